"""Composed mappings (`compose`, tpmap/language/compose.py) and the example inputs of multimodal models: plans
of meta-device models and example inputs, no processes. The composed mappings on real ranks (forward,
gradients, generate with the image inputs) are proven by tests/test_mappings.py like every shipped mapping,
and a wrong projector or vision-tower split is caught below (test_a_wrong_composed_mapping_is_caught)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers
from helpers import DIFFERENCE, assert_caught, edited, mapping_text, replaced, write_mapping

import tpmap
from tpmap import verify
from tpmap.engine.errors import UnsupportedConfigError
from tpmap.engine.planner import composed
from tpmap.language import expr, source
from tpmap.language.errors import ConfigAttributeError, MappingError, MappingErrors, PatternMatchError
from tpmap.tool_errors import MissingInputError

LLAVA = "llava"


def meta_llava(text: dict | None = None, vision: dict | None = None, cls: str = "LlavaForConditionalGeneration",
               **top):
    """The llava verify config's model on the meta device, with sub-config and top-level overrides."""
    spec = verify.resolve(LLAVA).mapping.verify[0].config
    config = transformers.AutoConfig.for_model(
        LLAVA, **{**spec, **top, "text_config": {**spec["text_config"], **(text or {})},
                  "vision_config": {**spec["vision_config"], **(vision or {})}})
    with torch.device("meta"):
        return getattr(transformers, cls)(config)


def composing(tmp_path: Path, compose: str, entries: str = "", name: str = "top") -> Path:
    """A llava mapping file in tmp_path whose compose section is `compose` (YAML text), with the verify
    config of the shipped one."""
    text = mapping_text(LLAVA)
    start, end = text.index("compose:\n"), text.index("entries:\n")
    text = text[:start] + compose + text[end:]
    if entries:
        text = replaced(text, "entries:\n", "entries:\n" + entries, once=True)
    return write_mapping(tmp_path, name, text)


def first_item_line(path: Path) -> int:
    """The line of the first compose item of a mapping file."""
    return path.read_text().splitlines().index("compose:") + 2


# -- the expansion ------------------------------------------------------------------------------------
def test_composed_entries_apply_under_the_sub_models_and_read_their_sub_configs():
    """Each composed file's entries reach its sub-model's modules, and their expressions read its sub-config:
    12 text heads and 6 vision heads at world size 2 give 6 and 3 heads per rank."""
    model = meta_llava(vision={"num_attention_heads": 6})
    plan = tpmap.plan(model, 2)
    params = plan.params
    assert params["model.language_model.layers.1.self_attn.q_proj.weight"].pieces[1] == ((48, 48),)
    assert params["model.vision_tower.encoder.layers.1.self_attn.q_proj.weight"].pieces[1] == ((48, 48),)
    assert params["model.multi_modal_projector.linear_1.weight"].dim == 0  # the llava file's own entries
    assert params["model.multi_modal_projector.linear_2.weight"].dim == 1
    updates = {(u.module, u.attribute): u.values for u in plan.updates}
    assert updates[("model.vision_tower.encoder.layers.0.self_attn", "num_heads")] == (3, 3)  # vision_config: 6
    assert updates[("model.vision_tower.encoder.layers.0.self_attn", "embed_dim")] == (48, 48)
    assert updates[("model.language_model.layers.0.self_attn", "num_key_value_groups")] == (1, 1)
    assert {m.name.split(".")[0] for m in plan.modules} == {"model", "lm_head"}
    # the bare LlavaModel has the same base model: the same split
    bare = tpmap.plan(meta_llava(cls="LlavaModel", vision={"num_attention_heads": 6}), 2)
    assert set(bare.params) == {n.removeprefix("model.") for n in params if not n.startswith("lm_head")}


