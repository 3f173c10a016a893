"""Loss-curve parity (benchmarks/loss_curves.py) for one cheap family in the full tier: Llama, 100 AdamW steps at
tp 2 on real ranks, against the unsharded run of this test and against the stored curve
(benchmarks/loss_curves/llama.json), so CI keeps the stored curves honest. The whole check runs the families at
tp 2 and 4: `python benchmarks/loss_curves.py`."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

# at import (collection), before any rank pool starts: spawned ranks inherit sys.path and import the module by name
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import loss_curves

pytestmark = pytest.mark.full


def test_llama_curve_at_tp2_matches_unsharded_and_stored(ranks):
    lines = []
    rows = loss_curves.check(["llama"], [2], ranks, log=lines.append)
    report = "\n".join([loss_curves.HEADER, *lines])
    assert [(r.family, r.tp) for r in rows] == [("llama", 1), ("llama", 2)], report
    assert rows[0].stored is not None, f"no stored curve: python benchmarks/loss_curves.py --update\n{report}"
    assert all(r.passed for r in rows), report
    stored = loss_curves.stored("llama")
    assert len(stored) == loss_curves.STEPS and stored[-1] < 0.5 * stored[0]  # a curve that trains, not a flat line
