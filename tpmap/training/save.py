"""`tpmap.training.save`: the whole training state, written by every rank in parallel, committed atomically.

Each tensor-parallel rank of data-parallel replica 0 writes one safetensors file with its tensors as it holds
them, one tensor at a time (`SafetensorsWriter`: no rank gathers anything, a rank's extra memory stays at one
tensor, and only when it lives on a GPU): its shard of every split model tensor and of the optimizer state that
goes with it; tensor-parallel rank 0 also writes the whole tensors (norms, routers, AdamW's ``step``) once. The
other replicas hold the same tensors (DDP) and write only their RNG state, as every rank does. Under FSDP2 the
dp ranks of a tensor-parallel rank write its file together, each its rows (`tpmap.training.fsdp`).

Atomic: the files go into ``DIR/.tmp-step-N`` and are fsync'd; rank 0 checks every rank's file is there with the
size it reported, writes ``manifest.json`` (the tensors' full shapes, dtypes and layouts, file sizes and sha256,
the optimizer and scheduler, step, data_state, the config and the mapping's identity), renames the folder to a
name no folder has (``DIR/step-N``; ``DIR/step-N.1`` when step N was saved before) and then replaces
``DIR/latest`` (a temporary file + rename); only then are the step's older folders removed (`_commit`). A save
killed at any point leaves ``latest`` naming a complete folder: the previous one or the new one.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from pathlib import Path

from torch import nn

from tpmap.checkpoint.safetensors import SafetensorsWriter
from tpmap.engine.planner import composed
from tpmap.language.source import read_file
from tpmap.training import files, fsdp, rng_state
from tpmap.training.errors import TrainingCheckpointError
from tpmap.training.layout import (
    base_model,
    holder_ranks,
    model_entries,
    optimizer_entries,
    plan_of,
    to_json,
    unwrap,
)
from tpmap.training.ranks import Shape, agree, all_gather

PAUSE_ENV = "TPMAP_TRAINING_TEST_PAUSE"  # tests only: "STEP:DIR" -- each rank writes DIR/rank<R>.pid, then sleeps


def save(directory, model: nn.Module, optimizer=None, scheduler=None, *, step: int, data_state: dict | None = None,
         extra: dict | None = None, dp_group=None) -> Path:
    """Write the training state into ``directory/step-{step:08d}`` and point ``directory/latest`` at it.

    A collective: call it on every rank of the run. `model`: the tensor-parallel model (tpmap.apply,
    tpmap.from_pretrained; a tpmap.peft model; under DDP, FSDP2 or neither). `optimizer`, `scheduler`: an optimizer over
    the model's parameters and its LR scheduler. `data_state`: a JSON dict that tells the data loader where to go
    on (rank 0's is kept: make it the global position), `extra`: any JSON dict. `dp_group`: the data-parallel
    group (or ``mesh["dp"]``) under DDP or FSDP2. Returns the step folder.
    """
    error, shape, prepared = None, None, None
    try:
        inner = unwrap(model)
        shape = Shape.of(inner, dp_group)
        fsdp.check(inner, shape, dp_group)
        prepared = _prepare(inner, optimizer, scheduler, step, data_state, extra, shape)
    except TrainingCheckpointError as e:
        error = e
    agree(error)
    root = Path(directory)
    tmp = root / f"{files.TMP_PREFIX}{step:08d}"
    error = None
    if shape.rank == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
        except OSError as e:
            error = TrainingCheckpointError(f"cannot create {tmp}: {e}")
    agree(error)
    written, error = {}, None
    try:
        written = _write_rank_files(tmp, prepared, shape, step)
    except Exception as e:  # raised again below, on this rank, after the others have learnt of it
        error = e
    agree(error)
    reported = {name: info for part in all_gather(written) for name, info in part.items()}
    error, final = None, None
    if shape.rank == 0:
        try:
            final = _commit(root, tmp, step, prepared["manifest"], reported, shape)
        except Exception as e:  # raised again below, after the others have learnt of it
            error = e
    agree(error)
    return root / all_gather(None if final is None else final.name)[0]


def _prepare(model, optimizer, scheduler, step, data_state, extra, shape: Shape) -> dict:
    """Every tensor this rank writes, and the manifest (everything checked before any file is written)."""
    if not isinstance(step, int) or step < 0:
        raise TrainingCheckpointError(f"step must be a non-negative integer, not {step!r}")
    entries, aliases = model_entries(model)
    layouts = {e.key: e.layout for e in entries}
    opt_entries, opt_description = optimizer_entries(model, optimizer, layouts) if optimizer is not None else ([], None)
    entries = entries + opt_entries
    base = base_model(model)
    manifest = {
        "format": files.FORMAT, "version": files.VERSION, "step": step,
        "data_state": _json(data_state, "data_state"), "extra": _json(extra, "extra"),
        "model_type": base.config.model_type, "model_class": type(base).__name__,
        "config": json.loads(base.config.to_json_string(use_diff=False)),
        "generation_config": _generation_config(base), "peft": hasattr(model, "peft_config"),
        "mapping": mapping_identity(model), "tp_size": shape.tp_size, "dp_size": shape.dp_size,
        "tensors": {e.key: to_json(e.layout, e) for e in entries}, "aliases": aliases,
        "optimizer": opt_description,
        "scheduler": None if scheduler is None else {
            "class": f"{type(scheduler).__module__}.{type(scheduler).__qualname__}",
            "state": _json(scheduler.state_dict(), "the scheduler's state_dict")},
    }
    return {"entries": entries, "manifest": manifest}


def mapping_identity(model: nn.Module) -> dict | None:
    """The mapping the model was sharded by: its file and a sha256 of its parsed content (comments and layout of
    the file do not count), or None for a model tpmap did not shard. A mapping that composes others
    (``compose:``) is hashed with what it composes: the file's content and its entries expanded over the model
    (every composed file's entries, replicated, grad_allreduce and unsupported items), so a change in a composed
    file changes the identity too."""
    plan = plan_of(model)
    if plan is None:
        return None
    path = Path(plan.source)
    if not path.is_file():
        raise TrainingCheckpointError(f"the model was sharded by a mapping given as an object ({plan.source}); a "
                                      "training checkpoint records the mapping's identity: pass the mapping as a file")
    loaded = read_file(path)
    content = loaded.data
    if loaded.mapping.compose:
        expanded = composed(base_model(model), loaded).mapping.model_dump(mode="json")
        content = {"file": loaded.data, "composed": expanded}
    text = json.dumps(content, sort_keys=True, default=str)
    return {"source": str(path), "sha256": hashlib.sha256(text.encode()).hexdigest()}


def _generation_config(base) -> dict | None:
    config = getattr(base, "generation_config", None)
    return None if config is None or not base.can_generate() else json.loads(config.to_json_string(use_diff=False))


def _json(value, what: str):
    try:
        return json.loads(json.dumps(value))
    except (TypeError, ValueError) as e:
        raise TrainingCheckpointError(f"{what} must be JSON data (dicts, lists, numbers, strings): {e}") from None


def _write_rank_files(tmp: Path, prepared: dict, shape: Shape, step: int) -> dict:
    """This rank's files: the tensor file (data-parallel replica 0 only) and its RNG state. {name: size, sha256}."""
    out = {}
    if fsdp.sharded(prepared["entries"]):  # FSDP2: the dp ranks of each tp rank write its file together
        out = fsdp.write_tensor_file(tmp, prepared, shape)
    elif shape.dp_rank == 0:
        mine = [e for e in prepared["entries"] if shape.tp_rank in holder_ranks(prepared["manifest"]["tensors"][e.key])]
        path = tmp / files.tensor_file(shape.tp_rank, shape.tp_size)
        writer = SafetensorsWriter(path, [(e.key, e.tensor.dtype, tuple(e.tensor.shape)) for e in mine],
                                   {"format": "tpmap-training", "tp_rank": str(shape.tp_rank)})
        try:
            for e in mine:
                writer.write(e.key, e.tensor)
        finally:
            writer.close()
        out[path.name] = _finish(path)
    path = tmp / files.rng_file(shape.dp_rank, shape.tp_rank)
    path.write_text(json.dumps(rng_state.capture()))
    out[path.name] = _finish(path)
    _test_pause(step, shape.rank)
    return out


def _finish(path: Path) -> dict:
    files.fsync_file(path)
    return {"size": path.stat().st_size, "sha256": files.digest(path)}


def _test_pause(step: int, rank: int) -> None:
    """Tests kill a rank inside a save: with TPMAP_TRAINING_TEST_PAUSE=STEP:DIR, the save of that step writes
    DIR/rank<R>.pid and sleeps after its files are written, before any manifest exists."""
    spec = os.environ.get(PAUSE_ENV)
    if not spec or int(spec.split(":", 1)[0]) != step:
        return
    folder = Path(spec.split(":", 1)[1])
    (folder / f"rank{rank}.pid").write_text(str(os.getpid()))
    time.sleep(600)


def _commit(root: Path, tmp: Path, step: int, manifest: dict, reported: dict, shape: Shape) -> Path:
    """Rank 0: check the files, write the manifest, then make the folder the checkpoint. Every state a kill can
    leave between two filesystem steps has `latest` naming a complete folder (or, before the first save, no
    `latest`): (1) the manifest is written into the temporary folder, (2) which is renamed to a name no folder has
    -- ``step-N``, or ``step-N.K`` when the step was saved before --, (3) `latest` is replaced to name it
    (temporary file, fsync, os.replace), and only then (4) the step's older folders are renamed aside
    (``.old-*``) and removed, with the temporary folders of saves killed earlier. Returns the step folder."""
    want = {files.tensor_file(t, shape.tp_size) for t in range(shape.tp_size)}
    want |= {files.rng_file(d, t) for d in range(shape.dp_size) for t in range(shape.tp_size)}
    for name in sorted(want):
        path = tmp / name
        if name not in reported or not path.is_file() or path.stat().st_size != reported[name]["size"]:
            raise TrainingCheckpointError(f"{path} is missing or not the size its rank wrote; the save is abandoned "
                                          f"({files.LATEST} still names the previous step)")
    manifest = {**manifest, "files": {name: reported[name] for name in sorted(want)}}
    files.write_durable(tmp / files.MANIFEST, json.dumps(manifest, indent=1) + "\n")
    older = files.step_folders(root, step)  # saved at this step before: replaced once `latest` names the new one
    final = root / files.step_name(step)
    k = 0
    while final.exists():
        k += 1
        final = root / f"{files.step_name(step)}.{k}"
    os.rename(tmp, final)
    files.fsync_dir(root)
    files.write_durable(root / files.LATEST, final.name + "\n")
    for folder in older:
        aside = root / f"{files.OLD_PREFIX}{folder.name}"
        shutil.rmtree(aside, ignore_errors=True)
        os.rename(folder, aside)
    for stale in [*root.glob(files.OLD_PREFIX + "*"), *root.glob(files.TMP_PREFIX + "*")]:  # saves killed earlier
        shutil.rmtree(stale, ignore_errors=True)
    return final