def test_the_expanded_entries_keep_their_own_files_positions_and_scopes():
    model = meta_llava()
    loaded = verify.resolve(LLAVA)
    expanded = composed(model, loaded)
    assert not expanded.mapping.compose and len(loaded.mapping.entries) == 2
    kinds = [e.module for e in expanded.mapping.entries]
    assert kinds[:2] == ["multi_modal_projector.linear_1", "multi_modal_projector.linear_2"]
    llama, clip = source.shipped_files()["llama"], source.shipped_files()["clip_vision_model"]
    n_llama = len(source.read_file(llama).mapping.entries)
    assert kinds[2] == "language_model.layers.*.self_attn.q_proj"
    assert kinds[2 + n_llama] == "vision_tower.encoder.layers.*.self_attn.[qkv]_proj"
    first = expanded.source.value(("entries", 2, "module"))
    assert (first.path, first.line) == (str(llama), source.read_file(llama).entry_position(0).line)
    assert expanded.source.value(("entries", 2 + n_llama, "heads")).path == str(clip)
    scope = expanded.scopes[("entries", 3)]
    assert (scope.index, scope.prefix, scope.config) == (1, "language_model.", ("text_config",))
    assert expanded.config_of("entries", 3, model.config) is model.config.text_config
    assert expanded.config_of("entries", 0, model.config) is model.config
    assert expanded.label(3) == (f"entry 1 (Column 'layers.*.self_attn.k_proj'), composed as 'language_model' "
                                 f"(text_config) by {loaded.source.value(('compose', 0))}")
    assert composed(model, expanded) is expanded  # expanding twice changes nothing


def test_the_default_mapping_is_the_sub_configs_own_model_type():
    """A llava whose text model is Mistral composes mistral.yaml, not llama.yaml."""
    model = meta_llava(text={"model_type": "mistral", "sliding_window": None})
    expanded = composed(model, verify.resolve(LLAVA))
    paths = {Path(expanded.source.value(("entries", i)).path).name for i in range(len(expanded.mapping.entries))}
    assert paths == {"llava.yaml", "mistral.yaml", "clip_vision_model.yaml"}
    assert tpmap.plan(model, 2).params["model.language_model.layers.0.mlp.down_proj.weight"].dim == 1


def test_mapping_names_another_file_by_model_type_or_relative_path(tmp_path):
    sub = tmp_path / "sub"
    sub.mkdir()
    (sub / "text.yaml").write_text(mapping_text("mistral").replace("model_type: mistral", "model_type: llama"))
    path = composing(tmp_path, "compose:\n  - {module: language_model, config: text_config, mapping: sub/text.yaml}\n"
                               "  - {module: vision_tower, config: vision_config, mapping: clip_vision_model}\n")
    expanded = composed(meta_llava(), source.read_file(path))
    files = {Path(expanded.source.value(("entries", i)).path).name for i in range(len(expanded.mapping.entries))}
    assert files == {"top.yaml", "text.yaml", "clip_vision_model.yaml"}


def test_a_composed_when_and_unsupported_read_the_sub_config(tmp_path):
    """`when` and `unsupported` of a composed file are matched against its sub-config, and the refusal
    points at the composed file's own line."""
    text = edited("llama", "entries:\n", "unsupported:\n  - when: {num_attention_heads: 12}\n"
                  "    reason: twelve heads refused (a test)\nentries:\n", once=True)
    write_mapping(tmp_path, "text", text)
    path = composing(tmp_path, "compose:\n  - {module: language_model, config: text_config, mapping: text.yaml}\n")
    model = meta_llava(vision={"num_attention_heads": 12})  # the top config has no num_attention_heads at all
    with pytest.raises(UnsupportedConfigError) as info:
        tpmap.plan(model, 2, mapping=path)
    assert info.value.position.path == str(tmp_path / "text.yaml") and "LlamaConfig" in str(info.value)
    # with 6 text heads the variant does not apply
    assert tpmap.plan(meta_llava(text={"num_attention_heads": 6, "num_key_value_heads": 6}), 2, mapping=path)


# -- errors -------------------------------------------------------------------------------------------
def test_a_sub_model_without_a_mapping_is_named_with_its_prefix_and_model_type():
    """A composed sub-model whose model type has no mapping: the error names the sub-model, its module prefix
    and its model type."""
    model = meta_llava(text={"model_type": "xlstm"})  # a type without a mapping (and none drafted)
    with pytest.raises(MappingError) as info:
        tpmap.plan(model, 2)
    message = str(info.value)
    assert info.value.rule == "compose" and info.value.position.path.endswith("llava.yaml")
    for words in ("model.language_model (xLSTMModel)", "model_type 'xlstm'", "text_config.model_type",
                  "no mapping", "mapping:"):
        assert words in message, message


