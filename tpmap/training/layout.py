"""What a training checkpoint holds, and how each tensor is spread over the tensor-parallel ranks.

Every tensor of the state is one *entry*: a model tensor (``model/<state-dict key>``) or a tensor of the
optimizer state of one parameter (``optim/<parameter name>/<state key>``, e.g. AdamW's ``exp_avg``), each with
the `ParamLayout` it is spread by (None: whole, the same on every rank of the tensor-parallel group):

* a parameter the plan splits: its plan layout (several pieces per rank for fused sections, the same range on
  several ranks for replicated KV heads, padded rows for a vocabulary, or ``partial``: held by rank 0);
* a LoRA adapter's A or B (`tpmap.peft`): the layer's `adapter_shard` (B's rows of a Column, A's columns of a
  Row, as the base weight), else whole;
* an optimizer state tensor shaped like its (local) parameter: the parameter's layout; any other (AdamW's
  scalar ``step``): whole.

`segments` maps a range of the full tensor to the stored local tensors holding it: what resharding reads.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from tpmap.engine.plan import ParamLayout
from tpmap.execute import PLAN_ATTR
from tpmap.training.errors import TrainingCheckpointError


@dataclass(frozen=True)
class Entry:
    key: str  # stored name
    layout: ParamLayout | None  # None: whole on every tensor-parallel rank
    tensor: torch.Tensor  # this rank's local tensor (as held)

    @property
    def full_shape(self) -> tuple[int, ...]:
        return tuple(self.tensor.shape) if self.layout is None else self.layout.full_shape


def unwrap(model: nn.Module) -> nn.Module:
    """The model inside DDP (an FSDP2 model is the model itself: see tpmap.training.fsdp)."""
    return getattr(model, "module", model) if type(model).__name__ == "DistributedDataParallel" else model


def base_model(model: nn.Module) -> nn.Module:
    """The tpmap-sharded model inside a PEFT model (tpmap.peft), or the model itself."""
    return model.get_base_model() if hasattr(model, "get_base_model") and hasattr(model, "peft_config") else model


def plan_of(model: nn.Module):
    plan = getattr(base_model(model), PLAN_ATTR, None)
    if plan is not None and any(t.holder == "modules" for t in plan.tensors):
        raise TrainingCheckpointError(
            f"the {plan.model_type} mapping cuts a ModuleList between the ranks (a Param entry on modules); training "
            "checkpoints do not save such models yet: save with tpmap.save_pretrained")
    return plan


def model_entries(model: nn.Module) -> tuple[list[Entry], dict[str, str]]:
    """The model's state-dict tensors with their layouts, and {tied alias key: the key stored for it}."""
    by_id = _layouts_by_tensor(model)
    entries, seen, aliases = [], {}, {}
    for key, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in seen:  # a tied weight: stored once, under its first name
            aliases[key] = seen[id(tensor)]
            continue
        seen[id(tensor)] = key
        entries.append(Entry(f"model/{key}", by_id.get(id(tensor)), tensor.detach()))
    return entries, aliases


def _layouts_by_tensor(model: nn.Module) -> dict[int, ParamLayout]:
    """id(tensor) -> layout, for every split tensor: plan parameters (found through PEFT's wrappers) and adapters."""
    out: dict[int, ParamLayout] = {}
    plan = plan_of(model)
    base = base_model(model)
    for layout in plan.params.values() if plan is not None else ():
        if layout.dim is None and not layout.partial:  # kept whole on every rank (a Row's bias): no layout
            continue
        owner_name, _, attr = layout.name.rpartition(".")
        owner = base.get_submodule(owner_name)
        while hasattr(owner, "get_base_layer") and owner.get_base_layer() is not owner:
            owner = owner.get_base_layer()
        tensor = owner._parameters.get(attr, owner._buffers.get(attr))
        assert tensor is not None, f"{layout.name}: the plan names a tensor the model lacks"
        out[id(tensor)] = layout
    for module in model.modules():
        if not hasattr(module, "adapter_shard"):
            continue
        for adapter in module.lora_A:
            for which, holder in (("A", module.lora_A), ("B", module.lora_B)):
                split = module.adapter_shard(which, adapter)
                if split is not None:
                    out[id(holder[adapter].weight)] = split
    return out


