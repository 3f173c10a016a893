"""Shared fixtures and the two test tiers.

`ranks(ws)` gives a pool of `ws` real gloo processes, started once per session and reused by every
test (starting a rank with transformers imported costs seconds).

Tiers: `pytest -q` runs the default tier, `pytest -q --full` everything (what CI's .ci/run runs). The
default tier keeps every test that neither starts ranks nor writes a checkpoint (unit tests, plans of
meta models, golden lint cases, hypothesis properties) and, of those that do (FAMILY_FIXTURES), the ones
whose model type (a `ref` or `model_type` parameter) is a representative family below and whose world
size (a `ws` or `world_size` parameter) is 2. Tests marked `full` (torchrun examples, dp x tp,
torch.compile, tests that start 3 or 4 ranks without a world-size parameter, the wrong-mapping cases
beyond one per feature) run in the full tier only. Tests marked `per_family` run no rank but repeat a
fraction of a second for every shipped mapping (a draft, a plan of a tiny model): the default tier keeps
the representative families and the model types the marker names (`also=`), the full tier all of them.
"""
from __future__ import annotations

import json
import os
import time

import pytest

from tpmap.parallelize.rank_processes import RankPool

# Families whose multi-rank tests run in the default tier: together they use every entry kind (Column,
# Row, Update, Param, Reduce, Enter, Norm, Input) and every flag of MODELS.md's features column.
REPRESENTATIVE = {
    "llama",        # the plain decoder: grouped-query attention, a separate LM head
    "gpt2",         # Conv1D: reverse, combined_qkv; tied embedding and LM head
    "bert",         # encoder; heads for masked LM, sequence classification and the bare model
    "t5",           # encoder-decoder with cross attention; relative attention bias split by heads
    "mixtral",      # MoE: Param experts with sections, Reduce
    "qwen3_moe",    # MoE with `when` (dense layers) and grad_allreduce (q/k norms)
    "deepseek_v3",  # MLA: Enter, copy_input: false, grad_allreduce
    "falcon",       # Input (ALiBi mask), groups, when across four layouts
    "phi3",         # fused qkv and gate/up: unequal sections; per-rank config copy
    "bloom",        # Input (ALiBi, flattened [B * H]); an `unsupported` variant
    "gpt_neox",     # head-major fused qkv without combined_qkv; parallel attention + MLP
    "mamba",        # SSM: Param on a depthwise conv, Enter
    "olmoe",        # Norm (q/k statistics over split features) in an MoE
    "gpt_oss",      # partial: an expert bias added once inside the partial sum
    "fsmt",         # gather_output, a partial mapping (attention kept whole), not_checked grad_fp64
    "llava",        # compose: a language model and a vision tower mapped by their own files; image inputs
}
DEFAULT_WORLD_SIZE = 2
# a test using one of these runs models per family: on real ranks, or saved to and loaded from a checkpoint
FAMILY_FIXTURES = {"ranks", "checkpoint"}


def pytest_addoption(parser):
    parser.addoption("--full", action="store_true", default=False,
                     help="run the full tier: every family at every world size and the tests marked full "
                          "(what CI runs); without it, the default tier (see tests/conftest.py)")
    parser.addoption("--only-beyond-newest", action="store_true", default=False,
                     help="only the cases of mappings whose own `transformers` range excludes the newest proven "
                          "release (the main run skips them): .ci/run runs these on the oldest release")


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


def _params(item) -> dict:
    return getattr(getattr(item, "callspec", None), "params", {})


def _architecture(item) -> str | None:
    """The model type a parametrized test names (`ref` in tests/test_mappings.py, `model_type` in
    tests/test_checkpoint.py, ...), or None."""
    params = _params(item)
    value = params.get("ref", params.get("model_type"))
    return value if isinstance(value, str) else None


def _full_only(item) -> bool:
    """True when `item` belongs to the full tier only."""
    if item.get_closest_marker("full"):
        return True
    per_family = item.get_closest_marker("per_family")
    if per_family is not None:
        arch = _architecture(item)
        assert arch is not None, f"{item.nodeid}: per_family needs a `ref` or `model_type` parameter"
        return arch not in REPRESENTATIVE and arch not in per_family.kwargs.get("also", ())
    if not FAMILY_FIXTURES & set(item.fixturenames):
        return False  # no rank process, no checkpoint: always in the default tier
    params = _params(item)
    arch = _architecture(item)
    world_size = params.get("ws", params.get("world_size"))
    return (arch is not None and arch not in REPRESENTATIVE) or (world_size not in (None, DEFAULT_WORLD_SIZE))


