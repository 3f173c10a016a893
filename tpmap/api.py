"""`tpmap.apply`: make a transformers model tensor-parallel in place, on every rank."""
from __future__ import annotations

from pathlib import Path

import torch.distributed as dist
from torch import nn

from .errors import AlreadyAppliedError, MappingError, ProcessGroupError
from .loader import LoadedMapping, SourceMap, for_model_type, load_file
from .schema import Mapping

PLAN_ATTR = "tpmap_plan"  # the applied Plan is kept on the model under this name


def load_mapping(model: nn.Module, mapping=None) -> LoadedMapping:
    """The mapping for `model`: the shipped one for its model_type, a file path, or a Mapping object."""
    model_type = model.config.model_type
    if mapping is None:
        return for_model_type(model_type)
    if isinstance(mapping, (str, Path)):
        loaded = load_file(mapping)
    elif isinstance(mapping, LoadedMapping):
        loaded = mapping
    elif isinstance(mapping, Mapping):
        loaded = LoadedMapping(mapping, SourceMap("<mapping object>"), mapping.model_dump())
    else:
        raise TypeError(f"mapping must be None, a path, a Mapping or a LoadedMapping, not {type(mapping).__name__}")
    if loaded.mapping.model_type != model_type:
        raise MappingError(
            f"the mapping is for model_type {loaded.mapping.model_type!r} but the model is {model_type!r}; "
            "copy the file and set its model_type if the architectures really match",
            loaded.source.value(("model_type",)),
        )
    return loaded


def resolve_group(world_size: int | None, group) -> tuple[int, int]:
    """(tp_size, tp_rank) after checking the process group agrees with `world_size`."""
    initialized = dist.is_available() and dist.is_initialized()
    if group is not None and not initialized:
        raise ProcessGroupError("a group was passed but torch.distributed is not initialized")
    if world_size is None:
        world_size = dist.get_world_size(group) if initialized else 1
    if not isinstance(world_size, int) or world_size < 1:
        raise ProcessGroupError(f"world_size must be a positive integer, got {world_size!r}")
    if world_size == 1:
        return 1, 0
    if not initialized:
        raise ProcessGroupError(
            f"tpmap.apply(world_size={world_size}) needs a process group, and torch.distributed is not "
            "initialized. Launch with `torchrun --nproc-per-node N` and call "
            "torch.distributed.init_process_group('nccl' or 'gloo') before tpmap.apply."
        )
    group_size = dist.get_world_size(group)
    if group_size != world_size:
        raise ProcessGroupError(
            f"world_size={world_size} but the {'given' if group is not None else 'default'} process group has "
            f"{group_size} ranks; pass world_size={group_size} or a group of {world_size} ranks"
        )
    return world_size, dist.get_rank(group)


def apply(model: nn.Module, world_size: int | None = None, *, group=None, mapping=None) -> nn.Module:
    """Shard `model` in place for tensor parallelism and return it.

    Every check happens before the model is touched, so an error leaves it exactly as it was.
    world_size 1 validates the mapping and returns the model unchanged.

    Example (run under ``torchrun --nproc-per-node 2``)::

        dist.init_process_group("gloo")
        model = tpmap.apply(AutoModelForCausalLM.from_config(cfg), world_size=2)
    """
    from tpmap.engine import plan as planning, shard

    if getattr(model, PLAN_ATTR, None) is not None:
        raise AlreadyAppliedError(f"{type(model).__name__} is already tensor-parallel "
                                  f"(tp_size={getattr(model, PLAN_ATTR).tp_size}); apply it once, to the full model")
    loaded = load_mapping(model, mapping)
    tp_size, tp_rank = resolve_group(world_size, group)
    plan = planning.build(model, loaded, tp_size)
    if tp_size == 1:
        return model
    shard.execute(model, plan, tp_rank, group)
    setattr(model, PLAN_ATTR, plan)
    return model


def plan(model: nn.Module, world_size: int, *, mapping=None):
    """The plan `apply` would execute at `world_size`, without a process group and without changing `model`."""
    from tpmap.engine import plan as planning

    return planning.build(model, load_mapping(model, mapping), world_size)
