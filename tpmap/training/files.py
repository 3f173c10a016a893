"""The folder of a training checkpoint: file names, the manifest, content hashes, durable writes.

    DIR/latest                          the name of the newest complete step folder (replaced atomically)
    DIR/step-00000100/manifest.json     written last: what the folder holds (see `tpmap.training.save`)
    DIR/step-00000100/tp-00000-of-00002.safetensors   tensor-parallel rank 0's tensors, model and optimizer
    DIR/step-00000100/rng-dp00000-tp00000.json        each rank's RNG states
    DIR/step-00000100.1/                the same step saved again (a fresh folder: `latest` names it, then
                                        the older one is removed)
    DIR/.tmp-step-00000100/             a save in progress (or killed): ignored, removed by the next save
    DIR/.old-step-00000100/             a replaced folder being removed (or a removal killed): ignored, likewise
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from tpmap.training.errors import TrainingCheckpointError

FORMAT = "tpmap-training-checkpoint"
VERSION = 1
MANIFEST = "manifest.json"
LATEST = "latest"
TMP_PREFIX = ".tmp-step-"
OLD_PREFIX = ".old-"
_CHUNK = 4 << 20


def step_name(step: int) -> str:
    return f"step-{step:08d}"


def step_folders(root: Path, step: int) -> list[Path]:
    """The folders holding a save of `step`: ``step-N`` and ``step-N.K`` (saved again)."""
    name = step_name(step)
    return sorted(p for p in root.glob(name + "*") if p.is_dir() and (p.name == name or (
        p.name.startswith(name + ".") and p.name[len(name) + 1:].isdigit())))


def tensor_file(tp_rank: int, tp_size: int) -> str:
    return f"tp-{tp_rank:05d}-of-{tp_size:05d}.safetensors"


def rng_file(dp_rank: int, tp_rank: int) -> str:
    return f"rng-dp{dp_rank:05d}-tp{tp_rank:05d}.json"


def digest(path: Path) -> str:
    """sha256 of a file's bytes, read in chunks into one buffer (a rank's extra memory while it hashes: _CHUNK;
    ``f.read`` would hold two chunks, the next one read while the last is still referenced)."""
    h = hashlib.sha256()
    buffer = bytearray(_CHUNK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            h.update(view[:n])
    return h.hexdigest()


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durable(path: Path, text: str) -> None:
    """Write `text` to `path` through a temporary file, fsync'd and renamed into place."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def resolve(directory) -> Path:
    """The step folder: `directory` itself if it holds a manifest, else the one its `latest` names."""
    root = Path(directory)
    if (root / MANIFEST).is_file():
        return root
    latest = root / LATEST
    if latest.is_file():
        name = latest.read_text().strip()
        folder = root / name
        if not (folder / MANIFEST).is_file():
            raise TrainingCheckpointError(f"{latest} names {name!r}, which has no {MANIFEST}: the folder was removed "
                                          "or damaged; pass an older step folder of this directory explicitly")
        return folder
    if not root.is_dir():
        raise TrainingCheckpointError(f"no training checkpoint at {root}: the folder does not exist")
    steps = sorted(p.name for p in root.iterdir() if p.name.startswith("step-"))
    raise TrainingCheckpointError(f"{root} holds neither {MANIFEST} nor {LATEST}" + (
        f" (step folders without a manifest: {', '.join(steps[:3])}: incomplete saves)" if steps else
        ": pass a directory that tpmap.training.save wrote into, or one of its step folders"))


def read_manifest(folder: Path) -> dict:
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except ValueError as e:
        raise TrainingCheckpointError(f"{folder / MANIFEST} is not valid JSON ({e}): the file is damaged") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise TrainingCheckpointError(f"{folder / MANIFEST} is not a tpmap training checkpoint manifest "
                                      f"(format {manifest.get('format') if isinstance(manifest, dict) else None!r})")
    if manifest.get("version") != VERSION:
        raise TrainingCheckpointError(f"{folder} is a training checkpoint of format version {manifest.get('version')}"
                                      f"; this tpmap reads version {VERSION}")
    return manifest


def check_files(folder: Path, manifest: dict, names, hash_these=()) -> None:
    """Every file in `names` is there with the size the manifest records; those in `hash_these` also with its
    sha256 (the content written)."""
    for name in names:
        want = manifest["files"].get(name)
        path = folder / name
        if want is None:
            raise TrainingCheckpointError(f"{folder / MANIFEST} lists no file {name}: the manifest is damaged")
        if not path.is_file():
            raise TrainingCheckpointError(f"{path} is missing (the checkpoint was saved at tp {manifest['tp_size']} "
                                          f"x dp {manifest['dp_size']} and needs every rank's file); restore it or "
                                          "resume from an older step folder")
        size = path.stat().st_size
        if size != want["size"]:
            raise TrainingCheckpointError(f"{path} has {size} bytes, the manifest records {want['size']}: the file "
                                          "is truncated or was rewritten; restore it or resume from an older step")
        if name in hash_these and digest(path) != want["sha256"]:
            raise TrainingCheckpointError(f"{path}: its content's sha256 differs from the manifest's: the file is "
                                          "corrupted; restore it or resume from an older step")
