"""The plan is pure data computed from the mapping and the model's structure: checked here on
meta-device models, without processes and without touching a tensor's values."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers
from helpers import not_proven_uneven

import tpmap
from tpmap import cli, verify
from tpmap.engine.shard import gather_order, take

ROOT_MAPPINGS = Path(__file__).resolve().parents[1] / "mappings"


def meta_model(model_type: str, verify_index: int = 0, **overrides):
    spec = verify.resolve(model_type).mapping.verify[verify_index]
    config = transformers.AutoConfig.for_model(model_type, **{**spec.config, **overrides})
    with torch.device("meta"):
        return getattr(transformers, spec.models[0])(config)


def test_gpt2_fused_qkv_conv1d_pieces():
    plan = tpmap.plan(meta_model("gpt2"), 2)  # n_embd 96, 12 heads: each of q, k, v has 96 features
    w = plan.params["transformer.h.0.attn.c_attn.weight"]
    assert w.full_shape == (96, 288) and w.dim == 1  # Conv1D stores [in, out]: the out dim is 1
    assert w.pieces[0] == ((0, 48), (96, 48), (192, 48))  # [q_0 | k_0 | v_0]
    assert w.pieces[1] == ((48, 48), (144, 48), (240, 48))  # [q_1 | k_1 | v_1]
    b = plan.params["transformer.h.0.attn.c_attn.bias"]
    assert b.dim == 0 and b.pieces == w.pieces
    proj = plan.params["transformer.h.0.attn.c_proj.weight"]
    assert proj.dim == 0 and proj.pieces[1] == ((48, 48),)  # Row on [in, out]: the in dim is 0
    assert plan.params["transformer.h.0.attn.c_proj.bias"].dim is None  # added once after the reduce
    updates = {(u.module, u.attribute): u.values for u in plan.updates}
    assert updates[("transformer.h.0.attn", "split_size")] == (48, 48)
    assert updates[("transformer.h.0.attn", "num_heads")] == (6, 6)


def test_llama_kv_heads_fewer_than_ranks_are_replicated():
    plan = tpmap.plan(meta_model("llama"), 4)  # 12 q heads, 2 kv heads, head_dim 8
    k = plan.params["model.layers.1.self_attn.k_proj.weight"]
    assert k.replicated_heads
    assert [k.pieces[r] for r in range(4)] == [((0, 8),), ((0, 8),), ((8, 8),), ((8, 8),)]  # head r // 2
    q = plan.params["model.layers.1.self_attn.q_proj.weight"]
    assert not q.replicated_heads and q.pieces[3] == ((72, 24),)
    groups = {u.values for u in plan.updates if u.attribute == "num_key_value_groups"}
    assert groups == {(3, 3, 3, 3)}  # 3 local q heads share 1 local kv head
    assert {u.values for u in tpmap.plan(meta_model("llama"), 2).updates} == {(6, 6)}  # unchanged at ws 2


def test_phi3_unequal_sections_and_config_update():
    plan = tpmap.plan(meta_model("phi3"), 2)  # q 12 heads, k and v 4 heads each, head_dim 8
    qkv = plan.params["model.layers.0.self_attn.qkv_proj.weight"]
    assert qkv.full_shape == (160, 96)
    assert qkv.pieces[1] == ((48, 48), (112, 16), (144, 16))
    gate_up = plan.params["model.layers.0.mlp.gate_up_proj.weight"]
    assert gate_up.pieces[1] == ((96, 96), (288, 96))  # [gate_1 | up_1]
    via_config = [u for u in plan.updates if u.via_config]
    assert via_config and all(u.attribute == "config.num_attention_heads" and u.values == (6, 6) for u in via_config)


def test_t5_relative_bias_embedding_split_by_heads():
    plan = tpmap.plan(meta_model("t5"), 3)
    bias = plan.params["encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"]
    assert bias.dim == 1 and bias.full_shape == (16, 12) and bias.local_shape(2) == (16, 4)
    assert "decoder.block.1.layer.0.SelfAttention.relative_attention_bias.weight" not in plan.params


def test_take_and_gather_order_roundtrip():
    plan = tpmap.plan(meta_model("gpt2"), 3)
    shard = plan.params["transformer.h.0.attn.c_attn.weight"]
    full = torch.arange(96 * 288, dtype=torch.float32).reshape(96, 288)
    parts = [take(full, shard, r) for r in range(3)]
    assert all(p.shape == (96, 96) for p in parts)
    cat = torch.cat(parts, dim=1)  # rank-major, as an all-gather returns it
    assert torch.equal(cat.index_select(1, gather_order(shard)), full)


def test_plan_reads_no_tensor_data():
    """The plan of a meta model (no storage at all) equals the plan of a real model with weights."""
    real = verify.build_model("gpt_neox", 0, "GPTNeoXForCausalLM")
    assert tpmap.plan(real, 4).params == tpmap.plan(meta_model("gpt_neox"), 4).params


def test_plan_cli_prints_table(capsys, tmp_path):
    assert cli.main(["plan", "llama", "-n", "4"]) == 0
    out = capsys.readouterr().out
    assert "model.layers.0.self_attn.k_proj.weight" in out and "r3:8:8" in out
    unproven = str(not_proven_uneven(tmp_path, "gpt2"))
    assert cli.main(["plan", unproven, "-n", "8", "--default-config", "--rank", "0"]) == 1  # 12 heads / 8: uneven
    err = capsys.readouterr().err  # and this copy of gpt2's mapping is not proven uneven
    assert "transformer.h.0.attn.c_attn would be split unevenly at world size 8" in err and "uneven: true" in err, err
    assert cli.main(["plan", "gpt2", "-n", "13", "--default-config", "--rank", "0"]) == 1  # fewer heads than ranks
    assert "12 heads cannot be split over world size 13" in capsys.readouterr().err


def test_plan_cli_prints_each_ranks_heads_and_share(capsys):
    """bert's first config: 12 heads of 8 at 5 ranks are 3, 3, 2, 2, 2 (max/mean 3 / 2.4); the local shapes differ."""
    assert cli.main(["plan", "bert", "-n", "5"]) == 0
    out = capsys.readouterr().out
    assert "# heads (of 12) per rank: 3, 3, 2, 2, 2 (max/mean 1.25, uneven)" in out, out[:600]
    assert "# share of " in out and "(24|24|16|16|16, 96)" in out, out[:1200]
    assert cli.main(["plan", "llama", "-n", "4"]) == 0
    out = capsys.readouterr().out
    assert "# heads (of 12) per rank: 3, 3, 3, 3 (max/mean 1.00)" in out, out[:600]


