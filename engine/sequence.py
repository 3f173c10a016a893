"""Sequence parallelism at run time: the hooks and autograd functions that split the tokens at each
stack's first block, gather them for each Column's parent, and reduce-scatter each Row's output.

Where each collective goes, and why, is decided by `engine.sequence_plan` (its docstring states the
math); this module only carries a `SequencePlan` out.
"""
from __future__ import annotations

import functools
import inspect
import weakref

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tpmap.engine import rng
from tpmap.engine.collectives import (
    _all_gather_along,
    all_reduce_,
    copy_to_tp_region,
    gather_from_sequence_region,
    reduce_scatter_to_sequence_region,
    split_to_sequence_region,
)
from tpmap.engine.errors import SequenceParallelError
from tpmap.engine.layers import _matmul
from tpmap.engine.sequence_plan import SequencePlan
from tpmap.engine.shard import map_first_tensor

SEQ_DIM = 1  # the hidden states between blocks are (B, T, H), batch first


class _Mark(torch.autograd.Function):
    """Identity; in backward, records on `state` whether the forward it closes ran split (see `summed`)."""

    @staticmethod
    def forward(ctx, x, state, stack, split):
        ctx.state, ctx.stack, ctx.split = state, stack, split
        return x

    @staticmethod
    def backward(ctx, grad):
        ctx.state.backward_from(ctx.stack, ctx.split)
        return grad, None, None, None


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

    def __init__(self, group, stacks: int):
        self.group, self.ws = group, dist.get_world_size(group)
        self.active = False
        self.tokens = 0  # B * T of the whole sequence in this forward
        self._shared: tuple | None = None  # (x, gathered x, x detached): siblings share one gather
        self._parent: tuple | None = None  # (gathered, this rank's chunk) of the last parent's input
        self._task, self._split = None, {}  # the backward (graph task) last marked; per stack, its kind
        self._active: dict[int, bool] = {}  # per stack: whether its last forward ran split
        self._gathers: set = set()  # autograd nodes of this forward's gathers (see _derives_from_gather)
        self._copies: dict[int, tuple] = {}  # id -> (tensor from outside the blocks, its copy), this forward
        self.batch: int | None = None  # the model input's batch size (the first dimension of its first tensor)
        self.batches: dict[int, int | None] = {}  # per stack: the batch of the (sub-)model that runs it (`owner`)
        self._full_shape = torch.Size()  # (B, T) of the first block's input
        # per stack: the tensors its blocks passed on holding this rank's tokens, this forward (by id, not kept alive)
        self._split_states: dict[int, weakref.WeakValueDictionary] = {}
        # Other tensors shaped like this rank's tokens or the whole sequence are per-token inputs (split with the
        # hidden states) only in a one-stack model: in an encoder-decoder the decoder's blocks also take the
        # encoder's output, a different sequence that stays whole, which may have the same length by chance.
        self.side_inputs = stacks == 1
        self.stack_prefixes: tuple[str, ...] = ()  # per stack, its blocks' ModuleList name and a dot ("model.layers.")

    def record_batch(self, module, args, kwargs):
        self.batch = _batch_of(args, kwargs)

    def record_stack_batch(self, stack: int):
        """A hook on the (sub-)model that runs stack `stack` (`owner`): the batch its blocks must see first. A
        vision tower of a multimodal model runs on every crop or frame of the batch's images: its batch is not
        the model input's."""
        def hook(module, args, kwargs):
            self.batches[stack] = _batch_of(args, kwargs)
        return hook

    # -- called by ColumnParallelLinear / RowParallelLinear while active --------------------------------
    def column_matmul(self, x: torch.Tensor, column) -> torch.Tensor:
        """A Column's product on the whole sequence, (..., T/ws or T, in) -> (..., T, out/ws): gathered here
        (siblings reading one tensor share the gather) or by the parent. Saves only this rank's tokens.
        Returns (the product, the input it read: (..., T, in), which an adapter's term reads too)."""
        if column.seq_gathers:
            self._check(x, self.tokens // self.ws, column, "input")
            full, local = self._shared_gather(x)
        elif self._parent is not None and self._parent[0] is x:  # the parent's gathered input (most models)
            full, local = x, self._parent[1]
        elif x.numel() // max(x.shape[-1], 1) == self.tokens // self.ws != self.tokens and self.side_inputs:
            full, local = self._shared_gather(x)  # this rank's tokens beside the parent's input (MobileBERT's value)
        elif not (x.requires_grad and torch.is_grad_enabled()):  # no backward: only the forward must be right
            return _matmul(x, column.weight, column.reverse), x
        elif self._derives_from_gather(x):  # computed from the gathered input inside the parent (a norm)
            self._check(x, self.tokens, column, "input")
            full = x  # replicated on every rank: cut this rank's chunk for the backward
            local = x.detach().narrow(-2, dist.get_rank(self.group) * (x.shape[-2] // self.ws),
                                      x.shape[-2] // self.ws).contiguous()
        else:  # a side input from outside the blocks (DeBERTa's relative embeddings): plain TP's copy
            copied = self._copied(x)
            return _matmul(copied, column.weight, column.reverse), copied
        return _SeqLinear.apply(full, local, column.weight, column.reverse, self.group), full

    def _shared_gather(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x all-gathered along dim -2, x detached): siblings reading one tensor share one gather."""
        if self._shared is None or self._shared[0] is not x:
            self._shared = (x, self._gather(x), x.detach())
        return self._shared[1], self._shared[2]  # (.., T, in), (.., T/ws, in)

    def _copied(self, x: torch.Tensor) -> torch.Tensor:
        """Plain TP's copy of a tensor from outside the blocks (identity; backward: all-reduce), one per tensor
        per forward: every layer reading it (an encoder's output, relative embeddings) shares one gradient sum."""
        if id(x) not in self._copies:
            self._copies[id(x)] = (x, copy_to_tp_region(x, self.group))  # holds x: its id stays its own
        return self._copies[id(x)][1]

    def _derives_from_gather(self, x: torch.Tensor) -> bool:
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
    def split_block_input(self, block_name: str, stack: int):
        def hook(module, args, kwargs):
            hidden, put = _first_argument(module, args, kwargs)
            if not isinstance(hidden, torch.Tensor) or hidden.dim() != 3:
                raise SequenceParallelError(f"sequence parallelism: {block_name} takes "
                                            f"{type(hidden).__name__} {tuple(getattr(hidden, 'shape', ()))} first, "
                                            "not hidden states (B, T, H)")
            batch = self.batches.get(stack, self.batch)
            if batch is not None and hidden.shape[0] != batch:
                raise SequenceParallelError(
                    f"sequence parallelism: {block_name} takes hidden states of shape {tuple(hidden.shape)} for a "
                    f"batch of {batch}: they are not batch first (B, T, H), so tpmap "
                    "cannot tell which dimension is the sequence. Apply without sequence_parallel for this model")
            self.active = self._active[stack] = hidden.shape[SEQ_DIM] % self.ws == 0
            self.tokens = hidden.shape[0] * hidden.shape[SEQ_DIM]
            self._full_shape = hidden.shape[:2]
            self._shared = self._parent = None
            self._gathers, self._copies = set(), {}
            self._split_states[stack] = weakref.WeakValueDictionary()
            if not self.active:
                return put(hidden)
            split = split_to_sequence_region(hidden, self.group, SEQ_DIM)
            self._split_states[stack][id(split)] = split  # recorded as the first hidden state
            return put(split)
        return hook

    def note_block_output(self, stack: int):
        """A hook on each block but a stack's last (gathered): its output holds this rank's tokens."""
        def hook(module, args, output):
            if self._active.get(stack):
                map_first_tensor(output, lambda y: self._split_states[stack].__setitem__(id(y), y))
        return hook

    def split_side_inputs(self, module, args, kwargs):
        """Every block argument other than the hidden states that holds the whole sequence as they did,
        (B, T, ...): a per-token input (Gemma 4's per-layer inputs), split with them. Inside a parent it is
        gathered back with them (`_gather_arguments`), so position tables passed as tensors stay exact."""
        if not (self.active and self.side_inputs):
            return None
        hidden, _ = _first_argument(module, args, kwargs)
        args, kwargs, _ = _map_arguments(
            args, kwargs, lambda a: a is not hidden and _per_token(a, self._full_shape),
            lambda a: split_to_sequence_region(a, self.group, SEQ_DIM))  # (B, T, ..) -> (B, T/ws, ..)
        return args, kwargs

    def _split_input(self, module, args, kwargs):
        """(the hidden states, this rank's tokens, first in args/kwargs; a function that replaces them)."""
        hidden, put = _first_argument(module, args, kwargs)
        if not isinstance(hidden, torch.Tensor):
            raise SequenceParallelError(f"sequence parallelism: {type(module).__name__} is run on the whole sequence "
                                        f"but takes {type(hidden).__name__} first, not the hidden states")
        self._check(hidden, self.tokens // self.ws, module, "input")
        return hidden, put

    def gather_parent_input(self, module, args, kwargs):
        if not self.active:
            return None
        hidden, put = self._split_input(module, args, kwargs)
        full = self._gather(hidden)  # (B, T/ws, H) -> (B, T, H)
        self._parent = (full, hidden.detach())
        return put(full)  # other arguments stay as they are: a residual added to the Row's output stays split

    def _gather_arguments(self, hidden: torch.Tensor, args: tuple, kwargs: dict):
        """All-gather the first argument and every other argument holding this rank's tokens as it does,
        (B, T/ws, ...), for a module run on the whole sequence (a residual it adds inside, too); the others
        (masks, position tables) are whole already. Returns (args, kwargs, {id(tensor): gathered})."""
        return _map_arguments(args, kwargs,
                              lambda a: a is hidden or (self.side_inputs and _per_token(a, hidden.shape[:2])),
                              lambda a: self._gather(a, SEQ_DIM))  # (B, T/ws, ..) -> (B, T, ..)

    def _gather(self, x: torch.Tensor, dim: int = -2) -> torch.Tensor:
        full = gather_from_sequence_region(x, self.group, dim)  # (.., T/ws, H) -> (.., T, H)
        if full.grad_fn is not None:
            self._gathers.add(full.grad_fn)
        return full

    def gather_whole_input(self, module, args, kwargs):
        """A module kept whole (a partial mapping's attention) mixes all the tokens: it runs on the gathered
        sequence on every rank, and `chunk_whole_output` keeps this rank's tokens of its output. Backward:
        each rank's input gradient is its chunk's part, summed over the ranks by the gather's reduce-scatter;
        its whole parameters' gradients are summed like a norm's. A parent whose Row's output meets its
        own gathered input (ALBERT's attention: residual and LayerNorm inside) runs the same way.
        A tensor from outside the blocks that it reads too (a decoder's cross-attention reading the encoder's
        output) gets plain TP's copy: each rank's gradient covers only its chunk, summed by the copy's backward."""
        if not self.active:
            return None
        hidden, _ = self._split_input(module, args, kwargs)
        args, kwargs, gathered = self._gather_arguments(hidden, args, kwargs)
        self._parent = (gathered[id(hidden)], hidden.detach())
        args, kwargs, _ = _map_arguments(
            args, kwargs, lambda a: isinstance(a, torch.Tensor) and a.requires_grad and torch.is_grad_enabled()
            and not any(a is g for g in gathered.values()) and not self._derives_from_gather(a), self._copied)
        return args, kwargs

    def chunk_whole_output(self, module, args, output):
        if not self.active:
            return None
        rank = dist.get_rank(self.group)
        first = output if isinstance(output, torch.Tensor) else output[0] if isinstance(output, (tuple, list)) \
            and output else None
        if not isinstance(first, torch.Tensor):
            raise SequenceParallelError(f"sequence parallelism: {type(module).__name__} returned "
                                        f"{type(output).__name__}, not hidden states (or a tuple starting with them)")
        self._check(first, self.tokens, module, "output")
        chunks: dict[int, torch.Tensor] = {}

        def chunk(y):  # (B, T, ..) -> (B, T/ws, ..); backward: zeros outside this rank's tokens
            if not (isinstance(y, torch.Tensor) and y.dim() == 3 and y.shape[:2] == first.shape[:2]):
                return y
            if id(y) not in chunks:
                n = y.shape[1] // self.ws
                chunks[id(y)] = y.narrow(1, rank * n, n).clone(memory_format=torch.contiguous_format)
            return chunks[id(y)]
        if isinstance(output, torch.Tensor):
            return chunk(output)
        mapped = [chunk(y) for y in output]  # every per-token output (MobileBERT's bottleneck returns four)
        return mapped if isinstance(output, list) else type(output)(*mapped) if hasattr(output, "_fields") \
            else tuple(mapped)

    def closed_row(self, partial: torch.Tensor, bias, row) -> torch.Tensor:
        """A Row inside a closed parent: the sum over ranks on every rank (reduce-scatter, bias on this rank's
        tokens, all-gather), whose backward is the same: the parent's output gradient, zero outside each
        rank's chunk, is summed so that this rank's heads see every token's gradient."""
        self._check(partial, self.tokens, row, "output")
        y = reduce_scatter_to_sequence_region(partial, self.group, 1)  # (B, T/ws, out)
        if bias is not None:
            y = y + bias  # a whole parameter seeing this rank's tokens: its gradient is summed like a norm's
        return self._gather(y, SEQ_DIM)

    def enter_block(self, module, args, kwargs):
        if self.active and module.training:  # this rank's tokens: their own dropout masks
            rng.enter_sharded_region(dist.get_rank(self.group), _device(module))
        return

    def leave_block(self, module, args, output):
        if self.active and module.training:
            rng.leave_sharded_region()
        return

    def _gather_output(self, y: torch.Tensor, stack: int, active: bool) -> torch.Tensor:
        """(B, T/ws, H) -> (B, T, H); backward: this rank's chunk (what follows is replicated)."""
        if active:
            y = gather_from_sequence_region(y, self.group, SEQ_DIM, reduce_grad=False)
        if y.requires_grad and torch.is_grad_enabled():
            y = _Mark.apply(y, self, stack, active)
        return y

    def gather_last_output(self, stack: int):
        def hook(module, args, output):
            self._shared = self._parent = None
            mapped = map_first_tensor(output, lambda y: self._gather_output(y, stack, self.active))
            if mapped is not None:
                return mapped
            raise SequenceParallelError(f"sequence parallelism: the last block ({type(module).__name__}) returned "
                                        f"{type(output).__name__}, not hidden states (or a tuple starting with them)")
        return hook

    def gather_recorded_states(self, stack: int):
        """A hook on each module enclosing stack `stack` (its ModuleList's parent up to the model): a returned
        ModelOutput's recorded block outputs (``output_hidden_states=True``: ``hidden_states``,
        ``encoder_hidden_states``, ...) hold this rank's tokens for every block but the last; they are
        all-gathered as the last block's output is, before the model's own code reads them (Mllama's vision
        encoder stacks intermediate layers' outputs) or returns them. The innermost enclosing module gathers;
        the outer ones find them whole."""
        def hook(module, args, output):
            if not (self._active.get(stack) and isinstance(output, dict)):
                return
            split = self._split_states[stack]

            def whole(y):  # only this stack's own split states: another stack's may have the same shape
                if isinstance(y, torch.Tensor) and split.get(id(y)) is y:
                    return self._gather_output(y, stack, True)
                return y
            for key in [k for k, v in output.items() if k.endswith("hidden_states") and isinstance(v, (tuple, list))]:
                output[key] = type(output[key])(whole(y) for y in output[key])
        return hook

    # -- gradients of whole parameters ---------------------------------------------------------------------
    def backward_from(self, stack: int, split: bool) -> None:
        task = torch._C._current_graph_task_id()
        if task != self._task:
            self._task, self._split = task, {}
        if self._split.get(stack, split) != split:
            raise SequenceParallelError(
                "one backward runs through forwards with and without sequence parallelism (a sequence length "
                "that divides by the world size and one that does not): the gradients of the whole parameters "
                "cannot be summed right for both. Call backward after each forward, or pad to a multiple of ws")
        self._split[stack] = split

    def summed(self, stack: int, grad: torch.Tensor) -> torch.Tensor:
        """A whole parameter's gradient: summed over the ranks when its backward came from a split forward of
        its stack (an encoder's input may divide by ws while the decoder's does not)."""
        task = torch._C._current_graph_task_id()
        split = self._split[stack] if self._task == task and stack in self._split else self._active.get(stack, False)
        if not split:
            return grad
        return all_reduce_(grad.contiguous().clone(), self.group)


def _device(module: nn.Module) -> torch.device:
    p = next(module.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


def _first_argument(module: nn.Module, args: tuple, kwargs: dict):
    """(the forward's first argument, a function that returns (args, kwargs) with it replaced). Every other
    argument that is the same tensor is replaced too (CTRL's attention takes the hidden states as v, k and q)."""
    if args:
        first = args[0]
    else:
        name = next(iter(inspect.signature(module.forward).parameters), None)
        if name is None or name not in kwargs:
            raise SequenceParallelError(f"sequence parallelism: {type(module).__name__} was called without its "
                                        "first argument (the hidden states)")
        first = kwargs[name]

    def put(v):
        return (tuple(v if a is first else a for a in args),
                {k: v if a is first else a for k, a in kwargs.items()})
    return first, put


def _batch_of(args: tuple, kwargs: dict) -> int | None:
    """The first dimension of a forward's first tensor argument (its batch), or None."""
    first = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
    return first.shape[0] if first is not None and first.dim() >= 1 else None


def owner(model: nn.Module, block: str) -> str:
    """The (sub-)model that runs the stack of `block`: its innermost enclosing transformers model (a language
    model, a vision tower, an encoder's stack), `model` itself ('') when none encloses it. Its input's batch is
    the batch its blocks' hidden states must have first."""
    from transformers import PreTrainedModel

    parts = block.split(".")
    for n in range(len(parts) - 1, 0, -1):
        name = ".".join(parts[:n])
        if isinstance(model.get_submodule(name), PreTrainedModel):
            return name
    return ""


def _per_token(a, tokens_shape) -> bool:
    """Whether `a` is a (B, T, F) tensor over the same tokens as hidden states of shape (B, T, H)."""
    return isinstance(a, torch.Tensor) and a.dim() == 3 and a.shape[:2] == tokens_shape


def _map_arguments(args: tuple, kwargs: dict, selected, op):
    """(args, kwargs, {id: result}) with op applied to each selected argument, once per tensor (an argument
    passed twice maps to one result)."""
    done: dict[int, torch.Tensor] = {}

    def put(a):
        if not selected(a):
            return a
        if id(a) not in done:
            done[id(a)] = op(a)
        return done[id(a)]
    return tuple(put(a) for a in args), {k: put(a) for k, a in kwargs.items()}, done


def install_sequence_parallel(model: nn.Module, sp: SequencePlan, group) -> SequenceState:
    """Hook the blocks and parents, and point the blocks' Columns and Rows at one shared state."""
    state = SequenceState(group, len(sp.ends))
    model.register_forward_pre_hook(state.record_batch, with_kwargs=True)
    for stack, (first, last) in enumerate(sp.ends):
        model.get_submodule(owner(model, first)).register_forward_pre_hook(state.record_stack_batch(stack),
                                                                           with_kwargs=True)
        model.get_submodule(first).register_forward_pre_hook(state.split_block_input(first, stack), with_kwargs=True)
        model.get_submodule(last).register_forward_hook(state.gather_last_output(stack))
        parts = first.split(".")[:-2]  # the ModuleList's parent, then each module enclosing it up to the model
        for n in range(len(parts), -1, -1):
            model.get_submodule(".".join(parts[:n])).register_forward_hook(state.gather_recorded_states(stack))
    stack_of = {name: i for name in sp.blocks for i, (first, _) in enumerate(sp.ends)
                if name.rpartition(".")[0] == first.rpartition(".")[0]}
    lasts = {last for _, last in sp.ends}
    for name in sp.blocks:
        block = model.get_submodule(name)
        if name not in lasts:
            block.register_forward_hook(state.note_block_output(stack_of[name]))
        block.register_forward_pre_hook(state.split_side_inputs, with_kwargs=True)
        block.register_forward_pre_hook(state.enter_block, with_kwargs=True)
        block.register_forward_hook(state.leave_block, always_call=True)  # also when it raises (rng.RegionGuard)
    for name in sp.parents:
        model.get_submodule(name).register_forward_pre_hook(state.gather_parent_input, with_kwargs=True)
    for name in sp.whole:
        module = model.get_submodule(name)
        module.register_forward_pre_hook(state.gather_whole_input, with_kwargs=True)
        module.register_forward_hook(state.chunk_whole_output)
    for name, gathers in sp.columns:
        column = model.get_submodule(name)
        column.__dict__["seq"], column.seq_gathers = state, gathers
    for name in sp.rows:
        model.get_submodule(name).__dict__["seq"] = state
    for name in sp.closed_rows:
        row = model.get_submodule(name)
        row.__dict__["seq"], row.seq_closed = state, True
    stacks = [first.rpartition(".")[0] + "." for first, _ in sp.ends]
    state.stack_prefixes = tuple(stacks)
    for name in sp.grad_allreduce:
        p = model.get_parameter(name)
        if p.requires_grad:
            stack = next(i for i, prefix in enumerate(stacks) if name.startswith(prefix))
            p.register_hook(functools.partial(state.summed, stack))
    return state
