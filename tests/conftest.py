"""Shared fixtures. `ranks(ws)` gives a pool of `ws` real gloo processes, started once per session
and reused by every test (starting a rank with transformers imported costs seconds)."""
from __future__ import annotations

import json
import os
import time

import pytest

from tpmap.launch import RankPool


@pytest.fixture(scope="session")
def ranks():
    pools: dict[int, RankPool] = {}

    def get(world_size: int) -> RankPool:
        if world_size not in pools:
            pools[world_size] = RankPool(world_size)
        return pools[world_size]

    yield get
    for pool in pools.values():
        pool.close()


# --- time per architecture -------------------------------------------------------------------------
# Issue 9 asks for the suite's time per architecture: every parametrized test that names a model type
# (`ref` in tests/test_mappings.py, `model_type` in tests/test_checkpoint.py, ...) adds its wall time,
# setup included, to that model type. The terminal summary prints the slowest ones and the totals;
# `TPMAP_SUITE_TIMES=FILE` also writes them all as JSON.
_SECONDS_BY_ARCH: dict[str, float] = {}
_SESSION_START = time.perf_counter()


def _architecture(item) -> str | None:
    params = getattr(getattr(item, "callspec", None), "params", {})
    value = params.get("ref", params.get("model_type"))
    return value if isinstance(value, str) else None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    start = time.perf_counter()
    yield
    arch = _architecture(item)
    if arch is not None:
        _SECONDS_BY_ARCH[arch] = _SECONDS_BY_ARCH.get(arch, 0.0) + time.perf_counter() - start


def pytest_terminal_summary(terminalreporter):
    if not _SECONDS_BY_ARCH:
        return
    wall = time.perf_counter() - _SESSION_START
    per_arch = sorted(_SECONDS_BY_ARCH.items(), key=lambda kv: -kv[1])
    total = sum(_SECONDS_BY_ARCH.values())
    write = terminalreporter.write_line
    write(f"time per architecture: {len(per_arch)} model types, {total:.0f} s of {wall:.0f} s wall "
          f"(mean {total / len(per_arch):.1f} s); slowest:")
    write("  " + ", ".join(f"{arch} {seconds:.1f}s" for arch, seconds in per_arch[:12]))
    out = os.environ.get("TPMAP_SUITE_TIMES")
    if out:
        with open(out, "w") as f:
            json.dump({"wall_s": round(wall, 1), "architectures_s": round(total, 1),
                       "per_architecture_s": {a: round(s, 2) for a, s in per_arch}}, f, indent=1)
