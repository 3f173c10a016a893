"""FP8 block-scaled checkpoints load dequantized, each rank reading its own slices; every other quantization
is refused, naming the method, instead of loading as plain tensors.

The FP8 layout (DeepSeek-V3, Qwen3-FP8): e4m3 ``X.weight`` with an fp32 ``X.weight_scale_inv`` of shape
``(ceil(out / B0), ceil(in / B1))``, ``quantization_config: {quant_method: fp8, weight_block_size: [B0, B1]}``;
``w = weight.float() * weight_scale_inv[i // B0, j // B1]``. The tests quantize tiny models into that layout
and dequantize them again here, by that definition (`_to_fp8`), into a plain folder beside: the reference.
transformers cannot be the reference for every layout: on CPU it finds the block from the scale grid
(``rows // scale_rows``), which for dims the block does not divide is not the block (192 rows in blocks of 128:
it uses 96, silently wrong) or not an integer (320 rows: it raises). Where the block divides the dims, tpmap
equals transformers' own CPU load bit for bit (`test_fp8_equals_transformers_own_dequantization`).
"""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import quantized_cases
import torch
from helpers import expert_bytes
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM, LlamaForCausalLM

import tpmap


def _projections(name: str, tensor: torch.Tensor) -> bool:
    return tensor.dim() == 2 and "embed" not in name and "lm_head" not in name and "norm" not in name


def _every_matrix(name: str, tensor: torch.Tensor) -> bool:
    return tensor.dim() == 2


def _save_tiny(folder: Path, model_type: str, **config) -> None:
    config = AutoConfig.for_model(model_type, num_hidden_layers=1, max_position_embeddings=64, **config)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)


def _to_fp8(folder: Path, block: tuple[int, int], quantize=_projections, **quantization) -> Path:
    """Turn the plain checkpoint saved in `folder` into the FP8 block-scaled layout, in place; return a folder
    beside it holding what the FP8 tensors stand for, dequantized here by the layout's definition and stored
    unquantized (fp32). Each block's weights are first scaled by 2**k (k random in -3..3), so that a scale
    taken from a neighbouring block is far off."""
    tensors = load_file(folder / "model.safetensors")
    plain = dict(tensors)
    generator = torch.Generator().manual_seed(1)
    for name in [n for n, t in tensors.items() if quantize(n, t)]:
        (out, inp), (b0, b1) = tensors[name].shape, block
        grid = (math.ceil(out / b0), math.ceil(inp / b1))
        rows, cols = torch.arange(out) // b0, torch.arange(inp) // b1
        w = tensors[name].float() * 2.0 ** torch.randint(-3, 4, grid, generator=generator)[rows][:, cols]
        padded = torch.zeros(grid[0] * b0, grid[1] * b1)
        padded[:out, :inp] = w.abs()
        scale = padded.reshape(grid[0], b0, grid[1], b1).amax(dim=(1, 3)) / torch.finfo(torch.float8_e4m3fn).max
        per_element = scale[rows][:, cols]
        tensors[name] = (w / per_element).to(torch.float8_e4m3fn)
        tensors[name + "_scale_inv"] = scale
        plain[name] = tensors[name].float() * per_element
    reference = folder.parent / f"{folder.name}-plain"
    reference.mkdir()
    shutil.copy(folder / "config.json", reference / "config.json")
    if (folder / "generation_config.json").exists():
        shutil.copy(folder / "generation_config.json", reference / "generation_config.json")
    save_file(plain, reference / "model.safetensors", metadata={"format": "pt"})
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    raw = json.loads((folder / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "fp8", "weight_block_size": list(block),
                                  "activation_scheme": "dynamic", **quantization}
    (folder / "config.json").write_text(json.dumps(raw))
    return reference


# name: (model type, config, weight_block_size, which weights are quantized)
LAYOUTS = {
    # the real block size on dims it does not divide (192, 320): slices start and end inside blocks, the last
    # blocks are partial; GQA 12/2, the KV heads replicated at world size 4
    "llama-128": ("llama", dict(hidden_size=192, intermediate_size=320, num_attention_heads=12, num_key_value_heads=2,
                                vocab_size=128), (128, 128), _projections),
    # small blocks, not square (B0 and B1 swapped would show): many boundaries inside blocks; the embedding and the
    # LM head quantized too, their vocabulary of 122 padded at world size 4
    "llama-16x32": ("llama", dict(hidden_size=96, intermediate_size=160, num_attention_heads=12, num_key_value_heads=4,
                                  vocab_size=122), (16, 32), _every_matrix),
    # fused Columns: qkv_proj [q | k | v] in GQA sections and gate_up_proj [gate | up], each section split on its own
    "phi3-32x48": ("phi3", dict(hidden_size=96, intermediate_size=176, num_attention_heads=12, num_key_value_heads=4,
                                vocab_size=128, pad_token_id=0, bos_token_id=1, eos_token_id=2),
                   (32, 48), _projections),
    # per-expert 2-D weights fused into 3-D experts by transformers' conversion: each dequantized, then converted
    "mixtral-32": ("mixtral", dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                                   num_local_experts=4, num_experts_per_tok=2, vocab_size=128), (32, 32), _projections),
    # SmolLM2's 9 query / 3 KV heads, intermediate 99: an uneven split at 2 (5/4 heads, KV heads held by both
    # ranks) and 4; every boundary falls inside a block somewhere
    "llama-9q3kv-16x32": ("llama", dict(hidden_size=72, intermediate_size=99, num_attention_heads=9,
                                        num_key_value_heads=3, vocab_size=122), (16, 32), _every_matrix),
}
FULL = {"mixtral-32"}


