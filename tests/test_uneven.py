"""Uneven world sizes: heads and features split as evenly as possible (engine.pieces, expr.rank_heads).

A 9-query-head / 3-KV-head Llama (SmolLM2's shape) at world sizes 2 and 4 and a 12-head BERT at 5 are exact
against the unsharded model in the same run: forward, every gradient in fp32 and fp64 per shard (against
tests/slicing_reference.py's slices, which decide element by element), greedy generate, and the
from_pretrained / save_pretrained round trip bit for bit. At 3 ranks, OLMo2's Norm entries over unevenly held KV
heads and Mamba-2's Param entries over unevenly dealt groups are exact the same way. Plans at world sizes that
split evenly are those of main before uneven splits existed (tests/plan_digests.json). Paths not proven uneven
are refused."""
from __future__ import annotations

import json

import plan_digests
import pytest
import rank_cases
import slicing_reference
import torch
import transformers
from helpers import edited, mapping_text, not_proven_uneven, verify_index, write_mapping

import tpmap
from tpmap import verify
from tpmap.errors import UnevenSplitError
from tpmap.language import expr
from tpmap.language.source import load_text

LLAMA_9_3 = ("  - name: smollm-9q3kv           # SmolLM2's 9 query / 3 KV heads: uneven at 2 and 4\n"
             "    config: {hidden_size: 72, num_attention_heads: 9, num_key_value_heads: 3, intermediate_size: 99,\n"
             "             num_hidden_layers: 2, vocab_size: 250, max_position_embeddings: 64}\n"
             "    models: [LlamaForCausalLM]\n"
             "    world_sizes: [1, 2, 3, 4]\n")
BERT_12_AT_5 = ("  - name: mha12-ws5\n"
                "    config: {hidden_size: 96, num_attention_heads: 12, intermediate_size: 192, num_hidden_layers: 2,\n"
                "             vocab_size: 250, max_position_embeddings: 64}\n"
                "    models: [BertForMaskedLM]\n"
                "    world_sizes: [5]\n")
GRAD_RTOL = {"grad_fp32": 1e-4, "grad_fp64": 2e-6}


def _with_case(tmp_path, model_type: str, case: str) -> tuple[str, int]:
    """The shipped mapping plus one verify config (its index) written to tmp_path."""
    path = write_mapping(tmp_path, model_type, mapping_text(model_type).rstrip("\n") + "\n" + case)
    return str(path), len(verify.resolve(str(path)).mapping.verify) - 1


# -- the rule -------------------------------------------------------------------------------------------
def test_rank_heads_balanced_and_kv_heads_follow_their_query_heads():
    assert [expr.rank_heads(9, 2, r) for r in range(2)] == [[0, 1, 2, 3, 4], [5, 6, 7, 8]]
    assert [expr.rank_heads(3, 2, r, query=9) for r in range(2)] == [[0, 0, 0, 1, 1], [1, 2, 2, 2]]
    assert [expr.rank_heads(3, 4, r, query=9) for r in range(4)] == [[0], [1], [1, 2], [2]]
    assert [expr.rank_heads(2, 4, r, query=12) for r in range(4)] == [[0], [0], [1], [1]]  # vLLM's rule
    assert expr.rank_heads(12, 13, 0) is None  # a rank would hold no head
    lookup = {"h": 9, "kv": 3}.__getitem__
    groups = [expr.evaluate("per_rank(h) // per_rank(kv, h)", lookup, 4, r, uneven=True) for r in range(4)]
    assert groups == [3, 2, 1, 2]  # each rank's query heads = repeat_kv(its KV heads, groups)
    with pytest.raises(tpmap.DivisibilityError, match="9 heads cannot be spread over world size 4"):
        expr.evaluate("per_rank(h)", lookup, 4, 0)  # a plan split evenly: the even rule only


@pytest.mark.parametrize("heads,query,ws", [(9, None, 2), (9, None, 4), (3, 9, 2), (3, 9, 4), (12, None, 5),
                                            (2, 12, 5), (4, 12, 8), (6, 6, 4), (None, None, 3)])
