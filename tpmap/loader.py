"""Read mapping files: YAML (safe, with source positions) -> pydantic `Mapping`.

Every error becomes a `MappingError` at ``path:line:col`` of the node to fix: the key for an unknown
key, the value for a wrong value, the parent mapping for a missing key. All errors of a file are
collected and raised together as `MappingErrors`.
"""
from __future__ import annotations

import importlib.resources
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pydantic
import yaml

from .errors import MappingError, MappingErrors, Position, UnknownModelTypeError, did_you_mean
from .schema import ENTRY_KINDS, Mapping


@dataclass
class SourceMap:
    """Where each node of a YAML document sits. Paths are tuples of keys and list indices."""

    path: str
    values: dict[tuple, Position] = field(default_factory=dict)
    keys: dict[tuple, Position] = field(default_factory=dict)

    def value(self, loc: tuple) -> Position:
        """Position of the value at `loc`, or of the nearest enclosing node that exists."""
        while loc not in self.values and loc:
            loc = loc[:-1]
        return self.values.get(loc, Position(self.path, 1, 1))

    def key(self, loc: tuple) -> Position:
        return self.keys.get(loc) or self.value(loc)


@dataclass
class LoadedMapping:
    mapping: Mapping
    source: SourceMap
    data: dict

    def entry_position(self, index: int, key: str = "module") -> Position:
        return self.source.value(("entries", index, key))


def _pos(path: str, node: yaml.Node) -> Position:
    return Position(path, node.start_mark.line + 1, node.start_mark.column + 1)


def _construct(node: yaml.Node, loc: tuple, src: SourceMap, errors: list[MappingError], loader) -> Any:
    """Build Python data from a composed YAML node, recording positions and duplicate keys."""
    src.values[loc] = _pos(src.path, node)
    if isinstance(node, yaml.MappingNode):
        out: dict = {}
        for key_node, value_node in node.value:
            key = loader.construct_object(key_node, deep=True)
            if not isinstance(key, (str, int, float, bool)) or key is None:
                errors.append(MappingError(f"mapping key {key!r} must be a string", _pos(src.path, key_node), "yaml-syntax"))
                continue
            if key in out:
                first = src.keys[loc + (key,)]
                errors.append(
                    MappingError(
                        f"duplicate key {key!r} (first given at line {first.line}); remove one",
                        _pos(src.path, key_node),
                        "duplicate-key",
                    )
                )
                continue
            src.keys[loc + (key,)] = _pos(src.path, key_node)
            out[key] = _construct(value_node, loc + (key,), src, errors, loader)
        return out
    if isinstance(node, yaml.SequenceNode):
        return [_construct(child, loc + (i,), src, errors, loader) for i, child in enumerate(node.value)]
    return loader.construct_object(node, deep=True)


def parse_yaml(text: str, path: str) -> tuple[Any, SourceMap]:
    """Safe-load `text`, returning the data and its SourceMap; YAML errors raise MappingErrors."""
    src = SourceMap(path)
    errors: list[MappingError] = []
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        pos = Position(path, mark.line + 1, mark.column + 1) if mark else Position(path, 1, 1)
        problem = e.problem or "invalid YAML"
        if e.context and e.context_mark and e.problem_mark and e.context_mark.line != e.problem_mark.line:
            # e.g. an unclosed {...}: the parser notices lines later; say where the construct began
            problem += f" ({e.context} that starts at line {e.context_mark.line + 1}, column {e.context_mark.column + 1})"
        if "\t" in text and "tab" in problem.lower() or "found character '\\t'" in problem:
            problem += "; indent with spaces, YAML does not allow tabs"
        raise MappingErrors([MappingError(f"YAML syntax error: {problem}", pos, "yaml-syntax")]) from None
    if node is None:
        raise MappingErrors([MappingError("the file is empty; a mapping needs model_type, entries and verify",
                                          Position(path, 1, 1), "empty-file")])
    data = _construct(node, (), src, errors, yaml.SafeLoader(""))
    if errors:
        raise MappingErrors(errors)
    return data, src


def _data_loc(data: Any, loc: tuple) -> tuple:
    """Drop pydantic's union-tag components ('Column', 'int', ...) that are not real data keys."""
    out: tuple = ()
    cur = data
    for part in loc:
        if isinstance(cur, dict) and part in cur:
            out, cur = out + (part,), cur[part]
        elif isinstance(cur, list) and isinstance(part, int) and 0 <= part < len(cur):
            out, cur = out + (part,), cur[part]
        elif isinstance(cur, dict) or isinstance(cur, list):
            # an unknown or missing key below cur, or a union tag: keep a missing/unknown key name
            if isinstance(part, str) and part not in ENTRY_KINDS and not part.startswith(("int", "list", "str")):
                out = out + (part,)
                cur = None
        else:
            break
    return out


