"""Structural rules: a loaded mapping against the real model, built on the meta device.

Which models are built (all on the meta device: shapes only, no weights, no process group):

* the model type's *default* config, with every layer count reduced to 2 (checks are per block, and
  block structure and sizes do not depend on the number of blocks), once per model class the file's
  ``verify`` section names, at world size 1 (structure), then with the first class at every world size
  the file declares in ``world_sizes`` (divisibility, reported per world size);
* every embedded tiny ``verify`` config with its first class, at world size 1 and at its own
  ``world_sizes`` (what `tpmap verify` will run).

The per-entry checks are `engine.planner.build_plan` in collecting mode -- the same code `tpmap.apply` runs --
so the linter and `apply` cannot disagree. Coverage and pairing are lint-only rules (below).
A problem found once is not repeated: a later model or world size only adds problems at a new
(place, rule), and world-size problems name the world size.
"""
from __future__ import annotations

import dataclasses
import inspect
import re
import sys
from collections.abc import Iterable

import transformers
from torch import nn
from transformers.pytorch_utils import Conv1D

from tpmap.compat import PROVEN, mapping_applies
from tpmap.engine import planner
from tpmap.engine.blocks import block_of, block_prefixes
from tpmap.language import expr
from tpmap.language.errors import TpmapError, did_you_mean
from tpmap.language.patterns import (
    generic_pattern,
    match_entry,
    match_modules,
    suggest_module,
)
from tpmap.language.schema import Column, Param, Row, config_matches, config_value, layer_selected, release_matches
from tpmap.language.source import MappingFile
from tpmap.lint.diagnostic import Diagnostic
from tpmap.meta import auto_classes, build_meta, config_keys, reduced_default_config


# -- the lint-only rules ---------------------------------------------------------------------------
def _covered_kinds() -> tuple:
    return (nn.Linear, nn.Embedding, Conv1D)


class _Matches:
    """What each entry and replicated pattern of a mapping matches in one base model."""

    def __init__(self, loaded: MappingFile, modules: dict):
        self.entries = [match_entry(e, modules) for e in loaded.mapping.entries]
        self.replicated = [match_modules(p, modules) for p in loaded.mapping.replicated_patterns]


def coverage(loaded: MappingFile, modules: dict, blocks: list[str], m: _Matches) -> list[Diagnostic]:
    """Every nn.Linear, Conv1D and nn.Embedding inside a block is sharded by a Column/Row entry or kept
    whole on purpose by a `replicated` pattern that matches it or one of its parents (strict mode)."""
    mapping = loaded.mapping
    sharded = {n for e, ns in zip(mapping.entries, m.entries) if isinstance(e, (Column, Row)) for n in ns}
    # a Linear whose weight a Param entry splits (inside a Reduce: JetMoE's kv_proj) is split too
    sharded |= {n for e, ns in zip(mapping.entries, m.entries)
                if isinstance(e, Param) and "weight" in (e.params or ()) for n in ns}
    kept = {n for ns in m.replicated for n in ns}
    kinds = _covered_kinds()
    out, seen = [], set()
    for name, module in modules.items():
        if not isinstance(module, kinds) or block_of(name, blocks) is None or name in sharded:
            continue
        parts = name.split(".")
        if any(".".join(parts[:k]) in kept for k in range(1, len(parts) + 1)):
            continue
        g = generic_pattern(name)
        if g in seen:
            continue
        seen.add(g)
        out.append(Diagnostic.at(
            loaded.source.key(("entries",)), "coverage",
            f"{_kind(module)} {g} is inside the repeated blocks but no entry shards it; add a Column or "
            f"Row entry for it, or list it under replicated: to keep it whole on every rank"))
    return out


def replicated_clashes(loaded: MappingFile, m: _Matches) -> list[Diagnostic]:
    """No replicated pattern keeps whole (a parent of) a module that an entry shards."""
    mapping = loaded.mapping
    out = []
    for k, (pattern, matched) in enumerate(zip(mapping.replicated_patterns, m.replicated)):
        kept = set(matched)
        for i, (entry, ns) in enumerate(zip(mapping.entries, m.entries)):
            if not isinstance(entry, (Column, Row)):
                continue
            clash = next((n for n in ns if any(n == r or n.startswith(r + ".") for r in kept)), None)
            if clash is not None:
                out.append(Diagnostic.at(loaded.source.value(("replicated", k)), "double-match",
                                         f"replicated pattern {pattern!r} keeps {clash} whole, but "
                                         f"{loaded.label(i)} ({loaded.source.value(('entries', i, 'module'))}) "
                                         "shards it; remove one of them"))
                break
    return out


