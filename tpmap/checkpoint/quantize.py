"""`tpmap.from_pretrained(..., quantization_config=TorchAoConfig(...))`: each rank quantizes its own slices.

transformers' torchao quantizer decides which weights are quantized (its `param_needs_quantization`: the
nn.Linear weights outside `modules_to_not_convert`, by default everything but the output embeddings) and
torchao's `quantize_` quantizes them; tpmap only changes *when*: after each rank has read its slices, so no
rank ever holds a whole weight. The result equals the unsharded model that transformers quantizes on load,
sliced, because each slice is quantized with the scales the whole weight would get:

* a scale per block that lies inside one rank's slice (per row of a Column, per group of a Row's input
  features when the boundaries fall between groups) is computed from the slice alone: it is the same;
* a block that spans ranks (per row of a Row: (1, in), split along in; per tensor: the whole weight) needs
  the whole block's range. Each rank all-reduces its blocks' minimum and maximum, appends them to its slice as
  two extra columns (min_j, max_j per row j), quantizes that (one block per row, or one per tensor: its range is
  now the whole block's, and torchao's min/max-based schemes -- int8 and float8, symmetric or not -- draw the
  scale and zero point from the range alone) and drops the two columns again (the quantized tensor's own
  slicing keeps the scale);
* a group that a shard boundary would cut is refused before anything is read, with the world sizes that work.

Which kind of block a scheme uses is measured, not assumed: a probe weight of 2 rows by the whole input
width is quantized once per weight shape, and its `block_size` says per row (1, in), per group (1, g) or per
tensor (2, in).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from tpmap.engine import quant_blocks
from tpmap.engine.errors import UnsupportedConfigError
from tpmap.engine.plan import ParamLayout, Plan

Kind = str  # "slice": quantize the slice as it is; "rows": rows span ranks; "tensor": one block, the whole weight


def torchao_config(quantization_config):
    """The TorchAoConfig that `from_pretrained` was given (a dict with quant_method torchao is read as one);
    anything else is refused naming it."""
    if quantization_config is None:
        return None
    from transformers import TorchAoConfig

    if isinstance(quantization_config, dict) and quantization_config.get("quant_method") == "torchao":
        quantization_config = TorchAoConfig.from_dict(quantization_config)
    if not isinstance(quantization_config, TorchAoConfig):
        method = getattr(quantization_config, "quant_method", None) or (
            quantization_config.get("quant_method") if isinstance(quantization_config, dict) else None)
        raise UnsupportedConfigError(
            f"tpmap.from_pretrained quantizes on load with torchao only (quantization_config=TorchAoConfig(...)); "
            f"got {type(quantization_config).__name__}" + (f" with quant_method {str(method)!r}" if method else "") +
            ". Quantize with torchao, or load unquantized and quantize the sharded model's slices yourself")
    try:
        import torchao  # noqa: F401
    except ImportError as e:
        raise UnsupportedConfigError("quantization_config=TorchAoConfig(...) needs torchao: "
                                     "pip install 'tpmap[torchao]'") from e
    return quantization_config


@dataclass(frozen=True)
class _Weight:
    name: str  # the parameter's full name
    kind: Kind


class OnLoadQuantization:
    """The weights to quantize after loading and, for each, whether its blocks span ranks. Built from the
    unsharded model on the meta device and the plan, before any tensor is read: a group that a shard boundary
    would cut is refused here, alike on every rank."""

    def __init__(self, config, model: nn.Module, plan: Plan, plan_at: Callable[[int], Plan | None]):
        from transformers.quantizers.auto import AutoHfQuantizer

        self.config = config
        self.hf_quantizer = AutoHfQuantizer.from_config(config, pre_quantized=False)
        self.hf_quantizer.preprocess_model(model)  # transformers' own choice of modules_to_not_convert
        names = [n for n, _ in model.named_parameters() if self.hf_quantizer.param_needs_quantization(model, n)]
        params, probed, groups = plan.params, {}, {}
        self.weights = []
        for name in names:
            shard = params.get(name)
            module = model.get_submodule(name.rpartition(".")[0])
            if not isinstance(module, nn.Linear) or (shard is not None and shard.local_size is not None):
                raise UnsupportedConfigError(
                    f"{name} is to be quantized, but it is not an nn.Linear weight that tpmap splits as a Column or "
                    "Row (an embedding or a vocabulary-parallel LM head): leave it out of the quantization "
                    "(TorchAoConfig's modules_to_not_convert, include_input_output_embeddings=False)")
            width = module.weight.shape[1]
            if width not in probed:
                probed[width] = _probe_block(config.get_apply_tensor_subclass(), width)
            rows, cols = probed[width]
            if rows == 1 and cols < width:
                groups[name] = cols
            kind = _kind(shard, width, (rows, cols))
            if kind != "slice":
                # (rank 0's slice stands for every rank's: weights split evenly have one local shape)
                _check_widened_slice(name, config.get_apply_tensor_subclass(), shard.local_shape(0))
            self.weights.append(_Weight(name, kind))
        quant_blocks.refuse_cut_groups(groups, plan, plan_at, "would be quantized in groups of {group} input features",
                                       "; or quantize with groups that divide each rank's share")

    def apply(self, model: nn.Module, group) -> None:
        """Quantize this rank's slice of every chosen weight (after loading; collectives on `group`)."""
        for weight in self.weights:
            module = model.get_submodule(weight.name.rpartition(".")[0])
            module.weight = nn.Parameter(_quantize(module.weight.detach(), weight.kind, self.config, group),
                                         requires_grad=False)
        self.hf_quantizer.postprocess_model(model)  # config.quantization_config, model.is_quantized, as transformers
        model.hf_quantizer = self.hf_quantizer


