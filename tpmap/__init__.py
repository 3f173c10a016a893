"""tpmap: tensor parallelism for Hugging Face transformers models from one YAML mapping per architecture.

    import tpmap
    model = tpmap.from_pretrained("path/to/model", device=...)   # each rank reads only its slices
    model = tpmap.apply(model, world_size)      # or: shard a model already in memory
    tpmap.save_pretrained(model, "out/")        # a standard checkpoint, written by rank 0
(under torchrun, after init_process_group), or from one plain process, which starts the workers:

    with tpmap.parallelize("path/to/model", 2) as model:
        tokens = model.generate(input_ids, max_new_tokens=32)
"""
from tpmap.api import apply, full_state_dict, load_mapping, plan
from tpmap.checkpoint.load import from_pretrained
from tpmap.checkpoint.save import save_pretrained
from tpmap.driver import CallTiming, Parallelized, Startup, parallelize
from tpmap.launch import RankFailure, RemoteTraceback
from tpmap.loss_parallel import vocab_parallel_cross_entropy
from tpmap.spec.errors import (
    AlreadyAppliedError,
    CheckpointError,
    ConfigAttributeError,
    DivisibilityError,
    HandleBusyError,
    HandleClosedError,
    InputMismatchError,
    InvalidCallError,
    LoadError,
    LossParallelError,
    MappingError,
    MappingErrors,
    MetaDeviceError,
    MissingInputError,
    ModuleKindError,
    ParallelizeError,
    PartialMappingWarning,
    PatternMatchError,
    ProcessGroupError,
    QuantizedCheckpointError,
    SequenceParallelError,
    TpmapError,
    UnknownModelTypeError,
    UnsupportedConfigError,
)

__version__ = "0.1.0"
__all__ = [
    "AlreadyAppliedError",
    "CallTiming",
    "CheckpointError",
    "ConfigAttributeError",
    "DivisibilityError",
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
    "UnknownModelTypeError",
    "UnsupportedConfigError",
    "apply",
    "from_pretrained",
    "full_state_dict",
    "load_mapping",
    "parallelize",
    "plan",
    "save_pretrained",
    "vocab_parallel_cross_entropy",
]
