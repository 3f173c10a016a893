"""Execute a plan on one rank: slice tensors, build parallel modules, then swap them in.

All new modules are built before the first swap, and building only reads the model, so an error in
building leaves the model as it was. Swapping and setting attributes cannot fail on user input (the
plan already checked it).

Also here, because they follow from the plan alone: gradient hooks for parameters whose gradient
is partial on each rank (replicated KV heads, `grad_allreduce` modules), and `full_tensor`, the
inverse of `take`, which gathers a sharded parameter back into the full tensor.
"""
from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn

from .layers import (
    ColumnParallelEmbedding,
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    VocabParallelLMHead,
)
from .plan import ModuleShard, ParamShard, Plan, _resolve_attr


def take(full: torch.Tensor, shard: ParamShard, rank: int) -> torch.Tensor:
    """This rank's slice of a full tensor, as a new contiguous tensor (zero-padded to local_size)."""
    if shard.dim is None:
        return full.detach().clone()
    parts = [full.narrow(shard.dim, s, n) for s, n in shard.pieces[rank]]
    if shard.local_size is not None:
        pad = shard.local_size - sum(n for _, n in shard.pieces[rank])
        if pad:
            shape = list(full.shape)
            shape[shard.dim] = pad
            parts.append(full.new_zeros(shape))
    return torch.cat(parts, dim=shard.dim).detach().contiguous() if len(parts) > 1 else parts[0].detach().clone()


def full_tensor(local: torch.Tensor, shard: ParamShard, group=None) -> torch.Tensor:
    """The full tensor from every rank's slice (a collective: call it on every rank)."""
    if shard.dim is None:
        return local.detach().clone()
    parts = [torch.empty_like(local) for _ in range(len(shard.pieces))]
    dist.all_gather(parts, local.detach().contiguous(), group=group)
    full = local.new_empty(shard.full_shape)
    for rank, part in enumerate(parts):
        offset = 0
        for start, n in shard.pieces[rank]:  # replicated heads are written by each holder, identically
            full.narrow(shard.dim, start, n).copy_(part.narrow(shard.dim, offset, n))
            offset += n
    return full


def gather_order(shard: ParamShard) -> torch.Tensor | None:
    """For Column gather_output: position in the rank-major all-gather of each full feature, or None if
    the all-gather is already in feature order."""
    concat = [i for r in range(len(shard.pieces)) for i in shard.indices(r)]
    if concat == list(range(len(concat))):
        return None
    where = {feature: pos for pos, feature in enumerate(concat)}
    return torch.tensor([where[f] for f in range(len(concat))], dtype=torch.long)


def _build(old: nn.Module, ms: ModuleShard, rank: int, group, param) -> nn.Module:
    weight = param(old.weight, ms.weight)
    bias = None if ms.bias is None else param(old.bias, ms.bias)
    if ms.style == "vocab_embedding":
        start, n = ms.weight.pieces[rank][0]
        # keeps the class's own forward (e.g. a scaled embedding) around the parallel lookup
        new = VocabParallelEmbedding.replacing(old, weight, vocab_start=start, vocab_end=start + n, group=group)
    elif ms.style == "vocab_head":
        start, n = ms.weight.pieces[rank][0]
        new = VocabParallelLMHead(weight, bias, vocab_start=start, vocab_end=start + n,
                                  vocab_size=ms.weight.full_shape[0], group=group)
    elif isinstance(old, nn.Embedding):
        new = ColumnParallelEmbedding(weight, old, group=group)
    elif ms.style == "column":
        order = gather_order(ms.weight) if ms.gather_output else None
        order = order.to(old.weight.device) if order is not None else None
        new = ColumnParallelLinear(weight, bias, reverse=ms.reverse, group=group,
                                   gather_order=order, gather_output=ms.gather_output)
    else:
        new = RowParallelLinear(weight, bias, reverse=ms.reverse, group=group)
    new.train(old.training)
    return new


def execute(model: nn.Module, plan: Plan, rank: int, group) -> None:
    new_params: dict[int, nn.Parameter] = {}  # id(full parameter) -> its shard: tied weights stay one tensor

    def param(full: nn.Parameter, shard: ParamShard) -> nn.Parameter:
        if id(full) not in new_params:
            new_params[id(full)] = nn.Parameter(take(full.data, shard, rank), requires_grad=full.requires_grad)
        return new_params[id(full)]

    new = {ms.name: _build(model.get_submodule(ms.name), ms, rank, group, param) for ms in plan.modules}
    aliases = [(n, model.get_parameter(n)) for p in plan.params.values() if p.aliases for n in (p.name, *p.aliases)]
    for name, module in new.items():
        model.set_submodule(name, module)
    for alias, old in aliases:  # other holders of a sharded tensor (e.g. a head's tied bias) see the shard
        owner, _, attr = alias.rpartition(".")
        module = model.get_submodule(owner)
        if getattr(module, attr) is old:
            setattr(module, attr, new_params[id(old)])
    _set_attributes(model, plan, rank)
    _register_grad_hooks(model, plan, group)


def _set_attributes(model: nn.Module, plan: Plan, rank: int) -> None:
    config_copies: dict[int, object] = {}  # one per-rank copy per original config object
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


def _register_grad_hooks(model: nn.Module, plan: Plan, group) -> None:
    """Gradients that are partial on each rank are summed in backward:

    * `grad_allreduce` parameters (replicated, but each rank saw only its shard of the activations);
    * pieces of replicated KV heads: each holder saw only its own query heads, so the holders' grads
      are summed (scattered into a full-size buffer, all-reduced, sliced back).
    """
    for name in plan.grad_allreduce:
        p = model.get_parameter(name)
        if p.requires_grad:
            p.register_hook(lambda g: _all_reduced(g, group))
    for shard in plan.params.values():
        if shard.replicated_heads:
            p = model.get_parameter(shard.name)
            if p.requires_grad:
                index = torch.tensor(shard.indices(dist.get_rank(group)), dtype=torch.long)
                p.register_hook(lambda g, s=shard, i=index: _sum_over_holders(g, s, i, group))


def _all_reduced(grad: torch.Tensor, group) -> torch.Tensor:
    grad = grad.contiguous().clone()
    dist.all_reduce(grad, group=group)
    return grad


def _sum_over_holders(grad: torch.Tensor, shard: ParamShard, index: torch.Tensor, group) -> torch.Tensor:
    full = grad.new_zeros(shard.full_shape)
    index = index.to(grad.device)  # the model may have moved to another device after apply
    full.index_copy_(shard.dim, index, grad)
    dist.all_reduce(full, group=group)
    return full.index_select(shard.dim, index)
