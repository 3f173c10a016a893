"""The errors of checkpoint reading and writing (`tpmap.checkpoint`)."""
from __future__ import annotations

from tpmap.language.errors import TpmapError

__all__ = [
    "CheckpointError",
    "LoadError",
    "OtherRankError",
    "QuantizedCheckpointError",
    "UnquantizedActivationsWarning",
]


class CheckpointError(TpmapError):
    """A checkpoint folder or file is missing, truncated, in an unsupported format, or disagrees with its config."""


class QuantizedCheckpointError(CheckpointError):
    """A checkpoint stores its weights quantized (config.json has a quantization_config) in a way tpmap
    does not read: loading its tensors as plain ones would give wrong results, so it is refused."""


class OtherRankError(TpmapError):
    """Another rank failed (while loading or saving): every rank raises, so none is left waiting in a
    collective. The failing rank raises its own error, which names the cause."""


LoadError = OtherRankError  # its name until the checkpoint work used it for saving too; kept for `except LoadError`


class UnquantizedActivationsWarning(UserWarning):
    """A checkpoint quantizes each Linear's input on the fly (dynamic W8A8 / FP8 activations), and
    `tpmap.from_pretrained` computes with the dequantized weights on unquantized inputs: the logits differ from
    a load that quantizes the activations by that quantization's error (docs/quantization.md)."""
