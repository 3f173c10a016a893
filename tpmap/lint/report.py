"""The three output formats of `tpmap lint`: text (actionlint-like), json, github (Actions annotations)."""
from __future__ import annotations

import json
from pathlib import Path

from tpmap.lint.diagnostic import Diagnostic

FORMATS = ("text", "json", "github")


def _source_lines(path: str, cache: dict[str, list[str]]) -> list[str]:
    if path not in cache:
        try:
            cache[path] = Path(path).read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError):
            cache[path] = []
    return cache[path]


def text(files: list[str], diagnostics: list[Diagnostic]) -> str:
    """``path:line:col: error: message [rule]``, the source line, a caret under the column; a summary."""
    out: list[str] = []
    cache: dict[str, list[str]] = {}
    for d in diagnostics:
        out.append(f"{d.path}:{d.line}:{d.col}: {d.severity}: {d.message} [{d.rule}]")
        lines = _source_lines(d.path, cache)
        if 1 <= d.line <= len(lines):
            line = lines[d.line - 1]
            out.append(line)
            # keep tabs so that the caret lines up however the terminal expands them
            out.append("".join(c if c == "\t" else " " for c in line[: d.col - 1]) + "^")
    errors = [d for d in diagnostics if d.severity == "error"]
    n, bad = len(errors), len({d.path for d in errors})
    if n:
        out.append(f"{n} error{'s' * (n != 1)} in {bad} of {len(files)} file{'s' * (len(files) != 1)}")
    else:
        out.append(f"{len(files)} file{'s' * (len(files) != 1)} linted, no errors")
    return "\n".join(out) + "\n"


def as_json(files: list[str], diagnostics: list[Diagnostic]) -> str:
    """``{"files": [...], "diagnostics": [{path, line, col, severity, rule, message}, ...]}``."""
    return json.dumps({"files": files, "diagnostics": [d.as_dict() for d in diagnostics]}, indent=2) + "\n"


def _escape_data(s: str) -> str:
    return s.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")


def _escape_property(s: str) -> str:
    return _escape_data(s).replace(":", "%3A").replace(",", "%2C")


def github(files: list[str], diagnostics: list[Diagnostic]) -> str:
    """GitHub Actions workflow commands: ``::error file=...,line=...,col=...,title=...::message``."""
    out = [
        f"::{d.severity} file={_escape_property(d.path)},line={d.line},col={d.col},"
        f"title={_escape_property(f'tpmap lint [{d.rule}]')}::{_escape_data(d.message)}"
        for d in diagnostics
    ]
    return "".join(line + "\n" for line in out)


def render(fmt: str, files: list[str], diagnostics: list[Diagnostic]) -> str:
    return {"text": text, "json": as_json, "github": github}[fmt](files, diagnostics)
