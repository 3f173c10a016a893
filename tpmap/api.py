"""`tpmap.apply`: make a transformers model tensor-parallel in place, on every rank."""
from __future__ import annotations

import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import transformers
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from tpmap.api_errors import (
    AlreadyAppliedError,
    LossParallelError,
    MetaDeviceError,
    PartialMappingWarning,
    ProcessGroupError,
    TransformersVersionError,
)
from tpmap.compat import check_transformers, mapping_applies
from tpmap.engine import planner, quant_blocks, shard, shm
from tpmap.engine.errors import UnsupportedConfigError
from tpmap.engine.plan import Plan
from tpmap.engine.sequence import install_sequence_parallel
from tpmap.engine.sequence_plan import SequencePlan, plan_sequence_parallel
from tpmap.input_check import check_generate_arguments, input_check
from tpmap.language.errors import DivisibilityError, MappingError, TpmapError
from tpmap.language.schema import Mapping
from tpmap.language.source import MappingFile, SourceMap, for_model_type, read_file
from tpmap.loss_parallel import use_loss_parallel

PLAN_ATTR = "tpmap_plan"  # the applied Plan is kept on the model under this name
GROUP_ATTR = "tpmap_group"  # and the process group it was sharded over (None: the default group)
SEQUENCE_ATTR = "tpmap_sequence"  # sequence parallelism's state (engine.sequence), when it is on


def read_mapping(model: nn.Module, mapping=None) -> MappingFile:
    """The mapping for `model`: the shipped one for its model_type, a file path, or a Mapping object. Raises
    TransformersVersionError where the installed transformers is outside tpmap's tested range or the mapping's."""
    check_transformers()
    loaded = _read_mapping(model, mapping)
    if not mapping_applies(loaded.mapping.transformers):
        raise TransformersVersionError(
            f"the mapping needs transformers{loaded.mapping.transformers} and transformers "
            f"{transformers.__version__} is installed: install a release in that range",
            loaded.source.value(("transformers",)))
    return loaded


load_mapping = read_mapping  # its earlier name ("load" now means reading weights only); kept for existing code


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


def group_of(model: nn.Module, group=None):
    """`group` (see `process_group`), or else the group `model` was sharded over by apply/from_pretrained."""
    return process_group(group) if group is not None else getattr(model, GROUP_ATTR, None)


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


def apply(model: nn.Module, world_size: int | None = None, *, group=None, mapping=None,
          loss_parallel: bool = False, check_inputs: bool = True, sequence_parallel: bool = False) -> nn.Module:
    """Shard `model` in place for tensor parallelism and return it.

    Every check happens before the model is touched, so an error leaves it exactly as it was.
    world_size 1 validates the mapping and returns the model unchanged.

    * ``group``: the tensor-parallel process group (default: every rank), or a 1-D DeviceMesh, e.g. the
      ``"tp"`` dimension of a (dp, tp) mesh for data parallelism around it: ``group=mesh["tp"]``. Every
      collective, gradient hook, input check and rank-dependent choice (slices, dropout seeds) uses it.

    * ``loss_parallel``: in training mode, keep the LM head's logits split along the vocabulary and
      compute the cross-entropy on the shards (needs ``vocab_parallel.lm_head`` in the mapping). A
      transformers causal-LM or masked-LM loss (``labels=...``) is computed that way; a model that
      computes its loss otherwise raises instead of returning a wrong loss. ``outputs.logits`` are then
      this rank's shard. In eval mode (generate, evaluation) the logits are gathered as usual.
    * ``check_inputs``: every forward first compares a fingerprint of every tensor argument (and, in
      training mode, of the RNG state) across ranks -- one all-gather of 5 numbers -- and raises
      `InputMismatchError` naming the arguments that differ, instead of hanging or computing garbage.
      ``generate`` also compares its arguments (max_new_tokens, ...) once per call.
    * ``sequence_parallel``: keep the activations between the repeated blocks split along the sequence
      (Megatron-SP; `tpmap.engine.sequence`): norms, dropout and residual adds run on T/ws tokens per rank.
      Each stack of blocks (an encoder-decoder has two) is split and gathered on its own. A forward whose
      sequence length does not divide by the world size runs as plain TP. Models it cannot run (MoE
      experts and routers, SSM mixers and convolutions) raise `SequenceParallelError` here.

    Example (run under ``torchrun --nproc-per-node 2``)::

        dist.init_process_group("gloo")
        model = tpmap.apply(AutoModelForCausalLM.from_config(cfg), world_size=2)
    """
    if getattr(model, PLAN_ATTR, None) is not None:
        raise AlreadyAppliedError(f"{type(model).__name__} is already tensor-parallel "
                                  f"(tp_size={getattr(model, PLAN_ATTR).tp_size}); apply it once, to the full model")
    loaded = read_mapping(model, mapping)
    group = process_group(group)
    tp_size, tp_rank = resolve_group(world_size, group)
    meta = [name for name, p in model.named_parameters() if p.is_meta]
    if meta and tp_size > 1:
        raise MetaDeviceError(f"{type(model).__name__} has {len(meta)} parameters on the meta device (e.g. {meta[0]}): "
                              "they hold no values to slice. Load the weights first (from_pretrained, or "
                              "to_empty() + load_state_dict), or use tpmap.from_pretrained to load each rank's slices")
    plan = planner.build_plan(model, loaded, tp_size)
    check_quantization_blocks(model, loaded, plan)
    check_quantized_slicing(model, plan)
    check_loss_parallel(plan, loaded, model, loss_parallel)
    sequence = plan_sequence_parallel(model, plan) if sequence_parallel else None  # may raise SequenceParallelError
    if tp_size == 1:
        return model
    return apply_plan(model, plan, tp_rank, group, loss_parallel=loss_parallel, check_inputs=check_inputs,
                      sequence=sequence)


