"""`tpmap.apply`: make a transformers model tensor-parallel in place, on every rank."""
from __future__ import annotations

import functools
import inspect
import warnings
import zlib
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from .errors import (
    AlreadyAppliedError,
    InputMismatchError,
    LossParallelError,
    MappingError,
    MetaDeviceError,
    ProcessGroupError,
    PartialMappingWarning,
    SequenceParallelError,  # noqa: F401  (raised by engine.sequence.build)
)
from .loader import LoadedMapping, SourceMap, for_model_type, load_file
from .schema import Mapping

PLAN_ATTR = "tpmap_plan"  # the applied Plan is kept on the model under this name
GROUP_ATTR = "tpmap_group"  # and the process group it was sharded over (None: the default group)
SEQUENCE_ATTR = "tpmap_sequence"  # sequence parallelism's state (engine.sequence), when it is on


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


def process_group(group):
    """The ProcessGroup that `group` names: a ProcessGroup, a 1-D DeviceMesh (the tensor-parallel dimension
    of a 2-D layout, ``mesh["tp"]``) or None (the default group, every rank)."""
    from torch.distributed.device_mesh import DeviceMesh

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
    from tpmap.engine import plan as planning

    if getattr(model, PLAN_ATTR, None) is not None:
        raise AlreadyAppliedError(f"{type(model).__name__} is already tensor-parallel "
                                  f"(tp_size={getattr(model, PLAN_ATTR).tp_size}); apply it once, to the full model")
    loaded = load_mapping(model, mapping)
    group = process_group(group)
    tp_size, tp_rank = resolve_group(world_size, group)
    meta = [name for name, p in model.named_parameters() if p.is_meta]
    if meta and tp_size > 1:
        raise MetaDeviceError(f"{type(model).__name__} has {len(meta)} parameters on the meta device (e.g. {meta[0]}): "
                              "they hold no values to slice. Load the weights first (from_pretrained, or "
                              "to_empty() + load_state_dict), or use tpmap.from_pretrained to load each rank's slices")
    plan = planning.build(model, loaded, tp_size)
    check_loss_parallel(plan, loaded, model, loss_parallel)
    sequence = sequence_plan(model, plan, sequence_parallel)
    if tp_size == 1:
        return model
    return install(model, plan, tp_rank, group, loss_parallel=loss_parallel, check_inputs=check_inputs,
                   sequence=sequence)


def sequence_plan(model: nn.Module, plan, sequence_parallel: bool):
    """Where sequence parallelism's collectives go (None when off); raises SequenceParallelError first."""
    from tpmap.engine import sequence

    return sequence.build(model, plan) if sequence_parallel else None


def check_loss_parallel(plan, loaded: LoadedMapping, model: nn.Module, loss_parallel: bool) -> None:
    if loss_parallel and not any(m.style == "vocab_head" for m in plan.modules):
        raise LossParallelError(
            f"loss_parallel needs an LM head split along the vocabulary, and {loaded.source.path} has no "
            f"vocab_parallel with lm_head: true for {type(model).__name__}; add `vocab_parallel: {{lm_head: true}}` "
            "to the mapping or drop loss_parallel"
        )


def install(model: nn.Module, plan, tp_rank: int, group, *, loss_parallel: bool, check_inputs: bool,
            read=None, sequence=None) -> nn.Module:
    """Execute a checked plan on `model` for this rank and attach what a tensor-parallel model carries (the
    plan, loss_parallel, the input check). `read` gives each split tensor's local part (default: sliced
    from the model's own tensor; `tpmap.from_pretrained` reads it from the checkpoint)."""
    from tpmap.engine import sequence as sequence_parallel
    from tpmap.engine import shard

    warn_partial = bool(plan.kept_whole) and tp_rank == 0
    params_full = sum(p.numel() for p in model.parameters()) if warn_partial else 0
    shard.execute(model, plan, tp_rank, group, **({} if read is None else {"read": read}))
    setattr(model, PLAN_ATTR, plan)
    setattr(model, GROUP_ATTR, group)  # full_state_dict and save_pretrained default to it
    if warn_partial:
        _warn_partial(plan, sum(p.numel() for p in model.parameters()) / params_full)
    if sequence is not None:
        setattr(model, SEQUENCE_ATTR, sequence_parallel.install(model, sequence, group))
    if loss_parallel:
        head = next(m for m in plan.modules if m.style == "vocab_head")
        _use_loss_parallel(model, model.get_submodule(head.name))
    if check_inputs:
        forward_check = _same_inputs_on_every_rank(model, group)
        model.register_forward_pre_hook(forward_check, with_kwargs=True)
        if callable(getattr(model, "generate", None)):
            _same_generate_arguments_on_every_rank(model, group, forward_check)
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


