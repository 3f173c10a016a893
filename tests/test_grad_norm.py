"""`tpmap.training.grad_norm` / `clip_grad_norm_` on real gloo ranks, against torch's norm and clipping of the
unsharded model built from the same weights in the same run (tests/grad_norm_cases.py): after one backward (fp64,
init std 0.15) the sharded norm equals the unsharded one, and after clipping by a third of it every rank's
gradient equals its reference slice of the unsharded clipped gradient -- so every rank clipped by the unsharded
factor, and the replicated tensors stay equal.

Covered: replicated KV heads (Llama with 1 KV head at tp 2, 2 at tp 4: each KV row held by 2 ranks), a
vocabulary the tp size does not divide (255 rows at tp 2 and 4, 256 at tp 3: padding rows; backward leaves their
gradient 0, which would hide a wrong weight, so they are set to 1.0 to show they count for nothing), MoE experts
split inside (Mixtral; Qwen3-MoE with grad_allreduce'd q/k norms), a ModuleList cut between the ranks (StableLM's
per-head LayerNorms), LoRA adapters (tpmap.peft: B's rows of a Column replicated with its KV heads, A's columns
of a Row, whole A / B, a trained copy of the LM head), the inf-norm and a 3-norm, and DDP over a (dp 2, tp 2)
mesh.

Bounds: the norm within 1e-12 relative (fp64 sums reordered; measured <= 2.3e-16), the clipped gradients as
tests/test_training.py's gradients (rank_cases._grad_report: 1e-9 relative over a 64-eps floor). The norm from
the gradients backward gave (`natural`) within 1e-12 too, except for MoE routers, which compute in float32 even
in fp64 (measured 1.3e-8 relative; bound 1e-6).
Planted bugs, each caught in the default tier: replicated KV heads counted by every holder (llama at tp 2: 12.78
against 11.59; LoRA 15.085 against 15.002), the vocabulary's padding weighted 1 (18.07 against 11.59; inf-norm 1.0
against 0.715), no all-reduce (each rank its own norm: 8.13 against 11.59; no MAX: 0.695 against 0.715), clipping
by the local norm (clipped gradients off by 0.07-0.44 relative), the weights' cache kept after PEFT added adapters
(0.0 against 15.0), and the Trainer's old item indexing of a cut ModuleList (IndexError on StableLM's rank 1).
"""
from __future__ import annotations

import math

import pytest

pytest.importorskip("peft")

NORM_REL = 1e-12
GRAD_REL = 1e-9
LLAMA = ("llama", 0, "LlamaForCausalLM")
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

# name -> (world size, (ref, verify index, class), config overrides, norm type); the default tier runs tp 2
DENSE = {
    "llama-kv1-vocab255-tp2": (2, LLAMA, {"num_key_value_heads": 1, "vocab_size": 255}, 2.0),
    "llama-kv1-vocab255-tp2-inf": (2, LLAMA, {"num_key_value_heads": 1, "vocab_size": 255}, math.inf),
    "llama-p3-tp2": (2, LLAMA, {"num_key_value_heads": 1, "vocab_size": 255}, 3.0),
    "mixtral-tp2": (2, ("mixtral", 0, "MixtralForCausalLM"), {}, 2.0),
    "stablelm-cut-norms-tp2": (2, ("stablelm", 0, "StableLmForCausalLM"), {}, 2.0),
    # 12 query / 4 KV heads at 3: k_layernorm items [0 0 0 1], [1 2], [2 3 3 3]: held twice and on two ranks
    "stablelm-shared-norms-tp3": (3, ("stablelm", 0, "StableLmForCausalLM"), {}, 2.0),
    "llama-kv2-vocab255-tp4": (4, LLAMA, {"vocab_size": 255}, 2.0),
    "llama-kv2-vocab255-tp4-inf": (4, LLAMA, {"vocab_size": 255}, math.inf),
    "llama-kv6-vocab256-tp3": (3, ("llama", 1, "LlamaForCausalLM"), {}, 2.0),
    "qwen3_moe-tp2": (2, ("qwen3_moe", 0, "Qwen3MoeForCausalLM"), {}, 2.0),
    "qwen3_moe-kv2-tp4": (4, ("qwen3_moe", 0, "Qwen3MoeForCausalLM"), {}, 2.0),
}
DEFAULT = {"llama-kv1-vocab255-tp2", "llama-kv1-vocab255-tp2-inf", "mixtral-tp2", "stablelm-cut-norms-tp2"}
ROUTED = ("mixtral", "qwen3_moe")  # float32 routers: natural gradients ~1e-7 apart


