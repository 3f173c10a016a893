"""`tpmap lint`: golden outputs for realistic mistakes, the output formats, exit codes, `tpmap schema`.

Regenerate the .out files with ``python tests/lint/regen.py`` after an intended change of a message.
No test here starts a rank process or reads a weight.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tpmap import compat
from tpmap.language import source

_spec = importlib.util.spec_from_file_location("tpmap_lint_regen", Path(__file__).with_name("regen.py"))
regen = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(regen)

ROOT, CASES = regen.ROOT, regen.CASES
NAMES = regen.case_names()

# realistic mistakes, each with at least one case (name -> rule it must report)
REQUIRED = {
    "typo_key": "unknown-key", "unknown_kind": "unknown-kind", "wrong_type": "wrong-type",
    "yaml_syntax": "yaml-syntax", "tab_indentation": "yaml-syntax", "duplicate_key": "duplicate-key",
    "empty_file": "empty-file", "pattern_no_match": "pattern-no-match", "double_match": "double-match",
    "uncovered_linear": "coverage", "column_without_row": "pairing", "fused_sections": "fused-sections",
    "missing_config_attribute": "config-attribute", "world_size": "divisibility",
    "reverse_on_linear": "orientation",
    # entry kinds beyond Column, Row and Update (Param, Reduce, Input, Norm), when, groups, unsupported
    "param_unknown_tensor": "module-kind", "param_dim_out_of_range": "module-kind",
    "param_partial_with_dim": "wrong-type", "reduce_no_match": "pattern-no-match",
    "input_argument": "module-kind", "norm_module_kind": "module-kind", "when_never": "when-never",
    "groups_divisibility": "divisibility", "unsupported_variant": "unsupported", "when_operator": "wrong-type",
    "when_undefined_attribute": "when-attribute", "config_default_defined": "when-attribute",
    "transformers_never": "transformers-never", "when_layer_never": "when-never",
    # composed mappings: a sub-model without a mapping; an error in a composed file, at its own line
    "compose_no_mapping": "compose", "compose_entry_error": "config-attribute",
    # expert parallelism: more ranks than experts; a Route without its Reduce
    "route_expert_count": "expert-count", "route_without_reduce": "route-reduce",
    # a per-layer list read at a module's layer: at_layer of a scalar
    "at_layer_not_a_list": "config-attribute",
}


def test_at_least_the_required_cases_exist():
    assert len(NAMES) >= 15
    assert set(REQUIRED) <= set(NAMES)
    for name, rule in REQUIRED.items():
        assert f"[{rule}]" in (CASES / f"{name}.out").read_text(), name


@pytest.mark.parametrize("name", NAMES)
def test_golden(name):
    expected = (CASES / f"{name}.out").read_text(encoding="utf-8")
    status, out = regen.run_case(name)
    assert out == expected, f"output of case {name} changed; if intended, run: python tests/lint/regen.py {name}"
    assert status == 1 and ": error: " in out


def test_every_rule_is_documented_and_has_a_golden_case():
    from tpmap.lint import RULES

    rules_page = (ROOT / "docs" / "lint.md").read_text()
    seen = set()
    for name in NAMES:
        for line in (CASES / f"{name}.out").read_text().splitlines():
            if ": error: " in line:
                seen.add(line.rsplit("[", 1)[1].rstrip("]"))
    assert seen == set(RULES)
    for rule in RULES:
        assert f"| `{rule}` |" in rules_page, rule


def test_shipped_mappings_are_clean_and_lint_loads_no_weights_and_starts_no_process_group(monkeypatch):
    """The one full lint of every shipped mapping in this file (each pass costs ~20 s); the other tests of
    the command line lint one or two shipped files beside the cases."""
    import torch.distributed as dist
    import transformers

    def forbidden(*args, **kwargs):
        raise AssertionError("tpmap lint must not do this")

    monkeypatch.setattr(dist, "init_process_group", forbidden)
    monkeypatch.setattr(transformers.PreTrainedModel, "from_pretrained", forbidden)
    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", forbidden)
    status, out = regen.run_lint("mappings/")
    files = sorted((ROOT / "mappings").glob("*.yaml"))
    assert status == 0 and out.splitlines()[-1] == f"{len(files)} files linted, no errors", out
    # the only diagnostics: a note for each mapping whose own range excludes the installed release (not checked)
    outside = [f"mappings/{f.name}" for f in files
               if not compat.mapping_applies(source.read_file(f).mapping.transformers)]
    notes = [line.split(":", 1)[0] for line in out.splitlines() if ": note: not checked: the mapping needs" in line]
    assert notes == outside and out.count(": note: ") == len(outside) and ": error: " not in out, out
    assert not (dist.is_available() and dist.is_initialized())


def test_all_errors_of_all_files_sorted_by_file_and_line():
    names = ["world_size", "many_schema_errors", "double_match"]
    clean = ["mappings/llama.yaml", "mappings/gpt2.yaml"]  # clean files given between and after them
    status, out = regen.run_lint(f"tests/lint/cases/{names[0]}.yaml", clean[0],
                                 *(f"tests/lint/cases/{n}.yaml" for n in names[1:]), clean[1])
    assert status == 1
    parts = [regen.run_case(n)[1].rsplit("\n", 2)[0] + "\n" for n in sorted(names)]
    total = sum(p.count(": error: ") for p in parts)
    assert out == "".join(parts) + f"{total} errors in 3 of 5 files\n"


def test_json_format():
    status, out = regen.run_lint("--format", "json", "tests/lint/cases/world_size.yaml", "mappings/gpt2.yaml")
    data = json.loads(out)
    assert status == 1
    assert data["files"] == ["tests/lint/cases/world_size.yaml", "mappings/gpt2.yaml"]
    first = data["diagnostics"][0]
    assert first == {
        "path": "tests/lint/cases/world_size.yaml", "line": 5, "col": 13, "severity": "error",
        "rule": "divisibility", "message": first["message"],
    }
    assert first["message"].startswith("world size 8: transformer.h.0.attn.c_attn would be split unevenly")
    assert [d["rule"] for d in data["diagnostics"]] == ["divisibility"] * 4  # and the 3 Updates that read tp_size
    status, out = regen.run_lint("--format", "json", "mappings/gpt2.yaml", "mappings/llama.yaml")
    files = ["mappings/gpt2.yaml", "mappings/llama.yaml"]
    assert status == 0 and json.loads(out) == {"files": files, "diagnostics": []}


def test_github_format():
    status, out = regen.run_lint("--format", "github", "tests/lint/cases/typo_key.yaml",
                                 "tests/lint/cases/yaml_syntax.yaml")
    assert status == 1
    lines = out.splitlines()
    assert lines[0] == (
        "::error file=tests/lint/cases/typo_key.yaml,line=10,col=5,title=tpmap lint [unknown-key]::"
        "unknown key 'combined_qvk' (did you mean combined_qkv?); valid keys here: module, when, experts, when_layer, "
        "transformers, classes, sections, heads, query_heads, interleaved, groups, reverse, combined_qkv, "
        "gather_output, copy_input"
    )
    # the message's own ':' and ',' stay as they are in the data part; properties are escaped
    assert lines[1].startswith("::error file=tests/lint/cases/yaml_syntax.yaml,line=35,col=11,")
    assert len(lines) == 2
    assert regen.run_lint("--format", "github", "mappings/gpt2.yaml") == (0, "")


def test_github_escaping():
    from tpmap.lint import Diagnostic
    from tpmap.lint.report import github

    d = Diagnostic("a,b:c.yaml", 1, 2, "wrong-type", "100% wrong\nsecond line")
    assert github([], [d]) == ("::error file=a%2Cb%3Ac.yaml,line=1,col=2,title=tpmap lint [wrong-type]::"
                               "100%25 wrong%0Asecond line\n")


def test_caret_keeps_tabs(tmp_path):
    from tpmap.lint import Diagnostic
    from tpmap.lint.report import text

    f = tmp_path / "t.yaml"
    f.write_text("a:\n\t  b: 1\n")
    out = text([str(f)], [Diagnostic(str(f), 2, 4, "yaml-syntax", "m")])
    assert out.splitlines()[1:3] == ["\t  b: 1", "\t  ^"]


def test_usage_errors_exit_2(tmp_path, capsys):
    from tpmap.cli import main

    assert main(["lint", str(tmp_path / "missing.yaml")]) == 2
    assert "no such file or folder" in capsys.readouterr().err
    assert main(["lint", str(tmp_path)]) == 2  # a folder without mappings
    assert "no .yaml or .yml files" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["lint", "--format", "xml"])
    assert e.value.code == 2


def test_default_paths_are_the_shipped_mappings(monkeypatch):
    import tpmap.lint

    linted = []  # which files a bare `tpmap lint` lints (linting them is the test above)
    monkeypatch.setattr(tpmap.lint, "lint_file", lambda f: linted.append(f) or [])
    status, out = regen.run_lint()
    shipped = sorted(f"mappings/{p.name}" for p in (ROOT / "mappings").glob("*.yaml"))
    assert (status, out, linted) == (0, f"{len(shipped)} files linted, no errors\n", shipped)


def test_rules_listing(capsys):
    from tpmap.cli import main
    from tpmap.lint import RULES

    assert main(["lint", "--rules"]) == 0
    out = capsys.readouterr().out
    assert all(rule in out for rule in RULES)


def test_subprocess_exit_codes_and_output():
    """The real command line, as CI and the pre-commit hook run it."""
    env = dict(os.environ)  # the installed tpmap, as CI and pre-commit run it
    cmd = [sys.executable, "-m", "tpmap", "lint"]
    bad = subprocess.run(cmd + ["tests/lint/cases/fused_sections.yaml"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=120)
    assert bad.returncode == 1, bad.stderr
    assert bad.stdout == (CASES / "fused_sections.out").read_text()
    good = subprocess.run(cmd + ["mappings/gpt2.yaml"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert good.returncode == 0 and "no errors" in good.stdout, good.stderr
    usage = subprocess.run(cmd + ["no/such/dir"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert usage.returncode == 2 and "no such file" in usage.stderr


def test_schema_command(capsys):
    from tpmap.cli import main
    from tpmap.language.schema import Mapping

    assert main(["schema"]) == 0
    schema = json.loads(capsys.readouterr().out)
    assert set(Mapping.model_fields) <= set(schema["properties"])
    assert set(schema["required"]) == {"model_type", "verify"}  # entries or compose: checked by the model
    assert {"Column", "Row", "Update", "Section", "Verify"} <= set(schema["$defs"])
    assert schema["additionalProperties"] is False


def test_shipped_schema_file_is_current_and_referenced():
    from tpmap.language.schema import json_schema

    shipped = json.loads((ROOT / "mappings" / "mapping.schema.json").read_text())
    assert shipped == json_schema(), "regenerate it: tpmap schema > mappings/mapping.schema.json"
    for f in sorted((ROOT / "mappings").glob("*.yaml")):
        first = f.read_text().splitlines()[0]
        assert first == "# yaml-language-server: $schema=mapping.schema.json", f  # beside it, in source and wheel
        assert (f.parent / first.split("=", 1)[1]).resolve() == (ROOT / "mappings" / "mapping.schema.json").resolve()
