"""Sequence parallelism (Megatron-SP), opt-in: `tpmap.apply(..., sequence_parallel=True)`.

Between the tensor-parallel regions of the repeated blocks, plain TP holds every token on every rank
and computes norms, dropout and residual adds ws times over. SP keeps those activations split along
the sequence instead (rank r holds tokens [r*T/ws, (r+1)*T/ws)):

    a stack's first block input  split along the sequence      (backward: all-gather)
    a Column's parent input  all-gather along the sequence     (backward: reduce-scatter)  was: copy
    a Row's output           reduce-scatter along the sequence (backward: all-gather)      was: all-reduce
    a stack's last block output  all-gather along the sequence (backward: keep this rank's chunk)

A stack is a ModuleList of repeated blocks: a decoder-only or encoder-only model has one, an
encoder-decoder two, each split and gathered on its own; the encoder's output reaches the decoder's
cross-attention whole, as a side input (below).

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

Beyond the plain Column -> Row pattern, each rule general (found in a shipped family, none by name):
* A Column's input that is not its parent's gathered input: this rank's tokens passed beside it (MobileBERT's
  value) gather themselves; a tensor computed from the gathered input inside the parent (a norm) is cut
  to this rank's chunk for the backward; a tensor from outside the blocks (DeBERTa's relative position
  embeddings) takes plain TP's copy, whose backward all-reduces its gradient. Which one is read from the
  autograd graph (`_derives_from_gather`), so no gradient is summed twice or missed.
* A module the mapping keeps whole inside a block (a partial mapping's attention) mixes all the tokens:
  it runs on the gathered sequence and keeps this rank's chunk of every per-token output; a tensor from
  outside the blocks that it reads (an encoder's output) takes plain TP's copy. So does a "closed"
  parent, whose Row's output meets its own gathered input before it returns (ALBERT's attention adds the
  residual and normalizes inside); its Rows all-reduce (reduce-scatter + all-gather).
* In a one-stack model, other block arguments shaped like the hidden states, (B, T, F), are split with
  them (Gemma 4's per-layer inputs), and gathered back with them where a module runs on the whole
  sequence. Not with several stacks: there a (B, T, F) argument may be the encoder's output, whole.
* A per-head embedding Column (T5's relative position bias) inside a gathered parent is looked up for
  the whole sequence, as in plain TP. Parents that are items of a ModuleList/ModuleDict (experts) are
  refused: they are called with the tokens routed to them.
* The hidden states must be batch first: a block input whose first dimension is not the model input's
  batch (XLNet's (T, B, H)) raises at the forward.

A forward whose sequence length is not a multiple of ws (a decode step of generate) runs as plain
TP. Which kind a backward's gradients came from is recorded in the graph (`_Mark`), so the whole
parameters' all-reduce follows it, per stack (an encoder input that divides and a decoder input that
does not is fine); mixing both kinds in one stack in one backward raises.
"""
from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tpmap.errors import SequenceParallelError

from . import rng
from .collectives import (_all_gather_along, copy_to_tp_region, gather_from_sequence_region,
                          reduce_scatter_to_sequence_region, split_to_sequence_region)
from .layers import _matmul
from .shard import map_first_tensor

SEQ_DIM = 1  # the hidden states between blocks are (B, T, H), batch first


def _token_wise() -> tuple:
    """Module classes that compute each token on its own (a whole one is exact on split tokens)."""
    from transformers.pytorch_utils import Conv1D

    return (nn.Linear, Conv1D)


@dataclass(frozen=True)
class SequencePlan:
    blocks: tuple[str, ...]  # full names of the repeated blocks, in order
    ends: tuple[tuple[str, str], ...]  # (first block, last block) of each stack
    parents: tuple[str, ...]  # modules whose first argument (the hidden states) is all-gathered
    columns: tuple[tuple[str, bool], ...]  # (Column, gathers its own input: its parent is a block)
    rows: tuple[str, ...]  # Rows inside the blocks: reduce-scatter
    grad_allreduce: tuple[str, ...]  # whole parameters in the blocks (each rank sees only its tokens)
    whole: tuple[str, ...] = ()  # kept-whole modules and closed parents: gather in, chunk out
    closed_rows: tuple[str, ...] = ()  # Rows inside closed parents: all-reduce (RS + AG) both ways


