"""Composed mappings: a file that maps a model by reusing other files for its sub-models.

A mapping's ``compose`` items (`tpmap.language.schema.Compose`) name sub-models -- a vision tower, a language
model -- by module path and sub-config, each mapped by another file (by default the one of the
sub-config's own ``model_type``)::

    compose:
      - {module: language_model, config: text_config}   # -> mappings/<text_config.model_type>.yaml
      - {module: vision_tower, config: vision_config}

`expand` turns such a mapping into an ordinary one over the whole model: every entry, ``replicated``,
``grad_allreduce`` and ``unsupported`` item of a composed file is appended to the composing file's own,
its module patterns prefixed with the sub-model's base model (patterns stay relative to the sub-model's
own base model, as when the file maps a whole model), and each carries a `Scope`: the sub-config its
expressions and ``when`` read, and where it came from. The source positions of appended items are those
of their own file, so an error in a composed entry points at its own line and its message
(`MappingFile.label`) says which file and module composed it. Everything after the expansion -- the
planner, lint, sequence parallelism, checkpoints -- sees ordinary entries. A composed file's
``vocab_parallel``, ``verify``, ``world_sizes`` and ``default_config`` are not used.

The expansion needs the model's module tree (where the sub-model's base model sits), which this layer
does not read: the engine passes `submodel`, a function of a module path (relative to the base model)
that returns the prefix of that module's own base model and a description of it, or None.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path

from tpmap.language.errors import MappingError, MappingErrors, PatternMatchError, TpmapError, did_you_mean
from tpmap.language.schema import Compose, KeptWhole, OwnParams
from tpmap.language.source import MappingFile, Scope, SourceMap, read_file, shipped_files

# a module path -> (pattern prefix of its own base model, e.g. "vision_tower.vision_model.", and a description
# of it for messages, e.g. "model.vision_tower (CLIPVisionModel)"), or None when there is no such module
SubModels = Callable[[str], "tuple[str, str] | None"]
SECTIONS = ("entries", "replicated", "grad_allreduce", "unsupported")  # the lists a composed file contributes
MAX_DEPTH = 8  # composed files composing others: far above any real model (2)


def expand(loaded: MappingFile, config, submodel: SubModels, names: Sequence[str],
           errors: list[TpmapError] | None = None, _seen: tuple[str, ...] = ()) -> MappingFile:
    """`loaded` with its ``compose`` items expanded over one model (see the module docstring); `loaded`
    itself when it composes nothing.

    `config` is the model's config, `submodel` resolves module paths and `names` lists the base model's
    module names (for "did you mean"). Raises the first problem (a `TpmapError` located at the compose
    item: no such module or sub-config, no mapping for the sub-model's type; or the composed file's own
    errors); with an `errors` list, problems are appended to it and the item is left out.
    """
    mapping = loaded.mapping
    if not mapping.compose:
        return loaded
    seen = _seen + (_identity(loaded.source.path),)
    lists = {section: list(getattr(mapping, section)) for section in SECTIONS}
    source = SourceMap(loaded.source.path, dict(loaded.source.values), dict(loaded.source.keys))
    scopes = dict(loaded.scopes)
    placements = set()  # the composed files' default experts placements
    for k, item in enumerate(mapping.compose):
        if item.optional and _absent(item, config, submodel):
            continue  # a model built without this sub-model: nothing to compose
        try:
            sub, prefix, sub_config_path, via = _part(loaded, k, item, config, submodel, names, errors, seen)
        except TpmapError as e:
            if errors is None:
                raise
            errors.extend(e.errors if isinstance(e, MappingErrors) else [e])
            continue
        placements |= {sub.mapping.experts} - {None}
        for section, target in lists.items():
            for j, value in enumerate(getattr(sub.mapping, section)):
                n = len(target)
                target.append(_prefixed(value, prefix))
                inner = sub.scopes.get((section, j))
                scopes[(section, n)] = Scope(
                    index=inner.index if inner else j, prefix=prefix + (inner.prefix if inner else ""),
                    config=sub_config_path + (inner.config if inner else ()),
                    via=f"{inner.via}, {via}" if inner else via)
                _copy_positions(sub.source, (section, j), source, (section, n))
    # the composed entries tagged with a placement apply under the composed files' default (one placement: a
    # file setting none keeps its parts' own), or the one the call chose
    if mapping.experts is None and len(placements) > 1:
        raise MappingError(f"the composed files' default experts placements differ ({', '.join(sorted(placements))}): "
                           "set this file's own, `experts: split` or `experts: parallel`",
                           loaded.source.value(("compose",)), "compose")
    experts = mapping.experts or (placements.pop() if placements else None)
    expanded = mapping.model_copy(update={"compose": [], "experts": experts, **lists})
    return dataclasses.replace(loaded, mapping=expanded, source=source, scopes=scopes)  # every other field kept


def _absent(item: Compose, config, submodel: SubModels) -> bool:
    """Whether an `optional` compose item's sub-model is absent: no sub-config at its path and no module."""
    return _sub_config(config, item) is None and submodel(item.module) is None


def _sub_config(config, item: Compose):
    """The config at a compose item's `config` path (text_config, audio_config.asr_config), or None."""
    for name in item.config.split("."):
        config = getattr(config, name, None)
    return config


