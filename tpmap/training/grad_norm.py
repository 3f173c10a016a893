"""The unsharded model's gradient norm from a tensor-parallel model's shards, and clipping by it.

    loss.backward()
    total = tpmap.training.clip_grad_norm_(model, 1.0)  # not torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()

`torch.nn.utils.clip_grad_norm_` on a tpmap model computes each rank's norm from the tensors it holds: a split
weight's slice, and every replicated weight once per rank. The ranks so get different norms (measured on a tiny
Llama at tp 2: 7.35 and 7.17 against the unsharded model's 10.17), clip by different factors, and the replicated
weights, which must stay equal on every rank, drift apart.

Here each element of every rank's local gradient g_r counts with the weight w_r(i) = 1 / (the number of ranks
holding its full index), so that summed over the ranks every element of the unsharded gradient g counts once:

    ||g||_p^p = sum_r sum_i w_r(i) |g_r(i)|^p        (one all-reduce SUM over the tensor-parallel group)
    ||g||_inf = max_r max_{i: w_r(i) > 0} |g_r(i)|   (one all-reduce MAX)

* a whole tensor (norms, routers, LoRA's whole A or B, the same on every rank): w = 1 / tp;
* a split tensor: w = 1 along its pieces, 1 / k on a range k ranks hold (replicated KV heads), 0 on the padding
  rows of a vocabulary the tp size does not divide (no element of the unsharded model);
* a ``partial`` tensor (a term of a partial sum: rank 0 holds it, the others zeros): 1 on rank 0, 0 elsewhere;
* the items of a ModuleList cut between the ranks (a Param entry on ``modules``): 1 / (ranks holding the item);
* LoRA adapters (`tpmap.peft`) as their layer spreads them (`adapter_shard`: B's rows of a Column, A's columns
  of a Row) or whole, and a ``modules_to_save`` copy of a split module like the module.

The weights are computed once per model (cached, weakly keyed on the object given: the tpmap model, its DDP
wrapper or its PEFT model) and again only when its parameters change (an adapter added). Under DDP the gradients
after backward are the replicas' average, the same on every replica, so the tensor-parallel group is enough.
A model `tpmap.apply` returned whole (tp 1) gets torch's own norm of its gradients.
"""
from __future__ import annotations

import math
import weakref
from collections import Counter

import torch
import torch.distributed as dist
from torch import nn

from tpmap.api import group_of
from tpmap.engine.plan import ParamLayout
from tpmap.execute import PLAN_ATTR
from tpmap.language.errors import TpmapError
from tpmap.training.layout import base_model

__all__ = ["GradNormError", "clip_grad_norm_", "grad_norm"]

Weight = float | tuple[int, torch.Tensor]  # one weight for every element, or (dim, weights along dim)


class GradNormError(TpmapError):
    """A norm type, group or model that the unsharded gradient norm cannot be computed for."""


def grad_norm(model: nn.Module, norm_type: float = 2.0, *, group=None) -> torch.Tensor:
    """The `norm_type`-norm of the unsharded model's gradient (every parameter's ``.grad`` viewed as one vector),
    the same on every rank of the tensor-parallel `group` (default: the group the model was sharded over; a
    ProcessGroup or a 1-D DeviceMesh). A collective over that group: call it on every rank. fp32, or fp64 where a
    gradient is fp64; 0 without gradients, as torch's."""
    p = _norm_type(norm_type)
    inner = _unwrap(model)
    plan = getattr(base_model(inner), PLAN_ATTR, None)
    params, weights = _cached_weights(model, inner, plan, group)
    grads = [(param.grad, w) for param, w in zip(params, weights) if param.grad is not None]
    dtype = torch.float64 if any(g.dtype == torch.float64 for g, _ in grads) else torch.float32
    device = grads[0][0].device if grads else next(iter(params), torch.zeros(())).device
    if p == math.inf:
        local = [_weighted_max(g, w, dtype).to(device) for g, w in grads]
        nan = any(t.isnan() for t in local)  # (a NaN is no MAX operand every backend keeps: sent as a flag)
        total = torch.stack([torch.stack(local).max() if local else torch.zeros((), dtype=dtype, device=device),
                             torch.tensor(float(nan), dtype=dtype, device=device)])
        if plan is not None:
            dist.all_reduce(total, op=dist.ReduceOp.MAX, group=_group(inner, plan, group))
        return torch.where(total[1] > 0, torch.full_like(total[0], math.nan), total[0])
    local = [_weighted_power_sum(g, w, p, dtype).to(device) for g, w in grads]
    total = torch.stack(local).sum() if local else torch.zeros((), dtype=dtype, device=device)
    if plan is not None:
        dist.all_reduce(total, group=_group(inner, plan, group))
    return total.sqrt() if p == 2 else total.pow(1.0 / p)


