"""`tpmap draft`: drafts of plain layouts verify unedited on real ranks; every draft passes the schema;
layouts that shapes cannot tell are flagged, never guessed silently."""
from __future__ import annotations

import subprocess
import sys

import pytest
import transformers
from helpers import run_case

from tpmap import draft, verify
from tpmap.draft.analysis import blocks_of
from tpmap.draft.config import build_meta, model_class, tiny_model
from tpmap.draft.entries import analysis_entries, attribute_candidates
from tpmap.draft.render import scalar
from tpmap.language import source
from tpmap.lint import lint_file
from tpmap.meta import auto_classes
from tpmap.tool_errors import DraftError

# plain layouts (separate q/k/v or head-major, plain MLPs): decoders (a parallel attention + MLP block,
# head-major fused qkv), BERT-style encoders (nested attention scopes, layer-shared weights),
# encoder-decoders with cross attention, a text tower. Hand-written mappings for them ship too; the drafter
# reads nothing of a shipped mapping but its default_config, which none of these has.
PLAIN = ["gptj", "opt", "xglm", "biogpt", "ctrl", "gpt_neox_japanese", "roberta", "xlm-roberta", "camembert",
         "electra", "megatron-bert", "distilbert", "albert", "roformer", "deberta-v2", "mbart", "m2m_100",
         "clip_text_model"]
# not plain: what the draft cannot split (MoE experts, a short-conv mixer) stays whole, flagged, and the
# rest verifies unedited. Hand-written mappings for some of them ship too; as for PLAIN, the drafter reads
# nothing of those but a default_config, which the test checks they lack.
NOT_PLAIN = ["llama4_text", "glm4_moe", "ernie4_5_moe", "lfm2", "ernie", "xlm"]


@pytest.fixture(scope="module")
def drafts(tmp_path_factory):
    """model type -> path of its draft, written once for the module."""
    folder = tmp_path_factory.mktemp("drafts")
    out = {}
    for model_type in PLAIN + NOT_PLAIN:
        out[model_type] = folder / f"{model_type}.yaml"
        out[model_type].write_text(draft.draft(model_type), encoding="utf-8")
    return out


def test_at_least_15_plain_drafts_are_proven():
    """Most of these types ship hand-checked mappings by now; the drafter reads nothing of a shipped
    mapping but its default_config, which none of these has, so each draft is the drafter's own work."""
    shipped = source.shipped_files()
    assert len(PLAIN) >= 15
    assert not [m for m in PLAIN + NOT_PLAIN if m in shipped and source.read_file(shipped[m]).mapping.default_config]


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("model_type", PLAIN + NOT_PLAIN)
def test_a_plain_draft_verifies_unedited(ranks, drafts, model_type, world_size):
    """Forward on real gloo ranks against the unsharded model, the draft exactly as written."""
    cases = verify.cases([str(drafts[model_type])], [world_size])
    assert [c.world_size for c in cases] == [world_size], f"the draft claims no world size {world_size}"
    result = run_case(ranks, cases[0])
    assert result.passed, result.error
    assert result.params_local < result.params_full  # something really was split


@pytest.mark.parametrize("model_type", PLAIN)
def test_a_plain_draft_passes_the_whole_lint(drafts, model_type):
    assert lint_file(str(drafts[model_type])) == []
    todos = [line for line in drafts[model_type].read_text().splitlines() if "TODO:" in line]
    assert all("fused q/k/v" in line for line in todos), todos  # head-major query_key_value: flagged, right


