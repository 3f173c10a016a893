"""LoRA through PEFT on a model sharded by tpmap (the optional extra ``tpmap[peft]``).

PEFT does not know tpmap's parallel modules; its public extension point for such layers is the custom-module
registration of a LoraConfig (``config._register_custom_module``). `register` registers `ParallelLoraLinear`
for ColumnParallelLinear and RowParallelLinear; `get_peft_model` and `from_pretrained` do it for you::

    model = tpmap.apply(model)                      # or tpmap.from_pretrained(...)
    model = tpmap.peft.get_peft_model(model, LoraConfig(r=8, target_modules=[...]))

The layers and their math: `tpmap.peft.layers`.

Not yet: expert tensors split another way or dealt whole to the ranks (experts='parallel'), mixed-adapter batches,
DoRA and other LoRA variants: each is refused
with a message.
"""
from __future__ import annotations

import functools
import re

import torch
import torch.distributed as dist
from torch import nn

try:
    import peft
except ImportError as e:  # pragma: no cover - exercised without the extra
    raise ImportError("tpmap.peft needs PEFT: pip install 'tpmap[peft]'") from e

from tpmap.checkpoint.save import delegate_saving
from tpmap.engine.layers import (
    TP_MODULES,
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    VocabParallelLMHead,
)
from tpmap.engine.plan import ParamLayout
from tpmap.engine.shard import full_tensor
from tpmap.execute import GROUP_ATTR, PLAN_ATTR, SEQUENCE_ATTR
from tpmap.peft.layers import (
    OWNER_GROUP_ATTR,
    PARAM_SHARDS_ATTR,
    SEED_ATTR,
    SHARD_ATTR,
    ParallelLoraEmbedding,
    ParallelLoraLinear,
    ParallelParamWrapper,
    inside_experts,
)

PEFT_LAYER_CLASSES = (nn.Linear, nn.Embedding, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.MultiheadAttention)  # PEFT's own