def parameter_names(model: nn.Module) -> dict[int, str]:
    return {id(p): name for name, p in model.named_parameters()}


def optimizer_entries(model: nn.Module, optimizer, layouts: dict[str, ParamLayout | None]) -> tuple[list[Entry], dict]:
    """The optimizer's state tensors, by parameter name, and its description: class, each group's hyperparameters
    and parameter names, the non-tensor state values."""
    names = parameter_names(model)
    groups = []
    for i, group in enumerate(optimizer.param_groups):
        missing = [j for j, p in enumerate(group["params"]) if id(p) not in names]
        if missing:
            raise TrainingCheckpointError(f"parameter {missing[0]} of the optimizer's group {i} is not a parameter of "
                                          "the model given: build the optimizer from this model's parameters")
        groups.append({"params": [names[id(p)] for p in group["params"]],
                       "hyper": {k: _plain(v, f"param_groups[{i}][{k!r}]") for k, v in group.items() if k != "params"}})
    entries, scalars = [], {}
    for p, state in optimizer.state.items():
        name = names[id(p)]
        for key, value in sorted(state.items()):
            if not isinstance(value, torch.Tensor):
                scalars.setdefault(name, {})[key] = _plain(value, f"state of {name}: {key}")
                continue
            layout = layouts.get(f"model/{name}")
            shaped = layout is not None and value.dim() > 0 and tuple(value.shape) == tuple(p.shape)
            entries.append(Entry(f"optim/{name}/{key}", layout if shaped else None, value.detach()))
    description = {"class": f"{type(optimizer).__module__}.{type(optimizer).__qualname__}", "param_groups": groups,
                   "scalars": scalars}
    return entries, description


def _plain(value, where: str):
    """A JSON value (tuples as lists: `restore_hyper` turns them back), or a TrainingCheckpointError."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (tuple, list)):
        return [_plain(v, where) for v in value]
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    raise TrainingCheckpointError(f"the optimizer's {where} is a {type(value).__name__}, which a training checkpoint "
                                  "cannot store (numbers, strings, booleans and lists of them)")


def to_json(layout: ParamLayout | None, entry: Entry) -> dict:
    out = {"full_shape": list(entry.full_shape), "dtype": str(entry.tensor.dtype).removeprefix("torch.")}
    if layout is None:
        return {**out, "dim": None}
    return {**out, "dim": layout.dim, "pieces": [[list(p) for p in rank] for rank in layout.pieces],
            "local_size": layout.local_size, "partial": layout.partial}


def from_json(key: str, info: dict) -> ParamLayout | None:
    if info["dim"] is None and not info.get("partial"):
        return None
    return ParamLayout(name=key, full_shape=tuple(info["full_shape"]), dim=info["dim"],
                       pieces=tuple(tuple(tuple(p) for p in rank) for rank in info["pieces"]),
                       local_size=info["local_size"], partial=info["partial"])


def holder_ranks(info: dict) -> range:
    """The tensor-parallel ranks whose files hold this entry: every rank for a split one, rank 0 for another."""
    return range(len(info["pieces"])) if info["dim"] is not None and not info.get("partial") else range(1)


def segments(layout: ParamLayout, start: int, length: int) -> list[tuple[int, int, int, int]]:
    """(stored rank, offset in its local tensor, offset in the range, length) covering [start, start + length) of
    the split dim, from the rank's pieces; a range several ranks hold (replicated KV heads) is read from the lowest
    of them, and padded rows (`local_size`) are never read, being in no piece."""
    held = []  # (full start, length, rank, local offset)
    for rank, pieces in enumerate(layout.pieces):
        offset = 0
        for s, n in pieces:
            held.append((s, n, rank, offset))
            offset += n
    held.sort(key=lambda h: (h[0], h[2]))
    out, at, end = [], start, start + length
    for s, n, rank, offset in held:
        if s + n <= at or s > at:
            continue
        take = min(s + n, end) - at
        out.append((rank, offset + at - s, at - start, take))
        at += take
        if at == end:
            break
    if at != end:
        raise TrainingCheckpointError(f"{layout.name}: the saved layout holds no rank with rows {at}..{end} of dim "
                                      f"{layout.dim}; the checkpoint's manifest is corrupt")
    return out
