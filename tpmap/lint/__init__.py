"""`tpmap lint`: check mapping files statically, before any rank runs them.

Two layers of rules, all reported in one run (see `RULES` for the ids; where entries or verify configs fail the
schema, the structural rules check the rest: `source.salvage`):

* schema rules -- YAML syntax, duplicate keys, unknown keys and kinds, wrong types, invalid
  expressions (`tpmap.language.source`); config attributes the model type's config does not have;
* structural rules -- the mapping against the real model, built on the meta device (no weights, no
  process group) from the model type's default config and from each embedded tiny config: patterns
  match, parameters are claimed once, sizes and sections fit, Update attributes exist, every weight in
  the repeated blocks is covered, Columns pair with Rows, and the sizes divide at every declared world
  size (`engine.planner.build_plan` in collecting mode, so `tpmap.apply` and the linter run the same checks).

    from tpmap.lint import lint_paths
    files, diagnostics = lint_paths(["mappings/"])
"""
from __future__ import annotations

from pathlib import Path

from tpmap.language import source
from tpmap.language.errors import MappingError, MappingErrors
from tpmap.language.source import shipped_dir
from tpmap.lint.diagnostic import RULES, Diagnostic, LintUsageError, sort
from tpmap.lint.rules import structural

__all__ = ["RULES", "Diagnostic", "LintUsageError", "collect_files", "lint_file", "lint_paths", "sort"]


def collect_files(paths: list[str] | None) -> list[str]:
    """The files to lint, as displayed: each path as given, directories expanded to their *.yaml/*.yml.

    No paths means the shipped mappings folder (shown relative to the working directory when inside it).
    """
    if not paths:
        folder = shipped_dir()
        try:
            shown = str(folder.resolve().relative_to(Path.cwd().resolve()))
        except ValueError:
            shown = str(folder)
        paths = [shown]
    files: list[str] = []
    for raw in paths:
        p = Path(raw)
        if p.is_dir():
            found = sorted(q for q in p.iterdir() if q.suffix in (".yaml", ".yml") and q.is_file())
            if not found:
                raise LintUsageError(f"{raw}: no .yaml or .yml files in this folder")
            files += [str(q) for q in found]
        elif p.is_file():
            files.append(str(p))
        else:
            raise LintUsageError(f"{raw}: no such file or folder")
    return list(dict.fromkeys(files))


# structural rules that a dropped item could fire falsely: a gap where a dropped Column or Row was; an entry or a
# pattern whose variant only a dropped verify config had (Gemma 4's audio tower, in a composed file too: fuzzing)
_NEEDS_ALL = {"entries": ("coverage", "pairing"), "verify": ("when-never", "unsupported", "pattern-no-match")}


def lint_file(path: str) -> list[Diagnostic]:
    """Every problem of one mapping file, sorted by position: its schema errors and, in the same pass, the
    structural problems of the items that passed the schema (`source.salvage`)."""
    text = None  # read_text itself raises MappingErrors for a file over the size limit: nothing to salvage then
    try:
        text = source.read_text(path)
        loaded = source.load_text(text, path)
    except MappingErrors as e:
        schema = [Diagnostic.from_error(m) for m in e.errors]
        salvaged = source.salvage(text, path) if text is not None else None
        if salvaged is None:
            return sort(schema)
        rest, dropped = salvaged
        unsure = {rule for name in dropped for rule in _NEEDS_ALL[name]}
        return sort(schema + [d for d in structural(rest) if d.rule not in unsure])
    except MappingError as e:  # unreadable: not UTF-8, a folder, gone
        return [Diagnostic.from_error(e) if e.position else Diagnostic(path, 1, 1, "yaml-syntax", e.message)]
    return sort(structural(loaded))


def lint_paths(paths: list[str] | None) -> tuple[list[str], list[Diagnostic]]:
    """(files linted, all their diagnostics sorted by file, line, column). Raises LintUsageError."""
    files = collect_files(paths)
    diagnostics: list[Diagnostic] = []
    for f in files:
        diagnostics += lint_file(f)
    return files, sort(diagnostics)
