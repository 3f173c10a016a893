"""Training checkpoints of FSDP2 runs: `fully_shard` over the data-parallel mesh around a tensor-parallel model.

FSDP2 replaces each parameter of a tensor-parallel rank by a DTensor over the dp mesh, ``Shard(0)``: its *global*
tensor is the rank's tp-local tensor (L, ...), and dp rank i holds rows ``[i * c, min((i + 1) * c, L))`` with
``c = ceil(L / dp)`` (torch.chunk's split; the last ranks hold fewer rows, or none, and FSDP2 pads their storage
to c rows -- that padding is not part of `to_local()` and never written or read). The optimizer's state tensors
shaped like a parameter (AdamW's ``exp_avg``) are DTensors with the same placement.

Saving keeps the checkpoint format of a DDP run: one file per tp rank holding the tp-local tensors. Dim-0 chunks
of a row-major tensor are contiguous bytes, so the dp ranks of a tp rank fill that file together: its dp rank 0
creates it (header and size, `SafetensorsWriter`), then every dp rank writes its rows of each tensor at
``data start + row offset * row bytes`` (one chunk in memory at a time, nothing gathered), and dp rank 0 hashes
the finished file. Plain tensors of the state (AdamW's scalar ``step``) are written by dp rank 0, as under DDP.

Loading fills a DTensor's local rows ``[a, a + n)`` of the tp-local tensor under the current layout with
`reshard.Reader`, reading only those rows' bytes: a layout split along dim 0 is cut to the window's pieces; a
tensor whose saved and current layouts both leave dim 0 whole is read through a window of rows ``[a, a + n)`` of
each stored tensor. So an FSDP2 checkpoint loads into DDP, tp-only or FSDP2 runs at any shape the mapping serves,
and a DDP or tp-only one into an FSDP2 run.
"""
from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path

import torch
from torch import nn

from tpmap.checkpoint.safetensors import SafetensorsFile, SafetensorsWriter
from tpmap.engine.plan import ParamLayout
from tpmap.prepare import process_group
from tpmap.training import files
from tpmap.training.errors import TrainingCheckpointError
from tpmap.training.layout import Entry, from_json, holder_ranks
from tpmap.training.ranks import Shape, agree
from tpmap.training.reshard import Reader


def _dtensor_class():
    from torch.distributed.tensor import DTensor

    return DTensor


def is_sharded(tensor: torch.Tensor) -> bool:
    return isinstance(tensor, _dtensor_class())


def sharded(entries: list[Entry]) -> bool:
    """Whether the run is FSDP2: any of its tensors is a DTensor (the same on every rank)."""
    return any(is_sharded(e.tensor) for e in entries)


def check(model: nn.Module, shape: Shape, dp_group) -> None:
    """Under FSDP2: every module's parameters back in their sharded form (a forward without backward leaves the
    root's unsharded), and each DTensor parameter sharded ``Shard(0)`` over a 1-D mesh that is `dp_group`."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import Shard

    if not any(is_sharded(p) for p in model.parameters()):
        return
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
    for name, p in model.named_parameters():
        if not is_sharded(p):
            continue
        mesh = p.device_mesh
        if mesh.ndim != 1 or tuple(p.placements) != (Shard(0),):
            raise TrainingCheckpointError(
                f"{name} is a DTensor placed {tuple(p.placements)} over a {mesh.ndim}-D mesh; tpmap.training saves "
                "FSDP2 models sharded Shard(0) over the 1-D data-parallel mesh (fully_shard(module, mesh=mesh['dp']),"
                " no shard_placement_fn, no HSDP): wrap so, or use DDP over the dp group")
        ranks = dist.get_process_group_ranks(mesh.get_group())
        if dp_group is None or ranks != dist.get_process_group_ranks(process_group(dp_group)):
            raise TrainingCheckpointError(
                f"{name} is sharded by fully_shard over the ranks {ranks}, but dp_group is "
                f"{'not given' if dp_group is None else 'another group'}: pass as dp_group the mesh dimension "
                "fully_shard was given (mesh['dp'])")
        assert (mesh.size(), mesh.get_local_rank()) == (shape.dp_size, shape.dp_rank)


def rows(tensor) -> tuple[int, int]:
    """(first row, rows) of the global dim 0 this rank holds of a Shard(0) DTensor: torch.chunk's split."""
    size, parts, index = tensor.shape[0], tensor.device_mesh.size(), tensor.device_mesh.get_local_rank()
    chunk = -(-size // parts)
    first = min(index * chunk, size)
    count = min(chunk, size - first)
    assert count == tensor.to_local().shape[0], f"a Shard(0) chunk of {count} rows expected, " \
                                                f"{tensor.to_local().shape[0]} held"
    return first, count


# -- save ------------------------------------------------------------------------------------------------------
def write_tensor_file(tmp: Path, prepared: dict, shape: Shape) -> dict:
    """A collective: the tp rank's tensor file, written by its dp ranks together. {name: size, sha256} on dp
    rank 0, {} elsewhere."""
    mine = [e for e in prepared["entries"] if shape.tp_rank in holder_ranks(prepared["manifest"]["tensors"][e.key])]
    path = tmp / files.tensor_file(shape.tp_rank, shape.tp_size)
    error = None
    if shape.dp_rank == 0:
        try:
            layout = [(e.key, e.tensor.dtype, tuple(e.tensor.shape)) for e in mine]
            writer = SafetensorsWriter(path, layout, {"format": "tpmap-training", "tp_rank": str(shape.tp_rank)})
            os.close(writer.fd)  # header and size only: the dp ranks write the data below
        except OSError as e:
            error = TrainingCheckpointError(f"cannot create {path}: {e}")
    agree(error)
    error = None
    try:
        _write_rows(path, mine, shape.dp_rank)
    except OSError as e:
        error = TrainingCheckpointError(f"cannot write {path}: {e}")
    agree(error)
    if shape.dp_rank != 0:
        return {}
    files.fsync_file(path)
    return {path.name: {"size": path.stat().st_size, "sha256": files.digest(path)}}


def _write_rows(path: Path, entries: list[Entry], dp_rank: int) -> None:
    """This rank's rows of every DTensor entry, and (dp rank 0) every plain one, at their places in the file."""
    stored = SafetensorsFile.parse(path).tensors
    fd = os.open(path, os.O_WRONLY)
    try:
        for e in entries:
            if is_sharded(e.tensor):
                first, _ = rows(e.tensor)
                local = e.tensor.to_local()  # (rows, ...): unpadded
            elif dp_rank == 0:
                first, local = 0, e.tensor
            else:
                continue
            row_bytes = math.prod(e.tensor.shape[1:]) * e.tensor.dtype.itemsize
            _pwrite(fd, local, stored[e.key].begin + first * row_bytes)
        os.fsync(fd)
    finally:
        os.close(fd)


def _pwrite(fd: int, tensor: torch.Tensor, offset: int) -> None:
    data = tensor.detach().to("cpu").contiguous()  # a copy only for a GPU tensor (or a strided one)
    if data.numel() == 0:
        return
    view = memoryview(data.view(-1).view(torch.uint8).numpy()).cast("B")
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)


