"""Time `tpmap lint` per mapping file, after imports: ``python benchmarks/lint.py [PATH ...]``.

Target: under 0.1 s per file, so that 100+ mappings lint in seconds. Per file it reports
the schema phase (YAML + pydantic) and the structural phase (meta-device models, plans at every
declared world size, coverage, pairing), for a first pass (transformers still imports each model
type's modeling module on first use) and for the best of three later passes. The imports counted
apart include transformers' lazily imported modeling_utils (~1 s, once per process).
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

t0 = time.perf_counter()
import torch  # noqa: E402
import transformers  # noqa: E402
import transformers.modeling_utils  # noqa: E402  (transformers imports it lazily, ~1 s, once)
from transformers import AutoConfig  # noqa: E402,F401

from tpmap.language import source  # noqa: E402
from tpmap.language.errors import MappingErrors  # noqa: E402
from tpmap.lint import collect_files  # noqa: E402
from tpmap.lint.rules import structural  # noqa: E402

IMPORTS = time.perf_counter() - t0


def phases(path: str) -> tuple[float, float, int]:
    t = time.perf_counter()
    try:
        loaded = source.load_text(Path(path).read_text(encoding="utf-8"), path)
    except MappingErrors as e:  # schema errors: the structural phase does not run
        return time.perf_counter() - t, 0.0, len(e.errors)
    t1 = time.perf_counter()
    problems = structural(loaded)
    return t1 - t, time.perf_counter() - t1, len(problems)


def main(paths: list[str]) -> int:
    files = collect_files(paths or [str(Path(__file__).resolve().parents[1] / "mappings")])
    print(f"imports (torch, transformers, tpmap): {IMPORTS:.2f} s; torch {torch.__version__}, "
          f"transformers {transformers.__version__}")
    print(f"{'file':<28} {'schema':>8} {'struct 1st':>11} {'total 1st':>10} {'schema':>8} {'struct':>8} "
          f"{'total':>8} {'errors':>6}")
    first_total = warm_total = 0.0
    for f in files:
        s1, st1, n = phases(f)
        best = min((phases(f) for _ in range(3)), key=lambda r: r[0] + r[1])
        first_total += s1 + st1
        warm_total += best[0] + best[1]
        print(f"{Path(f).name:<28} {s1 * 1e3:7.1f}ms {st1 * 1e3:9.1f}ms {(s1 + st1) * 1e3:8.1f}ms "
              f"{best[0] * 1e3:7.1f}ms {best[1] * 1e3:6.1f}ms {(best[0] + best[1]) * 1e3:6.1f}ms {n:>6}")
    k = len(files)
    print(f"per file, mean: first pass {first_total / k * 1e3:.1f} ms, later passes {warm_total / k * 1e3:.1f} ms "
          f"({k} files; target < 100 ms)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
