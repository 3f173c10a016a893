"""tpmap: tensor parallelism for Hugging Face transformers models from one YAML mapping per architecture.

    import tpmap
    model = tpmap.from_pretrained("path/to/model", device=...)   # each rank reads only its slices
    model = tpmap.apply(model, world_size)      # or: shard a model already in memory
    tpmap.save_pretrained(model, "out/")        # a standard checkpoint, written by rank 0
(under torchrun, after init_process_group)
"""
from .api import apply, full_state_dict, load_mapping, plan, vocab_parallel_cross_entropy
from .errors import (
    AlreadyAppliedError,
    CheckpointError,
    ConfigAttributeError,
    DivisibilityError,
    InputMismatchError,
    LoadError,
    LossParallelError,
    MappingError,
    MappingErrors,
    MetaDeviceError,
    MissingInputError,
    PartialMappingWarning,
    ModuleKindError,
    PatternMatchError,
    ProcessGroupError,
    SequenceParallelError,
    TpmapError,
    UnknownModelTypeError,
    UnsupportedConfigError,
)

from .loading import from_pretrained
from .saving import save_pretrained

__version__ = "0.1.0"
__all__ = [
    "apply", "plan", "load_mapping", "full_state_dict", "vocab_parallel_cross_entropy", "InputMismatchError",
    "LossParallelError", "TpmapError", "MappingError", "MappingErrors", "UnknownModelTypeError",
    "PatternMatchError", "ModuleKindError", "ConfigAttributeError", "DivisibilityError", "ProcessGroupError",
    "AlreadyAppliedError", "MetaDeviceError", "MissingInputError", "UnsupportedConfigError",
    "from_pretrained", "save_pretrained", "CheckpointError", "LoadError", "PartialMappingWarning",
    "SequenceParallelError",
]
