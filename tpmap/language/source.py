"""Read mapping files: YAML (safe, with source positions) -> pydantic `Mapping`.

Every error becomes a `MappingError` at ``path:line:col`` of the node to fix: the key for an unknown
key, the value for a wrong value, the parent mapping for a missing key. All errors of a file are
collected and raised together as `MappingErrors`.

Mapping files arrive in pull requests, so reading one is bounded (`LIMITS`, far above any real
mapping: the largest shipped file is a few KiB and nests 6 deep): file size, nesting depth, nodes
after alias expansion (a "billion laughs" alias bomb stops at the limit, in milliseconds) and scalar
length (a 5000-digit integer). Each violation is a located `MappingError`, never a traceback.
"""
from __future__ import annotations

import difflib
import functools
import importlib.resources
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pydantic
import yaml

from tpmap.language import schema
from tpmap.language.errors import MappingError, MappingErrors, Position, UnknownModelTypeError, did_you_mean
from tpmap.language.schema import ENTRY_KINDS, Mapping


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


@dataclass(frozen=True)
class Scope:
    """Where an item of a composed mapping comes from (`tpmap.language.compose`): an entry, `replicated`,
    `grad_allreduce` or `unsupported` item of another file, applied to a sub-model."""
    index: int  # the item's index in its own file's list
    prefix: str  # added to its module patterns: the sub-model's base model, relative to this file's
    config: tuple[str, ...]  # attribute path from this file's config to the sub-config it reads
    via: str  # "composed as 'language_model' (text_config) by llava.yaml:9:5"

    def sub_config(self, config):
        for name in self.config:
            config = getattr(config, name)
        return config


@dataclass(frozen=True)  # shared: load_text returns one object per text (dataclasses.replace makes a variant)
class MappingFile:
    mapping: Mapping
    source: SourceMap
    data: dict
    # composed items, by (list, index) in `mapping`: ("entries", 7) -> its Scope; none for this file's own
    scopes: dict[tuple[str, int], Scope] = field(default_factory=dict)
    chosen_experts: str | None = None  # the experts placement a call chose (`placed`); None: the mapping's default
    numbers: tuple[int, ...] | None = None  # each entry's number in the file, where `salvage` dropped some

    @property
    def experts(self) -> str | None:
        """The experts placement whose entries apply: the call's choice, else the mapping's default."""
        return self.chosen_experts or self.mapping.experts

    def entry_position(self, index: int, key: str = "module") -> Position:
        return self.source.value(("entries", index, key))

    def config_of(self, section: str, index: int, config):
        """The config that item `index` of `section` ("entries", "unsupported") reads: `config` itself, or the
        sub-config of the sub-model a composed item applies to."""
        scope = self.scopes.get((section, index))
        return config if scope is None else scope.sub_config(config)

    def label(self, index: int) -> str:
        """How messages name entry `index`: "entry 3 (Row 'layers.*.mlp.down_proj')", and for a composed
        entry its index and pattern in its own file and where it was composed."""
        entry = self.mapping.entries[index]
        scope = self.scopes.get(("entries", index))
        if scope is None:
            return f"entry {self.numbers[index] if self.numbers else index} ({entry.kind} {entry.module!r})"
        return f"entry {scope.index} ({entry.kind} {entry.module[len(scope.prefix):]!r}), {scope.via}"


LIMITS = {
    "file_bytes": 1 << 20,  # 1 MiB
    "depth": 64,  # nested mappings/sequences, aliases included
    "nodes": 20_000,  # nodes after alias expansion
    "scalar_chars": 4096,  # one scalar's text
}


class _Budget:
    """Counts nodes as aliases expand them; `_construct` stops at LIMITS."""
    def __init__(self):
        self.nodes = 0


def _pos(path: str, node: yaml.Node) -> Position:
    return Position(path, node.start_mark.line + 1, node.start_mark.column + 1)


class _TooLarge(Exception):
    """Raised inside `_construct` when a limit is hit; becomes a MappingError at the node."""
    def __init__(self, error: MappingError):
        self.error = error


