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
import subprocess
import sys
from pathlib import Path

import compressed_cases
import pytest
import torch
from helpers import expert_bytes
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM

import tpmap
from tpmap.checkpoint.load import plan_checkpoint

pytest.importorskip("compressed_tensors")

# name: (model type, config); std 0.15 init
FAMILIES = {
    # GQA: 2 KV heads, replicated at world size 4
    "llama": ("llama", dict(hidden_size=128, intermediate_size=256, num_attention_heads=8, num_key_value_heads=2,
                            vocab_size=128)),
    # fused Columns: qkv_proj [q | k | v] in GQA sections and gate_up_proj [gate | up], each section split on its own
    # (a rank's rows of the data and scales in several pieces)
    "phi3": ("phi3", dict(hidden_size=128, intermediate_size=256, num_attention_heads=8, num_key_value_heads=4,
                          vocab_size=128, pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    # SmolLM2's 9 query / 3 KV heads (head_dim 16): an uneven split at 2 and 4 (KV heads held by two ranks) whose
    # boundaries fall on W4A16's groups of 16 (o_proj's input 80/64 at 2, 48/32/32/32 at 4)
    "llama-9q3kv": ("llama", dict(hidden_size=144, intermediate_size=320, num_attention_heads=9, num_key_value_heads=3,
                                  vocab_size=128)),
    # experts stored one Linear each, fused into 3-D experts by transformers' conversion (dequantized first)
    "mixtral": ("mixtral", dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                                num_local_experts=4, num_experts_per_tok=2, vocab_size=128)),
    # MLA: low-rank q / kv projections kept whole, their up-projections split by heads
    "deepseek_v3": ("deepseek_v3", dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=64,
                                        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32,
                                        kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=32,
                                        n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1,
                                        num_hidden_layers=2,
                                        n_group=1, topk_group=1, vocab_size=128)),
}


def save(folder: Path, family: str, preset: str, group_size: int | None = None,
         scale_dtype: torch.dtype = torch.float32) -> Path:
    model_type, config = FAMILIES[family]
    config = AutoConfig.for_model(model_type, **{"num_hidden_layers": 1, "max_position_embeddings": 64, **config})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.15)
    model.save_pretrained(folder)
    linears = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"}
    compressed_cases.compress(folder, preset, linears, group_size, scale_dtype)
    return folder


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


# preset: (group size, the largest relative difference of transformers' logits, which fake-quantize activations)
PRESETS = {"W4A16": (16, 1e-4), "W4A16_ASYM": (16, 1e-4), "W8A8": (None, 6e-2), "FP8_DYNAMIC": (None, 0.5)}
# transformers 5.24's own CPU load of int8 (int-quantized) experts fails in its MoE conversion ("Concatenate on tensors
# destined for model.layers.0.mlp.experts.gate_up_proj. Ckpt contains: 0": its experts' decompression handles packed
# and float8 weights only), so there is no reference: not run
NO_REFERENCE = {("W8A8", "mixtral"), ("W8A8", "deepseek_v3")}
# transformers 5.24 cannot load asymmetric packed weights either (its compressed layout expects the zero point
# unpacked, [out, groups], compressed-tensors 0.20.1 writes it packed along the rows: "size mismatch"), so these are
# checked against compressed-tensors' own decompression of the whole tensors
LIBRARY_REFERENCE = {"W4A16_ASYM"}


@pytest.mark.parametrize("world_size", [2, pytest.param(4, marks=pytest.mark.full)])
@pytest.mark.parametrize("family", [f if f == "llama" else pytest.param(f, marks=pytest.mark.full) for f in FAMILIES])
@pytest.mark.parametrize("preset", list(PRESETS))
def test_compressed_tensors_checkpoint_loads_dequantized(ranks, tmp_path, preset, family, world_size):
    if (preset, family) in NO_REFERENCE:
        pytest.skip("transformers' CPU load of int8-quantized experts fails: no reference")
    group_size, bound = PRESETS[preset]
    folder = save(tmp_path / preset, family, preset, group_size)
    library = preset in LIBRARY_REFERENCE
    results = ranks(world_size).run(compressed_cases.load_compressed, str(folder),
                                    str(tmp_path / "reference") if library else None)

    # every rank's tensors are transformers' own decompressed weights (or compressed-tensors'), sliced, bit for bit
    assert [r["differ"] for r in results] == [[]] * world_size
    assert not any(r["quantization_config"] for r in results)
    if library:
        plain = compressed_cases.library_dequantized(str(folder), str(tmp_path / "reference"))
    else:
        plain, hf_logits = compressed_cases.transformers_dequantized(str(folder))
    with torch.no_grad():
        dense = plain(compressed_cases.input_ids(plain.config.vocab_size)).logits
    to_dense = _relative(results[0]["logits"], dense)
    to_hf = None if library else _relative(results[0]["logits"], hf_logits)
    print(f"{preset} {family} ws={world_size}: logits vs the dequantized weights {to_dense:.1e}, "
          f"vs transformers' (activations fake-quantized for W8A8/FP8) {to_hf if to_hf is None else f'{to_hf:.1e}'}")
    assert to_dense < 1e-4 and (to_hf is None or to_hf < bound)
    # each rank read about its share of the file, not all of it
    file_bytes = (folder / "model.safetensors").stat().st_size
    print(f"  largest rank read {max(r['read'] for r in results) / file_bytes:.3f} of the file")
    assert max(r["read"] for r in results) < (0.7 if world_size == 2 else 0.5) * file_bytes