# -- load ------------------------------------------------------------------------------------------------------
def fill(reader: Reader, key: str, layout: ParamLayout | None, tp_rank: int, out: torch.Tensor) -> None:
    """`Reader.fill` for `out` a plain tensor; for a DTensor, only its local rows of the tp-local tensor."""
    if not is_sharded(out):
        reader.fill(key, layout, tp_rank, out)
        return
    with torch.no_grad():
        local = out.to_local()  # (n, ...): rows [a, a + n) of the tp-local tensor
        first, count = rows(out)
        if count == 0:
            return
        if layout is not None and layout.partial:
            if tp_rank != 0:
                local.zero_()
                return
            layout = None
        old = from_json(key, reader.manifest["tensors"][key])
        old_dim = None if old is None or old.partial else old.dim
        if layout is not None and layout.dim == 0:
            reader.fill(key, _window_pieces(layout, tp_rank, first, count), tp_rank, local)
        elif layout is None and old_dim == 0:
            whole = ParamLayout(name=key, full_shape=tuple(reader.manifest["tensors"][key]["full_shape"]), dim=0,
                                pieces=tuple(((first, count),) if r == tp_rank else () for r in range(tp_rank + 1)))
            reader.fill(key, whole, tp_rank, local)
        else:  # neither layout splits dim 0: rows [a, a + n) of every stored tensor
            _window_reader(reader, key, first, count).fill(key, _window_layout(layout, count), tp_rank, local)


def _window_pieces(layout: ParamLayout, rank: int, first: int, count: int) -> ParamLayout:
    """`layout` with `rank`'s pieces cut to its local rows [first, first + count) (rows past its pieces: padding
    of an uneven vocabulary, zero)."""
    pieces, at = [], 0
    for start, n in layout.pieces[rank]:
        lo, hi = max(at, first), min(at + n, first + count)
        if lo < hi:
            pieces.append((start + lo - at, hi - lo))
        at += n
    cut = tuple(tuple(pieces) if r == rank else () for r in range(len(layout.pieces)))
    return dataclasses.replace(layout, pieces=cut, local_size=count, replicated_heads=False)


def _window_layout(layout: ParamLayout | None, count: int) -> ParamLayout | None:
    if layout is None:
        return None
    return dataclasses.replace(layout, full_shape=(count, *layout.full_shape[1:]))


class _Window:
    """Rows [first, first + count) of a stored tensor, as a stored tensor: its bytes are contiguous."""

    def __init__(self, stored, first: int, count: int):
        self.stored, self.dtype = stored, stored.dtype
        self.shape = (count, *stored.shape[1:])
        self.offset = first * math.prod(stored.shape[1:]) * stored.dtype.itemsize

    def read_into(self, buffer: memoryview, offset: int) -> None:
        self.stored.read_into(buffer, self.offset + offset)


class _WindowFile:
    def __init__(self, tensors: dict):
        self.tensors = tensors


def _window_reader(reader: Reader, key: str, first: int, count: int) -> Reader:
    """A Reader of entry `key` alone, whose stored tensors (each with the whole dim 0) are cut to the rows."""
    info = dict(reader.manifest["tensors"][key])
    info["full_shape"] = [count, *info["full_shape"][1:]]
    windows = [_WindowFile({key: _Window(f.tensors[key], first, count)} if key in f.tensors else {})
               for f in reader.files]
    out = Reader(windows, {"tensors": {key: info}})
    out.scratch = reader.scratch
    return out


def state_like(p, dtype: torch.dtype):
    """An empty optimizer state tensor for DTensor parameter `p`: the same placement, global shape and device."""
    from torch.distributed.tensor import DTensor

    local = p.to_local()
    return DTensor.from_local(torch.empty(local.shape, dtype=dtype, device=local.device), p.device_mesh,
                              p.placements, run_check=False, shape=p.shape, stride=p.stride())
