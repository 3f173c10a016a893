"""Sequence parallelism's per-forward state (`SequenceState`), shared by the hooks (`engine.sequence_hooks`)
and the blocks' Columns and Rows, which call it while a forward runs split: a Column's product on the whole
sequence, a Row's reduce-scatter input, a closed parent's Row; and the rule for the whole parameters'
gradients (summed over the ranks when their stack's forward ran split).

Shapes: T is the whole sequence, tp_size the tensor-parallel group's size; rank r holds tokens
[r*T/tp_size, (r+1)*T/tp_size) between the blocks' tensor-parallel regions.
"""
from __future__ import annotations

import weakref

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tpmap.engine.collectives import (
    _all_gather_along,
    all_reduce_,
    copy_to_tp_region,
    gather_from_sequence_region,
    reduce_scatter_to_sequence_region,
)
from tpmap.engine.errors import SequenceParallelError
from tpmap.engine.layers import _matmul

SEQ_DIM = 1  # the hidden states between blocks are (B, T, H), batch first


class _SeqLinear(torch.autograd.Function):
    """y = x_full A (a Column's product; x_full is all-gathered along dim -2) saving only this rank's chunk
    x_local of x_full, all-gathered again in backward for A's gradient (Megatron's SP linear): the whole
    sequence is never held between forward and backward."""

    @staticmethod
    def forward(ctx, x_full, x_local, weight, reverse, group):
        ctx.save_for_backward(x_local, weight)
        ctx.reverse, ctx.group = reverse, group
        return x_full @ weight if reverse else F.linear(x_full, weight)  # (.., T, out/tp_size)

    @staticmethod
    def backward(ctx, grad):  # grad (.., T, out/tp_size)
        x_local, weight = ctx.saved_tensors
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = grad @ weight.t() if ctx.reverse else grad @ weight  # (.., T, in): this rank's partial sum
        if ctx.needs_input_grad[2]:
            x_full = _all_gather_along(x_local, ctx.group, -2).reshape(-1, x_local.shape[-1])  # (B*T, in)
            g = grad.reshape(-1, grad.shape[-1])  # (B*T, out/tp_size)
            grad_w = x_full.t() @ g if ctx.reverse else g.t() @ x_full
        return grad_x, None, grad_w, None, None