def _layout(tmp_path: Path, name: str) -> tuple[Path, Path]:
    model_type, config, block, quantize = LAYOUTS[name]
    folder = tmp_path / name
    _save_tiny(folder, model_type, **config)
    return folder, _to_fp8(folder, block, quantize)


def _expected_param_bytes(reference: Path, world_size: int) -> tuple[list[int], int, int]:
    """(each rank's parameter bytes by the plan, the split parameters' bytes, all parameters' bytes) of the model
    loaded from the plain reference folder."""
    model = AutoModelForCausalLM.from_pretrained(reference)
    split = tpmap.plan(model, world_size).params
    per_rank = [sum(math.prod(split[n].local_shape(r) if n in split else p.shape) * p.element_size()
                    for n, p in model.named_parameters()) for r in range(world_size)]
    split_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if n in split)
    return per_rank, split_bytes, sum(p.numel() * p.element_size() for p in model.parameters())


@pytest.mark.parametrize("world_size", [2, pytest.param(4, marks=pytest.mark.full)])
@pytest.mark.parametrize("layout", [pytest.param(n, marks=pytest.mark.full) if n in FULL else n for n in LAYOUTS])
def test_fp8_block_scaled_checkpoint_loads_dequantized(ranks, tmp_path, layout, world_size):
    folder, reference = _layout(tmp_path, layout)
    results = ranks(world_size).run(quantized_cases.load_fp8, str(folder), str(reference))

    # every rank's tensors equal the plain folder's loaded by tpmap (itself bit-identical to tpmap.apply on
    # transformers' load: tests/test_checkpoint.py), bit for bit; the config no longer claims quantization
    assert [r["differ"] for r in results] == [[]] * world_size
    assert not any(r["quantization_config"] for r in results)
    # the sharded logits match transformers' unsharded load of the reference
    full = AutoModelForCausalLM.from_pretrained(reference)
    with torch.no_grad():
        want = full(quantized_cases.input_ids(full.config.vocab_size)).logits
    error = ((results[0]["logits"] - want).abs().max() / want.abs().max()).item()
    print(f"{layout} ws={world_size}: max relative error of the logits {error:.2e}")
    assert error < 1e-4
    # each rank keeps its share of the dequantized model: the plan's local sizes, about 1 / world_size of the split
    # weights (more where KV heads are replicated or the vocabulary padded)
    per_rank, split_bytes, total = _expected_param_bytes(reference, world_size)
    assert [r["param_bytes"] for r in results] == per_rank
    assert max(per_rank) - (total - split_bytes) < 0.7 * split_bytes
    # each rank read only its slices: float8 bytes and scales that its parameters need, not the whole file
    stored = load_file(folder / "model.safetensors")
    scale_bytes = sum(t.numel() * t.element_size() for n, t in stored.items() if n.endswith("_scale_inv"))
    file_bytes = sum(t.numel() * t.element_size() for t in stored.values())
    if layout not in FULL:  # stored names are the parameter names (no conversion)
        for r in results:
            bound = sum(n * stored[name].element_size() for name, n in r["numel"].items()) + scale_bytes
            assert r["read"] <= bound
    assert max(r["read"] for r in results) < (0.7 if world_size == 2 else 0.5) * file_bytes


