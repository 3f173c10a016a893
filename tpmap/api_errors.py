"""The errors of the API floor (`tpmap.apply` and what it calls first): the call, the process group, the
installed transformers, the inputs of a sharded model's forward."""
from __future__ import annotations

import sys
import warnings
from pathlib import Path

from tpmap.language.errors import TpmapError

__all__ = [
    "AlreadyAppliedError",
    "ExpertsPlacementError",
    "InputMismatchError",
    "LossParallelError",
    "MetaDeviceError",
    "PartialMappingWarning",
    "ProcessGroupError",
    "TransformersVersionError",
]


class AlreadyAppliedError(TpmapError):
    """`tpmap.apply` was called on a model that is already tensor-parallel."""


class ProcessGroupError(TpmapError):
    """No process group, or a process group whose size is not the world size."""


class MetaDeviceError(TpmapError):
    """`tpmap.apply` was given a model whose parameters are on the meta device (no values to slice)."""


class InputMismatchError(TpmapError):
    """The ranks of a tensor-parallel model were given different inputs."""


class LossParallelError(TpmapError):
    """loss_parallel was asked for where it cannot be computed correctly."""


class TransformersVersionError(TpmapError):
    """The installed transformers is outside the range tpmap is tested on (tpmap.compat.TRANSFORMERS)."""


class ExpertsPlacementError(TpmapError):
    """``experts=`` names a placement of the MoE experts that the mapping does not give entries for."""


class PartialMappingWarning(UserWarning):
    """`tpmap.apply` kept blocks whole on every rank because the mapping declares them so (a `replicated`
    item with a reason): the model is tensor-parallel, but those blocks take full memory and compute."""


def warn(message: str, category: type[Warning] = UserWarning) -> None:
    """`warnings.warn` attributed to the first frame outside tpmap (its package and engine/): the user's line that
    called into it, however deep the call ran, instead of a line of tpmap's own."""
    ours = [str(Path(__file__).resolve().parent)]
    engine = sys.modules.get("tpmap.engine")
    if engine is not None and getattr(engine, "__file__", None):
        ours.append(str(Path(engine.__file__).resolve().parent))
    level, frame = 2, sys._getframe(1)
    while frame is not None and str(Path(frame.f_code.co_filename).resolve()).startswith(tuple(ours)):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)