def _refuse(name: str, why: str) -> SequenceParallelError:
    return SequenceParallelError(f"sequence_parallel=True cannot split the tokens around {name}: {why}. "
                                 "Apply without sequence_parallel (plain tensor parallelism) for this model")


def build(model: nn.Module, plan) -> SequencePlan:
    """Check that `model` under `plan` can keep its inter-block activations split along the sequence,
    and say where the collectives go. Reads the model, changes nothing; raises SequenceParallelError."""
    from tpmap.lint.rules import block_prefixes

    from .plan import match

    base = model.get_submodule(plan.base_prefix[:-1]) if plan.base_prefix else model
    blocks = [plan.base_prefix + b for b in block_prefixes(base)]
    column_names = [m.name for m in plan.modules if m.style == "column"]
    holding = {b.rpartition(".")[0] for b in blocks if any(c.startswith(b + ".") for c in column_names)}
    if len(holding) == 1:  # other ModuleLists hold no Column (Gemma 3n's AltUp projections): not blocks
        blocks = [b for b in blocks if b.rpartition(".")[0] in holding]
    stacks = sorted({b.rpartition(".")[0] for b in blocks})
    if not stacks:
        raise _refuse(type(model).__name__, "it has no stack of repeated blocks (a ModuleList of layers) whose "
                      "first input could be split and last output gathered")
    # Each stack (an encoder's, a decoder's) runs as a unit: split at its first block, gathered at its last.
    # Its output, whole again, reaches the other stack as a side input (cross-attention's keys and values).
    ends = tuple((min(group, key=_index), max(group, key=_index))
                 for group in ([b for b in blocks if b.rpartition(".")[0] == s] for s in stacks))

    def block_of(name: str) -> str | None:
        return next((b for b in blocks if name.startswith(b + ".")), None)

    names = dict(base.named_modules())  # the mapping's patterns are relative to the base model
    whole = sorted({plan.base_prefix + n for pattern, _, _ in plan.kept_whole for n in match(pattern, names)
                    if block_of(plan.base_prefix + n)})
    whole = [n for n in whole if not any(n.startswith(w + ".") for w in whole)]  # the outermost
    kept = list(whole)

    def in_whole(name: str) -> bool:
        return any(name == w or name.startswith(w + ".") for w in kept)

    shards = {m.name: m for m in plan.modules if block_of(m.name)}
    if not any(m.style == "column" for m in shards.values()):
        raise _refuse(type(model).__name__, "nothing in its blocks is split (no Column), so there is no "
                      "tensor-parallel region whose all-reduces could become reduce-scatters")
    split_tensors = {t.name for t in plan.tensors}
    candidates, tables = [], []
    for m in shards.values():
        if m.style != "column":
            continue
        if isinstance(model.get_submodule(m.name), nn.Embedding):
            tables.append(m.name)  # a per-head table looked up by positions (T5's relative bias): checked below
            continue
        if m.gather_output or not m.copy_input:
            raise _refuse(m.name, "a Column inside a block whose input or output does not follow the Column -> Row "
                          "pattern (gather_output, or copy_input: false after an Enter)")
        candidates.append((m.name, m.name.rpartition(".")[0]))
    # A parent gathers its first argument for the Columns under it. A module holding Columns that holds
    # another such module too (ALBERT's layer: attention and the FFN's Columns) is no gather point: its
    # own Columns gather their inputs themselves, as Columns written inline in a block do.
    holders = {p for _, p in candidates if p not in blocks}
    nested = {p for p in holders if any(q.startswith(p + ".") for q in holders)}
    columns, parents = [], set()
    for name, parent in candidates:
        gathers = parent in blocks or parent in nested
        columns.append((name, gathers))
        if not gathers:
            parents.add(parent)
    # A parent whose Row's output meets the parent's own (gathered) input before it returns -- ALBERT's
    # attention adds the residual and applies the LayerNorm inside -- cannot return this rank's tokens from
    # its Row: it is closed, run like a whole module (gather in, chunk out) with its Rows summing on every
    # rank. Recognised by a norm over the Row's output width inside the parent (q/k norms are head-wide).
    rows = [m.name for m in shards.values() if m.style == "row"]
    closed = sorted(p for p in parents if _norm_after_row(model, p, [r for r in rows if r.startswith(p + ".")], shards))
    parents -= set(closed)
    # Parents that are items of a ModuleList / ModuleDict inside a block are experts: each is called with
    # only the tokens routed to it, not with the hidden states its gather expects.
    for p in sorted(parents):
        container = model.get_submodule(p.rpartition(".")[0])
        if isinstance(container, (nn.ModuleList, nn.ModuleDict)):
            raise _refuse(p, f"it is an item of a {type(container).__name__} of modules holding Columns (experts), "
                          "called with the tokens routed to it, not with the hidden states whose sequence tpmap splits")
    whole = sorted(whole + closed)
    for w in whole:
        if any(w.startswith(p + ".") for p in parents):
            raise _refuse(w, "a module kept whole by the mapping sits inside a module whose input is gathered for "
                          "its Columns")

    def in_parent(name: str) -> bool:
        return any(name == p or name.startswith(p + ".") for p in parents)

    for name in tables:  # inside a gathered parent it is looked up for the whole sequence, as in plain TP
        if not (in_parent(name) or any(name.startswith(w + ".") for w in whole)):
            raise _refuse(name, "an embedding Column inside a block but outside a module whose input is gathered "
                          "(an attention): its lookups would not cover the whole sequence")

    for block in blocks:
        for rel, module in model.get_submodule(block).named_modules():
            name = f"{block}.{rel}" if rel else block
            if in_whole(name):
                continue  # computed on the gathered sequence, this rank's chunk kept (install)
            if name in plan.reduces or name in plan.enters:
                kind = "Reduce" if name in plan.reduces else "Enter"
                raise _refuse(name, f"it is under a {kind} entry (a partial sum or a whole module feeding the "
                              "heads, as in MoE experts and SSM mixers), which tpmap does not yet run on split tokens")
            if isinstance(module, nn.modules.conv._ConvNd):
                raise _refuse(name, f"it is a {type(module).__name__}, which mixes neighbouring tokens along the "
                              "sequence outside attention; on split tokens it would miss its neighbours")
            own = [(n, p) for n, p in module.named_parameters(recurse=False)]
            if (name not in shards and not isinstance(module, _token_wise())
                    and any(p.dim() >= 2 and f"{name}.{n}" not in split_tensors for n, p in own)):
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
    closed_rows = tuple(r for r in rows if any(r.startswith(c + ".") for c in closed))
    return SequencePlan(tuple(blocks), ends, tuple(sorted(parents)), tuple(columns),
                        tuple(r for r in rows if r not in closed_rows), tuple(grad_allreduce), tuple(whole), closed_rows)


