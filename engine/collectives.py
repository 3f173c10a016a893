"""Autograd collectives for tensor parallelism, in Megatron's named pairs. All of them are no-ops
for a group of size 1. Shapes: the split is always along the last dim (features).

    copy_to_tp_region      forward: identity          backward: all-reduce (sum)
    reduce_from_tp_region  forward: all-reduce (sum)  backward: identity
    gather_from_tp_region  forward: all-gather        backward: keep this rank's slice of the grad
    sum_over_tp_region     forward: all-reduce (sum)  backward: all-reduce (sum)

The last is for a statistic summed over split features (a Norm's sum of squares) that every rank
then uses for its own features only: each rank's loss depends on the total through its own slice, so
the total's gradient is the sum of every rank's, and each rank's term receives all of it.

Sequence parallelism (Megatron-SP, `engine.sequence`) splits tokens instead, along a given `dim`
(rank r holds chunk r of ws equal chunks):

    split_to_sequence_region           forward: keep this rank's chunk   backward: all-gather
    gather_from_sequence_region        forward: all-gather               backward: reduce-scatter (sum,
                                                                          keep this rank's chunk), or
                                                                          with reduce_grad=False keep it
    reduce_scatter_to_sequence_region  forward: reduce-scatter           backward: all-gather
"""
from __future__ import annotations

import contextlib
from collections import Counter

import torch
import torch.distributed as dist


def _world(group) -> int:
    return dist.get_world_size(group) if group is not None or dist.is_initialized() else 1


def _all_reduce_(t: torch.Tensor, group) -> torch.Tensor:
    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce_(grad.contiguous().clone(), ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce_(x.contiguous().clone(), group)  # a copy: never write into autograd's inputs

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, rank, order):
        # x: (..., F/ws) -> (..., F); `order` puts the rank-major concatenation back into feature order
        ctx.group, ctx.rank, ctx.order, ctx.local = group, rank, order, x.shape[-1]
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        y = torch.cat(parts, dim=-1)  # (..., ws * F/ws), rank-major
        return y if order is None else y.index_select(-1, order)

    @staticmethod
    def backward(ctx, grad):
        if ctx.order is not None:  # back to rank-major: position order[j] of the cat holds feature j
            inverse = torch.empty_like(ctx.order)
            inverse[ctx.order] = torch.arange(ctx.order.numel(), device=ctx.order.device)
            grad = grad.index_select(-1, inverse)
        start = ctx.rank * ctx.local
        return grad[..., start : start + ctx.local].contiguous(), None, None, None


class _SumOverTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_reduce_(x.contiguous().clone(), group)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce_(grad.contiguous().clone(), ctx.group), None


