"""Time `tpmap lint`: ``python benchmarks/lint.py [PATH ...]`` (after imports, per file) and
``python benchmarks/lint.py --cold [FILE] [--repeat N]`` (whole fresh processes, as a pre-commit hook or an editor
runs it).

After imports -- target: under 0.1 s per file, so that 100+ mappings lint in seconds. Per file it reports
the schema phase (YAML + pydantic) and the structural phase (meta-device models, plans at every
declared world size, coverage, pairing), for a first pass (transformers still imports each model
type's modeling module on first use) and for the best of three later passes. The imports counted
apart include transformers' lazily imported modeling_utils (~1 s, once per process).

--cold -- each command in a new Python process, best and median of N runs (default 5), wall clock:
`tpmap lint --schema-only FILE`, `tpmap lint --schema-only mappings/`, `tpmap lint FILE`, and the floor of the
full lint: a process that only imports torch, transformers and FILE's verify model classes, which the full
lint cannot avoid (it builds those models on the meta device). `python -c pass` is the interpreter's own floor.
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _imports() -> float:
    """Import what the structural rules need (timed apart from the per-file passes); returns the seconds taken."""
    t0 = time.perf_counter()
    import torch  # noqa: F401
    import transformers
    import transformers.modeling_utils  # noqa: F401  (transformers imports it lazily, ~1 s, once)
    from transformers import AutoConfig  # noqa: F401

    import tpmap.lint.rules  # noqa: F401
    return time.perf_counter() - t0


def phases(path: str) -> tuple[float, float, int]:
    from tpmap.language import source
    from tpmap.language.errors import MappingErrors
    from tpmap.lint.rules import structural

    t = time.perf_counter()
    try:
        loaded = source.load_text(Path(path).read_text(encoding="utf-8"), path)
    except MappingErrors as e:  # schema errors: the structural phase does not run
        return time.perf_counter() - t, 0.0, len(e.errors)
    t1 = time.perf_counter()
    problems = structural(loaded)
    return t1 - t, time.perf_counter() - t1, len(problems)


def warm(paths: list[str]) -> int:
    import torch
    import transformers

    from tpmap.lint import collect_files

    imports = _imports()
    files = collect_files(paths or [str(ROOT / "mappings")])
    print(f"imports (torch, transformers, tpmap): {imports:.2f} s; torch {torch.__version__}, "
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


def _cold_commands(file: str) -> list[tuple[str, list[str]]]:
    """(label, argv) of each cold measurement, run from the repository root."""
    from tpmap.language import source

    classes = sorted({c for spec in source.read_file(ROOT / file).mapping.verify for c in spec.models})
    floor = f"import torch, transformers; from transformers import {', '.join(classes)}"
    py, tpmap = sys.executable, [sys.executable, "-m", "tpmap"]
    return [
        ("python -c pass (the interpreter)", [py, "-c", "pass"]),
        (f"tpmap lint --schema-only {file}", [*tpmap, "lint", "--schema-only", file]),
        ("tpmap lint --schema-only mappings/", [*tpmap, "lint", "--schema-only", "mappings/"]),
        (f"tpmap lint {file}", [*tpmap, "lint", file]),
        (f"floor of the full lint: {floor}", [py, "-c", floor]),
    ]


def cold(file: str, repeat: int) -> int:
    """Each command in a fresh process, `repeat` times, interleaved (a slower moment of a shared machine then costs
    every command alike); best and median wall seconds."""
    commands = _cold_commands(file)
    times: dict[str, list[float]] = {label: [] for label, _ in commands}
    for _ in range(repeat):
        for label, argv in commands:
            t = time.perf_counter()
            done = subprocess.run(argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            times[label].append(time.perf_counter() - t)
            if done.returncode != 0:
                print(f"{label}: exit status {done.returncode}\n{done.stderr}", file=sys.stderr)
                return 1
    files = len(list((ROOT / "mappings").glob("*.yaml")))
    width = max(map(len, times))
    print(f"cold processes, {repeat} runs each, wall seconds (mappings/ holds {files} files)")
    print(f"{'command':<{width}}  {'best':>6}  {'median':>6}")
    for label, ts in times.items():
        print(f"{label:<{width}}  {min(ts):6.2f}  {statistics.median(ts):6.2f}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("paths", nargs="*", metavar="PATH", help="mapping files or folders (default: mappings/); "
                        "with --cold one file, relative to the repository root (default: mappings/gpt2.yaml)")
    parser.add_argument("--cold", action="store_true", help="whole fresh processes instead of passes after imports")
    parser.add_argument("--repeat", type=int, default=5, help="with --cold: runs of each command (default 5)")
    args = parser.parse_args(argv)
    if args.cold:
        if len(args.paths) > 1:
            parser.error("--cold times one file")
        return cold(args.paths[0] if args.paths else "mappings/gpt2.yaml", args.repeat)
    return warm(args.paths)


if __name__ == "__main__":
    sys.exit(main())
