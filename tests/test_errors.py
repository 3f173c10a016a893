"""Bad input: each mistake raises a specific ValueError subclass that names the file/module and the
numbers, before anything is changed (the model is compared before and after)."""
from __future__ import annotations

import pytest
import rank_cases
import torch
from helpers import edited, mapping_text, not_proven_uneven

import tpmap
from tpmap import verify
from tpmap.api_errors import AlreadyAppliedError, ProcessGroupError
from tpmap.language import source
from tpmap.language.errors import (
    ConfigAttributeError,
    DivisibilityError,
    MappingErrors,
    PatternMatchError,
    TpmapError,
    UnknownModelTypeError,
)


def fails_cleanly(model_type: str, mapping_text: str | None, world_size: int, error: type, *needles: str):
    """apply() in this process: the right error, the right words, and an untouched model."""
    cls = verify.resolve(model_type).mapping.verify[0].models[0]
    result = rank_cases.apply_error(model_type, cls, world_size, mapping_text)
    assert result["error"] == error.__name__, result
    for needle in needles:
        assert needle in result["message"], f"{needle!r} not in: {result['message']}"
    assert result["untouched"]
    return result["message"]


def test_all_errors_are_value_errors():
    for cls in (TpmapError, MappingErrors, UnknownModelTypeError, PatternMatchError, ConfigAttributeError,
                DivisibilityError, ProcessGroupError, AlreadyAppliedError):
        assert issubclass(cls, ValueError)


def test_world_size_that_does_not_divide_the_heads(tmp_path):
    model = verify.build_model("gpt2", 0, "GPT2LMHeadModel")
    with pytest.raises(DivisibilityError) as e:  # more ranks than heads
        tpmap.plan(model, 13)
    msg = str(e.value)
    assert "gpt2.yaml:" in msg and "12 heads" in msg and "world size 13" in msg and "transformer.h.0.attn.c_attn" in msg
    unproven = str(not_proven_uneven(tmp_path, "gpt2"))
    with pytest.raises(DivisibilityError) as e:  # 12 heads at 5: an uneven split, of a mapping not proven uneven
        tpmap.plan(model, 5, mapping=unproven)
    msg = str(e.value)
    assert "gpt2.yaml:" in msg and "transformer.h.0.attn.c_attn would be split unevenly at world size 5" in msg
    assert "world sizes that split this model evenly: 1, 2, 3, 4, 6, 12" in msg, msg


@pytest.mark.full  # 3 ranks
def test_world_size_that_does_not_divide_the_heads_on_real_ranks(ranks):
    """llama's kv2 config at world size 3 (2 KV heads and 3 ranks, neither divides the other) with a mapping whose
    k/v entries do not name their query heads (the shipped one does, and runs it unevenly)."""
    text = edited("llama", "    query_heads: num_attention_heads\n", "", every=True)
    result = ranks(3).run(rank_cases.apply_error, "llama", "LlamaForCausalLM", 3, text)
    for r in result:
        assert r["error"] == "DivisibilityError" and "2 heads cannot be split over world size 3" in r["message"], r
        assert r["untouched"]


def test_unknown_key_points_at_the_line():
    text = edited("gpt2", "    combined_qkv: true", "    combined_qvk: true")
    with pytest.raises(MappingErrors) as e:
        source.load_text(text, "mappings/gpt2.yaml")
    line = text.splitlines().index("    combined_qvk: true") + 1
    assert str(e.value).startswith(f"mappings/gpt2.yaml:{line}:5: unknown key 'combined_qvk'")
    assert "did you mean combined_qkv?" in str(e.value)


def test_unknown_kind_lists_the_valid_kinds():
    text = edited("llama", "  - kind: Row\n", "  - kind: Rwo\n")
    with pytest.raises(MappingErrors) as e:
        source.load_text(text, "llama.yaml")
    assert "unknown entry kind 'Rwo' (did you mean Row?); valid kinds: Column, Row, Update" in str(e.value)


def test_pattern_that_matches_nothing():
    text = edited("llama", "module: layers.*.mlp.up_proj", "module: layers.*.mlp.upproj")
    msg = fails_cleanly("llama", text, 1, PatternMatchError, "matches no module", "layers.*.mlp.upproj",
                        "did you mean layers.*.mlp.up_proj?")
    assert msg.startswith("<test mapping>:")


