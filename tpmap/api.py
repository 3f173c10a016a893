"""`tpmap.apply`: make a transformers model tensor-parallel in place, on every rank.

The checks are `tpmap.prepare`'s steps (mapping, process group, plan, options) and apply's own (the model's
tensors: none on the meta device, quantized ones sliceable); `tpmap.execute.apply_plan` then changes the model."""
from __future__ import annotations

import torch
from torch import nn

from tpmap.api_errors import AlreadyAppliedError, MetaDeviceError
from tpmap.engine import planner, quant_blocks, shard
from tpmap.engine.errors import UnsupportedConfigError
from tpmap.engine.plan import Plan
from tpmap.execute import GROUP_ATTR, PLAN_ATTR, SEQUENCE_ATTR, apply_plan
from tpmap.language.errors import DivisibilityError, TpmapError
from tpmap.language.source import MappingFile
from tpmap.prepare import Place, prepare, process_group, read_mapping

# the names that code outside tpmap may know from here (they live in tpmap.prepare and tpmap.execute now)
__all__ = ["GROUP_ATTR", "PLAN_ATTR", "SEQUENCE_ATTR", "apply", "check_quantization_blocks", "check_quantized_slicing",
           "full_state_dict", "group_of", "load_mapping", "plan", "read_mapping"]

load_mapping = read_mapping  # its earlier name ("load" now means reading weights only); kept for existing code


def group_of(model: nn.Module, group=None):
    """`group` (see `process_group`), or else the group `model` was sharded over by apply/from_pretrained."""
    return process_group(group) if group is not None else getattr(model, GROUP_ATTR, None)


def apply(model: nn.Module, world_size: int | None = None, *, group=None, mapping=None,
          loss_parallel: bool = False, check_inputs: bool = True, sequence_parallel: bool = False,
          experts: str | None = None) -> nn.Module:
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
      (Megatron-SP; `tpmap.engine.sequence`): norms, dropout and residual adds run on T/tp_size tokens per rank.
      Each stack of blocks (an encoder-decoder has two) is split and gathered on its own. A forward whose
      sequence length does not divide by the world size runs as plain TP. Models it cannot run (MoE
      experts and routers, SSM mixers and convolutions) raise `SequenceParallelError` here.

    * ``experts``: where the mapping gives both, how MoE experts are placed: ``"split"`` (every expert split along
      its intermediate width, tensor parallelism inside every expert) or ``"parallel"`` (whole experts dealt to
      the ranks, E // ws or one more each; every rank routes alike and runs its own experts' tokens; one all-reduce
      per MoE block either way). Default: the mapping's ``experts``.

    Example (run under ``torchrun --nproc-per-node 2``)::

        dist.init_process_group("gloo")
        model = tpmap.apply(AutoModelForCausalLM.from_config(cfg), world_size=2)
    """
    if getattr(model, PLAN_ATTR, None) is not None:
        raise AlreadyAppliedError(f"{type(model).__name__} is already tensor-parallel "
                                  f"(tp_size={getattr(model, PLAN_ATTR).tp_size}); apply it once, to the full model")
    loaded = read_mapping(model, mapping, experts)
    place = Place.of(world_size, group)
    refuse_meta_tensors(model, place.tp_size)
    prepared = prepare(model, loaded, place, loss_parallel=loss_parallel, sequence_parallel=sequence_parallel,
                       check_inputs=check_inputs)
    refuse_uneven_quantized(model, prepared.plan)
    check_quantization_blocks(model, loaded, prepared.plan)
    check_quantized_slicing(model, prepared.plan)
    if place.tp_size == 1:
        return model
    return apply_plan(model, prepared)


def refuse_meta_tensors(model: nn.Module, tp_size: int) -> None:
    """A model with parameters on the meta device holds no values to slice (above tp_size 1)."""
    meta = [name for name, p in model.named_parameters() if p.is_meta]
    if meta and tp_size > 1:
        raise MetaDeviceError(f"{type(model).__name__} has {len(meta)} parameters on the meta device (e.g. {meta[0]}): "
                              "they hold no values to slice. Load the weights first (from_pretrained, or "
                              "to_empty() + load_state_dict), or use tpmap.from_pretrained to load each rank's slices")


def refuse_uneven_quantized(model: nn.Module, plan: Plan) -> None:
    """Quantized tensors (torchao's subclasses) are not proven on uneven splits: refused, naming the first."""
    for ps in plan.params.values():
        tensor = quant_blocks.tensor_of(model, ps.name)
        if ps.dim is not None and hasattr(tensor, "__tensor_flatten__"):
            plan.refuse_uneven(f"a quantized {type(tensor).__name__} ({ps.name})")


def check_quantization_blocks(model: nn.Module, loaded: MappingFile, plan: Plan) -> None:
    """A weight quantized in blocks (per-group scales: `engine.quant_blocks`) whose block a shard boundary cuts is
    refused before anything changes, naming the tensor, the block and the world sizes up to 16 that work."""
    bad = quant_blocks.misaligned(model, plan)
    if not bad:
        return

    def works(tp_size: int) -> bool:
        try:
            other = planner.build_plan(model, loaded, tp_size)
        except TpmapError:  # (heads that the world size does not divide, ...)
            return False
        return not other.uneven and not quant_blocks.misaligned(model, other)  # quantized: never uneven (above)

    first = bad[0]
    fine = [tp_size for tp_size in range(1, 17) if works(tp_size)]
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


def plan(model: nn.Module, world_size: int, *, mapping=None, experts: str | None = None):
    """The plan `apply` would execute at `world_size`, without a process group and without changing `model`."""
    return prepare(model, read_mapping(model, mapping, experts), Place.planning(world_size)).plan
