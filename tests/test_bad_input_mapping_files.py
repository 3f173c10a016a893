"""Hostile and broken mapping files (alias bombs, huge numbers, deep nesting, unreadable paths, fuzzed
edits of real mappings): every one a located TpmapError (never a traceback, never a hang),
and `tpmap lint` exits 0 or 1 with diagnostics on anything a fuzzer makes of real mappings.

The time bounds here are hang guards (seconds where a real run takes milliseconds), not speed targets.
"""
from __future__ import annotations

import os
import time

import fuzzing
import pytest
from helpers import edited
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tpmap.language import source
from tpmap.language.errors import MappingError, MappingErrors, TpmapError
from tpmap.lint import lint_file

SHIPPED = source.shipped_files()
LLAMA = SHIPPED["llama"].read_text()


def _alias_bomb(levels: int) -> str:
    lines = ['a0: &a0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    for i in range(1, levels + 1):
        lines.append(f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]")
    return "\n".join(lines) + "\n"


HOSTILE = {
    # name: (text, words the message must contain)
    "alias-bomb-9-levels": (_alias_bomb(9), "expands to more than"),
    "5000-digit-integer": ("model_type: llama\nworld_sizes: [" + "9" * 5000 + "]\n", "5,000 characters"),
    "4000-digit-integer": ("model_type: llama\nworld_sizes: [" + "9" * 4000 + "]\nentries: []\nverify: []\n",
                           "less than or equal to 65536"),
    "20000-term-expression": (edited("llama", "heads: num_attention_heads", "heads: " + "+".join(["1"] * 1500)),
                              "characters (limit 256)"),
    "deep-nesting": ("a: " + "[" * 3000 + "]" * 3000 + "\n", "nesting deeper than 64"),
    "recursive-alias": ("a: &a [*a]\n", "nesting deeper than 64"),
    "non-string-key": ("? [a, b]\n: 1\n", "must be a plain string"),
    "bad-timestamp": ("model_type: 2001-13-45 10:00:00\n", "cannot read the value"),
    "negative-update": (edited(
        "llama", "num_key_value_groups: per_rank(num_attention_heads) // per_rank(num_key_value_heads, "
                 "num_attention_heads)",
        "num_key_value_groups: 0 - 5", every=True), None),  # schema-valid: caught at plan time, see below
}


@pytest.mark.parametrize("name", [n for n, (_, words) in HOSTILE.items() if words])
def test_hostile_text_is_a_located_mapping_error_in_bounded_time(name):
    text, words = HOSTILE[name]
    start = time.monotonic()
    with pytest.raises(MappingErrors) as info:
        source.load_text(text, f"{name}.yaml")
    assert time.monotonic() - start < 5, "hang guard"
    first = info.value.errors[0]
    assert first.position is not None and first.position.path == f"{name}.yaml", first
    assert words in str(info.value), str(info.value)


def test_an_update_outside_1_to_the_full_value_fails_at_plan_time_with_its_line(tmp_path):
    """Before: a negative head-group count passed apply and failed at the first forward, in torch."""
    import torch
    from transformers import AutoConfig, LlamaForCausalLM

    import tpmap

    path = tmp_path / "llama_negative.yaml"
    path.write_text(HOSTILE["negative-update"][0])
    spec = source.read_file(path).mapping.verify[0]
    with torch.device("meta"):
        model = LlamaForCausalLM(AutoConfig.for_model("llama", **spec.config))
    with pytest.raises(TpmapError) as info:
        tpmap.plan(model, 2, mapping=path)
    line = next(i for i, s in enumerate(path.read_text().splitlines(), 1) if "0 - 5" in s)
    assert f"{path}:{line}:" in str(info.value) and "between 1 and 6" in str(info.value), str(info.value)


@pytest.mark.parametrize("make", ["missing", "folder", "not-utf8"])
def test_an_unreadable_mapping_path_is_a_mapping_error_and_the_model_is_untouched(tmp_path, make):
    import torch
    from transformers import AutoConfig, LlamaForCausalLM

    import tpmap

    path = {"missing": tmp_path / "nope.yaml", "folder": tmp_path, "not-utf8": tmp_path / "latin1.yaml"}[make]
    if make == "not-utf8":
        path.write_bytes(LLAMA.replace("# Llama", "# Llama \xe9t\xe9").encode("latin-1"))
    model = LlamaForCausalLM(AutoConfig.for_model("llama", **source.load_text(LLAMA, "x").mapping.verify[0].config))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(MappingError) as info:
        tpmap.apply(model, 1, mapping=path)
    assert str(path) in str(info.value)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_tpmap_lint_reports_an_alias_bomb_without_a_traceback(tmp_path):
    from tpmap.cli import main

    path = tmp_path / "bomb.yaml"
    path.write_text(_alias_bomb(9))
    assert main(["lint", str(path)]) == 1


def test_tpmap_lint_reports_a_file_over_the_size_limit_without_a_traceback(tmp_path):
    """Before: source.read_text raised the size error before lint_file had the text, and salvaging it raised
    UnboundLocalError (a traceback, exit status 1 by accident)."""
    path = tmp_path / "big.yaml"
    path.write_text("model_type: llama\n# " + "x" * source.LIMITS["file_bytes"] + "\n")
    assert [(d.line, d.col, d.rule) for d in lint_file(str(path))] == [(1, 1, "yaml-syntax")]


# -- fuzzing ---------------------------------------------------------------------------------------
_SCALARS = st.one_of(st.integers(-10**30, 10**30), st.text(max_size=12), st.booleans(), st.none(),
                     st.floats(allow_nan=True), st.sampled_from(["*a", "&a x", "!!python/object:os.system", "~",
                                                                   "{", "[", "'", '"', ": :", "- -", "\t", "\x00"]))


def _mutations(text: str):
    """Strategies that damage a real mapping the way a hurried pull request would (and worse)."""
    lines = text.splitlines(keepends=True)
    cut = st.integers(0, len(text)).map(lambda i: text[:i])
    replace_line = st.tuples(st.integers(0, len(lines) - 1), _SCALARS).map(
        lambda t: "".join(lines[: t[0]] + [f"{lines[t[0]].split(':')[0]}: {t[1]}\n"] + lines[t[0] + 1:]))
    insert = st.tuples(st.integers(0, len(text)), st.text(max_size=20)).map(lambda t: text[: t[0]] + t[1] + text[t[0]:])
    swap = st.tuples(st.integers(0, len(lines) - 1), st.integers(0, len(lines) - 1)).map(
        lambda t: "".join(lines[: t[0]] + [lines[t[1]]] + lines[t[0] + 1:]))
    return st.one_of(cut, replace_line, insert, swap)


_YAML_TREES = st.recursive(
    _SCALARS.map(str),
    lambda children: st.one_of(
        st.lists(children, max_size=4).map(lambda xs: "[" + ", ".join(xs) + "]"),
        st.dictionaries(st.text("abcdefghijklmnopqrstuvwxyz_", min_size=1, max_size=8), children, max_size=4).map(
            lambda d: "{" + ", ".join(f"{k}: {v}" for k, v in d.items()) + "}")),
    max_leaves=20)

_FUZZED = st.one_of(*[_mutations(p.read_text()) for p in SHIPPED.values()],
                    _YAML_TREES.map(lambda t: f"model_type: llama\nentries: {t}\nverify: {t}\n"),
                    _YAML_TREES.map(lambda t: f"a: &a {t}\nb: [*a, *a, *a]\n"))


# CI runs a few hundred examples, new ones every run (tests/fuzzing.py: a failure prints the seed that
# draws them again); TPMAP_FUZZ_EXAMPLES=10000 runs a long campaign locally
_N = int(os.environ.get("TPMAP_FUZZ_EXAMPLES", "300"))


@fuzzing.seeded
@settings(max_examples=_N, deadline=None, suppress_health_check=list(HealthCheck))
@given(_FUZZED)
def test_fuzzed_mappings_load_to_a_mapping_or_a_located_error(text):
    try:
        source.load_text(text, "fuzzed.yaml")
    except MappingErrors as e:
        assert all(m.position is not None and str(m).startswith("fuzzed.yaml:") for m in e.errors), e


@fuzzing.seeded
@settings(max_examples=max(40, _N // 20), deadline=None, suppress_health_check=list(HealthCheck))
@given(_FUZZED)
def test_fuzzed_mappings_lint_to_diagnostics_never_a_traceback(tmp_path_factory, text):
    path = tmp_path_factory.mktemp("fuzz") / "fuzzed.yaml"
    path.write_text(text, encoding="utf-8", errors="surrogatepass")
    diagnostics = lint_file(str(path))  # any exception other than a return fails the test
    assert all(d.path == str(path) and d.rule for d in diagnostics), [(d.path, d.rule, d.message) for d in diagnostics]


def test_lint_of_a_file_without_entries_whose_verify_config_fails_the_schema_reports_it(tmp_path):
    """The full tier's fuzzing found it (seed 3665245637): lint's one pass (source.salvage) read data['entries'] of a
    file without that key, whose only schema error was in a verify config, and raised KeyError."""
    from tpmap.lint import lint_file

    path = tmp_path / "no_entries.yaml"
    path.write_text("model_type: gpt2\nverify:\n  - name: tiny\n    config: {n_embd: 96, n_head: 12, n_layer: 2}\n"
                    "    models: [GPT2LMHeadModel]\n    bogus: 1\n")
    assert [(d.line, d.rule) for d in lint_file(str(path))] == [(6, "unknown-key")]


def test_lint_of_a_file_whose_verify_config_fails_the_schema_reports_no_pattern_its_variant_alone_has(tmp_path):
    """Fuzzing (seed 3665245637): gemma4.yaml with its second verify config broken. Lint's one pass checks the rest
    against the first config only, whose model has no audio tower nor MoE router: their replicated patterns, one in
    the composed gemma4_text.yaml, were reported as matching nothing. Only the schema error is right."""
    from tpmap.lint import lint_file

    lines = source.shipped_files()["gemma4"].read_text().splitlines(keepends=True)
    broken = next(i for i, line in enumerate(lines) if line.strip().startswith("count:") and i > 60)
    path = tmp_path / "fuzzed.yaml"
    path.write_text("".join(lines[:broken] + [lines[0]] + lines[broken + 1:]))
    assert [(d.path, d.rule) for d in lint_file(str(path))] == [(str(path), "missing-key")]
