"""The engine's errors: a model the mapping cannot shard as it is (a module of the wrong kind, a config
variant the mapping declares unsupported, blocks that cannot run sequence-parallel)."""
from __future__ import annotations

from tpmap.language.errors import DivisibilityError, TpmapError

__all__ = [
    "ModuleKindError",
    "SequenceParallelError",
    "UnevenSplitError",
    "UnsupportedConfigError",
]


class ModuleKindError(TpmapError):
    """An entry targets a module it cannot shard (wrong class, `reverse` on nn.Linear, ...)."""


class UnevenSplitError(DivisibilityError):
    """A world size that splits some heads or features unevenly, on a path not proven uneven (sequence
    parallelism, LoRA, quantized tensors, torch.compile, Param / Norm / Input entries, gather_output), or with
    Update values not written per rank. The message names the path and the world sizes that split evenly."""


class UnsupportedConfigError(TpmapError):
    """The model's config is a variant its mapping declares `unsupported`."""


class SequenceParallelError(TpmapError):
    """`sequence_parallel=True` was asked of a model whose blocks cannot run on sequence-split tokens (MoE
    experts and routers, SSM mixers, convolutions), or a forward broke its assumptions (hidden states that
    are not batch first)."""