def _construct(node: yaml.Node, loc: tuple, src: SourceMap, errors: list[MappingError], loader,
               budget: _Budget | None = None) -> Any:
    """Build Python data from a composed YAML node, recording positions and duplicate keys."""
    budget = budget or _Budget()
    budget.nodes += 1
    if budget.nodes > LIMITS["nodes"]:
        raise _TooLarge(MappingError(f"the document expands to more than {LIMITS['nodes']:,} nodes (aliases are "
                                     "expanded where they are used); a mapping needs a few hundred: remove the "
                                     "aliases that repeat large blocks", _pos(src.path, node), "yaml-syntax"))
    if len(loc) > LIMITS["depth"]:
        raise _TooLarge(MappingError(f"nesting deeper than {LIMITS['depth']} levels (aliases included); a mapping "
                                     "nests about 6", _pos(src.path, node), "yaml-syntax"))
    src.values[loc] = _pos(src.path, node)
    if isinstance(node, yaml.ScalarNode) and len(node.value) > LIMITS["scalar_chars"]:
        raise _TooLarge(MappingError(f"a scalar of {len(node.value):,} characters (limit {LIMITS['scalar_chars']:,}); "
                                     "no value of a mapping is that long", _pos(src.path, node), "wrong-type"))
    if isinstance(node, yaml.MappingNode):
        out: dict = {}
        for key_node, value_node in node.value:
            if not isinstance(key_node, yaml.ScalarNode):
                errors.append(MappingError("a mapping key must be a plain string", _pos(src.path, key_node),
                                           "yaml-syntax"))
                continue
            if len(key_node.value) > LIMITS["scalar_chars"]:
                raise _TooLarge(MappingError(f"a key of {len(key_node.value):,} characters", _pos(src.path, key_node),
                                             "wrong-type"))
            key = _scalar(key_node, src, loader)
            if not isinstance(key, (str, int, float, bool)) or key is None:
                errors.append(MappingError(f"mapping key {key!r} must be a string", _pos(src.path, key_node),
                                           "yaml-syntax"))
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
            out[key] = _construct(value_node, loc + (key,), src, errors, loader, budget)
        return out
    if isinstance(node, yaml.SequenceNode):
        return [_construct(child, loc + (i,), src, errors, loader, budget) for i, child in enumerate(node.value)]
    return _scalar(node, src, loader)


def _scalar(node: yaml.ScalarNode, src: SourceMap, loader) -> Any:
    """A scalar's value; the loader's own conversion errors (e.g. a malformed timestamp) become located."""
    try:
        return loader.construct_object(node, deep=True)
    except (ValueError, OverflowError, yaml.YAMLError) as e:
        raise _TooLarge(MappingError(f"cannot read the value {node.value[:40]!r}: {e}", _pos(src.path, node),
                                     "wrong-type")) from None


def _max_depth(text: str, path: str, loader=yaml.SafeLoader) -> None:
    """Refuse deep nesting before composing: PyYAML's composer recurses once per level. Scanning is
    iterative; a scanning error is left for the composer to report with its context."""
    depth = 0
    starts = (yaml.BlockMappingStartToken, yaml.BlockSequenceStartToken, yaml.FlowMappingStartToken,
              yaml.FlowSequenceStartToken)
    ends = (yaml.BlockEndToken, yaml.FlowMappingEndToken, yaml.FlowSequenceEndToken)
    try:
        for token in yaml.scan(text, Loader=loader):
            if isinstance(token, starts):
                depth += 1
                if depth > LIMITS["depth"]:
                    mark = token.start_mark
                    raise MappingErrors([MappingError(f"nesting deeper than {LIMITS['depth']} levels; a mapping "
                                                      "nests about 6", Position(path, mark.line + 1, mark.column + 1),
                                                      "yaml-syntax")])
            elif isinstance(token, ends):
                depth -= 1
    except yaml.YAMLError:
        return