def _part(loaded: MappingFile, k: int, item: Compose, config, submodel: SubModels, names: Sequence[str],
          errors, seen) -> tuple[MappingFile, str, tuple[str, ...], str]:
    """(the composed file, expanded in turn over the sub-model; its pattern prefix; the sub-config's path;
    the 'composed as ...' phrase) for compose item `k`."""
    src = loaded.source
    where = f"compose {k} ({item.module!r})"
    if len(seen) > MAX_DEPTH:
        raise MappingError(f"{where}: composed files nest deeper than {MAX_DEPTH} levels", src.value(("compose", k)),
                           "compose")
    path = tuple(item.config.split("."))
    sub_config = config
    for depth, name in enumerate(path):
        sub_config = getattr(sub_config, name, None)
        if sub_config is None or not hasattr(sub_config, "model_type"):
            owner = config if depth == 0 else "the sub-config " + ".".join(path[:depth])
            subs = list(getattr(config, "sub_configs", None) or {})
            raise MappingError(
                f"{where}: the {type(config).__name__ if depth == 0 else owner} has no sub-config {item.config!r}"
                f"{did_you_mean(item.config, subs)}; its sub-configs: {', '.join(subs) or 'none'}",
                src.value(("compose", k, "config")), "config-attribute")
    found = submodel(item.module)
    if found is None:
        raise PatternMatchError(f"{where}: the base model has no module {item.module!r}"
                                f"{did_you_mean(item.module, names)}", src.value(("compose", k, "module")),
                                "pattern-no-match")
    prefix, described = found
    via = f"composed as {item.module!r} ({item.config}) by {src.value(('compose', k))}"
    file = _part_file(loaded, k, item, sub_config, described)
    if _identity(str(file)) in seen:
        raise MappingError(f"{where}: {file} is already being composed (a cycle: "
                           f"{' -> '.join(Path(s).name for s in seen)} -> {Path(file).name})",
                           src.value(("compose", k)), "compose")
    sub = _load(str(file))

    def inner(module: str):
        got = submodel(prefix + module)
        return None if got is None else (got[0][len(prefix):], got[1])

    inner_names = [n[len(prefix):] for n in names if n.startswith(prefix)] if prefix else list(names)
    sub = expand(sub, sub_config, inner, inner_names, errors, seen)
    return sub, prefix, path, via


def _part_file(loaded: MappingFile, k: int, item: Compose, sub_config, described: str) -> Path:
    """The file compose item `k` applies: its `mapping` (a .yaml path relative to the composing file, or a model
    type), else the shipped one of the sub-config's model_type. Raises MappingError where there is none."""
    src = loaded.source
    where = f"compose {k} ({item.module!r})"
    model_type = getattr(sub_config, "model_type", None)
    if item.mapping is not None and item.mapping.endswith((".yaml", ".yml")):
        file = Path(src.path).parent / item.mapping
        if not file.is_file():
            raise MappingError(f"{where}: mapping file {str(file)!r} does not exist (a path is relative to "
                               f"this file's folder)", src.value(("compose", k, "mapping")), "compose")
        return file
    name = item.mapping or model_type
    files = shipped_files()
    if name not in files:
        missing = (f"tpmap ships no mapping {name!r} (named by mapping:) for it" if item.mapping
                   else "for which tpmap has no mapping")
        raise MappingError(
            f"{where}: the sub-model {described} has model_type {model_type!r} ({item.config}.model_type), "
            f"{missing}{did_you_mean(str(name), files)}; write mappings/{name}.yaml and prove it with tpmap "
            "verify, or name another mapping (a model type or a .yaml path) with mapping:",
            src.value(("compose", k)), "compose")
    return Path(files[name])


def placements(loaded: MappingFile, config, _depth: int = 0) -> tuple[str | None, frozenset[str]]:
    """(the default experts placement, every placement offered) of a mapping over a model of `config`, its composed
    files' included, read from the files alone (no model: `expand` needs one). A composed item whose sub-config
    is absent or whose file is missing offers nothing here (`expand` reports it)."""
    mapping = loaded.mapping
    offered = {e.experts for e in mapping.entries if e.experts is not None}
    defaults = set()
    for k, item in enumerate(mapping.compose if _depth <= MAX_DEPTH else ()):
        sub_config = _sub_config(config, item)
        if sub_config is None or not hasattr(sub_config, "model_type"):
            continue
        try:
            sub = _load(str(_part_file(loaded, k, item, sub_config, item.module)))
        except MappingError:
            continue
        default, more = placements(sub, sub_config, _depth + 1)
        offered |= more
        defaults |= {default} - {None}
    default = mapping.experts or (defaults.pop() if len(defaults) == 1 else None)
    return default, frozenset(offered)


_CACHE: dict[tuple, MappingFile] = {}


def _load(path: str) -> MappingFile:
    """A composed file, read once per version (lint and every world size plan the same files again);
    never changed by `expand`, which builds new mappings."""
    stat = Path(path).stat()
    key = (_identity(path), path, stat.st_mtime_ns, stat.st_size)
    if key not in _CACHE:
        if len(_CACHE) > 256:
            _CACHE.clear()
        _CACHE[key] = read_file(path)
    return _CACHE[key]


def _identity(path: str) -> str:
    try:
        return str(Path(path).resolve())
    except OSError:
        return path


def _prefixed(value, prefix: str):
    """A composed item with its module pattern under `prefix` (an `unsupported` item has none)."""
    if isinstance(value, str):
        return prefix + value
    if isinstance(value, KeptWhole | OwnParams) or hasattr(value, "kind"):
        return value.model_copy(update={"module": prefix + value.module})
    return value


def _copy_positions(sub: SourceMap, loc: tuple, into: SourceMap, new: tuple) -> None:
    """The positions of every node under `loc` of a composed file, recorded under `new`."""
    n = len(loc)
    for table, target in ((sub.values, into.values), (sub.keys, into.keys)):
        for key, position in table.items():
            if key[:n] == loc:
                target[new + key[n:]] = position
