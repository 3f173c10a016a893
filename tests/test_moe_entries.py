"""The entries MoE and MLA mappings rely on (Param experts with sections, Reduce, partial, Norm, when,
Enter, copy_input: false, grad_allreduce): each is needed, so a mapping without it is caught (a wrong
forward, wrong gradients or an error); expressions over sub-configs; lint past a cut default config."""
from __future__ import annotations

import pytest
import rank_cases
import torch
import transformers
from helpers import edited_copy, first_case, mapping_text, replaced, run_case, write_mapping

import tpmap
from tpmap.language.source import load_text

DBRX_EXPERTS = """
model_type: dbrx
entries:
  - kind: Param
    module: blocks.*.ffn.experts.mlp
    params: [w1]
    dim: 0
    sections: moe_num_experts
  - kind: Update
    module: blocks.*.ffn.experts
    attributes:
      ffn_hidden_size: ffn_hidden_size // tp_size
verify:
  - config: {}
    models: [DbrxForCausalLM]
"""


def test_expressions_read_attributes_of_a_sub_config():
    """DBRX keeps moe_num_experts and ffn_hidden_size in config.ffn_config, not on the config itself:
    an expression name that the config lacks is looked up in its sub-configs (exactly one must have it)."""
    config = transformers.AutoConfig.for_model(  # rope_theta: DbrxAttention reads it from attn_config
        "dbrx", d_model=32, n_heads=4, n_layers=1, vocab_size=64,
        attn_config={"kv_n_heads": 2, "clip_qkv": 8.0, "rope_theta": 10000.0},
        ffn_config={"ffn_hidden_size": 6, "moe_num_experts": 3})
    with torch.device("meta"):
        model = transformers.DbrxForCausalLM(config)
    plan = tpmap.plan(model, 2, mapping=load_text(DBRX_EXPERTS, "<dbrx experts>"))
    w1 = plan.params["transformer.blocks.0.ffn.experts.mlp.w1"]
    assert w1.full_shape == (18, 32)  # [E * I, H], E = 3 experts of I = 6
    assert w1.pieces == (((0, 3), (6, 3), (12, 3)), ((3, 3), (9, 3), (15, 3)))  # half of every expert
    assert [u.values for u in plan.updates] == [(3, 3)]


LATE_MOE = """
model_type: deepseek_v3
entries:
  - kind: Param
    module: layers.*.mlp.experts
    params: [gate_up_proj]
    dim: 1
    sections: 2
  - kind: Param
    module: layers.*.mlp.experts
    params: [down_proj]
    dim: 2
  - kind: Reduce
    module: layers.*.mlp.experts
replicated: [layers.*.self_attn, layers.*.mlp]
verify:
  - config: {hidden_size: 64, num_attention_heads: 4, num_key_value_heads: 4, q_lora_rank: 16, kv_lora_rank: 16,
             qk_rope_head_dim: 4, qk_nope_head_dim: 8, v_head_dim: 8, intermediate_size: 64,
             moe_intermediate_size: 32, n_routed_experts: 4, num_experts_per_tok: 2, n_group: 2, topk_group: 1,
             first_k_dense_replace: 1, num_hidden_layers: 2, vocab_size: 256}
    models: [DeepseekV3ForCausalLM]
"""


def test_lint_accepts_entries_for_blocks_past_the_cut_default_config(tmp_path):
    """lint cuts the default config to 2 blocks, where DeepSeek-V3 (first_k_dense_replace = 3) has no MoE
    layer yet: the experts entries match nothing there, but they match in the verify config's model,
    so they are not an error. A pattern that matches nothing anywhere still is."""
    from tpmap.lint import lint_file

    path = tmp_path / "late_moe.yaml"
    path.write_text(LATE_MOE)
    assert lint_file(str(path)) == []
    path.write_text(LATE_MOE.replace("    module: layers.*.mlp.experts\n    params: [down_proj]",
                                     "    module: layers.*.mlp.expert\n    params: [down_proj]"))
    found = lint_file(str(path))
    assert [(d.rule, d.line) for d in found] == [("pattern-no-match", 10)], found
    assert found[0].message.startswith("entry 1 (Param 'layers.*.mlp.expert'): pattern matches no module")


# -- a mapping without the feature it relies on is caught -------------------------------------------
DBRX = "dbrx"


def test_moe_experts_without_their_reduce_are_caught(ranks, tmp_path):
    """Each rank's experts output is a partial sum: without the Reduce the logits are wrong."""
    block = ("  - kind: Reduce\n"
             "    module: layers.*.mlp.experts  # each rank's output is a partial sum over its slice of I\n")
    path = edited_copy(tmp_path, "mixtral_no_reduce", "mixtral", block, "", every=True)
    result = run_case(ranks, first_case(path, 2))
    assert not result.passed and result.rel_diff > 1e-3, result