def test_pieces_equal_the_independent_reference(heads, query, ws):
    """engine.pieces against tests/slicing_reference.py, which decides owners element by element."""
    from tpmap.engine import pieces
    size = 8 * (heads or 13)
    got, _ = pieces.split_sections([(size, heads, query)], ws, True, lambda m, k: AssertionError(m),
                                   lambda k: (), allow_uneven=True)
    layout = slicing_reference.Layout(size, ((size, heads, query),))
    for r in range(ws):
        assert [i for s, n in got[r] for i in range(s, s + n)] == slicing_reference.held(layout, ws, r), r


# -- divisible plans are main's ----------------------------------------------------------------------------
def _stored_cases(every: bool):
    from conftest import REPRESENTATIVE
    stored = json.loads(plan_digests.STORED.read_text())
    return [(key, path, index, cls, stored[key]) for key, path, index, cls in plan_digests.cases()
            if (every or key.split("/")[0] in REPRESENTATIVE) and key in stored]  # (configs added since: no main)


def _planned(digest: str) -> bool:
    """A digest of an even plan (16 hex digits), not an error's class name nor an uneven plan's "uneven:..."."""
    return len(digest) == 16 and all(c in "0123456789abcdef" for c in digest)


# Two entries of plan_digests.json were stored again from today's planner, on purpose: gemma4_text/moe-keqv-shared and
# gemma4_unified_text/keqv-shared. k_eq_v's k/v were split contiguously, without heads, and num_key_value_groups left
# whole (right only where the world size divides every layer's KV heads; ws 3 was accepted and crashed): now by each
# layer's own KV heads (per_layer_config) with num_key_value_groups updated: the same pieces at 2 and 4 plus the
# Update; at 8 the global layers' 4 KV heads are held whole by the ranks whose query heads use them (main's plan cut
# each in half). Their verify configs prove them at every size they list.
# The three t5gemma entries too: its q/k/v were plain feature splits (no dotted names then to read each stack's head
# counts), right only where the world size divides both stacks' KV heads. Now split by heads with query_heads and a
# num_key_value_groups Update per stack: at 2 and 4 (gqa-kv4) and 3 and 6 (gqa-kv6) the same pieces plus an Update to
# the unchanged value; where main's plan cut a head in half (gqa-kv4 at 8, gqa-kv6 at 2, 4 and 8: the decoder's 3 KV
# heads of 16) it failed in the forward's view, and now holds whole heads or refuses more ranks than query heads.
# The eight nemotron_h and nemo_speechlm entries at 2, 3 and 4 (hybrid4, hybrid3, no-mlp; hybrid-chunks,
# hybrid3-chunks): the same pieces plus a num_key_value_groups Update of NemotronHAttention to its unchanged value
# (q / kv): repeat_kv reads it, and at an uneven size each rank needs its own (hybrid4 at 3: 1/2/1). Without that
# Update the plans equal main's (checked by removing it).
# The three laguna entries (kv4 at 2 and 4, kv3-fullgate at 3): the same pieces; its Updates now set num_heads and
# num_key_value_groups per layer (at_layer: its query-head count is a per-layer list) to their unchanged values, and
# no longer set config.num_key_value_heads (one config object shared by every layer holds one value; unread). Its
# kv3-fullgate at 6 is planned where main refused it (3 // 6): each KV head held by two ranks; not verified at 6.
# The thirty inkling entries (inkling_text, inkling2_text, inkling2_loop_text and the two mappings composing them):
# their attention entries now come once per layer kind (when_layer on layer_types, each kind split by its own heads),
# so at 2, 3 and 4 the same pieces come in another order, plus a num_key_value_groups Update to its unchanged value.
# inkling_text's kv3-swa6 at 2 and 4 is uneven now, where main's plain splits cut a KV head in half (the forward
# failed); kv3-swa6 at 6 is served where main refused it (3 // 6): each full layer's KV head held by two ranks,
# verified at 6 by the configs that list it (inkling2_loop's does not: 1.04e-5 against the 1e-5 bound, unproven).
# stablelm/qkln-kv3 at 6 is planned where main refused it (3 // 6): each KV head's per-head norm (a ModuleList item)
# held by two ranks, its gradient summed over them; checked once at 6 (prove_case: forward, fp32 and fp64 gradients
# of every rank within the harness bounds), not in CI.


