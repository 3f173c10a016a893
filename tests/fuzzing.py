"""Hypothesis examples that change from run to run, reproducibly: every fuzz test draws from one seed
per session, random unless TPMAP_FUZZ_SEED gives it, and a failure prints the seed next to the
falsifying example (a frozen, derandomized set of examples would test the same few cases forever).

    @fuzzing.seeded
    @settings(...)
    @given(...)
    def test_...(...): ...

Reproduce a failure with ``TPMAP_FUZZ_SEED=<seed> pytest <test id>`` (hypothesis' example database
replays the shrunk example too).
"""
from __future__ import annotations

import functools
import os
import secrets

from hypothesis import note, seed

SEED = int(os.environ.get("TPMAP_FUZZ_SEED") or secrets.randbelow(2**32))


def seeded(test):
    """Draw `test`'s examples (a @given test) from this session's SEED, and name it when one fails."""
    inner = test.hypothesis.inner_test

    @functools.wraps(inner)
    def noting(*args, **kwargs):
        note(f"fuzz seed: rerun with TPMAP_FUZZ_SEED={SEED} to draw the same examples")
        return inner(*args, **kwargs)

    test.hypothesis.inner_test = noting
    return seed(SEED)(test)