_LEFT_TO_FULL: list[int] = []


def _release_range(arch: str | None, cache: dict = {}) -> str | None:  # noqa: B006 (a cache per session)
    """The shipped mapping `arch`'s own `transformers` range (None: none, or not a shipped mapping)."""
    from tpmap import verify
    from tpmap.language import source

    if arch not in cache:
        cache[arch] = verify.resolve(arch).mapping.transformers if arch in source.shipped_files() else None
    return cache[arch]


def _skip_outside_range(items) -> None:
    """A case of a mapping whose own range excludes the installed transformers is skipped, saying so: .ci/run
    proves it on the releases in its range (`--only-beyond-newest` on the oldest)."""
    import transformers

    from tpmap.compat import mapping_applies

    for item in items:
        spec = _release_range(_architecture(item))
        if spec is not None and not mapping_applies(spec):
            item.add_marker(pytest.mark.skip(reason=f"mappings/{_architecture(item)}.yaml needs transformers{spec}; "
                                                    f"{transformers.__version__} is installed"))


def pytest_collection_modifyitems(config, items):
    from tpmap.compat import PROVEN, mapping_applies

    if config.getoption("--only-beyond-newest"):
        keep = [i for i in items if (spec := _release_range(_architecture(i))) is not None
                and not mapping_applies(spec, PROVEN[-1])]
        config.hook.pytest_deselected(items=[i for i in items if i not in keep])
        items[:] = keep
    _skip_outside_range(items)
    if config.getoption("--full"):
        return
    keep, left = [], []
    for item in items:
        (left if _full_only(item) else keep).append(item)
    if left:
        config.hook.pytest_deselected(items=left)
        items[:] = keep
    _LEFT_TO_FULL.append(len(left))


# --- time per architecture and per file ----------------------------------------------------------
# Every parametrized test that names a model type adds its wall time, setup included, to that model
# type. The terminal summary prints the slowest ones and the totals; `TPMAP_SUITE_TIMES=FILE` also
# writes them all as JSON.
_SECONDS_BY_ARCH: dict[str, float] = {}
_SECONDS_BY_FILE: dict[str, float] = {}  # every test, by its file: where CI's time goes
_SESSION_START = time.perf_counter()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    start = time.perf_counter()
    yield
    path = item.nodeid.split("::")[0]
    _SECONDS_BY_FILE[path] = _SECONDS_BY_FILE.get(path, 0.0) + time.perf_counter() - start
    arch = _architecture(item)
    if arch is not None:
        _SECONDS_BY_ARCH[arch] = _SECONDS_BY_ARCH.get(arch, 0.0) + time.perf_counter() - start


def pytest_terminal_summary(terminalreporter):
    write = terminalreporter.write_line
    if _LEFT_TO_FULL and _LEFT_TO_FULL[-1]:
        left = _LEFT_TO_FULL[-1]
        write(f"default tier: {left} test{'s' * (left != 1)} left to the full tier (pytest --full runs them)")
    wall = time.perf_counter() - _SESSION_START
    if len(_SECONDS_BY_FILE) > 1:
        per_file = sorted(_SECONDS_BY_FILE.items(), key=lambda kv: -kv[1])
        write(f"time per file ({wall:.0f} s wall): " + ", ".join(
            f"{path.removeprefix('tests/')} {seconds:.0f}s" for path, seconds in per_file[:15]))
    if not _SECONDS_BY_ARCH:
        return
    per_arch = sorted(_SECONDS_BY_ARCH.items(), key=lambda kv: -kv[1])
    total = sum(_SECONDS_BY_ARCH.values())
    write(f"time per architecture: {len(per_arch)} model types, {total:.0f} s of {wall:.0f} s wall "
          f"(mean {total / len(per_arch):.1f} s); slowest:")
    write("  " + ", ".join(f"{arch} {seconds:.1f}s" for arch, seconds in per_arch[:12]))
    out = os.environ.get("TPMAP_SUITE_TIMES")
    if out:
        with open(out, "w") as f:
            json.dump({"wall_s": round(wall, 1), "architectures_s": round(total, 1),
                       "per_file_s": {p: round(s, 1) for p, s in sorted(_SECONDS_BY_FILE.items())},
                       "per_architecture_s": {a: round(s, 2) for a, s in per_arch}}, f, indent=1)
