"""The long-tail features the MoE mappings rely on: each is needed, so a mapping without it is caught
(a wrong forward, wrong gradients or an error), and the small engine fixes they needed."""
from __future__ import annotations

import pytest
import torch
import transformers

import tpmap
from tpmap.loader import load_text

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