def replicated_unmatched(loaded: MappingFile, hit: set[tuple], names: list[str], model_names: list[str],
                         prefix: str) -> list[Diagnostic]:
    """A replicated pattern must match a module in at least one of the models built (a pooler, say,
    exists in some classes only). `hit`: the places (`_place`) of the patterns that matched."""
    return [
        Diagnostic.at(loaded.source.value(("replicated", k)), "pattern-no-match",
                      f"replicated pattern {pattern!r} matches no module of {' or '.join(model_names)} (relative "
                      f"to the base model{' ' + repr(prefix[:-1]) if prefix else ''}){suggest_module(pattern, names)}")
        for k, pattern in enumerate(loaded.mapping.replicated_patterns)
        if _place(loaded.source.value(("replicated", k))) not in hit
    ]


def _failed_compose(loaded: MappingFile, expanded: MappingFile) -> list[str]:
    """The module prefixes ('language_model.') of the compose items that did not expand (an error said why)."""
    reached = {s.prefix for s in expanded.scopes.values()}
    return [c.module + "." for c in loaded.mapping.compose
            if not any(p.startswith(c.module + ".") for p in reached)]


def _place(position) -> tuple:
    """A node's place in the files lint reads: composed files' items keep their own file's positions."""
    return (position.path, position.line, position.col)


def _kind(module) -> str:
    cls = type(module)
    return ("nn." if cls.__module__.startswith("torch.nn") else "") + cls.__name__


def _sequential_input_side(modules: dict, weights: list[str], m: _Matches, columns: set[str]) -> set[str]:
    """Weights kept whole by a `replicated` pattern (they or a parent) that lie in an earlier child of an
    nn.Sequential than some Column: the Sequential feeds them into it, so they are its input side."""
    kept = {n for ns in m.replicated for n in ns}

    def is_kept(w: str) -> bool:
        parts = w.split(".")
        return any(".".join(parts[:k]) in kept for k in range(1, len(parts) + 1))

    out: set[str] = set()
    for name, mod in modules.items():
        if not name or not isinstance(mod, nn.Sequential):
            continue
        children = [f"{name}.{c}" for c in mod._modules]
        last = max((i for i, c in enumerate(children)
                    if any(col == c or col.startswith(c + ".") for col in columns)), default=-1)
        for c in children[:max(last, 0)]:
            out.update(w for w in weights if (w == c or w.startswith(c + ".")) and is_kept(w))
    return out


