"""Sequence parallelism at run time: the hooks and autograd functions that split the tokens at each
stack's first block, gather them for each Column's parent, and reduce-scatter each Row's output.

Where each collective goes, and why, is decided by `engine.sequence_plan` (its docstring states the
math); this module only carries a `SequencePlan` out: `install_sequence_parallel` registers the hooks of
`engine.sequence_hooks` and points the blocks' Columns and Rows at one `engine.sequence_state.SequenceState`.
"""
from __future__ import annotations

import functools

from torch import nn

from tpmap.engine import sequence_hooks as hooks
from tpmap.engine.sequence_plan import SequencePlan
from tpmap.engine.sequence_state import SequenceState


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


def install_sequence_parallel(model: nn.Module, sp: SequencePlan, group) -> SequenceState:
    """Hook the blocks and parents, and point the blocks' Columns and Rows at one shared state."""
    state = SequenceState(group, len(sp.ends))
    model.register_forward_pre_hook(hooks.record_batch(state), with_kwargs=True)
    for stack, (first, last) in enumerate(sp.ends):
        model.get_submodule(owner(model, first)).register_forward_pre_hook(hooks.record_stack_batch(state, stack),
                                                                           with_kwargs=True)
        model.get_submodule(first).register_forward_pre_hook(hooks.split_block_input(state, first, stack),
                                                             with_kwargs=True)
        model.get_submodule(last).register_forward_hook(hooks.gather_last_output(state, stack))
        parts = first.split(".")[:-2]  # the ModuleList's parent, then each module enclosing it up to the model
        for n in range(len(parts), -1, -1):
            model.get_submodule(".".join(parts[:n])).register_forward_hook(hooks.gather_recorded_states(state, stack))
    stack_of = {name: i for name in sp.blocks for i, (first, _) in enumerate(sp.ends)
                if name.rpartition(".")[0] == first.rpartition(".")[0]}
    lasts = {last for _, last in sp.ends}
    for name in sp.blocks:
        block = model.get_submodule(name)
        if name not in lasts:
            block.register_forward_hook(hooks.note_block_output(state, stack_of[name]))
        block.register_forward_pre_hook(hooks.split_side_inputs(state), with_kwargs=True)
        block.register_forward_pre_hook(hooks.enter_block(state), with_kwargs=True)
        block.register_forward_hook(hooks.leave_block(state), always_call=True)  # also when it raises (RegionGuard)
    for name in sp.parents:
        model.get_submodule(name).register_forward_pre_hook(hooks.gather_parent_input(state), with_kwargs=True)
    for name in sp.whole:
        module = model.get_submodule(name)
        module.register_forward_pre_hook(hooks.gather_whole_input(state), with_kwargs=True)
        module.register_forward_hook(hooks.chunk_whole_output(state))
    _point_linears_at(model, sp, state)
    stacks = [first.rpartition(".")[0] + "." for first, _ in sp.ends]
    state.stack_prefixes = tuple(stacks)
    for name in sp.grad_allreduce:
        p = model.get_parameter(name)
        if p.requires_grad:
            stack = next(i for i, prefix in enumerate(stacks) if name.startswith(prefix))
            p.register_hook(functools.partial(state.summed, stack))
    return state


def _point_linears_at(model: nn.Module, sp: SequencePlan, state: SequenceState) -> None:
    """The blocks' Columns and Rows call `state` while a forward runs split (`layers`: their `seq`)."""
    for name, gathers in sp.columns:
        column = model.get_submodule(name)
        column.__dict__["seq"], column.seq_gathers = state, gathers
    for name in sp.rows:
        model.get_submodule(name).__dict__["seq"] = state
    for name in sp.closed_rows:
        row = model.get_submodule(name)
        row.__dict__["seq"], row.seq_closed = state, True
