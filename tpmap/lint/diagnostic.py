"""What `tpmap lint` reports: one `Diagnostic` per problem, each under a rule id of `RULES`."""
from __future__ import annotations

from dataclasses import dataclass

from tpmap.language.errors import Position, TpmapError

# rule id -> what it checks (docs/lint.md's table lists the same ids with an example each)
RULES: dict[str, str] = {
    "yaml-syntax": "the file is valid YAML (spaces, not tabs, for indentation) with string keys",
    "duplicate-key": "no key appears twice in one mapping",
    "empty-file": "the file is not empty",
    "unknown-key": "every key is a field of its section (did-you-mean and the valid keys are listed)",
    "missing-key": "required keys are present (model_type, entries, verify, module, ...; a main input other "
                   "than input_ids among a verify config's inputs)",
    "unknown-kind": "every entry's kind is one of Column, Row, Update, Param, Reduce, Enter, Input, Norm, Route",
    "wrong-type": "every value has the type its field needs",
    "invalid-expression": "size expressions use only integers, names, + - * //, parentheses, per_rank() and at_layer()",
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
    "when-attribute": "every `when` key is an attribute the config class defines or one declared in "
                      "config_defaults (with the default the model reads); config_defaults names no attribute the "
                      "class defines",
    "compose": "each composed sub-model has a mapping (shipped for its model type, or the file named), without "
               "a cycle",
    "when-never": "an entry with `when` applies to at least one config lint checks (the default or a verify config), "
                  "and one with `when_layer` selects a layer of one",
    "transformers-never": "an entry's `transformers` range admits at least one transformers release tpmap proves",
    "expert-count": "a Route deals at least one whole expert to every rank at each verify world size",
    "route-reduce": "a Route's experts module is also reduced (each rank's output is its experts' terms)",
}

# the rules of the schema layer: what `tpmap.language.source` reports when it loads a file (YAML, pydantic), with no
# model library; `tpmap lint --schema-only` runs these alone
SCHEMA_RULES: tuple[str, ...] = ("yaml-syntax", "duplicate-key", "empty-file", "unknown-key", "missing-key",
                                 "unknown-kind", "wrong-type", "invalid-expression")

# notes: printed, but not errors (the exit status stays 0)
NOTES: dict[str, str] = {
    "transformers-version": "the file's own `transformers` range excludes the installed release: not checked on it",
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
    def at(cls, position: Position, rule: str, message: str) -> Diagnostic:
        return cls(position.path, position.line, position.col, rule, message)

    @classmethod
    def from_error(cls, error: TpmapError, prefix: str = "") -> Diagnostic:
        """From an error that carries a position and a rule (MappingError, engine.planner errors)."""
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
