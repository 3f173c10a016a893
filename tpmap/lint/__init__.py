"""`tpmap lint`: check mapping files statically, before any rank runs them.

Two layers of rules, all reported in one run (see `RULES` for the ids; where entries or verify configs fail the
schema, the structural rules check the rest: `source.salvage`):

* schema rules (`SCHEMA_RULES`) -- YAML syntax, duplicate keys, unknown keys and kinds, wrong types, invalid
  expressions: what `tpmap.language.source` checks when it loads a file, with no model library;
* structural rules -- the mapping against the real model, built on the meta device (no weights, no
  process group) from the model type's default config and from each embedded tiny config: model_type and the
  verify classes exist, expression names and verify config keys are attributes of the config, patterns
  match, parameters are claimed once, sizes and sections fit, Update attributes exist, every weight in
  the repeated blocks is covered, Columns pair with Rows, and the sizes divide at every declared world
  size (`engine.planner.build_plan` in collecting mode, so `tpmap.apply` and the linter run the same checks).

`schema_only=True` (`tpmap lint --schema-only`) runs the schema layer alone: it never imports torch or
transformers (the structural rules, `tpmap.lint.rules`, are imported only when they run), so it takes a fraction
of a second, for editors and pre-commit hooks. It leaves out every check that needs transformers' config or model
classes: all the structural rules, among them `config-attribute` (a name in an expression, a verify config key or
an input shape that the model type's config lacks), `unknown-model-type`, `unknown-model-class`, `when-attribute`
and `transformers-never`; the `unknown-key` of a verify input that is no argument of the class's forward and the
`missing-key` of a class's main input other than input_ids; `compose` (composed sub-models' mappings are not
read); and the `transformers-version` note. A file clean in this mode can still fail the full lint.

    from tpmap.lint import lint_paths
    files, diagnostics = lint_paths(["mappings/"])
    files, diagnostics = lint_paths(["mappings/"], schema_only=True)
"""
from __future__ import annotations

from pathlib import Path

from tpmap.language import source
from tpmap.language.errors import MappingError, MappingErrors
from tpmap.language.source import MappingFile, shipped_dir
from tpmap.lint.diagnostic import RULES, SCHEMA_RULES, Diagnostic, LintUsageError, sort

__all__ = ["RULES", "SCHEMA_RULES", "Diagnostic", "LintUsageError", "collect_files", "lint_file", "lint_paths",
           "lint_schema", "sort"]


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


def _schema_pass(path: str) -> tuple[MappingFile | None, str | None, list[Diagnostic]]:
    """(the loaded file or None, its text where it was read, its schema diagnostics): `source` only, no model
    library."""
    text = None  # read_text itself raises MappingErrors for a file over the size limit: nothing to salvage then
    try:
        text = source.read_text(path)
        return source.load_text(text, path), text, []
    except MappingErrors as e:
        return None, text, [Diagnostic.from_error(m) for m in e.errors]
    except MappingError as e:  # unreadable: not UTF-8, a folder, gone
        return None, None, [Diagnostic.from_error(e) if e.position else
                            Diagnostic(path, 1, 1, "yaml-syntax", e.message)]


def _structural(loaded: MappingFile) -> list[Diagnostic]:
    """The structural rules: imported here, on first use, so that `import tpmap.lint` and the schema layer import
    neither torch nor transformers (`tpmap lint --schema-only`)."""
    from tpmap.lint.rules import structural

    return structural(loaded)


def lint_schema(path: str) -> list[Diagnostic]:
    """The schema problems of one mapping file, sorted by position: exactly the schema part of `lint_file`'s, with
    no structural rule (the module docstring lists what that leaves out); imports neither torch nor transformers."""
    return sort(_schema_pass(path)[2])


def lint_file(path: str) -> list[Diagnostic]:
    """Every problem of one mapping file, sorted by position: its schema errors and, in the same pass, the
    structural problems of the items that passed the schema (`source.salvage`)."""
    loaded, text, schema = _schema_pass(path)
    if loaded is not None:
        return sort(_structural(loaded))
    salvaged = source.salvage(text, path) if text is not None else None
    if salvaged is None:
        return sort(schema)
    rest, dropped = salvaged
    unsure = {rule for name in dropped for rule in _NEEDS_ALL[name]}
    return sort(schema + [d for d in _structural(rest) if d.rule not in unsure])


def lint_paths(paths: list[str] | None, schema_only: bool = False) -> tuple[list[str], list[Diagnostic]]:
    """(files linted, all their diagnostics sorted by file, line, column). Raises LintUsageError.
    `schema_only`: the schema layer alone (`lint_schema`), without torch or transformers."""
    files = collect_files(paths)
    check = lint_schema if schema_only else lint_file
    diagnostics: list[Diagnostic] = []
    for f in files:
        diagnostics += check(f)
    return files, sort(diagnostics)
