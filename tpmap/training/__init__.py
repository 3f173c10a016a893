"""Training checkpoints of tensor-parallel runs: stop, resume, change shape (``import tpmap.training``).

    tpmap.training.save(DIR, model, optimizer, scheduler, step=step, data_state={"batch": i}, dp_group=...)
    state = tpmap.training.load(DIR, model, optimizer, scheduler, dp_group=...)   # at any tp x dp the mapping serves
    tpmap.training.export(DIR, OUT)   # a standard transformers folder, from one process

The format, the resharding and the guarantees: docs/training.md#checkpoints-resume-and-resharding.
"""
from tpmap.training.errors import TrainingCheckpointError
from tpmap.training.export import export
from tpmap.training.load import TrainingState, check_resume, load
from tpmap.training.save import save

__all__ = ["TrainingCheckpointError", "TrainingState", "check_resume", "export", "load", "save"]