@pytest.mark.parametrize("model_type", ["gpt2", "llama", "bert", "t5", "gpt_neox", "phi3"])
def test_default_configs_plan_at_declared_world_sizes(model_type):
    """The real-size default config of each model type plans at every world size its file declares."""
    loaded = verify.resolve(model_type)
    config = transformers.AutoConfig.for_model(model_type)
    config.num_hidden_layers = 1  # structure per layer is what matters; keeps the meta build fast
    with torch.device("meta"):
        model = getattr(transformers, loaded.mapping.verify[0].models[0])(config)
    for ws in loaded.mapping.world_sizes:
        assert tpmap.plan(model, ws).tp_size == ws


def test_lookup_bypass_reads_every_forward_above_nn_embedding():
    """Which nn.Embedding subclasses can be vocab-split under their own forward: those whose forward
    reaches nn.Embedding.forward through super(); the others are named (refused by the plan)."""
    import functools

    import torch.nn.functional as F
    from torch import nn

    from tpmap.engine.layers import lookup_bypass, vocab_parallel_class

    class Scaled(nn.Embedding):
        def forward(self, ids):
            return super().forward(ids) * 2.0

    class ExplicitSuper(nn.Embedding):
        def forward(self, ids):
            return super().forward(ids) + 1.0

    def wrapped(f):
        @functools.wraps(f)
        def inner(*args, **kwargs):
            return f(*args, **kwargs)
        return inner

    class Decorated(nn.Embedding):
        @wrapped
        def forward(self, ids):
            return super().forward(ids)

    class NoForward(Scaled):
        pass

    class Direct(nn.Embedding):
        def forward(self, ids):
            return F.embedding(ids, self.weight) * 2.0

    class Indexing(nn.Embedding):
        def forward(self, ids):
            return self.weight[ids]

    class ByName(nn.Embedding):
        def forward(self, ids):
            return nn.Embedding.forward(self, ids)

    class DirectOverScaled(Scaled):  # the subclass bypasses, although its base would not
        def forward(self, ids):
            return F.embedding(ids, self.weight)

    for ok in (nn.Embedding, Scaled, ExplicitSuper, Decorated, NoForward):
        assert lookup_bypass(ok) is None, ok
    for bad in (Direct, Indexing, ByName, DirectOverScaled):
        assert lookup_bypass(bad) == f"{bad.__module__}.{bad.__qualname__}.forward", bad
    combined = vocab_parallel_class(Scaled)
    assert vocab_parallel_class(Scaled) is combined and combined.__name__ == "VocabParallelScaled"
    assert combined.__mro__[1] is Scaled and issubclass(combined, nn.Embedding)
    assert lookup_bypass(combined) is None


