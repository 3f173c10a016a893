"""Shared fixtures. `ranks(ws)` gives a pool of `ws` real gloo processes, started once per session
and reused by every test (starting a rank with transformers imported costs seconds)."""
from __future__ import annotations

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