def check_quantization_blocks(model: nn.Module, loaded: MappingFile, plan: Plan) -> None:
    """A weight quantized in blocks (per-group scales: `engine.quant_blocks`) whose block a shard boundary cuts is
    refused before anything changes, naming the tensor, the block and the world sizes up to 16 that work."""
    bad = quant_blocks.misaligned(model, plan)
    if not bad:
        return

    def works(ws: int) -> bool:
        try:
            return not quant_blocks.misaligned(model, planner.build_plan(model, loaded, ws))
        except TpmapError:  # (heads that the world size does not divide, ...)
            return False

    first = bad[0]
    fine = [ws for ws in range(1, 17) if works(ws)]
    raise DivisibilityError(
        f"{first.name} is quantized in blocks of {first.block} along dim {first.dim}, and at world size "
        f"{plan.tp_size} a shard boundary falls at {first.boundary}, inside a block "
        f"({len(bad)} tensor{'s' if len(bad) > 1 else ''} alike). World sizes that work: "
        f"{', '.join(map(str, fine))}; or quantize with blocks that divide each rank's share (smaller groups)")


def check_quantized_slicing(model: nn.Module, plan: Plan) -> None:
    """A quantized tensor subclass (torchao's) is sliced by its own operations; one whose slice takes an
    operation it does not implement (several pieces per rank, fused sections: a concatenation) is refused
    before anything changes. Tried on every rank's slice of each such tensor, so that every rank decides alike
    (ranks can differ in their number of pieces)."""
    for ps in plan.params.values():
        tensor = quant_blocks.tensor_of(model, ps.name)
        if ps.dim is None or not hasattr(tensor, "__tensor_flatten__"):
            continue
        for rank in range(plan.tp_size):
            try:
                shard.take(tensor, ps, rank)
            except (NotImplementedError, AssertionError) as e:  # torchao asserts on slices across its blocks
                pieces = len(ps.pieces[rank])
                how = (f"{pieces} pieces on rank {rank} (fused sections or heads)" if pieces > 1 else
                       f"rows zero-padded to {ps.local_size} on rank {rank} (an uneven vocabulary)"
                       if ps.local_size else f"one piece on rank {rank}")
                raise UnsupportedConfigError(
                    f"{ps.name} is a quantized {type(tensor).__name__} that this mapping splits in {how}, and the "
                    f"slice needs an operation the tensor type does not implement ({str(e).splitlines()[0][:160]}); "
                    "leave this layer out of the quantization (quantize_'s filter_fn)") from e


