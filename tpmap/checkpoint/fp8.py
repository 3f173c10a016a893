"""FP8 block-scaled checkpoints, dequantized while each rank reads its slices.

The layout (``quantization_config: {quant_method: fp8, weight_block_size: [B0, B1]}``): a weight ``X`` is
stored as float8 (e4m3) with a sibling ``X_scale_inv`` (``X.weight`` -> ``X.weight_scale_inv``) of shape
``(ceil(out / B0), ceil(in / B1))``, one scale per block, and stands for
``w[i, j] = X[i, j].float() * X_scale_inv[i // B0, j // B1]`` (the last block of a dim that B does not divide is
partial).

`Fp8Scales` pairs every quantized weight with its scale when the folder is opened, checks both (every rank
alike, before any collective), and takes the scales out of the checkpoint's names so that name matching
sees the weights alone. `Fp8Scales.read` then reads one rank's slice of a weight -- the plan's pieces, through
`engine.slice_io.read_local`, so the rank reads only its own bytes of the float8 tensor -- and the rows
(split dim 0) or columns (split dim 1) of the scale that its slice touches: the scale of element ``i`` of
the split dim is row ``i // B`` of the scale for the *full-tensor* index ``i`` (`ParamLayout.indices`), so a
slice that starts or ends inside a block, fused sections and replicated KV heads come out exact.

The arithmetic is transformers' own (`Fp8Dequantize._dequantize_one`, what its loader runs on CPU: the
float8 value and the scale as fp32, their product cast to the model's dtype), called on a scale expanded
to one entry per row (and per column along a split dim, or one B does not divide), a bounded block of rows
at a time. transformers derives the block from the scale grid (``rows // scale_rows``), which is the real
block only when B divides the weight's dims; expanded, every block is exact.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from tpmap.checkpoint.conversion import _ranges
from tpmap.checkpoint.errors import CheckpointError, QuantizedCheckpointError
from tpmap.checkpoint.safetensors import Checkpoint, StoredTensor
from tpmap.engine.plan import ParamLayout
from tpmap.engine.slice_io import Scratch, read_local, read_whole

SCALE_SUFFIX = "_scale_inv"
FLOAT8 = (torch.float8_e4m3fn, torch.float8_e5m2)
SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
CHUNK_ELEMENTS = 1 << 22  # rows dequantized at a time: fp32 temporaries of at most 16 MiB each


def _field(quantization, key: str, default=None):
    value = quantization.get(key, default) if isinstance(quantization, dict) else getattr(quantization, key, default)
    return getattr(value, "value", value)  # transformers' enums (QuantizationMethod)


def block_size(folder: Path, config) -> tuple[int, int] | None:
    """None for a checkpoint without a quantization_config (or a compressed-tensors one: `tpmap.checkpoint.compressed`);
    (B0, B1) for FP8 block-scaled weights that tpmap reads; a QuantizedCheckpointError naming every other method."""
    quantization = getattr(config, "quantization_config", None)
    if not quantization:
        return None
    where = folder / "config.json"
    method = _field(quantization, "quant_method")
    if method == "compressed-tensors":
        return None  # tpmap.checkpoint.compressed reads these
    if method != "fp8":
        raise QuantizedCheckpointError(
            f"{where} declares a quantization_config with quant_method {method!r}: its weights are stored quantized "
            "(with scales), and tpmap.from_pretrained reads only FP8 block-scaled checkpoints (quant_method 'fp8' "
            "with weight_block_size) and compressed-tensors ones, so loading them as plain tensors would compute wrong "
            "results. Load it with transformers (which dequantizes or runs it quantized) and shard that model with "
            "tpmap.apply, or save it unquantized (save_pretrained after loading it in a float dtype) and load that "
            "folder with tpmap.from_pretrained")
    block = _field(quantization, "weight_block_size")
    scheme = str(_field(quantization, "activation_scheme", "dynamic")).lower()
    scale_fmt = _field(quantization, "scale_fmt", "float") or "float"
    expert_dtype = _field(quantization, "expert_dtype", "fp8") or "fp8"
    why = None
    if block is None:
        why = "no weight_block_size: per-tensor FP8 scales, which tpmap does not read"
    elif (not isinstance(block, (list, tuple)) or len(block) != 2
          or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        why = f"weight_block_size {block!r}, which is not two positive integers"
    elif scheme != "dynamic":
        why = f"activation_scheme {scheme!r}: static activation scales (activation_scale tensors) are not read"
    elif scale_fmt != "float":
        why = f"scale_fmt {scale_fmt!r}: only float scales are read"
    elif expert_dtype != "fp8":
        why = f"expert_dtype {expert_dtype!r}: only FP8 weights are read"
    if why is not None:
        raise QuantizedCheckpointError(
            f"{where} declares quant_method 'fp8' with {why}; tpmap.from_pretrained reads FP8 block-scaled weights "
            "(weight_block_size [B0, B1], dynamic activations, float scales) only. Load it with transformers and "
            "shard that model with tpmap.apply, or save it unquantized and load that folder")
    return int(block[0]), int(block[1])


@dataclass
class Fp8Scales:
    """The block size and, by stored weight name, the scale of every quantized weight of a checkpoint."""
    block: tuple[int, int]
    scales: dict[str, StoredTensor]

    @classmethod
    def take(cls, checkpoint: Checkpoint, block: tuple[int, int]) -> Fp8Scales:
        """Pair each ``X`` with its ``X_scale_inv`` and remove the scales from ``checkpoint.tensors`` (they are read
        with their weights, not matched to model tensors). Every pair is checked, and a float8 tensor without a
        scale is refused: it would load as its raw values. A scale without its weight stays (an unexpected key)."""
        scales: dict[str, StoredTensor] = {}
        for name in [n for n in checkpoint.tensors if n.endswith(SCALE_SUFFIX)]:
            weight = checkpoint.tensors.get(name[: -len(SCALE_SUFFIX)])
            if weight is None:
                continue
            scale = checkpoint.tensors.pop(name)
            _check_pair(weight, scale, block)
            scales[weight.name] = scale
        bare = [t for n, t in checkpoint.tensors.items() if t.dtype in FLOAT8 and n not in scales]
        if bare:
            listed = ", ".join(f"{t.where()} ({_dtype_name(t.dtype)} {list(t.shape)})" for t in bare[:3])
            more = f" and {len(bare) - 3} more" if len(bare) > 3 else ""
            raise CheckpointError(
                f"{listed}{more}: quantized (float8) but the checkpoint has no {bare[0].name}{SCALE_SUFFIX} (its block "
                "scales); without them its values cannot be dequantized. The folder is incomplete or not in the FP8 "
                "block-scaled layout its config.json declares")
        return cls(block, scales)

    def scale_of(self, stored: StoredTensor) -> StoredTensor | None:
        return self.scales.get(stored.name)

    def read(self, stored: StoredTensor, shard: ParamLayout | None, rank: int, dtype: torch.dtype,
             device: torch.device, scratch: Scratch) -> torch.Tensor:
        """`stored` dequantized to `dtype` on `device`: whole (`shard` None, or a shard kept whole), or this
        rank's local tensor as `take` would cut it from the dequantized full tensor (pieces, padding, partial)."""
        scale = self.scales[stored.name]
        if shard is not None and shard.partial and rank != 0:
            return torch.zeros(shard.full_shape, dtype=dtype, device=device)
        if shard is None or shard.dim is None or shard.partial:
            dim, held = None, None
            q = read_whole(stored.read_into, stored.shape, stored.dtype, scratch)
            s = read_whole(scale.read_into, scale.shape, scale.dtype)
        else:
            dim, held = shard.dim, torch.tensor(shard.indices(rank), dtype=torch.long)
            q = read_local(stored.read_into, shard, rank, stored.dtype, scratch, in_scratch=True)
            blocks = sorted(set((held // self.block[dim]).tolist()))  # the scale rows (or columns) the slice touches
            s = read_local(scale.read_into, ParamLayout(name=scale.name, full_shape=scale.shape, dim=dim,
                                                       pieces=(_ranges(blocks),)), 0, scale.dtype, scratch)
        result = out = torch.empty(q.shape, dtype=dtype, device=device)
        if dim is not None and len(held) < q.shape[dim]:  # padded (uneven vocabulary): zeros after the held rows
            out.narrow(dim, len(held), q.shape[dim] - len(held)).zero_()
            q, out = q.narrow(dim, 0, len(held)), out.narrow(dim, 0, len(held))
        if q.numel() == 0:
            return result
        index = []  # per dim: which scale row (column) each row (column) of `q` takes, None for whole blocks
        for d in (0, 1):
            if d == 1 and dim != 1 and q.shape[1] % self.block[1] == 0:
                index.append(None)  # whole blocks of columns: transformers' op finds the block from the grid
                continue
            blocks_of = (held if d == dim else torch.arange(q.shape[d])) // self.block[d]  # full-tensor indices
            index.append(torch.searchsorted(torch.tensor(blocks), blocks_of) if d == dim else blocks_of)
        _dequantize_rows(q, s.index_select(0, index[0]), index[1], out)
        return result


def _dequantize_rows(q: torch.Tensor, s: torch.Tensor, columns: torch.Tensor | None, out: torch.Tensor) -> None:
    """out = q * s in transformers' arithmetic, a bounded block of rows at a time. `s` has a row per row of `q`;
    `columns`, when given, says which column of `s` each column of `q` takes (expanded a block of rows at a time)."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    op = Fp8Dequantize(None)  # the quantizer is only kept, never used, by the dequantization itself
    step = max(1, CHUNK_ELEMENTS // max(1, q.shape[1]))
    for first in range(0, q.shape[0], step):
        rows = slice(first, first + step)
        scale = s[rows] if columns is None else s[rows].index_select(1, columns)
        out[rows] = op._dequantize_one(q[rows], scale, output_dtype=out.dtype)


def _check_pair(weight: StoredTensor, scale: StoredTensor, block: tuple[int, int]) -> None:
    if len(weight.shape) != 2:
        raise QuantizedCheckpointError(
            f"{weight.where()} is a {len(weight.shape)}-D quantized tensor {list(weight.shape)} with block scales "
            f"{scale.name}; tpmap.from_pretrained dequantizes 2-D FP8 block-scaled weights only (3-D expert tensors "
            "stored fused are not read). Load it with transformers and shard that model with tpmap.apply")
    if not weight.dtype.is_floating_point or scale.dtype not in SCALE_DTYPES:
        raise QuantizedCheckpointError(
            f"{weight.where()} is stored as {_dtype_name(weight.dtype)} with {_dtype_name(scale.dtype)} block scales "
            f"{scale.name}; tpmap.from_pretrained reads float8 weights with float scales only (packed FP4 weights and "
            "exponent-only scales are not read)")
    want = tuple(math.ceil(n / b) for n, b in zip(weight.shape, block))
    if tuple(scale.shape) != want:
        raise CheckpointError(
            f"{scale.where()} has shape {list(scale.shape)} but its weight {weight.name} {list(weight.shape)} in "
            f"blocks of {list(block)} (config.json's weight_block_size) needs {list(want)} scales (ceil of each dim "
            "over its block); the scales do not belong to this weight or the block size is wrong")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
