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

Not yet: vocabulary-parallel embeddings and LM heads, expert Params (``target_parameters``), sequence
parallelism, mixed-adapter batches, DoRA and other LoRA variants: each is refused with a message.
"""
from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch import nn

try:
    import peft
    from peft.tuners.lora import Linear as _LoraLinear
except ImportError as e:  # pragma: no cover - exercised without the extra
    raise ImportError("tpmap.peft needs PEFT: pip install 'tpmap[peft]'") from e

from tpmap.api import PLAN_ATTR, SEQUENCE_ATTR
from tpmap.engine.layers import ColumnParallelLinear, RowParallelLinear
from tpmap.engine.plan import ParamShard
from tpmap.engine.shard import all_reduced, sum_over_holders

SHARD_ATTR = "tpmap_weight_shard"  # set on each Column/Row by `prepare`: the ParamShard of its weight


class ParallelLoraLinear(_LoraLinear):
    """PEFT's LoRA Linear around a ColumnParallelLinear or RowParallelLinear (see the module docstring)."""

    def __init__(self, base_layer, adapter_name: str, config, **kwargs):
        layer = base_layer.get_base_layer() if isinstance(base_layer, peft.tuners.tuners_utils.BaseTunerLayer) \
            else base_layer
        if getattr(layer, SHARD_ATTR, None) is None:
            raise ValueError(f"{type(layer).__name__} has no tpmap plan: call tpmap.peft.get_peft_model or "
                             "tpmap.peft.prepare(model) on the model tpmap sharded, not on a copy of one layer")
        if layer.seq is not None:
            raise NotImplementedError("LoRA with sequence parallelism is not supported yet; apply without it")
        if getattr(config, "use_dora", False) or getattr(config, "lora_bias", False):
            raise NotImplementedError("tpmap.peft supports plain LoRA (use_dora=False, lora_bias=False)")
        super().__init__(base_layer, adapter_name, config, **kwargs)
        self.fan_in_fan_out = layer.reverse  # Conv1D: merge adds (B A)^T, as PEFT's fan_in_fan_out

    def _get_in_out_features(self, module):  # the LOCAL weight's shape: A and B come out split or whole right
        w = module.weight
        out_features, in_features = (w.shape[1], w.shape[0]) if module.reverse else w.shape
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
        return isinstance(layer, ColumnParallelLinear), getattr(layer, SHARD_ATTR), dist.get_rank(group), group

    def _init_like_unsharded(self, adapter_name: str, init) -> None:
        """PEFT's own init of full-size A and B, drawn alike on every rank (a seed from the group's first
        rank), then this rank's slice: whole tensors agree across ranks, split ones are slices of one tensor."""
        column, shard, rank, group = self._split()
        reverse = self.get_base_layer().reverse
        full_out, full_in = shard.full_shape[::-1] if reverse else shard.full_shape
        a, b = self.lora_A[adapter_name], self.lora_B[adapter_name]
        seed = torch.randint(0, 2**62, (1,))
        dist.broadcast(seed, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(int(seed))
            twin_a = nn.Linear(full_in, a.out_features, bias=False, dtype=a.weight.dtype)
            twin_b = nn.Linear(b.in_features, full_out, bias=False, dtype=b.weight.dtype)
            self.lora_A[adapter_name], self.lora_B[adapter_name] = twin_a, twin_b
            try:
                self.reset_lora_parameters(adapter_name, init)
            finally:
                self.lora_A[adapter_name], self.lora_B[adapter_name] = a, b
        index = torch.tensor(shard.indices(rank), dtype=torch.long)
        with torch.no_grad():
            if column:  # B_r: the rows of B the base weight keeps
                a.weight.copy_(twin_a.weight)
                b.weight.copy_(twin_b.weight.index_select(0, index))
            else:  # A_r: the columns of A the base weight keeps
                a.weight.copy_(twin_a.weight.index_select(1, index))
                b.weight.copy_(twin_b.weight)

    def _hook_partial_gradients(self, adapter_name: str) -> None:
        """dA of a Column and dB of a Row are sums over ranks; B rows of replicated KV heads sum over holders."""
        column, shard, rank, group = self._split()
        whole = self.lora_A[adapter_name].weight if column else self.lora_B[adapter_name].weight
        whole.register_hook(functools.partial(all_reduced, group=group))
        if column and shard.replicated_heads:
            b = self.lora_B[adapter_name].weight  # (out_local, r): rows as the base weight's out features
            rows = ParamShard(name=shard.name, full_shape=(shard.full_shape[shard.dim], b.shape[1]), dim=0,
                              pieces=shard.pieces, replicated_heads=True)
            index = torch.tensor(shard.indices(rank), dtype=torch.long)
            b.register_hook(functools.partial(sum_over_holders, shard=rows, index=index, group=group))

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
        """sum over active adapters of s * drop(x) A^T B^T, on this rank's slices: (..., out_local)."""
        out = None
        for name in active:
            a, b = self.lora_A[name], self.lora_B[name]
            term = b(a(self.lora_dropout[name](self._cast_input_dtype(x, a.weight.dtype)))) * self.scaling[name]
            out = term if out is None else out + term
        return out.to(dtype)


def prepare(model: nn.Module) -> nn.Module:
    """Record on each Column and Row of a tpmap-sharded model the ParamShard of its weight (what
    ParallelLoraLinear slices adapters by). Idempotent; raises ValueError on a model tpmap did not shard."""
    base = model.get_base_model() if isinstance(model, peft.PeftModel) else model
    plan = getattr(base, PLAN_ATTR, None)
    if plan is None:
        raise ValueError("tpmap.peft: the model is not sharded by tpmap (tpmap.apply or tpmap.from_pretrained "
                         "first; an unsharded model needs plain peft.get_peft_model)")
    if getattr(base, SEQUENCE_ATTR, None) is not None:
        raise NotImplementedError("LoRA with sequence parallelism is not supported yet; apply without it")
    for ms in plan.modules:
        if ms.style in ("column", "row"):
            module = base.get_submodule(ms.name)
            if isinstance(module, peft.tuners.tuners_utils.BaseTunerLayer):
                module = module.get_base_layer()
            module.__dict__[SHARD_ATTR] = ms.weight
    return model


def register(config):
    """`config` (a peft LoraConfig) with ParallelLoraLinear registered for tpmap's Column and Row layers."""
    config._register_custom_module({ColumnParallelLinear: ParallelLoraLinear, RowParallelLinear: ParallelLoraLinear})
    return config


def get_peft_model(model: nn.Module, config, adapter_name: str = "default", **kwargs):
    """peft.get_peft_model on a tpmap-sharded model: adapters on its Column and Row layers (see the module)."""
    prepare(model)
    return peft.get_peft_model(model, register(config), adapter_name=adapter_name, **kwargs)