def test_a_missing_module_or_sub_config_is_located_at_the_compose_item(tmp_path):
    path = composing(tmp_path, "compose:\n  - {module: language_modle, config: text_config}\n")
    with pytest.raises(PatternMatchError) as info:
        tpmap.plan(meta_llava(), 2, mapping=path)
    assert "did you mean language_model?" in str(info.value)
    assert (info.value.position.line, info.value.position.col) == (first_item_line(path), 14)
    path = composing(tmp_path, "compose:\n  - {module: language_model, config: text_cfg}\n")
    with pytest.raises(MappingError) as info:
        tpmap.plan(meta_llava(), 2, mapping=path)
    assert "no sub-config 'text_cfg' (did you mean text_config?)" in str(info.value)
    assert info.value.rule == "config-attribute"


def test_an_error_in_a_composed_entry_cites_its_own_line_and_what_composed_it(tmp_path):
    write_mapping(tmp_path, "text", edited("llama", "heads: num_key_value_heads", "heads: num_kv_heads", once=False))
    path = composing(tmp_path, "compose:\n  - {module: language_model, config: text_config, mapping: text.yaml}\n")
    with pytest.raises(ConfigAttributeError) as info:
        tpmap.plan(meta_llava(), 2, mapping=path)
    e = info.value
    line = next(i for i, t in enumerate((tmp_path / "text.yaml").read_text().splitlines(), 1) if "num_kv_heads" in t)
    assert (e.position.path, e.position.line) == (str(tmp_path / "text.yaml"), line)
    assert str(e).startswith(f"{tmp_path / 'text.yaml'}:{line}:")
    assert (f"entry 1 (Column 'layers.*.self_attn.k_proj'), composed as 'language_model' (text_config) by "
            f"{path}:{first_item_line(path)}:5: the LlamaConfig has no attribute 'num_kv_heads'") in str(e)


def test_a_composed_file_that_composes_itself_is_a_cycle(tmp_path):
    path = composing(tmp_path, "compose:\n  - {module: language_model, config: text_config, mapping: top.yaml}\n")
    with pytest.raises(MappingError) as info:
        tpmap.plan(meta_llava(), 2, mapping=path)
    assert "a cycle: top.yaml -> top.yaml" in str(info.value) and info.value.rule == "compose"


def test_compose_schema_errors():
    base = mapping_text(LLAVA)
    for old, new, words in (("module: language_model", "module: language_*", "is a pattern; name one module"),
                            ("config: text_config", "config: 3", "Input should be a valid string"),
                            ("config: text_config", "config: text_config\n    mapp: llama", "did you mean mapping?")):
        with pytest.raises(MappingErrors) as info:
            source.load_text(replaced(base, old, new, once=True), "x.yaml")
        assert words in str(info.value), str(info.value)
    nothing = base[:base.index("compose:")] + base[base.index("vocab_parallel"):]
    with pytest.raises(MappingErrors, match="at least one entry"):
        source.load_text(nothing, "x.yaml")


# -- expressions and example inputs ---------------------------------------------------------------------
def test_dotted_names_read_a_sub_configs_attribute():
    assert expr.names("(vision_config.image_size // p) * 2") == {"vision_config.image_size", "p"}
    values = {"vision_config.image_size": 16, "p": 8}
    assert expr.evaluate("(vision_config.image_size // p) * 2", values.__getitem__) == 4
    for bad in ("a.b()", "f(a).b", "a[0].b"):
        with pytest.raises(expr.ExpressionError):
            expr.parse(bad)


def test_image_inputs_put_the_image_tokens_in_every_row_and_nowhere_else():
    model = verify.build_model(LLAVA, 0, "LlavaModel")
    inputs = verify.case_inputs(LLAVA, 0, model)
    image = model.config.image_token_id
    assert tuple(inputs["pixel_values"].shape) == (2, 3, 16, 16)  # batch, vision_config's channels and size
    ids = inputs["input_ids"]
    assert (ids[:, 1:5] == image).all() and (ids == image).sum() == 8  # (16 // 8) ** 2 tokens per image
    assert inputs["attention_mask"][:, :5].all()  # the image tokens lie before the padding
    # the forward goes through the image path: other pixels, other output
    other = dict(inputs, pixel_values=inputs["pixel_values"] + 1)
    with torch.no_grad():
        assert not torch.allclose(model(**inputs).last_hidden_state, model(**other).last_hidden_state)


