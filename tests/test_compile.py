"""torch.compile on real ranks at world size 2: tpmap adds no graph break to a forward
or a training forward, and compiled results equal eager tpmap's and the unsharded model's.

Counts come from torch._dynamo.explain; a break the unsharded model also has is transformers' own, so
the tpmap count must equal the unsharded one, and no break may point into tpmap's files. Results use
the aot_eager backend (dynamo + AOT autograd graphs, without inductor, which needs a C++ compiler on
CPU). Dropout in a compiled training forward needs graph breaks (engine/rng.py); its test checks the
compiled output equals eager's, seed for seed.
"""
from __future__ import annotations

import compile_cases
import pytest

pytestmark = pytest.mark.full  # compiling takes minutes

LLAMA = ("llama", "LlamaForCausalLM")
TPMAP_FILES = ("/engine/", "/tpmap/")


def _tpmap_reasons(report: dict) -> list[str]:
    return [r for r in report["reasons"] if any(part in r for part in TPMAP_FILES)]


EXPERT_PARALLEL = ("mixtral:experts=parallel", "MixtralForCausalLM")  # whole experts: the Route's pre-hook


@pytest.mark.parametrize("case", [LLAMA, ("bert", "BertForMaskedLM"), EXPERT_PARALLEL], ids=lambda c: c[0])
def test_no_graph_break_from_tpmap(ranks, case):
    """Eval forward and training forward (loss; its backward is traced with it). BERT's training forward
    has dropout (0.1), which breaks by design, so only its forward is compared."""
    for r in ranks(2).run(compile_cases.graph_breaks, *case, timeout=600):
        phases = ("forward", "train") if case[0] != "bert" else ("forward",)
        for phase in phases:
            tp, full = r[f"tpmap_{phase}"], r[f"unsharded_{phase}"]
            assert not _tpmap_reasons(tp), (phase, tp)
            assert tp["count"] == full["count"] == 0, (phase, tp, full)


def test_compiled_logits_equal_eager_and_unsharded(ranks):
    for r in ranks(2).run(compile_cases.compiled_logits, *LLAMA, timeout=600):
        assert r["vs_eager"] <= 1e-6 * r["scale"], r
        assert r["vs_unsharded"] <= 1e-5 * r["scale"], r  # sharding reorders float sums (verify: ~1e-6 rel)


def test_compiled_training_step_gradients_are_the_unsharded_slices(ranks):
    for r in ranks(2).run(compile_cases.compiled_training_step, *LLAMA, timeout=600):
        assert r["checked"] > 10 and r["worst_rel"] <= 1e-4, r  # tests/test_training.py's fp32 bound
        assert r["loss_diff"] <= 1e-5, r


def test_compiled_dropout_draws_the_eager_masks(ranks):
    """GPT-2 (dropout 0.1 in attention, MLP and residual) in training mode: same seed, same output as eager
    tpmap, which draws rank-specific masks inside sharded regions (tests/test_training.py -k dropout)."""
    for r in ranks(2).run(compile_cases.compiled_dropout, "gpt2", "GPT2LMHeadModel", timeout=600):
        assert r["dropout_active"] and r["ranks_agree"], r
        assert r["vs_eager"] == 0.0, r
