"""One rank's slice of a tensor stored row-major (a safetensors entry), read from its bytes.

`engine.shard.take` slices a full tensor already in memory; `read_local` builds the same tensor from
the bytes of the stored full tensor, reading only the byte runs the rank keeps. The plan drives both:
``ParamLayout.dim`` and ``pieces[rank]`` say which ranges of the split dim the rank holds, in local
order, ``local_size`` pads (zeros at the end) and ``partial`` means whole on rank 0, zeros elsewhere.

A row-major tensor of shape ``(*outer, D, *inner)`` split along D stores the rank's local tensor as
``prod(outer)`` rows, each the concatenation of the pieces ``[s, s + n)`` of D, every piece a run of
``n * prod(inner)`` contiguous elements. A split along dim 0 is a single run per piece; a split along
the last dim of a matrix (a Row weight) is one run per matrix row. Runs are read straight into the
destination tensor, one system call each, when they lie far apart; when the gaps between them are
small (below `GAP_BYTES`, as for a Row weight, whose runs are parts of each matrix row), whole rows are
read in blocks of at most `BLOCK_BYTES` and the pieces copied out: one call and one copy per block
instead of a call per row, gaps read too (the disk reads them anyway: they share pages and readahead
windows with the runs). Memory stays bounded either way: the rank's tensor plus one block. Reading
through a memory map instead would fault in every page a strided run touches: for a Row weight, the
whole tensor, kept as file-backed RSS (measured: a quarter of the columns of a 128 MiB bf16 matrix
through safetensors' mmap `get_slice` grew the file-backed RSS by 128 MiB; its pread backend read all
128 MiB).
"""
from __future__ import annotations

import math
from collections.abc import Callable
from itertools import pairwise

import torch

from tpmap.engine.plan import ParamLayout

# read_into(buffer, byte_offset): fill `buffer` (a writable memoryview) with the stored tensor's bytes
# starting `byte_offset` bytes after the start of its data.
ReadInto = Callable[[memoryview, int], None]

GAP_BYTES = 64 << 10  # runs closer together than this are read as whole rows, gaps included
BLOCK_BYTES = 16 << 20  # at most this much of a tensor's rows at a time
BLOCK_ROWS: int | None = None  # tests: blocks of at most this many rows, rows of any size (None: by BLOCK_BYTES)


def runs(full_shape: tuple[int, ...], dim: int, pieces, local_dim: int | None = None) -> list[tuple[int, int, int]]:
    """(offset in the full tensor, offset in the local tensor, length) of every contiguous run of the
    rank's local tensor, in elements, runs that touch on both sides merged.

    ``local_dim`` is the local length of `dim` (more than the pieces hold when padded); e.g. shape
    (4, 6) split along dim 1, pieces ((2, 2),): [(2, 0, 2), (8, 2, 2), (14, 4, 2), (20, 6, 2)].
    """
    outer = math.prod(full_shape[:dim])
    inner = math.prod(full_shape[dim + 1:])
    size = full_shape[dim]
    held = sum(n for _, n in pieces)
    local_dim = held if local_dim is None else local_dim
    out: list[list[int]] = []
    for o in range(outer):
        dst = o * local_dim * inner
        for start, n in pieces:
            src = (o * size + start) * inner
            if out and out[-1][0] + out[-1][2] == src and out[-1][1] + out[-1][2] == dst:
                out[-1][2] += n * inner
            else:
                out.append([src, dst, n * inner])
            dst += n * inner
    return [tuple(r) for r in out]