def _same_as_main(cases) -> None:
    """Every plan main made is made alike; a world size main refused is refused still, or planned uneven."""
    changed, accepted = [], []
    for key, path, index, cls, want in cases:
        got = plan_digests.plans(path, index, cls)
        changed += [(key, ws) for ws, digest in want.items() if _planned(digest) and got[int(ws)] != digest]
        accepted += [(key, ws) for ws, digest in want.items() if not _planned(digest) and _planned(got[int(ws)])]
    assert not changed, changed
    assert not accepted, ("accepted at an even split though main refused it", accepted)


def test_divisible_plans_of_representative_families_are_mains():
    _same_as_main(_stored_cases(False))


@pytest.mark.full  # every shipped mapping's verify configs, world sizes 2..8: ~1.5 minutes of planning
def test_divisible_plans_of_every_shipped_mapping_are_mains():
    _same_as_main(_stored_cases(True))


# Mappings whose `uneven: true` a dedicated test proves instead of one of their own verify configs
PROVEN_ELSEWHERE = {"bert": "test_bert_with_12_heads_is_exact_at_world_size_5 here",
                    "mixtral": "tests/test_aligned_experts.py (I=100 at 2, 3, 4)",
                    "qwen3_moe": "tests/test_aligned_experts.py (moe_intermediate_size 100 at 2, 3)"}


@pytest.mark.full  # the plans of test_divisible_plans_of_every_shipped_mapping_are_mains, cached
def test_every_mapping_that_says_uneven_verifies_a_config_that_splits_unevenly():
    """`uneven: true` claims exactness where heads or widths split unevenly: one of the mapping's verify configs
    must plan unevenly at a world size it lists, so that tpmap verify and tests/test_mappings.py run its per_rank
    Updates on real ranks; a mapping verified only at even splits never ran them."""
    from tpmap.language.source import read_file

    by_path: dict = {}
    for _key, path, index, cls in plan_digests.cases():
        by_path.setdefault(path, []).append((index, cls))
    unproven = []
    for path, cases in by_path.items():
        mapping = read_file(path).mapping
        if not mapping.uneven or path.stem in PROVEN_ELSEWHERE:
            continue
        if not any(plan_digests.plans(path, index, cls)[ws].startswith("uneven:") for index, cls in cases
                   for ws in mapping.verify[index].world_sizes if ws in plan_digests.WORLD_SIZES):
            unproven.append(path.stem)
    assert not unproven, f"uneven: true, but every verify config splits evenly: {unproven}"


# -- refusals -----------------------------------------------------------------------------------------------
def _meta_llama(**config):
    base = dict(hidden_size=72, num_attention_heads=9, num_key_value_heads=3, intermediate_size=99,
                num_hidden_layers=1, vocab_size=250)
    with torch.device("meta"):
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**base, **config}))


def test_a_mapping_not_proven_uneven_is_refused_at_an_uneven_world_size(tmp_path):
    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(verify.tiny_config("gpt2"))
    unproven = str(not_proven_uneven(tmp_path, "gpt2"))  # gpt2's mapping without its `uneven: true`
    with pytest.raises(UnevenSplitError, match=r"not proven at uneven world sizes \(no `uneven: true`\); world "
                       "sizes that split this model evenly: 1, 2, 3, 4, 6, 12"):
        tpmap.plan(model, 5, mapping=unproven)
    assert tpmap.plan(model, 5).uneven  # the shipped mapping is proven (its uneven3 config)


