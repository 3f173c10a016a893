"""Expert parallelism (issue 38): whole experts per rank (a Param on dim 0 by experts, a Route entry rewriting the
routing arguments, a Reduce), against the unsharded model in the same run: the forward through verify, and every
gradient per shard in fp64 -- the router's included, which sees every expert's term only through the Reduce's
all-reduced input gradient. Experts that the world size does not divide are dealt 2/1/1 (4 at 3) and 2/2/1/1
(6 at 4)."""
from __future__ import annotations

import pytest
import rank_cases
import torch
from helpers import edited, first_case, replaced, run_case, write_mapping

# mappings/mixtral.yaml with its experts dealt whole (the split inside experts replaced)
SPLIT = """  - kind: Param
    module: layers.*.mlp.experts
    params: [gate_up_proj]
    dim: 1
    sections: 2                  # [gate | up]: each rank keeps [gate_r | up_r] of every expert
  - kind: Param
    module: layers.*.mlp.experts
    params: [down_proj]
    dim: 2
  - kind: Update
    module: layers.*.mlp.experts
    attributes:
      intermediate_dim: per_rank(intermediate_size)   # its width on this rank (aligned units, see above)
"""
PARALLEL = """  - kind: Param
    module: layers.*.mlp.experts
    params: [gate_up_proj, down_proj]   # [E, 2I, H], [E, H, I]: whole experts, dealt on dim 0
    dim: 0
    heads: num_local_experts
    query_heads: num_local_experts      # the experts: a family of their own
  - kind: Update
    module: layers.*.mlp.experts
    attributes:
      num_experts: per_rank(num_local_experts)
  - kind: Route
    module: layers.*.mlp.experts
    experts: num_local_experts
"""
E6 = """    world_sizes: [3]
  - name: e6-k3                 # 6 experts, 3 per token: 2/2/1/1 at 4 ranks, a token often on two of one rank's
    config: {hidden_size: 96, num_attention_heads: 12, num_key_value_heads: 4, intermediate_size: 96,
             num_hidden_layers: 2, vocab_size: 256, max_position_embeddings: 64, num_local_experts: 6,
             num_experts_per_tok: 3}
    models: [MixtralForCausalLM]
    world_sizes: [2, 3, 4]
"""


def parallel_mixtral(folder):
    text = edited("mixtral", SPLIT, PARALLEL, once=True)
    return write_mapping(folder, "mixtral_ep", replaced(text, "    world_sizes: [3]\n", E6, once=True))


@pytest.mark.parametrize(("world_size", "config"), [(2, "moe-kv2"), (3, "moe-kv6"), (3, "e6-k3"), (4, "e6-k3")])
def test_whole_experts_per_rank_are_exact(ranks, tmp_path, world_size, config):
    path = parallel_mixtral(tmp_path)
    case = first_case(path, world_size, config_name=config)
    result = run_case(ranks, case)
    assert result.passed and result.rel_diff < 1e-5, result
    for r in ranks(world_size).run(rank_cases.grad_case, str(path), case.verify_index, "MixtralForCausalLM", False,
                                   torch.float64):
        assert r["loss_diff"] <= 1e-12 * max(1.0, r["loss"]), r
        assert any("mlp.gate" in n for n in r["rels"]), r  # the router's gradient is compared
        assert any("experts" in n for n in r["rels"]), r
        assert max(r["rels"].values()) < 1e-9, r
