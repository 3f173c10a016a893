"""Regenerate the golden outputs: ``python tests/lint/regen.py [NAME ...]`` (default: every case).

Each ``tests/lint/cases/NAME.yaml`` is one realistic mistake in a mapping of a shipped model type;
``NAME.out`` is the exact text `tpmap lint tests/lint/cases/NAME.yaml` prints, run from the
repository root (paths as given, so the outputs do not depend on the machine). Review the diff
(`git diff tests/lint/cases`) before committing regenerated files.
"""
from __future__ import annotations

import contextlib
import io
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CASES = ROOT / "tests" / "lint" / "cases"


def case_names() -> list[str]:
    return sorted(p.stem for p in CASES.glob("*.yaml"))


def run_lint(*args: str) -> tuple[int, str]:
    """`tpmap lint ARGS` in this process, from the repository root: (exit status, stdout)."""
    from tpmap.cli import main

    here = os.getcwd()
    out = io.StringIO()
    try:
        os.chdir(ROOT)
        with contextlib.redirect_stdout(out):
            status = main(["lint", *args])
    finally:
        os.chdir(here)
    return status, out.getvalue()


def run_case(name: str) -> tuple[int, str]:
    return run_lint(f"tests/lint/cases/{name}.yaml")


def main(names: list[str]) -> int:
    for name in names or case_names():
        status, text = run_case(name)
        (CASES / f"{name}.out").write_text(text, encoding="utf-8")
        print(f"{name}: exit {status}, {text.count(': error: ')} errors")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
