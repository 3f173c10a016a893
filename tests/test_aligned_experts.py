"""Stacked experts split in aligned units: transformers' grouped expert matmul (torch._grouped_mm, the default
`experts_implementation` of Mixtral-style [E, 2I, H] / [E, H, I] experts) needs 16-byte-aligned strides, so each
rank's share of the intermediate width I must be a multiple of 16 bytes (4 fp32 elements). A Mixtral with I=100
runs unsharded, but 50 columns per rank at world size 2 (200 bytes) raised "strides should be multiple of 16
bytes" in its first forward; the engine now deals out units of 16 bytes (52/48 at 2, 28/24/24/24 at 4).

The rule (engine.pieces.aligned) against the independent slicing reference; the plans (widths, the per-rank
intermediate_dim, the refusals); a Mixtral with I=100 exact at world sizes 2, 3 and 4 against the unsharded model
in the same run (fp32 forward and gradients through grouped_mm, fp64 gradients through the eager experts, which
have no fp64 grouped kernel), and its from_pretrained / save_pretrained round trip bit for bit; a Qwen3-MoE alike;
from_pretrained planning in the dtype it loads (bf16: units of 8) and a bf16 Mixtral through grouped_mm at 56/48."""
from __future__ import annotations

import pytest
import rank_cases
import slicing_reference
import torch
import transformers
from helpers import mapping_text, verify_index, write_mapping
from test_uneven import _assert_exact

import tpmap
from tpmap import verify
from tpmap.checkpoint.load import plan_checkpoint
from tpmap.engine import pieces
from tpmap.errors import DivisibilityError

MIXTRAL_I100 = ("  - name: moe-i100               # I=100: 25 units of 4 fp32 elements, uneven at 2, 3 and 4\n"
                "    config: {hidden_size: 96, num_attention_heads: 12, num_key_value_heads: 2,\n"
                "             intermediate_size: 100, num_hidden_layers: 2, vocab_size: 256,\n"
                "             max_position_embeddings: 64, num_local_experts: 4,\n"
                "             num_experts_per_tok: 2}\n"
                "    models: [MixtralForCausalLM]\n"
                "    world_sizes: [1, 2, 3, 4]\n")
CLASS = "MixtralForCausalLM"


def _case(tmp_path) -> tuple[str, int]:
    path = write_mapping(tmp_path, "mixtral", mapping_text("mixtral").rstrip("\n") + "\n" + MIXTRAL_I100)
    return str(path), len(verify.resolve(str(path)).mapping.verify) - 1


def _meta_mixtral(intermediate_size: int, dtype=torch.float32, **config):
    config = transformers.MixtralConfig(**{**dict(hidden_size=96, num_attention_heads=12, num_key_value_heads=2,
                                                  num_hidden_layers=1, vocab_size=256, num_local_experts=4,
                                                  num_experts_per_tok=2), **config},
                                        intermediate_size=intermediate_size)
    with torch.device("meta"):
        return transformers.MixtralForCausalLM(config).to(dtype)


# -- the rule --------------------------------------------------------------------------------------------
def _widths(size: int, element_size: int, ws: int, sections: int = 1) -> list[list[int]]:
    def fail(message, key):
        return ValueError(message)
    split, _ = pieces.split_sections([pieces.aligned((size, None), element_size)] * sections, ws, True, fail,
                                     lambda k: (), allow_uneven=True)
    return [[n for _, n in p] for p in split]


def test_aligned_units_are_balanced_and_divisible_widths_split_as_before():
    assert _widths(100, 4, 2) == [[52], [48]]  # 25 units of 4 fp32 elements: 13 and 12 units
    assert _widths(100, 4, 4) == [[28], [24], [24], [24]]
    assert _widths(100, 4, 3, sections=2) == [[36, 36], [32, 32], [32, 32]]  # [gate | up]: each section alike
    assert _widths(96, 2, 8) == [[16]] * 4 + [[8]] * 4  # bf16: units of 8 elements (12 units over 8 ranks)
    assert _widths(96, 4, 8) == [[12]] * 8  # aligned and divisible: the balanced split, unchanged
    assert _widths(99, 4, 3) == [[33]] * 3  # the full width itself is not aligned: elements, as before
    assert pieces.uneven_at(pieces.aligned((100, None), 4), 2, True)  # even in elements, uneven in units
    assert not pieces.uneven_at(pieces.aligned((96, None), 4), 2, True)
    with pytest.raises(ValueError, match=r"2 units, fewer than the 4 ranks.*world sizes that work: 1, 2"):
        _widths(8, 4, 4)


@pytest.mark.parametrize("size,element_size,tp", [(100, 4, 2), (100, 4, 3), (100, 4, 4), (96, 2, 8), (96, 4, 8),
                                                  (200, 8, 3), (99, 4, 3), (40, 4, 7)])