def test_shipped_scaled_word_embeddings_route_through_the_lookup():
    from tpmap.engine.layers import lookup_bypass

    for model_type in ("gemma2", "gemma3_text", "bart"):
        emb = meta_model(model_type).get_input_embeddings()
        assert type(emb).__name__.endswith("ScaledWordEmbedding") and lookup_bypass(type(emb)) is None


def test_when_reads_an_absent_attribute_as_its_declared_default_else_null():
    from types import SimpleNamespace

    from tpmap.language.schema import config_matches

    lacks, has = SimpleNamespace(), SimpleNamespace(share_att_key=True)
    assert not config_matches({"share_att_key": False}, lacks)  # absent, no default: null, not False
    assert config_matches({"share_att_key": None}, lacks)
    assert not config_matches({"share_att_key": {"not": None}}, lacks)
    assert config_matches({"share_att_key": False}, lacks, {"share_att_key": False})  # the model's default
    assert not config_matches({"share_att_key": None}, lacks, {"share_att_key": False})
    assert not config_matches({"share_att_key": False}, has, {"share_att_key": False})  # the config's value wins
    either = {"share_att_key": [True, None]}
    assert config_matches(either, has) and config_matches(either, lacks)


def test_expressions_read_a_declared_default_where_the_config_lacks_it():
    from tpmap.language import source

    loaded = source.load_text(
        "model_type: llama\nconfig_defaults: {head_groups: 2}\nentries:\n"
        "  - {kind: Column, module: layers.*.self_attn.q_proj, heads: num_attention_heads // head_groups * 2}\n"
        "verify:\n  - {config: {}, models: [LlamaForCausalLM]}\n", "m.yaml")
    from tpmap.engine import planner

    ctx = planner.EntryContext(transformers.LlamaConfig(), loaded, 0, 1)
    assert ctx.eval("num_attention_heads // head_groups") == 16


def test_a_default_config_patch_with_more_layers_is_still_cut_for_lint():
    from tpmap.meta import reduced_default_config

    config = reduced_default_config("llama", {"num_hidden_layers": 6, "vocab_size": 300})
    assert config.num_hidden_layers == 2 and config.vocab_size == 300