def pairing(loaded: MappingFile, modules: dict, blocks: list[str], m: _Matches) -> list[Diagnostic]:
    """Column -> Row pairing, by the nearest weights around each sharded module.

    Definition: the *weights* are the nn.Linear, Conv1D and nn.Embedding modules. For a Column
    without gather_output, walk up its parents (within its repeated block; for a module outside the
    blocks, up to the base model without the blocks) to the first one that holds other weights than
    such Columns: one of those must be a Row, the module that takes split input and all-reduces. So
    ``mlp.c_fc`` pairs with ``mlp.c_proj``; BERT's ``intermediate.dense`` pairs with the layer's
    ``output.dense``. Symmetrically, a Row's nearest other weights must include such a Column.
    A Column with ``heads`` on an nn.Embedding outside the repeated blocks is a per-head table (MPNet's
    ``encoder.relative_attention_bias``: a bias per head, added to every block's attention scores):
    its split output is consumed inside the blocks, so it pairs with a Row inside the repeated blocks
    of its nearest parent that holds any (the attention output of the heads it feeds).
    Weights kept whole (``replicated``) that come before a Column in an nn.Sequential are that
    Column's input side (a LoRA adapter ``Sequential(Linear(in -> rank), Linear(rank -> out))`` whose
    up-projection ``.1`` is a Column and whose down-projection ``.0`` stays whole): in a Sequential
    data flows in child order, so they cannot consume the split output, and they never count as
    "other weights" in this walk (it goes on up to the Row that takes the sum the adapter adds to).
    Limits: the rule sees the module tree, not the data flow: a split output that reaches the wrong
    Row of the same scope passes here and fails `tpmap verify`.
    """
    mapping = loaded.mapping
    kinds = _covered_kinds()
    weights = [n for n, mod in modules.items() if n and isinstance(mod, kinds)]
    rows = {n for e, ns in zip(mapping.entries, m.entries) if isinstance(e, Row) for n in ns}
    cols = {n for e, ns in zip(mapping.entries, m.entries)
            if isinstance(e, Column) and not e.gather_output for n in ns}
    input_side = _sequential_input_side(modules, weights, m, {n for e, ns in zip(mapping.entries, m.entries)
                                                             if isinstance(e, Column) for n in ns})
    out = []
    for i, (entry, ns) in enumerate(zip(mapping.entries, m.entries)):
        if not isinstance(entry, (Column, Row)) or (isinstance(entry, Column) and entry.gather_output):
            continue
        same, partner = (cols, rows) if isinstance(entry, Column) else (rows, cols)
        for name in ns:
            block = block_of(name, blocks)
            parts = name.split(".")
            # a per-head table outside the blocks feeds the blocks: look for its Row inside them
            feeds_blocks = (block is None and isinstance(entry, Column) and entry.heads is not None
                            and isinstance(modules[name], nn.Embedding))
            near: list[str] = []
            scope = ""
            for k in range(len(parts) - 1, -1, -1):
                scope = ".".join(parts[:k])
                if block is not None and len(scope) < len(block):
                    break  # the block itself was the last scope
                inside = [w for w in weights if w not in same and w not in input_side
                          and (not scope or w.startswith(scope + "."))
                          and ((block_of(w, blocks) is not None) if feeds_blocks
                               else (block is not None or block_of(w, blocks) is None))]
                if inside:
                    near = inside
                    break
            if any(w in partner for w in near):
                continue
            where = (f"{generic_pattern(scope)}" if scope else "the base model outside the repeated blocks")
            if feeds_blocks:
                where = f"the repeated blocks{' of ' + generic_pattern(scope) if scope else ''}"
            # one per block kind
            shown_near = list(dict.fromkeys(f"{generic_pattern(w)} ({_kind(modules[w])})" for w in near))
            shown = ", ".join(shown_near[:3]) + (", ..." if len(shown_near) > 3 else "")
            if isinstance(entry, Column):
                msg = (f"Column {generic_pattern(name)} leaves its output split, but no Row entry takes it: "
                       + (f"the nearest other weights, in {where}, are {shown}, none a Row; make the one that "
                          "consumes this output a Row" if near else f"{where} holds no other weight to be its Row")
                       + ", or set gather_output: true")
            else:
                msg = (f"Row {generic_pattern(name)} expects its input split by a Column, but "
                       + (f"the nearest other weights, in {where}, are {shown}, none a Column (without "
                          "gather_output); add the Column that feeds it" if near
                          else f"{where} holds no other weight to be its Column")
                       + ", or remove this Row")
            out.append(Diagnostic.at(loaded.source.value(("entries", i, "module")), "pairing", msg))
            break  # one problem per entry
    return out


# -- the whole file --------------------------------------------------------------------------------
class _Report:
    """Collects diagnostics; a later model or world size adds only problems at a new (place, rule)
    (for coverage: a new module)."""

    def __init__(self):
        self.items: list[Diagnostic] = []
        self.places: set[tuple] = set()

    def add(self, d: Diagnostic, label: str = "") -> None:
        # coverage problems all point at `entries:`; they differ by the module they name
        key = (d.path, d.line, d.col, d.rule) + ((d.message,) if d.rule == "coverage" else ())
        if key in self.places:
            return
        self.places.add(key)
        self.items.append(Diagnostic(d.path, d.line, d.col, d.rule, label + d.message) if label else d)

    def add_errors(self, errors: Iterable[TpmapError], label: str = "") -> None:
        for e in errors:
            self.add(Diagnostic.from_error(e), label)


