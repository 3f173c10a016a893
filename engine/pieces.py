"""Which features of a split dimension each rank holds: the slicing math, in one place, on integers.

A split dimension is a list of *sections* (blocks stored one after the other, e.g. [q | k | v] or
[gate | up]); each section is split over the ranks on its own and every rank's pieces are regrouped
in order, so rank r holds [q_r | k_r | v_r]. A section with ``heads`` is split on head boundaries;
with fewer heads than ranks (MQA/GQA K/V) each head is replicated by vLLM's rule: rank r holds head
``r // (tp_size / heads)``. Optionally the dimension is first a run of ``groups`` equal groups, each
laid out by the sections (Falcon's [kv, q_per_kv + 2, d]); groups are dealt out like heads.

Result: ``pieces[r]`` = tuple of ``(start, length)`` ranges of the full dimension; the rank's local
tensor is their concatenation. E.g. [q|k|v] of 4 heads of 8 at tp_size 2, rank 1:
``((16, 16), (48, 16), (80, 16))``.
"""
from __future__ import annotations

from collections.abc import Callable

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


def split_sections(sections: list[tuple[int, int | None]], tp_size: int, replicate: bool, fail: Fail,
                   heads_key: Callable[[int], tuple]) -> tuple[tuple[Pieces, ...], bool]:
    """Every rank's pieces of a dimension made of `sections` ((size, heads) each, summing to the dim).

    `replicate`: fewer heads than ranks may be replicated (a Column's output); a Row's input may not.
    Returns (pieces per rank, whether any head is held by more than one rank).
    """
    per_rank: list[list[tuple[int, int]]] = [[] for _ in range(tp_size)]
    replicated = False
    offset = 0
    for k, (size, heads) in enumerate(sections):
        if heads is not None:
            if heads <= 0 or size % heads:
                raise fail(f"a section of {size} features cannot hold {heads} heads", heads_key(k))
            head = size // heads
            if heads % tp_size == 0:
                n = heads // tp_size
                for r in range(tp_size):
                    per_rank[r].append((offset + r * n * head, n * head))
            elif replicate and tp_size % heads == 0:
                replicated = True
                for r in range(tp_size):  # vLLM's rule: rank r uses head r // (tp_size / heads)
                    per_rank[r].append((offset + (r // (tp_size // heads)) * head, head))
            else:
                why = "neither divides the other" if replicate else "a Row input cannot be replicated"
                works = [w for w in range(1, 2 * heads + 1) if heads % w == 0 or (replicate and w % heads == 0)]
                raise fail(f"{heads} heads cannot be split over world size {tp_size} ({why}); world sizes that "
                           f"work: {', '.join(map(str, works[:8]))}", heads_key(k))
        else:
            if size % tp_size:
                works = [w for w in range(1, min(size, 64) + 1) if size % w == 0]
                raise fail(f"{size} features cannot be split over world size {tp_size}; world sizes that divide "
                           f"{size}: {', '.join(map(str, works[:8]))}", ("module",))
            n = size // tp_size
            for r in range(tp_size):
                per_rank[r].append((offset + r * n, n))
        offset += size
    return tuple(merge(ranges) for ranges in per_rank), replicated


def split_groups(groups: int, group_width: int, sections, tp_size: int, replicate: bool, fail: Fail,
                 heads_key: Callable[[int], tuple]) -> tuple[tuple[Pieces, ...], bool]:
    """Pieces of a dimension of `groups` equal groups, each laid out by `sections`.

    ``groups % tp_size == 0``: rank r holds groups [r*G/tp_size, (r+1)*G/tp_size) whole (their sections intact).
    ``tp_size % groups == 0`` (a Column's output only): m = tp_size/G ranks share group r // m, and that
    group's sections are split over those m ranks (sub-rank r % m), replicating heads as needed.
    """
    if groups % tp_size == 0:
        n = groups // tp_size
        return tuple(((r * n * group_width, n * group_width),) for r in range(tp_size)), False
    if not (replicate and tp_size % groups == 0):
        works = [w for w in range(1, 2 * groups + 1) if groups % w == 0 or (replicate and w % groups == 0)]
        raise fail(f"{groups} groups cannot be dealt over world size {tp_size}; world sizes that work: "
                   f"{', '.join(map(str, works[:8]))}", ("groups",))
    m = tp_size // groups
    sub, replicated = split_sections(sections, m, replicate, fail, heads_key)
    pieces = []
    for r in range(tp_size):
        g = r // m
        pieces.append(merge((g * group_width + s, n) for s, n in sub[r % m]))
    return tuple(pieces), replicated


def vocab_pieces(vocab: int, tp_size: int) -> tuple[tuple[Pieces, ...], int]:
    """Megatron's padded vocabulary split: every rank holds ceil(V/tp_size) rows, the last ones padded."""
    per_rank = -(-vocab // tp_size)
    pieces = []
    for r in range(tp_size):
        start = min(r * per_rank, vocab)
        pieces.append(((start, min(per_rank, vocab - start)),))
    return tuple(pieces), per_rank