def test_an_entry_applies_only_on_the_transformers_releases_of_its_range():
    """One entry per layout of a module that a release renamed: each applies on its own releases only, so
    two entries for one module never both claim it, and the plan holds the installed release's entry."""
    from tpmap.language import source
    from tpmap.language.schema import release_matches

    assert release_matches(">=5.24", "5.24.0") and not release_matches(">=5.24", "5.23.0")
    assert release_matches("<5.24", "5.23.0") and release_matches(None, "5.23.0")
    installed = transformers.__version__
    text = (LLAMA_ATTENTION + "  - {kind: Row, module: layers.*.self_attn.o_proj, heads: num_attention_heads, "
            f"transformers: '=={installed}'}}\n"
            "  - {kind: Column, module: layers.*.self_attn.o_proj, "
            f"transformers: '!={installed}'}}\n" + LLAMA_VERIFY)
    plan = tpmap.plan(meta_model("llama"), 2, mapping=source.load_text(text, "m.yaml"))
    assert plan.params["model.layers.0.self_attn.o_proj.weight"].dim == 1  # the Row: the installed release's
    elsewhere = text.replace(f"'=={installed}'", "'<1'").replace(f"'!={installed}'", "'>=1'")
    plan = tpmap.plan(meta_model("llama"), 2, mapping=source.load_text(elsewhere, "m.yaml"))
    assert plan.params["model.layers.0.self_attn.o_proj.weight"].dim == 0  # the other entry (a Column here)
    skipped = text.replace(f"'=={installed}'", "'<1'").replace(f"'!={installed}'", "'<1'")
    plan = tpmap.plan(meta_model("llama"), 2, mapping=source.load_text(skipped, "m.yaml"))
    assert "model.layers.0.self_attn.o_proj.weight" not in plan.params  # neither applies: o_proj stays whole


LLAMA_ATTENTION = """model_type: llama
entries:
  - {kind: Column, module: layers.*.self_attn.q_proj, heads: num_attention_heads}
  - {kind: Column, module: layers.*.self_attn.k_proj, heads: num_key_value_heads}
  - {kind: Column, module: layers.*.self_attn.v_proj, heads: num_key_value_heads}
"""
LLAMA_VERIFY = "verify:\n  - {config: {}, models: [LlamaForCausalLM]}\n"


def test_when_layer_selects_the_modules_of_the_layers_whose_per_layer_entry_matches():
    """Gemma 2's layers alternate sliding and full attention in one class: `when_layer` gives each kind its own
    entry (here k_proj by 2 KV heads in sliding layers and by 1 group in full ones, to tell them apart)."""
    from tpmap.language import source
    from tpmap.language.errors import ConfigAttributeError

    model = meta_model("gemma2")  # layer_types [sliding_attention, full_attention], 2 KV heads of 8
    text = """model_type: gemma2
entries:
  - {kind: Column, module: layers.*.self_attn.k_proj, heads: num_key_value_heads,
     when_layer: {layer_types: sliding_attention}}
  - {kind: Column, module: layers.*.self_attn.k_proj, when_layer: {layer_types: [full_attention]}}
  - {kind: Column, module: layers.*.self_attn.v_proj, heads: num_key_value_heads,
     when_layer: {layer_types: {not: full_attention}}}
verify:
  - {config: {}, models: [Gemma2ForCausalLM]}
"""
    plan = tpmap.plan(model, 4, mapping=source.load_text(text, "m.yaml"))
    sliding, full = (plan.params[f"model.layers.{i}.self_attn.k_proj.weight"] for i in (0, 1))
    assert sliding.replicated_heads and [sliding.pieces[r] for r in range(4)] == [((0, 8),)] * 2 + [((8, 8),)] * 2
    assert not full.replicated_heads and full.pieces[3] == ((12, 4),)  # a plain even split: 16 / 4
    assert "model.layers.0.self_attn.v_proj.weight" in plan.params
    assert "model.layers.1.self_attn.v_proj.weight" not in plan.params  # {not: full_attention}: layer 0 only
    none = text.replace("layer_types: sliding_attention", "layer_types: chunked_attention")
    plan = tpmap.plan(model, 2, mapping=source.load_text(none, "m.yaml"))  # selects no layer: applies nowhere
    assert "model.layers.0.self_attn.k_proj.weight" not in plan.params
    wrong = text.replace("when_layer: {layer_types: [full_attention]}", "when_layer: {hidden_size: 96}")
    with pytest.raises(ConfigAttributeError, match=r"when_layer.hidden_size: the config's hidden_size is 96, not a "
                                                   r"list with one entry per layer") as e:
        tpmap.plan(model, 2, mapping=source.load_text(wrong, "m.yaml"))
    assert "m.yaml:5:" in str(e.value)


