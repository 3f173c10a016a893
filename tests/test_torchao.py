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
from helpers import even_verify_index

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
    """The first verify config of `cls` at `ws` whose plan is even: quantized tensors refuse uneven plans (by
    design: tests/test_uneven.py proves the refusal); skipped where there is none."""
    index = even_verify_index(ref, cls, ws)
    if index is None:
        pytest.skip(f"{ref} has no verify config of {cls} that plans evenly at world size {ws}: quantized tensors "
                    "refuse uneven plans")
    return index


def _cases():
    for ref, cls in FAMILIES.items():
        for scheme in EXACT:
            for ws in (2, 3, 4):
                default = ref == "llama" and ws == 2 and scheme == "int8_weight_only"
                yield pytest.param(ref, cls, scheme, ws, id=f"{ref}-{scheme}-ws{ws}",
                                   marks=() if default else pytest.mark.full)


@pytest.mark.parametrize("ref,cls,scheme,ws", list(_cases()))
def test_weight_only_quantized_model_sharded_equals_the_unsharded_quantized_model(ranks, ref, cls, scheme, ws):
    for r in ranks(ws).run(torchao_cases.torchao_case, ref, _index(ref, cls, ws), cls, scheme):
        assert r["refused"] is None, r["refused"]
        assert r["quantized"] > 0 and r["split"] > 0 and r["still_quantized"] == r["quantized"], r
        assert r["shapes_ok"], r
        assert r["rel"] <= BOUND, r
        assert r["rank_bytes"] < r["full_bytes"], r  # each rank holds only its slices


# MoE experts' stacked weights ([E, out, in] Params, split by the mappings' Param entries) quantized by torchao too
# (float8 per row: torchao's Int8Tensor cannot run them even unsharded, no transpose; gpt_oss indexes its experts'
# weights, which Float8Tensor does not implement, unsharded alike).
EXPERTS = {"qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM",
           "olmoe": "OlmoeForCausalLM"}


@pytest.mark.full
@pytest.mark.parametrize("ref,cls,ws", [(r, c, ws) for r, c in EXPERTS.items() for ws in (2, 3, 4)])
def test_quantized_expert_weights_are_sliced_with_their_scales(ranks, ref, cls, ws):
    """gate_up [E, 2I, H] split in its [gate | up] sections along dim 1 (two pieces a rank), down [E, H, I] along
    its input dim 2 (per-row scales [E, H] kept whole): exact against the unsharded quantized model."""
    for r in ranks(ws).run(torchao_cases.torchao_case, ref, _index(ref, cls, ws), cls, "float8_weight_only+experts"):
        assert r["refused"] is None, r["refused"]
        assert r["experts"] > 0 and r["still_quantized"] == r["quantized"] and r["shapes_ok"], r
        assert r["rel"] <= BOUND, r
        assert r["rank_bytes"] < r["full_bytes"], r


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


# tpmap.from_pretrained(folder, quantization_config=TorchAoConfig(...)): each rank quantizes its slices after reading
# them. Reference: transformers' own from_pretrained with the same config (the whole weights quantized), in the same
# run. phi3 is here too: its fused qkv_proj, refused above for a model quantized before sharding, is quantized after.
LOAD_FAMILIES = {"llama": "LlamaForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                 "deepseek_v3": "DeepseekV3ForCausalLM", "phi3": "Phi3ForCausalLM", "gpt_neox": "GPTNeoXForCausalLM",
                 "bert": "BertForMaskedLM", "mistral": "MistralForCausalLM", "gemma2": "Gemma2ForCausalLM",
                 "granite": "GraniteForCausalLM", "opt": "OPTForCausalLM"}


def _saved(tmp_path, ref: str, cls: str, ws: int) -> str:
    folder = tmp_path / ref
    verify.build_model(ref, _index(ref, cls, ws), cls).save_pretrained(folder)
    return str(folder)


def _load_cases():
    """int8 per row at ws 2, 3 and 4 for every family; float8 per row and int8 per tensor (one scale for the whole
    weight, a Column's too) at ws 4 for four."""
    for ref, cls in LOAD_FAMILIES.items():
        for scheme in ("int8_weight_only", "float8_weight_only", "int8_per_tensor"):
            for ws in (2, 3, 4) if scheme == "int8_weight_only" else (4,) if ref in (
                    "llama", "qwen3_moe", "deepseek_v3", "phi3") else ():
                default = ref == "llama" and ws == 2 and scheme == "int8_weight_only"
                yield pytest.param(ref, cls, scheme, ws, id=f"{ref}-{scheme}-ws{ws}",
                                   marks=() if default else pytest.mark.full)


