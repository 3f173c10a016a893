"""`tpmap.save_pretrained`: a standard transformers checkpoint from a tensor-parallel model, written by
rank 0 one gathered tensor at a time.

What is written is what transformers' `save_pretrained` writes for the unsharded model: the full state
dict under the original names, tied duplicates and ``_keys_to_ignore_on_save`` dropped, load-time
conversions reverted (fused 3-D experts back to the checkpoint's per-expert tensors: transformers'
own `revert_weight_conversion`), split into files above ``max_shard_size`` with an index, then
config.json (full sizes: the shared config is never changed by a mapping) and generation_config.json.
The layout of every file is fixed first from the full shapes, so each tensor is gathered to rank 0,
converted, written at its place and dropped: no rank ever holds more than one tensor (or one
conversion group, e.g. one layer's experts) beyond its own shard.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from tpmap.api import group_of
from tpmap.checkpoint.safetensors import (
    SAFE_WEIGHTS_INDEX_NAME,
    SAFE_WEIGHTS_NAME,
    SafetensorsWriter,
    with_variant,
)
from tpmap.engine.shard import full_tensor
from tpmap.execute import PLAN_ATTR

_TAKES = ("max_shard_size", "variant", "save_original_format", "is_main_process")
# (predicate, save) pairs from optional integrations: tpmap.peft saves a PeftModel as an adapter folder
_DELEGATES: list = []


def delegate_saving(predicate, save) -> None:
    """Let `save(model, save_directory, **kwargs)` write the models for which `predicate(model)` holds (an
    optional integration registers itself at import: tpmap.peft for PEFT models)."""
    _DELEGATES.append((predicate, save))


def save_pretrained(model: nn.Module, save_directory, *, group=None, **hf_kwargs) -> None:
    """Write `model` (tensor-parallel or not) as a standard transformers checkpoint into `save_directory`.

    A collective on a tensor-parallel model: call it on every rank of its tensor-parallel group (`group`
    defaults to the one it was sharded over); that group's rank 0 writes. Under data parallelism, call it
    in one data-parallel replica only (e.g. ``if dp_rank == 0``), or every replica writes the same files.
    ``hf_kwargs``: ``max_shard_size`` (default ``"50GB"``, as transformers), ``variant``, ``save_original_format``
    (default True: revert load-time weight conversions, as transformers). The folder loads with plain
    ``AutoModel...from_pretrained`` and with `tpmap.from_pretrained` at any world size. A PEFT model made by
    `tpmap.peft` is saved as PEFT saves it, an adapter folder with full-size tensors (`tpmap.peft.save_pretrained`).
    """
    for predicate, save in _DELEGATES:
        if predicate(model):
            if group is not None:
                raise TypeError("tpmap.save_pretrained: group= is not taken for this model (it saves over the group "
                                "its layers were sharded over)")
            save(model, save_directory, **hf_kwargs)
            return
    unknown = sorted(set(hf_kwargs) - set(_TAKES))
    if unknown:
        raise TypeError(f"tpmap.save_pretrained does not take {', '.join(unknown)}; it takes {', '.join(_TAKES)}")
    group = group_of(model, group)  # default: the group the model was sharded over
    plan = getattr(model, PLAN_ATTR, None)
    if plan is None:  # an ordinary model: transformers saves it (rank 0 only under a process group)
        rank = dist.get_rank(group) if dist.is_available() and dist.is_initialized() else 0
        model.save_pretrained(save_directory, is_main_process=rank == 0, **hf_kwargs)
        if dist.is_available() and dist.is_initialized():
            dist.barrier(group=group)
        return
    max_shard_size = hf_kwargs.get("max_shard_size", "50GB")
    variant = hf_kwargs.get("variant")
    revert = hf_kwargs.get("save_original_format", True)
    rank = dist.get_rank(group)
    folder = Path(save_directory)
    if folder.is_file():
        raise FileExistsError(f"{folder} is a file; save_pretrained writes a folder")

    layout = _full_layout(model, plan, group)  # name -> (shape, dtype, how to get it), in state-dict order
    keep = _kept_names(model, layout)
    groups = _conversion_groups(model, keep) if revert else [[k] for k in keep]
    outputs = _outputs(model, layout, groups, revert)
    files = _assign_files(outputs, with_variant(SAFE_WEIGHTS_NAME, variant), max_shard_size)

    writers = {}
    if rank == 0:
        folder.mkdir(parents=True, exist_ok=True)
        _remove_stale_shards(folder, with_variant(SAFE_WEIGHTS_NAME, variant), set(files.values()))
        by_file: dict[str, list] = {}
        for name, file in files.items():
            shape, dtype = outputs[name]
            by_file.setdefault(file, []).append((name, dtype, shape))
        writers = {f: SafetensorsWriter(folder / f, names, {"format": "pt"}) for f, names in by_file.items()}
    progress = _progress(rank, len(groups))
    try:
        for names in groups:
            gathered = {n: _gather(model, n, layout[n], plan, group) for n in names}
            if rank == 0:
                converted = _revert(model, gathered, layout) if revert else gathered
                for out_name, tensor in converted.items():
                    writers[files[out_name]].write(out_name, tensor)
            del gathered
            progress.update(1)
    finally:
        progress.close()
        for w in writers.values():
            w.close()
    _save_configs(model, folder, files, outputs, layout, variant, rank)
    dist.barrier(group=group)  # nobody returns (and perhaps tears the group down) before rank 0 has written


def _full_layout(model: nn.Module, plan, group) -> dict[str, tuple[tuple[int, ...], torch.dtype, object]]:
    """Every state-dict key of the unsharded model -> (full shape, dtype, how to get it): a ParamLayout
    (split, or partial), "local" (whole on every rank) or ("item", owner rank) for a tensor inside an
    item of a ModuleList cut by a Param entry, held by one rank only (and whether it is a parameter)."""
    shards = {}
    for shard in plan.params.values():
        for name in (shard.name, *shard.aliases):
            shards[name] = shard
    cut = [t for t in plan.tensors if t.holder == "modules"]
    local = model.state_dict()
    layout: dict[str, tuple] = {}
    if not cut:
        for name, t in local.items():
            layout[name] = (shards[name].full_shape if name in shards else tuple(t.shape), t.dtype,
                            shards.get(name, "local"))
        return layout
    # ModuleList items live on one rank each: learn every rank's item tensors, then merge in index order
    params = dict(model.named_parameters(remove_duplicate=False))
    mine = [(name, tuple(t.shape), t.dtype, name in params) for name, t in local.items()
            if any(name.startswith(c.name + ".") for c in cut)]
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    owner_of = {}
    for r, items in enumerate(everyone):
        for name, shape, dtype, is_param in items:
            owner_of.setdefault(name, (r, shape, dtype, is_param))
    placed: set[str] = set()
    for name, t in local.items():
        prefix = next((c.name + "." for c in cut if name.startswith(c.name + ".")), None)
        if prefix is None:
            layout[name] = (shards[name].full_shape if name in shards else tuple(t.shape), t.dtype,
                            shards.get(name, "local"))
        elif prefix not in placed:  # the list's first tensor here: place every rank's items, by index
            placed.add(prefix)
            for item in sorted((n for n in owner_of if n.startswith(prefix)),
                               key=lambda n: (int(n[len(prefix):].split(".")[0]), list(owner_of).index(n))):
                r, shape, dtype, is_param = owner_of[item]
                layout[item] = (shape, dtype, ("item", r, is_param))
    return layout


def _kept_names(model: nn.Module, layout: dict) -> list[str]:
    """The keys transformers saves: without `_keys_to_ignore_on_save` and tied duplicates (its own rule,
    run on this rank's tensors, which are tied exactly as the full ones)."""
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    ignore = set(getattr(model, "_keys_to_ignore_on_save", None) or ())
    state = {n: t for n, t in model.state_dict().items() if n not in ignore}
    kept = set(remove_tied_weights_from_state_dict(dict(state), model))  # it deletes from the dict it is given
    return [n for n in layout if n not in ignore and (n in kept or n not in state)]


def _conversions(model: nn.Module):
    """The weight conversions transformers reverts on save (what loading used, else the model's defaults)."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import PrefixChange

    conversions = getattr(model, "_weight_conversions", None)
    if conversions is None:
        conversions = [c for c in get_model_conversion_mapping(model, add_legacy=False)
                       if not isinstance(c, PrefixChange)]
    return conversions


def _conversion_groups(model: nn.Module, names: list[str]) -> list[list[str]]:
    """The keys whose reverse conversion needs them together, as transformers' revert_weight_conversion
    groups them (by the name its reverse converter gives them), in its order."""
    from transformers.core_model_loading import (
        WeightConverter,
        apply_converters,
        dot_natural_key,
    )

    conversions = _conversions(model)
    if not conversions:  # transformers then keeps the state dict as it is, in its order
        return [[name] for name in names]
    converters = [c.reverse_transform() for c in conversions[::-1] if isinstance(c, WeightConverter)]
    groups: dict[str, list[str]] = {}
    for name in sorted(names, key=dot_natural_key):
        renamed, pattern = apply_converters(name, converters)
        groups.setdefault(renamed if pattern is not None else name, []).append(name)
    return list(groups.values())


def _revert(model: nn.Module, tensors: dict[str, torch.Tensor], layout: dict) -> dict[str, torch.Tensor]:
    from transformers.core_model_loading import revert_weight_conversion

    return revert_weight_conversion(_Unsharded(model, layout), tensors)


class _Unsharded:
    """The sharded model as transformers' reverse conversion must see it: its parameters at their full
    shapes (meta tensors from `layout`), everything else the model's own. A converter may decide by the
    model parameter's shape -- ``Transpose(check_dims=True)`` transposes only a tensor whose shape is not the
    parameter's -- and a rank's slice would make it transpose what the unsharded model keeps as is."""

    def __init__(self, model: nn.Module, layout: dict):
        self._model, self._layout = model, layout

    def get_parameter(self, name: str) -> torch.Tensor:
        if name in self._layout:
            shape, dtype = self._layout[name][:2]
            return torch.empty(shape, dtype=dtype, device="meta")
        return self._model.get_parameter(name)

    def __getattr__(self, attr):
        return getattr(self._model, attr)


def _outputs(model, layout, groups, revert: bool) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Checkpoint name -> (shape, dtype) of everything written, in order: the conversion run on meta tensors."""
    out = {}
    for names in groups:
        meta = {n: torch.empty(layout[n][0], dtype=layout[n][1], device="meta") for n in names}
        for name, t in (_revert(model, meta, layout) if revert else meta).items():
            out[name] = (tuple(t.shape), t.dtype)
    return out


def _assign_files(outputs: dict, weights_name: str, max_shard_size) -> dict[str, str]:
    """Checkpoint name -> file, split as transformers splits (huggingface_hub, in order, by size)."""
    from huggingface_hub import split_torch_state_dict_into_shards

    meta = {n: torch.empty(shape, dtype=dtype, device="meta") for n, (shape, dtype) in outputs.items()}
    pattern = weights_name.replace(".safetensors", "{suffix}.safetensors")
    split = split_torch_state_dict_into_shards(meta, filename_pattern=pattern, max_shard_size=max_shard_size)
    return split.tensor_to_filename


def _gather(model: nn.Module, name: str, entry, plan, group) -> torch.Tensor | None:
    """The full tensor `name` on rank 0 (None elsewhere); a collective when it is split or on another rank."""
    shape, dtype, how = entry
    rank = dist.get_rank(group)
    if how == "local":
        return _local(model, name) if rank == 0 else None
    if isinstance(how, tuple):  # ("item", owner, is_param)
        owner = how[1]
        if owner == 0:
            return _local(model, name) if rank == 0 else None
        buffer = _local(model, name) if rank == owner else torch.empty(shape, dtype=dtype, device=_device(model))
        dist.broadcast(buffer, src=dist.get_global_rank(group, owner) if group is not None else owner, group=group)
        return buffer if rank == 0 else None
    return full_tensor(_local(model, name), how, group, dst=0)


def _local(model: nn.Module, name: str) -> torch.Tensor:
    return model.get_parameter_or_buffer(name).detach()


def _device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


def _remove_stale_shards(folder: Path, weights_name: str, keep: set[str]) -> None:
    """As transformers: shard files of an earlier save that this one does not overwrite."""
    stem = weights_name.replace(".safetensors", "")
    shard = re.compile(re.escape(stem) + r"-\d{5}-of-\d{5}\.safetensors")
    for entry in os.listdir(folder):
        if shard.fullmatch(entry) and entry not in keep and (folder / entry).is_file():
            os.remove(folder / entry)


def _save_configs(model, folder: Path, files: dict, outputs: dict, layout: dict, variant, rank: int) -> None:
    """config.json and generation_config.json as transformers writes them; the index if sharded."""
    import json

    dtype = model.dtype
    model.config.dtype = str(dtype).split(".")[1]
    model.config.architectures = [type(model).__name__]
    if rank != 0:
        return
    model.config.save_pretrained(folder)
    if model.can_generate():
        model.generation_config.save_pretrained(folder)
    names = set(files.values())
    index_path = folder / with_variant(SAFE_WEIGHTS_INDEX_NAME, variant)
    if len(names) > 1:
        total = sum(torch.empty(s, dtype=d, device="meta").numel() * torch.empty((), dtype=d).element_size()
                    for s, d in outputs.values())
        index = {"metadata": {"total_parameters": _full_parameter_count(model, layout), "total_size": total},
                 "weight_map": dict(files)}
        index_path.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _full_parameter_count(model: nn.Module, layout: dict) -> int:
    """model.num_parameters() of the unsharded model: every parameter once (tied ones too), full size."""
    import math

    names = dict(model.named_parameters(remove_duplicate=False))
    seen: set[int] = set()
    count = 0
    for name, (shape, _, how) in layout.items():
        if isinstance(how, tuple):  # a ModuleList item another rank holds: parameter or buffer?
            if not how[2]:
                continue
        elif name not in names or id(names[name]) in seen:
            continue
        else:
            seen.add(id(names[name]))
        count += math.prod(shape)
    return count


def _progress(rank: int, total: int):
    from transformers.utils import logging as hf_logging

    return hf_logging.tqdm(total=total, desc="Saving tensor-parallel weights", unit="tensor",
                           disable=True if rank else None, delay=2.0)
