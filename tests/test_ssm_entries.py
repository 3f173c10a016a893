"""The entries the SSM mappings (mamba, mamba2, jamba, falcon_mamba) rely on are needed: drop one from a
copy of the shipped YAML and the comparison against the unsharded model fails, by a large difference or
an error, never a pass. Modelled on test_forward's WRONG_MAPPINGS.

* Param on a depthwise nn.Conv1d (its weight [C, 1, K] split by channel) and its sections (Mamba-2's
  conv over [x | B | C]);
* Reduce on Jamba's experts block;
* Enter on Mamba's x_proj / Jamba's dt/B/C norms: the forward is unchanged without it, but every rank
  reads the whole [dt | B | C] with its own channels only, so the gradients of x_proj and below are
  partial sums -- caught by the per-shard gradient comparison;
* Mamba-2's gated norm as a Norm entry (group_size, gate): with fewer groups than ranks its per-group statistic
  spans ranks and is all-reduced; a mapping that splits the norm's weight with a Param instead (the module's own
  statistic over this rank's channels only) is wrong.
"""
from __future__ import annotations

import pytest
import rank_cases
import torch
from helpers import DIFFERENCE, assert_caught, edited_copy, first_case, run_case, write_mapping

# name: (model type, text of the shipped YAML, replacement, the failure it causes: assert_caught's `expect`)
FORWARD_WRONG = {
    # the depthwise conv kept whole: its I filters meet the I/ws channels of this rank, and x_proj (I/ws = 96
    # inputs per rank) gets all I = 192 channels
    "mamba-conv-not-split": ("mamba", "  - kind: Param\n    module: layers.*.mixer.conv1d\n"
                             "    params: [weight, bias]          "
                             "# weight [I, 1, K], bias [I]: one filter per channel\n"
                             "    dim: 0\n", "",
                             r"mat1 and mat2 shapes cannot be multiplied \(\d+x192 and 96x\d+\)"),
    # Mamba-2's conv over [x | B | C] split as one block: channels of x paired with filters of B/C
    "mamba2-conv-without-sections": ("mamba2", "    dim: 0\n    sections:\n"
                                     "      - {size: num_heads * head_dim, heads: n_groups}    # x\n"
                                     "      - {size: n_groups * state_size, heads: n_groups}   # B\n"
                                     "      - {size: n_groups * state_size, heads: n_groups}   # C\n", "    dim: 0\n",
                                     DIFFERENCE),
    # Jamba's experts without their Reduce: each rank's partial sum is taken for the whole
    "jamba-experts-not-reduced": ("jamba", "  - kind: Reduce\n    module: layers.*.feed_forward.experts"
                                  "  # each rank's output is a partial sum over its slice of I\n", "", DIFFERENCE),
}

GRAD_WRONG = {
    "mamba-no-enter": ("mamba", "MambaForCausalLM",
                       "  - kind: Enter\n    module: layers.*.mixer.x_proj   # [dt | B | C] is consumed per rank: "
                       "sum its gradient (see above)\n"),
    "jamba-no-enter": ("jamba", "JambaForCausalLM",
                       "  - kind: Enter\n    module: layers.*.mamba.*_layernorm   # dt_, b_, c_layernorm: whole dt, "
                       "B, C read by this rank's channels\n"),
}


@pytest.mark.parametrize("name", FORWARD_WRONG)
def test_a_wrong_ssm_mapping_is_caught(ranks, tmp_path, name):
    model_type, old, new, expect = FORWARD_WRONG[name]
    path = edited_copy(tmp_path, name, model_type, old, new, once=True)
    assert_caught(ranks, path, name, expect=expect)


@pytest.mark.parametrize("name", GRAD_WRONG)
def test_without_the_enter_the_x_proj_gradients_are_partial(ranks, tmp_path, name):
    model_type, class_name, entry = GRAD_WRONG[name]
    path = str(edited_copy(tmp_path, name, model_type, entry, "", once=True))
    for r in ranks(2).run(rank_cases.grad_case, path, 0, class_name, False, torch.float64):
        assert r["loss_diff"] <= 1e-9 * max(1.0, r["loss"]), r  # the forward is right without it...
        assert any("x_proj" in n for n, rel in r["rels"].items() if rel > 1e-2), r  # ...the gradients are not


