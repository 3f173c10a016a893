"""`tpmap.training.load`: resume a run from a training checkpoint, at the shape it was saved at or another one.

Two phases. Checking (nothing changes): the manifest against the model (model type, every tensor's name and full
shape, config, the mapping's identity), the optimizer (class, groups, parameter names) and the scheduler;
every file there with its recorded size and header, and its sha256 (each file hashed by one rank, in turn). The
ranks then agree (`ranks.agree`): if any rank found a problem, every rank raises `TrainingCheckpointError` with
it. Writing: each rank reads its local tensors under the model's current layout (`reshard.Reader`), straight into
the model's parameters and into fresh optimizer state, then the optimizer, scheduler and RNG states.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from tpmap.api import plan as plan_model
from tpmap.checkpoint.errors import CheckpointError
from tpmap.checkpoint.safetensors import SafetensorsFile
from tpmap.language.errors import TpmapError
from tpmap.training import files, fsdp, rng_state
from tpmap.training.errors import TrainingCheckpointError
from tpmap.training.export import meta_model
from tpmap.training.layout import (
    base_model,
    from_json,
    holder_ranks,
    model_entries,
    optimizer_entries,
    parameter_names,
    unwrap,
)
from tpmap.training.ranks import Shape, agree
from tpmap.training.reshard import Reader
from tpmap.training.save import mapping_identity

# config keys that say how a model runs or where it came from, not what it computes
_CONFIG_IGNORED = {"transformers_version", "dtype", "torch_dtype", "architectures", "use_cache", "output_attentions",
                   "output_hidden_states", "return_dict", "tp_plan", "base_model_tp_plan", "base_model_pp_plan"}


@dataclass(frozen=True)
class TrainingState:
    step: int  # the step the checkpoint was saved at
    data_state: dict | None  # what the data loader gave to save
    extra: dict | None
    folder: Path  # the step folder read
    resharded: bool  # the run's tp x dp differs from the saved one (RNG: see tpmap.training.rng_state)


def load(directory, model: nn.Module, optimizer=None, scheduler=None, *, dp_group=None) -> TrainingState:
    """Restore the training state saved by `tpmap.training.save` into `model`, `optimizer` and `scheduler`.

    A collective: call it on every rank. `directory`: the folder given to save (its `latest` step is read) or one
    step folder. The model must already be sharded at the current shape (tpmap.apply / from_pretrained, with
    tpmap.peft adapters if it had them; DDP or FSDP2 or neither), which may differ from the saved one; `optimizer`
    a fresh optimizer over its parameters with the same parameter groups. Nothing is changed on any rank unless every
    check passes on every rank."""
    error, plan = None, None
    try:
        inner = unwrap(model)
        shape = Shape.of(inner, dp_group)
        fsdp.check(inner, shape, dp_group)
        plan = _check(Path(directory) if not isinstance(directory, Path) else directory, inner, optimizer, scheduler,
                      shape)
    except TrainingCheckpointError as e:
        error = e
    agree(error)
    try:
        _write(plan, inner, optimizer, scheduler, shape)
    finally:
        plan["reader"].close()
    manifest = plan["manifest"]
    return TrainingState(manifest["step"], manifest["data_state"], manifest["extra"], plan["folder"],
                         plan["resharded"])


def check_resume(directory, tp_size: int):
    """Before building anything: whether the checkpoint's mapping can shard its model at `tp_size` (a resume
    shape); returns that Plan (on the meta device, no process group), or raises TrainingCheckpointError."""
    folder = files.resolve(directory)
    manifest = files.read_manifest(folder)
    model = meta_model(manifest)
    source = manifest["mapping"]["source"] if manifest["mapping"] else None
    try:
        return plan_model(model, tp_size, mapping=source)
    except TpmapError as e:
        raise TrainingCheckpointError(f"{folder} (saved at tp {manifest['tp_size']} x dp {manifest['dp_size']}) cannot "
                                      f"resume at tp {tp_size}: the mapping cannot shard the model so: {e}") from e


def _check(directory: Path, model, optimizer, scheduler, shape: Shape) -> dict:
    folder = files.resolve(directory)
    manifest = files.read_manifest(folder)
    _check_model_type(manifest, model)
    entries, aliases = model_entries(model)
    _check_tensors(manifest, {e.key: e for e in entries}, aliases, "model/")  # names a tensor whose shape changed
    _check_config(manifest, model)  # then the same tensors computing another function (rope_theta, eps, ...)
    if (optimizer is None) != (manifest["optimizer"] is None):
        raise TrainingCheckpointError("the checkpoint holds " + ("no optimizer state but an optimizer was given" if
                                      optimizer is not None else "optimizer state but no optimizer was given") +
                                      ": pass the same kind of optimizer the run saved, or none")
    if optimizer is not None:
        _check_optimizer(manifest["optimizer"], optimizer_entries(model, optimizer, {})[1], optimizer)
    _check_scheduler(manifest["scheduler"], scheduler)
    resharded = (manifest["tp_size"], manifest["dp_size"]) != (shape.tp_size, shape.dp_size)
    rng_name = files.rng_file(shape.dp_rank % manifest["dp_size"], 0) if resharded else \
        files.rng_file(shape.dp_rank, shape.tp_rank)
    tensor_names = [files.tensor_file(t, manifest["tp_size"]) for t in range(manifest["tp_size"])]
    every = sorted(manifest["files"])
    mine = {name for i, name in enumerate(every) if i % shape.world == shape.rank} | {rng_name}
    files.check_files(folder, manifest, every, hash_these=mine)
    tensor_files = [_parse(folder / name) for name in tensor_names]
    _check_stored(manifest, tensor_files)
    rng = (folder / rng_name).read_text()
    return {"folder": folder, "manifest": manifest, "entries": entries, "resharded": resharded,
            "reader": Reader(tensor_files, manifest), "rng": rng}


def _check_model_type(manifest: dict, model) -> None:
    base = base_model(model)
    if manifest["model_type"] != base.config.model_type:
        raise TrainingCheckpointError(f"the checkpoint is of a {manifest['model_type']} model "
                                      f"({manifest['model_class']}); this model is {base.config.model_type}")


def _check_config(manifest: dict, model) -> None:
    """The config's values (but those that say how the model runs or where it came from) and the mapping's
    identity."""
    base = base_model(model)
    config = base.config.to_dict()
    differ = sorted(k for k, v in manifest["config"].items() if k in config and not k.startswith("_")
                    and k not in _CONFIG_IGNORED and _plain(config[k]) != v)
    if differ:
        k = differ[0]
        raise TrainingCheckpointError(f"the checkpoint is of another {manifest['model_type']} model: its config has "
                                      f"{k}={manifest['config'][k]!r}, this model's {config[k]!r}" +
                                      (f" (and {len(differ) - 1} more: {', '.join(differ[1:4])})"
                                       if differ[1:] else ""))
    saved, now = manifest["mapping"], mapping_identity(model)
    if saved is not None and now is not None and saved["sha256"] != now["sha256"]:
        raise TrainingCheckpointError(
            f"the mapping changed since the save: the checkpoint was sharded by {saved['source']} with other content "
            f"than {now['source']} has now; restore that mapping to resume, or export the checkpoint "
            "(tpmap export-checkpoint) and start a new run from its weights")


def _plain(value):
    return json.loads(json.dumps(value, default=str))


def _check_tensors(manifest: dict, entries: dict, aliases: dict, prefix: str) -> None:
    saved = {k for k in manifest["tensors"] if k.startswith(prefix)}
    missing = sorted(set(entries) - saved)
    unexpected = sorted(saved - set(entries))
    if missing or unexpected:
        raise TrainingCheckpointError(
            "the checkpoint is of another model, or of the same with other adapters: " +
            (f"the model has {len(missing)} tensors it lacks (e.g. {missing[0][len(prefix):]})" if missing else "") +
            ("; " if missing and unexpected else "") +
            (f"it has {len(unexpected)} tensors the model lacks (e.g. {unexpected[0][len(prefix):]})"
             if unexpected else ""))
    for key, entry in entries.items():
        want = tuple(manifest["tensors"][key]["full_shape"])
        if want != entry.full_shape:
            raise TrainingCheckpointError(f"{key[len(prefix):]} is {list(want)} in the checkpoint and "
                                          f"{list(entry.full_shape)} in the model (full shapes): another model")
    if manifest["aliases"] != aliases:
        raise TrainingCheckpointError(f"the model ties other weights than the checkpoint's model: "
                                      f"{manifest['aliases']} saved, {aliases} now")


def _check_optimizer(saved: dict, now: dict, optimizer) -> None:
    if saved["class"] != now["class"]:
        raise TrainingCheckpointError(f"the checkpoint holds the state of a {saved['class']}; the optimizer given is a "
                                      f"{now['class']}: resume with the optimizer the run saved")
    if len(saved["param_groups"]) != len(now["param_groups"]):
        raise TrainingCheckpointError(f"the checkpoint's optimizer has {len(saved['param_groups'])} parameter groups, "
                                      f"the one given {len(now['param_groups'])}: build it with the same groups")
    for i, (a, b) in enumerate(zip(saved["param_groups"], now["param_groups"], strict=True)):
        if a["params"] != b["params"]:
            extra = sorted(set(b["params"]) - set(a["params"])) or sorted(set(a["params"]) - set(b["params"]))
            raise TrainingCheckpointError(
                f"parameter group {i} of the optimizer holds other parameters than the saved one's "
                f"({len(b['params'])} now, {len(a['params'])} saved" + (f"; e.g. {extra[0]}" if extra else
                                                                          "; in another order") + ")")


def _check_scheduler(saved: dict | None, scheduler) -> None:
    if scheduler is None:
        return
    if saved is None:
        raise TrainingCheckpointError("a scheduler was given but the checkpoint holds none")
    now = f"{type(scheduler).__module__}.{type(scheduler).__qualname__}"
    if saved["class"] != now:
        raise TrainingCheckpointError(f"the checkpoint holds a {saved['class']}'s state; the scheduler given is a "
                                      f"{now}")


def _parse(path: Path) -> SafetensorsFile:
    try:
        return SafetensorsFile.parse(path)
    except CheckpointError as e:
        raise TrainingCheckpointError(str(e)) from None


def _check_stored(manifest: dict, tensor_files: list[SafetensorsFile]) -> None:
    """Every file holds each tensor it should, with the local shape and dtype its layout gives."""
    for key, info in manifest["tensors"].items():
        layout = from_json(key, info)
        for rank in holder_ranks(info):
            stored = tensor_files[rank].tensors.get(key)
            shape = tuple(info["full_shape"]) if layout is None or layout.partial else layout.local_shape(rank)
            if stored is None or stored.shape != shape or str(stored.dtype).removeprefix("torch.") != info["dtype"]:
                raise TrainingCheckpointError(f"{tensor_files[rank].path} lacks {key} as {info['dtype']} {list(shape)}"
                                              f" (it has {None if stored is None else list(stored.shape)}): the file "
                                              "does not match the manifest")


def _write(plan: dict, model, optimizer, scheduler, shape: Shape) -> None:
    manifest, reader = plan["manifest"], plan["reader"]
    for entry in plan["entries"]:
        fsdp.fill(reader, entry.key, entry.layout, shape.tp_rank, entry.tensor)  # a plain tensor: reader.fill
    if optimizer is not None:
        optimizer.load_state_dict(_optimizer_state(manifest, model, optimizer, reader, shape.tp_rank))
    if scheduler is not None:
        scheduler.load_state_dict(manifest["scheduler"]["state"])
    rng_state.restore(json.loads(plan["rng"]))


def _optimizer_state(manifest: dict, model, optimizer, reader: Reader, tp_rank: int) -> dict:
    """A torch optimizer state_dict for `optimizer` (parameters numbered in its groups' order), each state tensor
    read under its parameter's current layout: into the optimizer's own tensor when it has one of that shape and
    dtype (load_state_dict then keeps it: no second copy of the state), else into a new one."""
    entries, _ = model_entries(model)
    layouts = {e.key[len("model/"):]: e.layout for e in entries}
    full_shapes = {e.key[len("model/"):]: e.full_shape for e in entries}
    names = parameter_names(model)
    saved = manifest["optimizer"]
    state, groups, index = {}, [], 0
    for group, saved_group in zip(optimizer.param_groups, saved["param_groups"], strict=True):
        numbers = []
        for p in group["params"]:
            name = names[id(p)]
            values = dict(saved["scalars"].get(name, {}))
            for key, info in manifest["tensors"].items():
                if key.startswith(f"optim/{name}/"):  # shaped like its parameter: spread like it
                    shaped = len(info["full_shape"]) > 0 and tuple(info["full_shape"]) == full_shapes[name]
                    layout = layouts[name] if shaped else None
                    local = tuple(p.shape) if shaped else tuple(info["full_shape"])
                    state_key = key.rsplit("/", 1)[1]
                    out = optimizer.state.get(p, {}).get(state_key)  # filled in place when it is there already
                    if not isinstance(out, torch.Tensor) or tuple(out.shape) != local or \
                            out.dtype != getattr(torch, info["dtype"]):
                        dtype = getattr(torch, info["dtype"])  # FSDP2: a DTensor placed like its parameter
                        out = fsdp.state_like(p, dtype) if shaped and fsdp.is_sharded(p) else \
                            torch.empty(local, dtype=dtype)
                    fsdp.fill(reader, key, layout, tp_rank, out)
                    values[state_key] = out
            if values:
                state[index] = values
            numbers.append(index)
            index += 1
        hyper = {k: tuple(v) if isinstance(group.get(k), tuple) else v for k, v in saved_group["hyper"].items()}
        groups.append({**{k: v for k, v in group.items() if k != "params"}, **hyper, "params": numbers})
    return {"state": state, "param_groups": groups}
