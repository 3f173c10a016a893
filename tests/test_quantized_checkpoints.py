"""Quantized checkpoints are refused, naming the method, instead of loading as plain tensors.

An FP8 block-scaled checkpoint (e4m3 `weight`s, an fp32 `weight_scale_inv` per 128 x 128 block,
`quantization_config: {quant_method: fp8, weight_block_size: [128, 128]}`; the DeepSeek-V3 / Qwen3-FP8
layout) used to load through tpmap.from_pretrained without an error and compute wrong logits: the
e4m3 weights were cast as values and the scales dropped. Every quantization method is refused until
one is read correctly; on every rank alike, before any collective.
"""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, LlamaForCausalLM

import quantized_cases
import tpmap

BLOCK = 128


def _fp8_block_scaled(folder) -> None:
    """A tiny Llama saved in the FP8 block-scaled layout: each 2-D projection weight as e4m3 with its
    inverse scale per 128 x 128 block (w ~= weight.float() * weight_scale_inv[i // 128, j // 128])."""
    config = AutoConfig.for_model("llama", hidden_size=256, intermediate_size=512, num_attention_heads=4,
                                  num_key_value_heads=2, num_hidden_layers=1, vocab_size=128)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    tensors = load_file(folder / "model.safetensors")
    for name in [n for n in tensors if n.endswith("proj.weight")]:
        w = tensors[name].float()
        rows, cols = w.shape[0] // BLOCK, w.shape[1] // BLOCK
        blocks = w.reshape(rows, BLOCK, cols, BLOCK)
        scale = blocks.abs().amax(dim=(1, 3)) / torch.finfo(torch.float8_e4m3fn).max  # (rows, cols)
        tensors[name] = (blocks / scale[:, None, :, None]).reshape(w.shape).to(torch.float8_e4m3fn)
        tensors[name + "_scale_inv"] = scale
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    raw = json.loads((folder / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [BLOCK, BLOCK],
                                  "activation_scheme": "dynamic"}
    (folder / "config.json").write_text(json.dumps(raw))


def _plain_with_quantization_config(folder, quantization: dict) -> None:
    config = AutoConfig.for_model("llama", hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                  num_hidden_layers=1, vocab_size=64)
    LlamaForCausalLM(config).save_pretrained(folder)
    raw = json.loads((folder / "config.json").read_text())
    raw["quantization_config"] = quantization
    (folder / "config.json").write_text(json.dumps(raw))


def test_an_fp8_block_scaled_checkpoint_is_refused_on_every_rank(ranks, tmp_path):
    _fp8_block_scaled(tmp_path)
    stored = load_file(tmp_path / "model.safetensors")
    assert stored["model.layers.0.self_attn.q_proj.weight"].dtype == torch.float8_e4m3fn  # the real layout
    assert stored["model.layers.0.self_attn.q_proj.weight_scale_inv"].shape == (2, 2)
    messages = ranks(2).run(quantized_cases.load_refused, str(tmp_path))
    assert messages[0] == messages[1]
    assert "quant_method 'fp8'" in messages[0] and "config.json" in messages[0] and "tpmap.apply" in messages[0]


@pytest.mark.parametrize("method", ["fp8", "compressed-tensors", "bitsandbytes", "gptq", "awq", "torchao"])
def test_every_quantization_method_is_refused_by_name(tmp_path, method):
    _plain_with_quantization_config(tmp_path, {"quant_method": method})
    with pytest.raises(tpmap.QuantizedCheckpointError, match=f"quant_method '{method}'"):
        tpmap.from_pretrained(tmp_path)
    assert issubclass(tpmap.QuantizedCheckpointError, tpmap.CheckpointError)


def test_a_checkpoint_without_quantization_still_loads(tmp_path):
    config = AutoConfig.for_model("llama", hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                  num_hidden_layers=1, vocab_size=64)
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    assert type(tpmap.from_pretrained(tmp_path)).__name__ == "LlamaForCausalLM"