def check_loss_parallel(plan: Plan, loaded: MappingFile, model: nn.Module, loss_parallel: bool) -> None:
    if loss_parallel and not any(m.style == "vocab_head" for m in plan.modules):
        raise LossParallelError(
            f"loss_parallel needs an LM head split along the vocabulary, and {loaded.source.path} has no "
            f"vocab_parallel with lm_head: true for {type(model).__name__}; add `vocab_parallel: {{lm_head: true}}` "
            "to the mapping or drop loss_parallel"
        )


def apply_plan(model: nn.Module, plan: Plan, tp_rank: int, group, *, loss_parallel: bool, check_inputs: bool,
               read=None, sequence: SequencePlan | None = None) -> nn.Module:
    """Execute a checked plan on `model` for this rank and attach what a tensor-parallel model carries (the
    plan, loss_parallel, the input check). `read` gives each split tensor's local part (default: sliced
    from the model's own tensor; `tpmap.from_pretrained` reads it from the checkpoint)."""
    if plan.tp_size > 1:  # the collectives' path, decided now on every rank (TPMAP_SHM=1 that cannot: raised here)
        shm.for_group(group)
    warn_partial = bool(plan.kept_whole) and tp_rank == 0
    params_full = sum(p.numel() for p in model.parameters()) if warn_partial else 0
    shard.execute(model, plan, tp_rank, group, **({} if read is None else {"read": read}))
    setattr(model, PLAN_ATTR, plan)
    setattr(model, GROUP_ATTR, group)  # full_state_dict and save_pretrained default to it
    if warn_partial:
        _warn_partial(plan, sum(p.numel() for p in model.parameters()) / params_full)
    if sequence is not None:
        setattr(model, SEQUENCE_ATTR, install_sequence_parallel(model, sequence, group))
    if loss_parallel:
        head = next(m for m in plan.modules if m.style == "vocab_head")
        use_loss_parallel(model, model.get_submodule(head.name))
    if check_inputs:
        forward_check = input_check(model, group)
        model.register_forward_pre_hook(forward_check, with_kwargs=True)
        if callable(getattr(model, "generate", None)):
            check_generate_arguments(model, group, forward_check)
    return model


_WARNED: set[tuple[str, int]] = set()


def _warn_partial(plan, share: float) -> None:
    """Once per process and (mapping, world size), on rank 0: which blocks a partial mapping keeps whole."""
    if (plan.source, plan.tp_size) in _WARNED:
        return
    _WARNED.add((plan.source, plan.tp_size))
    blocks = "; ".join(f"{pattern} ({count} module{'s' * (count != 1)}): {reason}"
                       for pattern, reason, count in plan.kept_whole)
    warnings.warn(f"{plan.source} is a partial mapping: these blocks stay whole on every rank -- {blocks}. "
                  f"Each rank holds {share:.1%} of the parameters at tp_size {plan.tp_size} "
                  f"(1/{plan.tp_size} = {1 / plan.tp_size:.1%} would be a complete split).",
                  PartialMappingWarning, stacklevel=3)


def full_state_dict(model: nn.Module, group=None) -> dict[str, torch.Tensor]:
    """The unsharded state dict of a tensor-parallel model (a collective: call it on every rank of its
    group; `group` defaults to the one it was sharded over).

    Keys and shapes are those of the original model, so it saves as a standard checkpoint."""
    plan = getattr(model, PLAN_ATTR, None)
    state = model.state_dict()
    if plan is None:
        return state
    shards = {}
    for param in plan.params.values():
        for name in (param.name, *param.aliases):
            shards[name] = param
    group = group_of(model, group)
    return {k: shard.full_tensor(v, shards[k], group) if k in shards else v for k, v in state.items()}


def plan(model: nn.Module, world_size: int, *, mapping=None):
    """The plan `apply` would execute at `world_size`, without a process group and without changing `model`."""
    return planner.build_plan(model, read_mapping(model, mapping), world_size)