@pytest.mark.parametrize("world_size", [2, 3])
def test_mamba2_with_one_group_is_exact_in_every_gradient(ranks, world_size):
    """n_groups: 1 (state-spaces/mamba2-*, Bamba-9B): B and C on every rank (query_heads), the gated norm's
    statistic over the whole I all-reduced (Norm group_size + gate). Forward as verify runs it; every
    gradient per shard, B/C's replicated conv filters and in_proj rows summed over their holders."""
    case = first_case("mamba2", world_size, config_name="h8-g1")
    result = run_case(ranks, case)
    assert result.passed and result.rel_diff < 1e-5, result
    for r in ranks(world_size).run(rank_cases.grad_case, "mamba2", case.verify_index, "Mamba2ForCausalLM", False,
                                   torch.float64):
        # transformers' Mamba-2 scan casts to float32 inside (B.float(), ...) even in an fp64 model: ~4e-7
        assert r["loss_diff"] <= 1e-6 * max(1.0, r["loss"]), r
        assert r["rels"] and max(r["rels"].values()) < 1e-5, r


def test_a_grouped_norm_is_local_only_where_every_rank_holds_whole_groups():
    """The grouped Norm adds no collective where every rank holds whole groups, each once and contiguous (the divisible
    path as the unsharded module computes it); a group split over ranks, or held twice, all-reduces its sums --
    and every rank decides alike (a collective that one rank skips hangs). One group is the plain statistic."""
    from tpmap.engine import shard
    from tpmap.engine.plan import ParamLayout

    def decide(pieces, group_size, replicated=False):
        layout = ParamLayout(name="norm.weight", full_shape=(16,), dim=0, pieces=pieces, replicated_heads=replicated)
        return [shard.norm_groups(layout, r, group_size, torch.empty(0)) for r in range(len(pieces))]

    whole = decide((((0, 8),), ((8, 8),)), 4)  # 4 groups of 4 at 2 ranks: 2 whole groups each
    assert all(index is None and local for index, local in whole), whole
    split = decide((((0, 6),), ((6, 5),), ((11, 5),)), 4)  # 16 features over 3 ranks: groups 1 and 2 span ranks
    assert not any(local for _, local in split), split
    assert [index.tolist() for index, _ in split] == [[0, 0, 0, 0, 1, 1], [1, 1, 2, 2, 2], [2, 3, 3, 3, 3]]
    swapped = decide((((4, 4), (0, 4)), ((8, 8),)), 4)  # whole groups stored in another order: still local
    assert all(local for _, local in swapped)
    interleaved = decide((((0, 2), (8, 4), (2, 2)), ((4, 4), (12, 4))), 4)  # group 0 whole, but not contiguous
    assert not any(local for _, local in interleaved)
    twice = decide((((0, 8),), ((8, 8),)), 4, replicated=True)  # some features held by two ranks
    assert not any(local for _, local in twice)
    assert decide((((0, 8),), ((8, 8),)), 16) == [(None, False), (None, False)]  # one group: the plain sum


