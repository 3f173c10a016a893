"""The planning `tpmap lint` runs: engine.plan.build in collecting mode agrees with raising mode (what
`tpmap.apply` runs: same first problem, same plan when clean); expressions of entries that match
nothing; the cut default config; a mapping's default_config patches."""
from __future__ import annotations

import pytest
import torch
import transformers
from helpers import edited, edited_copy, mapping_text, replaced
from transformers import AutoConfig

from tpmap.engine import planner
from tpmap.language import source
from tpmap.language.errors import TpmapError


def tiny(model_type: str):
    spec = source.for_model_type(model_type).mapping.verify[0]
    with torch.device("meta"):
        return getattr(transformers, spec.models[0])(AutoConfig.for_model(model_type, **spec.config))


def broken_llama():
    text = mapping_text("llama")
    for old, new in [("module: layers.*.mlp.up_proj", "module: layers.*.mlp.upproj"),
                     ("heads: num_key_value_heads", "heads: num_kv_heads"),
                     ("    module: layers.*.mlp.down_proj", "    module: layers.*.mlp.down_proj\n    reverse: true"),
                     ("num_key_value_groups: per_rank", "num_key_value_group: per_rank")]:
        text = replaced(text, old, new)
    return source.load_text(text, "broken.yaml")


def test_collecting_finds_every_problem_and_the_first_is_what_apply_raises():
    model, loaded = tiny("llama"), broken_llama()
    errors: list[TpmapError] = []
    planner.build_plan(model, loaded, 2, errors)
    # (Updates are planned after the other entries: they read whether a split is uneven)
    assert [e.rule for e in errors] == ["config-attribute", "pattern-no-match", "orientation", "update-attribute"]
    assert all(str(e) == f"{e.position}: {e.message}" for e in errors)
    with pytest.raises(TpmapError) as raised:
        planner.build_plan(model, loaded, 2)
    assert str(raised.value) == str(errors[0]) and type(raised.value) is type(errors[0])


@pytest.mark.per_family
@pytest.mark.parametrize("model_type", sorted(source.shipped_files()))
def test_clean_mapping_gives_the_same_plan_in_both_modes(model_type):
    model, loaded = tiny(model_type), source.for_model_type(model_type)
    errors: list[TpmapError] = []
    assert planner.build_plan(model, loaded, 2, errors) == planner.build_plan(model, loaded, 2)
    assert errors == []


def test_check_expressions_covers_entries_that_match_nothing():
    text = edited("gpt2", "  - kind: Row\n    module: h.*.mlp.c_proj\n",
                  "  - kind: Row\n    module: h.*.mlp.cproj\n    heads: n_heads\n", every=True)
    loaded = source.load_text(text, "g.yaml")
    found = planner.check_expressions(tiny("gpt2").config, loaded)
    line = text.splitlines().index("    heads: n_heads") + 1
    assert [(e.rule, e.position.line, e.position.col) for e in found] == [("config-attribute", line, 12)]
    assert "has no attribute 'n_heads' (did you mean n_head?)" in found[0].message


def test_the_reduced_default_config_keeps_one_layer_of_every_kind():
    """Lint cuts the default config to 2 layers, but not below the first layer of each kind in
    `layer_types`: Jamba's first attention layer is layer 4 (a 2-layer cut left its attention entries
    matching nothing)."""
    from tpmap.meta import reduced_default_config

    jamba = reduced_default_config("jamba")
    assert set(jamba.layer_types) == {"linear_attention", "full_attention"}
    assert jamba.num_hidden_layers == 5
    assert reduced_default_config("llama").num_hidden_layers == 2  # one kind: still 2


def test_the_reduced_default_config_keeps_a_sub_configs_per_layer_settings_of_its_layers():
    """Gemma 4's default text_config sets per_layer_config for layers 11-29 (transformers rejects keys beyond
    num_hidden_layers): the cut keeps those of the layers it keeps, so the reduced config builds."""
    from tpmap.meta import reduced_default_config

    full = transformers.AutoConfig.for_model("gemma4").text_config
    assert any(int(k) >= 2 for k in full.to_dict()["per_layer_config"])  # the case: layers the cut drops
    text = reduced_default_config("gemma4").text_config
    assert text.num_hidden_layers == 6  # layers 0-5 hold one of each kind (the first full-attention layer is 5)
    assert [int(k) for k in text.to_dict()["per_layer_config"]] == [5]  # layer 5's setting kept, 11-29 dropped


def test_the_reduced_default_config_cuts_every_per_layer_kind_list_of_a_sub_config():
    """Step 3.7's text_config lists two per-layer kinds (layer_types and mlp_layer_types, 45 entries each, which
    transformers requires to match num_hidden_layers): the cut shortens both, so the reduced config builds."""
    from tpmap.meta import reduced_default_config

    text = reduced_default_config("step3p7").text_config
    assert len(text.layer_types) == len(text.mlp_layer_types) == text.num_hidden_layers < 45

def test_default_config_patches_a_default_transformers_cannot_build(tmp_path):
    """DBRX's default config does not build in transformers 5.24; the mapping's default_config supplies the
    two missing values, without which lint can only report model-build (and checks no world size)."""
    from tpmap.language import source
    from tpmap.lint import lint_file

    text = mapping_text("dbrx")
    assert lint_file(str(source.shipped_files()["dbrx"])) == []
    line = next(x for x in text.splitlines() if x.startswith("default_config:"))
    path = edited_copy(tmp_path, "dbrx", "dbrx", line + "\n", "", every=True)
    assert [d.rule for d in lint_file(str(path))] == ["model-build"]