@pytest.mark.parametrize("world_size", [2, pytest.param(3, marks=pytest.mark.full)])
def test_compressed_experts_dealt_whole_read_only_their_experts(ranks, tmp_path, world_size):
    """experts='parallel' on a W4A16 Mixtral (int4 weights packed in int32, group scales; stored per expert, stacked
    by the conversion): each rank decompresses only its whole experts (4 at 3: 2/1/1), bit for bit transformers' own
    decompressed weights sharded the same way, and reads those experts' packed weights and scales alone."""
    group_size, _ = PRESETS["W4A16"]
    folder = save(tmp_path / "W4A16", "mixtral", "W4A16", group_size)
    results = ranks(world_size).run(compressed_cases.load_compressed, str(folder), None, "float32", "parallel")
    assert [r["differ"] for r in results] == [[]] * world_size
    plain, _ = compressed_cases.transformers_dequantized(str(folder))
    with torch.no_grad():
        dense = plain(compressed_cases.input_ids(plain.config.vocab_size)).logits
    assert _relative(results[0]["logits"], dense) < 1e-4
    experts = plain.model.layers[0].mlp.experts.gate_up_proj
    held = [r["numel"]["model.layers.0.mlp.experts.gate_up_proj"] // experts[0].numel() for r in results]
    assert held == ([2, 2] if world_size == 2 else [2, 1, 1]), held
    expert_sizes, other = expert_bytes(folder / "model.safetensors", 4)
    for r, n in zip(results, held):  # this rank's experts (packed weights and scales) and at most all the rest
        assert r["read"] <= n * max(expert_sizes) + other, (r["read"], n, expert_sizes, other)


@pytest.mark.parametrize(("family", "preset", "scales", "dtype"), [
    ("llama", "W8A8", "float32", "bfloat16"),
    ("llama", "W4A16", "bfloat16", "float32"),
    pytest.param("mixtral", "W4A16", "float32", "bfloat16", marks=pytest.mark.full),
    pytest.param("mixtral", "FP8_DYNAMIC", "bfloat16", "float32", marks=pytest.mark.full),
])
def test_scales_and_weights_in_transformers_dtypes(ranks, tmp_path, family, preset, scales, dtype):
    """Stored scales in one dtype, the model loaded in another: bit for bit transformers' decompressed weights. It
    loads a quantized Linear's scales into the module's parameters (the model's dtype) before decompressing, and
    decompresses converted experts in the stored dtypes, then casts: the first rounds a float32 scale to bfloat16."""
    folder = save(tmp_path / preset, family, preset, PRESETS[preset][0], getattr(torch, scales))
    results = ranks(2).run(compressed_cases.load_compressed, str(folder), None, dtype)
    assert [r["differ"] for r in results] == [[], []]


@pytest.mark.parametrize(("family", "config", "name", "boundary"), [
    # down_proj's 160 features split 80 / 80, a boundary inside the group [64, 96)
    ("llama", {"intermediate_size": 160}, "model.layers.0.mlp.down_proj.weight", 80),
    # the experts' down projections, converted from quantized per-expert weights: 96 features split 48 / 48
    ("mixtral", {"intermediate_size": 96}, "model.layers.0.mlp.experts.down_proj", 48),
])
def test_a_group_a_shard_boundary_would_cut_is_refused_with_the_world_sizes_that_work(ranks, tmp_path, family, config,
                                                                                       name, boundary):
    """W4A16 in groups of 32 input features, cut by the boundary at world size 2: refused on every rank before
    anything is read."""
    FAMILIES["cut"] = (FAMILIES[family][0], {**FAMILIES[family][1], **config})
    try:
        folder = save(tmp_path / "w4a16", "cut", "W4A16", 32)
    finally:
        del FAMILIES["cut"]
    messages = ranks(2).run(compressed_cases.load_refused, str(folder))
    assert messages[0] == messages[1]
    assert messages[0].startswith(f"DivisibilityError: {name} is stored quantized in groups of 32 input features"), \
        messages[0]
    assert f"at world size 2 a shard boundary falls at {boundary}" in messages[0]
    assert "World sizes that work: 1" in messages[0]
    # the same verdict from the folder alone, before any rank starts (tpmap.parallelize's driver asks it)
    with pytest.raises(tpmap.DivisibilityError) as e:
        plan_checkpoint(folder, 2)
    assert f"DivisibilityError: {e.value}" == messages[0]
    assert plan_checkpoint(folder, 1).tp_size == 1


@pytest.mark.parametrize(("preset", "data"), [("W8A8", "weight"), ("W4A16", "weight_packed")])
def test_a_quantized_tensor_without_its_scale_is_an_error_on_every_rank(ranks, tmp_path, preset, data):
    folder = save(tmp_path / preset, "llama", preset, PRESETS[preset][0])
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.0.mlp.up_proj.weight_scale"]
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    messages = ranks(2).run(compressed_cases.load_refused, str(folder))
    assert messages[0] == messages[1]
    assert f"CheckpointError: model.safetensors:model.layers.0.mlp.up_proj.{data} (" in messages[0], messages[0]
    assert "no model.layers.0.mlp.up_proj.weight_scale" in messages[0]


def _strategy_tensor(q):
    q["config_groups"]["group_0"]["weights"].update(strategy="tensor", group_size=None)


def _two_groups(q):
    q["config_groups"]["group_1"] = {**q["config_groups"]["group_0"], "targets": ["re:.*experts.*"]}


@pytest.mark.parametrize(("edit", "message"), [
    (_strategy_tensor, "with weight strategy"),
    (_two_groups, "with 2 config_groups (mixed schemes are not read yet)"),
    (lambda q: q.update(format="nvfp4-pack-quantized"), "with format 'nvfp4-pack-quantized'"),
    (lambda q: q.update(quantization_status="frozen"), "with quantization_status"),
    (lambda q: q.update(kv_cache_scheme={"num_bits": 8, "type": "float", "strategy": "tensor"}),
     "with a kv_cache_scheme"),
    (lambda q: q.update(transform_config={"config_groups": {"u": {}}}), "with a transform_config"),
    (lambda q: q.pop("config_groups"), "that compressed-tensors does not accept"),
])
def test_a_compressed_tensors_scheme_tpmap_does_not_read_is_refused_by_name(tmp_path, edit, message):
    folder = save(tmp_path / "w4a16", "llama", "W4A16", 32)
    raw = json.loads((folder / "config.json").read_text())
    edit(raw["quantization_config"])
    (folder / "config.json").write_text(json.dumps(raw))
    with pytest.raises(tpmap.QuantizedCheckpointError) as e:
        tpmap.from_pretrained(folder)
    assert "config.json declares quant_method 'compressed-tensors'" in str(e.value)
    assert message in str(e.value), str(e.value)


@pytest.mark.full  # (a fresh interpreter importing tpmap and transformers: seconds)
def test_import_tpmap_does_not_import_compressed_tensors():
    code = "import sys, tpmap, tpmap.checkpoint.load; print('compressed_tensors' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "False\n"


def test_a_quantized_tensor_stored_3d_is_refused_by_name(tmp_path):
    folder = save(tmp_path / "w8a8", "llama", "W8A8")
    tensors = load_file(folder / "model.safetensors")
    tensors["model.layers.0.mlp.experts.weight"] = torch.zeros(2, 32, 16, dtype=torch.int8)
    tensors["model.layers.0.mlp.experts.weight_scale"] = torch.ones(2, 32, 1)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(tpmap.QuantizedCheckpointError, match=r"model\.layers\.0\.mlp\.experts\.weight is a 3-D"):
        tpmap.from_pretrained(folder)


@pytest.mark.parametrize(("preset", "warns"), [("W8A8", "8-bit int activations"), ("FP8_DYNAMIC", "8-bit float"),
                                               ("W4A16", None)])
def test_dynamic_activation_quantization_is_named_in_a_warning(tmp_path, preset, warns):
    """tpmap does not quantize the activations a W8A8 / FP8-dynamic checkpoint quantizes on the fly: it says so at
    load (the logits differ from transformers' CPU load by that error), and stays silent where weights only are."""
    import warnings

    from tpmap.checkpoint.errors import UnquantizedActivationsWarning

    folder = save(tmp_path / preset, "llama", preset, 32 if preset == "W4A16" else None)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        tpmap.from_pretrained(folder)
    ours = [str(w.message) for w in seen if issubclass(w.category, UnquantizedActivationsWarning)]
    if warns is None:
        assert ours == []
    else:
        assert len(ours) == 1 and warns in ours[0] and "config.json quantizes each Linear's input" in ours[0], ours
