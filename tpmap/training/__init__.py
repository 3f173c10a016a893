"""Training tensor-parallel runs (``import tpmap.training``): checkpoints (stop, resume, change shape), the gradient
norm.

    tpmap.training.save(DIR, model, optimizer, scheduler, step=step, data_state={"batch": i}, dp_group=...)
    state = tpmap.training.load(DIR, model, optimizer, scheduler, dp_group=...)   # at any tp x dp the mapping serves
    tpmap.training.export(DIR, OUT)   # a standard transformers folder, from one process
    tpmap.training.clip_grad_norm_(model, 1.0)   # torch's clip_grad_norm_ by the unsharded model's norm

The format, the resharding and the guarantees: docs/training.md#checkpoints-resume-and-resharding; the gradient
norm (`grad_norm`, `clip_grad_norm_`): docs/training.md#gradient-clipping.
"""
from tpmap.training.errors import TrainingCheckpointError
from tpmap.training.export import export
from tpmap.training.grad_norm import GradNormError, clip_grad_norm_, grad_norm
from tpmap.training.load import TrainingState, check_resume, load
from tpmap.training.save import save

__all__ = ["GradNormError", "TrainingCheckpointError", "TrainingState", "check_resume", "clip_grad_norm_", "export",
           "grad_norm", "load", "save"]