def test_values_inputs_hold_their_values_in_every_row_and_drive_llava_next_anyres_grid():
    """`kind: values` (image_sizes): every row holds the values; llava_next's 16 x 32 image takes the [16, 32] grid
    of its pinpoints, so the tower sees 3 images of 16 x 16 (base + 2 crops) and the image has 14 tokens: the
    base's 2 x 2 features, then 2 rows of 2 crops x 2 features each ended by image_newline (2 x 5)."""
    model = verify.build_model("llava_next", 0, "LlavaNextModel")
    inputs = verify.case_inputs("llava_next", 0, model)
    assert inputs["image_sizes"].tolist() == [[16, 32], [16, 32]] and inputs["image_sizes"].dtype == torch.long
    assert tuple(inputs["pixel_values"].shape) == (2, 3, 3, 16, 16)
    assert ((inputs["input_ids"] == model.config.image_token_id).sum(-1) == 14).all()
    seen = []
    model.vision_tower.register_forward_hook(lambda m, a, out: seen.append(tuple(a[0].shape)))
    with torch.no_grad():
        out = model(**inputs)
    assert seen == [(6, 3, 16, 16)]  # 2 rows x 3 images
    assert [tuple(f.shape) for f in out.image_outputs.pooler_output] == [(14, 96), (14, 96)]  # per image: its tokens


def test_values_inputs_need_one_value_per_element_of_the_last_dimension():
    base = mapping_text("llava_next")
    values = "values: [vision_config.image_size, 2 * vision_config.image_size]"
    with pytest.raises(MappingErrors, match="kind: values needs `values`"):
        source.load_text(replaced(base, values, "values: []"), "x.yaml")
    with pytest.raises(MappingErrors, match="only it takes them"):
        source.load_text(replaced(base, "kind: values,", "kind: ids,"), "x.yaml")
    model = verify.build_model("llava_next", 0, "LlavaNextModel")
    loaded = source.load_text(replaced(base, values, values[:-1] + ", 1]"), "x.yaml")
    with pytest.raises(MissingInputError, match="3 values for a last dimension of 2"):
        verify.example_inputs(model, loaded.mapping.verify[0].inputs)


def test_grid_inputs_hold_every_cells_coordinates_and_bool_inputs_are_true():
    """`kind: grid` gives cell i of a [width, height] grid (i % width, i // width) in every row: Gemma 4's
    image_position_ids for a 4 x 4 grid of patches, which its pooler averages 2 x 2 into 4 image tokens (a
    grid of one repeated pair pools every patch into one token and the image-token count fails). `kind: bool`
    is True everywhere (its audio frames' mask)."""
    model = verify.build_model("gemma4", 1, "Gemma4ForConditionalGeneration")
    inputs = verify.case_inputs("gemma4", 1, model)
    grid = inputs["image_position_ids"]
    assert tuple(grid.shape) == (2, 16, 2) and grid.dtype == torch.long and (grid[1] == grid[0]).all()
    assert grid[0].tolist() == [[x, y] for y in range(4) for x in range(4)]
    mask = inputs["input_features_mask"]
    assert mask.dtype == torch.bool and tuple(mask.shape) == (2, 32) and mask.all()
    with torch.no_grad():
        features = model.model.get_image_features(inputs["pixel_values"], grid).pooler_output
    assert [tuple(f.shape) for f in features] == [(4, 64), (4, 64)]  # 16 patches pooled 2 x 2: 4 tokens per image


def test_grid_inputs_need_two_sizes_and_a_shape_that_holds_the_grid():
    base = mapping_text("gemma4_vision")
    with pytest.raises(MappingErrors, match="kind: grid needs `grid: \\[width, height\\]`"):
        source.load_text(replaced(base, "grid: [4, 4]", "grid: [16]"), "x.yaml")
    with pytest.raises(MappingErrors, match="kind: grid needs"):
        source.load_text(replaced(base, "kind: grid, grid: [4, 4]", "kind: values, values: [1, 2], grid: [4, 4]"),
                         "x.yaml")
    model = verify.build_model("gemma4_vision", 0, "Gemma4VisionModel")
    loaded = source.load_text(replaced(base, "grid: [4, 4]", "grid: [4, 2]"), "x.yaml")  # the first config
    with pytest.raises(MissingInputError, match="a 4 x 2 grid has 8 cells of \\(x, y\\), so its last two "
                                                "dimensions are \\[8, 2\\], not \\[16, 2\\]"):
        verify.example_inputs(model, loaded.mapping.verify[0].inputs)