def _tensors(args: tuple, kwargs: dict, positional: list[str]) -> list[tuple[str, torch.Tensor]]:
    """Every tensor argument of a forward call, by name (positional ones by the signature), including
    tensors inside a list or tuple argument; in a fixed order (by name) so ranks compare like with like."""
    named = dict(zip(positional, args)) | kwargs
    named |= {f"*args[{i}]": a for i, a in enumerate(args[len(positional):])}
    out = []
    for name, value in sorted(named.items()):
        if isinstance(value, torch.Tensor):
            out.append((name, value))
        elif isinstance(value, (list, tuple)):
            out += [(f"{name}[{i}]", v) for i, v in enumerate(value) if isinstance(v, torch.Tensor)]
    return out


def _code(text: str) -> float:
    """A deterministic number for a string (the same on every rank, unlike hash())."""
    return float(zlib.crc32(text.encode()))


def _sums(t: torch.Tensor) -> tuple[float, float]:
    """(position-weighted sum, plain sum) of a tensor's values in float64: a reordering changes the first."""
    flat = t.detach().reshape(-1)
    if flat.dtype != torch.float64:
        flat = flat.to(torch.float64)
    positions = torch.arange(1, flat.numel() + 1, dtype=torch.float64, device=flat.device)
    return float(flat @ positions), float(flat.sum())


def _fingerprint(tensors: list[tuple[str, torch.Tensor]], rng_state: torch.Tensor | None) -> torch.Tensor:
    """Five float64 numbers for all tensor arguments together (fixed size, so one all-gather serves any
    call): how many; their names and shapes; a position- and name-weighted sum of their values; a
    plain sum; and the default RNG state (training mode: ranks must draw the same dropout masks)."""
    names = sum(_code(f"{n}:{tuple(t.shape)}:{t.dtype}") for n, t in tensors)
    weighted = plain = 0.0
    for name, t in tensors:
        by_position, total = _sums(t)
        weighted += by_position * (1.0 + _code(name) / 2**32)
        plain += total
    rng = _code(rng_state.numpy().tobytes().hex()) if rng_state is not None else 0.0
    row = torch.tensor([len(tensors), names, weighted, plain, rng], dtype=torch.float64)
    return torch.nan_to_num(row)  # a NaN input must not read as a mismatch


def _positional_names(function) -> list[str]:
    parameters = inspect.signature(function).parameters.values()
    return [p.name for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


def _compare_across_ranks(tensors, rng_state, group) -> None:
    """One all-gather of the 5-number fingerprint; on a mismatch, name what differs and raise."""
    device = tensors[0][1].device if tensors else torch.device("cpu")
    mine = _fingerprint(tensors, rng_state).to(device)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, mine, group=group)
    bad = [r for r, other in enumerate(everyone) if not torch.equal(everyone[0], other)]
    if bad:
        raise InputMismatchError(_mismatch_message(tensors, everyone, bad, group))


def _same_inputs_on_every_rank(model: nn.Module, group):
    """The input check: before every forward, one all-gather of a 5-number fingerprint of *every* tensor
    argument (and, in training mode, of the RNG state); on a mismatch, every rank (they all see it) joins
    one more gather to name the arguments that differ, and raises InputMismatchError.

    ``hook.paused`` skips it: `generate` checks its own arguments and the RNG state once per call, and
    every forward inside it then gets inputs derived identically on every rank (the gathered logits are
    the same bytes everywhere, sampling draws from the checked RNG state), so the decode steps need no
    gather of their own."""
    positional = _positional_names(model.forward)

    def hook(module, args, kwargs):
        if hook.paused or torch.compiler.is_compiling():  # compiled: the fingerprint reads values into
            return  # Python floats, a graph break each; compiled forwards go unchecked (README, "torch.compile")
        _compare_across_ranks(_tensors(args, kwargs, positional), torch.get_rng_state() if module.training else None,
                              group)

    hook.paused = False
    return hook


def _same_generate_arguments_on_every_rank(model: nn.Module, group, forward_check=None) -> None:
    """Ranks calling generate with different settings (max_new_tokens, ...) would run different numbers
    of forwards and leave the others blocked in a collective: compare them once per call, up front, with
    the tensor arguments (the prompt) and the RNG state (sampling); the per-forward check (`forward_check`)
    is paused for the forwards generate runs."""
    generate = model.generate
    positional = _positional_names(generate)

    @functools.wraps(generate)
    def checked_generate(*args, **kwargs):
        config = kwargs.get("generation_config") or getattr(model, "generation_config", None)
        settings = {k: v for k, v in kwargs.items() if v is None or isinstance(v, (bool, int, float, str))}
        settings["generation_config"] = config.to_json_string(use_diff=False) if config is not None else ""
        gathered: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, settings, group=group)
        differ = sorted(k for k in set().union(*gathered) if any(g.get(k) != gathered[0].get(k) for g in gathered))
        if differ:
            bad = [r for r, g in enumerate(gathered) if any(g.get(k) != gathered[0].get(k) for k in differ)]
            raise InputMismatchError(
                f"ranks {bad} called generate with other settings than rank 0: {', '.join(differ)} "
                f"({differ[0]} = {[g.get(differ[0]) for g in gathered]} per rank). Every rank must generate "
                "the same way, or the ranks run different numbers of forwards and block each other.")
        if forward_check is None or forward_check.paused:  # no input check, or generate called re-entrantly
            return generate(*args, **kwargs)
        sampling = kwargs.get("do_sample", getattr(config, "do_sample", False))
        _compare_across_ranks(_tensors(args, kwargs, positional), torch.get_rng_state() if sampling else None, group)
        forward_check.paused = True
        try:
            return generate(*args, **kwargs)
        finally:
            forward_check.paused = False

    model.generate = checked_generate