def _bytes(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory."""
    return memoryview(t.view(-1).view(torch.uint8).numpy()).cast("B")


class Scratch:
    """Buffers reused from one read to the next (for the blocks of rows, and for a tensor that is cast or
    moved to another device after reading). One allocation for a whole load instead of one per tensor:
    glibc keeps blocks that were allocated and freed per tensor resident on its heap (measured: +50% peak
    RSS loading the 1.1B Llama at world size 4)."""

    def __init__(self):
        self._buffers: dict[str, torch.Tensor] = {}

    def tensor(self, role: str, shape, dtype: torch.dtype) -> torch.Tensor:
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        buffer = self._buffers.get(role)
        if buffer is None or buffer.numel() < nbytes:
            self._buffers.pop(role, None)
            buffer = self._buffers[role] = torch.empty(nbytes, dtype=torch.uint8)
        return buffer[:nbytes].view(dtype).view(shape)


def read_whole(read_into: ReadInto, shape: tuple[int, ...], dtype: torch.dtype,
               scratch: Scratch | None = None) -> torch.Tensor:
    """The stored tensor, in its dtype; in `scratch` (valid until its next use) when one is given."""
    out = scratch.tensor("result", shape, dtype) if scratch is not None else torch.empty(shape, dtype=dtype)
    if out.numel():
        read_into(_bytes(out), 0)
    return out


def read_local(read_into: ReadInto, shard: ParamLayout, rank: int, dtype: torch.dtype,
               scratch: Scratch | None = None, in_scratch: bool = False) -> torch.Tensor:
    """This rank's local tensor (as `take` would cut it from the full one) from the stored full tensor's
    bytes, in the stored `dtype`, on the CPU. `scratch` provides the blocks of rows; with `in_scratch`
    the result lives there too (valid until the scratch's next use: for a caller that copies it out)."""
    if shard.partial:
        if rank == 0:
            return read_whole(read_into, shard.full_shape, dtype, scratch if in_scratch else None)
        return torch.zeros(shard.full_shape, dtype=dtype)
    if shard.dim is None:
        return read_whole(read_into, shard.full_shape, dtype, scratch if in_scratch else None)
    scratch = scratch if scratch is not None else Scratch()
    local_shape = shard.local_shape(rank)
    dim, pieces = shard.dim, shard.pieces[rank]
    local_dim = local_shape[dim]
    held = sum(n for _, n in pieces)
    out = scratch.tensor("result", local_shape, dtype) if in_scratch else torch.empty(local_shape, dtype=dtype)
    if held < local_dim:  # padded (uneven vocabulary): zeros after the held rows
        out.narrow(dim, held, local_dim - held).zero_()
    if out.numel() == 0 or held == 0:
        return out
    item = out.element_size()
    todo = runs(shard.full_shape, dim, pieces, local_dim)
    gap = max((b[0] - a[0] - a[2] for a, b in pairwise(todo)), default=0) * item
    row_bytes = math.prod(shard.full_shape[dim:]) * item
    if len(todo) > 1 and gap < GAP_BYTES and (row_bytes <= BLOCK_BYTES or BLOCK_ROWS):
        _read_in_blocks(read_into, shard.full_shape, dim, pieces, out, scratch)
    else:
        dst = _bytes(out)
        for src, at, n in todo:
            read_into(dst[at * item:(at + n) * item], src * item)
    return out


def _read_in_blocks(read_into: ReadInto, full_shape, dim: int, pieces, out: torch.Tensor, scratch: Scratch) -> None:
    """Read whole rows of the outer dims, a bounded block at a time, and copy the rank's pieces out."""
    outer = math.prod(full_shape[:dim])
    size, inner = full_shape[dim], math.prod(full_shape[dim + 1:])
    row_bytes = size * inner * out.element_size()
    rows_per_block = BLOCK_ROWS or max(1, BLOCK_BYTES // row_bytes)
    local = out.view(outer, out.shape[dim], inner)
    block = scratch.tensor("block", (min(rows_per_block, outer), size, inner), out.dtype)
    for first in range(0, outer, rows_per_block):
        count = min(rows_per_block, outer - first)
        read_into(_bytes(block)[:count * row_bytes], first * row_bytes)
        offset = 0
        for start, n in pieces:
            local[first:first + count, offset:offset + n] = block[:count, start:start + n]
            offset += n
