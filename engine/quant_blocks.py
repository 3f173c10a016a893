"""Weights quantized in blocks: every shard boundary must fall on a block boundary.

A quantized tensor that records its quantization blocks as ``block_size`` (one length per dim: one scale, and
zero point, per block; torchao's quantized tensor subclasses do) is sliced with its scales by its own
indexing. Along a split dim, a block that spans the whole dim (per-channel scales: ``block_size`` (1, in)
for a Row's weight split along in) keeps one scale for every slice, so any cut is exact. A shorter block
(per-group scales, e.g. groups of 32 input features) must not straddle a boundary: each rank's pieces must
start and end on multiples of the block length. `misaligned` finds the tensors of a plan where they do not,
before anything is changed; tpmap.apply refuses them, listing the world sizes that work.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from tpmap.engine.plan import ParamLayout, Plan
from tpmap.language.errors import DivisibilityError


@dataclass(frozen=True)
class Misaligned:
    name: str  # the tensor's full name
    dim: int  # its split dim
    block: int  # the block length along it
    boundary: int  # the first shard boundary inside a block (a full-tensor index along dim)


def tensor_of(model: nn.Module, name: str):
    """The parameter or buffer `name` of `model` (None if absent)."""
    owner, _, attr = name.rpartition(".")
    return getattr(model.get_submodule(owner) if owner else model, attr, None)


def misaligned(model: nn.Module, plan: Plan) -> list[Misaligned]:
    """The split tensors of `plan` quantized in blocks that a shard boundary cuts (none for unquantized models)."""
    out = []
    for shard in plan.params.values():
        if shard.dim is None:
            continue
        tensor = tensor_of(model, shard.name)
        blocks = getattr(tensor, "block_size", None)
        if blocks is None or len(blocks) != len(shard.full_shape):
            continue
        boundary = cut_inside(shard, int(blocks[shard.dim]))
        if boundary is not None:
            out.append(Misaligned(shard.name, shard.dim, int(blocks[shard.dim]), boundary))
    return out


def cut_inside(shard: ParamLayout, block: int) -> int | None:
    """The first shard boundary of `shard` inside a block of `block` elements along its split dim, or None."""
    if shard.dim is None or block <= 1 or block >= shard.full_shape[shard.dim]:  # element-wise, or one block
        return None
    cuts = sorted({edge for pieces in shard.pieces for start, n in pieces for edge in (start, start + n)})
    return next((edge for edge in cuts if edge % block and edge != shard.full_shape[shard.dim]), None)


def refuse_cut_groups(groups: dict[str, int], plan: Plan, plan_at: Callable[[int], Plan | None], what: str,
                      remedy: str = "") -> None:
    """Weights quantized in groups of input features (their last dim; name -> group length) that a shard boundary
    of `plan` falls inside: DivisibilityError naming the first, with the world sizes (1-16) whose plans
    (`plan_at`, None where the mapping refuses the size) cut none. `what`: how the weight is quantized, with
    "{group}" for the group length ("would be quantized in groups of {group} input features")."""
    def cut(p: Plan) -> list[tuple[str, int, int]]:
        return [(n, g, b) for n, g in groups.items() if n in p.params and p.params[n].dim is not None
                and p.params[n].dim == len(p.params[n].full_shape) - 1
                and (b := cut_inside(p.params[n], g)) is not None]

    bad = cut(plan)
    if bad:
        name, group, boundary = bad[0]
        fine = [tp_size for tp_size in range(1, 17) if (p := plan_at(tp_size)) is not None and not cut(p)]
        raise DivisibilityError(
            f"{name} {what.format(group=group)}, and at world size {plan.tp_size} a shard boundary "
            f"falls at {boundary}, inside a group ({len(bad)} weight{'s' if len(bad) > 1 else ''} alike). World sizes "
            f"that work: {', '.join(map(str, fine))}{remedy}")
