"""Autograd collectives for tensor parallelism, in Megatron's named pairs. All of them are no-ops
for a group of size 1. Shapes: the split is always along the last dim (features).

    copy_to_tp_region      forward: identity          backward: all-reduce (sum)
    reduce_from_tp_region  forward: all-reduce (sum)  backward: identity
    gather_from_tp_region  forward: all-gather        backward: keep this rank's slice of the grad
    sum_over_tp_region     forward: all-reduce (sum)  backward: all-reduce (sum)
    sum_items_over_holders forward: identity          backward: all-reduce of a ModuleList's items' grads

The last is for a statistic summed over split features (a Norm's sum of squares) that every rank
then uses for its own features only: each rank's loss depends on the total through its own slice, so
the total's gradient is the sum of every rank's, and each rank's term receives all of it.

Two implementations of the same collectives: eagerly, `torch.distributed`'s in-place calls (on a copy
where autograd may still read the tensor; in place on a fresh result without autograd); under
`torch.compile`, torch's functional collectives (out of place, traced by dynamo into the graph, no
graph break). Eager gloo runs the functional ones ~10-40% slower per call (their async wrapper), so
they are used only while compiling.

Sequence parallelism (Megatron-SP, `engine.sequence`) splits tokens instead, along a given `dim`
(rank r holds chunk r of tp_size equal chunks):

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
import torch.distributed._functional_collectives as funcol

from tpmap.engine import shm as shm_path
from tpmap.engine import symm_mem


def _tp_size(group) -> int:
    return dist.get_world_size(group) if group is not None or dist.is_initialized() else 1


def _shm(t: torch.Tensor, group) -> shm_path.ShmGroup | None:
    """The shared-memory path for this call (engine.shm), or None for torch.distributed. Decided per group
    at its first collective (a collective itself), then a dict lookup."""
    return shm_path.for_group(group) if t.device.type == "cpu" else None


@torch._dynamo.assume_constant_result
def _shm_handle(group) -> int:
    """Under torch.compile: the group's shared-memory handle if it was chosen eagerly (tpmap.apply decides),
    else -1; a constant of the traced graph."""
    shm = shm_path.chosen(group)
    return shm.handle if shm is not None else -1


def _compiled_handle(t: torch.Tensor, group) -> int:
    """While compiling: the handle of the shared-memory custom ops for a CPU tensor, else -1 (functional ops)."""
    return _shm_handle(group) if torch.compiler.is_compiling() and t.device.type == "cpu" else -1


def _all_reduce(t: torch.Tensor, group, fresh: bool = False) -> torch.Tensor:
    """The sum over the group, a new tensor unless `fresh` (t is a temporary nobody else reads: summed in place)."""
    if torch.compiler.is_compiling():
        if (handle := _compiled_handle(t, group)) >= 0:
            return torch.ops.tpmap.shm_all_reduce(t, handle)
        return funcol.all_reduce(t, "sum", group if group is not None else dist.group.WORLD)
    return all_reduce_(t.contiguous() if fresh else t.contiguous().clone(), group)


def _all_gather(x: torch.Tensor, group) -> torch.Tensor:
    """(..., F/tp_size) -> (..., tp_size * F/tp_size), rank-major along the last dim."""
    tp_size = dist.get_world_size(group)
    if torch.compiler.is_compiling():
        if (handle := _compiled_handle(x, group)) >= 0:
            stacked = torch.ops.tpmap.shm_all_gather(x, handle, tp_size)
        else:
            stacked = funcol.all_gather_tensor(x.contiguous(), 0, group if group is not None else dist.group.WORLD)
        return torch.cat(stacked.chunk(tp_size, dim=0), dim=-1)  # (tp_size * B, ..., F/tp_size) -> (B, ..., F)
    x = x.contiguous()
    shm = _shm(x, group)
    if shm is not None:  # each rank's slice straight into place
        return shm_path.all_gather(x.new_empty((*x.shape[:-1], tp_size * x.shape[-1])), x, shm)
    parts = [torch.empty_like(x) for _ in range(tp_size)]
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts, dim=-1)


def all_gather_stacked(x: torch.Tensor, group) -> torch.Tensor:
    """Every rank's x, stacked: (group_size, *x.shape), eagerly (shared memory on one host's CPU ranks, else gloo)."""
    x = x.contiguous()
    group_size = dist.get_world_size(group)
    shm = _shm(x, group)
    if shm is not None:  # (1, numel) gathered along the last dim is the stack, rank-major
        flat = shm_path.all_gather(x.new_empty((1, group_size * x.numel())), x.view(1, -1), shm)
        return flat.view(group_size, *x.shape)
    parts = [torch.empty_like(x) for _ in range(group_size)]
    dist.all_gather(parts, x, group=group)
    return torch.stack(parts)


def all_reduce_(t: torch.Tensor, group) -> torch.Tensor:
    """In-place sum over the group of a contiguous tensor no one else reads (a gradient hook's copy)."""
    if t.is_cuda:  # NCCL, or torch's symmetric memory for small messages where TPMAP_SYMM_MEM=1 (engine.symm_mem)
        if (symm := symm_mem.for_group(t, group)) is not None:
            return symm.all_reduce_(t)
        dist.all_reduce(t, group=group)
        return t
    shm = _shm(t, group)
    if shm is not None:
        return shm_path.all_reduce(t, shm)
    dist.all_reduce(t, group=group)
    return t


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None  # a copy: autograd may hand the same grad to other nodes


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)  # a copy: never write into autograd's inputs

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, rank, order):
        # x: (..., F/tp_size) -> (..., F); `order` puts the rank-major concatenation back into feature order
        ctx.group, ctx.rank, ctx.order, ctx.local = group, rank, order, x.shape[-1]
        return _gather_in_order(x, group, order)

    @staticmethod
    def backward(ctx, grad):
        if ctx.order is not None:  # back to rank-major: position order[j] of the cat holds feature j
            gathered = dist.get_world_size(ctx.group) * ctx.local
            if ctx.order.numel() < gathered:  # blocks padded to the widest rank: the pads get zeros
                grad = grad.new_zeros((*grad.shape[:-1], gathered)).index_copy_(-1, ctx.order, grad)
            else:
                inverse = torch.empty_like(ctx.order)
                inverse[ctx.order] = torch.arange(ctx.order.numel(), device=ctx.order.device)
                grad = grad.index_select(-1, inverse)
        start = ctx.rank * ctx.local
        return grad[..., start : start + ctx.local].contiguous(), None, None, None


