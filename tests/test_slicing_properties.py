"""Property tests of the slicing math, over random layouts (hypothesis; no processes).

For random shapes, split dims, section lists, head counts (fewer KV heads than ranks included),
groups, world sizes and vocabulary sizes: every rank's pieces and `take` are the slice of the
independent reference (tests/slicing_reference.py, which decides element by element which ranks hold
a feature, from the layout rules alone); every rank's `take` gathered back (`assemble`) is the
tensor; the pieces tile the split dim (each index held once, or -- replicated heads -- by the same
number of ranks); and the checkpoint reader's slice (`engine.slice_io.read_local`, both its run-by-run
and its block-by-block strategy, the latter with blocks of one or a few rows, and
`tpmap.conversion.Reader` through a transformers expert conversion) equals the reference slice, bit
for bit. Split-then-gather alone is self-consistent by construction (a wrong replicated head reads
and writes the same wrong place); the reference is what catches a wrong slice.

Examples change from run to run (tests/fuzzing.py: a failure prints the seed that reproduces it).
"""
from __future__ import annotations

import math

import fuzzing
import pytest
import slicing_reference as ref
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from tpmap.engine import slice_io
from tpmap.engine.pieces import split_groups, split_sections, vocab_pieces
from tpmap.engine.plan import ParamLayout
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
    """(world size, pieces per rank, replicated, local_size, dim size, reference layout) of one split
    dimension: the engine's pieces, and the layout the reference derives its own slices from."""
    ws = draw(st.integers(1, 8))
    kind = draw(st.sampled_from(["sections", "groups", "vocab"]))
    if kind == "vocab":
        vocab = draw(st.integers(1, 40))
        pieces, per_rank = vocab_pieces(vocab, ws)
        return ws, pieces, False, per_rank, vocab, ref.Layout(vocab, vocab=True)
    replicate = draw(st.booleans())
    if kind == "sections":
        layout = draw(sections(ws, replicate))
        pieces, replicated = split_sections(layout, ws, replicate, _fail, lambda k: ())
        size = sum(s for s, _ in layout)
        return ws, pieces, replicated, None, size, ref.Layout(size, tuple(layout))
    if replicate and ws > 1 and draw(st.booleans()):  # uneven groups (whole, or by query heads): [Q | one-heads]
        q, head = draw(st.integers(1, 4)), draw(st.integers(1, 3))
        groups = draw(st.sampled_from([g for g in range(2, 2 * ws + 2) if g * q >= ws and g % ws
                                       and (g > ws or ws % g or (q % (ws // g) and (ws // g) % q))]))
        layout = [(q * head, q)] + [(head, 1)] * draw(st.integers(0, 2))
        group_size = sum(s for s, _ in layout)
        pieces, replicated, uneven = split_groups(groups, group_size, layout, ws, True, _fail, lambda k: (),
                                                  allow_uneven=True)
        assert uneven
        return ws, pieces, replicated, None, groups * group_size, ref.Layout(groups * group_size, tuple(layout),
                                                                              groups)
    choices = [g for g in range(1, 2 * ws + 1) if g % ws == 0 or (replicate and ws % g == 0)]
    groups = draw(st.sampled_from(choices))
    layout = draw(sections(ws // groups if groups < ws else 1, replicate))  # a shared group splits its sections
    group_size = sum(s for s, _ in layout)
    pieces, replicated, _ = split_groups(groups, group_size, layout, ws, replicate, _fail, lambda k: ())
    size = groups * group_size
    return ws, pieces, replicated, None, size, ref.Layout(size, tuple(layout), groups)


@st.composite
def shards(draw):
    """(ParamLayout, world size, reference Split): a random tensor shape with one split dim, or a partial
    tensor."""
    ws, pieces, replicated, local_size, size, layout = draw(split_dims())
    ndim = draw(st.integers(1, 3))
    dim = draw(st.integers(0, ndim - 1))
    shape = [draw(st.integers(1, 3)) for _ in range(ndim)]
    shape[dim] = size
    if draw(st.integers(0, 9)) == 0:
        shard = ParamLayout(name="t", full_shape=tuple(shape), dim=None, partial=True)
        return shard, ws, ref.Split(None, None, partial=True)
    return ParamLayout(name="t", full_shape=tuple(shape), dim=dim, pieces=pieces,
                      replicated_heads=replicated, local_size=local_size), ws, ref.Split(dim, layout)


def _tensor(shape, dtype=torch.float32) -> torch.Tensor:
    return (torch.arange(math.prod(shape), dtype=torch.float64) + 1).reshape(shape).to(dtype)


def _stored(full: torch.Tensor):
    """read_into over a full tensor's row-major bytes, as a checkpoint file stores it."""
    data = full.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()

    def read_into(buffer: memoryview, offset: int) -> None:
        buffer[:] = data[offset:offset + len(buffer)]

    return read_into


@fuzzing.seeded
@SETTINGS
@given(shards())
def test_every_ranks_slice_is_the_reference_slice(case):
    """Pieces (in local order) and `take` against the reference: the slice of a wrong head, section or
    replicated KV head fails here, even when every rank's wrong slices still gather back to the tensor."""
    shard, ws, split = case
    full = _tensor(shard.full_shape)
    for r in range(ws):
        want = split.local(full, ws, r)
        if not shard.partial:
            assert shard.indices(r) == ref.held(split.layout, ws, r), (r, shard.pieces[r])
        assert shard.local_shape(r) == tuple(want.shape), r
        assert torch.equal(take(full, shard, r), want), r


@pytest.mark.parametrize("heads,ws", [(1, 2), (2, 4), (2, 8), (3, 6), (4, 8), (1, 3), (6, 12)])
def test_replicated_kv_heads_are_the_reference_heads(heads, ws):
    """Fewer KV heads than ranks, on every rank of a fixed grid (not left to the random draws): GQA
    [q | k | v] with 2 features per head; rank r's k and v are head r // (ws / heads)'s."""
    layout = ((ws * 2, ws), (heads * 2, heads), (heads * 2, heads))
    pieces, replicated = split_sections(list(layout), ws, True, _fail, lambda k: ())
    assert replicated
    size = sum(s for s, _ in layout)
    for r in range(ws):
        assert [i for s, n in pieces[r] for i in range(s, s + n)] == ref.held(ref.Layout(size, layout), ws, r), r
    for groups, ws_ in ((2, 4), (1, 4), (3, 6)):  # a shared group (Falcon) splits its sections, replicating
        pieces, _, _ = split_groups(groups, 8, [(4, 2), (2, 1), (2, 1)], ws_, True, _fail, lambda k: ())
        layout = ref.Layout(groups * 8, ((4, 2), (2, 1), (2, 1)), groups)
        assert [[i for s, n in p for i in range(s, s + n)] for p in pieces] == [
            ref.held(layout, ws_, r) for r in range(ws_)], (groups, ws_)


@fuzzing.seeded
@SETTINGS
@given(shards())
def test_every_ranks_slice_gathered_back_is_the_tensor(case):
    shard, ws, _ = case
    full = _tensor(shard.full_shape)
    parts = [take(full, shard, r) for r in range(ws)]
    for r, part in enumerate(parts):
        assert tuple(part.shape) == shard.local_shape(r)
    if shard.partial:
        assert torch.equal(parts[0], full) and all(not p.any() for p in parts[1:])
        return
    assert torch.equal(assemble(parts, shard), full)


@fuzzing.seeded
@SETTINGS
@given(shards())
def test_the_pieces_tile_the_split_dim(case):
    shard, ws, split = case
    assume(not shard.partial)
    size = shard.full_shape[shard.dim]
    held = [0] * size
    by_query = ref.groups_by_query(split.layout, ws)  # uneven groups: a shared head repeated, ranks unequal
    for r in range(ws):
        for i in shard.indices(r):
            held[i] += 1
        assert by_query or len(set(shard.indices(r))) == len(shard.indices(r))  # no rank holds an index twice
    if by_query:
        assert min(held) >= 1 and shard.replicated_heads == (sum(held) > size)
    elif shard.replicated_heads:
        assert min(held) >= 1  # every index somewhere; a replicated head on ws / heads ranks
        assert len({len(shard.indices(r)) for r in range(ws)}) == 1  # every rank holds as much
    else:
        assert held == [1] * size


def _read_all(shard: ParamLayout, ws: int, split, dtype, gap_bytes: int, block_bytes: int) -> int:
    """Every rank's `read_local` against the reference slice, with these GAP_BYTES and BLOCK_BYTES; returns
    how many blocks of rows were read."""
    full = _tensor(shard.full_shape, dtype)
    saved = (slice_io.GAP_BYTES, slice_io.BLOCK_BYTES, slice_io._read_in_blocks)
    blocks = []

    def counting(read_into, *args):
        def read(buffer, offset):
            blocks.append(offset)
            read_into(buffer, offset)
        return saved[2](read, *args)

    slice_io.GAP_BYTES, slice_io.BLOCK_BYTES, slice_io._read_in_blocks = gap_bytes, block_bytes, counting
    scratch = slice_io.Scratch()  # reused by every rank's read, as in a load
    try:
        for r in range(ws):
            got = slice_io.read_local(_stored(full), shard, r, dtype, scratch, in_scratch=r % 2 == 1)
            want = split.local(full, ws, r)
            assert got.dtype == want.dtype and torch.equal(got, want), (r, got, want)
    finally:
        slice_io.GAP_BYTES, slice_io.BLOCK_BYTES, slice_io._read_in_blocks = saved
    return len(blocks)


@fuzzing.seeded
@SETTINGS
@given(shards(), st.sampled_from([torch.float32, torch.bfloat16, torch.int64]), st.booleans(), st.integers(1, 3))
def test_the_checkpoint_readers_slice_is_the_reference_slice(case, dtype, in_blocks, rows_per_block):
    """Run by run (every run read into place), or whole rows in blocks of `rows_per_block` rows: the block
    path always runs where the slice has more than one run, over several blocks where there are more rows."""
    shard, ws, split = case
    item = torch.empty((), dtype=dtype).element_size()
    if not in_blocks:
        _read_all(shard, ws, split, dtype, 0, slice_io.BLOCK_BYTES)
        return
    row_bytes = math.prod(shard.full_shape[shard.dim:]) * item if not shard.partial and shard.dim is not None else 1
    blocks = _read_all(shard, ws, split, dtype, 10 ** 9, rows_per_block * row_bytes)
    several = [r for r in range(ws) if len(slice_io.runs(shard.full_shape, shard.dim, shard.pieces[r])) > 1
               and sum(n for _, n in shard.pieces[r])] if not shard.partial else []
    if several:  # the block path ran, one block per rows_per_block rows on each such rank
        outer = math.prod(shard.full_shape[:shard.dim])
        assert blocks == len(several) * -(-outer // rows_per_block), (blocks, several, outer)


@pytest.mark.parametrize("shape,dim,sections,ws,rows", [
    ((5, 12), 1, ((12, None),), 2, 1),          # a Row weight, one row per block
    ((7, 12), 1, ((12, None),), 3, 2),          # two rows per block, the last block short
    ((3, 4, 9), 1, ((4, 2),), 4, 1),            # replicated heads inside, 3-D
    ((6, 24), 1, ((8, 4), (8, 2), (8, 2)), 4, 4),  # GQA [q | k | v] with replicated k, v
])
def test_reads_in_blocks_of_a_few_rows_are_the_reference_slice(shape, dim, sections, ws, rows):
    """The block path over several blocks, every block at its byte offset (a block read at an offset in
    elements instead of bytes reads the wrong rows from the second block on)."""
    size = shape[dim]
    layout = ref.Layout(size, sections)
    pieces, replicated = split_sections(list(sections), ws, True, _fail, lambda k: ())
    shard = ParamLayout(name="t", full_shape=shape, dim=dim, pieces=pieces, replicated_heads=replicated)
    row_bytes = math.prod(shape[dim:]) * 4
    blocks = _read_all(shard, ws, ref.Split(dim, layout), torch.float32, 10 ** 9, rows * row_bytes)
    assert blocks == ws * -(-math.prod(shape[:dim]) // rows)


def test_a_tensor_larger_than_a_block_read_from_a_file_is_the_reference_slice(tmp_path):
    """A stored Row weight of 17 MB (more than the default 16 MiB block), read from a real safetensors file
    through the checkpoint reader at world size 2 with the default block size: two blocks, the second at a
    byte offset past the first, each rank's slice the reference's."""
    from safetensors.torch import save_file

    from tpmap.checkpoint.safetensors import Checkpoint

    shape = (256, 16896)  # rows of 67,584 bytes: 248 rows in the first block, 8 in the second
    assert math.prod(shape) * 4 > slice_io.BLOCK_BYTES >= shape[1] * 4
    full = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    save_file({"w": full}, tmp_path / "model.safetensors")
    pieces, _ = split_sections([(shape[1], None)], 2, False, _fail, lambda k: ())
    shard = ParamLayout(name="w", full_shape=shape, dim=1, pieces=pieces)
    seen = []
    original = slice_io._read_in_blocks
    slice_io._read_in_blocks = lambda *args: (seen.append(args[0]), original(*args))
    try:
        with Checkpoint.open(tmp_path) as checkpoint:
            stored = checkpoint.tensors["w"]
            for r in range(2):
                got = slice_io.read_local(stored.read_into, shard, r, torch.float32)
                assert torch.equal(got, ref.local_slice(full, 1, ref.Layout(shape[1]), 2, r)), r
    finally:
        slice_io._read_in_blocks = original
    assert len(seen) == 2  # one block-wise read per rank (of 2 blocks each)


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


@fuzzing.seeded
@settings(max_examples=40, deadline=None)
@given(experts=st.integers(1, 4), inter=st.integers(1, 4), hidden=st.integers(1, 3), ws=st.sampled_from([1, 2, 3, 4]),
       fused=st.booleans())
def test_a_lazily_converted_slice_equals_take_of_the_converted_tensor(expert_conversion, experts, inter, hidden, ws,
                                                                     fused):
    from tpmap.checkpoint import conversion

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
    shard = ParamLayout(name=name, full_shape=shape, dim=dim, pieces=pieces)
    for r in range(ws):
        lazy = reader._plan_for(name, source, shard, r)
        assert lazy is not None  # a pure rearrangement: sliced, not converted whole
        want = ref.local_slice(whole, dim, ref.Layout(shape[dim], ((size, None),) * (2 if fused else 1)), ws, r)
        assert torch.equal(reader.local(name, shard, r), want)