def test_aligned_pieces_equal_the_independent_reference(size, element_size, tp):
    ws = tp
    sections = [pieces.aligned((size, None), element_size)] * 2
    split, _ = pieces.split_sections(sections, ws, True, lambda m, k: ValueError(m), lambda k: (), True)
    layout = slicing_reference.Layout(2 * size, ((size, None, None),) * 2, align=16 // element_size)
    for r in range(ws):
        assert [i for s, n in split[r] for i in range(s, s + n)] == slicing_reference.held(layout, ws, r)
        assert all(n * element_size % 16 == 0 for _, n in split[r]) or size * element_size % 16


# -- the plan --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("tp,widths", [(2, (52, 48)), (3, (36, 32, 32)), (4, (28, 24, 24, 24))])
def test_the_plan_of_a_mixtral_with_an_intermediate_width_of_100(tp, widths):  # (no ranks: every size)
    ws = tp
    plan = tpmap.plan(_meta_mixtral(100), ws)
    down = plan.params["model.layers.0.mlp.experts.down_proj"]
    gate_up = plan.params["model.layers.0.mlp.experts.gate_up_proj"]
    assert tuple(down.local_shape(r)[2] for r in range(ws)) == widths
    assert tuple(gate_up.local_shape(r)[1] for r in range(ws)) == tuple(2 * w for w in widths)
    assert next(u.values for u in plan.updates if u.attribute == "intermediate_dim") == widths
    assert down.name in plan.uneven


def test_bf16_experts_are_aligned_in_units_of_8():
    plan = tpmap.plan(_meta_mixtral(96, torch.bfloat16), 8)
    down = plan.params["model.layers.0.mlp.experts.down_proj"]
    assert [down.local_shape(r)[2] for r in range(8)] == [16] * 4 + [8] * 4  # not 12 each (24 bytes)


def test_widths_that_cannot_be_aligned_are_refused_naming_the_world_sizes_that_work():
    with pytest.raises(DivisibilityError,
                       match=r"8 features split in units of 4 elements .* world sizes that work: 1, 2"):
        tpmap.plan(_meta_mixtral(8), 4)
    with pytest.raises(tpmap.errors.UnevenSplitError, match="gate_up_proj: world size 2 splits it unevenly"):
        tpmap.plan(_meta_mixtral(99), 2)  # unaligned unsharded too: only world sizes that divide 99


# -- on real ranks ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("ws", [2, 3, 4])
def test_mixtral_with_an_intermediate_width_of_100_is_exact(ranks, tmp_path, ws):
    """ws 2 and 4 split I unevenly in units only; ws 3 also its 2 KV heads, and divides none of its 4 experts'
    widths (fp32 forward and gradients through grouped_mm, fp64 gradients through the eager experts)."""
    ref, index = _case(tmp_path)
    per_rank = ranks(ws).run(rank_cases.prove_case, ref, index, CLASS, True, ws == 2)
    _assert_exact(ref, index, CLASS, ws, per_rank, generate=ws == 2)


def test_aligned_mixtral_round_trips_checkpoints_bit_for_bit(ranks, tmp_path):
    import uneven_cases
    ref, index = _case(tmp_path)
    per_rank = ranks(2).run(uneven_cases.round_trip, ref, index, CLASS, str(tmp_path / "ckpt"))
    for r in per_rank:
        assert "model.layers.0.mlp.experts.down_proj" in r["uneven"] and r["loaded_wrong"] == [], r
    assert per_rank[0]["tensors"] and per_rank[0]["saved_keys_differ"] == [] and per_rank[0]["saved_wrong"] == []


QWEN3_MOE_I100 = ("  - name: moe-i100\n"
                  "    config: {hidden_size: 96, num_attention_heads: 12, num_key_value_heads: 2, head_dim: 8,\n"
                  "             moe_intermediate_size: 100, intermediate_size: 96, num_hidden_layers: 2,\n"
                  "             vocab_size: 256,\n"
                  "             max_position_embeddings: 64, num_experts: 4, num_experts_per_tok: 2}\n"
                  "    models: [Qwen3MoeForCausalLM]\n"
                  "    world_sizes: [1, 2, 3]\n")


@pytest.mark.parametrize("ws", [2, 3])
def test_qwen3_moe_with_an_expert_width_of_100_is_exact(ranks, tmp_path, ws):
    """Qwen3-MoE's experts alike (moe_intermediate_size 100); at 3 also its 2 KV heads, with per-head q/k norms."""
    path = write_mapping(tmp_path, "qwen3_moe", mapping_text("qwen3_moe").rstrip("\n") + "\n" + QWEN3_MOE_I100)
    ref, index = str(path), len(verify.resolve(str(path)).mapping.verify) - 1
    per_rank = ranks(ws).run(rank_cases.prove_case, ref, index, "Qwen3MoeForCausalLM", True, False)
    _assert_exact(ref, index, "Qwen3MoeForCausalLM", ws, per_rank, generate=False)


MIXTRAL_I104 = MIXTRAL_I100.replace("moe-i100", "moe-i104").replace("intermediate_size: 100", "intermediate_size: 104")


def test_from_pretrained_plans_in_the_dtype_it_loads(tmp_path):
    """The units follow the dtype the checkpoint is loaded in: 104 features are 26 fp32 units (52/52 at 2) but
    13 bf16 units (56/48 at 2; 52 bf16 elements are 104 bytes, unaligned)."""
    path = write_mapping(tmp_path, "mixtral", mapping_text("mixtral").rstrip("\n") + "\n" + MIXTRAL_I104)
    ref, index = str(path), len(verify.resolve(str(path)).mapping.verify) - 1
    verify.build_model(ref, index, CLASS).save_pretrained(tmp_path / "hf")
    for dtype, widths in ((torch.float32, (52, 52)), (torch.bfloat16, (56, 48))):
        plan = plan_checkpoint(str(tmp_path / "hf"), 2, dtype=dtype, mapping=verify.resolve(ref))
        down = plan.params["model.layers.0.mlp.experts.down_proj"]
        assert tuple(down.local_shape(r)[2] for r in range(2)) == widths, dtype


def test_a_bf16_mixtral_runs_grouped_mm_at_an_aligned_uneven_split(ranks, tmp_path):
    import aligned_experts_cases
    path = write_mapping(tmp_path, "mixtral", mapping_text("mixtral").rstrip("\n") + "\n" + MIXTRAL_I104)
    ref, index = str(path), len(verify.resolve(str(path)).mapping.verify) - 1
    per_rank = ranks(2).run(aligned_experts_cases.bf16_forward, ref, index, CLASS, str(tmp_path / "hf"))
    assert [r["width"] for r in per_rank] == [56, 48] and per_rank[0]["dtype"] == "torch.bfloat16", per_rank
    for r in per_rank:  # bf16 rounds differently by CPU (AVX512-BF16 or AMX kernels): both bf16 models against fp32
        assert r["implementation"] == "grouped_mm" and r["unsharded_vs_fp32"] <= 0.1 * r["scale"], r
        assert r["sharded_vs_fp32"] <= 1.5 * r["unsharded_vs_fp32"], r  # sharded: as close as unsharded bf16


# -- interleaved sections with biases (gpt-oss) ------------------------------------------------------------
def _gpt_oss_uneven() -> tuple[str, int]:
    return "gpt_oss", verify_index("gpt_oss", "uneven")


def test_gpt_oss_keeps_whole_pairs_and_splits_its_bias_like_its_weight():
    """gate_up_proj [E, H, 2I] interleaves gate and up ([g0 u0 g1 u1 ...]): each rank holds whole pairs, in the
    grouped matmul's units (I = 40: 10 units of 4 fp32 pairs, 4/3/3 at 3 ranks), and gate_up_proj_bias [E, 2I]
    (2-D, never aligned on its own) the same columns; down_proj's I matches the pairs."""
    ref, index = _gpt_oss_uneven()
    model = verify.build_model(ref, index, "GptOssForCausalLM")
    plan = tpmap.plan(model, 3)
    experts = "model.layers.0.mlp.experts"
    up, bias, down = (plan.params[f"{experts}.{n}"] for n in ("gate_up_proj", "gate_up_proj_bias", "down_proj"))
    assert [up.indices(r) for r in range(3)] == [bias.indices(r) for r in range(3)]
    assert [up.indices(r) for r in range(3)] == [list(range(32)), list(range(32, 56)), list(range(56, 80))]
    assert [down.indices(r) for r in range(3)] == [list(range(16)), list(range(16, 28)), list(range(28, 40))]
    assert next(u.values for u in plan.updates if u.attribute == "intermediate_size") == (16, 12, 12)


def test_gpt_oss_with_interleaved_pairs_split_unevenly_is_exact(ranks):
    """Forward and every fp64 gradient at 3 ranks against the unsharded model (planted: the bias split by elements,
    28/26/26 beside a weight of 32/24/24, fails its forward; the sections read one after the other, not
    interleaved, is O(1) off)."""
    ref, index = _gpt_oss_uneven()
    per_rank = ranks(3).run(rank_cases.prove_case, ref, index, "GptOssForCausalLM", True, False)
    _assert_exact(ref, index, "GptOssForCausalLM", 3, per_rank, generate=False)