def structural(loaded: MappingFile) -> list[Diagnostic]:
    """Every problem of a mapping that passed the schema, found against the real model classes."""
    mapping, src = loaded.mapping, loaded.source
    if not mapping_applies(mapping.transformers):
        note = Diagnostic.at(src.value(("transformers",)), "transformers-version",
                             f"not checked: the mapping needs transformers{mapping.transformers}, and "
                             f"{transformers.__version__} is installed")
        return [dataclasses.replace(note, severity="note")]
    report = _Report()
    for d in release_never(loaded):
        report.add(d)
    default = _default_config(loaded, report)
    if default is None:
        return report.items
    valid_keys = config_keys(default)
    section = _verify_section(loaded, default, valid_keys, report)
    for d in when_attributes(loaded, default, valid_keys):
        report.add(d)
    report.add_errors(planner.check_expressions(default, loaded))
    checks = _ModelChecks(loaded, report)
    _check_default_config(checks, default, section)
    configs = [("the default config", default), *_check_verify_configs(checks, section)]  # every config, for `when`
    for d in when_never(loaded, configs) + layer_never(loaded, configs):
        report.add(d)
    checks.finish()
    return report.items


def _default_config(loaded: MappingFile, report: _Report):
    """The model type's default config with at most 2 layers, or None (reported) where there is none."""
    mapping, src = loaded.mapping, loaded.source
    if mapping.model_type not in transformers.CONFIG_MAPPING:
        report.add(Diagnostic.at(src.value(("model_type",)), "unknown-model-type",
                                 f"{mapping.model_type!r} is not a model_type of transformers "
                                 f"{transformers.__version__}"
                                 f"{did_you_mean(mapping.model_type, transformers.CONFIG_MAPPING)}"))
        return None
    try:
        return reduced_default_config(mapping.model_type, mapping.default_config)
    except Exception as e:  # a config class rejecting its own defaults with 2 layers: reported, not hidden
        report.add(Diagnostic.at(src.value(("model_type",)), "model-build",
                                 f"the default config of {mapping.model_type!r} with at most 2 layers is rejected: "
                                 f"{type(e).__name__}: {e}"))
        return None


@dataclasses.dataclass
class _VerifySection:
    """The verify section, resolved: per verify spec, the classes that resolved and its config (or the
    exception the config's __init__ raised, reported when its models are checked)."""
    classes: list[list] = dataclasses.field(default_factory=list)
    configs: list = dataclasses.field(default_factory=list)


def _verify_section(loaded: MappingFile, default, valid_keys: set[str], report: _Report) -> _VerifySection:
    """Known classes of this model type, known config keys, declared inputs, per verify spec."""
    mapping, src = loaded.mapping, loaded.source
    section = _VerifySection()
    for v, spec in enumerate(mapping.verify):
        found = _verify_classes(loaded, v, default, report)
        section.classes.append(found)
        for key in spec.config:
            if key not in valid_keys and not any(_reads(c, key) for c in found):
                report.add(Diagnostic.at(src.key(("verify", v, "config", key)), "config-attribute",
                                         f"{type(default).__name__} has no attribute {key!r}"
                                         f"{did_you_mean(key, valid_keys)}; AutoConfig would silently keep it"))
        try:
            section.configs.append(transformers.AutoConfig.for_model(mapping.model_type, **spec.config))
        except Exception as e:  # a config __init__ rejecting values: reported with the embedded configs below
            section.configs.append(e)
        # dotted input names read this config's sub-configs (a tower the default config lacks)
        own = section.configs[v] if not isinstance(section.configs[v], Exception) else default
        for d in verify_inputs(loaded, v, found, valid_keys | set(spec.config), own):
            report.add(d)
    return section


def _verify_classes(loaded: MappingFile, v: int, default, report: _Report) -> list:
    """The classes verify spec `v` names that are transformers model classes of this model type."""
    mapping, src = loaded.mapping, loaded.source
    found = []
    for j, name in enumerate(mapping.verify[v].models):
        cls = getattr(transformers, name, None) if name.isidentifier() else None
        pos = src.value(("verify", v, "models", j))
        config_type = getattr(getattr(cls, "config_class", None), "model_type", None)
        if cls is None or not isinstance(cls, type) or not hasattr(cls, "base_model_prefix"):
            report.add(Diagnostic.at(pos, "unknown-model-class",
                                     f"{name!r} is not a transformers model class; use a class name such as "
                                     f"{_example_class(type(default))}"))
        elif config_type != mapping.model_type and name not in auto_classes(mapping.model_type):
            report.add(Diagnostic.at(pos, "unknown-model-class",
                                     f"{name} is a model class for model_type {config_type!r}, not "
                                     f"{mapping.model_type!r}"))
        else:
            found.append(cls)
    return found


