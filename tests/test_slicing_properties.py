"""Property tests of the slicing math, over random layouts (hypothesis; no processes).

For random shapes, split dims, section lists, head counts (fewer KV heads than ranks included),
groups, world sizes and vocabulary sizes: every rank's `take` gathered back (`assemble`) is the
tensor; the pieces tile the split dim (each index held once, or -- replicated heads -- by the same
number of ranks); and the checkpoint reader's slice (`engine.load.read_local`, both its run-by-run
and its block-by-block strategy, and `tpmap.checkpoint.conversion.Reader` through a transformers expert
conversion) equals `take`'s, bit for bit.
"""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from tpmap.engine import slice_io
from tpmap.engine.pieces import split_groups, split_sections, vocab_pieces
from tpmap.engine.plan import ParamShard
from tpmap.engine.shard import assemble, take

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _fail(message, key):
    raise AssertionError(f"a layout the strategy built does not split: {message}")


@st.composite
def sections(draw, ranks: int, replicate: bool):
    """1-3 sections ((size, heads) each) that split over `ranks`: plain sizes a multiple of it, head
    counts a multiple of it or, replicated, a divisor of it (fewer KV heads than ranks)."""
    head_dim = draw(st.integers(1, 3))
    out = []
    for _ in range(draw(st.integers(1, 3))):
        if draw(st.booleans()):
            out.append((ranks * draw(st.integers(1, 3)), None))
        elif replicate and draw(st.booleans()):
            heads = draw(st.sampled_from([d for d in range(1, ranks + 1) if ranks % d == 0]))
            out.append((heads * head_dim, heads))
        else:
            heads = ranks * draw(st.integers(1, 3))
            out.append((heads * head_dim, heads))
    return out


