"""Which features of a split dimension each rank holds: the slicing math, in one place, on integers.

A split dimension is a list of *sections* (blocks stored one after the other, e.g. [q | k | v] or
[gate | up]); each section is split over the ranks on its own and every rank's pieces are regrouped
in order, so rank r holds [q_r | k_r | v_r]. A section with ``heads`` is split on head boundaries
by `tpmap.language.expr.rank_heads`: with fewer heads than ranks (MQA/GQA K/V) each head is replicated
by vLLM's rule, rank r holds head ``r // (tp_size / heads)``. At a world size that does not divide the
heads (planned as *uneven*), ranks hold ``heads // tp_size`` or one more, and key/value heads that name
their ``query_heads`` follow the query heads: each rank holds every KV head its query heads read,
repeated so that HF's ``repeat_kv`` pairs them (a head may then appear on two ranks, or twice on one).
Plain features split unevenly the same way (``size // tp_size``, one more on the first ranks).
A plain section may carry an alignment *unit* as a 4th item, ``(size, None, None, unit)``: it is then split in
whole units (``size // unit`` units dealt out as above), so that every rank's width is a multiple of the unit
(stacked experts: transformers' grouped matmul needs 16-byte-aligned strides, see `aligned`).
Optionally the dimension is first a run of ``groups`` equal groups, each
laid out by the sections (Falcon's [kv, q_per_kv + 2, d]); groups are dealt out like heads (whole groups by the
balanced rule at a world size that does not divide them), or, with fewer groups than ranks that they do not
divide, by their query heads (`split_groups`).

Result: ``pieces[r]`` = tuple of ``(start, length)`` ranges of the full dimension; the rank's local
tensor is their concatenation. E.g. [q|k|v] of 4 heads of 8 at tp_size 2, rank 1:
``((16, 16), (48, 16), (80, 16))``.
"""
from __future__ import annotations

from collections.abc import Callable

from tpmap.language import expr

Pieces = tuple[tuple[int, int], ...]
# raise_error(message, key) -> an exception: the caller locates it in the mapping file
Fail = Callable[[str, tuple], Exception]


def merge(ranges) -> Pieces:
    """Join ranges that touch: ((0, 4), (4, 4)) -> ((0, 8),)."""
    out: list[tuple[int, int]] = []
    for s, n in ranges:
        if out and out[-1][0] + out[-1][1] == s:
            out[-1] = (out[-1][0], out[-1][1] + n)
        else:
            out.append((s, n))
    return tuple(out)


def split_sections(sections: list[tuple], tp_size: int, replicate: bool, fail: Fail,
                   heads_key: Callable[[int], tuple], allow_uneven: bool = False) -> tuple[tuple[Pieces, ...], bool]:
    """Every rank's pieces of a dimension made of `sections` ((size, heads) or (size, heads, query_heads)
    each, summing to the dim).

    `replicate`: a head may be held by more than one rank (a Column's output); a Row's input may not.
    `allow_uneven`: a dimension the world size does not divide is split as evenly as possible
    (`expr.rank_heads` for heads; plain features: ``size // tp_size``, one more on the first
    ``size % tp_size`` ranks); else it is refused, as before uneven splits existed.
    Returns (pieces per rank, whether any head is held more than once: by two ranks, or twice by one).
    """
    per_rank: list[list[tuple[int, int]]] = [[] for _ in range(tp_size)]
    replicated = False
    offset = 0
    for k, section in enumerate(sections):
        size, heads, query, unit = parts(section)
        if heads is not None:
            held = _head_ranges(size, heads, query, tp_size, replicate, allow_uneven, fail, heads_key(k))
            replicated = replicated or sum(map(len, held)) > heads
            for r in range(tp_size):
                per_rank[r] += [(offset + s, n) for s, n in held[r]]
        else:
            units = size // unit
            if units % tp_size and not (allow_uneven and units >= tp_size):
                raise fail(_unsplittable(size, unit, tp_size, allow_uneven), ("module",))
            for r, (start, n) in enumerate(balanced(units, tp_size)):
                per_rank[r].append((offset + start * unit, n * unit))
        offset += size
    return tuple(merge(ranges) for ranges in per_rank), replicated


