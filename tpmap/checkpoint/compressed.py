"""compressed-tensors checkpoints (llm-compressor's W8A8, FP8-dynamic, W4A16), dequantized while each rank reads
its slices.

The layout (``quantization_config: {quant_method: compressed-tensors, format, config_groups}``): a quantized
Linear ``X`` stores its weight as ``X.weight`` (int-quantized: int8; float-quantized: float8) or ``X.weight_packed``
(pack-quantized: int4 and other widths packed densely into int32 along the input features, ``bits`` words per 32
elements, with the logical shape in ``X.weight_shape``), its scales as ``X.weight_scale`` (``[out, 1]`` per
channel, ``[out, in / group_size]`` per group) and, for asymmetric schemes, ``X.weight_zero_point`` alike
(pack-quantized: packed along its rows, ``[ceil(out * bits / 32), groups]`` int32).

`CompressedWeights.take` pairs every quantized weight with its tensors when the folder is opened (every rank
alike, before any collective; a quantized weight without its scale is an error naming it) and puts a stand-in
``X.weight`` of the logical shape into the checkpoint's names, so that name matching and shape checks see the
model's weights. `read` then reads one rank's rows (a Column's slice: rows of the data, scales, zero points; a
packed zero point is unpacked whole, its rows picked and packed again) or columns (a Row's: the packed words and
the scale and zero-point groups its features fall in) and decompresses that slice with
compressed-tensors' own compressor (`BaseCompressor.decompress`, what transformers runs), in transformers' dtypes:
a quantized Linear's scales cast to the model's dtype first (transformers loads them into the module's
parameters), converted experts' in their stored dtype (float8 ones in float32), the result then cast to the model's
dtype. A shard boundary
inside a group (or inside a packed word) cannot be cut this way: `refuse_cut_groups` refuses it at plan time,
listing the world sizes that work.

The activations are not quantized: a W8A8 / FP8-dynamic model computes in the model's dtype with the
dequantized weights (transformers' CPU path also fake-quantizes each Linear's input per token; docs/quantization.md
gives the measured difference). compressed-tensors is imported only when such a folder is opened.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from tpmap.api_errors import warn
from tpmap.checkpoint.conversion import _ranges
from tpmap.checkpoint.errors import CheckpointError, QuantizedCheckpointError, UnquantizedActivationsWarning
from tpmap.checkpoint.safetensors import Checkpoint, StoredTensor
from tpmap.engine import quant_blocks
from tpmap.engine.plan import ParamLayout, Plan
from tpmap.engine.slice_io import Scratch, read_local, read_whole

METHOD = "compressed-tensors"
FORMATS = ("int-quantized", "float-quantized", "pack-quantized")  # the ones tested
PARTS = ("weight_scale", "weight_zero_point", "weight_shape")  # stored beside the data, by local name
FLOAT8 = (torch.float8_e4m3fn, torch.float8_e5m2)
QUANTIZED_DTYPES = (torch.int8, torch.int32, *FLOAT8)


def _field(quantization, key: str, default=None):
    return quantization.get(key, default) if isinstance(quantization, dict) else getattr(quantization, key, default)


def is_compressed(config) -> bool:
    quantization = getattr(config, "quantization_config", None)
    method = _field(quantization, "quant_method") if quantization else None
    return getattr(method, "value", method) == METHOD


@dataclass(frozen=True)
class _Weight:
    data: StoredTensor  # X.weight (int8 / float8) or X.weight_packed (int32)
    parts: dict  # local name (weight_scale, weight_zero_point) -> StoredTensor
    shape: tuple[int, int]  # the logical weight's (out, in)


@dataclass
class CompressedWeights:
    """The scheme and, by model weight name, the stored tensors of every quantized weight of a checkpoint."""
    scheme: object  # compressed_tensors' QuantizationScheme
    format: str
    weights: dict[str, _Weight]
    # the weights that are model tensors as stored (no conversion): transformers loads their scales into the
    # quantized module's parameters, in the model's dtype, and decompresses there; converted ones (experts fused
    # by its conversion mapping) it decompresses in the stored dtypes, then casts. `read` does each alike.
    in_model_dtype: set[str] = dataclasses.field(default_factory=set)

    @classmethod
    def take(cls, checkpoint: Checkpoint, folder: Path, config) -> CompressedWeights:
        scheme, fmt = _scheme(folder, config)
        weights: dict[str, _Weight] = {}
        tensors = checkpoint.tensors
        for name in [n for n in tensors if n.endswith((".weight_packed", ".weight"))]:
            prefix = name.rpartition(".")[0] + "."
            data = tensors[name]
            scale = tensors.get(prefix + "weight_scale")
            if data.dtype not in QUANTIZED_DTYPES and not name.endswith("_packed"):
                continue  # a weight stored plain (an ignored module: lm_head, norms, embeddings)
            if scale is None:
                raise CheckpointError(
                    f"{data.where()} ({str(data.dtype).removeprefix('torch.')} {list(data.shape)}): quantized but the "
                    f"checkpoint has no {prefix}weight_scale; without it its values cannot be dequantized. The folder "
                    "is incomplete or not in the compressed-tensors layout its config.json declares")
            if prefix + "weight_g_idx" in tensors:
                raise QuantizedCheckpointError(
                    f"{data.where()} has {prefix}weight_g_idx (activation ordering): tpmap.from_pretrained does not "
                    "read reordered groups yet. Load it with transformers and shard that model with tpmap.apply")
            if len(data.shape) != 2:
                raise QuantizedCheckpointError(
                    f"{data.where()} is a {len(data.shape)}-D quantized tensor {list(data.shape)}; "
                    "tpmap.from_pretrained decompresses 2-D weights only (experts stored fused are not read). Load "
                    "it with transformers and shard that model with tpmap.apply")
            parts = {p: tensors.pop(prefix + p) for p in PARTS if prefix + p in tensors}
            del tensors[name]
            shape = _logical_shape(data, parts.pop("weight_shape", None))
            weights[prefix + "weight"] = _Weight(data, parts, shape)
            # the stand-in the model's weight is matched to: its logical shape, read only through `read`
            tensors[prefix + "weight"] = dataclasses.replace(data, name=prefix + "weight", shape=shape,
                                                             dtype=parts["weight_scale"].dtype)
        if scheme.input_activations is not None:  # dynamic (static scales are refused by _scheme)
            warn(
                f"{folder / 'config.json'} quantizes each Linear's input per token on the fly "
                f"({scheme.input_activations.num_bits}-bit {_value(scheme.input_activations.type)} activations); "
                "tpmap.from_pretrained computes with the dequantized weights on unquantized inputs, so its logits "
                "differ from a load that quantizes the activations (transformers' CPU path) by that quantization's "
                "error, measured 3e-2 (int8) to 3e-1 (float8) relative on tiny random models (docs/quantization.md)",
                UnquantizedActivationsWarning)
        return cls(scheme, fmt, weights)

    def scale_of(self, stored: StoredTensor) -> StoredTensor | None:
        weight = self.weights.get(stored.name)
        return weight.parts["weight_scale"] if weight is not None else None

    def group(self) -> int:
        """How many input features must stay on one rank together (a group; the features of a packed word)."""
        bits, args = self.scheme.weights.num_bits, self.scheme.weights
        unit = 32 // math.gcd(32, bits) if self.format == "pack-quantized" else 1
        return math.lcm(unit, (args.group_size if _value(args.strategy) == "group" else 1) or 1)

    def read(self, stored: StoredTensor, shard: ParamLayout | None, rank: int, dtype: torch.dtype,
             device: torch.device, scratch: Scratch) -> torch.Tensor:
        """`stored` dequantized to `dtype` on `device`: whole, or this rank's local tensor as `take` would cut it
        from the dequantized full tensor."""
        weight = self.weights[stored.name]
        if shard is not None and shard.partial and rank != 0:
            return torch.zeros(shard.full_shape, dtype=dtype, device=device)
        out, inp = weight.shape
        if shard is None or shard.dim is None or shard.partial:
            data = read_whole(weight.data.read_into, weight.data.shape, weight.data.dtype)
            local = {"weight_packed" if _packed(weight) else "weight": data}
            local.update({p: read_whole(t.read_into, t.shape, t.dtype) for p, t in weight.parts.items()})
            shape = (out, inp)
        else:
            runs = shard.pieces[rank]
            held = sum(n for _, n in runs)
            assert held == shard.local_shape(rank)[shard.dim], f"{stored.name}: a padded quantized weight"
            local = self._slice(weight, shard.dim, runs, scratch)
            shape = (held, inp) if shard.dim == 0 else (out, held)
        # transformers' arithmetic: a Linear's scales in the model's dtype; converted float8 experts in float32
        # (its CompressedTensorsDequantize multiplies them itself); other converted weights in the stored dtypes
        cast = dtype if stored.name in self.in_model_dtype else torch.float32 if weight.data.dtype in FLOAT8 else None
        if cast is not None:
            local = {k: v.to(cast) if v.is_floating_point() and k != "weight" else v for k, v in local.items()}
        return self._decompress(local, shape).to(dtype=dtype, device=device)

    def _slice(self, weight: _Weight, dim: int, runs, scratch: Scratch) -> dict[str, torch.Tensor]:
        """The stored tensors' parts that hold the runs ((start, n), ...) of the weight's dim `dim`."""
        packed = _packed(weight)
        data_runs = runs
        if dim == 1 and packed:  # features -> their int32 words (runs start and end on whole words: plan-time check)
            per_word = 32 // math.gcd(32, self.scheme.weights.num_bits)
            words = self.scheme.weights.num_bits // math.gcd(32, self.scheme.weights.num_bits)
            data_runs = tuple((s // per_word * words, n // per_word * words) for s, n in runs)
        local = {"weight_packed" if packed else "weight": _read(weight.data, dim, data_runs, scratch)}
        for part, t in weight.parts.items():
            if part == "weight_zero_point" and packed and dim == 0:  # packed along the rows: unpack, pick, repack
                local[part] = self._packed_rows(t, weight.shape[0], runs)
            elif dim == 1:  # the scale columns (groups) the features fall in; one column (per channel): whole
                group = weight.shape[1] // t.shape[1]
                cols = sorted({i // group for s, n in runs for i in range(s, s + n)}) if t.shape[1] > 1 else [0]
                local[part] = _read(t, 1, _ranges(cols), scratch)
            else:
                local[part] = _read(t, 0, runs, scratch)
        return local

    def _packed_rows(self, t: StoredTensor, rows: int, runs) -> torch.Tensor:
        """The rows `runs` of a zero point packed along its rows ([ceil(out * bits / 32), groups] int32), packed
        again as compressed-tensors packs it (its own helpers; the whole zero point is small: one per group)."""
        from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32

        bits = self.scheme.weights.num_bits
        whole = unpack_from_int32(read_whole(t.read_into, t.shape, t.dtype), bits, (rows, t.shape[1]), packed_dim=0)
        held = torch.tensor([i for s, n in runs for i in range(s, s + n)])
        return pack_to_int32(whole.index_select(0, held), bits, packed_dim=0)

    def _decompress(self, local: dict[str, torch.Tensor], shape: tuple[int, int]) -> torch.Tensor:
        """compressed-tensors' own decompression of one (sliced) module state dict (transformers' load op)."""
        from compressed_tensors.compressors import BaseCompressor

        if "weight_packed" in local:
            local["weight_shape"] = torch.tensor(shape)
        compressor = BaseCompressor.get_value_from_registry(self.scheme.format or self.format)
        weight = compressor.decompress(local, self.scheme)["weight"]
        assert tuple(weight.shape) == tuple(shape), (tuple(weight.shape), shape)
        return weight


def refuse_cut_groups(compressed: CompressedWeights, sources: dict, plan: Plan, plan_at) -> None:
    """A weight's input features (its last dim: a Row's, or stacked experts' down projections converted from
    quantized per-expert weights) split inside a group or a packed word cannot be dequantized slice by slice: refused
    before anything is read, with the world sizes whose boundaries fall between groups. `sources`: model tensor
    name -> its checkpoint source (`conversion.match_checkpoint_names`)."""
    group = compressed.group()
    quantized = [n for n, source in sources.items() if any(t.name in compressed.weights for _, t in source.stored)]
    quant_blocks.refuse_cut_groups(dict.fromkeys(quantized, group), plan, plan_at,
                                   "is stored quantized in groups of {group} input features (compressed-tensors: "
                                   "group_size / packed words)")


def _scheme(folder: Path, config):
    """compressed-tensors' QuantizationScheme that every quantized weight uses, and the format; what tpmap does not
    read is refused naming it."""
    from compressed_tensors.quantization import QuantizationConfig
    from pydantic import ValidationError

    raw = config.quantization_config
    raw = raw if isinstance(raw, dict) else raw.to_dict()
    where = folder / "config.json"
    fields = {k: v for k, v in raw.items() if k in QuantizationConfig.model_fields}
    try:
        parsed = QuantizationConfig.model_validate(fields)
    except ValidationError as e:
        raise QuantizedCheckpointError(f"{where} declares quant_method 'compressed-tensors' with a quantization_config "
                                       f"that compressed-tensors does not accept: {e}") from e
    groups = list(parsed.config_groups.values())
    why = None
    if len(groups) != 1:
        why = f"{len(groups)} config_groups (mixed schemes are not read yet)"
    elif groups[0].weights is None:
        why = "a config group without weight quantization"
    elif (groups[0].format or parsed.format) not in FORMATS:
        why = f"format {groups[0].format or parsed.format!r} (read: {', '.join(FORMATS)})"
    elif _value(groups[0].weights.strategy) not in ("channel", "group"):
        why = f"weight strategy {groups[0].weights.strategy!r} (read: channel, group)"
    elif _value(parsed.quantization_status) != "compressed":
        why = f"quantization_status {parsed.quantization_status!r} (read: compressed)"
    elif groups[0].input_activations is not None and not groups[0].input_activations.dynamic:
        why = "static input activation scales (input_scale tensors)"
    elif groups[0].output_activations is not None:
        why = "quantized output activations"
    elif parsed.kv_cache_scheme is not None:
        why = "a kv_cache_scheme (a quantized KV cache: k_scale / v_scale tensors)"
    elif any(raw.get(key) for key in ("sparsity_config", "transform_config")):
        why = "a " + " and a ".join(k for k in ("sparsity_config", "transform_config") if raw.get(k))
    if why is not None:
        raise QuantizedCheckpointError(
            f"{where} declares quant_method 'compressed-tensors' with {why}; tpmap.from_pretrained reads one config "
            "group of int8 / float8 / packed int weights per channel or group, compressed. Load it with transformers "
            "and shard that model with tpmap.apply, or save it unquantized and load that folder")
    scheme = groups[0]
    return scheme, scheme.format or parsed.format


def _value(x):
    return getattr(x, "value", x)  # compressed-tensors' enums


def _packed(weight: _Weight) -> bool:
    return weight.data.name.endswith("_packed")


def _logical_shape(data: StoredTensor, shape: StoredTensor | None) -> tuple[int, int]:
    if shape is None:
        return tuple(data.shape)
    values = read_whole(shape.read_into, shape.shape, shape.dtype).tolist()
    if len(values) != 2 or len(data.shape) != 2 or values[0] != data.shape[0]:
        raise QuantizedCheckpointError(
            f"{data.where()} {list(data.shape)} with weight_shape {values}: tpmap.from_pretrained reads 2-D packed "
            "weights only")
    return int(values[0]), int(values[1])


def _read(t: StoredTensor, dim: int, runs, scratch: Scratch) -> torch.Tensor:
    shard = ParamLayout(name=t.name, full_shape=t.shape, dim=dim, pieces=(tuple(runs),))
    return read_local(t.read_into, shard, 0, t.dtype, scratch)