def test_parameter_matched_by_two_entries():
    text = edited("llama", "module: layers.*.mlp.up_proj", "module: layers.*.mlp.gate_proj")
    fails_cleanly("llama", text, 1, PatternMatchError,
                  "model.layers.0.mlp.gate_proj.weight is already claimed by entry")


def test_missing_config_attribute():
    text = edited("llama", "heads: num_key_value_heads", "heads: num_kv_heads")
    fails_cleanly("llama", text, 1, ConfigAttributeError, "LlamaConfig has no attribute 'num_kv_heads'",
                  "did you mean num_key_value_heads?")


def test_missing_module_attribute_in_update():
    text = edited("gpt2", "      split_size: per_rank(n_head)", "      splitsize: per_rank(n_head)")
    fails_cleanly("gpt2", text, 1, tpmap.ModuleKindError, "has no attribute 'splitsize'", "did you mean split_size?")


def test_reverse_on_a_linear():
    text = edited("llama", "    module: layers.*.mlp.down_proj",
                  "    module: layers.*.mlp.down_proj\n    reverse: true")
    fails_cleanly("llama", text, 1, tpmap.ModuleKindError, "is an nn.Linear", "remove reverse: true")


def test_fused_sections_that_do_not_sum():
    text = edited("phi3", "    sections: 2", "    sections: [{size: intermediate_size}, {size: hidden_size}]")
    fails_cleanly("phi3", text, 1, DivisibilityError, "sections sum to 288 (192 + 96)", "384 features")


def test_world_size_above_one_without_a_process_group():
    fails_cleanly("gpt2", None, 2, ProcessGroupError, "world_size=2", "init_process_group", "torchrun")


def test_world_size_different_from_the_group(ranks):
    for r in ranks(2).run(rank_cases.untouched_after_failed_apply_in_group, "gpt2", "GPT2LMHeadModel"):
        assert r["error"] == "ProcessGroupError" and "world_size=3" in r["message"] and "2 ranks" in r["message"]
        assert r["untouched"]


def test_model_type_without_a_mapping_gives_its_refusal_and_where_the_supported_ones_are():
    from transformers import AutoConfig, IBertForMaskedLM  # refused for good (docs/refused.md): no mapping ships

    model = IBertForMaskedLM(AutoConfig.for_model("ibert", hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                                  intermediate_size=32, vocab_size=64))
    before = rank_cases.state_signature(model)
    with pytest.raises(UnknownModelTypeError) as e:
        tpmap.apply(model, 1)
    files = source.shipped_files()
    assert f"all {len(files)}: MODELS.md" in str(e.value) and "docs/refused.md: every projection" in str(e.value)
    assert "'ibert'" in str(e.value) and rank_cases.same_signature(before, rank_cases.state_signature(model))


def test_mapping_for_another_model_type():
    fails_cleanly("gpt2", mapping_text("llama"), 1, tpmap.MappingError, "for model_type 'llama'", "'gpt2'")


def test_applying_twice(ranks):
    for r in ranks(2).run(rank_cases.apply_error, "gpt2", "GPT2LMHeadModel", 2, None, True):
        assert r["error"] == "AlreadyAppliedError" and r["untouched"]


def test_world_size_one_returns_the_model_unchanged():
    model = verify.build_model("phi3", 0, "Phi3ForCausalLM")
    before = rank_cases.state_signature(model)
    assert tpmap.apply(model, 1) is model
    assert rank_cases.same_signature(before, rank_cases.state_signature(model))
    assert not any("Parallel" in type(m).__name__ for m in model.modules())


def test_invalid_expression_is_rejected_at_load():
    text = edited("gpt2", "split_size: per_rank(n_head) * (n_embd // n_head)", "split_size: __import__('os').getcwd()")
    with pytest.raises(MappingErrors) as e:
        source.load_text(text, "gpt2.yaml")
    assert "is not allowed in expression" in str(e.value)


