"""Sequence parallelism's hooks, grouped by what they hook: the model and the sub-models that run a stack
(their batch), a stack's ends (split at its first block's input, gathered at its last block's output and
in the outputs of the modules enclosing it), every block (its side inputs, its outputs, its dropout
region), a Column's parent (its input gathered), and the modules run on the whole sequence (kept whole,
closed parents: gathered in, chunked out).

Each function here takes the model's `SequenceState` (and what it hooks) and returns the hook that
`engine.sequence.install_sequence_parallel` registers. Shapes: T is the whole sequence, tp_size the
tensor-parallel group's size; T/tp_size tokens are this rank's.
"""
from __future__ import annotations

import inspect

import torch
import torch.distributed as dist
from torch import nn

from tpmap.engine import rng
from tpmap.engine.collectives import gather_from_sequence_region, split_to_sequence_region
from tpmap.engine.errors import SequenceParallelError
from tpmap.engine.sequence_state import SEQ_DIM, SequenceState
from tpmap.engine.shard import map_first_tensor


# -- the model and the sub-models that run a stack: the batch their blocks must see -------------------------
def record_batch(state: SequenceState):
    """A hook on the model: its input's batch size."""
    def hook(module, args, kwargs):
        state.batch = _batch_of(args, kwargs)
    return hook


def record_stack_batch(state: SequenceState, stack: int):
    """A hook on the (sub-)model that runs stack `stack` (`owner`): the batch its blocks must see first. A
    vision tower of a multimodal model runs on every crop or frame of the batch's images: its batch is not
    the model input's."""
    def hook(module, args, kwargs):
        state.batches[stack] = _batch_of(args, kwargs)
    return hook


# -- a stack's ends: split at its first block's input, gathered at its last block's output -------------------
def split_block_input(state: SequenceState, block_name: str, stack: int):
    def hook(module, args, kwargs):
        hidden, put = _first_argument(module, args, kwargs)
        if not isinstance(hidden, torch.Tensor) or hidden.dim() != 3:
            raise SequenceParallelError(f"sequence parallelism: {block_name} takes "
                                        f"{type(hidden).__name__} {tuple(getattr(hidden, 'shape', ()))} first, "
                                        "not hidden states (B, T, H)")
        batch = state.batches.get(stack, state.batch)
        if batch is not None and hidden.shape[0] != batch:
            raise SequenceParallelError(
                f"sequence parallelism: {block_name} takes hidden states of shape {tuple(hidden.shape)} for a "
                f"batch of {batch}: they are not batch first (B, T, H), so tpmap "
                "cannot tell which dimension is the sequence. Apply without sequence_parallel for this model")
        if not state.start_stack(stack, hidden):
            return put(hidden)
        split = split_to_sequence_region(hidden, state.group, SEQ_DIM)
        state.split_states[stack][id(split)] = split  # recorded as the first hidden state
        return put(split)
    return hook


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


def _gather_output(state: SequenceState, y: torch.Tensor, stack: int, active: bool) -> torch.Tensor:
    """(B, T/tp_size, H) -> (B, T, H); backward: this rank's chunk (what follows is replicated)."""
    if active:
        y = gather_from_sequence_region(y, state.group, SEQ_DIM, reduce_grad=False)
    if y.requires_grad and torch.is_grad_enabled():
        y = _Mark.apply(y, state, stack, active)
    return y


def gather_last_output(state: SequenceState, stack: int):
    def hook(module, args, output):
        state.forget_gathers()
        mapped = map_first_tensor(output, lambda y: _gather_output(state, y, stack, state.active))
        if mapped is not None:
            return mapped
        raise SequenceParallelError(f"sequence parallelism: the last block ({type(module).__name__}) returned "
                                    f"{type(output).__name__}, not hidden states (or a tuple starting with them)")
    return hook


def gather_recorded_states(state: SequenceState, stack: int):
    """A hook on each module enclosing stack `stack` (its ModuleList's parent up to the model): a returned
    ModelOutput's recorded block outputs (``output_hidden_states=True``: ``hidden_states``,
    ``encoder_hidden_states``, ...) hold this rank's tokens for every block but the last; they are
    all-gathered as the last block's output is, before the model's own code reads them (Mllama's vision
    encoder stacks intermediate layers' outputs) or returns them. The innermost enclosing module gathers;
    the outer ones find them whole."""
    def hook(module, args, output):
        if not (state.stack_split.get(stack) and isinstance(output, dict)):
            return
        split = state.split_states[stack]

        def whole(y):  # only this stack's own split states: another stack's may have the same shape
            if isinstance(y, torch.Tensor) and split.get(id(y)) is y:
                return _gather_output(state, y, stack, True)
            return y
        for key in [k for k, v in output.items() if k.endswith("hidden_states") and isinstance(v, (tuple, list))]:
            output[key] = type(output[key])(whole(y) for y in output[key])
    return hook


# -- every block: its outputs, its other per-token inputs, its dropout region --------------------------------
def note_block_output(state: SequenceState, stack: int):
    """A hook on each block but a stack's last (gathered): its output holds this rank's tokens."""
    def hook(module, args, output):
        if state.stack_split.get(stack):
            map_first_tensor(output, lambda y: state.split_states[stack].__setitem__(id(y), y))
    return hook


