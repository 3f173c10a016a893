"""Module patterns: a mapping names modules by dotted paths with a shell glob per component.

``layers.*.self_attn.q_proj`` matches ``layers.0.self_attn.q_proj`` and ``layers.11.self_attn.q_proj``;
``*``, ``?`` and ``[qkv]`` glob one component, and a pattern matches names with as many components.
"""
from __future__ import annotations

import fnmatch
import re

from tpmap.language.errors import did_you_mean


def match_modules(pattern: str, names) -> list[str]:
    """Module names matching `pattern`: a shell glob per dotted component, same number of components."""
    parts = pattern.split(".")
    return [
        n for n in names
        if n and len(n.split(".")) == len(parts) and all(fnmatch.fnmatchcase(a, p) for a, p in zip(n.split("."), parts))
    ]


def match_entry(entry, modules: dict) -> list[str]:
    """The modules an entry applies to: its pattern's matches, kept to its `classes` when it names any."""
    matched = match_modules(entry.module, modules)
    if entry.classes:
        matched = [n for n in matched if type(modules[n]).__name__ in entry.classes]
    return matched


def generic_pattern(name: str) -> str:
    """A module name with its block indices as '*' (h.3.attn.c_attn -> h.*.attn.c_attn)."""
    return re.sub(r"(?<=\.)\d+(?=\.|$)|^\d+(?=\.)", "*", name)


def suggest_module(pattern: str, names) -> str:
    """A close real module name, with layer numbers turned back into '*'."""
    generic = sorted({generic_pattern(n) for n in names if n})
    close = did_you_mean(pattern, generic)
    return close or (f"; modules look like {generic[min(len(generic) - 1, 5)]!r}" if generic else "")