def _all_gather_along(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    """(.., n, ..) at `dim` -> (.., ws * n, ..), rank-major."""
    first = x.movedim(dim, 0).contiguous()  # (n, ...): each rank's chunk one block of memory
    out = first.new_empty((dist.get_world_size(group) * first.shape[0], *first.shape[1:]))
    dist.all_gather_into_tensor(out, first, group=group)
    return out.movedim(0, dim).contiguous()


def _reduce_scatter_along(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    """(.., ws * n, ..) at `dim`, summed over ranks -> this rank's chunk (.., n, ..)."""
    first = x.movedim(dim, 0).contiguous()
    out = first.new_empty((first.shape[0] // dist.get_world_size(group), *first.shape[1:]))
    dist.reduce_scatter_tensor(out, first, group=group)
    return out.movedim(0, dim).contiguous()


def _chunk_along(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    """(.., ws * n, ..) at `dim` -> this rank's chunk (.., n, ..), no communication."""
    n = x.shape[dim] // dist.get_world_size(group)
    return x.narrow(dim, dist.get_rank(group) * n, n).contiguous()


class _SplitToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _chunk_along(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_along(grad, ctx.group, ctx.dim), None, None


class _GatherFromSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim, reduce_grad):
        ctx.group, ctx.dim, ctx.reduce_grad = group, dim, reduce_grad
        return _all_gather_along(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        # reduce_grad: what follows is tensor-parallel (each rank's grad is a partial sum over its
        # features); else what follows is replicated and every rank already holds the whole grad
        pick = _reduce_scatter_along if ctx.reduce_grad else _chunk_along
        return pick(grad, ctx.group, ctx.dim), None, None, None


class _ReduceScatterToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _reduce_scatter_along(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_along(grad, ctx.group, ctx.dim), None, None


def split_to_sequence_region(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    """Enter the sequence-parallel region: keep this rank's chunk of `dim` (all-gather backward)."""
    return x if _world(group) == 1 else _SplitToSeq.apply(x, group, dim)


def gather_from_sequence_region(x: torch.Tensor, group, dim: int, reduce_grad: bool = True) -> torch.Tensor:
    """All-gather the chunks of `dim`. Backward: reduce-scatter into a tensor-parallel region (a Column
    follows), or with ``reduce_grad=False`` keep this rank's chunk (replicated computation follows)."""
    return x if _world(group) == 1 else _GatherFromSeq.apply(x, group, dim, reduce_grad)


def reduce_scatter_to_sequence_region(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    """Leave a tensor-parallel region into the sequence-parallel one: sum over ranks and keep this rank's
    chunk of `dim` (a Row's partial products; all-gather backward). Same bytes as an all-reduce."""
    return x if _world(group) == 1 else _ReduceScatterToSeq.apply(x, group, dim)


def copy_to_tp_region(x: torch.Tensor, group=None) -> torch.Tensor:
    """Enter a tensor-parallel region: identity forward, all-reduce of the gradient backward.

    Several Columns reading the same tensor (q, k and v; gate and up) share one copy, so their input
    gradients are summed first and all-reduced once, as with Megatron's fused QKV layer (the sum of
    all-reduces is the all-reduce of the sum). Without autograd there is nothing to do.
    """
    if _world(group) == 1 or not (x.requires_grad and torch.is_grad_enabled()):
        return x
    shared = getattr(x, "_tpmap_copy", None)
    if shared is not None and shared[0] is group:
        return shared[1]
    y = _CopyToTP.apply(x, group)
    if x.grad_fn is not None:  # an activation of this forward; a user's leaf may outlive its graph
        x._tpmap_copy = (group, y)
    return y


def reduce_from_tp_region(x: torch.Tensor, group=None) -> torch.Tensor:
    """Leave a tensor-parallel region by summing partial results: all-reduce forward, identity backward."""
    return x if _world(group) == 1 else _ReduceFromTP.apply(x, group)


def gather_from_tp_region(x: torch.Tensor, group=None, order: torch.Tensor | None = None) -> torch.Tensor:
    """All-gather the last dim; `order` (optional) maps the rank-major concatenation to feature order."""
    if _world(group) == 1:
        return x
    return _GatherFromTP.apply(x, group, dist.get_rank(group), order)


def sum_over_tp_region(x: torch.Tensor, group=None) -> torch.Tensor:
    """Sum a partial statistic over the ranks whose results stay rank-local: all-reduce both ways."""
    return x if _world(group) == 1 else _SumOverTP.apply(x, group)


_COUNTED = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast")


class CollectiveCounts(Counter):
    """Calls per collective name; ``.bytes`` holds, per name, the bytes this rank sent in (the input
    tensor's size: for an all-gather, this rank's part)."""

    def __init__(self):
        super().__init__()
        self.bytes: Counter = Counter()


def _payload(args, kwargs) -> int:
    tensor = kwargs.get("tensor", kwargs.get("input_tensor"))
    if tensor is None:  # all_reduce(tensor), all_gather(list, tensor), all_gather_into_tensor(out, tensor)
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        tensor = tensors[-1] if tensors else None
    return tensor.numel() * tensor.element_size() if tensor is not None else 0


@contextlib.contextmanager
def counting_collectives():
    """Count the torch.distributed collectives issued inside the block (by name), e.g. per forward:
    ``with counting_collectives() as counts: model(**inputs)`` -> ``{"all_reduce": 5, "all_gather": 2}``,
    with ``counts.bytes`` the bytes per name. Counts the real calls on their way through; for reports
    and tests, not for production loops."""
    counts = CollectiveCounts()
    originals = {name: getattr(dist, name) for name in _COUNTED}

    def counted(name, fn):
        def call(*args, **kwargs):
            counts[name] += 1
            counts.bytes[name] += _payload(args, kwargs)
            return fn(*args, **kwargs)
        return call

    for name, fn in originals.items():
        setattr(dist, name, counted(name, fn))
    try:
        yield counts
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