@st.composite
def split_dims(draw):
    """(world size, pieces per rank, replicated, local_size, dim size) of one split dimension."""
    ws = draw(st.integers(1, 8))
    kind = draw(st.sampled_from(["sections", "groups", "vocab"]))
    if kind == "vocab":
        vocab = draw(st.integers(1, 40))
        pieces, per_rank = vocab_pieces(vocab, ws)
        return ws, pieces, False, per_rank, vocab
    replicate = draw(st.booleans())
    if kind == "sections":
        layout = draw(sections(ws, replicate))
        pieces, replicated = split_sections(layout, ws, replicate, _fail, lambda k: ())
        return ws, pieces, replicated, None, sum(s for s, _ in layout)
    choices = [g for g in range(1, 2 * ws + 1) if g % ws == 0 or (replicate and ws % g == 0)]
    groups = draw(st.sampled_from(choices))
    layout = draw(sections(ws // groups if groups < ws else 1, replicate))  # a shared group splits its sections
    group_size = sum(s for s, _ in layout)
    pieces, replicated = split_groups(groups, group_size, layout, ws, replicate, _fail, lambda k: ())
    return ws, pieces, replicated, None, groups * group_size


@st.composite
def shards(draw):
    """(ParamShard, world size): a random tensor shape with one split dim, or a partial tensor."""
    ws, pieces, replicated, local_size, size = draw(split_dims())
    ndim = draw(st.integers(1, 3))
    dim = draw(st.integers(0, ndim - 1))
    shape = [draw(st.integers(1, 3)) for _ in range(ndim)]
    shape[dim] = size
    if draw(st.integers(0, 9)) == 0:
        return ParamShard(name="t", full_shape=tuple(shape), dim=None, partial=True), ws
    return ParamShard(name="t", full_shape=tuple(shape), dim=dim, pieces=pieces, replicated_heads=replicated,
                      local_size=local_size), ws


def _tensor(shape, dtype=torch.float32) -> torch.Tensor:
    return (torch.arange(math.prod(shape), dtype=torch.float64) + 1).reshape(shape).to(dtype)


def _stored(full: torch.Tensor):
    """read_into over a full tensor's row-major bytes, as a checkpoint file stores it."""
    data = full.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()

    def read_into(buffer: memoryview, offset: int) -> None:
        buffer[:] = data[offset:offset + len(buffer)]

    return read_into


@SETTINGS
@given(shards())
def test_every_ranks_slice_gathered_back_is_the_tensor(case):
    shard, ws = case
    full = _tensor(shard.full_shape)
    parts = [take(full, shard, r) for r in range(ws)]
    for r, part in enumerate(parts):
        assert tuple(part.shape) == shard.local_shape(r)
    if shard.partial:
        assert torch.equal(parts[0], full) and all(not p.any() for p in parts[1:])
        return
    assert torch.equal(assemble(parts, shard), full)


@SETTINGS
@given(shards())
def test_the_pieces_tile_the_split_dim(case):
    shard, ws = case
    assume(not shard.partial)
    size = shard.full_shape[shard.dim]
    held = [0] * size
    for r in range(ws):
        for i in shard.indices(r):
            held[i] += 1
        assert len(set(shard.indices(r))) == len(shard.indices(r))  # no rank holds an index twice
    if shard.replicated_heads:
        assert min(held) >= 1  # every index somewhere; a replicated head on ws / heads ranks
        assert len({len(shard.indices(r)) for r in range(ws)}) == 1  # every rank holds as much
    else:
        assert held == [1] * size


@SETTINGS
@given(shards(), st.sampled_from([torch.float32, torch.bfloat16, torch.int64]), st.booleans())
def test_the_checkpoint_readers_slice_equals_take(case, dtype, in_blocks):
    shard, ws = case
    full = _tensor(shard.full_shape, dtype)
    saved = (slice_io.GAP_BYTES, slice_io.BLOCK_BYTES)
    # run by run (every run read into place), or whole rows a tiny block at a time
    slice_io.GAP_BYTES, slice_io.BLOCK_BYTES = (10 ** 9, 7) if in_blocks else (0, saved[1])
    scratch = slice_io.Scratch()  # reused by every rank's read, as in a load
    try:
        for r in range(ws):
            got = slice_io.read_local(_stored(full), shard, r, dtype, scratch, in_scratch=r % 2 == 1)
            want = take(full, shard, r)
            assert got.dtype == want.dtype and torch.equal(got, want), (r, got, want)
    finally:
        slice_io.GAP_BYTES, slice_io.BLOCK_BYTES = saved


def test_runs_merge_what_is_contiguous():
    assert slice_io.runs((4, 6), 1, ((2, 2),)) == [(2, 0, 2), (8, 2, 2), (14, 4, 2), (20, 6, 2)]
    assert slice_io.runs((4, 6), 0, ((0, 2), (2, 2))) == [(0, 0, 24)]  # adjacent pieces of dim 0: one read
    assert slice_io.runs((4, 6), 1, ((0, 6),)) == [(0, 0, 24)]  # a whole row after a whole row


# -- a converted tensor (transformers' per-expert -> fused experts) read lazily equals take ------------
class _Fake:
    """A stored tensor in memory: what tpmap.checkpoint.conversion reads through (name, shape, dtype, read_into)."""

    def __init__(self, name: str, value: torch.Tensor):
        self.name, self.shape, self.dtype = name, tuple(value.shape), value.dtype
        self.read_into = _stored(value)

    def where(self) -> str:
        return self.name


class _Model:
    """What the Reader asks of a model: the full shapes and a config."""

    config = None

    def __init__(self, tensors: dict):
        self.tensors = tensors

    def state_dict(self):
        return self.tensors


@pytest.fixture(scope="module")
def expert_conversion():
    """transformers' own converters for Mixtral's experts (from its conversion mapping)."""
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    from transformers.core_model_loading import WeightConverter

    converters = [c for c in get_checkpoint_conversion_mapping("mixtral") if isinstance(c, WeightConverter)]
    return {c.target_patterns[0]: c for c in converters}


@settings(max_examples=40, deadline=None)
@given(experts=st.integers(1, 4), inter=st.integers(1, 4), hidden=st.integers(1, 3), ws=st.sampled_from([1, 2, 3, 4]),
       fused=st.booleans())
def test_a_lazily_converted_slice_equals_take_of_the_converted_tensor(expert_conversion, experts, inter, hidden, ws,
                                                                     fused):
    from tpmap.checkpoint.safetensors import conversion

    size = inter * ws
    if fused:  # gate_up_proj [E, 2I, H] from w1, w3 [I, H] per expert, split on dim 1 as [gate | up]
        converter = expert_conversion[".experts.gate_up_proj"]
        stored = [(p, _Fake(f"m.experts.{e}.{w}.weight", torch.randn(size, hidden)))
                  for p, w in ((".experts.*.w1.weight", "w1"), (".experts.*.w3.weight", "w3")) for e in range(experts)]
        name, shape, dim = "m.experts.gate_up_proj", (experts, 2 * size, hidden), 1
        pieces, _ = split_sections([(size, None), (size, None)], ws, False, _fail, lambda k: ())
    else:  # down_proj [E, H, I] from w2 [H, I] per expert, split on dim 2
        converter = expert_conversion[".experts.down_proj"]
        stored = [(".experts.*.w2.weight", _Fake(f"m.experts.{e}.w2.weight", torch.randn(hidden, size)))
                  for e in range(experts)]
        name, shape, dim = "m.experts.down_proj", (experts, hidden, size), 2
        pieces, _ = split_sections([(size, None)], ws, False, _fail, lambda k: ())
    source = conversion.Source(name, stored, converter, {name: shape})
    model = _Model({name: torch.empty(shape, device="meta")})
    reader = conversion.Reader(model, {name: source}, lambda n: torch.float32, torch.device("cpu"))
    whole = reader.whole(name)
    shard = ParamShard(name=name, full_shape=shape, dim=dim, pieces=pieces)
    for r in range(ws):
        lazy = reader._plan_for(name, source, shard, r)
        assert lazy is not None  # a pure rearrangement: sliced, not converted whole
        assert torch.equal(reader.local(name, shard, r), take(whole, shard, r))