@dataclasses.dataclass
class _ModelChecks:
    """`build_plan` in collecting mode and the structural rules, on each model lint builds, and what they hold
    back for the end (`finish`).

    The default config is cut to 2 blocks, which may lack a kind of block that comes later (DeepSeek's MoE layers
    from first_k_dense_replace = 3 on): an entry matching nothing there is reported only if it matches nothing in
    the verify configs' models either (those run whole, as `tpmap verify` runs them)."""
    loaded: MappingFile
    report: _Report
    # place -> the default config's pattern-no-match error there, held back
    unmatched_in_default: dict[tuple, TpmapError] = dataclasses.field(default_factory=dict)
    # the same entries unmatched in a verify config, with its label
    unmatched_later: list[tuple[TpmapError, str]] = dataclasses.field(default_factory=list)
    # places of the entries whose pattern matches in a verify config's model
    entry_hit: set[tuple] = dataclasses.field(default_factory=set)
    # places of the replicated patterns that matched
    replicated_hit: set[tuple] = dataclasses.field(default_factory=set)
    # (class name, module names, base prefix) of each model checked for structure
    models: list[tuple[str, list[str], str]] = dataclasses.field(default_factory=list)
    # the mapping as the last model checked expanded it (compose)
    expanded: MappingFile | None = None

    def build(self, cls, config, v: int | None):
        """`cls` on the meta device from `config` (verify spec `v`'s, or the default config's), or None."""
        try:
            return build_meta(cls, config)
        except Exception as e:  # any failure of a transformers constructor: reported, never swallowed
            src = self.loaded.source
            which = "the default config" if v is None else f"the verify config {self.loaded.mapping.verify[v].name!r}"
            pos = src.value(("model_type",)) if v is None else src.value(("verify", v, "config"))
            self.report.add(Diagnostic.at(pos, "model-build", f"building {cls.__name__} from {which} failed: "
                                                              f"{type(e).__name__}: {e}"))
            return None

    def check(self, model, tp_size: int, label: str = "", structure: bool = True, default: bool = False) -> None:
        """The plan's errors at `tp_size`, and with `structure` the lint-only rules, each under `label`;
        `default`: the model of the default config (its unmatched patterns wait for the verify configs')."""
        expanded = self._plan(model, tp_size, label, structure, default)
        if structure:
            self._structure(model, expanded, label, default)

    def _plan(self, model, tp_size: int, label: str, structure: bool, default: bool) -> MappingFile:
        errors: list[TpmapError] = []
        expanded = planner.composed(model, self.loaded, errors)  # the same expansion build_plan makes
        self.expanded = expanded
        planner.build_plan(model, expanded, tp_size, errors)
        placements = sorted({e.experts for e in expanded.mapping.entries if e.experts is not None})
        for other in (p for p in placements if p != expanded.experts):  # every experts placement is checked
            found: list[TpmapError] = []
            planner.build_plan(model, dataclasses.replace(expanded, chosen_experts=other), tp_size, found)
            if default and any(e.rule == "expert-count" for e in found):
                continue  # the default config's listed world sizes are the default placement's: this one serves fewer
            errors += [e for e in found if all(str(e) != str(x) for x in errors)]
        if structure and expanded is not self.loaded:  # composed entries read their sub-configs
            errors += planner.check_expressions(model.config, expanded)
        for e in errors:
            key = _place(e.position) if e.rule == "pattern-no-match" else None
            if default and key:
                self.unmatched_in_default.setdefault(key, e)
            elif key in self.unmatched_in_default:
                self.unmatched_later.append((e, label))
        self.report.add_errors((e for e in errors if e.rule != "pattern-no-match"
                                or _place(e.position) not in self.unmatched_in_default), label)
        return expanded

    def _structure(self, model, expanded: MappingFile, label: str, default: bool) -> None:
        base, prefix = planner.base_prefix(model)
        modules = dict(base.named_modules())
        names = [n for n in modules if n]
        blocks = block_prefixes(base)
        m = _Matches(expanded, modules)
        self.replicated_hit.update(_place(expanded.source.value(("replicated", k)))
                                   for k, ns in enumerate(m.replicated) if ns)
        if not default:
            self.entry_hit.update(_place(expanded.source.value(("entries", i, "module")))
                                  for i, ns in enumerate(m.entries) if ns)
        self.models.append((type(model).__name__, names, prefix))
        uncovered = coverage(expanded, modules, blocks, m)
        failed = _failed_compose(self.loaded, expanded)  # reported already: their blocks are not uncovered too
        uncovered = [d for d in uncovered if not any(f" {f}" in d.message for f in failed)]
        for d in replicated_clashes(expanded, m) + uncovered + pairing(expanded, modules, blocks, m):
            self.report.add(d, label)

    def finish(self) -> None:
        """What was held back: unmatched patterns, replicated patterns no model matched."""
        self.report.add_errors(e for key, e in self.unmatched_in_default.items() if key not in self.entry_hit)
        for e, label in self.unmatched_later:  # only where the default config's error was dropped: a new place
            self.report.add_errors([e], label)
        if self.models:
            for d in replicated_unmatched(self.expanded, self.replicated_hit, self.models[0][1],
                                          list(dict.fromkeys(n for n, _, _ in self.models)), self.models[0][2]):
                self.report.add(d)