@pytest.mark.parametrize(("world_size", "local"), [(2, True), (3, False)])
def test_a_grouped_norm_is_exact_with_whole_groups_and_with_groups_split_over_ranks(ranks, tmp_path, world_size,
                                                                                    local):
    """The shipped one-group layout (heads split, B/C following them, the grouped gated Norm) applied to 4 groups of
    2 heads: at world size 2 every rank holds 2 whole groups and computes their statistics alone; at 3 (heads
    3/3/2) groups 1 and 2 span ranks and their sums are all-reduced. Forward and every fp64 gradient."""
    from transformers import AutoConfig, Mamba2ForCausalLM

    from tpmap.engine import planner, shard
    from tpmap.language import source

    path = edited_copy(tmp_path, "mamba2_grouped_norm", "mamba2", "when: {n_groups: 1}", "when: {n_groups: {gt: 0}}",
                       every=True)
    path.write_text(path.read_text().replace("when: {n_groups: {gt: 1}}", "when: {n_groups: {gt: 99}}"))
    loaded = source.read_file(path)
    with torch.device("meta"):
        model = Mamba2ForCausalLM(AutoConfig.for_model("mamba2", **loaded.mapping.verify[0].config))  # h8-g4
    norms = [m for m in planner.build_plan(model, loaded, world_size).modules if m.name.endswith("mixer.norm")]
    assert norms and all(shard.norm_groups(m.weight, 0, m.group_size, torch.empty(0))[1] == local for m in norms)
    case = first_case(path, world_size, config_name="h8-g4")
    result = run_case(ranks, case)
    assert result.passed and result.rel_diff < 1e-5, result
    for r in ranks(world_size).run(rank_cases.grad_case, str(path), case.verify_index, "Mamba2ForCausalLM", False,
                                   torch.float64):
        assert r["loss_diff"] <= 1e-6 * max(1.0, r["loss"]), r  # the scan casts to float32 inside (see above)
        assert r["rels"] and max(r["rels"].values()) < 1e-5, r


# Mamba-2 with its heads split one by one and B/C replicated where there are fewer groups than ranks (as the
# shipped mapping does), but the gated norm's weight split by a Param: its statistic then spans this rank's
# channels only -- what the shipped mapping's Norm entry (group_size, its sums all-reduced) prevents
REPLICATED_GROUPS = """model_type: mamba2
entries:
  - kind: Column
    module: layers.*.mixer.in_proj
    sections:
      - {size: num_heads * head_dim, heads: num_heads}
      - {size: num_heads * head_dim, heads: num_heads}
      - {size: n_groups * state_size, heads: n_groups}
      - {size: n_groups * state_size, heads: n_groups}
      - {size: num_heads, heads: num_heads}
  - kind: Param
    module: layers.*.mixer.conv1d
    params: [weight, bias]
    dim: 0
    sections:
      - {size: num_heads * head_dim, heads: num_heads}
      - {size: n_groups * state_size, heads: n_groups}
      - {size: n_groups * state_size, heads: n_groups}
  - kind: Update
    module: layers.*.mixer.conv1d
    attributes:
      groups: per_rank(num_heads) * head_dim + 2 * per_rank(n_groups) * state_size
      in_channels: per_rank(num_heads) * head_dim + 2 * per_rank(n_groups) * state_size
      out_channels: per_rank(num_heads) * head_dim + 2 * per_rank(n_groups) * state_size
  - kind: Param
    module: layers.*.mixer
    params: [A_log, D, dt_bias]
    dim: 0
    heads: num_heads
  - kind: Param
    module: layers.*.mixer.norm
    params: [weight]
    dim: 0
    heads: num_heads
  - kind: Update
    module: layers.*.mixer
    attributes:
      num_heads: per_rank(num_heads)
      n_groups: per_rank(n_groups)
      intermediate_size: per_rank(num_heads) * head_dim
      conv_dim: per_rank(num_heads) * head_dim + 2 * per_rank(n_groups) * state_size
  - kind: Update
    module: layers.*.mixer.norm
    attributes:
      group_size: per_rank(num_heads) * head_dim // per_rank(n_groups)
  - kind: Row
    module: layers.*.mixer.out_proj
    heads: num_heads
vocab_parallel: {embedding: true, lm_head: true}
verify:
  - name: h8-g1
    config: {hidden_size: 64, expand: 2, num_heads: 8, head_dim: 16, n_groups: 1, state_size: 8,
             chunk_size: 4, conv_kernel: 4, num_hidden_layers: 2, vocab_size: 256}
    models: [Mamba2ForCausalLM]
    world_sizes: [2]
"""


def test_mamba2_groups_replicated_like_kv_heads_would_be_wrong(ranks, tmp_path):
    """What the Norm entry prevents: B/C of the one group replicated on both ranks (as KV heads are) and the
    gated norm taking its statistic over this rank's half of the group only -- off by O(1)."""
    path = write_mapping(tmp_path, "mamba2_replicated_groups", REPLICATED_GROUPS)
    result = run_case(ranks, first_case(path, 2))
    assert not result.passed and result.rel_diff > 1e-3, result
