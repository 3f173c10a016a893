"""One prepare step for every way in (`tpmap.apply`, `tpmap.from_pretrained`, `plan_checkpoint`, `tpmap.plan`):
the mapping read, this rank placed in its process group, the plan built and every option checked -- before anything
changes, and on every rank alike (each check reads only the model's structure, the mapping and the world size).

Three named steps, which a caller takes in its own order around what is its own:

1. `read_mapping`: the mapping file, checked against the model type and the installed transformers;
2. `Place.of`: the process group, its size (tp_size) and this rank's index in it (tp_rank);
3. `prepare`: the plan (`engine.planner.build_plan`, every mapping check), ``loss_parallel`` checked against it,
   sequence parallelism planned -> a `Prepared`, which `tpmap.execute.apply_plan` executes.

`apply` reads the mapping, then places the rank; `from_pretrained` places the rank first (its progress bar is rank
0's), reads the mapping before it reads any weight, and prepares once the meta model's weights are tied (the
planner checks that tied tensors split together).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist
import transformers
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from tpmap.api_errors import ExpertsPlacementError, LossParallelError, ProcessGroupError, TransformersVersionError
from tpmap.compat import check_transformers, mapping_applies
from tpmap.engine import planner
from tpmap.engine.plan import Plan
from tpmap.engine.sequence_plan import SequencePlan, plan_sequence_parallel
from tpmap.language.errors import MappingError
from tpmap.language.schema import Mapping
from tpmap.language.source import MappingFile, SourceMap, for_model_type, read_file


# -- 1. the mapping --------------------------------------------------------------------------------
def read_mapping(model: nn.Module, mapping=None, experts: str | None = None) -> MappingFile:
    """The mapping for `model`: the shipped one for its model_type, a file path, or a Mapping object, with the
    experts placement `experts` chosen (None: the mapping's default). Raises TransformersVersionError where the
    installed transformers is outside tpmap's tested range or the mapping's."""
    check_transformers()
    loaded = _read_mapping(model, mapping)
    if not mapping_applies(loaded.mapping.transformers):
        raise TransformersVersionError(
            f"the mapping needs transformers{loaded.mapping.transformers} and transformers "
            f"{transformers.__version__} is installed: install a release in that range",
            loaded.source.value(("transformers",)))
    return choose_experts(loaded, experts, model)


def choose_experts(loaded: MappingFile, experts: str | None, model: nn.Module | None = None) -> MappingFile:
    """`loaded` with the experts placement `experts` ("split" or "parallel") chosen; None keeps its default.
    The placements offered by a mapping that composes others are its parts' for `model`; without a model its
    choice is kept unchecked, and checked when a model reads it (`read_mapping`)."""
    if experts is None:
        if model is None or loaded.chosen_experts is None or not loaded.mapping.compose:
            return loaded
        experts = loaded.chosen_experts  # chosen before the model was known (a composing mapping): checked now
    if experts not in ("split", "parallel"):
        raise ValueError(f"experts={experts!r}: valid choices are 'split' (each expert split along its width) and "
                         "'parallel' (whole experts dealt to the ranks)")
    if model is None and loaded.mapping.compose:  # its parts' entries are known with the model: read_mapping
        return dataclasses.replace(loaded, chosen_experts=experts)  # checks the choice then
    whole = planner.composed(model, loaded) if model is not None else loaded
    offered = sorted({e.experts for e in whole.mapping.entries if e.experts is not None})
    if experts not in offered:
        has = (f"it gives entries for experts={offered[0]!r} only" if offered else
               "it places no experts either way (its MoE blocks, if any, are split by its plain entries)")
        raise ExpertsPlacementError(f"experts={experts!r}, but the mapping {loaded.source.path} has no entries for "
                                    f"that placement: {has}; leave experts= out for its default",
                                    loaded.source.value(("model_type",)))
    return dataclasses.replace(loaded, chosen_experts=experts)


def _read_mapping(model: nn.Module, mapping) -> MappingFile:
    model_type = model.config.model_type
    if mapping is None:
        return for_model_type(model_type)
    if isinstance(mapping, (str, Path)):
        loaded = read_file(mapping)
    elif isinstance(mapping, MappingFile):
        loaded = mapping
    elif isinstance(mapping, Mapping):
        loaded = MappingFile(mapping, SourceMap("<mapping object>"), mapping.model_dump())
    else:
        raise TypeError(f"mapping must be None, a path, a Mapping or a MappingFile, not {type(mapping).__name__}")
    if loaded.mapping.model_type != model_type:
        raise MappingError(
            f"the mapping is for model_type {loaded.mapping.model_type!r} but the model is {model_type!r}; "
            "copy the file and set its model_type if the architectures really match",
            loaded.source.value(("model_type",)),
        )
    return loaded


# -- 2. the process group --------------------------------------------------------------------------
def process_group(group):
    """The ProcessGroup that `group` names: a ProcessGroup, a 1-D DeviceMesh (the tensor-parallel dimension
    of a 2-D layout, ``mesh["tp"]``) or None (the default group, every rank)."""
    if group is None or isinstance(group, dist.ProcessGroup):
        return group
    if isinstance(group, DeviceMesh):
        if group.ndim != 1:
            names = group.mesh_dim_names or ()
            raise ProcessGroupError(
                f"group is a {group.ndim}-D DeviceMesh {tuple(group.shape)}; tensor parallelism needs one dimension "
                f"of it: pass group=mesh[{names[-1] if names else 'NAME'!r}] (the tensor-parallel dimension)")
        return group.get_group()
    raise ProcessGroupError(f"group must be a torch.distributed ProcessGroup, a 1-D DeviceMesh or None, "
                            f"not {type(group).__name__}")


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


@dataclass(frozen=True, kw_only=True)
class Place:
    """Where this rank stands: its tensor-parallel process group (None: the default group, or none at all),
    the group's size and this rank's index in it."""
    group: dist.ProcessGroup | None
    tp_size: int
    tp_rank: int

    @classmethod
    def of(cls, world_size: int | None, group) -> Place:
        """The public ``world_size`` and ``group`` arguments, checked against torch.distributed."""
        group = process_group(group)
        tp_size, tp_rank = resolve_group(world_size, group)
        return cls(group=group, tp_size=tp_size, tp_rank=tp_rank)

    @classmethod
    def planning(cls, tp_size: int) -> Place:
        """No process group (yet): planning only, as rank 0 of `tp_size` would see it."""
        return cls(group=None, tp_size=tp_size, tp_rank=0)


# -- 3. the plan and the options -------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class Prepared:
    """A checked plan for one model at one place, and the options it is executed with."""
    loaded: MappingFile
    place: Place
    plan: Plan
    sequence: SequencePlan | None  # where sequence parallelism splits and gathers; None: it is off
    loss_parallel: bool
    check_inputs: bool


def prepare(model: nn.Module, loaded: MappingFile, place: Place, *, loss_parallel: bool = False,
            sequence_parallel: bool = False, check_inputs: bool = True) -> Prepared:
    """Build the plan of `loaded` for `model` at ``place.tp_size`` and check the options against it, changing
    nothing: raises the planner's errors, `LossParallelError` (no LM head split along the vocabulary),
    and `SequenceParallelError` (a model sequence parallelism cannot run)."""
    plan = planner.build_plan(model, loaded, place.tp_size)
    check_loss_parallel(plan, loaded, model, loss_parallel)
    sequence = plan_sequence_parallel(model, plan) if sequence_parallel else None  # may raise SequenceParallelError
    return Prepared(loaded=loaded, place=place, plan=plan, sequence=sequence, loss_parallel=loss_parallel,
                    check_inputs=check_inputs)


def check_loss_parallel(plan: Plan, loaded: MappingFile, model: nn.Module, loss_parallel: bool) -> None:
    if loss_parallel and not any(m.style == "vocab_head" for m in plan.modules):
        raise LossParallelError(
            f"loss_parallel needs an LM head split along the vocabulary, and {loaded.source.path} has no "
            f"vocab_parallel with lm_head: true for {type(model).__name__}; add `vocab_parallel: {{lm_head: true}}` "
            "to the mapping or drop loss_parallel"
        )
