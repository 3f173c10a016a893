"""Errors for user mistakes. Every one subclasses ValueError and says what to change.

`MappingError` carries a source position so that it prints as ``path:line:col: message``
(lines and columns are 1-based, as editors count them).
"""
from __future__ import annotations

import difflib
from dataclasses import dataclass

__all__ = [
    "AlreadyAppliedError",
    "CheckpointError",
    "ConfigAttributeError",
    "DivisibilityError",
    "DraftError",
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
    "PartialMappingWarning",
    "PatternMatchError",
    "Position",
    "ProcessGroupError",
    "QuantizedCheckpointError",
    "SequenceParallelError",
    "TpmapError",
    "TransformersVersionError",
    "UnknownModelTypeError",
    "UnsupportedConfigError",
    "did_you_mean",
]


@dataclass(frozen=True)
class Position:
    path: str
    line: int  # 1-based
    col: int  # 1-based

    def __str__(self) -> str:
        return f"{self.path}:{self.line}:{self.col}"


class TpmapError(ValueError):
    """Base class of every error tpmap raises for a user mistake.

    Errors about a line of a mapping file also carry `position` (where to fix it), `rule` (the
    `tpmap lint` rule id) and `message` (the text without the position); all three are None otherwise.
    Every such error is built one way: ``SomeError(message, position, rule)``, which prints as
    ``path:line:col: message``.
    """
    position: Position | None = None
    rule: str | None = None
    message: str | None = None

    def __init__(self, message: str = "", position: Position | None = None, rule: str | None = None):
        if position is not None:
            self.position, self.rule, self.message = position, rule, message
        super().__init__(f"{position}: {message}" if position is not None else message)


class MappingError(TpmapError):
    """A mapping file is wrong. `position` points at the YAML node to fix."""

    def __init__(self, message: str, position: Position | None = None, rule: str = "schema"):
        super().__init__(message, position, rule)
        self.message, self.rule = message, rule


class MappingErrors(TpmapError):
    """Several mapping errors found in one pass (all are reported, sorted by position)."""

    def __init__(self, errors: list[MappingError]):
        assert errors, "MappingErrors needs at least one error"
        self.errors = errors
        super().__init__("\n".join(str(e) for e in errors))


class UnknownModelTypeError(TpmapError):
    """No mapping ships for this `config.model_type`."""


class PatternMatchError(TpmapError):
    """A module pattern matches nothing, or two entries claim the same parameter."""


class ModuleKindError(TpmapError):
    """An entry targets a module it cannot shard (wrong class, `reverse` on nn.Linear, ...)."""


class ConfigAttributeError(TpmapError):
    """A mapping names a config attribute the model's config does not have."""


class DivisibilityError(TpmapError):
    """A size (heads, features, vocabulary) cannot be split over the world size."""


class ProcessGroupError(TpmapError):
    """No process group, or a process group whose size is not the world size."""


class InputMismatchError(TpmapError):
    """The ranks of a tensor-parallel model were given different inputs."""


class LossParallelError(TpmapError):
    """loss_parallel was asked for where it cannot be computed correctly."""


class UnsupportedConfigError(TpmapError):
    """The model's config is a variant its mapping declares `unsupported`."""


class MetaDeviceError(TpmapError):
    """`tpmap.apply` was given a model whose parameters are on the meta device (no values to slice)."""


class MissingInputError(TpmapError):
    """An example input for `tpmap verify` cannot be made: the model's main input is not declared in the
    verify config's ``inputs``, or a declared shape names something the config does not have."""


class DraftError(TpmapError):
    """`tpmap draft` cannot write a draft for a model type (unknown type, a config or model that does not
    build, no blocks to split); the message says which and why."""


class AlreadyAppliedError(TpmapError):
    """`tpmap.apply` was called on a model that is already tensor-parallel."""


class CheckpointError(TpmapError):
    """A checkpoint folder or file is missing, truncated, in an unsupported format, or disagrees with its config."""


class SequenceParallelError(TpmapError):
    """`sequence_parallel=True` was asked of a model whose blocks cannot run on sequence-split tokens (MoE
    experts and routers, SSM mixers, convolutions), or a forward broke its assumptions (hidden states that
    are not batch first)."""


class TransformersVersionError(TpmapError):
    """The installed transformers is outside the range tpmap is tested on (tpmap.compat.TRANSFORMERS)."""


class QuantizedCheckpointError(CheckpointError):
    """A checkpoint stores its weights quantized (config.json has a quantization_config) in a way tpmap
    does not read: loading its tensors as plain ones would give wrong results, so it is refused."""


class LoadError(TpmapError):
    """Loading failed on another rank (every rank raises, so none is left waiting in a collective)."""


class ParallelizeError(TpmapError):
    """`tpmap.parallelize` was asked for workers it cannot start: a world size that is not a positive integer,
    a device it cannot place them on, more GPUs than the machine has."""


class InvalidCallError(TpmapError):
    """A call to a `tpmap.parallelize` handle that its workers refuse before running the model: token ids
    outside the vocabulary, or an output that would stay split across the workers (the cache, attention
    weights). Raised on every worker alike, so the handle stays usable."""


class HandleClosedError(TpmapError):
    """A `tpmap.parallelize` handle was used after `close()` (or closed twice), or after its workers were
    stopped by a failure; the message says which."""


class HandleBusyError(TpmapError):
    """A `tpmap.parallelize` handle was called from the thread whose streamed generate is still open; finish
    or close that stream first."""


def did_you_mean(word: str, choices) -> str:
    """' (did you mean X?)' for the closest choice, or '' when nothing is close."""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]}?)" if close else ""


class UnquantizedActivationsWarning(UserWarning):
    """A checkpoint quantizes each Linear's input on the fly (dynamic W8A8 / FP8 activations), and
    `tpmap.from_pretrained` computes with the dequantized weights on unquantized inputs: the logits differ from
    a load that quantizes the activations by that quantization's error (docs/quantization.md)."""


class PartialMappingWarning(UserWarning):
    """`tpmap.apply` kept blocks whole on every rank because the mapping declares them so (a `replicated`
    item with a reason): the model is tensor-parallel, but those blocks take full memory and compute."""