class SequenceState:
    """Per-model state shared by the hooks and the Columns/Rows of the blocks: whether this forward runs
    split (`active`: the sequence length divides by tp_size), and its whole token count (B * T)."""

    def __init__(self, group, stacks: int):
        self.group, self.tp_size = group, dist.get_world_size(group)
        self.active = False
        self.tokens = 0  # B * T of the whole sequence in this forward
        self.full_shape = torch.Size()  # (B, T) of the first block's input
        self.parent: tuple | None = None  # (gathered, this rank's chunk) of the last parent's input
        self._shared: tuple | None = None  # (x, gathered x, x detached): siblings share one gather
        self._gathers: set = set()  # autograd nodes of this forward's gathers (see derives_from_gather)
        self._copies: dict[int, tuple] = {}  # id -> (tensor from outside the blocks, its copy), this forward
        self._task, self._split = None, {}  # the backward (graph task) last marked; per stack, its kind
        self.stack_split: dict[int, bool] = {}  # per stack: whether its last forward ran split
        self.batch: int | None = None  # the model input's batch size (the first dimension of its first tensor)
        self.batches: dict[int, int | None] = {}  # per stack: the batch of the (sub-)model that runs it (`owner`)
        # per stack: the tensors its blocks passed on holding this rank's tokens, this forward (by id, not kept alive)
        self.split_states: dict[int, weakref.WeakValueDictionary] = {}
        # Other tensors shaped like this rank's tokens or the whole sequence are per-token inputs (split with the
        # hidden states) only in a one-stack model: in an encoder-decoder the decoder's blocks also take the
        # encoder's output, a different sequence that stays whole, which may have the same length by chance.
        self.side_inputs = stacks == 1
        self.stack_prefixes: tuple[str, ...] = ()  # per stack, its blocks' ModuleList name and a dot ("model.layers.")

    def start_stack(self, stack: int, hidden: torch.Tensor) -> bool:
        """A forward of stack `stack` begins on hidden states (B, T, H): whether it runs split (T divides by
        tp_size). Forgets the previous forward's gathers, copies and split states."""
        self.active = self.stack_split[stack] = hidden.shape[SEQ_DIM] % self.tp_size == 0
        self.tokens = hidden.shape[0] * hidden.shape[SEQ_DIM]
        self.full_shape = hidden.shape[:2]
        self.forget_gathers()
        self._gathers, self._copies = set(), {}
        self.split_states[stack] = weakref.WeakValueDictionary()
        return self.active

    def forget_gathers(self) -> None:
        """No later Column reads the last gathered input (a stack's last block returned)."""
        self._shared = self.parent = None

    # -- the collectives every caller shares ---------------------------------------------------------
    def gather(self, x: torch.Tensor, dim: int = -2) -> torch.Tensor:
        full = gather_from_sequence_region(x, self.group, dim)  # (.., T/tp_size, H) -> (.., T, H)
        if full.grad_fn is not None:
            self._gathers.add(full.grad_fn)
        return full

    def copied(self, x: torch.Tensor) -> torch.Tensor:
        """Plain TP's copy of a tensor from outside the blocks (identity; backward: all-reduce), one per tensor
        per forward: every layer reading it (an encoder's output, relative embeddings) shares one gradient sum."""
        if id(x) not in self._copies:
            self._copies[id(x)] = (x, copy_to_tp_region(x, self.group))  # holds x: its id stays its own
        return self._copies[id(x)][1]

    def derives_from_gather(self, x: torch.Tensor) -> bool:
        """Whether x's autograd graph reaches a sequence gather of this forward (its gradient is then summed
        over the ranks by that gather's reduce-scatter), rather than only tensors from outside the blocks
        (whose gradient plain TP's copy must all-reduce). Walks back from x, stopping at the gathers."""
        seen, todo = set(), [x.grad_fn]
        while todo:
            node = todo.pop()
            if node is None or node in seen:
                continue
            if node in self._gathers:
                return True
            seen.add(node)
            todo.extend(n for n, _ in node.next_functions)
        return False

    def check(self, x: torch.Tensor, tokens: int, module, what: str) -> None:
        if x.numel() // max(x.shape[-1], 1) != tokens:
            raise SequenceParallelError(
                f"sequence parallelism: a {type(module).__name__} got an {what} of shape {tuple(x.shape)}, not "
                f"{tokens} tokens: the module that calls it does not take the hidden states as its first "
                "argument. Apply without sequence_parallel for this model")

    # -- called by ColumnParallelLinear / RowParallelLinear while active --------------------------------
    def column_matmul(self, x: torch.Tensor, column) -> torch.Tensor:
        """A Column's product on the whole sequence, (..., T/tp_size or T, in) -> (..., T, out/tp_size): gathered
        here (siblings reading one tensor share the gather) or by the parent. Saves only this rank's tokens.
        Returns (the product, the input it read: (..., T, in), which an adapter's term reads too)."""
        if column.seq_gathers:
            self.check(x, self.tokens // self.tp_size, column, "input")
            full, local = self._shared_gather(x)
        elif self.parent is not None and self.parent[0] is x:  # the parent's gathered input (most models)
            full, local = x, self.parent[1]
        elif x.numel() // max(x.shape[-1], 1) == self.tokens // self.tp_size != self.tokens and self.side_inputs:
            full, local = self._shared_gather(x)  # this rank's tokens beside the parent's input (MobileBERT's value)
        elif not (x.requires_grad and torch.is_grad_enabled()):  # no backward: only the forward must be right
            return _matmul(x, column.weight, column.reverse), x
        elif self.derives_from_gather(x):  # computed from the gathered input inside the parent (a norm)
            self.check(x, self.tokens, column, "input")
            full = x  # replicated on every rank: cut this rank's chunk for the backward
            local = x.detach().narrow(-2, dist.get_rank(self.group) * (x.shape[-2] // self.tp_size),
                                      x.shape[-2] // self.tp_size).contiguous()
        else:  # a side input from outside the blocks (DeBERTa's relative embeddings): plain TP's copy
            copied = self.copied(x)
            return _matmul(copied, column.weight, column.reverse), copied
        return _SeqLinear.apply(full, local, column.weight, column.reverse, self.group), full

    def _shared_gather(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x all-gathered along dim -2, x detached): siblings reading one tensor share one gather."""
        if self._shared is None or self._shared[0] is not x:
            self._shared = (x, self.gather(x), x.detach())
        return self._shared[1], self._shared[2]  # (.., T, in), (.., T/tp_size, in)

    def row_partial(self, y: torch.Tensor, row) -> torch.Tensor:
        self.check(y, self.tokens, row, "output")
        return y

    def closed_row(self, partial: torch.Tensor, bias, row) -> torch.Tensor:
        """A Row inside a closed parent: the sum over ranks on every rank (reduce-scatter, bias on this rank's
        tokens, all-gather), whose backward is the same: the parent's output gradient, zero outside each
        rank's chunk, is summed so that this rank's heads see every token's gradient."""
        self.check(partial, self.tokens, row, "output")
        y = reduce_scatter_to_sequence_region(partial, self.group, 1)  # (B, T/tp_size, out)
        if bias is not None:
            y = y + bias  # a whole parameter seeing this rank's tokens: its gradient is summed like a norm's
        return self.gather(y, SEQ_DIM)

    # -- gradients of whole parameters ---------------------------------------------------------------------
    def backward_from(self, stack: int, split: bool) -> None:
        task = torch._C._current_graph_task_id()
        if task != self._task:
            self._task, self._split = task, {}
        if self._split.get(stack, split) != split:
            raise SequenceParallelError(
                "one backward runs through forwards with and without sequence parallelism (a sequence length "
                "that divides by the world size and one that does not): the gradients of the whole parameters "
                "cannot be summed right for both. Call backward after each forward, or pad to a multiple of the "
                "world size")
        self._split[stack] = split

    def summed(self, stack: int, grad: torch.Tensor) -> torch.Tensor:
        """A whole parameter's gradient: summed over the ranks when its backward came from a split forward of
        its stack (an encoder's input may divide by tp_size while the decoder's does not)."""
        task = torch._C._current_graph_task_id()
        marked = self._split if self._task == task else {}  # what this backward's forwards recorded (`_Mark`)
        split = marked.get(stack, self.stack_split.get(stack, False))
        if not split:
            return grad
        return all_reduce_(grad.contiguous().clone(), self.group)