def _mismatch_message(tensors, everyone: list[torch.Tensor], bad: list[int], group) -> str:
    """Which arguments differ (a second, rare gather of per-argument summaries), and what to do."""
    summary = {n: (tuple(t.shape), str(t.dtype), _sums(t)) for n, t in tensors}
    gathered: list = [None] * len(everyone)
    dist.all_gather_object(gathered, summary, group=group)
    names = sorted(set().union(*gathered))
    differ = [n for n in names if any(g.get(n) != gathered[0].get(n) for g in gathered)]
    rng = any(e[4] != everyone[0][4] for e in everyone)
    what = ", ".join(differ) if differ else ("the RNG state (training mode, or sampling)" if rng else "tensor values")
    advice = ("seed every rank with the same torch.manual_seed before training or sampling (dropout masks and "
              "sampled tokens must match)"
              if rng and not differ else "give all ranks the same batch (same data order and seed)")
    return (f"the ranks of this tensor-parallel model got different inputs: ranks {bad} differ from rank 0 in "
            f"{what}. Every rank must call the model with the same tensors: {advice}.")


def _use_loss_parallel(model: nn.Module, head) -> None:
    from tpmap.engine.loss import hf_loss_function

    head.loss_parallel = True
    replacement = hf_loss_function(model.loss_function, head)
    if replacement is not None:
        model.loss_function = replacement
    forward = model.forward
    message = (f"{type(model).__name__} computes its loss from labels without its loss_function, on vocabulary-"
               "sharded logits, so that loss would be wrong. With loss_parallel, call the model without labels and "
               "use tpmap.vocab_parallel_cross_entropy(model, outputs.logits, labels).")

    @functools.wraps(forward)  # keeps the signature transformers inspects (e.g. for logits_to_keep)
    def forward_with_loss_check(*args, **kwargs):
        # labels given but the loss not computed by our loss_function: refuse rather than return a wrong loss
        calls = head.loss_calls
        with_labels = kwargs.get("labels") is not None
        try:
            out = forward(*args, **kwargs)
        except Exception as e:
            if with_labels and head.loss_calls == calls:
                raise LossParallelError(message) from e
            raise
        if with_labels and head.loss_calls == calls:
            raise LossParallelError(message)
        return out

    model.forward = forward_with_loss_check


def vocab_parallel_cross_entropy(model: nn.Module, logits: torch.Tensor, labels: torch.Tensor,
                                 ignore_index: int = -100) -> torch.Tensor:
    """Mean cross-entropy of a vocabulary-parallel model's logits (no label shift), computed on this
    rank's vocabulary shard: local logits (loss_parallel in training mode) or gathered ones."""
    from tpmap.engine.layers import VocabParallelLMHead
    from tpmap.engine.loss import vocab_parallel_cross_entropy as ce

    head = next((m for m in model.modules() if isinstance(m, VocabParallelLMHead)), None)
    if head is None:
        raise LossParallelError("the model has no vocabulary-sharded LM head (vocab_parallel.lm_head in its mapping)")
    return ce(logits, labels, head, ignore_index)


def full_state_dict(model: nn.Module, group=None) -> dict[str, torch.Tensor]:
    """The unsharded state dict of a tensor-parallel model (a collective: call it on every rank of its
    group; `group` defaults to the one it was sharded over).

    Keys and shapes are those of the original model, so it saves as a standard checkpoint."""
    from tpmap.engine.shard import full_tensor

    plan = getattr(model, PLAN_ATTR, None)
    state = model.state_dict()
    if plan is None:
        return state
    shards = {}
    for shard in plan.params.values():
        for name in (shard.name, *shard.aliases):
            shards[name] = shard
    group = group_of(model, group)
    return {k: full_tensor(v, shards[k], group) if k in shards else v for k, v in state.items()}


def plan(model: nn.Module, world_size: int, *, mapping=None):
    """The plan `apply` would execute at `world_size`, without a process group and without changing `model`."""
    from tpmap.engine import plan as planning

    return planning.build(model, load_mapping(model, mapping), world_size)