@pytest.mark.parametrize("world_size", [2, pytest.param(3, marks=pytest.mark.full)])
def test_fp8_experts_dealt_whole_read_only_their_experts_and_scales(ranks, tmp_path, world_size):
    """experts='parallel' on an FP8 Mixtral stored per expert (w1/w3/w2 of each, each with its block scales; the
    conversion stacks them): each rank dequantizes and keeps only its whole experts (4 at 3: 2/1/1), bit for bit the
    plain folder's, and reads the float8 bytes and scales of those experts alone."""
    folder, reference = _layout(tmp_path, "mixtral-32")
    results = ranks(world_size).run(quantized_cases.load_fp8, str(folder), str(reference), None, "parallel")
    assert [r["differ"] for r in results] == [[]] * world_size
    full = AutoModelForCausalLM.from_pretrained(reference)
    with torch.no_grad():
        want = full(quantized_cases.input_ids(full.config.vocab_size)).logits
    assert ((results[0]["logits"] - want).abs().max() / want.abs().max()).item() < 1e-4
    held = [r["numel"]["model.layers.0.mlp.experts.gate_up_proj"] // (2 * 96 * 64) for r in results]
    assert held == ([2, 2] if world_size == 2 else [2, 1, 1]), held  # whole experts: E_r x 2I x H
    expert_sizes, other = expert_bytes(folder / "model.safetensors", 4)
    for r, experts in zip(results, held):  # this rank's experts (weights and scales) and at most all the rest
        assert r["read"] <= experts * expert_sizes[0] + other, (r["read"], experts, expert_sizes, other)


def test_fp8_in_bfloat16_equals_the_reference_cast(ranks, tmp_path):
    """dtype=bfloat16: each weight rounded once, from the fp32 product (transformers' order), not computed in bf16."""
    folder, reference = _layout(tmp_path, "phi3-32x48")
    results = ranks(2).run(quantized_cases.load_fp8, str(folder), str(reference), "bfloat16")
    assert [r["differ"] for r in results] == [[], []]
    assert {r["dtype"] for r in results} == {"torch.bfloat16"}


@pytest.mark.full
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fp8_equals_transformers_own_dequantization(ranks, tmp_path, dtype):
    """Where the block divides every dim, transformers' CPU load (it dequantizes: no FP8 module is left) is the
    reference itself: tpmap.apply on it equals tpmap.from_pretrained, bit for bit (transformers needs accelerate)."""
    pytest.importorskip("accelerate")
    folder = tmp_path / "llama"
    _save_tiny(folder, "llama", hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
               vocab_size=128)
    _to_fp8(folder, (128, 128))
    results = ranks(2).run(quantized_cases.against_transformers, str(folder), dtype)
    assert [r["differ"] for r in results] == [[], []]
    assert results[0]["fp8_modules"] == [] and results[0]["dtype"] == f"torch.{dtype}"


def test_a_float8_tensor_without_its_scale_is_an_error_on_every_rank(ranks, tmp_path):
    folder, _ = _layout(tmp_path, "llama-16x32")
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.0.mlp.up_proj.weight_scale_inv"]
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    messages = ranks(2).run(quantized_cases.load_refused, str(folder))
    assert messages[0] == messages[1]
    assert "model.safetensors:model.layers.0.mlp.up_proj.weight (float8_e4m3fn [160, 96])" in messages[0]
    assert "no model.layers.0.mlp.up_proj.weight_scale_inv" in messages[0]


def test_a_scale_that_does_not_fit_its_weight_names_both_shapes(tmp_path):
    folder, _ = _layout(tmp_path, "llama-16x32")
    tensors = load_file(folder / "model.safetensors")
    tensors["model.layers.0.mlp.down_proj.weight_scale_inv"] = torch.ones(6, 3)  # (96, 160) in 16 x 32: (6, 5)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(tpmap.CheckpointError) as e:
        tpmap.from_pretrained(folder)
    assert "down_proj.weight_scale_inv has shape [6, 3]" in str(e.value)
    assert "down_proj.weight [96, 160] in blocks of [16, 32]" in str(e.value) and "needs [6, 5]" in str(e.value)


@pytest.mark.parametrize(("tensor", "scale", "message"), [
    (torch.zeros(2, 32, 16, dtype=torch.float8_e4m3fn), torch.ones(2, 2, 1), "3-D quantized tensor [2, 32, 16]"),
    (torch.zeros(32, 16, dtype=torch.int8), torch.ones(2, 1), "stored as int8"),
    (torch.zeros(32, 16, dtype=torch.float8_e4m3fn), torch.ones(2, 1, dtype=torch.uint8), "with uint8 block scales"),
])
def test_quantized_tensors_tpmap_does_not_read_are_refused_by_name(tmp_path, tensor, scale, message):
    folder, _ = _layout(tmp_path, "llama-16x32")
    tensors = load_file(folder / "model.safetensors")
    tensors["model.layers.0.mlp.experts.gate_up_proj"] = tensor
    tensors["model.layers.0.mlp.experts.gate_up_proj_scale_inv"] = scale
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(tpmap.QuantizedCheckpointError, match=r"model\.layers\.0\.mlp\.experts\.gate_up_proj") as e:
        tpmap.from_pretrained(folder)
    assert message in str(e.value)


def _plain_with_quantization_config(folder, quantization: dict) -> None:
    config = AutoConfig.for_model("llama", hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                  num_hidden_layers=1, vocab_size=64)
    LlamaForCausalLM(config).save_pretrained(folder)
    raw = json.loads((folder / "config.json").read_text())
    raw["quantization_config"] = quantization
    (folder / "config.json").write_text(json.dumps(raw))


@pytest.mark.parametrize("method", ["compressed-tensors", "bitsandbytes", "gptq", "awq", "torchao"])
def test_every_other_quantization_method_is_refused_by_name(tmp_path, method):
    _plain_with_quantization_config(tmp_path, {"quant_method": method})
    with pytest.raises(tpmap.QuantizedCheckpointError, match=f"quant_method '{method}'"):
        tpmap.from_pretrained(tmp_path)
    assert issubclass(tpmap.QuantizedCheckpointError, tpmap.CheckpointError)


@pytest.mark.parametrize(("quantization", "message"), [
    ({}, "no weight_block_size: per-tensor FP8 scales"),
    ({"weight_block_size": None}, "no weight_block_size: per-tensor FP8 scales"),
    ({"weight_block_size": [128]}, "weight_block_size [128], which is not two positive integers"),
    ({"weight_block_size": [128, 128], "activation_scheme": "static"}, "activation_scheme 'static'"),
    ({"weight_block_size": [128, 128], "scale_fmt": "ue8m0"}, "scale_fmt 'ue8m0'"),
    ({"weight_block_size": [128, 128], "expert_dtype": "fp4"}, "expert_dtype 'fp4'"),
])
def test_fp8_variants_tpmap_does_not_read_are_refused(tmp_path, quantization, message):
    _plain_with_quantization_config(tmp_path, {"quant_method": "fp8", **quantization})
    with pytest.raises(tpmap.QuantizedCheckpointError, match="quant_method 'fp8'") as e:
        tpmap.from_pretrained(tmp_path)
    assert message in str(e.value)


def test_a_checkpoint_without_quantization_still_loads(tmp_path):
    config = AutoConfig.for_model("llama", hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                  num_hidden_layers=1, vocab_size=64)
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    assert type(tpmap.from_pretrained(tmp_path)).__name__ == "LlamaForCausalLM"