def test_a_param_whose_heads_must_not_be_shared_is_refused_naming_sizes_that_work():
    """A Param entry with `replicate_heads: false` (StableLM-2's per-KV-head norms, edited so) refuses a world size
    where two ranks' query heads read one KV head: 12 query / 4 KV heads at 3 ranks (4/4/4 query heads) would put
    KV heads 1 and 2 on two ranks each. The world sizes offered are those the same rule accepts. The shipped
    mapping (replicate_heads true) accepts 3: the shared norms sum their gradients (test below)."""
    norms = "    heads: num_key_value_heads\n    query_heads: num_attention_heads\n"
    gate = "  - kind: Column\n    module: layers.*.mlp.gate_proj"
    text = edited("stablelm", norms + gate, norms + "    replicate_heads: false\n" + gate)
    with torch.device("meta"):
        model = transformers.StableLmForCausalLM(verify.tiny_config("stablelm"))
    for ws in (3, 5):
        with pytest.raises(tpmap.DivisibilityError, match=r"k_layernorm\.norms: 4 heads cannot be split over world "
                           rf"size {ws} \(ranks whose query heads share a head would both hold it, and a Row's "
                           r"input or a Param with replicate_heads: false cannot\); world sizes that work: 1, 2, 4$"):
            tpmap.plan(model, ws, mapping=load_text(text, "<stablelm>"))
    tpmap.plan(model, 4, mapping=load_text(text, "<stablelm>"))
    assert tpmap.plan(model, 3).uneven


def test_an_update_that_reads_tp_size_is_refused_at_an_uneven_world_size():
    text = edited("bert", "num_attention_heads: per_rank(num_attention_heads)", "num_attention_heads: "
                  "num_attention_heads // tp_size")
    with torch.device("meta"):
        model = transformers.BertModel(verify.tiny_config("bert"))
    tpmap.plan(model, 4, mapping=load_text(text, "<bert>"))  # 12 heads at 4: even, accepted
    with pytest.raises(UnevenSplitError, match=r"reads the world size.*per_rank\(num_attention"):
        tpmap.plan(model, 5, mapping=load_text(text, "<bert>"))


def test_a_one_argument_per_rank_of_kv_heads_is_refused_and_says_how_to_write_it():
    text = edited("llama", "per_rank(num_key_value_heads, num_attention_heads)", "per_rank(num_key_value_heads)")
    with pytest.raises(UnevenSplitError, match=r"per_rank\(num_key_value_heads, <query heads>\)"):
        tpmap.plan(_meta_llama(), 2, mapping=load_text(text, "<llama>"))


def test_kv_heads_without_query_heads_are_refused_at_an_uneven_world_size():
    text = edited("llama", "    query_heads: num_attention_heads\n", "", every=True)
    model = _meta_llama(num_attention_heads=12, num_key_value_heads=4, hidden_size=96)
    with pytest.raises(UnevenSplitError, match="add `query_heads"):
        tpmap.plan(model, 3, mapping=load_text(text, "<llama>"))  # 4 KV heads at 3 would split on their own


@pytest.mark.parametrize("model_type,config,path,works", [
    ("mixtral", dict(num_attention_heads=8, num_key_value_heads=8, intermediate_size=99, num_local_experts=4),
     "a plain width of a Param entry's tensor of 3 or more dims split along another dim than the first (grouped "
     "experts)",
     "1, 3, 9, 11"),
])
def test_unproven_paths_are_refused_with_the_world_sizes_that_work(model_type, config, path, works):
    config = transformers.AutoConfig.for_model(model_type, hidden_size=72, num_hidden_layers=1, vocab_size=250,
                                               eos_token_id=2, **config)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    with pytest.raises(UnevenSplitError, match="world size 2 splits it unevenly") as e:
        tpmap.plan(model, 2)
    assert f"not supported for {path}" in str(e.value) and f"split it evenly: {works}" in str(e.value), str(e.value)


def _meta_olmo2(**config):
    base = dict(hidden_size=96, num_attention_heads=12, num_key_value_heads=4, intermediate_size=192,
                num_hidden_layers=1, vocab_size=250, eos_token_id=2, pad_token_id=0)
    with torch.device("meta"):
        return transformers.Olmo2ForCausalLM(transformers.Olmo2Config(**{**base, **config}))


