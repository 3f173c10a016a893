"""`tpmap lint --schema-only` (issue 39): the schema layer alone, fast enough for an editor's save or a pre-commit
hook because it never imports torch or transformers; the same diagnostics as the schema part of the full lint.

The golden cases (tests/lint/cases, whose .out files the full lint wrote) are the reference: this mode must report
exactly their schema-layer lines and nothing else.
"""
from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tpmap.lint import RULES, SCHEMA_RULES, lint_paths, lint_schema

_spec = importlib.util.spec_from_file_location("tpmap_lint_regen", Path(__file__).with_name("regen.py"))
regen = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(regen)
ROOT, CASES, NAMES = regen.ROOT, regen.CASES, regen.case_names()

# the full lint's schema-rule ids that come from its structural pass (they need the model classes): a verify
# input that is no argument of the class's forward (unknown-key), a main input other than input_ids (missing-key)
STRUCTURAL_SCHEMA_IDS = {"verify_inputs": {(34, "missing-key"), (41, "missing-key"), (50, "unknown-key")}}

_LINE = re.compile(r"^(?P<path>\S+?):(?P<line>\d+):(?P<col>\d+): (?:error|note): (?P<message>.*) "
                   r"\[(?P<rule>[a-z-]+)\]$")


def _golden(name: str) -> list[tuple]:
    """(path, line, col, rule, message) of each diagnostic in case `name`'s .out (the full lint's output)."""
    return [(m["path"], int(m["line"]), int(m["col"]), m["rule"], m["message"])
            for text in (CASES / f"{name}.out").read_text(encoding="utf-8").splitlines() if (m := _LINE.match(text))]


# Runs `python -m tpmap` (runpy, as -m does) with ARGS, then reports, from the same process, which of torch and
# transformers it imported: stdout is the command's, the last line of stderr this JSON.
PROBE = """
import json, runpy, sys
sys.argv = ["tpmap", *json.loads(sys.argv[1])]
try:
    runpy.run_module("tpmap", run_name="__main__", alter_sys=True)
    status = 0
except SystemExit as e:
    status = e.code
sys.stdout.flush()
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "transformers"))
print(json.dumps({"status": status, "heavy": heavy[:5]}), file=sys.stderr)
"""


def _probe(*args: str) -> tuple[int, str, list[str]]:
    done = subprocess.run([sys.executable, "-c", PROBE, json.dumps(list(args))], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    last = json.loads(done.stderr.strip().splitlines()[-1])
    return last["status"], done.stdout, last["heavy"]


def test_the_command_reports_schema_errors_and_imports_neither_torch_nor_transformers():
    status, out, heavy = _probe("lint", "--schema-only", "mappings/gpt2.yaml", "tests/lint/cases/typo_key.yaml")
    assert heavy == [], f"tpmap lint --schema-only imported {heavy}"
    assert status == 1
    golden = (CASES / "typo_key.out").read_text()
    assert out == golden.replace("1 error in 1 of 1 file", "1 error in 1 of 2 files"), out
    assert out.startswith("tests/lint/cases/typo_key.yaml:10:5: error: unknown key 'combined_qvk' (did you mean "
                          "combined_qkv?); ")
    assert out.splitlines()[0].endswith(" [unknown-key]")
    status, out, heavy = _probe("lint", "--schema-only", "--format", "github", "mappings/llama.yaml")
    assert (status, out, heavy) == (0, "", [])
    status, out, heavy = _probe("lint", "--schema-only", "no/such/dir")  # a usage error exits 2, as the full lint
    assert (status, heavy) == (2, [])


def test_importing_the_linter_imports_neither_torch_nor_transformers():
    """The structural rules (tpmap.lint.rules: the planner, transformers) are imported when they first run."""
    code = ("import sys, tpmap.lint, tpmap.lint.diagnostic, tpmap.lint.report\n"
            "print(sorted(m for m in ('torch', 'transformers', 'tpmap.lint.rules') if m in sys.modules))")
    probe = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert probe.returncode == 0 and probe.stdout == "[]\n", probe.stdout + probe.stderr


def test_every_shipped_mapping_is_clean():
    status, out = regen.run_lint("--schema-only", "mappings/")
    files = sorted((ROOT / "mappings").glob("*.yaml"))
    assert (status, out) == (0, f"{len(files)} files linted, no errors\n")
    assert lint_paths(None, schema_only=True) == ([f"mappings/{f.name}" for f in files], [])


@pytest.mark.parametrize("name", NAMES)
def test_the_schema_part_of_the_full_lint(name):
    """On every golden case: exactly the full lint's diagnostics of the schema rules, in its order and words, less
    the few schema-rule ids its structural pass finds (STRUCTURAL_SCHEMA_IDS); none of another rule."""
    golden = _golden(name)
    got = [(d.path, d.line, d.col, d.rule, d.message) for d in lint_schema(f"tests/lint/cases/{name}.yaml")]
    left_out = STRUCTURAL_SCHEMA_IDS.get(name, set())
    assert got == [g for g in golden if g[3] in SCHEMA_RULES and (g[1], g[3]) not in left_out]
    assert {(g[1], g[3]) for g in golden if g[3] in SCHEMA_RULES and g not in got} == left_out


def test_a_file_with_schema_errors_only_reads_as_in_the_full_lint():
    """Where a case's errors are all schema errors the whole output is the golden one (text; json's positions); where
    it has both kinds, its schema errors alone."""
    schema_cases = [n for n in NAMES if all(g[3] in SCHEMA_RULES for g in _golden(n))]
    assert {"many_schema_errors", "yaml_syntax", "duplicate_key", "empty_file", "typo_key"} <= set(schema_cases)
    for name in schema_cases:
        expected = (CASES / f"{name}.out").read_text(encoding="utf-8")
        assert regen.run_lint("--schema-only", f"tests/lint/cases/{name}.yaml") == (1, expected), name
    # schema and structural errors in one file (the full lint reports both in one pass): the schema one alone
    golden = (CASES / "schema_and_structure_one_pass.out").read_text(encoding="utf-8").splitlines()
    assert regen.run_lint("--schema-only", "tests/lint/cases/schema_and_structure_one_pass.yaml") == (
        1, "\n".join(golden[:3] + ["1 error in 1 of 1 file"]) + "\n")
    assert golden[0].endswith("[unknown-key]") and golden[3].endswith("[pattern-no-match]")
    status, out = regen.run_lint("--schema-only", "--format", "json", "tests/lint/cases/many_schema_errors.yaml")
    assert status == 1
    assert [(d["line"], d["col"], d["rule"]) for d in json.loads(out)["diagnostics"]] == \
        [(g[1], g[2], g[3]) for g in _golden("many_schema_errors")]


def test_the_rules_of_the_mode():
    def listed(*args):
        status, out = regen.run_lint(*args, "--rules")
        assert status == 0
        return [tuple(line.split(None, 1)) for line in out.splitlines()]

    assert set(SCHEMA_RULES) < set(RULES)
    assert listed("--schema-only") == [r for r in listed() if r[0] in SCHEMA_RULES]
    assert [r for r, _ in listed("--schema-only")] == list(SCHEMA_RULES)
