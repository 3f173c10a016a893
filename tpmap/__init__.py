"""tpmap: tensor parallelism for Hugging Face transformers models from one YAML mapping per architecture.

    import tpmap
    model = tpmap.from_pretrained("path/to/model", device=...)   # each rank reads only its slices
    model = tpmap.apply(model, world_size)      # or: shard a model already in memory
    tpmap.save_pretrained(model, "out/")        # a standard checkpoint, written by rank 0
(under torchrun, after init_process_group), or from one plain process, which starts the workers:

    with tpmap.parallelize("path/to/model", 2) as model:
        tokens = model.generate(input_ids, max_new_tokens=32)
"""
# The public names are imported on first use (PEP 562): `import tpmap` and the `tpmap` command start without torch
# and transformers, which only the commands that build models need (`tpmap --help` and `--version` need neither).
from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING

__version__ = "0.1.0"

_WHERE = {  # public name -> the module that defines it
    **dict.fromkeys(("apply", "full_state_dict", "load_mapping", "plan", "read_mapping"), "tpmap.api"),
    **dict.fromkeys((
        "AlreadyAppliedError",
        "ExpertsPlacementError",
        "InputMismatchError",
        "LossParallelError",
        "MetaDeviceError",
        "PartialMappingWarning",
        "ProcessGroupError",
    ), "tpmap.api_errors"),
    **dict.fromkeys((
        "CheckpointError",
        "LoadError",
        "OtherRankError",
        "QuantizedCheckpointError",
    ), "tpmap.checkpoint.errors"),
    **dict.fromkeys(("from_pretrained",), "tpmap.checkpoint.load"),
    **dict.fromkeys(("save_pretrained",), "tpmap.checkpoint.save"),
    **dict.fromkeys(("ModuleKindError", "SequenceParallelError", "UnsupportedConfigError"), "tpmap.engine.errors"),
    **dict.fromkeys((
        "ConfigAttributeError",
        "DivisibilityError",
        "MappingError",
        "MappingErrors",
        "PatternMatchError",
        "TpmapError",
        "UnknownModelTypeError",
    ), "tpmap.language.errors"),
    **dict.fromkeys(("vocab_parallel_cross_entropy",), "tpmap.loss_parallel"),
    **dict.fromkeys((
        "HandleBusyError",
        "HandleClosedError",
        "InvalidCallError",
        "ParallelizeError",
    ), "tpmap.parallelize.errors"),
    **dict.fromkeys(("CallTiming", "Parallelized", "Startup", "parallelize"), "tpmap.parallelize.handle"),
    **dict.fromkeys(("RankFailure", "RemoteTraceback"), "tpmap.parallelize.rank_processes"),
    **dict.fromkeys(("MissingInputError",), "tpmap.tool_errors"),
    **dict.fromkeys(("TrainingCheckpointError",), "tpmap.training.errors"),
}


class _Package(types.ModuleType):
    def __setattr__(self, name: str, value) -> None:
        if name in _WHERE and isinstance(value, types.ModuleType):
            return  # the import system binding the subpackage tpmap.parallelize: the public function keeps the name
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


def __getattr__(name: str):
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'tpmap' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # once: later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_WHERE))


if TYPE_CHECKING:  # what static tools see
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
