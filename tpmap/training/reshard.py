"""Read this rank's local tensor under the current layout from the files of a checkpoint saved under another
(or the same) layout, reading only the byte ranges that overlap.

The full tensor is the meeting point: the new layout asks, for each of its pieces along the split dim, for a
range ``[s, s + n)`` of the full tensor; `layout.segments` says which saved ranks hold which parts of that range
and where in their local tensors; each part is read from its rank's file by `engine.slice_io.read_local` (a
one-piece layout over the stored local tensor: only those bytes are read) and copied into place. Whole tensors
(saved once, by rank 0) are sliced the same way; a partial tensor (rank 0 holds it, the others zeros) is read by
rank 0 and zeroed elsewhere; padded rows of a vocabulary are in no piece, so never read, and are zero.
"""
from __future__ import annotations

import torch

from tpmap.checkpoint.safetensors import SafetensorsFile
from tpmap.engine.plan import ParamLayout
from tpmap.engine.slice_io import Scratch, read_local
from tpmap.training.errors import TrainingCheckpointError
from tpmap.training.layout import from_json, segments


class Reader:
    """The tensor files of one checkpoint (opened once), reading entries into destination tensors."""

    def __init__(self, tensor_files: list[SafetensorsFile], manifest: dict):
        self.files, self.manifest = tensor_files, manifest
        self.scratch = Scratch()

    def close(self) -> None:
        for f in self.files:
            f.close()

    def fill(self, key: str, new: ParamLayout | None, rank: int, out: torch.Tensor) -> None:
        """Write entry `key`'s local tensor for `rank` under layout `new` (None: whole) into `out`."""
        info = self.manifest["tensors"][key]
        old = from_json(key, info)
        whole_source = old is None or old.partial
        with torch.no_grad():
            if new is not None and new.partial:
                if rank != 0:
                    out.zero_()
                    return
                new = None
            if new is None:
                if whole_source:
                    out.copy_(self._part(0, key, None, 0, 0))
                else:
                    self._range(key, old, old.dim, 0, old.full_shape[old.dim], out)
                return
            if not whole_source and old.dim != new.dim:
                raise TrainingCheckpointError(f"{key}: the checkpoint splits it along dim {old.dim}, the model along "
                                              f"dim {new.dim}: the mapping changed")
            position = 0
            for start, n in new.pieces[rank]:
                dest = out.narrow(new.dim, position, n)
                if whole_source:
                    dest.copy_(self._part(0, key, new.dim, start, n))
                else:
                    self._range(key, old, new.dim, start, n, dest)
                position += n
            if position < out.shape[new.dim]:  # a vocabulary's padded rows
                out.narrow(new.dim, position, out.shape[new.dim] - position).zero_()

    def _range(self, key: str, old: ParamLayout, dim: int, start: int, n: int, dest: torch.Tensor) -> None:
        for rank, local_offset, offset, length in segments(old, start, n):
            dest.narrow(dim, offset, length).copy_(self._part(rank, key, dim, local_offset, length))

    def _part(self, rank: int, key: str, dim: int | None, start: int, n: int) -> torch.Tensor:
        """Rows [start, start + n) along `dim` of the tensor rank `rank` stored (all of it for dim None), in the
        scratch buffer (valid until the next read)."""
        stored = self.files[rank].tensors[key]
        if dim is None:
            layout = ParamLayout(name=key, full_shape=stored.shape, dim=None)
        else:
            layout = ParamLayout(name=key, full_shape=stored.shape, dim=dim, pieces=(((start, n),),))
        return read_local(stored.read_into, layout, 0, stored.dtype, self.scratch, in_scratch=True)