@pytest.mark.parametrize("ref,cls", [("phi3", "Phi3ForCausalLM"), ("gpt2", "GPT2LMHeadModel"),
                                     ("mixtral", "MixtralForCausalLM"), ("fsmt", "FSMTForConditionalGeneration")])
def test_after_a_successful_apply_the_shared_config_and_checkpoint_describe_the_original(ranks, ref, cls):
    for r in ranks(2).run(rank_cases.post_apply_invariants, ref, cls):
        assert r["shared_config_full"] and r["saved_config_full"], r
        assert r["linears"] > 0 and not r["bad_widths"], r["bad_widths"]  # in_features / out_features as nn.Linear's
        if ref == "fsmt":
            assert r["gathering_linears"] > 0  # gather_output: the full width comes out
        assert r["copies_ok"], r["bad_copies"]
        assert r["state_names_equal"] and r["state_bit_equal"] and r["local_smaller"], r
        if ref == "phi3":
            assert r["via_config_updates"] > 0  # the per-module config copy path is exercised


def test_a_partial_mapping_warns_once_on_rank_0_naming_what_stays_whole(ranks):
    """ConvBERT keeps its attention whole (a `replicated` item with a reason): apply warns on rank 0, once per
    mapping and world size, naming the pattern, the reason and this rank's share; a complete mapping (llama)
    and the other ranks stay silent."""
    refs, classes = ["convbert", "llama"], ["ConvBertForMaskedLM", "LlamaForCausalLM"]
    rank0, rank1 = ranks(2).run(rank_cases.partial_mapping_warnings, refs, classes)
    first, again, llama = rank0
    assert len(first["messages"]) == 1, first
    message = first["messages"][0]
    assert "convbert.yaml is a partial mapping" in message and "encoder.layer.*.*attention (2 modules)" in message
    assert "conv_kernel_layer" in message  # the declared reason
    assert f"{first['share']:.1%} of the parameters at tp_size 2" in message
    assert 0.5 < first["share"] < 1.0  # the FFN and the vocabulary are split, the attention is not
    assert again["messages"] == [] and llama["messages"] == []
    assert all(r["messages"] == [] for r in rank1)


def test_a_non_head_dim_the_world_size_does_not_divide_is_split_unevenly_and_whole():
    """intermediate_size 190 at world size 4 must not silently cover 188 rows: 48, 48, 47, 47 rows."""
    import torch
    from transformers import AutoConfig, LlamaForCausalLM

    import tpmap

    spec = source.for_model_type("llama").mapping.verify[0]
    with torch.device("meta"):
        model = LlamaForCausalLM(AutoConfig.for_model("llama", **{**spec.config, "intermediate_size": 190}))
    up = tpmap.plan(model, 4).params["model.layers.0.mlp.up_proj.weight"]
    assert up.pieces == (((0, 48),), ((48, 48),), ((96, 47),), ((143, 47),))


def test_apply_on_a_meta_device_model_says_to_load_the_weights_first(ranks):
    for r in ranks(2).run(rank_cases.meta_apply_error, "llama", "LlamaForCausalLM"):
        assert r["error"] == "MetaDeviceError" and r["untouched"], r
        assert "meta device" in r["message"] and "from_pretrained" in r["message"]


def test_a_failing_verify_case_prints_one_line_per_rank(ranks):
    """The whole tracebacks (hundreds of lines) only with --verbose."""
    from tpmap.parallelize.rank_processes import RankFailure

    with pytest.raises(RankFailure) as info:
        ranks(2).run(rank_cases.crash_on_rank, 1)
    summary = info.value.summary().splitlines()
    assert "  rank 1: RuntimeError: deliberate failure on rank 1" in summary, summary
    assert len(summary) <= 3 and "Traceback" not in "\n".join(summary)  # the header, then a line per rank


class _DirectLookupEmbedding(torch.nn.Embedding):
    """Overrides forward without super().forward: a vocabulary split cannot run under it."""

    def forward(self, ids):
        return torch.nn.functional.embedding(ids, self.weight, self.padding_idx) * 2.0


