"""Sequence parallelism (Megatron-SP), opt-in: `tpmap.apply(..., sequence_parallel=True)`.

Between the tensor-parallel regions of the repeated blocks, plain TP holds every token on every rank
and computes norms, dropout and residual adds tp_size times over. SP keeps those activations split along
the sequence instead (rank r holds tokens [r*T/tp_size, (r+1)*T/tp_size), tp_size the group's size):

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
  autograd graph (`SequenceState.derives_from_gather`), so no gradient is summed twice or missed.
* A module the mapping keeps whole inside a block (a partial mapping's attention) mixes all the tokens:
  it runs on the gathered sequence and keeps this rank's chunk of every per-token output; a tensor from
  outside the blocks that it reads (an encoder's output) takes plain TP's copy. So does a "closed"
  parent, whose Row's output meets its own gathered input before it returns (ALBERT's attention adds the
  residual and normalizes inside); its Rows all-reduce (reduce-scatter + all-gather).
* In a one-stack model, other block arguments shaped like the hidden states, (B, T, F), are split with
  them (Gemma 4's per-layer inputs), and gathered back with them where a module runs on the whole
  sequence. Not with several stacks: there a (B, T, F) argument may be the encoder's output, whole.
* Sibling ModuleLists holding Columns under one parent (XLM's ``attentions`` and ``ffns``, Qwen3-VL's
  ``blocks`` and ``deepstack_merger_list``) are refused: the model's loop interleaves their items, so no one
  of them is a stack whose first input could be split and last output gathered. Stacks of their own
  (an encoder's, a decoder's) have different parents.
* A per-head embedding Column (T5's relative position bias) inside a gathered parent is looked up for
  the whole sequence, as in plain TP. Parents that are items of a ModuleList/ModuleDict (experts) are
  refused: they are called with the tokens routed to them.
* The hidden states must be batch first: a block input whose first dimension is not the batch of the
  (sub-)model that runs its stack (XLNet's (T, B, H)) raises at the forward. That model is the innermost
  transformers model enclosing the stack (`sequence.owner`): a multimodal model's vision tower runs on every
  crop or frame of the batch's images (LLaVA-NeXT's anyres crops, Video-LLaVA's frames), so its batch is its
  own input's, not the model input's.

Block outputs a model records (``output_hidden_states=True``) hold this rank's tokens for every block but
the last: each module enclosing a stack gathers those in its returned ModelOutput (`gather_recorded_states`),
before the model's own code reads them or returns them.

A forward whose sequence length is not a multiple of tp_size (a decode step of generate) runs as plain
TP. Which kind a backward's gradients came from is recorded in the graph (`_Mark`), so the whole
parameters' all-reduce follows it, per stack (an encoder input that divides and a decoder input that
does not is fine); mixing both kinds in one stack in one backward raises.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from tpmap.engine.blocks import block_prefixes
from tpmap.engine.errors import SequenceParallelError
from tpmap.engine.plan import Plan
from tpmap.language.patterns import match_modules


def _token_wise() -> tuple:
    """Module classes that compute each token on its own (a whole one is exact on split tokens)."""
    return (nn.Linear, Conv1D)


@dataclass(frozen=True, kw_only=True)
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


def plan_sequence_parallel(model: nn.Module, plan: Plan) -> SequencePlan:
    """Check that `model` under `plan` can keep its inter-block activations split along the sequence,
    and say where the collectives go. Reads the model, changes nothing; raises SequenceParallelError."""
    if plan.refuse_sequence_parallel:  # the mapping knows what these checks cannot see
        raise _refuse(type(model).__name__, plan.refuse_sequence_parallel)
    base = model.get_submodule(plan.base_prefix[:-1]) if plan.base_prefix else model
    blocks, ends = _find_stacks(model, plan, base)
    kept = _kept_whole(plan, base, blocks)
    shards = {m.name: m for m in plan.modules if any(m.name.startswith(b + ".") for b in blocks)}
    if not any(m.style == "column" for m in shards.values()):
        raise _refuse(type(model).__name__, "nothing in its blocks is split (no Column), so there is no "
                      "tensor-parallel region whose all-reduces could become reduce-scatters")
    columns, parents, tables = _gather_points(model, shards, blocks)
    rows = [m.name for m in shards.values() if m.style == "row"]
    closed = _closed_parents(model, parents, rows, shards)
    parents -= set(closed)
    _refuse_experts(model, parents)
    whole = sorted(kept + closed)
    _check_whole_and_tables(whole, parents, tables)
    split_tensors = {t.name for t in plan.tensors}
    for block in blocks:
        _check_block_modules(model, plan, block, kept, parents, shards, split_tensors)
    grad_allreduce = _whole_parameters(model, plan, blocks, split_tensors)
    closed_rows = tuple(r for r in rows if any(r.startswith(c + ".") for c in closed))
    return SequencePlan(blocks=tuple(blocks), ends=ends, parents=tuple(sorted(parents)), columns=tuple(columns),
                        rows=tuple(r for r in rows if r not in closed_rows), grad_allreduce=tuple(grad_allreduce),
                        whole=tuple(whole), closed_rows=closed_rows)


def _within(name: str, roots) -> bool:
    """Whether `name` is one of `roots` or inside one."""
    return any(name == r or name.startswith(r + ".") for r in roots)


def _find_stacks(model: nn.Module, plan: Plan, base: nn.Module) -> tuple[list[str], tuple[tuple[str, str], ...]]:
    """(the repeated blocks, in order; (first block, last block) of each stack). Refuses Columns in sibling
    ModuleLists and a model without a stack."""
    blocks = [plan.base_prefix + b for b in block_prefixes(base)]
    column_names = [m.name for m in plan.modules if m.style == "column"]
    holding = {b.rpartition(".")[0] for b in blocks if any(c.startswith(b + ".") for c in column_names)}
    if len(holding) == 1:  # other ModuleLists hold no Column (Gemma 3n's AltUp projections): not blocks
        blocks = [b for b in blocks if b.rpartition(".")[0] in holding]
    stacks = sorted({b.rpartition(".")[0] for b in blocks})
    siblings: dict[str, list[str]] = {}
    for s in sorted(holding):
        siblings.setdefault(s.rpartition(".")[0], []).append(s)
    for parent, lists in siblings.items():
        if len(lists) > 1:  # an encoder's and a decoder's stacks have parents of their own
            raise _refuse(parent or type(model).__name__, f"its split modules sit in sibling ModuleLists "
                          f"({', '.join(lists)}) whose items the model's own loop interleaves; sequence "
                          "parallelism splits the input of one stack of whole blocks and gathers its output")
    if not stacks:
        raise _refuse(type(model).__name__, "it has no stack of repeated blocks (a ModuleList of layers) whose "
                      "first input could be split and last output gathered")
    # Each stack (an encoder's, a decoder's) runs as a unit: split at its first block, gathered at its last.
    # Its output, whole again, reaches the other stack as a side input (cross-attention's keys and values).
    ends = tuple((min(group, key=_index), max(group, key=_index))
                 for group in ([b for b in blocks if b.rpartition(".")[0] == s] for s in stacks))
    return blocks, ends


def _kept_whole(plan: Plan, base: nn.Module, blocks: list[str]) -> list[str]:
    """The outermost modules inside the blocks that the mapping keeps whole, sorted."""
    names = dict(base.named_modules())  # the mapping's patterns are relative to the base model
    whole = sorted({plan.base_prefix + n for pattern, _, _ in plan.kept_whole for n in match_modules(pattern, names)
                    if any((plan.base_prefix + n).startswith(b + ".") for b in blocks)})
    return [n for n in whole if not any(n.startswith(w + ".") for w in whole)]  # the outermost


def _gather_points(model: nn.Module, shards: dict, blocks: list[str]) -> tuple[list, set, list]:
    """(columns: (name, gathers its own input), parents whose first argument is gathered, per-head embedding
    Columns). Refuses a Column that does not follow the Column -> Row pattern."""
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
    return columns, parents, tables


def _closed_parents(model: nn.Module, parents: set, rows: list[str], shards: dict) -> list[str]:
    """A parent whose Row's output meets the parent's own (gathered) input before it returns -- ALBERT's
    attention adds the residual and applies the LayerNorm inside -- cannot return this rank's tokens from
    its Row: it is closed, run like a whole module (gather in, chunk out) with its Rows summing on every
    rank. Recognised by a norm over the Row's output width inside the parent (q/k norms are head-wide)."""
    return sorted(p for p in parents if _norm_after_row(model, p, [r for r in rows if r.startswith(p + ".")], shards))


