"""Errors for user mistakes. Every one subclasses ValueError and says what to change.

`MappingError` carries a source position so that it prints as ``path:line:col: message``
(lines and columns are 1-based, as editors count them).
"""
from __future__ import annotations

import difflib
from dataclasses import dataclass

__all__ = [
    "ConfigAttributeError",
    "DivisibilityError",
    "MappingError",
    "MappingErrors",
    "PatternMatchError",
    "Position",
    "TpmapError",
    "UnknownModelTypeError",
    "did_you_mean",
]


@dataclass(frozen=True)
class Position:
    path: str
    line: int  # 1-based
    col: int  # 1-based

    def __str__(self) -> str:
        return f"{self.path}:{self.line}:{self.col}"


class TpmapError(ValueError):
    """Base class of every error tpmap raises for a user mistake.

    Errors about a line of a mapping file also carry `position` (where to fix it), `rule` (the
    `tpmap lint` rule id) and `message` (the text without the position); all three are None otherwise.
    Every such error is built one way: ``SomeError(message, position, rule)``, which prints as
    ``path:line:col: message``.
    """
    position: Position | None = None
    rule: str | None = None
    message: str | None = None

    def __init__(self, message: str = "", position: Position | None = None, rule: str | None = None):
        if position is not None:
            self.position, self.rule, self.message = position, rule, message
        super().__init__(f"{position}: {message}" if position is not None else message)


class MappingError(TpmapError):
    """A mapping file is wrong. `position` points at the YAML node to fix."""

    def __init__(self, message: str, position: Position | None = None, rule: str = "schema"):
        super().__init__(message, position, rule)
        self.message, self.rule = message, rule


class MappingErrors(TpmapError):
    """Several mapping errors found in one pass (all are reported, sorted by position)."""

    def __init__(self, errors: list[MappingError]):
        assert errors, "MappingErrors needs at least one error"
        self.errors = errors
        super().__init__("\n".join(str(e) for e in errors))


class UnknownModelTypeError(TpmapError):
    """No mapping ships for this `config.model_type`."""


class PatternMatchError(TpmapError):
    """A module pattern matches nothing, or two entries claim the same parameter."""


class ConfigAttributeError(TpmapError):
    """A mapping names a config attribute the model's config does not have."""


class DivisibilityError(TpmapError):
    """A size (heads, features, vocabulary) cannot be split over the world size."""


def did_you_mean(word: str, choices) -> str:
    """' (did you mean X?)' for the closest choice, or '' when nothing is close."""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]}?)" if close else ""
