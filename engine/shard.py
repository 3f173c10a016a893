"""Execute a plan on one rank: slice tensors, build parallel modules, then swap them in.

All new modules are built before the first swap, and building only reads the model, so an error in
building leaves the model as it was. Swapping and setting attributes cannot fail on user input (the
plan already checked it).
"""
from __future__ import annotations

import copy

import torch
from torch import nn

from .layers import ColumnParallelEmbedding, ColumnParallelLinear, RowParallelLinear
from .plan import ModuleShard, ParamShard, Plan, _resolve_attr


def take(full: torch.Tensor, shard: ParamShard, rank: int) -> torch.Tensor:
    """This rank's slice of a full tensor, as a new contiguous tensor."""
    if shard.dim is None:
        return full.detach().clone()
    parts = [full.narrow(shard.dim, s, n) for s, n in shard.pieces[rank]]
    return torch.cat(parts, dim=shard.dim).contiguous() if len(parts) > 1 else parts[0].detach().clone().contiguous()


def gather_order(shard: ParamShard) -> torch.Tensor | None:
    """For Column gather_output: position in the rank-major all-gather of each full feature, or None if
    the all-gather is already in feature order."""
    concat = [i for r in range(len(shard.pieces)) for i in shard.indices(r)]
    if concat == list(range(len(concat))):
        return None
    where = {feature: pos for pos, feature in enumerate(concat)}
    return torch.tensor([where[f] for f in range(len(concat))], dtype=torch.long)


def _param(full: nn.Parameter, shard: ParamShard, rank: int) -> nn.Parameter:
    return nn.Parameter(take(full.data, shard, rank), requires_grad=full.requires_grad)


def _build(old: nn.Module, ms: ModuleShard, rank: int, group) -> nn.Module:
    weight = _param(old.weight, ms.weight, rank)
    bias = None if ms.bias is None else _param(old.bias, ms.bias, rank)
    if isinstance(old, nn.Embedding):
        new = ColumnParallelEmbedding(weight, old, group=group)
    elif ms.style == "column":
        order = gather_order(ms.weight) if ms.gather_output else None
        new = ColumnParallelLinear(weight, bias, reverse=ms.reverse, group=group,
                                   gather_order=order, gather_output=ms.gather_output)
    else:
        new = RowParallelLinear(weight, bias, reverse=ms.reverse, group=group)
    new.train(old.training)
    new.tp_source_class = type(old).__name__
    return new


def execute(model: nn.Module, plan: Plan, rank: int, group) -> None:
    new = {ms.name: _build(model.get_submodule(ms.name), ms, rank, group) for ms in plan.modules}
    config_copies: dict[int, object] = {}  # one per-rank copy per original config object
    for name, module in new.items():
        model.set_submodule(name, module)
    for u in plan.updates:
        module = model.get_submodule(u.module)
        if u.via_config:  # give the owner of the config its own copy; the shared config keeps full sizes
            *owner_path, cfg_attr, _ = u.attribute.split(".")
            owner = module
            for part in owner_path:
                owner = getattr(owner, part)
            original = getattr(owner, cfg_attr)
            if id(original) not in config_copies:
                config_copies[id(original)] = copy.copy(original)
            setattr(owner, cfg_attr, config_copies[id(original)])
        owner, attr, _ = _resolve_attr(module, u.attribute)
        setattr(owner, attr, u.values[rank])