@pytest.mark.parametrize("ref,cls,scheme,ws", list(_load_cases()))
def test_from_pretrained_quantizes_each_ranks_slices_as_transformers_quantizes_the_whole(ranks, tmp_path, ref, cls,
                                                                                          scheme, ws):
    """Every quantized tensor a rank holds, dequantized, is bit for bit the independent reference's slice of the
    weight transformers quantized whole: a Row's per-row scales and a per-tensor scale come from the whole weight's
    range, not the slice's (planted: quantizing the slice as it is -> the Rows' o_proj / down_proj differ, 1.8e-2
    relative in the logits at ws 2)."""
    folder = _saved(tmp_path, ref, cls, ws)
    for r in ranks(ws).run(torchao_cases.from_pretrained_case, folder, cls, scheme, "float32"):
        assert r["quantized"] > 0 and r["split"] > 0, r
        assert r["differ"] == [], r
        assert r["rel"] <= BOUND, r
        assert r["config"] == "TorchAoConfig", r  # model.config.quantization_config, as transformers sets it
        assert r["rank_bytes"] < r["full_bytes"], r


def test_from_pretrained_refuses_groups_a_shard_boundary_would_cut_before_reading(ranks, tmp_path):
    """Groups of 16: o_proj's 96 input features split into 24 per rank at ws 4. Refused on every rank alike, with
    the world sizes that work, before a byte of the weights is read."""
    folder = _saved(tmp_path, "llama", "LlamaForCausalLM", 4)
    for r in ranks(4).run(torchao_cases.from_pretrained_refused, folder, "LlamaForCausalLM",
                          "int8_weight_only_group16"):
        message = r["refused"]
        assert message is not None and message.startswith("DivisibilityError"), r
        assert "o_proj.weight would be quantized in groups of 16 input features" in message, message
        assert "falls at 24" in message and "World sizes that work: 1, 2, 6;" in message, message
        assert r["read"] == 0, r


@pytest.mark.full
def test_from_pretrained_with_groups_between_the_boundaries_is_exact(ranks, tmp_path):
    folder = _saved(tmp_path, "llama", "LlamaForCausalLM", 2)
    for r in ranks(2).run(torchao_cases.from_pretrained_case, folder, "LlamaForCausalLM", "int8_weight_only_group16",
                          "float32"):
        assert r["differ"] == [] and r["rel"] <= BOUND and r["split"] > 0, r


@pytest.mark.parametrize("config", [{"quant_method": "awq", "bits": 4}, "FineGrainedFP8Config"])
def test_from_pretrained_refuses_every_quantization_config_but_torchao_by_name(tmp_path, config):
    import transformers

    import tpmap

    folder = _saved(tmp_path, "llama", "LlamaForCausalLM", 2)
    config = getattr(transformers, config)() if isinstance(config, str) else config
    with pytest.raises(tpmap.UnsupportedConfigError, match="torchao only") as e:
        tpmap.from_pretrained(folder, world_size=1, quantization_config=config)
    assert ("'awq'" in str(e.value)) if isinstance(config, dict) else ("FineGrainedFP8Config" in str(e.value))


@pytest.mark.full
@pytest.mark.parametrize("ws", [2, 3])
def test_int4_per_group_on_cpu_loads_exact_and_shards_exact(ranks, tmp_path, ws):
    """torchao's int4 weight-only that runs on CPU (IntxWeightOnlyConfig(weight_dtype=torch.int4), groups of 16):
    from_pretrained quantizes the slices with their groups' scales, bit for bit transformers' whole quantization
    sliced; and a model quantized so before tpmap.apply is sliced exactly. (Int4WeightOnlyConfig needs mslk or a
    GPU.)"""
    folder = _saved(tmp_path, "llama", "LlamaForCausalLM", ws)
    for r in ranks(ws).run(torchao_cases.from_pretrained_case, folder, "LlamaForCausalLM", "int4_group16", "float32"):
        assert r["differ"] == [] and r["rel"] <= BOUND and r["split"] > 0, r
    for r in ranks(ws).run(torchao_cases.torchao_case, "llama", _index("llama", "LlamaForCausalLM", ws),
                           "LlamaForCausalLM", "int4_group16"):
        assert r["refused"] is None and r["shapes_ok"] and r["rel"] <= BOUND, r


def test_int4_per_row_scales_a_row_split_cannot_keep_are_refused_on_both_routes(ranks, tmp_path):
    """int4 per row (IntxUnpackedToInt8Tensor) cannot be sliced inside its row blocks: a Row's weight is refused by
    name on both routes before anything changes, saying to quantize per group instead."""
    folder = _saved(tmp_path, "llama", "LlamaForCausalLM", 2)
    for r in ranks(2).run(torchao_cases.from_pretrained_refused, folder, "LlamaForCausalLM", "int4_per_row"):
        message = r["refused"]
        assert message is not None and message.startswith("UnsupportedConfigError"), r
        assert "o_proj.weight's scales span the ranks" in message and "per group" in message, message
        assert r["read"] == 0, r
    for r in ranks(2).run(torchao_cases.torchao_case, "llama", _index("llama", "LlamaForCausalLM", 2),
                          "LlamaForCausalLM", "int4_per_row"):
        message = r["refused"]
        assert message is not None and message.startswith("UnsupportedConfigError"), r
        assert "o_proj.weight is a quantized IntxUnpackedToInt8Tensor" in message and r["untouched"], r