def _check(per_rank: list[dict], natural_rel: float = NORM_REL) -> None:
    for r in per_rank:
        want = r["want"]
        assert r["norm"] == pytest.approx(want, rel=NORM_REL), r
        assert r["natural"] == pytest.approx(want, rel=natural_rel), r
        assert r["clip_total"] == pytest.approx(r["clip_want"], rel=NORM_REL), r
        assert r["after"] <= GRAD_REL, r
        assert r["clipped_by"] < 0.34  # torch did clip the unsharded gradient (to a third)
    assert any(r["local_torch"] != pytest.approx(r["want"], rel=1e-3) for r in per_rank)  # torch's per rank: wrong


@pytest.mark.parametrize("name", [n if n in DEFAULT else pytest.param(n, marks=pytest.mark.full) for n in DENSE])
def test_sharded_norm_and_clipping_equal_the_unsharded_models(ranks, name):
    import grad_norm_cases

    ws, model, overrides, norm_type = DENSE[name]
    per_rank = ranks(ws).run(grad_norm_cases.dense_case, *model, overrides, norm_type)
    _check(per_rank, 1e-6 if model[0] in ROUTED else NORM_REL)
    for r in per_rank:
        assert r["before"] <= (1e-6 if model[0] in ROUTED else GRAD_REL), r  # the gradients themselves
    if overrides.get("vocab_size", 256) % ws:
        assert {n for r in per_rank for n in r["padded"]} == {"lm_head.weight", "model.embed_tokens.weight"}
        assert all(r["padding_grad"] == 0.0 for r in per_rank)
    if "-kv1-" in name or "-kv2-" in name:  # fewer KV heads than ranks: each held by ws / kv ranks
        assert all(r["replicated_kv"] for r in per_rank)
    if model[0] == "stablelm":  # q_layernorm.norms, k_layernorm.norms of each layer: rank r keeps its heads' items
        assert len(per_rank[0]["cut_lists"]) == 4, per_rank[0]["cut_lists"]


@pytest.mark.parametrize("ws", [2, 4])
def test_lora_norm_and_clipping_equal_plain_peft(ranks, ws):
    """Adapters on every projection of a Llama (1 KV head at tp 2, 2 at tp 4: k/v's B rows replicated) and
    the vocabulary-parallel LM head trained as a copy (255 rows: padded)."""
    import grad_norm_cases

    kv = {2: 1, 4: 2}[ws]
    per_rank = ranks(ws).run(grad_norm_cases.lora_case, {"num_key_value_heads": kv, "vocab_size": 255},
                             LORA_TARGETS, ["lm_head"])
    for r in per_rank:
        r["natural"] = r["norm"]
        r["clipped_by"] = 0.0
        assert r["before"] <= GRAD_REL and r["split_adapters"] > 0 and r["trained"] > r["split_adapters"], r
        assert r["base_norm"] == pytest.approx(r["want"], rel=NORM_REL), r
    _check(per_rank)


@pytest.mark.full  # 4 ranks
def test_norm_and_clipping_inside_ddp_over_a_dp_tp_mesh(ranks):
    import grad_norm_cases

    per_rank = ranks(4).run(grad_norm_cases.ddp_case, {"vocab_size": 255})
    for r in per_rank:
        r["natural"], r["clipped_by"] = r["norm"], 0.0
        assert r["before"] <= GRAD_REL, r
        assert "group= has 4 ranks but the model is sharded over 2" in r["wrong_group"]
    _check(per_rank)


def test_norm_types_it_cannot_compute_are_refused(ranks):
    import grad_norm_cases

    for r in ranks(2).run(grad_norm_cases.refused_case):
        assert "norm_type=0" in r["p0"] and "p > 0" in r["p0"], r
        assert "norm_type=-inf" in r["minus_inf"], r