def _index(block: str) -> int:
    return int(block.rpartition(".")[2])


def _norm_after_row(model: nn.Module, parent: str, rows: list[str], shards: dict) -> bool:
    """Whether `parent` holds a Row and a norm (a module named *Norm*) over the Row's output width."""
    if not rows:
        return False
    widths = {shards[r].weight.full_shape[1 if shards[r].reverse else 0] for r in rows}  # the Rows' output widths
    for _, m in model.get_submodule(parent).named_modules():
        w = getattr(m, "weight", None)
        if "norm" in type(m).__name__.lower() and isinstance(w, torch.Tensor) and w.dim() == 1 and w.numel() in widths:
            return True
    return False


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
        self._full_shape = torch.Size()  # (B, T) of the first block's input
        # Other tensors shaped like this rank's tokens or the whole sequence are per-token inputs (split with the
        # hidden states) only in a one-stack model: in an encoder-decoder the decoder's blocks also take the
        # encoder's output, a different sequence that stays whole, which may have the same length by chance.
        self.side_inputs = stacks == 1

    def record_batch(self, module, args, kwargs):
        first = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
        self.batch = first.shape[0] if first is not None and first.dim() >= 1 else None

    # -- called by ColumnParallelLinear / RowParallelLinear while active --------------------------------
    def column_matmul(self, x: torch.Tensor, column) -> torch.Tensor:
        """A Column's product on the whole sequence, (..., T/ws or T, in) -> (..., T, out/ws): gathered here
        (siblings reading one tensor share the gather) or by the parent. Saves only this rank's tokens."""
        if column.seq_gathers:
            self._check(x, self.tokens // self.ws, column, "input")
            full, local = self._shared_gather(x)
        elif self._parent is not None and self._parent[0] is x:  # the parent's gathered input (most models)
            full, local = x, self._parent[1]
        elif x.numel() // max(x.shape[-1], 1) == self.tokens // self.ws != self.tokens and self.side_inputs:
            full, local = self._shared_gather(x)  # this rank's tokens beside the parent's input (MobileBERT's value)
        elif not (x.requires_grad and torch.is_grad_enabled()):  # no backward: only the forward must be right
            return _matmul(x, column.weight, column.reverse)
        elif self._derives_from_gather(x):  # computed from the gathered input inside the parent (a norm)
            self._check(x, self.tokens, column, "input")
            full = x  # replicated on every rank: cut this rank's chunk for the backward
            local = x.detach().narrow(-2, dist.get_rank(self.group) * (x.shape[-2] // self.ws),
                                      x.shape[-2] // self.ws).contiguous()
        else:  # a side input from outside the blocks (DeBERTa's relative embeddings): plain TP's copy
            return _matmul(self._copied(x), column.weight, column.reverse)
        return _SeqLinear.apply(full, local, column.weight, column.reverse, self.group)

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
            if self.batch is not None and hidden.shape[0] != self.batch:
                raise SequenceParallelError(
                    f"sequence parallelism: {block_name} takes hidden states of shape {tuple(hidden.shape)} for a "
                    f"batch of {self.batch}: they are not batch first (B, T, H), so tpmap "
                    "cannot tell which dimension is the sequence. Apply without sequence_parallel for this model")
            self.active = self._active[stack] = hidden.shape[SEQ_DIM] % self.ws == 0
            self.tokens = hidden.shape[0] * hidden.shape[SEQ_DIM]
            self._full_shape = hidden.shape[:2]
            self._shared = self._parent = None
            self._gathers, self._copies = set(), {}
            return put(split_to_sequence_region(hidden, self.group, SEQ_DIM) if self.active else hidden)
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
        return None

    def leave_block(self, module, args, output):
        if self.active and module.training:
            rng.leave_sharded_region()
        return None

    def gather_last_output(self, stack: int):
        def hook(module, args, output):
            self._shared = self._parent = None

            def gather(y):  # (B, T/ws, H) -> (B, T, H); backward: this rank's chunk (what follows is replicated)
                if self.active:
                    y = gather_from_sequence_region(y, self.group, SEQ_DIM, reduce_grad=False)
                if y.requires_grad and torch.is_grad_enabled():
                    y = _Mark.apply(y, self, stack, self.active)
                return y

            mapped = map_first_tensor(output, gather)
            if mapped is not None:
                return mapped
            raise SequenceParallelError(f"sequence parallelism: the last block ({type(module).__name__}) returned "
                                        f"{type(output).__name__}, not hidden states (or a tuple starting with them)")
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
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=self.group)
        return grad


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


def install(model: nn.Module, sp: SequencePlan, group) -> SequenceState:
    """Hook the blocks and parents, and point the blocks' Columns and Rows at one shared state."""
    state = SequenceState(group, len(sp.ends))
    model.register_forward_pre_hook(state.record_batch, with_kwargs=True)
    for stack, (first, last) in enumerate(sp.ends):
        model.get_submodule(first).register_forward_pre_hook(state.split_block_input(first, stack), with_kwargs=True)
        model.get_submodule(last).register_forward_hook(state.gather_last_output(stack))
    for name in sp.blocks:
        block = model.get_submodule(name)
        block.register_forward_pre_hook(state.split_side_inputs, with_kwargs=True)
        block.register_forward_pre_hook(state.enter_block, with_kwargs=True)
        block.register_forward_hook(state.leave_block)
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
    for name in sp.grad_allreduce:
        p = model.get_parameter(name)
        if p.requires_grad:
            stack = next(i for i, prefix in enumerate(stacks) if name.startswith(prefix))
            p.register_hook(functools.partial(state.summed, stack))
    return state