# shipped types the drafter refuses with a clear error: SqueezeBERT's projections are 1x1 convolutions (no
# Linear pairs). (MobileBERT, whose bottleneck widths do not shrink with the tiny hidden size, keeps its
# default widths instead: see test_a_model_that_fails_with_tiny_widths_keeps_its_widths_noted.)
DRAFTER_REFUSES = {"squeezebert": "no Column/Row pair",  # grouped convolutions only
                   "jetmoe": "no Column/Row pair",  # mixture-of-attention and experts: 3-D tensors only
                   "recurrent_gemma": "no Column/Row pair",  # temporal_block differs by layer kind
                   # the mapping's default_config (is_decoder, for the causal LM) cannot build the masked LM
                   "reformer": "building ReformerForMaskedLM from the tiny config failed",
                   # its class is registered only as image-text-to-text, which the drafter does not search
                   "shieldgemma2": "no model class of transformers is registered for model_type 'shieldgemma2'",
                   # the same: GotOcr2ForConditionalGeneration is registered for it as image-text-to-text only
                   "pp_chart2table": "no model class of transformers is registered for model_type 'pp_chart2table'",
                   # the same: Pix2StructForConditionalGeneration is registered as image-text-to-text only
                   "pix2struct": "no model class of transformers is registered for model_type 'pix2struct'",
                   # vision-language configs whose text settings live in text_config: the causal-LM class the
                   # drafter builds reads config.vocab_size at the top level
                   "qwen3_5": "building Qwen3_5ForCausalLM from the tiny config failed",
                   # the same (5.23, where the llama4 mapping is proven): the causal LM reads pad_token_id at the top
                   "llama4": "building Llama4ForCausalLM from the tiny config failed",
                   # its vision_config defaults text_hidden_size to the full model's width, and the config's own
                   # check (it must equal text_config.hidden_size) rejects the drafter's tiny text width
                   "inkling2_loop": "vision_config.text_hidden_size. \\(4608\\) must match",
                   "qwen3_5_moe": "building Qwen3_5MoeForCausalLM from the tiny config failed",
                   "qwen4_exp": "building Qwen4ExpForCausalLM from the tiny config failed",
                   # Emu3ForCausalLM is built from Emu3TextConfig (emu3_text_model), not Emu3Config, which holds
                   # the text settings in text_config
                   "emu3": "building Emu3ForCausalLM from the tiny config failed",
                   # its config builds sub-configs from dicts that must name their model_type
                   "exaone4_5": "the tiny config of 'exaone4_5' is rejected: KeyError: 'model_type'",
                   "musicflamingo": "the tiny config of 'musicflamingo' is rejected: KeyError: 'model_type'",
                   # q/k/v/o are MoshiLinear wrappers (the nn.Linear one level down, `.linear`), which the
                   # drafter's attention names do not reach, and the MLP's fc1/fc2 differ in width by the gate
                   "moshi": "no Column/Row pair",
                   # the drafter cuts layer_types to its first 2 entries, both sliding (full attention every
                   # sixth layer and the last), and the config requires a full_attention layer
                   "neomme": "the tiny config of 'neomme' is rejected: ValueError: layer_types must contain at "
                             "least one full_attention layer",
                   # the drafter's tiny sizes give the text model's sliding layers other head counts than its
                   # KV head count
                   "dots3_note": "the tiny config of 'dots3_note' is rejected"}

# shipped hybrid stacks whose config rejects a 2-layer layer_types: the draft keeps the default layer count,
# with a note naming the rejection (the drafter cuts per-layer lists to 2 layers, which drops a layer kind)
KEEPS_DEFAULT_LAYERS = {"olmo_hybrid": "the tiny config of 'olmo_hybrid' is rejected"}

# and drafts that once rendered broken YAML or stretch the renderer: an empty nested config (mpt), nested
# configs whose depth keys do not say "layers", so the drafter's tiny config keeps the default depth (a slow draft,
# not a wrong one); known gap of the drafter's key names (tpmap/draft/names.py CONFIG_KEYS["layers"])
DEPTH_NOT_NAMED_LAYERS = {"perceiver": "num_blocks x num_self_attends_per_block self-attention layers"}

# encoder/decoder configs (t5gemma), a plan with MoE and latent attention (deepseek_v3), ModuleDict experts
_DRAFT_REGRESSIONS = ("mpt", "t5gemma", "deepseek_v3", "switch_transformers")


