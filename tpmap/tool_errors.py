"""The errors of the tools floor: `tpmap draft` and `tpmap verify` (`--model` too)."""
from __future__ import annotations

from tpmap.language.errors import TpmapError

__all__ = [
    "DraftError",
    "MissingInputError",
    "WontFitError",
]


class DraftError(TpmapError):
    """`tpmap draft` cannot write a draft for a model type (unknown type, a config or model that does not
    build, no blocks to split); the message says which and why."""


class MissingInputError(TpmapError):
    """An example input for `tpmap verify` cannot be made: the model's main input is not declared in the
    verify config's ``inputs``, or a declared shape names something the config does not have."""


class WontFitError(TpmapError):
    """`tpmap verify --model`: the machine's available memory cannot hold the checkpoint for the comparison; the
    message gives the estimate and what is available."""