def _compose_fast(text: str, path: str) -> yaml.Node | None:
    """The composed document by libyaml (PyYAML's C extension, ~10x faster), or None where it is not installed,
    the text is not ASCII (columns are counted alike only there), the document is empty or it fails: the
    pure-Python loader then composes it again and words the error (tests/lint/cases hold those messages)."""
    fast = getattr(yaml, "CSafeLoader", None)
    if fast is None or not text.isascii():
        return None
    try:
        _max_depth(text, path, fast)
        return yaml.compose(text, Loader=fast)
    except yaml.YAMLError:
        return None


def parse_yaml(text: str, path: str) -> tuple[Any, SourceMap]:
    """Safe-load `text`, returning the data and its SourceMap; YAML errors raise MappingErrors."""
    src = SourceMap(path)
    errors: list[MappingError] = []
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > LIMITS["file_bytes"]:
        raise MappingErrors([MappingError(f"the file has {size:,} bytes (limit {LIMITS['file_bytes']:,}); a mapping "
                                          "has a few KiB", Position(path, 1, 1), "yaml-syntax")])
    node = _compose_fast(text, path)
    if node is None:
        _max_depth(text, path)
    try:
        if node is None:
            node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.reader.ReaderError as e:  # a control character: YAML forbids it anywhere in the text
        before = text[: e.position]
        pos = Position(path, before.count("\n") + 1, e.position - (before.rfind("\n") + 1) + 1)
        raise MappingErrors([MappingError(f"character #x{e.character:04x} is not allowed in YAML; remove it",
                                          pos, "yaml-syntax")]) from None
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        pos = Position(path, mark.line + 1, mark.column + 1) if mark else Position(path, 1, 1)
        problem = e.problem or "invalid YAML"
        if e.context and e.context_mark and e.problem_mark and e.context_mark.line != e.problem_mark.line:
            # e.g. an unclosed {...}: the parser notices lines later; say where the construct began
            problem += (f" ({e.context} that starts at line {e.context_mark.line + 1}, "
                        f"column {e.context_mark.column + 1})")
        if ("\t" in text and "tab" in problem.lower()) or "found character '\\t'" in problem:
            problem += "; indent with spaces, YAML does not allow tabs"
        raise MappingErrors([MappingError(f"YAML syntax error: {problem}", pos, "yaml-syntax")]) from None
    if node is None:
        raise MappingErrors([MappingError("the file is empty; a mapping needs model_type, entries and verify",
                                          Position(path, 1, 1), "empty-file")])
    try:
        data = _construct(node, (), src, errors, yaml.SafeLoader(""))
    except _TooLarge as e:
        raise MappingErrors([e.error]) from None
    if errors:
        raise MappingErrors(errors)
    return data, src


def _data_loc(data: Any, loc: tuple) -> tuple:
    """Drop pydantic's union-tag components ('Column', 'int', ...) that are not real data keys."""
    out: tuple = ()
    cur = data
    for part in loc:
        if (isinstance(cur, dict) and part in cur) or (
                isinstance(cur, list) and isinstance(part, int) and 0 <= part < len(cur)):
            out, cur = out + (part,), cur[part]
        elif isinstance(cur, (dict, list)):
            # an unknown or missing key below cur, or a union tag: keep a missing/unknown key name
            if isinstance(part, str) and part not in ENTRY_KINDS and not part.startswith(("int", "list", "str")):
                out = out + (part,)
                cur = None
        else:
            break
    return out