@torch.no_grad()
def clip_grad_norm_(model: nn.Module, max_norm: float, norm_type: float = 2.0, *, group=None,
                    error_if_nonfinite: bool = False, foreach: bool | None = None) -> torch.Tensor:
    """`torch.nn.utils.clip_grad_norm_` for a tpmap model (alone, inside DDP or inside a `tpmap.peft` model):
    scales every gradient by min(1, max_norm / (total + 1e-6)), total = `grad_norm(model, norm_type)` -- the same
    factor on every rank -- and returns total. A collective over the tensor-parallel group."""
    total = grad_norm(model, norm_type, group=group)
    if error_if_nonfinite and not torch.isfinite(total):  # every rank alike: total is all-reduced
        raise RuntimeError(f"The total norm of order {float(norm_type)} for gradients from `parameters` is "
                           "non-finite, so it cannot be clipped. To disable this error and scale the gradients by "
                           "the non-finite norm anyway, set `error_if_nonfinite=False`")
    torch.nn.utils.clip_grads_with_norm_(list(_unwrap(model).parameters()), max_norm, total, foreach=foreach)
    return total


def _norm_type(norm_type: float) -> float:
    p = float(norm_type)
    if not (p == math.inf or (math.isfinite(p) and p > 0)):
        raise GradNormError(f"norm_type={norm_type!r}: the unsharded gradient norm is computed for p-norms with "
                            "p > 0 (2.0 by default) and for float('inf'); 0, negative and -inf norms are not "
                            "supported")
    return p


def _unwrap(model: nn.Module) -> nn.Module:
    """The model inside DDP; parameters that are DTensors (FSDP2) are refused."""
    from torch.distributed.tensor import DTensor

    inner = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    if any(isinstance(p, DTensor) for p in inner.parameters()):
        raise GradNormError("tpmap.training.grad_norm takes a tpmap model alone or inside DDP or PEFT; this model's "
                            "parameters are DTensors (FSDP2's fully_shard): wrap the replicas with "
                            "DistributedDataParallel")
    return inner


def _group(inner: nn.Module, plan, group):
    """The tensor-parallel group (`group`, else the one the model was sharded over), checked against the plan."""
    group = group_of(base_model(inner), group)
    size = dist.get_world_size(group)
    if size != plan.tp_size:
        raise GradNormError(f"group= has {size} ranks but the model is sharded over {plan.tp_size}: pass the "
                            "tensor-parallel group (mesh['tp']), or leave group out to use the one given to apply")
    return group


_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> (parameters, weights, rank)


def _cached_weights(model: nn.Module, inner: nn.Module, plan, group) -> tuple[list[nn.Parameter], list[Weight]]:
    """Every parameter of the model and its elements' weights, from the cache while the parameters are those
    it was computed for (the same objects in the same order) at the same rank."""
    params = list(inner.parameters())
    rank = dist.get_rank(_group(inner, plan, group)) if plan is not None else 0
    cached = _CACHE.get(model)
    if cached is not None and cached[2] == rank and len(cached[0]) == len(params) and all(
            a is b for a, b in zip(cached[0], params)):
        return cached[0], cached[1]
    by_id = _weights_by_tensor(inner, plan, rank) if plan is not None else {}
    weights = [by_id.get(id(p), 1.0 / plan.tp_size if plan is not None else 1.0) for p in params]
    _CACHE[model] = (params, weights, rank)
    return params, weights