def _valid_keys(model_cls, data_loc: tuple, data: Any) -> list[str]:
    """The field names allowed in the mapping that holds an unknown key (for 'valid keys are ...')."""
    from . import schema

    parent = data_loc[:-1]
    if parent == ():
        return list(schema.Mapping.model_fields)
    if parent[0] == "verify":
        if len(parent) >= 4 and parent[2] == "inputs":  # verify.N.inputs.NAME holds an Input
            return list(schema.Input.model_fields)
        return list(schema.Verify.model_fields)
    if parent[0] == "entries" and len(parent) >= 2:
        entry = data["entries"][parent[1]] if isinstance(data.get("entries"), list) else {}
        cls = {"Column": schema.Column, "Row": schema.Row, "Update": schema.Update}.get(
            entry.get("kind") if isinstance(entry, dict) else None
        )
        if cls is None:
            return []
        if len(parent) >= 4 and parent[2] == "sections":
            return list(schema.Section.model_fields)
        return list(cls.model_fields)
    return []


def _pydantic_errors(err: pydantic.ValidationError, data: Any, src: SourceMap) -> list[MappingError]:
    out = []
    for e in err.errors(include_url=False):
        loc = _data_loc(data, tuple(e["loc"]))
        kind = e["type"]
        where = ".".join(str(p) for p in loc) or "(top level)"
        if kind == "extra_forbidden":
            key = loc[-1]
            choices = [k for k in _valid_keys(Mapping, loc, data) if k != "kind" or loc[0] != "entries"]
            msg = f"unknown key {key!r}{did_you_mean(str(key), choices)}; valid keys here: {', '.join(choices)}"
            out.append(MappingError(msg, src.key(loc), "unknown-key"))
        elif kind == "missing":
            out.append(MappingError(f"missing required key {loc[-1]!r} in {'.'.join(map(str, loc[:-1])) or 'the file'}",
                                    src.value(loc[:-1]), "missing-key"))
        elif kind in ("union_tag_invalid", "union_tag_not_found"):
            tag = e.get("ctx", {}).get("tag") or ""
            if kind == "union_tag_not_found":
                msg = f"entry has no 'kind'; choose one of {', '.join(ENTRY_KINDS)}"
                pos = src.value(loc)
            else:
                msg = f"unknown entry kind {tag!r}{did_you_mean(str(tag), ENTRY_KINDS)}; valid kinds: {', '.join(ENTRY_KINDS)}"
                pos = src.value(loc + ("kind",))
            out.append(MappingError(msg, pos, "unknown-kind"))
        else:
            msg = e["msg"]
            if msg.startswith("Value error, "):
                msg = msg[len("Value error, "):]
            rule = "invalid-expression" if "expression" in msg else "wrong-type"
            out.append(MappingError(f"{where}: {msg}", src.value(loc), rule))
    return out


def load_text(text: str, path: str) -> LoadedMapping:
    data, src = parse_yaml(text, path)
    if not isinstance(data, dict):
        raise MappingErrors([MappingError("a mapping file must be a YAML mapping with model_type, entries and verify",
                                          src.value(()), "wrong-type")])
    try:
        mapping = Mapping.model_validate(data)
    except pydantic.ValidationError as e:
        errors = _pydantic_errors(e, data, src)
        errors.sort(key=lambda m: (m.position.line, m.position.col) if m.position else (0, 0))
        raise MappingErrors(errors) from None
    return LoadedMapping(mapping, src, data)


def load_file(path: str | Path) -> LoadedMapping:
    path = Path(path)
    return load_text(path.read_text(encoding="utf-8"), str(path))


def shipped_dir() -> Path:
    """The folder of shipped mappings (mappings/ in the source tree, tpmap/mappings in the wheel)."""
    return Path(str(importlib.resources.files("tpmap.mappings")))


def shipped_files() -> dict[str, Path]:
    """model_type -> file, for every shipped mapping (the file stem is the model_type)."""
    return {p.stem: p for p in sorted(shipped_dir().glob("*.yaml"))}


def for_model_type(model_type: str) -> LoadedMapping:
    files = shipped_files()
    if model_type not in files:
        raise UnknownModelTypeError(
            f"no tpmap mapping for model_type {model_type!r}{did_you_mean(model_type, files)}. "
            f"Supported: {', '.join(files) or '(none)'}. To add one, write mappings/{model_type}.yaml and "
            f"prove it with `tpmap lint` and `tpmap verify {model_type}`, or pass mapping=PATH to tpmap.apply."
        )
    return load_file(files[model_type])
