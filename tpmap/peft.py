"""LoRA through PEFT on a model sharded by tpmap (the optional extra ``tpmap[peft]``).

PEFT does not know tpmap's parallel modules; its public extension point for such layers is the custom-module
registration of a LoraConfig (``config._register_custom_module``). `register` registers `ParallelLoraLinear`
for ColumnParallelLinear and RowParallelLinear; `get_peft_model` and `from_pretrained` do it for you::

    model = tpmap.apply(model)                      # or tpmap.from_pretrained(...)
    model = tpmap.peft.get_peft_model(model, LoraConfig(r=8, target_modules=[...]))

The math (s = lora_alpha / r; A: (r, in), B: (out, r) in the unsharded model), with the base layer's
collectives and no other on activations:

* Column, W_r = rows of W: A whole, B_r = the same rows of B (fused q/k/v, sections and replicated KV heads
  alike: the rows the base weight keeps). y_r = x W_r^T + s * drop(x) A^T B_r^T, x after the Column's
  copy_to_tp_region, so the LoRA path's input gradient is summed by the same all-reduce as the base's.
  dA is a sum over ranks (each sees its B_r): all-reduced as a gradient, like grad_allreduce.
* Row, W_r = columns of W: A_r = the same columns of A, B whole. y = all_reduce(x_r W_r^T + s * drop(x_r) A_r^T
  B^T) + b: the LoRA term joins the partial sum, one all-reduce. dB is a sum over ranks: all-reduced.

A whole adapter tensor so gets the same gradient on every rank. Dropout follows the base layer's RNG regions:
a Column's LoRA input is replicated (the same mask on every rank, drawn before the sharded region), a Row's is
this rank's slice (drawn in the sharded region). Merging (``merge_and_unload``) adds B_r A (Column) or B A_r
(Row) to the local weight: PEFT's own merge, since the adapter tensors are shaped like the local weight.

Sequence parallelism: a Column's term reads the gathered sequence its product read (the LoRA path's input gradient
joins the base's before the gather's reduce-scatter) and a Row's joins the partial sum before its reduce-scatter,
so the collectives are the base layer's and dA / dB are all-reduced as above. PEFT's own LoRA layers on modules
kept whole inside the blocks get the stack's gradient sum, as its norms do (`take_over_entry_hooks`).

Expert tensors (``target_parameters``: PEFT's ParamWrapper on MoE experts (E, out, in)) that a Param entry
splits inside every expert: `ParallelParamWrapper`, B's rows or A's columns split like the tensor's.

Not yet: expert tensors split another way, mixed-adapter batches, DoRA and other LoRA variants: each is refused
with a message.
"""
from __future__ import annotations

import contextlib
import functools
import re
import zlib

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

try:
    import peft
    from peft.tuners.lora import Linear as _LoraLinear
except ImportError as e:  # pragma: no cover - exercised without the extra
    raise ImportError("tpmap.peft needs PEFT: pip install 'tpmap[peft]'") from e

from tpmap.api import GROUP_ATTR, PLAN_ATTR, SEQUENCE_ATTR
from tpmap.checkpoint.save import delegate_saving
from tpmap.engine import rng
from tpmap.engine.layers import (
    TP_MODULES,
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    VocabParallelLMHead,
)
from tpmap.engine.plan import ParamShard
from tpmap.engine.shard import all_reduced, full_tensor, sum_over_holders, take

SHARD_ATTR = "tpmap_weight_shard"  # set on each Column/Row by `prepare`: the ParamShard of its weight
SEED_ATTR = "tpmap_lora_seed"  # and the seed fresh adapters are drawn from, the same on every rank
PARAM_SHARDS_ATTR = "tpmap_param_shards"  # on a module holding tensors Param entries split: {tensor name: ParamShard}
OWNER_GROUP_ATTR = "tpmap_lora_group"  # and the group it was sharded over (None: the default group)