WRONG_FORWARD = {
    # the experts' partial sums never summed: each rank keeps its slice of every expert's output
    "qwen3_moe-no-reduce": ("qwen3_moe", [("  - kind: Reduce\n    module: layers.*.mlp.experts", "")]),
    # OLMoE's q/k norms with their weights split but the statistic over this rank's features only
    "olmoe-norm-as-param": ("olmoe", [("  - kind: Norm", "  - kind: Param"),
                                      ("    statistic: rms\n", "    params: [weight]\n    dim: 0\n")]),
    # GPT-OSS's down_proj_bias left whole on every rank: added once per rank inside the partial sum
    "gpt_oss-bias-not-partial": ("gpt_oss", [(
        "  - kind: Param                  # added inside every expert's output: a term of the partial sum\n"
        "    module: layers.*.mlp.experts\n    params: [down_proj_bias]\n    partial: true\n", "")]),
    # DBRX's stacked [E * I, H] experts split as one block: rank 0 gets whole experts, not half of each
    "dbrx-no-expert-sections": (DBRX, [("    dim: 0\n    sections: moe_num_experts\n", "    dim: 0\n")]),
}


@pytest.mark.parametrize("name", WRONG_FORWARD)
def test_a_wrong_moe_mapping_is_caught(ranks, tmp_path, name):
    """Each feature is needed: without it the sharded output is off by far more than rounding (or the
    forward fails)."""
    source, replacements = WRONG_FORWARD[name]
    text = mapping_text(source)
    for old, new in replacements:
        text = replaced(text, old, new, every=True)
    path = write_mapping(tmp_path, name, text)
    try:
        result = run_case(ranks, first_case(path, 2, verify_index=0))
    except Exception as e:  # a shape error inside the forward is also a catch
        assert "RankFailure" in type(e).__name__ or isinstance(e, RuntimeError), e
        return
    assert not result.passed
    assert result.rel_diff > 1e-3, f"wrong mapping {name} was off by only {result.rel_diff:.2g}"


def test_when_keeps_dense_entries_off_configs_without_dense_layers(ranks, tmp_path):
    """Qwen3-MoE's dense-MLP entries apply only where mlp_only_layers makes dense layers: without the
    `when`, a config whose layers are all sparse has no module for them, and apply refuses."""
    path = edited_copy(tmp_path, "qwen3_moe-no-when", "qwen3_moe", "    when: {mlp_only_layers: [[0]]}\n", "",
                       every=True)
    with pytest.raises(Exception, match="pattern matches no module"):
        run_case(ranks, first_case(path, 2, verify_index=0))


WRONG_GRADS = {  # DeepSeek-V3's MLA: the shared rope key's gradient, summed once, and the norm between
    # the residual stream's gradient misses the other ranks' k_rot parts: wrong all the way down
    "no-enter": ("  - kind: Enter                  # [c_kv | k_rot]: this rank's heads consume k_rot directly\n"
                 "    module: layers.*.self_attn.kv_a_proj_with_mqa\n", "", "layers."),
    # c_kv's gradient all-reduced twice: ws times too large for the latent path
    "copy-input-twice": ("    copy_input: false            # its input's gradient is all-reduced by the Enter above\n",
                         "", "kv_a_proj_with_mqa"),
    # the norm's weight sees this rank's heads only
    "no-grad-allreduce": ("grad_allreduce: [layers.*.self_attn.kv_a_layernorm]", "", "kv_a_layernorm"),
}


@pytest.mark.parametrize("name", WRONG_GRADS)
def test_deepseek_mla_gradients_need_enter_copy_input_and_grad_allreduce(ranks, tmp_path, name):
    old, new, where = WRONG_GRADS[name]
    path = str(edited_copy(tmp_path, f"deepseek_v3-{name}", "deepseek_v3", old, new, every=True))
    for r in ranks(2).run(rank_cases.grad_case, path, 0, "DeepseekV3ForCausalLM", False, torch.float64):
        assert r["worst_rel"] > 1e-2 and any(where in n for n, rel in r["rels"].items() if rel > 1e-2), r


def test_jetmoe_refuses_more_ranks_than_kv_heads_instead_of_copying_them():
    """JetMoE's query heads ride on its KV heads inside a partial sum: a KV head held by two ranks (the even rule's
    replication, 4 heads at 8) would count its query heads twice. Its Params say replicate_heads: false; before,
    per_rank(num_key_value_heads) let ws 8 plan (planted: the flag ignored fails this)."""
    from tpmap import verify
    from tpmap.errors import DivisibilityError
    model = verify.build_model("jetmoe", 1, "JetMoeForCausalLM")  # untied-top1: 4 KV heads
    refused = (r"jetmoe\.yaml:\d+:\d+: .*4 heads cannot be split over world size 8 "
               r".*replicate_heads: false cannot\); world sizes that work: 1, 2, 3, 4")
    with pytest.raises(DivisibilityError, match=refused):
        tpmap.plan(model, 8)
    assert tpmap.plan(model, 3).uneven  # 2/1/1 heads: served