def test_float_inputs_with_a_grid_lead_every_patch_with_its_row_and_column():
    """`kind: float` with `grid: [width, height]` gives flattened patches whose first two features are patch i's row
    i // width + 1 and column i % width + 1 (from 1, as Pix2Struct's processor writes them), the rest standard normal:
    exactly the indices Pix2Struct's encoder looks up in its row and column tables (a plain float input gives
    negative indices there, and the unsharded model fails)."""
    model = verify.build_model("pix2struct", 0, "Pix2StructForConditionalGeneration")
    inputs = verify.case_inputs("pix2struct", 0, model)
    patches = inputs["flattened_patches"]
    assert tuple(patches.shape) == (2, 16, 2 + 48) and patches.dtype == torch.float32
    expected = [[row, col] for row in range(1, 5) for col in range(1, 5)]  # row by row, 4 patches each
    assert patches[0, :, :2].tolist() == expected and patches[1, :, :2].tolist() == expected
    features = patches[..., 2:]
    assert (features != features.round()).all() and 0.8 < features.std() < 1.2  # random, not coordinates
    seen = {}
    embeddings = model.encoder.embeddings
    embeddings.row_embedder.register_forward_hook(lambda m, a, out: seen.update(row=a[0]))
    embeddings.column_embedder.register_forward_hook(lambda m, a, out: seen.update(col=a[0]))
    with torch.no_grad():
        model(**inputs)
    assert seen["row"][0].tolist() == [r for r, _ in expected] and seen["col"][1].tolist() == [c for _, c in expected]
    inputs["flattened_patches"] = torch.randn(patches.shape)  # what a float input without a grid would be
    with pytest.raises(IndexError), torch.no_grad():
        model(**inputs)


def test_float_inputs_take_a_grid_of_two_sizes_with_a_shape_that_holds_its_patches(tmp_path):
    from tpmap.lint import lint_file

    base = mapping_text("pix2struct")
    declared = "kind: float, grid: [4, 4]"
    with pytest.raises(MappingErrors, match=r"kind: grid needs `grid: \[width, height\]`.* kind: float"):
        source.load_text(replaced(base, declared, "kind: float, grid: [16]"), "x.yaml")
    with pytest.raises(MappingErrors, match="this input's kind is 'mask'"):
        source.load_text(replaced(base, declared, "kind: mask, grid: [4, 4]"), "x.yaml")
    model = verify.build_model("pix2struct", 0, "Pix2StructForConditionalGeneration")
    loaded = source.load_text(replaced(base, declared, "kind: float, grid: [4, 2]"), "x.yaml")
    with pytest.raises(MissingInputError, match=r"a 4 x 2 grid has 8 patches, each led by its \(row, column\), so its "
                                                r"last two dimensions are \[8, 2 \+ features\], not \[16, 50\]"):
        verify.example_inputs(model, loaded.mapping.verify[0].inputs)
    # lint evaluates the grid's expressions: a misspelt attribute is named where it stands
    text = replaced(base, declared, "kind: float, grid: [vision_config.grid_width, 4]")
    found = lint_file(str(write_mapping(tmp_path, "pix2struct", text)))
    assert [d.rule for d in found] == ["config-attribute"]
    assert "flattened_patches" in found[0].message and "grid_width" in found[0].message
    text = replaced(base, declared, "kind: float, grid: [2 * 2, 4]")
    assert lint_file(str(write_mapping(tmp_path, "ok", text))) == []


def test_a_model_without_input_ids_needs_its_inputs_declared():
    """A tower whose forward takes no input_ids (Gemma 4's vision model: main_input_name left at input_ids) gets
    no derived token ids: with nothing declared, the error says to declare its inputs."""
    model = verify.build_model("gemma4_vision", 0, "Gemma4VisionModel")
    assert model.main_input_name == "input_ids"  # the case: transformers' default, yet no such argument
    inputs = verify.case_inputs("gemma4_vision", 0, model)
    assert set(inputs) == {"pixel_values", "pixel_position_ids"}
    with pytest.raises(MissingInputError, match=r"Gemma4VisionModel\.forward takes no input_ids"):
        verify.example_inputs(model, {})