def test_embedding_subclass_that_bypasses_the_lookup_is_refused_at_plan_time():
    model = verify.build_model("llama", 0, "LlamaForCausalLM")
    old = model.get_input_embeddings()
    toy = _DirectLookupEmbedding(old.num_embeddings, old.embedding_dim, old.padding_idx)
    toy.weight = old.weight
    model.set_input_embeddings(toy)
    before = rank_cases.state_signature(model)
    for world_size in (1, 2):  # apply validates at 1; plan() builds the world size 2 plan without ranks
        with pytest.raises(tpmap.ModuleKindError) as e:
            tpmap.apply(model, 1) if world_size == 1 else tpmap.plan(model, world_size)
        err = e.value
        assert str(err).startswith(f"{source.shipped_files()['llama']}:") and err.rule == "module-kind", str(err)
        assert "model.embed_tokens is a _DirectLookupEmbedding" in str(err), str(err)
        assert "_DirectLookupEmbedding.forward does not call super().forward" in str(err), str(err)
        assert "set vocab_parallel.embedding: false" in str(err), str(err)
    assert rank_cases.same_signature(before, rank_cases.state_signature(model))
    # the advice works: with the embedding kept whole the plan builds (the LM head is still split)
    text = edited("llama", "vocab_parallel: {embedding: true,", "vocab_parallel: {embedding: false,")
    assert "embedding: false" in text
    plan = tpmap.plan(model, 2, mapping=source.load_text(text, "llama.yaml"))
    assert [m.style for m in plan.modules if m.style.startswith("vocab")] == ["vocab_head"]


TIED_HALVES = {"lm_head-only": ("{embedding: false, lm_head: true}", "vocab_parallel.lm_head splits lm_head.weight",
                                "tied to transformer.wte.weight", "(vocab_parallel.embedding: false)"),
               "embedding-only": ("{embedding: true, lm_head: false}",
                                  "vocab_parallel.embedding splits transformer.wte",
                                  "tied to lm_head.weight", "(vocab_parallel.lm_head: false)")}


@pytest.mark.parametrize("name", TIED_HALVES)
def test_half_of_a_tied_embedding_and_lm_head_is_refused(ranks, name):
    """GPT-2's LM head is tied to wte: splitting one half only used to pass apply and then crash in
    forward (IndexError) or return logits of a vocabulary slice. Refused at plan time, model untouched."""
    spec, *needles = TIED_HALVES[name]
    text = edited("gpt2", "vocab_parallel: {embedding: true, lm_head: true}", f"vocab_parallel: {spec}")
    line = text.splitlines().index(next(x for x in text.splitlines() if x.startswith("vocab_parallel:"))) + 1
    advice = "set both embedding and lm_head to true, or untie them (tie_word_embeddings: false)"
    msg = fails_cleanly("gpt2", text, 1, PatternMatchError, *needles, advice)
    assert msg.startswith(f"<test mapping>:{line}:1: "), msg
    for r in ranks(2).run(rank_cases.apply_error, "gpt2", "GPT2LMHeadModel", 2, text):
        assert r["error"] == "PatternMatchError" and advice in r["message"] and r["untouched"], r


def test_unknown_key_in_a_verify_input_lists_the_input_keys():
    text = edited("whisper", "      input_features: {shape: [batch,", "      input_features: {shap: [batch,")
    with pytest.raises(MappingErrors) as e:
        source.load_text(text, "whisper.yaml")
    assert "unknown key 'shap' (did you mean shape?); valid keys here: shape, kind" in str(e.value), str(e.value)


def test_warnings_point_at_the_users_line(monkeypatch):
    """A warning raised deep inside tpmap (here the untested-release override, three calls down from tpmap.plan) is
    attributed to the user's line, not to tpmap/compat.py (PartialMappingWarning pointed at tpmap/api.py:170)."""
    import tpmap.compat
    monkeypatch.setattr(tpmap.compat, "TRANSFORMERS", ">=99")  # the installed release falls outside the range
    monkeypatch.setenv(tpmap.compat.OVERRIDE, "1")
    import transformers
    model = transformers.LlamaForCausalLM(verify.tiny_config("llama"))
    with pytest.warns(UserWarning, match="is outside the range tpmap is tested on") as record:
        tpmap.plan(model, 2)
    assert record[0].filename == __file__, record[0].filename