# the default tier keeps every case with its own expectation (a refusal, the default layer count) too
@pytest.mark.per_family(also=(*_DRAFT_REGRESSIONS, *DRAFTER_REFUSES, *KEEPS_DEFAULT_LAYERS, *DEPTH_NOT_NAMED_LAYERS))
@pytest.mark.parametrize("model_type", list(source.shipped_files()) + list(_DRAFT_REGRESSIONS))
def test_drafts_of_shipped_model_types_pass_the_schema(model_type):
    if model_type in DRAFTER_REFUSES:  # a clear DraftError, never a broken file
        with pytest.raises(DraftError, match=DRAFTER_REFUSES[model_type]):
            draft.draft(model_type)
        return
    text = draft.draft(model_type)
    loaded = source.load_text(text, f"{model_type}.yaml")  # raises MappingErrors on any schema problem
    assert loaded.mapping.model_type == model_type
    spec = loaded.mapping.verify[0]
    cls = getattr(transformers, spec.models[0])
    assert cls.config_class.model_type == model_type or spec.models[0] in auto_classes(model_type)
    if model_type in KEEPS_DEFAULT_LAYERS:  # the note says why, and the layer counts stay the default's
        assert "with 2 layers the config or the model fails" in text and KEEPS_DEFAULT_LAYERS[model_type] in text
        return
    if model_type in DEPTH_NOT_NAMED_LAYERS:  # the drafter cannot find the depth: it stays the default's
        assert not any("layers" in k for k in spec.config), spec.config
        transformers.AutoConfig.for_model(model_type, **spec.config)  # the verify config builds
        return
    counts = [v for k, v in spec.config.items() if ("layers" in k or k == "n_layer") and type(v) is int]
    counts += [v for sub in spec.config.values() if isinstance(sub, dict)  # nested encoder/decoder configs (and
               for k, v in sub.items() if ("layers" in str(k) or k == "n_layer") and type(v) is int]  # per-layer dicts)
    assert counts and max(counts) <= 2, spec.config  # the tiny config keeps at most 2 layers everywhere
    transformers.AutoConfig.for_model(model_type, **spec.config)  # the verify config builds


@pytest.mark.parametrize("value", [8.0, 500000.0, 1e-05, 1.5e20, -2.5, float("inf"), 7, None, True, "x_y",
                                   [1, 2.0, None], {"a": 1e-06, "b": [True, "z"]}, "needs: quoting", "*star",
                                   "null", "Yes", 'a "quoted" \\ word'])
def test_values_render_as_yaml_that_reads_back_the_same(value):
    import yaml

    assert yaml.safe_load(scalar(value)) == value


def entry_notes(text: str, module: str) -> str:
    """The comment lines right above the entry for `module`."""
    lines = text.splitlines()
    at = next(i for i, line in enumerate(lines) if line.strip() == f"module: {module}") - 1  # the '- kind:' line
    notes = []
    while lines[at - 1].lstrip().startswith("#"):
        at -= 1
        notes.insert(0, lines[at].strip())
    return " ".join(notes)


def test_a_fused_qkv_gets_a_todo_not_a_silent_guess():
    text = draft.draft("gpt2")  # c_attn: Conv1D [in, out] holding q, k and v: 3 x the q width
    notes = entry_notes(text, "h.*.attn.c_attn")
    assert "TODO" in notes and "combined_qkv" in notes and "head-major" in notes
    loaded = source.load_text(text, "gpt2.yaml").mapping
    c_attn = next(e for e in loaded.entries if e.module == "h.*.attn.c_attn")
    assert c_attn.reverse and c_attn.heads == "n_head"


def test_fused_gate_up_and_unequal_qkv_get_todos():
    text = draft.draft("modernbert")  # no base_model_tp_plan: Wqkv [q|k|v] and Wi [input|gate] fused
    assert "TODO" in entry_notes(text, "layers.*.attn.Wqkv")
    wi = entry_notes(text, "layers.*.mlp.Wi")
    assert "TODO" in wi and "gate | up" in wi
    model = build("phi3", num_key_value_heads=4)  # qkv_proj registered after o_proj: order does not matter
    entries, _ = analysis_entries(blocks_of(model.model), 96, model.config, names(model.model))
    qkv = next(e for e in entries if e.module == "layers.*.self_attn.qkv_proj")
    assert qkv.kind == "Column" and qkv.fields["combined_qkv"] and "TODO" in qkv.notes[0]
    assert [s["heads"] for s in qkv.fields["sections"]] == ["num_attention_heads", "num_key_value_heads",
                                                           "num_key_value_heads"]
    assert next(e for e in entries if e.module == "layers.*.self_attn.o_proj").kind == "Row"


def build(model_type: str, **overrides):
    _, tiny, _, _, _ = tiny_model(model_type)
    config = transformers.AutoConfig.for_model(model_type, **{**tiny, **overrides})
    return build_meta(model_class(model_type, config), config)


