"""Collectives per forward and per training step (benchmarks/comm.py) against the Megatron minimum, on real
ranks: counts, never times. The minimum comes from the unsharded model's dataflow (comm.megatron_minimum);
the hand-derived numbers below pin that computation too, so neither side can drift unnoticed."""
from __future__ import annotations

import rank_cases

# (model type, forward all-reduces, forward all-gathers, step all-reduces), derived by hand for the
# 2-layer first verify configs at world size 2: 2 per decoder/encoder block (attention, MLP), 3 per
# decoder block with cross attention, 1 per vocab-parallel embedding lookup; backward: 1 per Column input
# group (q/k/v share one; the LM head's) and per floating input of an MoE experts Reduce (hidden states,
# routing weights); a q/k Norm over split features costs 1 both ways.
SEQUENTIAL = [
    ("llama", 5, 1, 10),          # fwd 2x2 + 1; bwd 2x2 + LM head
    ("gpt2", 5, 1, 10),
    ("mixtral", 5, 1, 12),        # bwd: attention 1 + experts 2 (hidden, routing weights) per layer, LM head
    ("t5", 12, 1, 24),            # encoder 2x2 + decoder 2x3 + 2 lookups (encoder and decoder)
    ("bert", 5, 0, 9),            # BertModel: no LM head, no logits gather
    ("olmo2", 9, 1, 18),          # + q and k Norm statistics per layer, both ways
    ("whisper", 11, 1, 23),       # encoder 2x2 (input_features: no lookup) + decoder 2x3 + 1 lookup
]
# parallel blocks: two partial sums read the same input, so Megatron shares one all-reduce; tpmap reduces
# each Row/Reduce on its own (HF adds the residual inside the layer's forward): one extra per such block
PARALLEL = [("gptj", 2), ("gpt_neox", 2), ("falcon", 2), ("qwen2_moe", 2), ("deepseek_v3", 1)]


def test_collectives_per_forward_and_step_are_the_megatron_minimum(ranks):
    types = [t for t, *_ in SEQUENTIAL] + [t for t, _ in PARALLEL]
    rows = {r["model_type"]: r for r in ranks(2).run(rank_cases.comm_counts, types, timeout=600)[0]}
    for model_type, fwd_ar, fwd_ag, step_ar in SEQUENTIAL:
        r = rows[model_type]
        assert (r["min_fwd_ar"], r["min_fwd_ag"]) == (fwd_ar, fwd_ag), r  # the minimum computation itself
        assert (r["fwd_ar"], r["fwd_ag"]) == (fwd_ar, fwd_ag) and r["at_minimum"], r
        assert r["step_ar"] == step_ar == r["min_step_ar"], r
    for model_type, blocks in PARALLEL:
        r = rows[model_type]
        assert r["fwd_ar"] == r["min_fwd_ar"] + blocks and r["fwd_ag"] == r["min_fwd_ag"], r
