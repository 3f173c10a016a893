"""Models quantized by torchao, then sharded by tpmap.apply, against the unsharded quantized model in the same run.

* Weight-only schemes (int8 per channel, int8 per group of 16, float8) are exact up to summation order: each
  rank's quantized data is sliced with its scales (the plan's local shapes, the tensors still quantized), and
  the matmul dequantizes the same values. fp32 bound 1e-5 (measured <= 1.6e-6); a lost scale is O(1).
* Dynamic int8 activations (int8 x int8): a Row's input is quantized per token over this rank's features only,
  so its scales differ from the unsharded model's: not exact, bounded and documented (docs/quantization.md).
* A per-group block that a shard boundary would cut is refused before anything changes, with the world sizes
  that work.
"""
from __future__ import annotations

import pytest

pytest.importorskip("torchao")

import torchao_cases

from tpmap import verify

# mapping -> class: GQA with KV heads replicated at ws 4 (llama), sliding window (mistral), biases on q/k/v (qwen2),
# MoE attention and dense MLP beside experts (qwen3_moe, mixtral: the experts are Params, not nn.Linear, and stay
# unquantized), MLA (deepseek_v3), granite, gemma2, fused interleaved qkv (gpt_neox), encoder (bert), encoder-decoder
# (t5), OPT. (falcon: torchao cannot run its FalconLinear, `x @ weight.T`, even unsharded; phi3: see the refusal)
FAMILIES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
            "qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM",
            "deepseek_v3": "DeepseekV3ForCausalLM", "granite": "GraniteForCausalLM", "gemma2": "Gemma2ForCausalLM",
            "gpt_neox": "GPTNeoXForCausalLM", "bert": "BertForMaskedLM", "t5": "T5ForConditionalGeneration",
            "opt": "OPTForCausalLM"}
EXACT = ("int8_weight_only", "float8_weight_only")
BOUND = 1e-5


def _index(ref: str, cls: str, ws: int) -> int:
    return next(i for i, v in enumerate(verify.resolve(ref).mapping.verify) if ws in v.world_sizes and cls in v.models)


def _cases():
    for ref, cls in FAMILIES.items():
        for scheme in EXACT:
            for ws in (2, 3, 4):
                default = ref == "llama" and ws == 2 and scheme == "int8_weight_only"
                yield pytest.param(ref, cls, scheme, ws, id=f"{ref}-{scheme}-ws{ws}",
                                   marks=() if default else pytest.mark.full)


@pytest.mark.parametrize("ref,cls,scheme,ws", _cases())
def test_weight_only_quantized_model_sharded_equals_the_unsharded_quantized_model(ranks, ref, cls, scheme, ws):
    for r in ranks(ws).run(torchao_cases.torchao_case, ref, _index(ref, cls, ws), cls, scheme):
        assert r["refused"] is None, r["refused"]
        assert r["quantized"] > 0 and r["split"] > 0 and r["still_quantized"] == r["quantized"], r
        assert r["shapes_ok"], r
        assert r["rel"] <= BOUND, r
        assert r["rank_bytes"] < r["full_bytes"], r  # each rank holds only its slices


@pytest.mark.full
@pytest.mark.parametrize("ws", [2, 3])
def test_per_group_weights_are_sliced_with_their_group_scales(ranks, ws):
    """Groups of 16 input features: every boundary of the llama config's Rows falls between groups at ws 2 and 3."""
    for r in ranks(ws).run(torchao_cases.torchao_case, "llama", _index("llama", "LlamaForCausalLM", ws),
                           "LlamaForCausalLM", "int8_weight_only_group16"):
        assert r["refused"] is None and r["shapes_ok"] and r["rel"] <= BOUND, r


def test_a_group_that_a_shard_boundary_would_cut_is_refused_with_the_world_sizes_that_work(ranks):
    """At ws 4 o_proj's 96 input features split into 24 per rank: groups of 16 straddle 24 and 72."""
    for r in ranks(4).run(torchao_cases.torchao_case, "llama", _index("llama", "LlamaForCausalLM", 4),
                          "LlamaForCausalLM", "int8_weight_only_group16"):
        message = r["refused"]
        assert message is not None and message.startswith("DivisibilityError"), r
        assert "o_proj.weight is quantized in blocks of 16 along dim 1" in message, message
        # 12 heads and 2 KV heads: ws in {1, 2, 4, 6, 12}; groups of 16 whole in o_proj's 96 / ws: {1, 2, 3, 6};
        # in down_proj's 192 / ws: {1, 2, 3, 4, 6, 12}
        assert "falls at 24" in message and "World sizes that work: 1, 2, 6;" in message, message


@pytest.mark.full
def test_dynamic_int8_activations_are_close_not_exact(ranks):
    """Per-token activation scales over a Row's local features: measured 3.2e-2 relative at ws 2 (llama config,
    std 0.2 init), bounded at 0.1 here; an exact scheme is 4 orders of magnitude closer."""
    for r in ranks(2).run(torchao_cases.torchao_case, "llama", _index("llama", "LlamaForCausalLM", 2),
                          "LlamaForCausalLM", "int8_dynamic_activation"):
        assert r["refused"] is None and r["shapes_ok"], r
        assert 1e-4 < r["rel"] <= 0.1, r


def test_a_quantized_tensor_whose_slice_its_type_cannot_make_is_refused_before_any_change(ranks):
    """phi3's fused qkv_proj is three sections, so each rank's rows are three pieces to concatenate, which torchao's
    Int8Tensor does not implement: refused, naming the tensor, before the model is touched (an uneven vocabulary's
    zero-padded head rows, new_zeros, are refused alike)."""
    for r in ranks(2).run(torchao_cases.torchao_case, "phi3", _index("phi3", "Phi3ForCausalLM", 2),
                          "Phi3ForCausalLM", "int8_weight_only"):
        message = r["refused"]
        assert message is not None and message.startswith("UnsupportedConfigError"), r
        assert "qkv_proj.weight is a quantized Int8Tensor" in message and "3 pieces on rank 0" in message, message
        assert r["untouched"], r