class ParallelLoraLinear(_LoraLinear):
    """PEFT's LoRA Linear around a ColumnParallelLinear or RowParallelLinear (see the module docstring)."""

    def __init__(self, base_layer, adapter_name: str, config, **kwargs):
        layer = base_layer.get_base_layer() if isinstance(base_layer, peft.tuners.tuners_utils.BaseTunerLayer) \
            else base_layer
        if getattr(layer, SHARD_ATTR, None) is None:
            raise ValueError(f"{type(layer).__name__} has no tpmap plan: call tpmap.peft.get_peft_model or "
                             "tpmap.peft.prepare(model) on the model tpmap sharded, not on a copy of one layer")
        if getattr(config, "use_dora", False) or getattr(config, "lora_bias", False):
            raise NotImplementedError("tpmap.peft supports plain LoRA (use_dora=False, lora_bias=False)")
        super().__init__(base_layer, adapter_name, config, **kwargs)
        self.fan_in_fan_out = getattr(layer, "reverse", False)  # Conv1D: merge adds (B A)^T, as PEFT's fan_in_fan_out

    def _get_in_out_features(self, module):  # the LOCAL weight's shape: A and B come out split or whole right
        w = module.weight
        out_features, in_features = (w.shape[1], w.shape[0]) if getattr(module, "reverse", False) else w.shape
        return in_features, out_features

    def update_layer(self, adapter_name, r, lora_alpha, config, **kwargs):
        super().update_layer(adapter_name, r, lora_alpha=lora_alpha, config=config, **kwargs)
        if adapter_name in self.lora_variant:
            raise NotImplementedError(f"tpmap.peft: LoRA variant {type(self.lora_variant[adapter_name]).__name__} "
                                      "is not supported on sharded layers")
        self._init_like_unsharded(adapter_name, config.init_lora_weights)
        self._hook_partial_gradients(adapter_name)

    # -- the two halves of the math -------------------------------------------------------------------
    def _split(self) -> tuple[bool, ParamShard, int, object]:
        layer = self.get_base_layer()
        group = layer.tp_group
        column = isinstance(layer, (ColumnParallelLinear, VocabParallelLMHead))
        return column, getattr(layer, SHARD_ATTR), dist.get_rank(group), group

    def _init_like_unsharded(self, adapter_name: str, init) -> None:
        """PEFT's own init of full-size A and B, drawn alike on every rank (from the seed `prepare` shared once,
        mixed with the weight's and the adapter's names: no collective per layer), then this rank's slice:
        whole tensors agree across ranks, split ones are slices of one tensor."""
        _, shard, rank, _ = self._split()
        reverse = getattr(self.get_base_layer(), "reverse", False)
        full_out, full_in = shard.full_shape[::-1] if reverse else shard.full_shape
        _draw_like_unsharded(self, adapter_name, init, full_in, full_out, shard.name, rank)

    def adapter_shard(self, which: str, adapter_name: str) -> ParamShard | None:
        """How lora_A or lora_B (`which`: "A" or "B") of an adapter is spread: B's rows of a Column, A's
        columns of a Row, as the base weight's out or in features; None for the whole one."""
        column, shard, _, _ = self._split()
        if (which == "B") != column:
            return None
        r = self.r[adapter_name]
        features = shard.full_shape[shard.dim]  # the base weight's split features (out of a Column, in of a Row)
        return ParamShard(name=f"lora_{which}", full_shape=(features, r) if column else (r, features),
                          dim=0 if column else 1, pieces=shard.pieces, replicated_heads=shard.replicated_heads,
                          local_size=shard.local_size)  # (a vocabulary's padded rows: zeros, never read)

    def _hook_partial_gradients(self, adapter_name: str) -> None:
        """dA of a Column and dB of a Row are sums over ranks; B rows of replicated KV heads sum over holders."""
        column, shard, rank, group = self._split()
        _on_gradient(self.lora_A[adapter_name] if column else self.lora_B[adapter_name],
                     functools.partial(all_reduced, group=group))
        rows = self.adapter_shard("B", adapter_name)
        if rows is not None and rows.replicated_heads:
            index = torch.tensor(shard.indices(rank), dtype=torch.long)
            _on_gradient(self.lora_B[adapter_name],
                         functools.partial(sum_over_holders, shard=rows, index=index, group=group))

    def forward(self, x: torch.Tensor, *args, **kwargs):
        self._check_forward_args(x, *args, **kwargs)
        if kwargs.pop("adapter_names", None) is not None:
            raise NotImplementedError("tpmap.peft: mixed-adapter batches (adapter_names=...) are not supported yet")
        layer = self.get_base_layer()
        if self.disable_adapters:
            if self.merged:
                self.unmerge()
            return self.base_layer(x, *args, **kwargs)
        active = [a for a in self.active_adapters if a in self.lora_A]
        if self.merged or not active:
            return self.base_layer(x, *args, **kwargs)
        layer.__dict__["adapter_delta"] = functools.partial(self._delta, active, x.dtype)
        try:
            return self.base_layer(x, *args, **kwargs)
        finally:
            del layer.__dict__["adapter_delta"]

    def _delta(self, active: list[str], dtype: torch.dtype, x: torch.Tensor) -> torch.Tensor:
        """sum over active adapters of s * drop(x) A^T B^T, on this rank's slices: (..., out_local). A Column's
        x is replicated: its dropout mask comes from the default stream, the same on every rank, even when an
        earlier Column of the block has opened the sharded region (rng.replicated_draws); a Row's x is this
        rank's slice: its mask is drawn in the region, rank-specific, as the base layer's dropout there."""
        column = self._split()[0]
        out = None
        for name in active:
            a, b = self.lora_A[name], self.lora_B[name]
            with rng.replicated_draws() if column else contextlib.nullcontext():
                dropped = self.lora_dropout[name](self._cast_input_dtype(x, a.weight.dtype))
            term = b(a(dropped)) * self.scaling[name]
            out = term if out is None else out + term
        return out.to(dtype)