def balanced(size: int, tp_size: int) -> list[tuple[int, int]]:
    """(start, length) of each rank's block of `size` items: size // tp_size, one more on the first
    size % tp_size ranks (10 at 4: (0, 3), (3, 3), (6, 2), (8, 2)); equal blocks when tp_size divides size."""
    base, extra = divmod(size, tp_size)
    return [(r * base + min(r, extra), base + (r < extra)) for r in range(tp_size)]


def parts(section: tuple) -> tuple[int, int | None, int | None, int]:
    """(size, heads, query_heads, unit) of a section given as (size, heads), (size, heads, query_heads) or
    (size, None, None, unit); unit 1 unless given."""
    size, heads, query, unit = tuple(section) + (None, 1)[len(section) - 2:]
    return size, heads, query, unit


# transformers' grouped matmul (torch._grouped_mm, the default experts implementation of stacked experts) needs
# the strides of its operands to be multiples of 16 bytes
GROUPED_MM_ALIGN_BYTES = 16


def aligned(section: tuple, element_size: int) -> tuple:
    """A plain section of a stacked-experts tensor split in units of 16 bytes (`GROUPED_MM_ALIGN_BYTES`), so that
    every rank's width keeps the grouped matmul's strides aligned: (size, None, None, unit), e.g. 100 fp32
    features at 2 ranks -> 52 and 48 (not 50 and 50: 200 bytes). A section with heads, or whose full width is
    not a multiple of the unit (the unsharded model's own strides are not aligned), is returned unchanged."""
    size, heads, _, _ = parts(section)
    unit = max(1, GROUPED_MM_ALIGN_BYTES // max(1, element_size))
    if heads is not None or unit == 1 or size % unit:
        return section
    return (size, None, None, unit)


def uneven_at(section: tuple, tp_size: int, replicate: bool) -> bool:
    """`uneven_section` of a section tuple, an aligned one (`aligned`) counted in its units."""
    size, heads, query, unit = parts(section)
    if unit > 1:
        return (size // unit) % tp_size != 0
    return uneven_section(size, heads, query, tp_size, replicate)


def _unsplittable(size: int, unit: int, tp_size: int, allow_uneven: bool) -> str:
    """Why `size` features (in units of `unit`) cannot be split over tp_size ranks, with the world sizes that can."""
    units = size // unit
    works = [w for w in range(1, min(units, 64) + 1) if units % w == 0 or allow_uneven]
    if unit == 1:
        return (f"{size} features cannot be split over world size {tp_size}; world sizes that divide {size}: "
                f"{', '.join(map(str, works[:8]))}")
    return (f"{size} features split in units of {unit} elements ({GROUPED_MM_ALIGN_BYTES} bytes, the alignment of "
            f"the grouped expert matmul's strides) are {units} units, fewer than the {tp_size} ranks (a rank would "
            f"hold none); world sizes that work: {', '.join(map(str, works[:8]))}")


def uneven_section(size: int, heads: int | None, query: int | None, tp_size: int, replicate: bool) -> bool:
    """Whether a section needs the uneven rule at tp_size (the even rule, the only one before, would refuse it
    or, for key/value heads of unevenly split query heads, lay them out differently)."""
    if heads is None:
        return size % tp_size != 0
    even = heads % tp_size == 0 or (replicate and tp_size % heads == 0)
    return not even or (query is not None and not expr.even(query, tp_size))


def _head_ranges(size: int, heads: int, query: int | None, tp_size: int, replicate: bool, allow_uneven: bool,
                 fail: Fail, key: tuple) -> list[list[tuple[int, int]]]:
    """Each rank's (start, length) ranges of one section of `heads` heads (`expr.rank_heads`), in local order."""
    if heads <= 0 or size % heads:
        raise fail(f"a section of {size} features cannot hold {heads} heads", key)
    if query is not None and (query <= 0 or query % heads):
        raise fail(f"{heads} key/value heads must divide the {query} query heads (query_heads)", key)
    head = size // heads
    held, why = _held_heads(size, heads, query, tp_size, replicate, allow_uneven)
    if held is None:
        fewest = heads if query is None else min(heads, query)
        works = [w for w in range(1, 2 * fewest + 1)
                 if _held_heads(size, heads, query, w, replicate, allow_uneven)[0] is not None]
        raise fail(f"{heads} heads cannot be split over world size {tp_size} ({why}); world sizes that "
                   f"work: {', '.join(map(str, works[:8]))}", key)
    return [list(merge((h * head, head) for h in rank)) for rank in held]


def _held_heads(size: int, heads: int, query: int | None, tp_size: int, replicate: bool,
                allow_uneven: bool) -> tuple[list[list[int]] | None, str]:
    """Each rank's heads (`expr.rank_heads`), or None and why this world size cannot hold them."""
    if uneven_section(size, heads, query, tp_size, replicate) and not allow_uneven:
        return None, "neither divides the other"
    held = [expr.rank_heads(heads, tp_size, r, query) for r in range(tp_size)]
    if None in held:
        return None, "fewer heads than ranks, not dividing the world size"
    if not replicate and sum(map(len, held)) > heads:
        return None, ("ranks whose query heads share a head would both hold it, and a Row's input or a Param with "
                      "replicate_heads: false cannot")
    return held, ""


def split_groups(groups: int, group_width: int, sections, tp_size: int, replicate: bool, fail: Fail,
                 heads_key: Callable[[int], tuple],
                 allow_uneven: bool = False) -> tuple[tuple[Pieces, ...], bool, bool]:
    """Pieces of a dimension of `groups` equal groups, each laid out by `sections` (Falcon's [kv, q_per_kv + 2, d]).

    ``groups % tp_size == 0``: rank r holds groups [r*G/tp_size, (r+1)*G/tp_size) whole (their sections intact).
    ``tp_size % groups == 0``: m = tp_size/G ranks share group r // m, and that group's sections are split over
    those m ranks (sub-rank r % m), replicating heads as needed (a Column's output only).
    Otherwise, with `allow_uneven`: more groups than ranks are dealt whole by the balanced rule (3 groups at 2:
    2 and 1; no head is held twice, and Falcon-40B's 8 groups at 3 keep 3/3/2 groups, 48/48/32 query heads);
    fewer, `_groups_by_query_heads`. Returns (pieces per rank, whether any head is held more than once, whether
    the split is uneven). `uneven_group_counts` gives each rank's groups and query heads under the same rule.
    """
    if groups % tp_size == 0:
        n = groups // tp_size
        return tuple(((r * n * group_width, n * group_width),) for r in range(tp_size)), False, False
    # a shared group: its sections split over its m ranks (uneven ones, with allow_uneven, by the rule below)
    if tp_size % groups == 0 and (not any(uneven_at(s, tp_size // groups, replicate) for s in sections)
                                  if allow_uneven else replicate):
        m = tp_size // groups
        sub, replicated = split_sections(sections, m, replicate, fail, heads_key)
        pieces = []
        for r in range(tp_size):
            g = r // m
            pieces.append(merge((g * group_width + s, n) for s, n in sub[r % m]))
        return tuple(pieces), replicated, False
    if allow_uneven and groups > tp_size:
        return tuple(((start * group_width, n * group_width),) for start, n in balanced(groups, tp_size)), False, True
    if not allow_uneven or group_query_heads(groups, sections) is None:
        works = [w for w in range(1, 2 * groups + 1)
                 if groups % w == 0 or (replicate and w % groups == 0) or (allow_uneven and w < groups)]
        why = "" if not allow_uneven else (" (fewer groups than ranks need every section of a group to hold the "
                                           "group's query heads or one head they share, as Falcon's [q_per_kv, 1, 1])")
        raise fail(f"{groups} groups cannot be dealt over world size {tp_size}; world sizes that work: "
                   f"{', '.join(map(str, works[:8]))}{why}", ("groups",))
    pieces, replicated = _groups_by_query_heads(groups, group_width, sections, tp_size, replicate, fail)
    return pieces, replicated, True


def uneven_group_counts(groups: int, query_per_group: int, tp_size: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(groups, query heads) each rank holds where `split_groups` splits `groups` groups of `query_per_group` query
    heads unevenly: whole groups dealt by the balanced rule (more groups than ranks), else copies of groups
    (`expr.rank_heads(G, tp_size, r, query=G*Q)`, a group counted once per copy) and the balanced query heads.
    What per_rank(num_kv_heads) and per_rank(num_attention_heads) read on each rank (Planner.features)."""
    total = groups * query_per_group
    if groups > tp_size:
        held = tuple(n for _, n in balanced(groups, tp_size))
        return held, tuple(n * query_per_group for n in held)
    return (tuple(len(expr.rank_heads(groups, tp_size, r, total)) for r in range(tp_size)),
            tuple(len(expr.rank_heads(total, tp_size, r)) for r in range(tp_size)))


def group_query_heads(groups: int, sections) -> int | None:
    """Query heads per group of a grouped layout whose sections each hold the group's Q query heads or one head
    shared by them (Falcon's [q_per_kv, 1, 1]): Q, or None for any other layout."""
    heads = [parts(s)[1] for s in sections]
    if None in heads or any(parts(s)[2] is not None for s in sections):
        return None
    q = max(heads)
    return q if all(h in (q, 1) for h in heads) else None


def _groups_by_query_heads(groups: int, group_width: int, sections, tp_size: int, replicate: bool,
                           fail: Fail) -> tuple[tuple[Pieces, ...], bool]:
    """The uneven rule for fewer groups than ranks (2 groups at 3, 3 at 4): the G*Q query heads are split by the
    balanced rule (`expr.rank_heads`), and
    each rank holds, for every group its query heads read, that group's one-head sections (its key and value)
    once per g of its query heads, where g is the gcd of the runs of query heads it holds per group: exactly
    `expr.rank_heads(G, tp_size, r, query=G*Q)` groups of g query heads each (the layout HF views per rank as
    (-1, num_heads // num_kv_heads + 2, d) with num_heads = per_rank(G*Q) and num_kv_heads = per_rank(G, G*Q)).
    E.g. 3 groups of 4 query heads at 4 ranks: 3 query heads each; rank 1 holds group 0's query head 3 and group
    1's 0-1, as three copies of 1: [q3 k0 v0 | q4 k1 v1 | q5 k1 v1]. (With more groups than ranks whole groups are
    dealt instead: copies of one query head each would hold every k/v row up to Q times.)"""
    q = group_query_heads(groups, sections)
    assert q is not None, sections  # split_groups refuses other layouts
    total = groups * q
    offsets, o = [], 0
    for s in sections:
        offsets.append(o)
        o += parts(s)[0]
    pieces = []
    for r in range(tp_size):
        queries = expr.rank_heads(total, tp_size, r)
        if queries is None:
            raise fail(f"{total} query heads in {groups} groups cannot be split over world size {tp_size}: fewer "
                       f"heads than ranks; world sizes that work: {', '.join(map(str, range(1, min(total, 8) + 1)))}",
                       ("groups",))
        copies = expr.rank_heads(groups, tp_size, r, total)  # a group once per g of this rank's query heads
        g = len(queries) // len(copies)
        ranges = []
        for i, group in enumerate(copies):  # copy i pairs with query heads i*g .. i*g + g - 1, as repeat_kv does
            first = queries[i * g] - group * q
            for s, off in zip(sections, offsets):
                size, heads, _, _ = parts(s)
                base, head = group * group_width + off, size // heads
                ranges.append((base + first * head, g * head) if heads == q else (base, size))
        pieces.append(merge(ranges))
    replicated = sum(n for p in pieces for _, n in p) > groups * group_width  # a one-head section repeated
    if replicated and not replicate:
        raise fail(f"{groups} groups cannot be dealt over world size {tp_size}: ranks whose query heads share a "
                   "group would both hold its one-head sections, and a Row's input cannot", ("groups",))
    return tuple(pieces), replicated


def vocab_pieces(vocab: int, tp_size: int) -> tuple[tuple[Pieces, ...], int]:
    """Megatron's padded vocabulary split: every rank holds ceil(V/tp_size) rows, the last ones padded."""
    per_rank = -(-vocab // tp_size)
    pieces = []
    for r in range(tp_size):
        start = min(r * per_rank, vocab)
        pieces.append(((start, min(per_rank, vocab - start)),))
    return tuple(pieces), per_rank
