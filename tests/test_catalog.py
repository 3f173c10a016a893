"""MODELS.md is generated from what CI proves, and stays in step with the mappings and the test cases."""
from __future__ import annotations

from pathlib import Path

import test_mappings

from tpmap import catalog, verify
from tpmap.language import source

ROOT = Path(__file__).resolve().parents[1]


def test_models_md_is_the_generated_table():
    want = catalog.render(catalog.rows())
    assert (ROOT / "MODELS.md").read_text() == want, "regenerate it: tpmap models -o MODELS.md"


def test_each_row_lists_exactly_the_checks_ci_runs():
    for model_type in source.shipped_files():
        cases = [c.values for c in test_mappings.CASES if c.values[0] == model_type]
        forward, gradient, generate = catalog.proven_checks(verify.resolve(model_type).mapping)
        assert forward == sorted({c[3] for c in cases}), model_type
        assert gradient == sorted({c[3] for c in cases if c[4]}), model_type
        # a declared not_checked generate: CI proves the unsharded generate fails instead; the table says "-"
        skipped = "generate" in verify.resolve(model_type).mapping.verify[0].not_checked
        assert generate == ([] if skipped else sorted({c[3] for c in cases if c[5]})), model_type