def _draw_like_unsharded(layer, adapter_name: str, init, full_in: int, full_out: int, name: str, rank: int) -> None:
    """PEFT's own init of `layer`'s A (r', full_in) and B (full_out, r') at full size, drawn alike on every rank
    (the seed `prepare` shared, mixed with the base tensor's `name` and the adapter's), then this rank's slices
    (layer.adapter_shard): whole tensors agree across ranks, split ones are slices of one tensor."""
    a, b = layer.lora_A[adapter_name], layer.lora_B[adapter_name]
    base = layer.get_base_layer()
    seed = base.__dict__[SEED_ATTR] + zlib.crc32(f"{name}/{adapter_name}".encode())
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed % 2**63)
        twin_a = nn.Linear(full_in, a.out_features, bias=False, dtype=a.weight.dtype)
        twin_b = nn.Linear(b.in_features, full_out, bias=False, dtype=b.weight.dtype)
        layer.lora_A[adapter_name], layer.lora_B[adapter_name] = twin_a, twin_b
        try:
            layer.reset_lora_parameters(adapter_name, init)
        finally:
            layer.lora_A[adapter_name], layer.lora_B[adapter_name] = a, b
    with torch.no_grad():  # e.g. B_r: the rows of B a Column keeps; A_r: the columns of A a Row keeps
        for which, module, twin in (("A", a, twin_a), ("B", b, twin_b)):
            split = layer.adapter_shard(which, adapter_name)
            module.weight.copy_(twin.weight if split is None else take(twin.weight, split, rank))


class ParallelParamWrapper(peft.tuners.lora.ParamWrapper):
    """PEFT's LoRA on a bare parameter (``target_parameters``; MoE experts stored as 3-D tensors) that a Param
    entry splits inside each expert. PEFT's math, on the local tensor: with W (E, out, in) (transformers' layout;
    PEFT reads (E, in, out) for a layer marked ``is_transposed``), A (r*E, in) and B (out, r*E), expert e's delta is
    s * B[:, r-block e] A[r-block e, :] (PEFT's reshapes), folded into W by a parametrization for the forward.
    The split dim of W is out or in of every expert, so:

    * split along out (gate_up_proj (E, 2I, H) by I, gate|up sections alike): B_r = the same rows of B as W_r's
      (its ``pieces``), A whole; dA is a sum over ranks: all-reduced.
    * split along in (down_proj (E, H, I) by I): A_r = the same columns of A, B whole; dB all-reduced.

    The local delta is then this rank's slice of the full one, so the forward, PEFT's merge (W_r += delta_r) and
    the expert block's own collectives (its Reduce) are unchanged. A tensor split along the experts (dim 0), a
    partial one or a cut ModuleList is refused by get_peft_model (`_refuse_split_parameters`)."""

    def __init__(self, base_layer, adapter_name: str, config, parameter_name: str | None = None, **kwargs):
        if parameter_name is None:  # (target_modules naming the experts module itself, not one of its tensors)
            raise ValueError(f"tpmap.peft: LoRA on {type(base_layer).__name__} as a module: it holds tensors a Param "
                             "entry splits; target them with LoraConfig(target_parameters=[...]) instead")
        super().__init__(base_layer, adapter_name, parameter_name=parameter_name, config=config, **kwargs)

    def _shard(self) -> ParamShard | None:
        """The Param entry's shard of the wrapped tensor when it splits it inside every expert, else None."""
        shard = self.get_base_layer().__dict__.get(PARAM_SHARDS_ATTR, {}).get(self.parameter_name)
        return shard if shard is not None and _inside_experts(shard) else None

    def _split_out(self) -> bool:  # whether W's split dim is PEFT's out (B's rows), else its in (A's columns)
        return self._shard().dim == (1 if self._did_swap_in_out_features else 2)

    def update_layer(self, adapter_name, r, lora_alpha, config, **kwargs):
        super().update_layer(adapter_name, r, lora_alpha=lora_alpha, config=config, **kwargs)
        shard = self._shard()
        if shard is None:  # whole on every rank: PEFT's layer as it is
            return
        group = self.get_base_layer().__dict__[OWNER_GROUP_ATTR]
        full = shard.full_shape[shard.dim]
        out_features, in_features = self.out_features, self.in_features
        full_out, full_in = (full, in_features) if self._split_out() else (out_features, full)
        _draw_like_unsharded(self, adapter_name, config.init_lora_weights, full_in, full_out, shard.name,
                             dist.get_rank(group))
        whole = self.lora_A[adapter_name] if self._split_out() else self.lora_B[adapter_name]
        _on_gradient(whole, functools.partial(all_reduced, group=group), trigger=self)

    def adapter_shard(self, which: str, adapter_name: str) -> ParamShard | None:
        """How lora_A or lora_B of an adapter is spread: B's rows like W's out, or A's columns like W's in."""
        shard = self._shard()
        if shard is None or (which == "B") != self._split_out():
            return None
        rank_e = self.r[adapter_name] * self.num_experts
        features = shard.full_shape[shard.dim]
        return ParamShard(name=f"lora_{which}", full_shape=(features, rank_e) if which == "B" else (rank_e, features),
                          dim=0 if which == "B" else 1, pieces=shard.pieces, local_size=shard.local_size)