class _SumItemsOverHolders(torch.autograd.Function):
    """forward: the parameters unchanged. backward: each parameter's gradient summed over the ranks holding it,
    by one all-reduce of a zeroed (items, item numel) buffer into which each rank writes its held items' rows
    (`slots`: per parameter, its item's row and its offset in the row)."""

    @staticmethod
    def forward(ctx, slots, rows, group, *params):
        ctx.slots, ctx.rows, ctx.group = slots, rows, group
        ctx.shapes = [p.shape for p in params]
        return tuple(p.view_as(p) for p in params)

    @staticmethod
    def backward(ctx, *grads):
        like = next(g for g in grads if g is not None)
        width = max(start + shape.numel() for (_, start), shape in zip(ctx.slots, ctx.shapes))
        full = like.new_zeros(ctx.rows, width)  # (items, item numel)
        for (row, start), g in zip(ctx.slots, grads):
            if g is not None:
                full[row, start:start + g.numel()] = g.reshape(-1)
        full = _all_reduce(full, ctx.group, fresh=True)
        return None, None, None, *(full[row, start:start + shape.numel()].reshape(shape).clone()
                                   for (row, start), shape in zip(ctx.slots, ctx.shapes))


def sum_items_over_holders(params: list[torch.Tensor], slots: list[tuple[int, int]], rows: int,
                           group) -> tuple[torch.Tensor, ...]:
    """The parameters of a ModuleList's held items, as tensors whose gradients are summed over the ranks holding
    each item (a per-KV-head norm two ranks hold: each saw only its own query heads' part of the gradient).

    One node for the whole list, so every rank, whatever items it holds, issues exactly one all-reduce per list
    per backward, when the list's backward completes; and the gradient reaching each parameter is already the
    sum, so DDP's and FSDP2's hooks, and accumulation over micro-batches, see the right value."""
    return _SumItemsOverHolders.apply(tuple(slots), rows, group, *params)


