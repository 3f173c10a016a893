"""Sequence parallelism (Megatron-SP), opt-in: `tpmap.apply(..., sequence_parallel=True)`.

Between the tensor-parallel regions of the repeated blocks, plain TP holds every token on every rank
and computes norms, dropout and residual adds ws times over. SP keeps those activations split along
the sequence instead (rank r holds tokens [r*T/ws, (r+1)*T/ws)):

    block 0 input            split along the sequence          (backward: all-gather)
    a Column's parent input  all-gather along the sequence     (backward: reduce-scatter)  was: copy
    a Row's output           reduce-scatter along the sequence (backward: all-gather)      was: all-reduce
    last block output        all-gather along the sequence     (backward: keep this rank's chunk)

The split sits at the first block's input, not at the embedding, because transformers models build
masks, position ids and rotary tables from the input's shape before the blocks; those stay whole.
The gather sits at the input of each Column's parent (the attention or MLP module), because the parent
reads the sequence length from its input (``hidden_states.shape[:-1]``) before projecting; a Column
that sits directly in a block (an MLP written inline) gathers its own input along dim -2, which is
exact for the token-wise code between it and its Row whatever the layout ([B, T, H] or [B*T, H]).

Parameters kept whole inside the blocks (norms, Row biases) now see only this rank's tokens: their
gradients are all-reduced over the group (Megatron sums its "sequence_parallel" LayerNorm grads).
Dropout inside a block draws from the rank-specific generator (`engine.rng`): each rank's tokens
get their own masks.

A forward whose sequence length is not a multiple of ws (a decode step of generate) runs as plain
TP. Which kind a backward's gradients came from is recorded in the graph (`_Mark`), so the whole
parameters' all-reduce follows it; mixing both kinds in one backward raises.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tpmap.errors import SequenceParallelError

from . import rng
from .collectives import _all_gather_along, gather_from_sequence_region, split_to_sequence_region
from .shard import map_first_tensor

SEQ_DIM = 1  # the hidden states between blocks are (B, T, H), batch first


@dataclass(frozen=True)
class SequencePlan:
    blocks: tuple[str, ...]  # full names of the repeated blocks, in order
    parents: tuple[str, ...]  # modules whose first argument (the hidden states) is all-gathered
    columns: tuple[tuple[str, bool], ...]  # (Column, gathers its own input: its parent is a block)
    rows: tuple[str, ...]  # Rows inside the blocks: reduce-scatter
    grad_allreduce: tuple[str, ...]  # whole parameters in the blocks (each rank sees only its tokens)


def _refuse(name: str, why: str) -> SequenceParallelError:
    return SequenceParallelError(f"sequence_parallel=True cannot split the tokens around {name}: {why}. "
                                 "Apply without sequence_parallel (plain tensor parallelism) for this model")


def build(model: nn.Module, plan) -> SequencePlan:
    """Check that `model` under `plan` can keep its inter-block activations split along the sequence,
    and say where the collectives go. Reads the model, changes nothing; raises SequenceParallelError."""
    from tpmap.lint.rules import block_prefixes

    base = model.get_submodule(plan.base_prefix[:-1]) if plan.base_prefix else model
    blocks = [plan.base_prefix + b for b in block_prefixes(base)]
    stacks = sorted({b.rpartition(".")[0] for b in blocks})
    if len(stacks) != 1:
        raise _refuse(type(model).__name__, f"it has {len(stacks)} stacks of repeated blocks "
                      f"({', '.join(stacks) or 'none'}); sequence parallelism supports one stack (a decoder-only "
                      "or an encoder-only model), whose first block's input is split and last block's output gathered")

    def block_of(name: str) -> str | None:
        return next((b for b in blocks if name.startswith(b + ".")), None)

    shards = {m.name: m for m in plan.modules if block_of(m.name)}
    split_tensors = {t.name for t in plan.tensors}
    columns, parents = [], set()
    for m in shards.values():
        if m.style != "column":
            continue
        if isinstance(model.get_submodule(m.name), nn.Embedding) or m.gather_output or not m.copy_input:
            raise _refuse(m.name, "a Column inside a block whose input or output does not follow the Column -> Row "
                          "pattern (an embedding, gather_output, or copy_input: false after an Enter)")
        parent = m.name.rpartition(".")[0]
        columns.append((m.name, parent in blocks))
        if parent not in blocks:
            parents.add(parent)
    for p in parents:
        outer = next((q for q in parents if p.startswith(q + ".")), None)
        if outer is not None:
            raise _refuse(p, f"it holds Columns and sits inside {outer}, which holds Columns too (two gathers)")

    def in_parent(name: str) -> bool:
        return any(name == p or name.startswith(p + ".") for p in parents)

    for block in blocks:
        for rel, module in model.get_submodule(block).named_modules():
            name = f"{block}.{rel}" if rel else block
            if name in plan.reduces or name in plan.enters:
                kind = "Reduce" if name in plan.reduces else "Enter"
                raise _refuse(name, f"it is under a {kind} entry (a partial sum or a whole module feeding the "
                              "heads, as in MoE experts and SSM mixers), which tpmap does not yet run on split tokens")
            if isinstance(module, nn.modules.conv._ConvNd):
                raise _refuse(name, f"it is a {type(module).__name__}, which mixes neighbouring tokens along the "
                              "sequence outside attention; on split tokens it would miss its neighbours")
            own = [(n, p) for n, p in module.named_parameters(recurse=False)]
            if name not in shards and any(p.dim() >= 2 and f"{name}.{n}" not in split_tensors for n, p in own):
                raise _refuse(name, f"it is a {type(module).__name__} with a matrix kept whole inside a block "
                              "(a router, or a projection feeding every head); tpmap cannot tell whether it needs "
                              "all the tokens")
            cut = [t for t in split_tensors if t.startswith(name + ".") and t.count(".") == name.count(".") + 1]
            if cut and not in_parent(name):
                raise _refuse(name, f"its tensors {', '.join(cut)} are split by a Param entry outside a Column's "
                              "module, where the tokens are split (a sequence mixer's state)")
    grad_allreduce = []
    params = plan.params
    for block in blocks:
        for rel, p in model.get_submodule(block).named_parameters():
            name = f"{block}.{rel}"
            shard = params.get(name)
            if shard is not None and (shard.dim is not None or shard.partial):
                continue  # split: its gradient is this rank's slice already
            if name in plan.grad_allreduce or any(name.startswith(t + ".") for t in split_tensors):
                continue  # already summed over the ranks, or this rank's items of a split ModuleList
            grad_allreduce.append(name)
    rows = tuple(m.name for m in shards.values() if m.style == "row")
    return SequencePlan(tuple(blocks), tuple(sorted(parents)), tuple(columns), rows, tuple(grad_allreduce))


class _Mark(torch.autograd.Function):
    """Identity; in backward, records on `state` whether the forward it closes ran split (see `summed`)."""

    @staticmethod
    def forward(ctx, x, state, split):
        ctx.state, ctx.split = state, split
        return x

    @staticmethod
    def backward(ctx, grad):
        ctx.state.backward_from(ctx.split)
        return grad, None, None


class _SeqLinear(torch.autograd.Function):
    """y = x_full A (a Column's product; x_full is all-gathered along dim -2) saving only this rank's chunk
    x_local of x_full, all-gathered again in backward for A's gradient (Megatron's SP linear): the whole
    sequence is never held between forward and backward."""

    @staticmethod
    def forward(ctx, x_full, x_local, weight, reverse, group):
        ctx.save_for_backward(x_local, weight)
        ctx.reverse, ctx.group = reverse, group
        return x_full @ weight if reverse else F.linear(x_full, weight)  # (.., T, out/ws)

    @staticmethod
    def backward(ctx, grad):  # grad (.., T, out/ws)
        x_local, weight = ctx.saved_tensors
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = grad @ weight.t() if ctx.reverse else grad @ weight  # (.., T, in): this rank's partial sum
        if ctx.needs_input_grad[2]:
            x_full = _all_gather_along(x_local, ctx.group, -2).reshape(-1, x_local.shape[-1])  # (B*T, in)
            g = grad.reshape(-1, grad.shape[-1])  # (B*T, out/ws)
            grad_w = x_full.t() @ g if ctx.reverse else g.t() @ x_full
        return grad_x, None, grad_w, None, None


class SequenceState:
    """Per-model state shared by the hooks and the Columns/Rows of the blocks: whether this forward runs
    split (`active`: the sequence length divides by ws), and its whole token count (B * T)."""

    def __init__(self, group):
        self.group, self.ws = group, dist.get_world_size(group)
        self.active = False
        self.tokens = 0  # B * T of the whole sequence in this forward
        self._shared: tuple | None = None  # (x, gathered x, x detached): siblings share one gather
        self._parent: tuple | None = None  # (gathered, this rank's chunk) of the last parent's input
        self._task, self._split = None, False  # the backward (graph task) last marked, and its kind

    # -- called by ColumnParallelLinear / RowParallelLinear while active --------------------------------
    def column_matmul(self, x: torch.Tensor, column) -> torch.Tensor:
        """A Column's product on the whole sequence, (..., T/ws or T, in) -> (..., T, out/ws): gathered here
        (siblings reading one tensor share the gather) or by the parent. Saves only this rank's tokens."""
        if column.seq_gathers:
            if self._shared is None or self._shared[0] is not x:
                self._check(x, self.tokens // self.ws, column, "input")
                self._shared = (x, gather_from_sequence_region(x, self.group, -2), x.detach())
            _, full, local = self._shared  # (.., T/ws, in) -> (.., T, in)
        else:
            self._check(x, self.tokens, column, "input")
            full = x
            local = self._parent[1] if self._parent is not None and self._parent[0] is x else None
            if local is None:  # gathered by the parent from a tensor it did not record: cut this rank's chunk
                local = x.detach().narrow(-2, dist.get_rank(self.group) * (x.shape[-2] // self.ws),
                                          x.shape[-2] // self.ws).contiguous()
        return _SeqLinear.apply(full, local, column.weight, column.reverse, self.group)

    def row_partial(self, y: torch.Tensor, row) -> torch.Tensor:
        self._check(y, self.tokens, row, "output")
        return y

    def _check(self, x: torch.Tensor, tokens: int, module, what: str) -> None:
        if x.numel() // max(x.shape[-1], 1) != tokens:
            raise SequenceParallelError(
                f"sequence parallelism: a {type(module).__name__} got an {what} of shape {tuple(x.shape)}, not "
                f"{tokens} tokens: the module that calls it does not take the hidden states as its first "
                "argument. Apply without sequence_parallel for this model")

    # -- the hooks ----------------------------------------------------------------------------------------
    def split_block_input(self, block_name: str):
        def hook(module, args, kwargs):
            hidden, put = _first_argument(module, args, kwargs)
            if not isinstance(hidden, torch.Tensor) or hidden.dim() != 3:
                raise SequenceParallelError(f"sequence parallelism: {block_name} takes "
                                            f"{type(hidden).__name__} {tuple(getattr(hidden, 'shape', ()))} first, "
                                            "not hidden states (B, T, H)")
            self.active = hidden.shape[SEQ_DIM] % self.ws == 0
            self.tokens = hidden.shape[0] * hidden.shape[SEQ_DIM]
            self._shared = self._parent = None
            return put(split_to_sequence_region(hidden, self.group, SEQ_DIM) if self.active else hidden)
        return hook

    def gather_parent_input(self, module, args, kwargs):
        if not self.active:
            return None
        hidden, put = _first_argument(module, args, kwargs)
        if not isinstance(hidden, torch.Tensor):
            raise SequenceParallelError(f"sequence parallelism: {type(module).__name__} holds Columns but takes "
                                        f"{type(hidden).__name__} first, not the hidden states")
        self._check(hidden, self.tokens // self.ws, module, "input")
        full = gather_from_sequence_region(hidden, self.group, -2)  # (B, T/ws, H) -> (B, T, H)
        self._parent = (full, hidden.detach())
        return put(full)

    def enter_block(self, module, args, kwargs):
        if self.active and module.training:  # this rank's tokens: their own dropout masks
            rng.enter_sharded_region(dist.get_rank(self.group), _device(module))
        return None

    def leave_block(self, module, args, output):
        if self.active and module.training:
            rng.leave_sharded_region()
        return None

    def gather_last_output(self, module, args, output):
        self._shared = self._parent = None

        def gather(y):  # (B, T/ws, H) -> (B, T, H); backward: this rank's chunk (what follows is replicated)
            if self.active:
                y = gather_from_sequence_region(y, self.group, SEQ_DIM, reduce_grad=False)
            return _Mark.apply(y, self, self.active) if y.requires_grad and torch.is_grad_enabled() else y

        mapped = map_first_tensor(output, gather)
        if mapped is not None:
            return mapped
        raise SequenceParallelError(f"sequence parallelism: the last block ({type(module).__name__}) returned "
                                    f"{type(output).__name__}, not hidden states (or a tuple starting with them)")

    # -- gradients of whole parameters ---------------------------------------------------------------------
    def backward_from(self, split: bool) -> None:
        task = torch._C._current_graph_task_id()
        if task == self._task and split != self._split:
            raise SequenceParallelError(
                "one backward runs through forwards with and without sequence parallelism (a sequence length "
                "that divides by the world size and one that does not): the gradients of the whole parameters "
                "cannot be summed right for both. Call backward after each forward, or pad to a multiple of ws")
        self._task, self._split = task, split

    def summed(self, grad: torch.Tensor) -> torch.Tensor:
        """A whole parameter's gradient: summed over the ranks when its backward came from a split forward."""
        split = self._split if self._task == torch._C._current_graph_task_id() else self.active
        if not split:
            return grad
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=self.group)
        return grad


def _device(module: nn.Module) -> torch.device:
    p = next(module.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


def _first_argument(module: nn.Module, args: tuple, kwargs: dict):
    """(the forward's first argument, a function that returns (args, kwargs) with it replaced)."""
    if args:
        return args[0], lambda v: ((v,) + args[1:], kwargs)
    name = next(iter(inspect.signature(module.forward).parameters), None)
    if name is None or name not in kwargs:
        raise SequenceParallelError(f"sequence parallelism: {type(module).__name__} was called without its first "
                                    "argument (the hidden states)")
    return kwargs[name], lambda v: (args, {**kwargs, name: v})


def install(model: nn.Module, sp: SequencePlan, group) -> SequenceState:
    """Hook the blocks and parents, and point the blocks' Columns and Rows at one shared state."""
    state = SequenceState(group)
    first, last = model.get_submodule(sp.blocks[0]), model.get_submodule(sp.blocks[-1])
    first.register_forward_pre_hook(state.split_block_input(sp.blocks[0]), with_kwargs=True)
    for name in sp.blocks:
        block = model.get_submodule(name)
        block.register_forward_pre_hook(state.enter_block, with_kwargs=True)
        block.register_forward_hook(state.leave_block)
    last.register_forward_hook(state.gather_last_output)
    for name in sp.parents:
        model.get_submodule(name).register_forward_pre_hook(state.gather_parent_input, with_kwargs=True)
    for name, gathers in sp.columns:
        column = model.get_submodule(name)
        column.__dict__["seq"], column.seq_gathers = state, gathers
    for name in sp.rows:
        model.get_submodule(name).__dict__["seq"] = state
    for name in sp.grad_allreduce:
        p = model.get_parameter(name)
        if p.requires_grad:
            p.register_hook(state.summed)
    return state