def names(base) -> list[str]:
    return [n for n, _ in base.named_modules() if n]


def test_base_model_tp_plan_styles_are_translated():
    text = draft.draft("olmo3")  # q/k/v colwise_gather_output, o_proj rowwise_split_input
    mapping = source.load_text(text, "olmo3.yaml").mapping
    by_module = {e.module: e for e in mapping.entries}
    assert by_module["layers.*.self_attn.q_proj"].gather_output
    assert "layers.*.self_attn.o_proj" in mapping.replicated and "layers.*.self_attn.o_proj" not in by_module
    assert by_module["layers.*.mlp.down_proj"].kind == "Row"
    qwen3 = source.load_text(draft.draft("qwen3"), "qwen3.yaml").mapping
    assert qwen3.grad_allreduce == ["layers.*.self_attn.q_norm", "layers.*.self_attn.k_norm"]
    mixtral = draft.draft("mixtral")
    assert "TODO: base_model_tp_plan: layers.*.mlp.experts is moe_tp_experts" in " ".join(mixtral.split())
    assert "Param" in mixtral and "Reduce" in mixtral


def test_updates_hold_on_the_default_config_too():
    """An attribute whose value only coincides with a split size in the tiny config gets no update:
    Phi's rotary_ndims equals its KV head count in the default config and in the tiny one."""
    text = draft.draft("phi")
    assert "rotary_ndims" not in text
    gpt2 = source.load_text(draft.draft("gpt2"), "gpt2.yaml").mapping
    update = next(e for e in gpt2.entries if e.kind == "Update")
    assert update.attributes == {"embed_dim": "n_embd // tp_size", "num_heads": "n_head // tp_size",
                                 "split_size": "n_embd // tp_size"}
    model = build("phi3")
    attention = model.model.layers[0].self_attn  # reads self.config.num_attention_heads in forward
    found = attribute_candidates(attention, {12: ["num_attention_heads // tp_size"]})
    assert found["config.num_attention_heads"] == ["num_attention_heads // tp_size"]


def test_world_sizes_are_where_the_planner_accepts_the_draft():
    mapping = source.load_text(draft.draft("mistral"), "mistral.yaml").mapping  # 32 heads, 8 KV heads
    assert mapping.world_sizes == [1, 2, 4, 8, 16, 32]
    assert mapping.verify[0].world_sizes == [1, 2, 4]  # tiny: 12 heads but 4 KV heads, which 3 cannot split


def test_an_unknown_model_type_is_a_draft_error_that_suggests():
    with pytest.raises(DraftError, match="did you mean mistral"):
        draft.draft("mistrall")


def test_cli_writes_the_draft(tmp_path):
    out = tmp_path / "helium.yaml"
    done = subprocess.run([sys.executable, "-m", "tpmap", "draft", "helium", "-o", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "wrote" in done.stderr and source.read_file(out).mapping.model_type == "helium"
    bad = subprocess.run([sys.executable, "-m", "tpmap", "draft", "no_such_type"], capture_output=True, text=True,
                         timeout=300)
    assert bad.returncode == 1 and "is not a model_type" in bad.stderr and not bad.stdout


def test_a_model_that_does_not_build_is_a_draft_error_naming_its_error(monkeypatch):
    import tpmap.draft.config

    def fails(cls, config):
        raise RuntimeError("a constructor that fails")

    monkeypatch.setattr(tpmap.draft.config, "build_meta_model", fails)
    with pytest.raises(DraftError, match="building MistralForCausalLM from the tiny config failed: RuntimeError: "
                                         "a constructor that fails"):
        draft.draft("mistral")
    monkeypatch.undo()
    with pytest.raises(DraftError, match="found no Column/Row pair"):
        draft.draft("resnet")  # convolutions only: nothing a Column/Row pairs


def test_a_model_that_fails_with_tiny_widths_keeps_its_widths_noted():
    text = draft.draft("mobilebert")  # its bottleneck widths do not follow the tiny hidden size
    assert "with the tiny widths the config or the model fails (building MobileBertForMaskedLM" in " ".join(
        text.split())
    assert "hidden_size" not in source.load_text(text, "mobilebert.yaml").mapping.verify[0].config