def _refuse_experts(model: nn.Module, parents: set) -> None:
    """Parents that are items of a ModuleList / ModuleDict inside a block are experts: each is called with
    only the tokens routed to it, not with the hidden states its gather expects."""
    for p in sorted(parents):
        container = model.get_submodule(p.rpartition(".")[0])
        if isinstance(container, (nn.ModuleList, nn.ModuleDict)):
            raise _refuse(p, f"it is an item of a {type(container).__name__} of modules holding Columns (experts), "
                          "called with the tokens routed to it, not with the hidden states whose sequence tpmap splits")


def _check_whole_and_tables(whole: list[str], parents: set, tables: list[str]) -> None:
    """A module run whole must not sit inside a gathered parent; a per-head embedding Column must (or inside
    a module run whole): there it is looked up for the whole sequence, as in plain TP."""
    for w in whole:
        if any(w.startswith(p + ".") for p in parents):
            raise _refuse(w, "a module kept whole by the mapping sits inside a module whose input is gathered for "
                          "its Columns")
    for name in tables:
        if not (_within(name, parents) or any(name.startswith(w + ".") for w in whole)):
            raise _refuse(name, "an embedding Column inside a block but outside a module whose input is gathered "
                          "(an attention): its lookups would not cover the whole sequence")


def _check_block_modules(model: nn.Module, plan: Plan, block: str, kept: list[str], parents: set, shards: dict,
                         split_tensors: set[str]) -> None:
    """Refuse what in `block` cannot run on split tokens: modules under a Reduce or Enter entry, convolutions,
    matrices kept whole outside a Column (a router), tensors split by a Param entry outside a parent."""
    for rel, module in model.get_submodule(block).named_modules():
        name = f"{block}.{rel}" if rel else block
        if _within(name, kept):
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
        cut = [t for t in sorted(split_tensors) if t.startswith(name + ".") and t.count(".") == name.count(".") + 1]
        if cut and not _within(name, parents):
            raise _refuse(name, f"its tensors {', '.join(cut)} are split by a Param entry outside a Column's "
                          "module, where the tokens are split (a sequence mixer's state)")


def _whole_parameters(model: nn.Module, plan: Plan, blocks: list[str], split_tensors: set[str]) -> list[str]:
    """The parameters in the blocks kept whole and not summed yet: each rank's gradient covers only its
    tokens, so they are all-reduced over the group."""
    grad_allreduce = []
    params = plan.params
    for block in blocks:
        for rel, _ in model.get_submodule(block).named_parameters():
            name = f"{block}.{rel}"
            shard = params.get(name)
            if shard is not None and (shard.dim is not None or shard.partial):
                continue  # split: its gradient is this rank's slice already
            if name in plan.grad_allreduce or any(name.startswith(t + ".") for t in split_tensors):
                continue  # already summed over the ranks, or this rank's items of a split ModuleList
            grad_allreduce.append(name)
    return grad_allreduce


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