def test_an_entry_whose_when_layer_selects_no_layer_does_not_apply_even_where_its_modules_are_absent():
    """A layer kind a config does not have (a Nemotron-H stack without MLP layers) has no modules to match: the
    entry does not apply, as a false `when`; where the config has such a layer, a pattern matching nothing is the
    usual error."""
    from tpmap.language import source
    from tpmap.language.errors import PatternMatchError

    model = meta_model("gemma2")  # layer_types [sliding_attention, full_attention]
    text = """model_type: gemma2
entries:
  - {kind: Column, module: layers.*.self_attn.k_proj, heads: num_key_value_heads}
  - {kind: Column, module: layers.*.mlp.chunk_proj, when_layer: {layer_types: chunked_attention}}
verify:
  - {config: {}, models: [Gemma2ForCausalLM]}
"""
    plan = tpmap.plan(model, 2, mapping=source.load_text(text, "m.yaml"))
    assert "model.layers.0.self_attn.k_proj.weight" in plan.params
    selects = text.replace("layer_types: chunked_attention", "layer_types: sliding_attention")
    with pytest.raises(PatternMatchError, match=r"m.yaml:4:.*pattern matches no module"):
        tpmap.plan(model, 2, mapping=source.load_text(selects, "m.yaml"))



def test_a_heterogeneous_config_is_read_per_layer():
    """Step 3.5's sliding layers have their own query-head count (transformers' per_layer_config; the global
    num_attention_heads cannot be read): each module's expressions read its own layer's config, so layer 0 (full,
    12 heads) and layer 1 (sliding, 24 heads) split q_proj by their own heads and update num_heads per layer."""
    model = meta_model("step3p5")  # layer_types [full_attention, sliding_attention], 12 / 24 heads of 8, 2 KV
    plan = tpmap.plan(model, 4)
    full, sliding = (plan.params[f"layers.{i}.self_attn.q_proj.weight"] for i in (0, 1))
    assert full.full_shape[0] == 96 and full.pieces[1] == ((24, 24),)  # 3 of 12 heads per rank
    assert sliding.full_shape[0] == 192 and sliding.pieces[1] == ((48, 48),)  # 6 of 24 heads per rank
    heads = {u.module: u.values[0] for u in plan.updates if u.attribute == "num_heads"}
    assert heads == {"layers.0.self_attn": 3, "layers.1.self_attn": 6}, heads

@pytest.mark.skipif("dory" not in transformers.CONFIG_MAPPING, reason="dory needs transformers >= 5.24")
def test_an_l2_norm_without_a_weight_is_planned_as_a_statistic_only():
    """Dory's sub-norms (x / sqrt(sum(x^2) + eps), no weight) over split features: a norm shard with no tensor to
    slice; a layout on it is refused (nothing to lay out)."""
    from tpmap.engine.errors import ModuleKindError
    from tpmap.language import source

    model = meta_model("dory")
    plan = tpmap.plan(model, 2)
    norm = next(m for m in plan.modules if m.name == "model.layers.0.mlp.ffn_sub_norm")
    assert norm.style == "norm" and norm.statistic == "l2" and norm.weight is None and norm.bias is None
    assert not [n for n in plan.params if "sub_norm" in n]  # nothing to read or slice from a checkpoint
    text = (ROOT_MAPPINGS / "dory.yaml").read_text()
    text = text.replace("    statistic: l2\n", "    statistic: l2\n    heads: 12\n", 1)
    with pytest.raises(ModuleKindError, match=r"has no weight to lay out: remove heads/sections/groups"):
        tpmap.plan(model, 2, mapping=source.load_text(text, "dory.yaml"))



