"""An independent reference for tensor-parallel slicing: which elements of a split dimension rank r
holds, decided element by element from the layout rules, without engine.pieces, ParamLayout.pieces,
ParamLayout.indices or engine.shard.take. The property tests compare the engine's slicing with it, and
the rank tests slice the unsharded gradients and checkpoint tensors with it.

The rules, for element i of a split dimension of D features at world size ws:

* plain: D in ws equal consecutive parts, rank r holds part r;
* sections (fused [q | k | v], [gate | up]): each section is split on its own by these rules;
* heads: a section of H heads of S / H features each. H a multiple of ws: rank r holds the heads
  [r * H / ws, (r + 1) * H / ws). ws a multiple of H (fewer KV heads than ranks): the ranks form H
  consecutive blocks of ws / H ranks, block h holds head h (each head replicated on ws / H ranks);
* groups (Falcon's [kv, q_per_kv + 2, d]): G equal groups, each laid out by the sections. G a multiple
  of ws: rank r holds the groups [r * G / ws, (r + 1) * G / ws) whole. ws a multiple of G: the ranks
  form G consecutive blocks of m = ws / G, block g shares group g, whose sections are split over its m
  ranks as above (sub-rank r % m). More groups than ranks otherwise: whole groups, the first G % ws ranks holding
  one more. Fewer groups than ranks otherwise (not a divisor of ws, or a shared group whose heads its m ranks do
  not split evenly), each section of a group holds its Q query heads or one head: the
  G * Q query heads are split by the head rule, and rank r holds, group by group, c / g copies of each group it
  reads c query heads of (g the gcd of those counts), each copy its next g query heads and the one-head sections
  whole (Falcon's layout with fewer groups than ranks: the key and value repeated as HF's view pairs them);
* vocabulary: ceil(V / ws) rows per rank, rank r holds rows [r * ceil(V / ws), ...) that exist; every
  rank's local tensor is padded with zero rows to ceil(V / ws).
* uneven (a plain dim or H heads that ws does not divide, H > ws): item i (a feature, or a head) belongs to
  the rank r whose block holds it, the first D % ws ranks holding one item more than the others;
* aligned (stacked experts: a Param entry's parameter of 3 or more dims split along another dim than its first,
  e.g. Mixtral's [E, 2I, H] along 2I): transformers' grouped matmul needs 16-byte-aligned strides, so a plain
  section whose width is a multiple of u = 16 bytes / element size is cut into units of u consecutive features,
  and the units are dealt out by the plain / uneven rules above (feature k goes where its unit k // u goes); the
  other tensors of the same Param entry with the same width (a bias [E, 2I]) take the same unit;
* interleaved (k sections stored [a0 b0 a1 b1 ...]): element i is feature i // k of a plain section of D / k
  features, laid out by the rules above (aligned included), so feature j's k elements stay together;
* key/value heads of Q query heads (query_heads; query head j reads KV head j // (Q / H)): rank r holds
  the KV heads its own query heads (the rules above, on Q) read, each m / g times, m the number of its
  query heads reading it and g the gcd of those counts.

A rank's local tensor holds its elements in ascending order of their full index (then the padding); a KV
head held several times is its block of features repeated.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Layout:
    """How one split dimension of `size` features is laid out (the sections of one group)."""

    size: int
    sections: tuple[tuple, ...] = ()  # (size, heads[, query heads]) of each section; () = one plain section
    groups: int | None = None
    vocab: bool = False
    align: int = 1  # the unit (elements) of aligned plain sections (stacked experts); 1 = none
    interleave: int = 1  # k sections interleaved feature by feature: element i is feature i // k (gpt-oss's gate_up)


def _block_owner(i: int, n: int, m: int) -> int:
    """The rank (of m) whose block holds item i of n, the first n % m ranks holding one item more."""
    small, extra = divmod(n, m)
    return i // (small + 1) if i < extra * (small + 1) else extra + (i - extra * (small + 1)) // small


def _head_owners(head: int, heads: int, m: int) -> set[int]:
    if heads % m == 0:
        return {head // (heads // m)}
    if m % heads == 0:
        per_head = m // heads  # the block of ranks that replicates this head
        return set(range(head * per_head, (head + 1) * per_head))
    assert heads > m, (heads, m)
    return {_block_owner(head, heads, m)}


def _kv_copies(head: int, heads: int, query: int, m: int, rank: int) -> int:
    """How many times `rank` holds KV head `head` of `heads`, read by `query` query heads."""
    group = query // heads
    mine = [j for j in range(query) if rank in _head_owners(j, query, m)]
    reads = {h: sum(1 for j in mine if j // group == h) for h in {j // group for j in mine}}
    g = 0
    for count in reads.values():
        g = math.gcd(g, count)
    return reads.get(head, 0) // g if g else 0


def _section_of(j: int, sections, unit: int) -> tuple[int, tuple]:
    """(start, section) of the section holding feature j."""
    start = 0
    for section in sections or ((unit, None),):
        if j < start + section[0]:
            return start, section
        start += section[0]
    raise AssertionError(f"feature {j} lies beyond the sections {sections}")


def _in_sections(j: int, sections, unit: int, m: int, align: int = 1) -> set[int]:
    """The sub-ranks (of m) holding feature j of one unit (a whole dim, or a group) laid out by `sections`."""
    start, (size, heads, *query) = _section_of(j, sections, unit)
    k = j - start
    if heads is None and align > 1 and size % align == 0:  # aligned: units of `align` features dealt out
        k, size = k // align, size // align
    if heads is None:
        return {k // (size // m)} if size % m == 0 else {_block_owner(k, size, m)}
    head = k // (size // heads)
    if query and query[0] is not None and query[0] != heads:
        return {r for r in range(m) if _kv_copies(head, heads, query[0], m, r)}
    return _head_owners(head, heads, m)


def owners(layout: Layout, ws: int, i: int) -> set[int]:
    """The ranks that hold feature i."""
    if layout.vocab:
        return {i // -(-layout.size // ws)}
    if layout.interleave > 1:  # one plain section of size / k features, each k elements wide
        return _in_sections(i // layout.interleave, (), layout.size // layout.interleave, ws, layout.align)
    if layout.groups is None or layout.groups == 1:
        return _in_sections(i, layout.sections, layout.size, ws, layout.align)
    g_count = layout.groups
    unit = layout.size // g_count
    g, j = divmod(i, unit)
    if g_count % ws == 0:
        return {g // (g_count // ws)}
    if g_count > ws:  # uneven: whole groups, the first G % ws ranks holding one more
        return {_block_owner(g, g_count, ws)}
    assert ws % g_count == 0, (g_count, ws)
    m = ws // g_count
    return {g * m + s for s in _in_sections(j, layout.sections, unit, m)}


def held(layout: Layout, ws: int, rank: int) -> list[int]:
    """The full indices rank `rank` holds, in local order (a KV head held c times: its block c times)."""
    return list(_held(layout, ws, rank))


@functools.lru_cache(maxsize=4096)
def _held(layout: Layout, ws: int, rank: int) -> tuple[int, ...]:
    """held(), decided once per (layout, ws, rank) in a process: every layer of a model repeats its layouts,
    and a rank process meets the same ones case after case (the decision is element by element, slow)."""
    return tuple(_decide(layout, ws, rank))


def groups_by_query(layout: Layout, ws: int) -> bool:
    """Whether the groups follow the uneven rule by query heads: fewer groups than ranks, G not (with every head
    count of a group splitting evenly over the m = ws / G ranks sharing it) a divisor of ws."""
    g_count = layout.groups or 1
    if g_count == 1 or g_count % ws == 0 or g_count > ws:
        return False
    return ws % g_count != 0 or any(h is not None and h % (ws // g_count) and (ws // g_count) % h
                                    for _, h, *_ in layout.sections)


def _decide_by_query(layout: Layout, ws: int, rank: int) -> list[int]:
    """Uneven groups: the G * Q query heads (Q the most heads of a group's sections) split by the head rule; for
    each group, in order, with c of its query heads on this rank starting at its query head f, and g the gcd of
    those counts over the groups: c / g copies of the group, copy i holding query heads f + i*g .. f + i*g + g - 1
    of its Q-head sections and the whole of its one-head sections."""
    g_count, unit = layout.groups, layout.size // layout.groups
    q = max(h for _, h, *_ in layout.sections)
    mine = [j for j in range(g_count * q) if rank in _head_owners(j, g_count * q, ws)]
    counts = {j // q: sum(1 for k in mine if k // q == j // q) for j in mine}
    firsts = {group: min(j for j in mine if j // q == group) - group * q for group in counts}
    g = 0
    for c in counts.values():
        g = math.gcd(g, c)
    out = []
    for group in sorted(counts):
        for copy in range(counts[group] // g):
            at = group * unit
            for size, heads, *_ in layout.sections:
                width = size // heads
                first = firsts[group] + copy * g
                out += range(at + first * width, at + (first + g) * width) if heads == q else range(at, at + size)
                at += size
    return out


def _decide(layout: Layout, ws: int, rank: int) -> list[int]:
    if groups_by_query(layout, ws):
        return _decide_by_query(layout, ws, rank)
    ones = [i for i in range(layout.size) if rank in owners(layout, ws, i)]
    if layout.vocab or (layout.groups or 1) > 1 or not any(len(s) > 2 and s[2] is not None for s in layout.sections):
        return ones
    out, at = [], 0
    for size, heads, query in layout.sections:
        mine = [i for i in ones if at <= i < at + size]
        if query is None or query == heads:
            out += mine
        else:
            width = size // heads
            for head in range(heads):
                block = [i for i in mine if (i - at) // width == head]
                out += block * (_kv_copies(head, heads, query, ws, rank) if block else 0)
        at += size
    return out


def local_length(layout: Layout, ws: int, rank: int) -> int:
    """The local length of the split dim (padded for a vocabulary)."""
    return -(-layout.size // ws) if layout.vocab else len(held(layout, ws, rank))


def local_slice(full: torch.Tensor, dim: int, layout: Layout, ws: int, rank: int) -> torch.Tensor:
    """Rank `rank`'s local tensor of `full`, split along `dim`: its features in order, then zero padding."""
    assert full.shape[dim] == layout.size, (tuple(full.shape), dim, layout)
    index = torch.tensor(held(layout, ws, rank), dtype=torch.long, device=full.device)
    out = full.detach().index_select(dim, index)
    pad = local_length(layout, ws, rank) - len(index)
    if pad:
        shape = list(full.shape)
        shape[dim] = pad
        out = torch.cat([out, full.new_zeros(shape)], dim)
    return out.contiguous()


# -- layouts of a model's parameters, from its mapping ------------------------------------------------
@dataclass(frozen=True)
class Split:
    """How a mapping says one tensor of a model is spread: split along `dim` by `layout`, whole on every
    rank (`dim` None: a Row's bias), or `partial` (whole on rank 0, zeros elsewhere)."""

    dim: int | None
    layout: Layout | None
    partial: bool = False

    def local(self, full: torch.Tensor, ws: int, rank: int) -> torch.Tensor:
        if self.partial:
            return full.detach().clone() if rank == 0 else torch.zeros_like(full.detach())
        if self.dim is None:
            return full.detach().clone()
        return local_slice(full, self.dim, self.layout, ws, rank)

    def local_numel(self, full_shape, ws: int, rank: int) -> int:
        if self.partial or self.dim is None:
            return int(torch.Size(full_shape).numel())
        shape = list(full_shape)
        shape[self.dim] = local_length(self.layout, ws, rank)
        return int(torch.Size(shape).numel())


def _sections(entry, unit: int, evaluate) -> tuple[tuple[int, int | None, int | None], ...]:
    """The (size, heads, query heads) of an entry's sections within one unit of `unit` features, from the entry's own
    fields: sized sections as stated, unsized ones share the rest in proportion to their heads (1 each)."""
    if isinstance(entry.sections, str):  # a count given as an expression
        specs = [(None, entry.heads)] * evaluate(entry.sections)
    else:
        specs = entry.section_specs()
    queries = [entry.query_heads] * len(specs) if isinstance(entry.sections, str) else entry.query_specs()
    sizes = [None if s is None else evaluate(s) for s, _ in specs]
    heads = [None if h is None else evaluate(h) for _, h in specs]
    query = [None if q is None else evaluate(q) for q in queries]
    unsized = [k for k, s in enumerate(sizes) if s is None]
    if unsized:
        rest = unit - sum(s for s in sizes if s is not None)
        weight = sum(heads[k] or 1 for k in unsized)
        for k in unsized:
            sizes[k] = rest // weight * (heads[k] or 1)
    assert sum(sizes) == unit, (entry, sizes, unit)
    return tuple(zip(sizes, heads, query))


def _layout(entry, size: int, evaluate, align: int = 1) -> Layout:
    if getattr(entry, "interleaved", False):
        return Layout(size, (), align=align, interleave=entry.sections)
    groups = None if entry.groups is None else evaluate(entry.groups)
    unit = size // groups if groups else size
    return Layout(size, _sections(entry, unit, evaluate), groups, align=align)


def splits(full: torch.nn.Module, loaded, plan, ws: int) -> dict[str, Split]:
    """Every tensor of the unsharded model `full` that `plan` splits (by full name, tied aliases included),
    with its dim and layout derived from the mapping entry that claims it and `full`'s own modules: which
    entry comes from the plan (ModuleShard.entry; for Param tensors, the entry whose pattern and params
    name it), everything else from the entry's fields, the config and the module kinds."""
    from torch import nn

    from tpmap.engine.planner import EntryContext, base_prefix, composed
    from tpmap.language.expr import evaluate as evaluate_expr
    from tpmap.language.patterns import match_entry
    from tpmap.language.schema import Column, Norm, Param, entry_applies, layer_selected

    loaded = composed(full, loaded)  # a composing mapping's entries, as the plan numbers them
    entries = loaded.mapping.entries

    views: dict = {}

    def evaluator(index: int, name: str):  # in a heterogeneous config, the expressions read the module's layer's
        ctx = EntryContext(full.config, loaded, index, ws).at_layer(name, views)  # config, and at_layer(...)'s layer
        return lambda text: evaluate_expr(text, ctx.lookup, ws, 0, at_layer=ctx.layer_entry)

    out: dict[str, Split] = {}
    for ms in plan.modules:
        if ms.weight is None:
            continue  # a Norm without a weight (statistic l2): nothing to slice
        module = full.get_submodule(ms.name)
        if ms.style in ("vocab_embedding", "vocab_head"):  # (V, H) weight, (V,) bias: rows of the vocabulary
            layout = Layout(module.weight.shape[0], vocab=True)
            weight, bias = Split(0, layout), Split(0, layout)
        else:
            entry = entries[ms.entry]
            column = isinstance(entry, Column)
            if isinstance(entry, Norm):
                dim = 0
            elif isinstance(module, nn.Embedding):
                dim = 1
            elif isinstance(module, nn.Linear):
                dim = 0 if column else 1
            else:  # a weight stored [in, out] (reverse: true)
                dim = 1 if column else 0
            weight = Split(dim, _layout(entry, module.weight.shape[dim], evaluator(ms.entry, ms.name)))
            bias = Split(0, weight.layout) if column or isinstance(entry, Norm) else Split(None, None)
        out[ms.weight.name] = weight
        if ms.bias is not None:
            out[ms.bias.name] = bias
    _, prefix = base_prefix(full)
    base = full.get_submodule(prefix[:-1]) if prefix else full
    modules = dict(base.named_modules())
    for t in plan.tensors:
        owner, _, pname = t.name.rpartition(".")
        rel = owner[len(prefix):]
        claims = [i for i, e in enumerate(entries) if isinstance(e, Param)
                  and entry_applies(e, loaded.config_of("entries", i, full.config),
                                    loaded.mapping.config_defaults, experts=loaded.experts)
                  and pname in e.params and rel in match_entry(e, modules)
                  and (not e.when_layer or layer_selected(
                      e.when_layer, rel, loaded.config_of("entries", i, full.config), loaded.mapping.config_defaults))]
        assert len(claims) == 1, (t.name, claims)
        entry = entries[claims[0]]
        tensor = getattr(full.get_submodule(owner), pname)
        shape = (len(tensor),) if isinstance(tensor, nn.ModuleList) else tuple(tensor.shape)
        if entry.partial:
            out[t.name] = Split(None, None, partial=True)
            continue
        dim = entry.dim + len(shape) if entry.dim < 0 else entry.dim
        align = 1  # stacked experts ([E, 2I, H] along 2I) are aligned, and so are the entry's tensors of that width
        for other in (getattr(full.get_submodule(owner), n) for n in entry.params):
            other_dim = entry.dim % other.dim() if isinstance(other, nn.Parameter) else 0
            if isinstance(tensor, nn.Parameter) and other.dim() >= 3 and other_dim and \
                    other.shape[other_dim] == shape[dim]:
                align = max(align, 16 // other.element_size())
        out[t.name] = Split(dim, _layout(entry, shape[dim], evaluator(claims[0], rel), align))
    for shard in plan.params.values():  # tied names see the same split
        for alias in shard.aliases:
            out.setdefault(alias, out[shard.name])
    return out