def _check_default_config(checks: _ModelChecks, default, section: _VerifySection) -> None:
    """The default config: structure with every class, then the first class at each declared world size."""
    first = None
    for cls in dict.fromkeys(c for found in section.classes for c in found):
        model = checks.build(cls, default, None)
        if model is None:
            continue
        checks.check(model, 1, default=True)
        first = first or model
    if first is not None:
        for tp_size in checks.loaded.mapping.world_sizes:
            if tp_size != 1:
                checks.check(first, tp_size, f"world size {tp_size}: ", structure=False, default=True)


def _check_verify_configs(checks: _ModelChecks, section: _VerifySection) -> list[tuple[str, object]]:
    """The embedded tiny configs, as `tpmap verify` will run them: each with its first class, at world size 1
    and at its own world sizes. Returns the (label, config) of each config checked."""
    loaded, report = checks.loaded, checks.report
    configs = []
    for v, (spec, found) in enumerate(zip(loaded.mapping.verify, section.classes)):
        if not found:
            continue
        config = section.configs[v]
        if isinstance(config, Exception):  # a config __init__ rejecting values: reported at the config
            report.add(Diagnostic.at(loaded.source.value(("verify", v, "config")), "model-build",
                                     f"the verify config {spec.name!r} is rejected: {type(config).__name__}: {config}"))
            continue
        configs.append((f"verify {spec.name!r}", config))
        report.add_errors(planner.check_expressions(config, loaded), f"verify {spec.name!r}: ")
        model = checks.build(found[0], config, v)
        if model is None:
            continue
        checks.check(model, 1, f"verify {spec.name!r}: ")
        for tp_size in spec.world_sizes:
            if tp_size != 1:
                checks.check(model, tp_size, f"verify {spec.name!r}, world size {tp_size}: ", structure=False)
    return configs


def when_attributes(loaded: MappingFile, default, valid_keys: set[str]) -> list[Diagnostic]:
    """A `when` key the config class does not define reads null on every config that lacks it, which is
    rarely what the model does: transformers reads such attributes with its own default
    (``getattr(config, "share_att_key", False)``), so the mapping must declare that default in
    `config_defaults`. A `config_defaults` key the class defines is never used: an error too."""
    mapping, src = loaded.mapping, loaded.source
    name = type(default).__name__
    out = []
    whens = [(("entries", i, "when"), e.when) for i, e in enumerate(mapping.entries) if e.when]
    whens += [(("entries", i, "when_layer"), e.when_layer) for i, e in enumerate(mapping.entries) if e.when_layer]
    whens += [(("unsupported", k, "when"), u.when) for k, u in enumerate(mapping.unsupported)]
    for where, when in whens:
        for key in when:
            if key in valid_keys or key in mapping.config_defaults:
                continue
            out.append(Diagnostic.at(src.key((*where, key)), "when-attribute",
                                     f"the {name} does not define {key!r}{did_you_mean(key, valid_keys)}, so a "
                                     f"config without it reads null here. If the model reads it with a default "
                                     f"(getattr(config, {key!r}, <default>)), declare that default: "
                                     f"config_defaults: {{{key}: <default>}}"))
    for key in mapping.config_defaults:
        if key in valid_keys:
            out.append(Diagnostic.at(src.key(("config_defaults", key)), "when-attribute",
                                     f"the {name} defines {key!r} (default {getattr(default, key, None)!r}), so "
                                     "this default is never read: remove it"))
    return out