def _valid_keys(model_cls, data_loc: tuple, data: Any) -> list[str]:
    """The field names allowed in the mapping that holds an unknown key (for 'valid keys are ...')."""
    parent = data_loc[:-1]
    if parent == ():
        return list(schema.Mapping.model_fields)
    if parent[0] == "compose":
        return list(schema.Compose.model_fields)
    if parent[0] == "verify":
        if len(parent) >= 6 and parent[4] == "tokens":  # verify.N.inputs.NAME.tokens.K holds a TokenRun
            return list(schema.TokenRun.model_fields)
        if len(parent) >= 4 and parent[2] == "inputs":  # verify.N.inputs.NAME holds an ExampleInput
            return list(schema.ExampleInput.model_fields)
        return list(schema.Verify.model_fields)
    if parent[0] == "entries" and len(parent) >= 2:
        entry = data["entries"][parent[1]] if isinstance(data.get("entries"), list) else {}
        cls = schema.KIND_CLASSES.get(
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
                msg = (f"unknown entry kind {tag!r}{did_you_mean(str(tag), ENTRY_KINDS)}; "
                       f"valid kinds: {', '.join(ENTRY_KINDS)}")
                pos = src.value(loc + ("kind",))
            out.append(MappingError(msg, pos, "unknown-kind"))
        else:
            msg = e["msg"]
            if msg.startswith("Value error, "):
                msg = msg[len("Value error, "):]
            rule = "invalid-expression" if "expression" in msg else "wrong-type"
            out.append(MappingError(f"{where}: {msg}", src.value(loc), rule))
    return out


def load_text(text: str, path: str) -> MappingFile:
    """The validated MappingFile of `text` (read from `path`, named in messages). The same text is parsed
    once per process: apply, plan, verify and the checkpoint paths each resolve a mapping several times, and
    PyYAML's pure-Python composer takes tens of milliseconds per file. The result is shared, never mutated
    (the schema's models are frozen; composition builds a new MappingFile)."""
    return _load_text(text, path)


@functools.lru_cache(maxsize=128)
def _load_text(text: str, path: str) -> MappingFile:  # errors raise, so they are never cached
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
    return MappingFile(mapping, src, data)


def salvage(text: str, path: str) -> tuple[MappingFile, set[str]] | None:
    """For `tpmap lint`'s single pass: the file without its entries and verify configs that fail the schema, so
    that the structural rules still check the rest (positions and entry numbers stay the file's own), and which
    lists lost items ("entries", "verify"). None where nothing fails, or a problem lies outside those items (the
    YAML, a top-level key): then there is no rest."""
    try:
        data, src = parse_yaml(text, path)
        Mapping.model_validate(data)
        return None
    except MappingErrors:
        return None
    except pydantic.ValidationError as e:
        locs = [_data_loc(data, tuple(x["loc"])) for x in e.errors(include_url=False)]
    bad: dict[str, set[int]] = {"entries": set(), "verify": set()}
    for loc in locs:
        if len(loc) < 2 or loc[0] not in bad or not isinstance(loc[1], int):
            return None
        bad[loc[0]].add(loc[1])
    if any(dropped and not isinstance(data.get(name), list) for name, dropped in bad.items()):
        return None
    keep = {name: [i for i in range(len(data[name])) if i not in dropped]
            for name, dropped in bad.items() if isinstance(data.get(name), list)}  # an absent list has no items
    rest = {**data, **{name: [data[name][i] for i in kept] for name, kept in keep.items()}}
    try:
        mapping = Mapping.model_validate(rest)
    except pydantic.ValidationError:
        return None  # the rest fails on its own (an empty list): the schema errors are all there is
    moved = {(name, old): new for name, kept in keep.items() for new, old in enumerate(kept)}
    src = SourceMap(path, _renumbered(src.values, moved), _renumbered(src.keys, moved))
    numbers = tuple(keep["entries"]) if "entries" in keep else None
    return MappingFile(mapping, src, rest, numbers=numbers), {name for name in bad if bad[name]}


def _renumbered(positions: dict[tuple, Position], moved: dict[tuple, int]) -> dict[tuple, Position]:
    """`positions` with the kept items' locations renumbered (("entries", 5, ...) -> ("entries", 4, ...)), the
    dropped items' removed."""
    out = {}
    for loc, pos in positions.items():
        if len(loc) < 2 or loc[0] not in ("entries", "verify"):
            out[loc] = pos
        elif loc[:2] in moved:
            out[(loc[0], moved[loc[:2]], *loc[2:])] = pos
    return out


def read_file(path: str | Path) -> MappingFile:
    """Read and validate a mapping file; a path that cannot be read is a MappingError naming it."""
    return load_text(read_text(path), str(path))


def read_text(path: str | Path) -> str:
    """A mapping file's text: UTF-8, at most LIMITS['file_bytes']; anything else a MappingError naming it."""
    path = Path(path)
    try:
        if path.is_dir():
            raise IsADirectoryError(f"{path} is a folder")
        raw = path.read_bytes()
        if len(raw) > LIMITS["file_bytes"]:
            raise MappingErrors([MappingError(f"the file has {len(raw):,} bytes (limit {LIMITS['file_bytes']:,}); a "
                                              "mapping has a few KiB", Position(str(path), 1, 1), "yaml-syntax")])
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise MappingError(f"the file is not UTF-8 text (byte {e.start}: {e.reason}); save it as UTF-8",
                           Position(str(path), line, 1), "yaml-syntax") from None
    except OSError as e:  # missing, a folder, no permission
        what = {FileNotFoundError: "no such file", IsADirectoryError: "is a folder, not a file",
                PermissionError: "cannot be read (permission denied)"}.get(type(e), e.strerror or str(e))
        raise MappingError(f"mapping file {str(path)!r} {what}; pass the path of a .yaml mapping (or a model type "
                           "to use the shipped one)") from None
    return text


def shipped_dir() -> Path:
    """The folder of shipped mappings (mappings/ in the source tree, tpmap/mappings in the wheel)."""
    return Path(str(importlib.resources.files("tpmap.mappings")))


def shipped_files() -> dict[str, Path]:
    """model_type -> file, for every shipped mapping (the file stem is the model_type)."""
    folder = shipped_dir()
    return dict(_listing(folder, folder.stat().st_mtime_ns))  # listed again once a file is added or removed


@functools.lru_cache(maxsize=4)
def _listing(folder: Path, mtime_ns: int) -> tuple[tuple[str, Path], ...]:
    return tuple((p.stem, p) for p in sorted(folder.glob("*.yaml")))


def for_model_type(model_type: str) -> MappingFile:
    files = shipped_files()
    if model_type not in files:
        raise UnknownModelTypeError(unknown_model_type(model_type, files))
    return read_file(files[model_type])


REFUSED = Path(__file__).resolve().parents[2] / "docs" / "refused.md"  # in a source checkout; absent in a wheel


def refusal(model_type: str, page: Path = REFUSED) -> str | None:
    """What docs/refused.md says of a model type it lists (items "- a, b: reason", continued on indented lines), or
    None."""
    if not page.is_file():
        return None
    items: list[str] = []
    for line in page.read_text().splitlines():
        if line.startswith("- "):
            items.append(line[2:])
        elif line.startswith("  ") and items:
            items[-1] += " " + line.strip()
        elif items:
            items.append("")  # a paragraph ends the item
    for item in items:
        names, sep, reason = item.partition(":")
        if sep and model_type in [n.split()[0] for n in names.split(",") if n.split()]:
            return reason.strip()
    return None


def unknown_model_type(model_type: str, files) -> str:
    """Why there is no mapping for `model_type`: its refusal where docs/refused.md gives one, the three nearest
    shipped types, where the list of all of them is, and how to add one."""
    nearest = difflib.get_close_matches(model_type, list(files), n=3, cutoff=0.0)
    reason = refusal(model_type)
    why = f" docs/refused.md: {reason}" if reason else ""
    return (f"no tpmap mapping for model_type {model_type!r}.{why} Nearest shipped types: {', '.join(nearest)}; "
            f"all {len(files)}: MODELS.md; types refused or not yet shipped, with the reason: docs/refused.md. To add "
            f"one, write mappings/{model_type}.yaml and prove it with `tpmap lint` and `tpmap verify {model_type}`, or "
            "pass mapping=PATH to tpmap.apply.")