class _SumOverTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


def _gather_in_order(x: torch.Tensor, group, order: torch.Tensor | None) -> torch.Tensor:
    y = _all_gather(x, group)  # (..., tp_size * F/tp_size), rank-major
    return y if order is None else y.index_select(-1, order)


def _recorded(x: torch.Tensor) -> bool:
    """Whether autograd records an op on x (else the collectives skip their autograd Function)."""
    return x.requires_grad and torch.is_grad_enabled()


# torch 2.13 renamed the single-tensor collectives (the old names now warn on every call); older torch
# has only the old names. Called through `dist` by name so that counting_collectives sees them.
_ALL_GATHER_SINGLE = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
_REDUCE_SCATTER_SINGLE = "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"


def _all_gather_along(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    """(.., n, ..) at `dim` -> (.., tp_size * n, ..), rank-major."""
    first = x.movedim(dim, 0).contiguous()  # (n, ...): each rank's chunk one block of memory
    tp_size = dist.get_world_size(group)
    if (handle := _compiled_handle(x, group)) >= 0:
        return torch.ops.tpmap.shm_all_gather(first, handle, tp_size).movedim(0, dim).contiguous()
    out = first.new_empty((tp_size * first.shape[0], *first.shape[1:]))
    shm = None if torch.compiler.is_compiling() else _shm(x, group)
    if shm is not None:
        shm_path.all_gather_into_tensor(out, first, shm)
    else:
        getattr(dist, _ALL_GATHER_SINGLE)(out, first, group=group)
    return out.movedim(0, dim).contiguous()


def _reduce_scatter_along(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    """(.., tp_size * n, ..) at `dim`, summed over ranks -> this rank's chunk (.., n, ..)."""
    first = x.movedim(dim, 0).contiguous()
    tp_size = dist.get_world_size(group)
    if (handle := _compiled_handle(x, group)) >= 0:
        return torch.ops.tpmap.shm_reduce_scatter(first, handle, tp_size).movedim(0, dim).contiguous()
    out = first.new_empty((first.shape[0] // tp_size, *first.shape[1:]))
    shm = None if torch.compiler.is_compiling() else _shm(x, group)
    if shm is not None:
        shm_path.reduce_scatter_tensor(out, first, shm)
    else:
        getattr(dist, _REDUCE_SCATTER_SINGLE)(out, first, group=group)
    return out.movedim(0, dim).contiguous()


def _chunk_along(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    """(.., tp_size * n, ..) at `dim` -> this rank's chunk (.., n, ..), no communication."""
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
    return x if _tp_size(group) == 1 else _SplitToSeq.apply(x, group, dim)


def gather_from_sequence_region(x: torch.Tensor, group, dim: int, reduce_grad: bool = True) -> torch.Tensor:
    """All-gather the chunks of `dim`. Backward: reduce-scatter into a tensor-parallel region (a Column
    follows), or with ``reduce_grad=False`` keep this rank's chunk (replicated computation follows)."""
    return x if _tp_size(group) == 1 else _GatherFromSeq.apply(x, group, dim, reduce_grad)


def reduce_scatter_to_sequence_region(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    """Leave a tensor-parallel region into the sequence-parallel one: sum over ranks and keep this rank's
    chunk of `dim` (a Row's partial products; all-gather backward). Same bytes as an all-reduce."""
    return x if _tp_size(group) == 1 else _ReduceScatterToSeq.apply(x, group, dim)


def copy_to_tp_region(x: torch.Tensor, group=None) -> torch.Tensor:
    """Enter a tensor-parallel region: identity forward, all-reduce of the gradient backward.
    Without autograd there is nothing to do. Columns reading one tensor share one copy: `SharedCopy`."""
    if not _recorded(x) or _tp_size(group) == 1:
        return x
    return _CopyToTP.apply(x, group)


class SharedCopy:
    """One copy_to_tp_region per tensor for the Columns that read it (q, k and v; gate and up; every cross
    attention's k and v reading one encoder output), so their input gradients are summed first and
    all-reduced once, as with Megatron's fused QKV layer (the sum of all-reduces is the all-reduce of the sum).

    The model's forward opens a scope (`open`, a pre-hook) that remembers the copies made in it by
    tensor identity, and closes it (`close`, a hook); a Column called outside the scope copies alone.
    Plain Python state on a module-held object, so dynamo traces it (a tensor attribute would break
    the graph), and nothing outlives the model's forward.
    """

    def __init__(self):
        self.copies: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # (input, its copy) in the scope

    def open(self, *_):
        self.copies = []

    def close(self, *_):
        self.copies = None

    def __call__(self, x: torch.Tensor, group) -> torch.Tensor:
        if self.copies is None or not _recorded(x):  # (without autograd the copy is x itself)
            return copy_to_tp_region(x, group)
        for seen, y in self.copies:
            if seen is x:
                return y
        y = copy_to_tp_region(x, group)
        self.copies.append((x, y))
        return y


def reduce_from_tp_region(x: torch.Tensor, group=None, *, fresh: bool = False) -> torch.Tensor:
    """Leave a tensor-parallel region by summing partial results: all-reduce forward, identity backward.
    `fresh`: x is a temporary only this call reads (a matmul's result), so without autograd it is
    summed in place, with no copy."""
    if _tp_size(group) == 1:
        return x
    return _ReduceFromTP.apply(x, group) if _recorded(x) else _all_reduce(x, group, fresh)


def gather_from_tp_region(x: torch.Tensor, group=None, order: torch.Tensor | None = None) -> torch.Tensor:
    """All-gather the last dim; `order` (optional) maps the rank-major concatenation to feature order."""
    if _tp_size(group) == 1:
        return x
    if not _recorded(x):
        return _gather_in_order(x, group, order)
    return _GatherFromTP.apply(x, group, dist.get_rank(group), order)


def sum_over_tp_region(x: torch.Tensor, group=None) -> torch.Tensor:
    """Sum a partial statistic over the ranks whose results stay rank-local: all-reduce both ways."""
    if _tp_size(group) == 1:
        return x
    return _SumOverTP.apply(x, group) if _recorded(x) else _all_reduce(x, group, fresh=True)


_COUNTED = {"all_reduce": "all_reduce", "all_gather": "all_gather", "all_gather_into_tensor": "all_gather_into_tensor",
            "reduce_scatter_tensor": "reduce_scatter_tensor", "broadcast": "broadcast",
            "all_gather_single": "all_gather_into_tensor", "reduce_scatter_single": "reduce_scatter_tensor"}
# torch.distributed name -> counted as (torch 2.13's new names under the old ones, so counts read the same)
_FUNCOL_COUNTED = {"all_reduce": "all_reduce", "all_gather_tensor": "all_gather",
                   "reduce_scatter_tensor": "reduce_scatter_tensor"}  # functional name -> counted as


# engine.shm's eager calls -> counted as the torch.distributed collective they replace
_SHM_COUNTED = {"all_reduce": "all_reduce", "all_gather": "all_gather",
                "all_gather_into_tensor": "all_gather_into_tensor", "reduce_scatter_tensor": "reduce_scatter_tensor"}


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
    with ``counts.bytes`` the bytes per name. Counts the real calls on their way through, eager
    `torch.distributed` and functional collectives alike (under torch.compile: the calls traced, not those
    a compiled graph replays); for reports and tests, not for production loops."""
    counts = CollectiveCounts()
    originals = [(dist, name, n) for name, n in _COUNTED.items() if hasattr(dist, name)]
    originals += [(funcol, f, n) for f, n in _FUNCOL_COUNTED.items()]
    originals += [(shm_path, f, n) for f, n in _SHM_COUNTED.items()]
    saved = [(module, name, getattr(module, name)) for module, name, _ in originals]

    def counted(name, fn):
        def call(*args, **kwargs):
            counts[name] += 1
            counts.bytes[name] += _payload(args, kwargs)
            return fn(*args, **kwargs)
        return call

    for (module, name, counted_as), (_, _, fn) in zip(originals, saved):
        setattr(module, name, counted(counted_as, fn))
    try:
        yield counts
    finally:
        for module, name, fn in saved:
            setattr(module, name, fn)