def test_has_dropout_reads_modules_their_configs_and_a_probability_stored_as_config():
    """Idefics' gated cross-attention layer keeps its dropout probability as `self.config` (a float): reading its
    attributes as a config's raised TypeError (vars() of a float) at every apply; it counts as a dropout now."""
    from types import SimpleNamespace

    from torch import nn

    from tpmap.engine.rng import has_dropout

    def holding(**attributes):
        module = nn.Module()
        module.__dict__.update(attributes)
        return module

    assert not has_dropout(holding(config=SimpleNamespace(attention_dropout=0.0)))
    assert has_dropout(holding(config=SimpleNamespace(attention_dropout=0.1)))
    assert has_dropout(holding(resid_pdrop=0.1)) and has_dropout(nn.Dropout(0.1)) and not has_dropout(nn.Dropout(0.0))
    assert has_dropout(holding(config=0.1)) and not has_dropout(holding(config=0.0))
    assert not has_dropout(holding(config="name"))  # neither a config object nor a probability


def test_at_layer_reads_the_per_layer_list_at_each_modules_layer():
    """Laguna's query-head count varies by layer (num_attention_heads_per_layer [12, 8], 4 KV heads): at_layer(...)
    gives each module its own layer's entry, so at world size 3 layer 0 splits 12 heads 4/4/4 and layer 1 splits
    8 heads 3/3/2, each layer's k/v follow its own query heads, and num_key_value_groups is per layer and rank."""
    model = meta_model("laguna")  # verify config kv4: head_dim 8
    plan = tpmap.plan(model, 3)
    q = [plan.params[f"model.layers.{i}.self_attn.q_proj.weight"].pieces for i in (0, 1)]
    assert q[0] == (((0, 32),), ((32, 32),), ((64, 32),)), q[0]  # 12 heads of 8: 4 per rank
    assert q[1] == (((0, 24),), ((24, 24),), ((48, 16),)), q[1]  # 8 heads: 3, 3, 2
    gate = plan.params["model.layers.1.self_attn.g_proj.weight"].pieces  # per-head gate [8]
    assert gate == (((0, 3),), ((3, 3),), ((6, 2),)), gate
    groups = {u.module: u.values for u in plan.updates if u.attribute == "num_key_value_groups"}
    # layer 0: rank 1's q heads 4..7 read KV [1, 1, 2, 2] (g 2); layer 1: rank 2's 6, 7 read KV [3, 3] (g 2)
    assert groups == {"model.layers.0.self_attn": (1, 2, 1), "model.layers.1.self_attn": (1, 1, 2)}, groups
    k = plan.params["model.layers.1.self_attn.k_proj.weight"].pieces[2]
    assert k == ((24, 8),), k  # layer 1, rank 2: KV head 3 once (its q heads 6, 7 are one group)


def test_at_layer_is_an_error_where_there_is_no_layers_entry(tmp_path):
    """at_layer(...) of a scalar, of a list shorter than the stack, for a module outside the stack, and in a verify
    input (no module at all): each a located error."""
    from tpmap.language import source
    from tpmap.language.errors import ConfigAttributeError, MappingErrors, PatternMatchError

    text = (ROOT_MAPPINGS / "laguna.yaml").read_text()
    q_heads = ("    heads: at_layer(num_attention_heads_per_layer)\n  - kind: Column\n"
               "    module: layers.*.self_attn.k_proj")
    assert q_heads in text
    model = meta_model("laguna")
    scalar = text.replace(q_heads, q_heads.replace("_per_layer", ""))
    with pytest.raises(ConfigAttributeError, match=r"laguna.yaml:\d+:\d+: .*q_proj.*at_layer\(num_attention_"
                                                   r"heads\): the config's num_attention_heads is 12, not a list"):
        tpmap.plan(model, 2, mapping=source.load_text(scalar, "laguna.yaml"))
    short = meta_model("laguna")
    short.config.num_attention_heads_per_layer = [12]  # one entry for two layers
    with pytest.raises(ConfigAttributeError, match=r"at_layer\(num_attention_heads_per_layer\): layers.1.self_attn"
                                                   r".q_proj is layer 1, but the config's "
                                                   r"num_attention_heads_per_layer lists 1 layers"):
        tpmap.plan(short, 2, mapping=source.load_text(text, "laguna.yaml"))
    outside = text.replace("entries:\n", "entries:\n  - kind: Update\n    module: norm\n    attributes:\n"
                           "      variance_epsilon: at_layer(num_attention_heads_per_layer)\n", 1)
    with pytest.raises(ConfigAttributeError, match=r"laguna.yaml:\d+:\d+: .*at_layer\(num_attention_heads_per_"
                                                   r"layer\) reads the entry of the module's layer, but norm is in no "
                                                   r"stack"):
        tpmap.plan(model, 2, mapping=source.load_text(outside, "laguna.yaml"))
    inputs = text.replace("    models: [LagunaForCausalLM]\n", "    models: [LagunaForCausalLM]\n"
                          "    inputs: {input_ids: {shape: [batch, at_layer(num_attention_heads_per_layer)]}}\n", 1)
    with pytest.raises(MappingErrors, match=r"laguna.yaml:\d+:\d+: .*a verify input belongs to no module"):
        source.load_text(inputs, "laguna.yaml")
    # a config object shared by the layers holds one value per rank: per-layer values are refused there
    shared = text.replace("      num_heads: per_rank(", "      config.num_key_value_heads: per_rank("
                          "num_key_value_heads, at_layer(num_attention_heads_per_layer))\n"
                          "      num_heads: per_rank(", 1)
    assert shared != text
    tpmap.plan(model, 2, mapping=source.load_text(shared, "laguna.yaml"))  # even: the same value in every layer
    with pytest.raises(PatternMatchError, match=r"layers.1.self_attn.config.num_key_value_heads is \[3, 3, 1\] per "
                                                r"rank, but model.layers.0.self_attn shares that config object"):
        tpmap.plan(model, 3, mapping=source.load_text(shared, "laguna.yaml"))