def split_side_inputs(state: SequenceState):
    """Every block argument other than the hidden states that holds the whole sequence as they did,
    (B, T, ...): a per-token input (Gemma 4's per-layer inputs), split with them. Inside a parent it is
    gathered back with them (`_gather_arguments`), so position tables passed as tensors stay exact."""
    def hook(module, args, kwargs):
        if not (state.active and state.side_inputs):
            return None
        hidden, _ = _first_argument(module, args, kwargs)
        args, kwargs, _ = _map_arguments(
            args, kwargs, lambda a: a is not hidden and _per_token(a, state.full_shape),
            lambda a: split_to_sequence_region(a, state.group, SEQ_DIM))  # (B, T, ..) -> (B, T/tp_size, ..)
        return args, kwargs
    return hook


def enter_block(state: SequenceState):
    def hook(module, args, kwargs):
        if state.active and module.training:  # this rank's tokens: their own dropout masks
            rng.enter_sharded_region(dist.get_rank(state.group), _device(module))
        return
    return hook


def leave_block(state: SequenceState):
    def hook(module, args, output):
        if state.active and module.training:
            rng.leave_sharded_region()
        return
    return hook


# -- a Column's parent: its input gathered -----------------------------------------------------------------
def _split_input(state: SequenceState, module, args, kwargs):
    """(the hidden states, this rank's tokens, first in args/kwargs; a function that replaces them)."""
    hidden, put = _first_argument(module, args, kwargs)
    if not isinstance(hidden, torch.Tensor):
        raise SequenceParallelError(f"sequence parallelism: {type(module).__name__} is run on the whole sequence "
                                    f"but takes {type(hidden).__name__} first, not the hidden states")
    state.check(hidden, state.tokens // state.tp_size, module, "input")
    return hidden, put


def gather_parent_input(state: SequenceState):
    def hook(module, args, kwargs):
        if not state.active:
            return None
        hidden, put = _split_input(state, module, args, kwargs)
        full = state.gather(hidden)  # (B, T/tp_size, H) -> (B, T, H)
        state.parent = (full, hidden.detach())
        return put(full)  # other arguments stay as they are: a residual added to the Row's output stays split
    return hook


# -- modules run on the whole sequence (kept whole, closed parents): gathered in, chunked out ---------------
def _gather_arguments(state: SequenceState, hidden: torch.Tensor, args: tuple, kwargs: dict):
    """All-gather the first argument and every other argument holding this rank's tokens as it does,
    (B, T/tp_size, ...), for a module run on the whole sequence (a residual it adds inside, too); the others
    (masks, position tables) are whole already. Returns (args, kwargs, {id(tensor): gathered})."""
    return _map_arguments(args, kwargs,
                          lambda a: a is hidden or (state.side_inputs and _per_token(a, hidden.shape[:2])),
                          lambda a: state.gather(a, SEQ_DIM))  # (B, T/tp_size, ..) -> (B, T, ..)


def gather_whole_input(state: SequenceState):
    """A module kept whole (a partial mapping's attention) mixes all the tokens: it runs on the gathered
    sequence on every rank, and `chunk_whole_output` keeps this rank's tokens of its output. Backward:
    each rank's input gradient is its chunk's part, summed over the ranks by the gather's reduce-scatter;
    its whole parameters' gradients are summed like a norm's. A parent whose Row's output meets its
    own gathered input (ALBERT's attention: residual and LayerNorm inside) runs the same way.
    A tensor from outside the blocks that it reads too (a decoder's cross-attention reading the encoder's
    output) gets plain TP's copy: each rank's gradient covers only its chunk, summed by the copy's backward."""
    def hook(module, args, kwargs):
        if not state.active:
            return None
        hidden, _ = _split_input(state, module, args, kwargs)
        args, kwargs, gathered = _gather_arguments(state, hidden, args, kwargs)
        state.parent = (gathered[id(hidden)], hidden.detach())
        args, kwargs, _ = _map_arguments(
            args, kwargs, lambda a: isinstance(a, torch.Tensor) and a.requires_grad and torch.is_grad_enabled()
            and not any(a is g for g in gathered.values()) and not state.derives_from_gather(a), state.copied)
        return args, kwargs
    return hook


def chunk_whole_output(state: SequenceState):
    def hook(module, args, output):
        if not state.active:
            return None
        rank = dist.get_rank(state.group)
        first = output if isinstance(output, torch.Tensor) else output[0] if isinstance(output, (tuple, list)) \
            and output else None
        if not isinstance(first, torch.Tensor):
            raise SequenceParallelError(f"sequence parallelism: {type(module).__name__} returned "
                                        f"{type(output).__name__}, not hidden states (or a tuple starting with them)")
        state.check(first, state.tokens, module, "output")
        chunks: dict[int, torch.Tensor] = {}

        def chunk(y):  # (B, T, ..) -> (B, T/tp_size, ..); backward: zeros outside this rank's tokens
            if not (isinstance(y, torch.Tensor) and y.dim() == 3 and y.shape[:2] == first.shape[:2]):
                return y
            if id(y) not in chunks:
                n = y.shape[1] // state.tp_size
                chunks[id(y)] = y.narrow(1, rank * n, n).clone(memory_format=torch.contiguous_format)
            return chunks[id(y)]
        if isinstance(output, torch.Tensor):
            return chunk(output)
        mapped = [chunk(y) for y in output]  # every per-token output (MobileBERT's bottleneck returns four)
        return mapped if isinstance(output, list) else type(output)(*mapped) if hasattr(output, "_fields") \
            else tuple(mapped)
    return hook


# -- a forward's arguments ---------------------------------------------------------------------------------
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


def _device(module: nn.Module) -> torch.device:
    p = next(module.parameters(), None)
    return p.device if p is not None else torch.device("cpu")