def release_never(loaded: MappingFile) -> list[Diagnostic]:
    """An entry (or grad_allreduce item) whose `transformers` range admits none of the releases tpmap proves
    (compat.PROVEN) is never applied nor proven: widen the range or remove it."""
    items = [(("entries", i), loaded.label(i), e.transformers) for i, e in enumerate(loaded.mapping.entries)]
    items += [(("grad_allreduce", i), f"grad_allreduce item {i} ({g.module!r})", g.transformers)
              for i, g in enumerate(loaded.mapping.grad_allreduce) if not isinstance(g, str)]
    return [Diagnostic.at(loaded.source.value((*key, "transformers")), "transformers-never",
                          f"{what} applies to no release tpmap proves: transformers{spec} admits none of "
                          f"{', '.join(PROVEN)}; write a range that holds one of them (e.g. '>=5.24' or '<5.24') "
                          "or remove it")
            for key, what, spec in items
            if spec is not None and not any(release_matches(spec, v) for v in PROVEN)]


def when_never(loaded: MappingFile, configs: list) -> list[Diagnostic]:
    """An entry whose `when` matches none of the configs lint checks is never checked nor proven: add a
    verify config of that variant, or fix the condition. `configs`: the default config first, then the verify ones."""
    out = []
    defaults = loaded.mapping.config_defaults
    defined = config_keys(configs[0][1]) | set(defaults)  # configs[0]: the default config (what the class defines)
    for i, entry in enumerate(loaded.mapping.entries):
        if not entry.when or any(config_matches(entry.when, c, defaults) for _, c in configs):
            continue
        if not set(entry.when) <= defined:
            continue  # an attribute no config class defines: `when_attributes` reports it
        for key, want in entry.when.items():
            seen = {label: getattr(c, key, defaults.get(key, "<missing>")) for label, c in configs}
            if all(not config_matches({key: want}, c, defaults) for _, c in configs):
                if all(v == "<missing>" for v in seen.values()):
                    keys = set().union(*(set(c.to_dict()) for _, c in configs))
                    why = f"no config has an attribute {key!r}{did_you_mean(key, keys)}"
                else:
                    values = "; ".join(f"{label}: {v!r}" for label, v in seen.items())
                    why = f"{key} is never {want!r} ({values}); add a verify config with {key}: {want!r}"
                msg = (f"{loaded.label(i)} applies to no config lint checks, so it is "
                       f"never checked nor proven: {why}")
                out.append(Diagnostic.at(loaded.source.key(("entries", i, "when", key)), "when-never", msg))
                break
        else:
            out.append(Diagnostic.at(loaded.source.key(("entries", i, "when")), "when-never",
                                     f"{loaded.label(i)}: no config lint checks matches "
                                     f"all of {entry.when}; add a verify config of that variant"))
    return out


def layer_never(loaded: MappingFile, configs: list) -> list[Diagnostic]:
    """An entry whose `when_layer` selects no layer of any config lint checks (where its `when` matches) is never
    checked nor proven: add a verify config with such a layer, or fix the value."""
    out = []
    defaults = loaded.mapping.config_defaults
    for i, entry in enumerate(loaded.mapping.entries):
        if not entry.when_layer:
            continue
        seen = {}
        for label, c in configs:
            c = loaded.config_of("entries", i, c)
            if not config_matches(entry.when, c, defaults):
                continue
            lists = {key: config_value(c, key, defaults) for key in entry.when_layer}
            if not all(isinstance(v, (list, tuple)) for v in lists.values()):
                break  # not a per-layer list: the plan reports it (config-attribute)
            seen[label] = lists
            layers = min(len(v) for v in lists.values())
            if any(layer_selected(entry.when_layer, str(j), c, defaults) for j in range(layers)):
                break
        else:
            values = "; ".join(f"{label}: {lists}" for label, lists in seen.items()) or "no config matches its when"
            out.append(Diagnostic.at(loaded.source.key(("entries", i, "when_layer")), "when-never",
                                     f"{loaded.label(i)} selects no layer of any config lint "
                                     f"checks, so it is never checked nor proven: no layer has {entry.when_layer} "
                                     f"({values}); add a verify config with such a layer"))
    return out