def test_at_layer_takes_one_attribute_name_and_needs_a_module():
    from tpmap.language import expr

    text = "per_rank(at_layer(h)) // per_rank(kv, at_layer(h))"
    assert expr.names(text) == {"h", "kv"} and expr.layer_lists(text) == ["h", "h"]
    assert expr.per_rank_calls(text) == [("at_layer(h)",), ("kv", "at_layer(h)")]  # at_layer is no per_rank call
    lookup = {"kv": 4}.__getitem__
    assert [expr.evaluate(text, lookup, 3, r, uneven=True, at_layer=lambda n: 8) for r in range(3)] == [1, 1, 2]
    for bad in ("at_layer(1)", "at_layer(h, kv)", "at_layer(tp_size)", "at_layer(h + 1)", "per_rank(kv, at_layer(2))"):
        with pytest.raises(expr.ExpressionError, match="at_layer takes one config attribute name"):
            expr.parse(bad)
    with pytest.raises(expr.ExpressionError, match=r"at_layer\(h\) reads the layer of the module"):
        expr.evaluate("at_layer(h)", lookup)
    with pytest.raises(expr.ExpressionError, match=r"h's entry for this layer is 'full', not an integer"):
        expr.evaluate("at_layer(h)", lookup, at_layer=lambda n: "full")


def test_zaya_splits_by_whole_query_groups_and_never_copies_a_kv_head():
    """ZAYA's key residual averages q + k over all G query heads of each KV head, so every split is in units of KV
    heads (KV/2 per half of the value), query heads G at a time: kv8 (16 heads, 8 KV, G 2, d 8) at 3 deals each
    half's 4 KV heads 2/1/1 with their query heads; more ranks than KV/2 (a KV head on two ranks) is refused."""
    model = meta_model("zaya", 2)  # kv8
    plan = tpmap.plan(model, 3)
    q = plan.params["model.layers.0.self_attn.qkv_proj.q_proj.weight"].pieces
    assert q == (((0, 32), (64, 32)), ((32, 16), (96, 16)), ((48, 16), (112, 16))), q
    updates = {u.attribute: u.values for u in plan.updates if u.module == "model.layers.0.self_attn"}
    assert updates == {"num_key_value_groups": (2, 2, 2), "num_attention_heads": (8, 4, 4),
                       "num_key_value_heads": (4, 2, 2)}, updates
    with pytest.raises(tpmap.DivisibilityError, match=r"o_proj: 2 heads cannot be split over world size 4"):
        tpmap.plan(meta_model("zaya", 0), 4)  # kv4: 2 KV heads per half
