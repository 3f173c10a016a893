"""One rank's slice of a tensor stored row-major (a safetensors entry), read from its bytes.

`engine.shard.take` slices a full tensor already in memory; `read_local` builds the same tensor from
the bytes of the stored full tensor, reading only the byte runs the rank keeps. The plan drives both:
``ParamShard.dim`` and ``pieces[rank]`` say which ranges of the split dim the rank holds, in local
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
from typing import Callable

import torch

from .plan import ParamShard

# read_into(buffer, byte_offset): fill `buffer` (a writable memoryview) with the stored tensor's bytes
# starting `byte_offset` bytes after the start of its data.
ReadInto = Callable[[memoryview, int], None]

GAP_BYTES = 64 << 10  # runs closer together than this are read as whole rows, gaps included
BLOCK_BYTES = 16 << 20  # at most this much of a tensor's rows at a time


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


def read_whole(read_into: ReadInto, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    out = torch.empty(shape, dtype=dtype)
    if out.numel():
        read_into(_bytes(out), 0)
    return out


def read_local(read_into: ReadInto, shard: ParamShard, rank: int, dtype: torch.dtype) -> torch.Tensor:
    """This rank's local tensor (as `take` would cut it from the full one) from the stored full tensor's
    bytes, in the stored `dtype`, on the CPU."""
    if shard.partial:
        return read_whole(read_into, shard.full_shape, dtype) if rank == 0 else torch.zeros(shard.full_shape, dtype=dtype)
    if shard.dim is None:
        return read_whole(read_into, shard.full_shape, dtype)
    local_shape = shard.local_shape(rank)
    dim, pieces = shard.dim, shard.pieces[rank]
    local_dim = local_shape[dim]
    held = sum(n for _, n in pieces)
    out = torch.empty(local_shape, dtype=dtype)
    if held < local_dim:  # padded (uneven vocabulary): zeros after the held rows
        out.narrow(dim, held, local_dim - held).zero_()
    if out.numel() == 0 or held == 0:
        return out
    item = out.element_size()
    todo = runs(shard.full_shape, dim, pieces, local_dim)
    gap = max((b[0] - a[0] - a[2] for a, b in zip(todo, todo[1:])), default=0) * item
    if len(todo) > 1 and gap < GAP_BYTES:
        _read_in_blocks(read_into, shard.full_shape, dim, pieces, out)
    else:
        dst = _bytes(out)
        for src, at, n in todo:
            read_into(dst[at * item:(at + n) * item], src * item)
    return out


def _read_in_blocks(read_into: ReadInto, full_shape, dim: int, pieces, out: torch.Tensor) -> None:
    """Read whole rows of the outer dims, a bounded block at a time, and copy the rank's pieces out."""
    outer = math.prod(full_shape[:dim])
    size, inner = full_shape[dim], math.prod(full_shape[dim + 1:])
    row_bytes = size * inner * out.element_size()
    rows_per_block = max(1, BLOCK_BYTES // row_bytes)
    local = out.view(outer, out.shape[dim], inner)
    held = sum(n for _, n in pieces)
    block = torch.empty(min(rows_per_block, outer), size, inner, dtype=out.dtype)
    for first in range(0, outer, rows_per_block):
        count = min(rows_per_block, outer - first)
        read_into(_bytes(block)[:count * row_bytes], first * row_bytes)
        rows = block[:count]
        local[first:first + count, :held] = torch.cat([rows[:, s:s + n] for s, n in pieces], dim=1)
