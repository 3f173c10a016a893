"""Wrong mappings are caught, one per entry kind or feature that attention mappings rely on (Norm, Input,
groups, when, Param on a weight and on a ModuleList): a copy of the shipped YAML with the feature removed
or mis-stated, run through `tpmap verify`'s case on real ranks, fails by far more than the tolerance or
errors. The shipped file itself passes the same case (tests/test_forward.py)."""
from __future__ import annotations

import pytest
from helpers import edited_copy, first_case, run_case

from tpmap import verify

# name: (model type, verify config name, world size, text to replace, replacement, what it shows)
WRONG = {
    # OLMo2's q/k norms as plain per-rank tensors: RMS over this rank's heads only, not all heads
    "olmo2-norm-statistic-per-rank": (
        "olmo2", "gqa-kv4", 2,
        "  - kind: Norm                      # RMSNorm over H * d features, split like q_proj's output\n"
        "    module: layers.*.self_attn.q_norm\n    statistic: rms\n",
        "  - kind: Param\n    module: layers.*.self_attn.q_norm\n    params: [weight]\n    dim: 0\n"),
    # OLMo2 without the k_norm entry: the whole [KV * d] norm meets this rank's [KV/ws * d] keys
    "olmo2-no-k-norm": (
        "olmo2", "gqa-kv4", 2,
        "  - kind: Norm                      # RMSNorm over KV * d features, split like k_proj's output\n"
        "    module: layers.*.self_attn.k_norm\n    statistic: rms\n    heads: num_key_value_heads\n", ""),
    # BLOOM's alibi [B * H, 1, S] left whole
    "bloom-no-alibi-slice": (
        "bloom", "mha12", 2,
        "  - kind: Input                     # alibi [B * H, 1, S] built with all H heads: keep this rank's heads\n"
        "    module: h.*.self_attention\n    argument: alibi\n    dim: 0\n    heads: n_head\n    flattened: true\n",
        ""),
    # BLOOM's alibi sliced as if it were [H, ...] (heads-major): the engine finds B * H rows, not H
    "bloom-alibi-not-flattened": ("bloom", "mha12", 2, "    flattened: true\n", ""),
    # MPT's position_bias [H, 1, S] left whole
    "mpt-no-position-bias-slice": (
        "mpt", "mha12", 2,
        "  - kind: Input                    # position_bias [H, 1, S] built with all H heads\n"
        "    module: blocks.*.attn\n    argument: position_bias\n    dim: 0\n    heads: n_heads\n", ""),
    # Falcon-RW: the alibi-folded mask [B, H, S, S] left whole
    "falcon-no-mask-slice": (
        "falcon", "alibi-mha", 2,
        "  - kind: Input\n    module: h.*.self_attention\n    when: {alibi: true}\n    argument: attention_mask\n"
        "    dim: 1\n    heads: num_attention_heads\n", ""),
    # Falcon-RW on the eager path: alibi [B, H, 1, S] left whole
    "falcon-no-alibi-slice": (
        "falcon", "alibi-eager", 2,
        "  - kind: Input\n    module: h.*.self_attention\n    when: {alibi: true}\n    argument: alibi\n"
        "    dim: 1\n    heads: num_attention_heads\n", ""),
    # Falcon-40B's grouped [kv, q_per_kv + 2, d] without `groups`: split as one [q | k | v] run
    "falcon-grouped-without-groups": ("falcon", "grouped-kv2", 2, "    groups: num_kv_heads\n    sections:\n",
                                      "    sections:\n"),
    # a copy-paste slip in `when`: the grouped layout's Update gated like the MHA one, so it never applies
    # to a grouped config (and num_heads / num_kv_heads keep their full values)
    "falcon-when-slip": (
        "falcon", "grouped-kv2", 2,
        "    when: {new_decoder_architecture: true}\n    attributes:\n",
        "    when: {multi_query: false, new_decoder_architecture: false}\n    attributes:\n"),
    # Cohere's per-head q_norm weight [H, d] left whole
    "cohere-no-q-norm-split": (
        "cohere", "qknorm-kv2", 2,
        "  - kind: Param                     # weight [H, head_dim]: this rank's query heads\n"
        "    module: layers.*.self_attn.q_norm\n    when: {use_qk_norm: true}\n    params: [weight]\n    dim: 0\n"
        "    heads: num_attention_heads\n", ""),
    # StableLM's per-head LayerNorm list left whole: zip() pairs every rank's heads with norms 0, 1, ...
    "stablelm-no-norms-slice": (
        "stablelm", "qkln-kv4", 2,
        "  - kind: Param                     # one LayerNorm per query head: keep this rank's\n"
        "    module: layers.*.self_attn.q_layernorm\n    when: {qk_layernorm: true}\n    params: [norms]\n"
        "    dim: 0\n    heads: num_attention_heads\n", ""),
}


# how each is caught (measured): a numeric difference (relative to max|logits|), or a shape error in the
# forward (every other one: the sliced and the whole tensors meet) / the engine's own check
NUMERIC = {"olmo2-norm-statistic-per-rank": 7e-2, "stablelm-no-norms-slice": 6e-2}


def wrong_case(tmp_path, name: str) -> verify.Case:
    model_type, config_name, ws, old, new = WRONG[name]
    return first_case(edited_copy(tmp_path, name, model_type, old, new, once=True), ws, config_name=config_name)


# the default tier keeps one case per feature (Norm, Param on a ModuleList, Input, groups); the others, most
# a rank failure and a restart of the rank pool, run in the full tier
FULL_TIER_ONLY = {"olmo2-no-k-norm", "bloom-alibi-not-flattened", "mpt-no-position-bias-slice", "falcon-no-mask-slice",
                  "falcon-no-alibi-slice", "falcon-when-slip", "cohere-no-q-norm-split"}


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.full) if n in FULL_TIER_ONLY else n for n in WRONG])
def test_a_wrong_attention_mapping_is_caught(ranks, tmp_path, name):
    case = wrong_case(tmp_path, name)
    if name not in NUMERIC:  # a shape error inside the forward, or the engine's check of the sliced dim
        with pytest.raises(Exception) as caught:
            run_case(ranks, case)
        assert "RankFailure" in type(caught.value).__name__ and "RuntimeError" in str(caught.value), caught.value
        return
    result = run_case(ranks, case)
    assert not result.passed
    assert result.rel_diff > 1e-3, f"wrong mapping {name} was off by only {result.rel_diff:.2g}"