def _probe_block(quant_type, in_features: int) -> tuple[int, int]:
    probe = nn.Linear(in_features, 2, bias=False)
    probe.weight.data = torch.randn(2, in_features, generator=torch.Generator().manual_seed(0))
    _quantize_linear(probe, quant_type)
    block = getattr(probe.weight, "block_size", None)
    if block is None or len(block) != 2:
        raise UnsupportedConfigError(
            f"{type(quant_type).__name__} makes {type(probe.weight).__name__} weights that record no 2-D block_size, "
            "so tpmap cannot tell which slices keep their scales; quantize with a scheme whose tensors record it "
            "(torchao's Int8WeightOnlyConfig, Float8WeightOnlyConfig, Int8DynamicActivationInt8WeightConfig)")
    return int(block[0]), int(block[1])


def _check_widened_slice(name: str, quant_type, local_shape) -> None:
    """A block spanning ranks is quantized widened by two columns and sliced back: the tensor type must slice so."""
    width = local_shape[1]
    probe = nn.Linear(width + 2, 2, bias=False)
    probe.weight.data = torch.randn(2, width + 2, generator=torch.Generator().manual_seed(0))
    _quantize_linear(probe, quant_type)
    try:
        probe.weight[:, :width]
    except (NotImplementedError, AssertionError) as e:  # torchao asserts on slices across its blocks
        raise UnsupportedConfigError(
            f"{name}'s scales span the ranks (one per row, split along the input features, or one for the whole "
            f"weight), so its slice is quantized widened by two columns of the whole range and cut back, and "
            f"{type(probe.weight).__name__} cannot be cut back from {width + 2} to this rank's {width} columns "
            f"({str(e).splitlines()[0][:160]}); quantize per group of input features that "
            "divide each rank's share, or leave this layer out (modules_to_not_convert)") from e


def _kind(shard: ParamLayout | None, width: int, block: tuple[int, int]) -> Kind:
    rows, cols = block
    split = shard is not None and shard.dim is not None
    if rows > 1:  # one block over all rows (the probe had 2): per tensor
        return "tensor" if split else "slice"
    if cols >= width:  # per row
        return "rows" if split and shard.dim == 1 else "slice"
    return "slice"  # per group along the input features (a group cut by a boundary is refused first)


def _quantize(local: torch.Tensor, kind: Kind, config, group) -> torch.Tensor:
    """This rank's quantized slice: (out_r, in_r) -> the same shape, quantized as the whole weight would be."""
    width = local.shape[1]
    if kind != "slice":  # widen by the whole block's range: [local | min | max], (out_r, in_r + 2)
        low, high = (local.amin(1, keepdim=True), local.amax(1, keepdim=True)) if kind == "rows" else (
            local.amin().reshape(1, 1), local.amax().reshape(1, 1))
        extremes = torch.cat([-low.float(), high.float()], dim=1)  # one all-reduce: max(-x) is -min(x)
        dist.all_reduce(extremes, dist.ReduceOp.MAX, group=group)
        low, high = -extremes[:, :1], extremes[:, 1:]
        n = local.shape[0]
        local = torch.cat([local, low.to(local.dtype).expand(n, 1), high.to(local.dtype).expand(n, 1)], dim=1)
    linear = nn.Linear(local.shape[1], local.shape[0], bias=False, device=local.device, dtype=local.dtype)
    linear.weight.data = local
    _quantize_linear(linear, config.get_apply_tensor_subclass())
    quantized = linear.weight.detach()
    return quantized if kind == "slice" else quantized[:, :width]  # the block's scale kept, the range columns gone


def _quantize_linear(linear: nn.Linear, quant_type) -> None:
    from torchao.quantization import quantize_

    quantize_(linear, quant_type)
