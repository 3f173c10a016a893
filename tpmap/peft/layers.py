"""The LoRA layers of `tpmap.peft` (PEFT's own layers, subclassed for tpmap's sharded modules).

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
kept whole inside the blocks get the stack's gradient sum, as its norms do (`tpmap.peft.take_over_entry_hooks`).

Expert tensors (``target_parameters``: PEFT's ParamWrapper on MoE experts (E, out, in)) that a Param entry
splits inside every expert: `ParallelParamWrapper`, B's rows or A's columns split like the tensor's.
"""
from __future__ import annotations

import contextlib
import functools
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

from tpmap.engine import rng
from tpmap.engine.layers import ColumnParallelLinear, VocabParallelLMHead
from tpmap.engine.plan import ParamLayout
from tpmap.engine.shard import all_reduced, sum_over_holders, take

SHARD_ATTR = "tpmap_weight_shard"  # set on each Column/Row by `prepare`: the ParamLayout of its weight
SEED_ATTR = "tpmap_lora_seed"  # and the seed fresh adapters are drawn from, the same on every rank
PARAM_SHARDS_ATTR = "tpmap_param_shards"  # on a module holding tensors Param entries split: {tensor name: ParamLayout}
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
        with torch.random.fork_rng(devices=[]):  # PEFT's init at the local shapes, replaced below: no draw counts
            super().update_layer(adapter_name, r, lora_alpha=lora_alpha, config=config, **kwargs)
        if adapter_name in self.lora_variant:
            raise NotImplementedError(f"tpmap.peft: LoRA variant {type(self.lora_variant[adapter_name]).__name__} "
                                      "is not supported on sharded layers")
        self._init_like_unsharded(adapter_name, config.init_lora_weights)
        self._hook_partial_gradients(adapter_name)

    # -- the two halves of the math -------------------------------------------------------------------
    def _split(self) -> tuple[bool, ParamLayout, int, object]:
        layer = self.get_base_layer()
        group = layer.tp_group
        column = isinstance(layer, (ColumnParallelLinear, VocabParallelLMHead))
        return column, getattr(layer, SHARD_ATTR), dist.get_rank(group), group

    def _init_like_unsharded(self, adapter_name: str, init) -> None:
        """PEFT's own init of full-size A and B, drawn alike on every rank (from the seed `prepare` shared once,
        mixed with the weight's and the adapter's names: no collective per layer), then this rank's slice:
        whole tensors agree across ranks, split ones are slices of one tensor. First the default stream draws
        what the unsharded layer's init draws (`_full_size_init`, thrown away): at every world size, even or not,
        each rank's stream stays where the unsharded model's is (draws at local shapes would set uneven ranks
        apart, and every later replicated draw, a dropout mask or another adapter's init, would differ)."""
        _, shard, rank, _ = self._split()
        reverse = getattr(self.get_base_layer(), "reverse", False)
        full_out, full_in = shard.full_shape[::-1] if reverse else shard.full_shape
        _full_size_init(self, adapter_name, init, full_in, full_out)  # (PEFT builds them in the default dtype)
        _draw_like_unsharded(self, adapter_name, init, full_in, full_out, shard.name, rank)

    def adapter_shard(self, which: str, adapter_name: str) -> ParamLayout | None:
        """How lora_A or lora_B (`which`: "A" or "B") of an adapter is spread: B's rows of a Column, A's
        columns of a Row, as the base weight's out or in features; None for the whole one."""
        column, shard, _, _ = self._split()
        if (which == "B") != column:
            return None
        r = self.r[adapter_name]
        features = shard.full_shape[shard.dim]  # the base weight's split features (out of a Column, in of a Row)
        return ParamLayout(name=f"lora_{which}", full_shape=(features, r) if column else (r, features),
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


def _full_size_init(layer, adapter_name: str, init, full_in: int, full_out: int, dtype=None) -> tuple[nn.Linear, ...]:
    """PEFT's own init (reset_lora_parameters) of full-size A (r', full_in) and B (full_out, r') built in place of
    the layer's, from the current RNG stream; the layer's own A and B are put back. Returns the two twins."""
    a, b = layer.lora_A[adapter_name], layer.lora_B[adapter_name]
    twin_a = nn.Linear(full_in, a.out_features, bias=False, dtype=dtype)
    twin_b = nn.Linear(b.in_features, full_out, bias=False, dtype=dtype)
    layer.lora_A[adapter_name], layer.lora_B[adapter_name] = twin_a, twin_b
    try:
        layer.reset_lora_parameters(adapter_name, init)
    finally:
        layer.lora_A[adapter_name], layer.lora_B[adapter_name] = a, b
    return twin_a, twin_b


def _draw_like_unsharded(layer, adapter_name: str, init, full_in: int, full_out: int, name: str, rank: int) -> None:
    """PEFT's own init of `layer`'s A (r', full_in) and B (full_out, r') at full size, drawn alike on every rank
    (the seed `prepare` shared, mixed with the base tensor's `name` and the adapter's), then this rank's slices
    (layer.adapter_shard): whole tensors agree across ranks, split ones are slices of one tensor."""
    a, b = layer.lora_A[adapter_name], layer.lora_B[adapter_name]
    seed = layer.get_base_layer().__dict__[SEED_ATTR] + zlib.crc32(f"{name}/{adapter_name}".encode())
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed % 2**63)
        twin_a, twin_b = _full_size_init(layer, adapter_name, init, full_in, full_out, a.weight.dtype)
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

    def _shard(self) -> ParamLayout | None:
        """The Param entry's shard of the wrapped tensor when it splits it inside every expert, else None."""
        shard = self.get_base_layer().__dict__.get(PARAM_SHARDS_ATTR, {}).get(self.parameter_name)
        return shard if shard is not None and inside_experts(shard) else None

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

    def adapter_shard(self, which: str, adapter_name: str) -> ParamLayout | None:
        """How lora_A or lora_B of an adapter is spread: B's rows like W's out, or A's columns like W's in."""
        shard = self._shard()
        if shard is None or (which == "B") != self._split_out():
            return None
        rank_e = self.r[adapter_name] * self.num_experts
        features = shard.full_shape[shard.dim]
        return ParamLayout(name=f"lora_{which}", full_shape=(features, rank_e) if which == "B" else (rank_e, features),
                          dim=0 if which == "B" else 1, pieces=shard.pieces, local_size=shard.local_size)


def inside_experts(shard: ParamLayout) -> bool:
    """Whether a Param entry's shard cuts a 3-D tensor (experts, d1, d2) inside every expert (d1 or d2)."""
    return len(shard.full_shape) == 3 and shard.dim in (1, 2) and not shard.partial and shard.holder == "parameter"


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

    def get_delta_weight(self, adapter) -> torch.Tensor:  # (V_pad/tp_size, H): this rank's rows
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