def prepare(model: nn.Module) -> nn.Module:
    """Record on each Column and Row of a tpmap-sharded model the ParamLayout of its weight (what
    ParallelLoraLinear slices adapters by). Idempotent; raises ValueError on a model tpmap did not shard."""
    base = model.get_base_model() if isinstance(model, peft.PeftModel) else model
    plan = getattr(base, PLAN_ATTR, None)
    if plan is None:
        raise ValueError("tpmap.peft: the model is not sharded by tpmap (tpmap.apply or tpmap.from_pretrained "
                         "first; an unsharded model needs plain peft.get_peft_model)")
    seed = torch.randint(0, 2**62, (1,))  # one draw, shared: fresh adapters then need no collective per layer
    group = getattr(base, GROUP_ATTR, None)
    dist.broadcast(seed, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    for ms in plan.modules:
        if ms.style in ("column", "row", "vocab_head", "vocab_embedding"):
            module = base.get_submodule(ms.name)
            if isinstance(module, peft.tuners.tuners_utils.BaseTunerLayer):
                module = module.get_base_layer()
            module.__dict__[SHARD_ATTR] = ms.weight
            module.__dict__[SEED_ATTR] = int(seed)
    for owner in _param_owners(base, plan):
        owner.__dict__[SEED_ATTR], owner.__dict__[OWNER_GROUP_ATTR] = int(seed), group
    return model


def _param_owners(base: nn.Module, plan):
    """The modules holding tensors that Param entries split (MoE experts), each with {tensor name: ParamLayout}
    recorded (PARAM_SHARDS_ATTR), the class of each being what `register` registers ParallelParamWrapper for."""
    owners = {}
    for name, shard in plan.params.items():
        module_name, _, tensor = name.rpartition(".")
        if shard.dim is None or not module_name:
            continue
        module = base.get_submodule(module_name)
        while isinstance(module, peft.tuners.tuners_utils.BaseTunerLayer):  # (nested ParamWrappers)
            module = module.get_base_layer()
        if isinstance(module, TP_MODULES):  # a Column's or Row's weight (ParallelLoraLinear's)
            continue
        module.__dict__.setdefault(PARAM_SHARDS_ATTR, {})[tensor] = shard
        owners[id(module)] = module
    return list(owners.values())


def register(config, model: nn.Module | None = None):
    """`config` (a peft LoraConfig) with ParallelLoraLinear registered for tpmap's Column and Row layers and
    its vocabulary-parallel LM head (a Column over the vocabulary: B's rows padded like the head's). With the
    sharded `model` (prepared), also ParallelParamWrapper for the classes of the modules holding tensors that
    Param entries split (MoE experts): PEFT dispatches a custom module first, with the targeted tensor's name."""
    modules = {**dict.fromkeys((ColumnParallelLinear, RowParallelLinear, VocabParallelLMHead), ParallelLoraLinear),
               VocabParallelEmbedding: ParallelLoraEmbedding}
    if model is not None:
        base = model.get_base_model() if isinstance(model, peft.PeftModel) else model
        plan = getattr(base, PLAN_ATTR, None)
        if plan is not None:  # only expert containers: a class PEFT has a LoRA layer of its own for keeps it
            owners = [m for m in _param_owners(base, plan) if not isinstance(m, PEFT_LAYER_CLASSES)
                      and any(inside_experts(shard) for shard in m.__dict__[PARAM_SHARDS_ATTR].values())]
            modules.update(dict.fromkeys((type(m) for m in owners), ParallelParamWrapper))
    config._register_custom_module(modules)
    return config


def _sharded(model: nn.Module) -> bool:
    """Whether tpmap sharded `model` (tpmap.apply returns a model unchanged at world size 1)."""
    base = model.get_base_model() if isinstance(model, peft.PeftModel) else model
    return getattr(base, PLAN_ATTR, None) is not None


def get_peft_model(model: nn.Module, config, adapter_name: str = "default", **kwargs):
    """peft.get_peft_model on a tpmap-sharded model: adapters on its Column and Row layers (see the module).
    On a model tpmap left unsharded (world size 1), plain peft.get_peft_model."""
    if not _sharded(model):
        return peft.get_peft_model(model, config, adapter_name=adapter_name, **kwargs)
    prepare(model)
    before = _Before(model)
    peft_model = peft.get_peft_model(model, register(config, model), adapter_name=adapter_name, **kwargs)
    try:
        _refuse_split_parameters(peft_model, before.names, getattr(model, PLAN_ATTR))
    except BaseException:
        before.restore(peft_model)
        raise
    return take_over_entry_hooks(peft_model)


class _Before:
    """What PEFT changes on the model it wraps, to put back when tpmap refuses the result."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.names = {id(m): n for n, m in model.named_modules()}
        self.trainable = {name: p.requires_grad for name, p in model.named_parameters()}
        self.had_config = "peft_config" in vars(model)

    def restore(self, peft_model) -> None:
        peft_model.base_model.unload()  # its own modules back in place
        for name, p in self.model.named_parameters():
            p.requires_grad_(self.trainable[name])
        if not self.had_config:
            vars(self.model).pop("peft_config", None)


def _refuse_split_parameters(peft_model, names: dict[int, str], plan) -> None:
    """LoRA on a bare parameter (PEFT's ParamWrapper: ``target_parameters``, and the MoE expert tensors PEFT
    maps names such as gate_proj onto) that a Param entry splits other than inside every expert (along the
    experts, a partial term, a cut ModuleList, a 2-D tensor) is not supported yet."""
    split = {name: shard for name, shard in plan.params.items() if shard.dim is not None}
    dealt = {route.module for route in plan.routes}  # experts='parallel': whole experts dealt to the ranks
    for module in peft_model.modules():
        if isinstance(module, peft.tuners.lora.ParamWrapper):
            owner = names.get(id(module.get_base_layer()), "?")
            name = f"{owner}.{module.parameter_name}"
            if name in split and owner in dealt:
                raise NotImplementedError(
                    f"tpmap.peft: LoRA on {name} {tuple(split[name].full_shape)}, whose whole experts are dealt to the "
                    "ranks (experts='parallel'), is not supported yet: shard the model with experts='split' (each "
                    "expert split along its width; tpmap.apply, tpmap.from_pretrained and tpmap.parallelize take "
                    "it), under which tpmap.peft splits the experts' adapters exactly, or leave the experts out of "
                    r"the targets (for example target_modules=r'.*\.(q_proj|k_proj|v_proj|o_proj)')")
            if name in split and not (isinstance(module, ParallelParamWrapper) and module._shard() is not None):
                shard = split[name]
                raise NotImplementedError(
                    f"tpmap.peft: LoRA on {name} {tuple(shard.full_shape)}, split by a Param entry along dim "
                    f"{shard.dim}{' (a partial term)' if shard.partial else ''}, is not supported: tpmap.peft splits "
                    "LoRA on a 3-D expert tensor (experts, out, in) cut inside every expert (dim 1 or 2), not along "
                    "the experts or another layout; PEFT targets it through target_parameters, or by mapping a "
                    "target_modules name such as gate_proj onto the experts: leave it out of the targets (for "
                    r"example target_modules=r'.*\.(q_proj|k_proj|v_proj|o_proj)')")


def take_over_entry_hooks(peft_model):
    """A module the mapping keeps whole but marks at its edge (Enter: its output's gradient is all-reduced;
    Reduce; Input: a forward argument cut to this rank's heads) gets PEFT's plain LoRA layer, whose term is
    added outside the wrapped module, past its hooks: the wrapper takes tpmap's hooks over, so they see the
    output with the LoRA term (without it, MLA's kv_a_proj_with_mqa adapter's gradient is a partial sum).
    With sequence parallelism such a layer inside a block sees only this rank's tokens (or, in a module run on
    the gathered sequence, gets only their part of its output's gradient), as a norm does: its adapter tensors'
    gradients are summed over the ranks like the norm's (`_sum_over_tokens`).
    Called by get_peft_model and from_pretrained; call it after an ``add_adapter`` that wraps new modules."""
    seq = getattr(peft_model.get_base_model(), SEQUENCE_ATTR, None)
    for name, module in peft_model.named_modules():
        if not isinstance(module, peft.tuners.lora.LoraLayer) or isinstance(module, ParallelLoraLinear):
            continue
        if isinstance(module, peft.tuners.lora.ParamWrapper):  # its term is inside the module's own tensor: the
            continue  # module's hooks see it already (taken over, a merge_and_unload would drop them with the wrapper)
        if seq is not None:
            _sum_over_tokens(module, name.removeprefix("base_model.model."), seq)
        base = module.get_base_layer()
        for hooks, flags, register_hook in ((base._forward_pre_hooks, base._forward_pre_hooks_with_kwargs,
                                             module.register_forward_pre_hook),
                                            (base._forward_hooks, base._forward_hooks_with_kwargs,
                                             module.register_forward_hook)):
            for key, hook in list(hooks.items()):
                if getattr(hook, "tpmap_entry", None) is None:
                    continue
                register_hook(hook, with_kwargs=key in flags)
                del hooks[key]
                flags.pop(key, None)
    return peft_model


def _sum_over_tokens(layer, name: str, seq) -> None:
    """PEFT's own LoRA layer `name` (a module the mapping keeps whole) inside a sequence-parallel stack: each
    adapter tensor's gradient summed over the ranks when its stack's backward ran split (SequenceState.summed,
    the hook of the stack's norms). Once per tensor: a tensor already hooked is marked."""
    stack = next((i for i, prefix in enumerate(seq.stack_prefixes) if name.startswith(prefix)), None)
    if stack is None:  # outside the blocks (an embedding, a pooler): replicated, every rank sees every token
        return
    containers = (layer.lora_A, layer.lora_B, layer.lora_embedding_A, layer.lora_embedding_B)
    for container in containers:
        for value in container.values():
            p = value.weight if isinstance(value, nn.Module) else value
            if p.requires_grad and not p.__dict__.get("tpmap_summed_over_tokens"):
                p.register_hook(functools.partial(seq.summed, stack))
                p.__dict__["tpmap_summed_over_tokens"] = True


def _adapter_tensors(peft_model):
    """(parameter name, adapter, file key, tensor, ParamLayout or None) of every LoRA A and B and every tensor of
    a ``modules_to_save`` copy: the file key is PEFT's (the adapter name dropped), the shard says how this rank's
    tensor is split (None: whole): a ParallelLoraLinear's A or B, or a copy of a sharded module, split like it."""
    plan = getattr(peft_model.get_base_model(), PLAN_ATTR, None)
    split = plan.params if plan is not None else {}
    for module_name, module in peft_model.named_modules():
        if isinstance(module, peft.tuners.lora.LoraLayer):
            for which, container in (("A", module.lora_A), ("B", module.lora_B)):
                for adapter, linear in container.items():
                    shard = module.adapter_shard(which, adapter) if isinstance(
                        module, (ParallelLoraLinear, ParallelParamWrapper)) else None
                    yield (f"{module_name}.lora_{which}.{adapter}.weight", adapter,
                           f"{module_name}.lora_{which}.weight", linear.weight, shard)
            for which, params in (("A", module.lora_embedding_A), ("B", module.lora_embedding_B)):
                for adapter, param in params.items():  # an embedding's LoRA (PEFT's own layer: whole)
                    yield (f"{module_name}.lora_embedding_{which}.{adapter}", adapter,
                           f"{module_name}.lora_embedding_{which}", param, None)
        elif isinstance(module, peft.utils.other.ModulesToSaveWrapper):
            base_name = module_name.removeprefix("base_model.model.")  # the name in the sharded model's plan
            for adapter in module.modules_to_save:
                for file_suffix, loaded_suffix in module.adapter_state_dict_load_map(adapter).items():
                    yield (f"{module_name}.{loaded_suffix}", adapter, f"{module_name}.{file_suffix}",
                           functools.reduce(getattr, loaded_suffix.split("."), module),
                           split.get(f"{base_name}.{file_suffix}"))


def _split(shard: ParamLayout | None) -> bool:
    return shard is not None and shard.dim is not None


def _group(peft_model):
    """The group the base model was sharded over (None: the default group)."""
    return getattr(peft_model.get_base_model(), GROUP_ATTR, None)


def save_pretrained(peft_model, save_directory, **kwargs) -> None:
    """Write a standard PEFT adapter (adapter_config.json, adapter_model.safetensors with full-size tensors)
    from the group's rank 0; plain PEFT loads it on an unsharded base. A collective: call it on every rank.
    ``kwargs`` go to PeftModel.save_pretrained (selected_adapters, safe_serialization, ...). Also what
    ``tpmap.save_pretrained(peft_model, ...)`` does."""
    initialized = dist.is_available() and dist.is_initialized()
    group = _group(peft_model)
    rank = dist.get_rank(group) if initialized else 0
    tensors = list(_adapter_tensors(peft_model)) + list(_embedding_tensors(peft_model, kwargs))
    full = {name: full_tensor(t, shard, group, dst=0) if _split(shard) else t.detach()
            for name, _, _, t, shard in tensors}
    if rank == 0:
        state = peft_model.state_dict()
        state.update(full)
        peft_model.save_pretrained(save_directory, state_dict=state, **kwargs)
    if initialized:
        dist.barrier(group=group)


def _embedding_tensors(peft_model, kwargs):
    """The input and output embeddings' own tensors where PEFT saves them beside the adapters (its
    ``save_embedding_layers``: True, or "auto" with an embedding layer among the targets), with their shards:
    a vocabulary-parallel embedding or head holds only its rows here, and the file needs the whole tensor."""
    save = kwargs.get("save_embedding_layers", "auto")
    if not (save is True or (save == "auto" and _embedding_targeted(peft_model))):
        return
    base = peft_model.get_base_model()
    plan = getattr(base, PLAN_ATTR, None)
    if plan is None:
        return
    layers = {id(m.get_base_layer() if isinstance(m, peft.tuners.tuners_utils.BaseTunerLayer) else m)
              for m in (base.get_input_embeddings(), base.get_output_embeddings()) if m is not None}
    for module_name, module in peft_model.named_modules():
        if id(module) in layers:
            plan_name = module_name.removeprefix("base_model.model.").replace(".base_layer", "")
            for name, param in module.named_parameters(recurse=False):
                yield (f"{module_name}.{name}", None, None, param, plan.params.get(f"{plan_name}.{name}"))


def _embedding_targeted(peft_model) -> bool:
    """PEFT's "auto" rule: an embedding layer name (embed_tokens, lm_head, ...) among an adapter's target_modules,
    a list of names or a regular expression matched against the module names."""
    names = peft.utils.other.EMBEDDING_LAYER_NAMES
    for config in peft_model.peft_config.values():
        targets = getattr(config, "target_modules", None) or ()
        if isinstance(targets, str):
            modules = [n for n, _ in peft_model.get_base_model().named_modules()]
            if any(re.fullmatch(targets, n) for n in modules if any(re.match(rf"(.*\.)?{e}$", n) for e in names)):
                return True
        elif set(targets) & set(names):
            return True
    return False


def from_pretrained(model: nn.Module, adapter_dir, adapter_name: str = "default", is_trainable: bool = False):
    """PeftModel.from_pretrained for a tpmap-sharded model: a LoRA adapter folder (as PEFT writes it, full
    size) onto the sharded layers, each rank reading only its slices of adapter_model.safetensors.

    Every tensor's full shape is checked against the layer it goes to before any value is read: an adapter
    of another model size (or rank r) raises ValueError naming the tensor and both shapes, and a failed load
    takes the adapter layers out again (`unload`), so the model is left as it was. The check reads only the
    file's header and the plan, the same on every rank, so every rank raises alike."""
    from pathlib import Path

    config = peft.PeftConfig.from_pretrained(str(adapter_dir))
    if config.peft_type != peft.PeftType.LORA:
        raise ValueError(f"{adapter_dir}: tpmap.peft loads LoRA adapters, this one is {config.peft_type}")
    file = Path(adapter_dir) / "adapter_model.safetensors"
    if not file.is_file():
        raise FileNotFoundError(f"{file}: no adapter_model.safetensors (tpmap.peft reads safetensors adapters)")
    if not _sharded(model):  # world size 1: tpmap.apply left the model as it was
        return peft.PeftModel.from_pretrained(model, str(adapter_dir), adapter_name=adapter_name,
                                              is_trainable=is_trainable)
    config.inference_mode = not is_trainable
    prepare(model)
    before = _Before(model)
    peft_model = peft.PeftModel(model, register(config, model), adapter_name)
    try:
        _refuse_split_parameters(peft_model, before.names, getattr(model, PLAN_ATTR))
        _load_slices(peft_model, file, adapter_name)
        take_over_entry_hooks(peft_model)
    except BaseException:  # the model as it was: its own modules, requires_grad flags and attributes back
        before.restore(peft_model)
        raise
    return peft_model


def _load_slices(peft_model, file, adapter_name: str) -> None:
    from safetensors import safe_open

    rank = dist.get_rank(_group(peft_model))  # (a sharded model: torch.distributed is initialized)
    wanted = [(key, tensor, shard) for _, adapter, key, tensor, shard in _adapter_tensors(peft_model)
              if adapter == adapter_name]
    with safe_open(str(file), framework="pt") as f:
        keys = set(f.keys())
        for key, tensor, shard in wanted:  # every check first, from the header: the same on every rank
            full = shard.full_shape if _split(shard) else tuple(tensor.shape)
            if key not in keys:
                raise ValueError(f"{file}: no tensor {key!r} for the adapter's {full} weight; was it saved for "
                                 "another model or target_modules?")
            stored = tuple(f.get_slice(key).get_shape())
            if stored != tuple(full):
                raise ValueError(f"{file}: {key!r} is {stored}, the model's layer needs {tuple(full)}: an adapter "
                                 "trained on another model size or with another rank r (check the base model and "
                                 "adapter_config.json's r / rank_pattern)")
        with torch.no_grad():
            for key, tensor, shard in wanted:
                if not _split(shard):
                    local = f.get_tensor(key)
                else:  # only this rank's ranges are read
                    cut = f.get_slice(key)
                    parts = [cut[start:start + n] if shard.dim == 0 else cut[:, start:start + n]
                             for start, n in shard.pieces[rank]]
                    local = torch.cat(parts, dim=shard.dim)
                    pad = (shard.local_size or 0) - local.shape[shard.dim]
                    if pad > 0:  # a vocabulary's padded rows
                        local = torch.cat([local, local.new_zeros(pad, *local.shape[1:])])
                assert tuple(local.shape) == tuple(tensor.shape), (key, local.shape, tensor.shape)
                tensor.copy_(local)


delegate_saving(lambda model: isinstance(model, peft.PeftModel), save_pretrained)  # tpmap.save_pretrained(peft_model)
