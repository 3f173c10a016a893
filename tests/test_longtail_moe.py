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
