"""Safetensors checkpoint folders: find and validate the files, read byte ranges, write files tensor by tensor.

A folder holds ``model.safetensors`` or ``model.safetensors.index.json`` + the shard files it names
(``model.<variant>.safetensors`` with a variant), as `save_pretrained` writes them. Every file's header
(8-byte little-endian length, JSON: name -> dtype, shape, data_offsets; data after it) is parsed and
checked when the folder is opened, so a missing shard, an index naming a tensor its file lacks, a
truncated file or a ``.bin``-only folder is a `CheckpointError` naming the file and tensor before
anything is read -- on every rank alike, since every rank opens the same folder.

Tensor data is read with ``os.preadv`` into the destination's memory (`StoredTensor.read_into`), so
exactly the bytes asked for are read and nothing is memory-mapped; `engine.slice_io` decides which bytes.
Writing (`SafetensorsWriter`) lays a file out as ``safetensors.torch.save_file`` does (same header,
same order: by dtype then name), so the result is byte-identical, but it takes the tensors one at a
time, in any order, from their full shapes known up front.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from tpmap.checkpoint.errors import CheckpointError

DTYPES = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "F8_E5M2": torch.float8_e5m2,
    "F8_E4M3": torch.float8_e4m3fn, "I16": torch.int16, "U16": torch.uint16, "F16": torch.float16,
    "BF16": torch.bfloat16, "I32": torch.int32, "U32": torch.uint32, "F32": torch.float32, "C64": torch.complex64,
    "F64": torch.float64, "I64": torch.int64, "U64": torch.uint64,
}
NAMES = {v: k for k, v in DTYPES.items()}
# safetensors stores tensors sorted by dtype in this order, largest first, then by name
_DTYPE_ORDER = ["BOOL", "U8", "I8", "F8_E5M2", "F8_E4M3", "I16", "U16", "F16", "BF16", "I32", "U32", "F32", "C64",
                "F64", "I64", "U64"]
SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"


def with_variant(name: str, variant: str | None) -> str:
    """model.safetensors -> model.<variant>.safetensors (transformers' naming)."""
    if not variant:
        return name
    stem, _, ext = name.partition(".")
    return f"{stem}.{variant}.{ext}"


@dataclass(eq=False)
class SafetensorsFile:
    path: Path
    size: int
    data_start: int
    tensors: dict[str, StoredTensor]
    bytes_read: int = 0
    _fd: int | None = None

    @classmethod
    def parse(cls, path: Path) -> SafetensorsFile:
        """Read and check the header: JSON, dtypes, offsets that match the shapes and fit in the file."""
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path} is truncated or not a safetensors file: it has {size} bytes, fewer "
                                      "than the 8-byte header length; re-download or re-save it")
            n = int.from_bytes(head, "little")
            if 8 + n > size:
                raise CheckpointError(f"{path} is truncated or not a safetensors file: its header claims {n} bytes "
                                      f"but the file has {size} bytes; re-download or re-save it")
            raw = f.read(n)
        try:
            header = json.loads(raw)
        except ValueError as e:
            raise CheckpointError(f"{path} is not a safetensors file: its header is not valid JSON ({e})") from None
        if not isinstance(header, dict):
            raise CheckpointError(f"{path} is not a safetensors file: its header is not a JSON object")
        out = cls(path, size, 8 + n, {})
        for name, info in header.items():
            if name == "__metadata__":
                continue
            dtype = DTYPES.get(info.get("dtype")) if isinstance(info, dict) else None
            if dtype is None:
                raise CheckpointError(f"{path}: tensor {name} has dtype "
                                      f"{info.get('dtype') if isinstance(info, dict) else info!r}, "
                                      f"which tpmap does not read (supported: {', '.join(DTYPES)})")
            shape = tuple(info["shape"])
            begin, end = info["data_offsets"]
            nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            if end - begin != nbytes or begin < 0:
                raise CheckpointError(f"{path}: tensor {name} is {info['dtype']} {list(shape)} ({nbytes} bytes) but "
                                      f"its data_offsets {begin}..{end} span {end - begin} bytes; the file is corrupt")
            if out.data_start + end > size:
                raise CheckpointError(f"{path} is truncated: tensor {name} ends at byte {out.data_start + end} but the "
                                      f"file has {size} bytes; re-download or re-save the checkpoint")
            out.tensors[name] = StoredTensor(out, name, dtype, shape, out.data_start + begin, nbytes)
        return out

    def read_into(self, buffer: memoryview, offset: int) -> None:
        """Fill `buffer` with the file's bytes from `offset` (absolute)."""
        fd = self._open()
        done = 0
        while done < len(buffer):
            got = os.preadv(fd, [buffer[done:]], offset + done)
            if got == 0:
                raise CheckpointError(f"{self.path} ended at byte {offset + done} while reading; it was truncated "
                                      "after it was opened")
            done += got
        self.bytes_read += len(buffer)

    def _open(self) -> int:
        if self._fd is None:
            self._fd = os.open(self.path, os.O_RDONLY)
        return self._fd

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


@dataclass(frozen=True, eq=False)
class StoredTensor:
    """One tensor of a safetensors file: where its bytes are, and how to read a range of them."""
    file: SafetensorsFile
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # absolute byte offset of its data in the file
    nbytes: int

    def read_into(self, buffer: memoryview, offset: int) -> None:
        """Fill `buffer` with this tensor's bytes from `offset` (relative to its first byte)."""
        assert offset + len(buffer) <= self.nbytes, "read past the end of a tensor"
        self.file.read_into(buffer, self.begin + offset)

    def where(self) -> str:
        return f"{self.file.path.name}:{self.name}"