def test_a_norm_over_uneven_heads_plans_and_one_over_even_replicated_heads_is_refused_as_before():
    plan = tpmap.plan(_meta_olmo2(), 3)  # 4 KV heads after 12 query heads at 3: [0 0 0 1], [1 2], [2 3 3 3]
    k_norm = plan.params["model.layers.0.self_attn.k_norm.weight"]
    assert k_norm.replicated_heads and [len(k_norm.indices(r)) for r in range(3)] == [32, 16, 32]
    assert "model.layers.0.self_attn.k_norm" in plan.uneven
    with pytest.raises(tpmap.DivisibilityError, match="a Norm over replicated heads is not exact"):
        tpmap.plan(_meta_olmo2(num_key_value_heads=2), 4)  # 12 / 4 even, 2 KV heads replicated (vLLM's rule)


def test_a_rank_may_hold_more_kv_heads_than_the_model_has_and_the_update_says_so():
    """Llama 4 Scout's 40 query / 8 KV heads at 3, in small: 10 query / 2 KV heads. Rank 1's query heads 4-6 read KV
    heads 0, 1, 1, so it holds KV head 0 once and 1 twice: 3 KV heads, more than the model's 2. The Update's
    per-rank value is bounded by the query heads, not by the full value (main refused this shape in 14 mappings)."""
    with torch.device("meta"):
        model = transformers.Phi3ForCausalLM(transformers.Phi3Config(
            hidden_size=80, num_attention_heads=10, num_key_value_heads=2, intermediate_size=96,
            num_hidden_layers=1, vocab_size=250, pad_token_id=0))
    plan = tpmap.plan(model, 3)
    kv = next(u for u in plan.updates if u.attribute == "num_key_value_heads")
    assert kv.full_value == 2 and kv.values == (1, 3, 1), kv
    qkv = plan.params["model.layers.0.self_attn.qkv_proj.weight"]  # q 4/3/3 heads, then the KV copies, of 8
    assert [len(qkv.indices(r)) // 8 for r in range(3)] == [4 + 2 * 1, 3 + 2 * 3, 3 + 2 * 1]


def test_the_uneven_plan_of_smollm2s_shape():
    plan = tpmap.plan(_meta_llama(), 2)
    k = plan.params["model.layers.0.self_attn.k_proj.weight"]
    assert k.replicated_heads and [len(k.indices(r)) for r in range(2)] == [40, 32]  # 5 and 4 copies of 8
    update = next(u for u in plan.updates if u.attribute == "num_key_value_groups")
    assert update.values == (1, 1) and "model.layers.0.mlp.up_proj" in plan.uneven


# -- on real ranks ---------------------------------------------------------------------------------------
def _assert_exact(ref: str, index: int, cls: str, ws: int, per_rank: list[dict], generate: bool) -> None:
    case = verify.Case(ref=ref, model_type=ref, verify_index=index, config_name="", class_name=cls, world_size=ws)
    result = verify.judge(case, [r["forward"] for r in per_rank])
    assert result.passed, result.error
    for rank, r in enumerate(per_rank):
        assert r["forward"]["params_local"] == r["share"]["expected_local"] < r["share"]["full"], (rank, r)
        for key, rtol in GRAD_RTOL.items():
            g = r[key]
            assert g["checked"] == g["params"] and g["sharded"] == g["expected_sharded"], (key, g)
            assert g["worst_rel"] <= rtol, (rank, key, g["worst_rel"], g["worst_name"])
            assert g["loss_diff"] <= 1e-5 * max(1.0, abs(g["loss"])), (key, g)
        if generate:
            assert r["generate"]["new_tokens"] >= 20 and r["generate"]["ranks_agree"], r["generate"]


@pytest.mark.parametrize("ws", [2, 4])
def test_llama_with_9_query_and_3_kv_heads_is_exact(ranks, tmp_path, ws):
    ref, index = _with_case(tmp_path, "llama", LLAMA_9_3)
    per_rank = ranks(ws).run(rank_cases.prove_case, ref, index, "LlamaForCausalLM", True, True)
    _assert_exact(ref, index, "LlamaForCausalLM", ws, per_rank, generate=True)


def test_olmo2_norms_over_uneven_and_twice_held_kv_heads_are_exact_at_3(ranks):
    """q_norm/k_norm (Norm entries) at 3 ranks over 12 query / 4 KV heads: each rank's k_norm holds KV heads
    twice or on two ranks ([0 0 0 1], [1 2], [2 3 3 3]); the statistic counts each feature once."""
    per_rank = ranks(3).run(rank_cases.prove_case, "olmo2", 0, "Olmo2ForCausalLM", True, False)
    _assert_exact("olmo2", 0, "Olmo2ForCausalLM", 3, per_rank, generate=False)


@pytest.mark.parametrize("config_name,ws", [("qkln-kv4", 3), pytest.param("qkln-kv3", 4, marks=pytest.mark.full)])
def test_per_kv_head_norms_held_by_two_ranks_sum_their_gradients(ranks, config_name, ws):
    """StableLM-2's k_layernorm is a ModuleList of one LayerNorm per KV head (a Param entry). 12 query / 4 KV
    heads at 3 ranks hold KV heads [0 0 0 1], [1 2], [2 3 3 3]: norm 0 met three times on rank 0 (one module,
    autograd sums its uses), norms 1 and 2 on two ranks each (one all-reduce per list sums their holders'
    terms). 12 / 3 at 4: [0], [0 1 1], [1 1 2], [2]. Every rank's every norm has the unsharded gradient."""
    index = verify_index("stablelm", config_name)
    per_rank = ranks(ws).run(rank_cases.prove_case, "stablelm", index, "StableLmForCausalLM", True, ws == 4)
    _assert_exact("stablelm", index, "StableLmForCausalLM", ws, per_rank, generate=ws == 4)


def test_mamba2_with_groups_split_unevenly_is_exact_at_3(ranks):
    """Mamba-2's conv1d, A_log/D/dt_bias and gated-norm weight (Param entries on bare tensors) at 3 ranks over
    4 groups of 2 heads: ranks hold 2, 1, 1 whole groups."""
    per_rank = ranks(3).run(rank_cases.prove_case, "mamba2", 0, "Mamba2ForCausalLM", True, False)
    _assert_exact("mamba2", 0, "Mamba2ForCausalLM", 3, per_rank, generate=False)


@pytest.mark.parametrize("ws", [2, 4])
def test_falcon_groups_split_unevenly_are_exact(ranks, ws):
    """Falcon-40B's fused [kv, q_per_kv + 2, d] at a world size that neither divides its 3 groups (of 4 query heads)
    nor is a multiple of them: at 2 whole groups, 2 and 1 (8 and 4 query heads, the dense Row following them); at 4
    3 query heads per rank (runs of 1 and 2 query heads per group: copies of 1 with their group's k and v). A
    key/value row held on two ranks, or twice on one, gets the unsharded gradient (its copies' terms summed)."""
    index = verify_index("falcon", "grouped-kv3")
    per_rank = ranks(ws).run(rank_cases.prove_case, "falcon", index, "FalconForCausalLM", True, True)
    _assert_exact("falcon", index, "FalconForCausalLM", ws, per_rank, generate=True)


@pytest.mark.parametrize("ws", [2, 4])
def test_llama_with_9_query_and_3_kv_heads_round_trips_checkpoints_bit_for_bit(ranks, tmp_path, ws):
    import uneven_cases
    ref, index = _with_case(tmp_path, "llama", LLAMA_9_3)
    per_rank = ranks(ws).run(uneven_cases.round_trip, ref, index, "LlamaForCausalLM", str(tmp_path / "ckpt"))
    for r in per_rank:
        assert r["uneven"] and r["loaded_wrong"] == [], r
        assert abs(r["planned_numel"] - r["local_numel"]) < 0.5, r  # `tpmap plan`'s share: what the rank holds
    assert len({r["local_numel"] for r in per_rank}) > 1  # uneven: the ranks hold different amounts
    assert per_rank[0]["tensors"] and per_rank[0]["saved_keys_differ"] == [] and per_rank[0]["saved_wrong"] == []


@pytest.mark.parametrize("ws", [2, pytest.param(4, marks=pytest.mark.full)])
def test_sequence_parallelism_at_an_uneven_world_size_equals_plain_tp_and_unsharded(ranks, tmp_path, ws):
    """The sequence splits by tokens, whatever the heads: the 9q/3kv Llama with sequence_parallel=True has the
    unsharded model's logits, plain TP's gradients, and the unsharded model's greedy tokens."""
    import sequence_parallel_cases
    text = mapping_text("llama").replace("verify:\n", "verify:\n" + LLAMA_9_3, 1)  # verify config 0
    ref = str(write_mapping(tmp_path, "llama", text))
    for r in ranks(ws).run(sequence_parallel_cases.grad_case, ref, "LlamaForCausalLM", torch.float64, 8):
        assert r["block1_tokens"] == [8 // ws] and r["block1_tokens_tp"] == [8], r  # really split
        assert r["logits_vs_full"] <= 1e-12 and r["grad_vs_tp"] <= 1e-12 and r["checked"] > 0, r
    for r in ranks(ws).run(sequence_parallel_cases.generate_case, ref, "LlamaForCausalLM", 8):
        assert r["same_as_full"] and r["same_as_tp"] and r["block1_tokens"][0] == 8 // ws, r


@pytest.mark.parametrize("n_head", [8, 6])  # 8 at 3: 3/3/2 heads per section, padded; 6 at 3: the even path
def test_a_gathered_column_split_unevenly_returns_the_full_output_and_exact_gradients(ranks, n_head):
    """gather_output at an uneven split: each rank pads its output to the widest before the all-gather, and
    the backward hands each rank the gradient of its own features (fused [q | k | v]: reordered too)."""
    per_rank = ranks(3).run(rank_cases.uneven_gather_output_case, n_head)
    assert [r["widths"] for r in per_rank] == ([72, 72, 48] if n_head == 8 else [48, 48, 48]), per_rank
    for r in per_rank:
        assert max(r["y"], r["dx"], r["dw"], r["db"]) < 1e-12, r


# Shipped verify configs that split an Input entry's heads, a gathered Column or an nn.Embedding Column
# unevenly at 3 ranks: forward, fp32 and fp64 gradients per shard against the unsharded model
UNEVEN_PATHS = [
    pytest.param("mpt", "uneven3", "MptForCausalLM", id="input-position_bias-10-heads"),
    pytest.param("t5", "uneven3", "T5ForConditionalGeneration", id="embedding-column-relative-bias-8-heads"),
    pytest.param("bloom", "uneven3", "BloomForCausalLM", id="input-flattened-alibi-8-heads", marks=pytest.mark.full),
    pytest.param("falcon", "alibi-uneven3", "FalconForCausalLM", id="input-alibi-and-mask", marks=pytest.mark.full),
    pytest.param("squeezebert", "uneven3", "SqueezeBertForSequenceClassification", id="gathered-pooler",
                 marks=pytest.mark.full),
]


@pytest.mark.parametrize("model_type,config_name,cls", UNEVEN_PATHS)
def test_inputs_gathered_columns_and_embedding_columns_are_exact_at_an_uneven_split(ranks, model_type,
                                                                                       config_name, cls):
    index = verify_index(model_type, config_name)
    per_rank = ranks(3).run(rank_cases.prove_case, model_type, index, cls, True, False)
    _assert_exact(model_type, index, cls, 3, per_rank, generate=False)


@pytest.mark.full  # 5 ranks
def test_bert_with_12_heads_is_exact_at_world_size_5(ranks, tmp_path):
    ref, index = _with_case(tmp_path, "bert", BERT_12_AT_5)
    per_rank = ranks(5).run(rank_cases.prove_case, ref, index, "BertForMaskedLM", True, False)
    _assert_exact(ref, index, "BertForMaskedLM", 5, per_rank, generate=False)


@pytest.mark.full  # torch.compile (aot_eager): each rank traces its own local shapes
def test_compiled_uneven_llama_equals_eager_and_unsharded(ranks, tmp_path):
    import compile_cases
    path = write_mapping(tmp_path, "llama", mapping_text("llama").replace("verify:\n", "verify:\n" + LLAMA_9_3, 1))
    for r in ranks(2).run(compile_cases.compiled_logits, str(path), "LlamaForCausalLM", timeout=600):
        assert r["vs_eager"] <= 1e-6 * r["scale"] and r["vs_unsharded"] <= 1e-5 * r["scale"], r
    for r in ranks(2).run(compile_cases.compiled_training_step, str(path), "LlamaForCausalLM", timeout=600):
        assert r["checked"] > 10 and r["worst_rel"] <= 1e-4 and r["loss_diff"] <= 1e-5, r


def test_paths_not_proven_uneven_are_refused_on_real_ranks(ranks, tmp_path):
    ref, index = _with_case(tmp_path, "llama", LLAMA_9_3)
    import uneven_cases
    for r in ranks(2).run(uneven_cases.refused_paths, ref, index, "LlamaForCausalLM", str(tmp_path / "ckpt")):
        for path, message in r.items():
            assert message.startswith("UnevenSplitError: ") and "world size 2 splits" in message, (path, message)
            assert "world sizes that split this model evenly: 1, 3, 9" in message, (path, message)


# -- every verify config at every world size 2-4 ----------------------------------------------------------
# (model type, verify config) refused at a world size that leaves each rank a head, and why: gaps left open by name
KNOWN_REFUSALS = {
    ("zaya", "kv4"): "a Row's input or a Param with replicate_heads: false",  # split in units of its 2 KV heads
}


@pytest.mark.full  # ~800 cases, forward only, on one warm pool per world size: ~3 minutes
def test_every_verify_config_runs_exactly_at_every_world_size_2_to_4_it_does_not_list():
    """Issue 37's bar: every shipped verify config passes at every world size from 2 to 4 where the model has a head
    per rank. The world sizes a config lists run in test_mappings; here, the others: planned on the meta device,
    and where tpmap accepts the plan, run against the unsharded model (a plan tpmap accepts must not crash or
    differ). A refusal must be for fewer heads than ranks, or one of KNOWN_REFUSALS."""
    from tpmap.compat import mapping_applies
    from tpmap.errors import TpmapError
    from tpmap.language import source

    todo, wrong = [], []
    for model_type, path in sorted(source.shipped_files().items()):
        mapping = source.read_file(path).mapping
        if not mapping_applies(mapping.transformers):
            continue
        for index, spec in enumerate(mapping.verify):
            missing = [ws for ws in (2, 3, 4) if ws not in spec.world_sizes]
            for cls in spec.models if missing else ():
                with torch.device("meta"):
                    model = getattr(transformers, cls)(verify.tiny_config(model_type, index))
                for ws in missing:
                    try:
                        tpmap.plan(model, ws)
                    except TpmapError as e:
                        known = KNOWN_REFUSALS.get((model_type, spec.name), "fewer heads than ranks")
                        if known not in str(e) and "fewer heads than ranks" not in str(e):
                            wrong.append(f"{model_type} {spec.name} {cls} at {ws}: {e}")
                        continue
                    todo.append(verify.Case(ref=model_type, model_type=model_type, verify_index=index,
                                            config_name=spec.name, class_name=cls, world_size=ws))
    assert not wrong, "\n".join(wrong)
    assert len(todo) > 500, len(todo)  # the sweep itself: 787 cases when written
    failed = [r for r in verify.run(todo, log=lambda line: None) if not r.passed]
    assert not failed, "\n".join(f"{r.case.model_type} {r.case.config_name} {r.case.class_name} at "
                                 f"{r.case.world_size}: {r.error}" for r in failed)
