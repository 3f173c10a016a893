"""tpmap: tensor parallelism for Hugging Face transformers models from one YAML mapping per architecture.

    import tpmap
    model = tpmap.from_pretrained("path/to/model", device=...)   # each rank reads only its slices
    model = tpmap.apply(model, world_size)      # or: shard a model already in memory
    tpmap.save_pretrained(model, "out/")        # a standard checkpoint, written by rank 0
(under torchrun, after init_process_group), or from one plain process, which starts the workers:

    with tpmap.parallelize("path/to/model", 2) as model:
        tokens = model.generate(input_ids, max_new_tokens=32)
"""
from tpmap.api import apply, full_state_dict, load_mapping, plan, read_mapping
from tpmap.api_errors import (
    AlreadyAppliedError,
    ExpertsPlacementError,
    InputMismatchError,
    LossParallelError,
    MetaDeviceError,
    PartialMappingWarning,
    ProcessGroupError,
)
from tpmap.checkpoint.errors import CheckpointError, LoadError, OtherRankError, QuantizedCheckpointError
from tpmap.checkpoint.load import from_pretrained
from tpmap.checkpoint.save import save_pretrained
from tpmap.engine.errors import ModuleKindError, SequenceParallelError, UnsupportedConfigError
from tpmap.language.errors import (
    ConfigAttributeError,
    DivisibilityError,
    MappingError,
    MappingErrors,
    PatternMatchError,
    TpmapError,
    UnknownModelTypeError,
)
from tpmap.loss_parallel import vocab_parallel_cross_entropy
from tpmap.parallelize.errors import HandleBusyError, HandleClosedError, InvalidCallError, ParallelizeError
from tpmap.parallelize.handle import CallTiming, Parallelized, Startup, parallelize
from tpmap.parallelize.rank_processes import RankFailure, RemoteTraceback
from tpmap.tool_errors import MissingInputError
from tpmap.training.errors import TrainingCheckpointError

__version__ = "0.1.0"
__all__ = [
    "AlreadyAppliedError",
    "CallTiming",
    "CheckpointError",
    "ConfigAttributeError",
    "DivisibilityError",
    "ExpertsPlacementError",
    "HandleBusyError",
    "HandleClosedError",
    "InputMismatchError",
    "InvalidCallError",
    "LoadError",
    "LossParallelError",
    "MappingError",
    "MappingErrors",
    "MetaDeviceError",
    "MissingInputError",
    "ModuleKindError",
    "OtherRankError",
    "ParallelizeError",
    "Parallelized",
    "PartialMappingWarning",
    "PatternMatchError",
    "ProcessGroupError",
    "QuantizedCheckpointError",
    "RankFailure",
    "RemoteTraceback",
    "SequenceParallelError",
    "Startup",
    "TpmapError",
    "TrainingCheckpointError",
    "UnknownModelTypeError",
    "UnsupportedConfigError",
    "apply",
    "from_pretrained",
    "full_state_dict",
    "load_mapping",
    "parallelize",
    "plan",
    "read_mapping",
    "save_pretrained",
    "vocab_parallel_cross_entropy",
]