def verify_inputs(loaded: MappingFile, v: int, classes: list, known: set[str], config=None) -> list[Diagnostic]:
    """The example inputs of verify config `v` (what `tpmap.verify.example_inputs` will make): every
    class's main input is input_ids (derived) or declared; declared names are arguments of every
    class's forward; their shapes and token runs name config attributes (`known`: the config's keys; a
    dotted name a sub-config's attribute, looked up in `config`, the default config) or `batch` / `seq`."""
    spec, src = loaded.mapping.verify[v], loaded.source
    out = []
    for cls in classes:
        main = getattr(cls, "main_input_name", "input_ids")
        if main != "input_ids" and main not in spec.inputs:
            out.append(Diagnostic.at(src.value(("verify", v)), "missing-key",
                                     f"missing input {main!r} in verify.{v}.inputs: {cls.__name__}'s main input is "
                                     f"{main}, whose shape tpmap cannot derive; declare it, e.g. inputs: "
                                     f"{{{main}: {{shape: [batch, ...], kind: float}}}}"))
            break
    for name, declared in spec.inputs.items():
        for cls in classes:
            arguments = [n for n in inspect.signature(cls.forward).parameters if n != "self"]
            if name not in arguments:
                out.append(Diagnostic.at(src.key(("verify", v, "inputs", name)), "unknown-key",
                                         f"{cls.__name__}.forward has no argument {name!r}"
                                         f"{did_you_mean(name, arguments)}; inputs are named by forward argument"))
                break
        exprs = [(("shape", k), dim) for k, dim in enumerate(declared.shape)]
        exprs += [(("tokens", k, f), getattr(t, f)) for k, t in enumerate(declared.tokens) for f in ("id", "count")]
        exprs += [(("values", k), value) for k, value in enumerate(declared.values)]
        exprs += [(("grid", k), value) for k, value in enumerate(declared.grid)]
        for key, value in exprs:
            for n in sorted(expr.names(value) - {"batch", "seq"}):
                problem = _unknown_name(n, known, config)
                if problem:
                    out.append(Diagnostic.at(src.value(("verify", v, "inputs", name) + key), "config-attribute",
                                             f"input {name!r}: {problem}; shapes and tokens use config attributes "
                                             "(dotted for a sub-config's), batch and seq"))
    return out


def _unknown_name(name: str, known: set[str], config) -> str:
    """Why `name` (an attribute, or a dotted sub-config attribute) is not one the config has; '' when it is."""
    first, _, rest = name.partition(".")
    if first not in known:
        return f"the config has no attribute {first!r}{did_you_mean(first, known)}"
    if rest and config is not None:
        try:
            planner.attribute_path(config, name)
        except TpmapError as e:
            return str(e)
    return ""


def _reads(cls, name: str) -> bool:
    """Whether the modeling source of `cls` names `name` (configs need not declare every attribute their
    model reads, e.g. a `config.decoder_start_token_id` read by a seq2seq model)."""
    source = _source(sys.modules[cls.__module__])
    return re.search(rf"\b{re.escape(name)}\b", source) is not None


_SOURCES: dict[str, str] = {}


def _source(module) -> str:
    if module.__name__ not in _SOURCES:
        _SOURCES[module.__name__] = inspect.getsource(module)
    return _SOURCES[module.__name__]


def _example_class(config_cls) -> str:

    stem = config_cls.__name__.removesuffix("Config")
    for suffix in ("ForCausalLM", "Model", "ForMaskedLM"):
        if hasattr(transformers, stem + suffix):
            return stem + suffix
    return stem + "Model"