def _weights_by_tensor(model: nn.Module, plan, rank: int) -> dict[int, Weight]:
    """id(parameter) -> its weight, for every parameter not whole on every rank (see the module docstring)."""
    base = base_model(model)
    out: dict[int, Weight] = {}
    for layout in plan.tensors:
        if layout.holder == "modules":  # a ModuleList cut by Param: rank r holds items indices(r), whole
            count = Counter(i for r in range(plan.tp_size) for i in set(layout.indices(r)))  # holders, not uses
            for index, item in _owner(base, layout.name).named_children():  # (under their original indices)
                for p in item.parameters():
                    out[id(p)] = 1.0 / count[int(index)]
    for layout in plan.params.values():
        tensor = _tensor(base, layout.name)
        out[id(tensor)] = _split_weight(layout, tensor, rank, plan.tp_size)
    for module in model.modules():
        if hasattr(module, "adapter_shard"):  # tpmap.peft's LoRA layers
            for adapter in module.lora_A:
                for which, holder in (("A", module.lora_A), ("B", module.lora_B)):
                    split = module.adapter_shard(which, adapter)
                    if split is not None:
                        weight = holder[adapter].weight
                        out[id(weight)] = _split_weight(split, weight, rank, plan.tp_size)
        elif hasattr(module, "original_module") and hasattr(module, "modules_to_save"):  # PEFT's trained copy
            originals = dict(module.original_module.named_parameters())
            for copy in module.modules_to_save.values():
                for name, p in copy.named_parameters():
                    if id(originals.get(name)) in out:
                        out[id(p)] = out[id(originals[name])]
    return out


def _owner(base: nn.Module, name: str) -> nn.Module:
    """The module holding `name` (a dotted path), through PEFT's wrappers (LoRA layers, modules_to_save)."""
    owner = base.get_submodule(name)
    while True:
        if hasattr(owner, "get_base_layer") and owner.get_base_layer() is not owner:
            owner = owner.get_base_layer()
        elif hasattr(owner, "original_module") and hasattr(owner, "modules_to_save"):
            owner = owner.original_module
        else:
            return owner


def _tensor(base: nn.Module, name: str) -> torch.Tensor:
    owner_name, _, attr = name.rpartition(".")
    owner = _owner(base, owner_name) if owner_name else base
    tensor = owner._parameters.get(attr, owner._buffers.get(attr))
    assert tensor is not None, f"{name}: the plan names a tensor the model lacks"
    return tensor


def _split_weight(layout: ParamLayout, tensor: torch.Tensor, rank: int, tp_size: int) -> Weight:
    if layout.partial:
        return 1.0 if rank == 0 else 0.0  # rank 0 holds the term, the others zeros
    if layout.dim is None:
        return 1.0 / tp_size
    count = Counter(i for r in range(tp_size) for i in layout.indices(r))  # full index -> ranks holding it
    along = torch.zeros(tensor.shape[layout.dim], dtype=torch.float64)  # padding past the pieces: 0
    own = [1.0 / count[i] for i in layout.indices(rank)]
    along[: len(own)] = torch.tensor(own, dtype=torch.float64)
    return layout.dim, along


def _weighted_power_sum(grad: torch.Tensor, weight: Weight, p: float, dtype: torch.dtype) -> torch.Tensor:
    """sum_i w(i) |grad(i)|^p, in `dtype`."""
    g = grad.detach().to(dtype)
    power = g.square() if p == 2 else g.abs().pow(p)
    if not isinstance(weight, tuple):
        return power.sum() * weight
    dim, along = weight
    per_index = power.movedim(dim, 0).reshape(power.shape[dim], -1).sum(1)  # (local length along dim,)
    return (per_index * along.to(per_index.device, dtype)).sum()


def _weighted_max(grad: torch.Tensor, weight: Weight, dtype: torch.dtype) -> torch.Tensor:
    """max |grad(i)| over the elements with w(i) > 0 (0 when none), in `dtype`."""
    g = grad.detach().to(dtype).abs()
    zero = torch.zeros((), dtype=dtype, device=g.device)
    if not isinstance(weight, tuple):
        return g.amax() if weight > 0 and g.numel() else zero
    dim, along = weight
    per_index = g.movedim(dim, 0).reshape(g.shape[dim], -1)  # (local length along dim, rest)
    kept = per_index[along.to(g.device) > 0]
    return kept.amax() if kept.numel() else zero