def _inside_experts(shard: ParamShard) -> bool:
    """Whether a Param entry's shard cuts a 3-D tensor (experts, d1, d2) inside every expert (d1 or d2)."""
    return len(shard.full_shape) == 3 and shard.dim in (1, 2) and not shard.partial and shard.holder == "parameter"


_PEFT_LAYER_CLASSES = (nn.Linear, nn.Embedding, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.MultiheadAttention)


# PEFT 0.21 tells a ParamWrapper by its class name, not isinstance (tuners_utils._inject_parameters: "use the class
# name for checking to avoid circular import"), where it nests a second tensor's wrapper of the same module
# (gate_up_proj, then down_proj) and where a later adapter reuses a wrapper: under another name either refuses
# ("Trying to wrap an `nn.Parameter` of layer ... which is not a valid target"). So this subclass carries its name.
ParallelParamWrapper.__name__ = "ParamWrapper"


class ParallelLoraEmbedding(peft.tuners.lora.Embedding):
    """PEFT's embedding LoRA on a vocabulary-parallel embedding. A (r, V) and B (H, r) stay whole on every rank:
    the term s * B A[ids] is added to the embedding's all-reduced output, the same on every rank, so its gradients
    are too. A looks up ids in the full vocabulary (the full padding_idx, not the shard's local one), and a
    merge adds this rank's rows of the full delta (padded like the weight) to the local weight."""

    def get_delta_weight(self, adapter) -> torch.Tensor:  # (V_pad/ws, H): this rank's rows
        base = self.get_base_layer()
        full = super().get_delta_weight(adapter)  # (V, H)
        return take(full, base.__dict__[SHARD_ATTR], dist.get_rank(base.tp_group))

    def _embed(self, input, weight, input_fn=None, output_fn=None):
        base = self.get_base_layer()
        if input_fn is not None:
            input = input_fn((input,))
        output = F.embedding(input, weight, padding_idx=base.full_padding_idx, max_norm=base.max_norm,
                             norm_type=base.norm_type, scale_grad_by_freq=base.scale_grad_by_freq, sparse=base.sparse)
        return output if output_fn is None else output_fn(output)


def _on_gradient(linear: nn.Linear, hook, trigger: nn.Module | None = None) -> None:
    """`hook` on the gradient of linear.weight, now if it trains, else at the first forward of `trigger` (default:
    `linear`; a ParamWrapper, which reads its factors' weights without calling them) that trains (an adapter
    loaded for inference may be made trainable later); once per parameter object."""
    hooked: list[torch.Tensor] = []

    def attach(module, args):
        p = linear.weight
        if p.requires_grad and not any(h is p for h in hooked):
            p.register_hook(hook)
            hooked.append(p)

    attach(linear, ())
    (linear if trigger is None else trigger).register_forward_pre_hook(attach)


def prepare(model: nn.Module) -> nn.Module:
    """Record on each Column and Row of a tpmap-sharded model the ParamShard of its weight (what
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
    """The modules holding tensors that Param entries split (MoE experts), each with {tensor name: ParamShard}
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
            owners = [m for m in _param_owners(base, plan) if not isinstance(m, _PEFT_LAYER_CLASSES)
                      and any(_inside_experts(shard) for shard in m.__dict__[PARAM_SHARDS_ATTR].values())]
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
    for module in peft_model.modules():
        if isinstance(module, peft.tuners.lora.ParamWrapper):
            name = f"{names.get(id(module.get_base_layer()), '?')}.{module.parameter_name}"
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
    """(parameter name, adapter, file key, tensor, ParamShard or None) of every LoRA A and B and every tensor of
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


def _split(shard: ParamShard | None) -> bool:
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