class Checkpoint:
    """The safetensors files of a model folder and every tensor in them, by name."""

    def __init__(self, folder: Path, files: list[SafetensorsFile], index: Path | None, metadata: dict | None = None):
        self.folder, self.files, self.index = folder, files, index
        self.metadata = metadata  # the index's "metadata" (total_size, ...), None for a single file
        self.tensors: dict[str, StoredTensor] = {}
        for f in files:  # as transformers merges the files: a name in two files comes from the later one
            self.tensors.update(f.tensors)

    @property
    def bytes_read(self) -> int:
        return sum(f.bytes_read for f in self.files)

    @property
    def paths(self) -> list[str]:
        return [str(f.path) for f in self.files]

    def close(self) -> None:
        for f in self.files:
            f.close()

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @classmethod
    def open(cls, path, variant: str | None = None) -> Checkpoint:
        folder = Path(path)
        if not folder.is_dir():
            if folder.is_file():
                raise CheckpointError(f"{folder} is a file; pass the model folder that holds config.json and the "
                                      "safetensors files")
            raise CheckpointError(f"no folder {folder}; tpmap.from_pretrained reads a local model folder (download it "
                                  "first, e.g. `hf download ORG/MODEL --local-dir DIR`)")
        index = folder / with_variant(SAFE_WEIGHTS_INDEX_NAME, variant)
        single = folder / with_variant(SAFE_WEIGHTS_NAME, variant)
        if single.is_file():  # transformers' order: the single file first
            return cls(folder, [SafetensorsFile.parse(single)], None)
        if index.is_file():
            return cls._sharded(folder, index)
        present = sorted(p.name for p in folder.iterdir())
        pickles = [n for n in present if n.endswith((".bin", ".pt", ".pth", ".ckpt", ".bin.index.json"))]
        if pickles:
            raise CheckpointError(
                f"{folder} holds only PyTorch pickle weights ({', '.join(pickles[:3])}), no {single.name}: "
                "tpmap.from_pretrained reads safetensors, slicing each tensor without loading the file. Convert the "
                "folder once, e.g. `AutoModelForCausalLM.from_pretrained(DIR).save_pretrained(DIR)` (writes "
                "safetensors), then load it again")
        raise CheckpointError(f"{folder} has neither {single.name} nor {index.name}; it holds: "
                              f"{', '.join(present) or 'nothing'}")

    @classmethod
    def _sharded(cls, folder: Path, index: Path) -> Checkpoint:
        try:
            content = json.loads(index.read_text())
        except ValueError as e:
            raise CheckpointError(f"{index} is not valid JSON ({e}); re-download or re-save the checkpoint") from None
        weight_map = content.get("weight_map") if isinstance(content, dict) else None
        metadata = (content.get("metadata") or {}) if isinstance(content, dict) else None
        if not isinstance(weight_map, dict) or not isinstance(metadata, dict):
            raise CheckpointError(f"{index} is not a safetensors index: it needs a 'weight_map' object (tensor name "
                                  "-> file) and optionally a 'metadata' object")
        by_file: dict[str, list[str]] = {}
        for name, file in weight_map.items():
            by_file.setdefault(file, []).append(name)
        missing = [f for f in by_file if not (folder / f).is_file()]
        if missing:
            f = missing[0]
            raise CheckpointError(f"{index.name} names {len(by_file[f])} tensors (e.g. {by_file[f][0]}) in {f}, which "
                                  f"is not in {folder}" + (f" (nor {len(missing) - 1} more files: "
                                                            f"{', '.join(missing[1:4])})" if len(missing) > 1 else "")
                                  + "; the download is incomplete")
        files = [SafetensorsFile.parse(folder / f) for f in sorted(by_file)]
        for f in files:
            absent = [n for n in by_file[f.path.name] if n not in f.tensors]
            if absent:
                raise CheckpointError(f"{index.name} says tensor {absent[0]} is in {f.path.name}, but that file has no "
                                      f"such tensor" + (f" ({len(absent)} such tensors)" if len(absent) > 1 else "")
                                      + "; the index and the files disagree (re-download or re-save)")
        return cls(folder, files, index, metadata)


class SafetensorsWriter:
    """One safetensors file written tensor by tensor, in any order, from a list of (name, dtype, shape)."""

    def __init__(self, path: Path, layout: list[tuple[str, torch.dtype, tuple[int, ...]]],
                 metadata: dict[str, str] | None = None):
        order = sorted(layout, key=lambda t: (-_DTYPE_ORDER.index(NAMES[t[1]]), t[0]))
        header: dict = {"__metadata__": metadata} if metadata else {}
        self.slots: dict[str, tuple[int, torch.dtype, tuple[int, ...]]] = {}
        offset = 0
        for name, dtype, shape in order:
            nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            header[name] = {"dtype": NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            self.slots[name] = (offset, dtype, tuple(shape))
            offset += nbytes
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)
        self.data_start = 8 + len(text)
        self.path = path
        self.left = set(self.slots)
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.ftruncate(self.fd, self.data_start + offset)
        os.pwrite(self.fd, len(text).to_bytes(8, "little") + text, 0)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        offset, dtype, shape = self.slots[name]
        assert tensor.dtype == dtype and tuple(tensor.shape) == shape, f"{name}: layout says {dtype} {shape}"
        data = tensor.detach().to("cpu").contiguous()
        view = memoryview(data.view(-1).view(torch.uint8).numpy()).cast("B") if data.numel() else memoryview(b"")
        done = 0
        while done < len(view):
            done += os.pwrite(self.fd, view[done:], self.data_start + offset + done)
        self.left.discard(name)

    def close(self) -> None:
        assert not self.left, f"{self.path}: tensors never written: {sorted(self.left)[:3]}"
        os.close(self.fd)
