"""compressed-tensors checkpoints (as llm-compressor writes them) load dequantized, each rank reading its slices.

The checkpoints are written here with compressed-tensors' own compressors from a tiny model's state dict (scales
from its `calculate_qparams`, what llm-compressor's observers feed it) and the quantization_config llm-compressor
writes (its preset schemes: W8A8 int8 per channel with dynamic per-token int8 activations, FP8_DYNAMIC alike in
float8, W4A16 int4 packed per group). The reference is transformers' own CPU load of the same folder: its
decompressed weights (bit for bit, after tpmap.apply) and its logits. transformers also fake-quantizes each
Linear's input per token for W8A8 / FP8_DYNAMIC, which tpmap does not (it computes with the dequantized weights):
those logits differ by that simulation, measured and bounded below; W4A16 (weights only) matches within 1e-4.
"""
from __future__ import annotations

import json
from pathlib import Path

import compressed_cases
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM

pytest.importorskip("compressed_tensors")

FORMATS = {"W8A8": "int-quantized", "FP8_DYNAMIC": "float-quantized", "W4A16": "pack-quantized"}


def _quantized(name: str, tensor: torch.Tensor) -> bool:
    return tensor.dim() == 2 and name.endswith(".weight") and not any(s in name for s in ("embed", "lm_head", "norm"))


def compress(folder: Path, preset: str, group_size: int | None = None) -> None:
    """Turn the plain checkpoint in `folder` into compressed-tensors' layout for `preset`, in place."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme
    from compressed_tensors.quantization.utils import calculate_qparams

    scheme = preset_name_to_scheme(preset, ["Linear"])
    if group_size is not None:
        scheme.weights.group_size = group_size
    fmt = FORMATS[preset]
    compressor = BaseCompressor.get_value_from_registry(fmt)
    tensors, out = load_file(folder / "model.safetensors"), {}
    for name, t in tensors.items():
        if not _quantized(name, t):
            out[name] = t
            continue
        w = t.float()  # [out, in]
        if scheme.weights.strategy == "group":
            grouped = w.reshape(w.shape[0], -1, scheme.weights.group_size)  # [out, in / g, g]
            low, high = grouped.amin(-1), grouped.amax(-1)  # [out, in / g]
        else:
            low, high = w.amin(1, keepdim=True), w.amax(1, keepdim=True)  # [out, 1]
        scale, zero_point = calculate_qparams(low, high, scheme.weights)
        module = compressor.compress({"weight": w, "weight_scale": scale, "weight_zero_point": zero_point}, scheme)
        out.update({name.removesuffix("weight") + k: v for k, v in module.items()})
    save_file(out, folder / "model.safetensors", metadata={"format": "pt"})
    raw = json.loads((folder / "config.json").read_text())
    config = QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"], format=fmt,
                                quantization_status="compressed")
    raw["quantization_config"] = {**json.loads(config.model_dump_json()), "quant_method": "compressed-tensors"}
    (folder / "config.json").write_text(json.dumps(raw, indent=1))


# name: (model type, config); std 0.15 init
FAMILIES = {
    # GQA: 2 KV heads, replicated at world size 4
    "llama": ("llama", dict(hidden_size=128, intermediate_size=256, num_attention_heads=8, num_key_value_heads=2,
                            vocab_size=128)),
}


def save(folder: Path, family: str, preset: str, group_size: int | None = None) -> Path:
    model_type, config = FAMILIES[family]
    config = AutoConfig.for_model(model_type, num_hidden_layers=1, max_position_embeddings=64, **config)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.15)
    model.save_pretrained(folder)
    compress(folder, preset, group_size)
    return folder


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


# preset: (group size, the largest relative difference of transformers' logits, which fake-quantize activations)
PRESETS = {"W4A16": (32, 1e-4), "W8A8": (None, 6e-2), "FP8_DYNAMIC": (None, 0.2)}


@pytest.mark.parametrize("world_size", [2, pytest.param(4, marks=pytest.mark.full)])
@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("preset", list(PRESETS))
def test_compressed_tensors_checkpoint_loads_dequantized(ranks, tmp_path, preset, family, world_size):
    group_size, bound = PRESETS[preset]
    folder = save(tmp_path / preset, family, preset, group_size)
    results = ranks(world_size).run(compressed_cases.load_compressed, str(folder))

    # every rank's tensors are transformers' own decompressed weights, sliced, bit for bit
    assert [r["differ"] for r in results] == [[]] * world_size
    assert not any(r["quantization_config"] for r in results)
    plain, hf_logits = compressed_cases.transformers_dequantized(str(folder))
    with torch.no_grad():
        dense = plain(compressed_cases.input_ids(plain.config.vocab_size)).logits
    to_dense, to_hf = _relative(results[0]["logits"], dense), _relative(results[0]["logits"], hf_logits)
    print(f"{preset} {family} ws={world_size}: logits vs the dequantized weights {to_dense:.1e}, "
          f"vs transformers' (activations fake-quantized for W8A8/FP8) {to_hf:.1e}")
    assert to_dense < 1e-4 and to_hf < bound
    # each rank read about its share of the file, not all of it
    file_bytes = (folder / "model.safetensors").stat().st_size
    assert max(r["read"] for r in results) < (0.7 if world_size == 2 else 0.5) * file_bytes
