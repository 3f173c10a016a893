"""Which pieces of a split dimension each rank holds (engine/pieces.py, shard.take): whole `groups` dealt
or one group shared by several ranks, sections tiling the dimension, partial tensors."""
from __future__ import annotations

import pytest
import torch

from tpmap.engine import pieces
from tpmap.engine.plan import ParamLayout
from tpmap.engine.shard import take


def _fail(message, key):
    return ValueError(message)


def _heads_key(k):
    return ("heads",)


def _flat(p):
    return [i for s, n in p for i in range(s, s + n)]


@pytest.mark.parametrize("tp_size", [1, 2, 4, 8])
def test_groups_deal_whole_groups_or_split_a_shared_group(tp_size):
    """Falcon-40B layout: 2 KV groups, each [4 q heads | k | v] of head size 3 (18 features a group)."""
    sections = [(12, 4), (3, 1), (3, 1)]
    got, replicated, by_query = pieces.split_groups(2, 18, sections, tp_size, True, _fail, _heads_key)
    assert not by_query
    if tp_size == 1:
        assert got == (((0, 36),),) and not replicated
    elif tp_size == 2:  # one whole group each, sections intact
        assert got == (((0, 18),), ((18, 18),)) and not replicated
    elif tp_size == 4:  # 2 ranks share a group: 2 q heads each, k and v replicated
        assert [_flat(p) for p in got] == [
            list(range(6)) + list(range(12, 18)), list(range(6, 12)) + list(range(12, 18)),
            list(range(18, 24)) + list(range(30, 36)), list(range(24, 30)) + list(range(30, 36))]
        assert replicated
    else:  # 4 ranks share a group: one q head each
        assert _flat(got[5]) == list(range(21, 24)) + list(range(30, 36)) and replicated


def test_groups_refuse_a_world_size_that_neither_divides_nor_is_a_multiple():
    with pytest.raises(ValueError, match="3 groups cannot be dealt over world size 2; world sizes that work: 1, 3, 6"):
        pieces.split_groups(3, 6, [(6, None)], 2, True, _fail, _heads_key)
    # uneven, fewer groups than ranks: a layout other than [query heads, one-head sections] cannot be split
    with pytest.raises(ValueError, match=r"3 groups cannot be dealt over world size 4; world sizes that work: "
                                         r"1, 2, 3, 6 \(fewer groups than ranks need every section"):
        pieces.split_groups(3, 6, [(6, None)], 4, True, _fail, _heads_key, allow_uneven=True)


def test_uneven_groups_are_dealt_whole_or_by_their_query_heads():
    """Falcon-40B's layout at world sizes that neither divide its 3 groups of [4 q heads | k | v] (head size 1, 6
    features a group) nor are multiples of them. At 2, more groups than ranks: whole groups, 2 and 1, nothing held
    twice. At 4 (3 query heads each), by query heads: rank 1 holds group 0's q3 and group 1's q0-1, runs 1 and 2,
    gcd 1: three copies of one query head with its group's k and v, [q3 k0 v0 | q4 k1 v1 | q5 k1 v1]."""
    sections = [(4, 4), (1, 1), (1, 1)]
    got, replicated, uneven = pieces.split_groups(3, 6, sections, 2, True, _fail, _heads_key, allow_uneven=True)
    assert uneven and not replicated and got == (((0, 12),), ((12, 6),))
    assert pieces.uneven_group_counts(3, 4, 2) == ((2, 1), (8, 4))
    got, replicated, uneven = pieces.split_groups(3, 6, sections, 4, True, _fail, _heads_key, allow_uneven=True)
    assert uneven and replicated
    assert [_flat(p) for p in got] == [[0, 1, 2, 4, 5], [3, 4, 5, 6, 10, 11, 7, 10, 11],
                                       [8, 10, 11, 9, 10, 11, 12, 16, 17], [13, 14, 15, 16, 17]]
    assert pieces.uneven_group_counts(3, 4, 4) == ((1, 3, 3, 1), (3, 3, 3, 3))
    # 2 groups of 3 query heads at 4 (a shared group whose 3 heads 2 ranks cannot split evenly): 2/2/1/1
    got, _, uneven = pieces.split_groups(2, 5, [(3, 3), (1, 1), (1, 1)], 4, True, _fail, _heads_key,
                                         allow_uneven=True)
    assert uneven and [_flat(p) for p in got] == [[0, 1, 3, 4], [2, 3, 4, 5, 8, 9], [6, 8, 9], [7, 8, 9]]
    with pytest.raises(ValueError, match="a Row's input cannot"):  # a Row cannot hold a head twice
        pieces.split_groups(3, 6, sections, 4, False, _fail, _heads_key, allow_uneven=True)
    # a Row of the groups' query heads only (Falcon's dense): the same query heads, nothing repeated
    got, replicated, _ = pieces.split_groups(3, 4, [(4, 4)], 4, False, _fail, _heads_key, allow_uneven=True)
    assert not replicated and [_flat(p) for p in got] == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11]]


def test_pieces_tile_the_dimension_once_unless_heads_are_replicated():
    for sections, tp_size in [([(32, 4), (8, 1), (8, 1)], 4), ([(24, None), (24, None)], 3), ([(12, 12)], 6)]:
        got, replicated = pieces.split_sections(sections, tp_size, True, _fail, _heads_key)
        covered = sorted(i for p in got for i in _flat(p))
        total = sum(s for s, _ in sections)
        if replicated:
            assert set(covered) == set(range(total)) and len(covered) > total
        else:
            assert covered == list(range(total))


def test_a_partial_tensor_is_whole_on_rank_0_and_zero_elsewhere():
    full = torch.randn(4, 6)
    shard = ParamLayout(name="experts.down_proj_bias", full_shape=(4, 6), dim=None, partial=True)
    assert torch.equal(take(full, shard, 0), full)
    assert not take(full, shard, 1).any() and take(full, shard, 1).shape == full.shape