def meta_gemma4(**sub_configs):
    """Gemma 4's verify config with both towers (verify config 1) on the meta device, sub-configs replaced."""
    spec = verify.resolve("gemma4").mapping.verify[1].config
    config = transformers.AutoConfig.for_model("gemma4", **{**spec, **sub_configs})
    with torch.device("meta"):
        return transformers.Gemma4ForConditionalGeneration(config)


def test_an_optional_sub_model_absent_from_the_config_composes_nothing(tmp_path):
    """`optional: true`: a Gemma 4 checkpoint built without audio (audio_config null, no audio_tower) is mapped
    by the same file, the text model and the vision tower split as with audio; without `optional` the absent
    sub-config is an error at the compose item, as before."""
    whole = tpmap.plan(meta_gemma4(), 2).params
    assert any(n.startswith("model.audio_tower.layers.0.self_attn") for n in whole)
    no_audio = tpmap.plan(meta_gemma4(audio_config=None), 2).params
    assert not any("audio" in n for n in no_audio)
    assert {n: p.dim for n, p in no_audio.items()} == {n: p.dim for n, p in whole.items() if "audio" not in n}
    text_only = tpmap.plan(meta_gemma4(audio_config=None, vision_config=None), 2).params
    assert text_only and all(n.startswith(("model.language_model.", "lm_head.")) for n in text_only)
    path = write_mapping(tmp_path, "gemma4", replaced(mapping_text("gemma4"), "config: audio_config         "
                                                      "# mappings/gemma4_audio.yaml\n    optional: true\n",
                                                      "config: audio_config\n", once=True))
    with pytest.raises(MappingError, match="has no sub-config 'audio_config'"):
        tpmap.plan(meta_gemma4(audio_config=None), 2, mapping=path)


def test_token_runs_that_do_not_fit_are_refused():
    ids = torch.zeros(2, 10, dtype=torch.long)
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[1, 7:] = 0
    keep = verify.place_runs(ids, [(9, 3), (8, 3)], mask, spare=5)
    assert ids[0].tolist() == [0, 9, 9, 9, 8, 8, 8, 0, 0, 0] and keep.sum() == 12
    with pytest.raises(MissingInputError, match="need 7 positions"):
        verify.place_runs(torch.zeros(2, 10, dtype=torch.long), [(9, 7)], mask, spare=5)


# -- on real ranks: the image path is split and proven ----------------------------------------------------
WRONG = {
    # the projector's first Linear taken for a fused [a | b] weight: each rank's slice of its output is not
    # the input features its rows of linear_2 expect
    "projector-split-as-fused": (LLAVA, "module: multi_modal_projector.linear_1\n",
                                 "module: multi_modal_projector.linear_1\n    sections: 2\n", DIFFERENCE),
    # the same mistake inside the vision tower's MLP, in the composed vision file
    "vision-mlp-split-as-fused": ("clip_vision_model", "module: encoder.layers.*.mlp.fc1\n",
                                  "module: encoder.layers.*.mlp.fc1\n    sections: 2\n", DIFFERENCE),
}


@pytest.mark.parametrize("name", [pytest.param(n, marks=[pytest.mark.full] if n.startswith("vision") else [])
                                  for n in WRONG])
def test_a_wrong_composed_mapping_is_caught(ranks, tmp_path, name):
    """The image path is compared: a wrong split of the projector or of the composed vision tower fails."""
    origin, old, new, expect = WRONG[name]
    if origin == LLAVA:
        path = write_mapping(tmp_path, name, edited(LLAVA, old, new, once=True))
    else:
        write_mapping(tmp_path, "vision", edited(origin, old, new, once=True))
        path = write_mapping(tmp_path, name, edited(LLAVA, "config: vision_config ",
                                                    "config: vision_config\n    mapping: vision.yaml ", once=True))
    assert_caught(ranks, path, name, expect=expect)


def test_a_vision_tower_left_whole_is_reported_by_lint(tmp_path):
    """Dropping the vision tower's composition leaves its blocks whole: lint's coverage rule names them."""
    from tpmap.lint import lint_file

    text = edited(LLAVA, "  - module: vision_tower\n    config: vision_config", "", once=True)
    found = lint_file(str(write_mapping(tmp_path, "no_vision", text)))
    assert {d.rule for d in found} == {"coverage"}
    assert any("vision_tower.encoder.layers.*.mlp.fc1" in d.message for d in found)
