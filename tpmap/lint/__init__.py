"""`tpmap lint`: check mapping files statically, before any rank runs them.

Two layers of rules, all reported in one run (see `RULES` for the ids):

* schema rules -- YAML syntax, duplicate keys, unknown keys and kinds, wrong types, invalid
  expressions (`tpmap.loader`); config attributes the model type's config does not have;
* structural rules -- the mapping against the real model, built on the meta device (no weights, no
  process group) from the model type's default config and from each embedded tiny config: patterns
  match, parameters are claimed once, sizes and sections fit, Update attributes exist, every weight in
  the repeated blocks is covered, Columns pair with Rows, and the sizes divide at every declared world
  size (`engine.plan.build` in collecting mode, so `tpmap.apply` and the linter run the same checks).

    from tpmap.lint import lint_paths
    files, diagnostics = lint_paths(["mappings/"])
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..errors import MappingError, MappingErrors, Position, TpmapError

# rule id -> what it checks (the README's table lists the same ids with an example each)
RULES: dict[str, str] = {
    "yaml-syntax": "the file is valid YAML (spaces, not tabs, for indentation) with string keys",
    "duplicate-key": "no key appears twice in one mapping",
    "empty-file": "the file is not empty",
    "unknown-key": "every key is a field of its section (did-you-mean and the valid keys are listed)",
    "missing-key": "required keys are present (model_type, entries, verify, module, ...; a main input other "
                   "than input_ids among a verify config's inputs)",
    "unknown-kind": "every entry's kind is one of Column, Row, Update, Param, Reduce, Enter, Input, Norm",
    "wrong-type": "every value has the type its field needs",
    "invalid-expression": "size expressions use only integers, names, + - * //, parentheses and per_rank()",
    "unknown-model-type": "model_type is a transformers config.model_type",
    "unknown-model-class": "each verify model is a transformers class for this model_type",
    "model-build": "the model builds on the meta device from the default and the embedded configs",
    "config-attribute": "every name in an expression and every verify config key is an attribute of the config",
    "pattern-no-match": "every entry and replicated pattern matches at least one module",
    "double-match": "no parameter (or attribute) is claimed by two entries, nor both sharded and replicated",
    "module-kind": "each kind targets what it can split: Column/Row plain 2-D weight modules, Param existing "
                   "tensors/ModuleLists and dims, Input existing forward arguments, Norm 1-D norm weights with an eps",
    "orientation": "reverse: true exactly on weights stored [in, out] (transformers' Conv1D)",
    "fused-sections": "fused sections add up to the weight's size along the split dimension",
    "update-attribute": "Update attributes exist on every matched module",
    "tied-parameter": "a sharded parameter is not tied to one that stays whole",
    "coverage": "every nn.Linear, Conv1D and nn.Embedding in the repeated blocks is sharded or listed in replicated",
    "pairing": "a Column's output reaches a Row in the same block (or is gathered), and every Row input is split",
    "divisibility": "heads, features and Update expressions divide at every declared world size",
    "unsupported": "no config lint checks (default or verify) is a variant the mapping declares unsupported",
    "when-never": "an entry with `when` applies to at least one config lint checks (the default or a verify config)",
}


class LintUsageError(TpmapError):
    """The command line names no lintable file (exit status 2)."""


@dataclass(frozen=True)
class Diagnostic:
    """One problem at one place of one file."""

    path: str
    line: int  # 1-based
    col: int  # 1-based
    rule: str
    message: str
    severity: str = "error"

    @classmethod
    def at(cls, position: Position, rule: str, message: str) -> "Diagnostic":
        return cls(position.path, position.line, position.col, rule, message)

    @classmethod
    def from_error(cls, error: TpmapError, prefix: str = "") -> "Diagnostic":
        """From an error that carries a position and a rule (MappingError, engine.plan errors)."""
        assert error.position is not None and error.rule is not None, f"unlocated error: {error}"
        assert error.rule in RULES, error.rule
        return cls.at(error.position, error.rule, prefix + (error.message or str(error)))

    def sort_key(self) -> tuple:
        return (self.path, self.line, self.col)

    def as_dict(self) -> dict:
        return {"path": self.path, "line": self.line, "col": self.col, "severity": self.severity,
                "rule": self.rule, "message": self.message}


def sort(diagnostics: list[Diagnostic]) -> list[Diagnostic]:
    """By file, line, column; problems at the same place keep the order they were found in."""
    return sorted(diagnostics, key=Diagnostic.sort_key)


def collect_files(paths: list[str] | None) -> list[str]:
    """The files to lint, as displayed: each path as given, directories expanded to their *.yaml/*.yml.

    No paths means the shipped mappings folder (shown relative to the working directory when inside it).
    """
    if not paths:
        from ..loader import shipped_dir

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


def lint_file(path: str) -> list[Diagnostic]:
    """Every problem of one mapping file, sorted by position."""
    from .. import loader

    try:
        loaded = loader.load_text(loader.read_text(path), path)
    except MappingErrors as e:
        return sort([Diagnostic.from_error(m) for m in e.errors])
    except MappingError as e:  # unreadable: not UTF-8, a folder, gone
        return [Diagnostic.from_error(e) if e.position else Diagnostic(path, 1, 1, "yaml-syntax", e.message)]
    from .rules import structural

    return sort(structural(loaded))


def lint_paths(paths: list[str] | None) -> tuple[list[str], list[Diagnostic]]:
    """(files linted, all their diagnostics sorted by file, line, column). Raises LintUsageError."""
    files = collect_files(paths)
    diagnostics: list[Diagnostic] = []
    for f in files:
        diagnostics += lint_file(f)
    return files, sort(diagnostics)
