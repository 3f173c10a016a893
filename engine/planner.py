"""The planner: walks a mapping's entries over a model and records what each rank holds and does.

One `Planner` holds the planning state (the model's modules, which entry claimed which tensor, the
results so far, the errors when collecting), matches each entry's pattern and sizes the split dims
(`layout`, `sections`); each entry kind is planned by one method below, in the order of
`tpmap.language.schema`: Column/Row, Update, Param, Reduce, Enter, Input, Norm, with the records that need
no planning state built by the functions after the class (`split_dim`, `attribute_update`, `input_slice`,
`l2_statistic_norm`). The whole-model features (vocab_parallel, grad_allreduce, tied parameters) are planned
after the entries by `engine.whole_model`. Nothing here reads or writes a tensor's data; `engine.shard`
executes the plan.
"""
from __future__ import annotations

import copy
import inspect
from typing import Any

import torch
from torch import nn
from transformers import PretrainedConfig

from tpmap.engine import pieces as split
from tpmap.engine.errors import ModuleKindError, UnevenSplitError, UnsupportedConfigError
from tpmap.engine.plan import AttributeUpdate, InputSlice, ModuleShard, ParamLayout, Plan, RouteSlice
from tpmap.engine.whole_model import plan_grad_allreduce, plan_vocab_parallel, tie_errors
from tpmap.language import compose, expr
from tpmap.language.errors import ConfigAttributeError, DivisibilityError, PatternMatchError, TpmapError, did_you_mean
from tpmap.language.patterns import match_entry, match_modules, suggest_module
from tpmap.language.schema import (
    Column,
    Enter,
    Input,
    Norm,
    Param,
    Reduce,
    Route,
    Row,
    Update,
    any_layer_selected,
    config_matches,
    entry_applies,
    layer_index,
    layer_selected,
)
from tpmap.language.source import MappingFile


def base_prefix(model: nn.Module) -> tuple[nn.Module, str]:
    base = getattr(model, "base_model", model)
    if base is model:
        return model, ""
    for name, mod in model.named_modules():
        if mod is base:
            return base, name + "."
    raise AssertionError("model.base_model is not a submodule of the model")


def composed(model: nn.Module, loaded: MappingFile, errors: list[TpmapError] | None = None) -> MappingFile:
    """`loaded` with its `compose` items expanded over `model`'s sub-models (`tpmap.language.compose`): ordinary
    entries whose patterns reach the sub-model's own base model and whose expressions read its sub-config.
    `loaded` itself when it composes nothing. With `errors`, problems are collected (tpmap lint)."""
    if not loaded.mapping.compose:
        return loaded
    base, prefix = base_prefix(model)
    modules = dict(base.named_modules())

    def submodel(path: str) -> tuple[str, str] | None:
        module = modules.get(path) if path else None
        if module is None:
            return None
        return f"{path}.{base_prefix(module)[1]}", f"{prefix}{path} ({type(module).__name__})"

    return compose.expand(loaded, model.config, submodel, [n for n in modules if n], errors)


def expression_keys(entry) -> list[tuple[tuple, Any]]:
    """(key path inside the entry, expression) for every expression an entry holds, in file order."""
    if isinstance(entry, Update):
        return [(("attributes", path), value) for path, value in entry.attributes.items()]
    out: list[tuple[tuple, Any]] = []
    for key in ("heads", "query_heads", "groups"):
        if getattr(entry, key, None) is not None:
            out.append(((key,), getattr(entry, key)))
    sections = getattr(entry, "sections", None)
    if isinstance(sections, str):
        out.append((("sections",), sections))
    if isinstance(sections, list):
        for k, sec in enumerate(sections):
            out += [(("sections", k, f), v) for f, v in (("size", sec.size), ("heads", sec.heads),
                                                         ("query_heads", sec.query_heads)) if v is not None]
    return out


def resolve_attr(module: nn.Module, path: str):
    """(owner object, last name, value) for a dotted attribute path, or raise AttributeError."""
    obj = module
    parts = path.split(".")
    for p in parts[:-1]:
        obj = getattr(obj, p)
    return obj, parts[-1], getattr(obj, parts[-1])


# The `tpmap lint` rule id of each error kind raised while evaluating an expression.
_EVAL_RULES = {ConfigAttributeError: "config-attribute", DivisibilityError: "divisibility"}


class EntryContext:
    """One entry being planned: evaluates its expressions and names its position (and lint rule) in
    every error it raises."""

    def __init__(self, config: PretrainedConfig, loaded: MappingFile, index: int, tp_size: int):
        """`config` is the model's; a composed entry reads its sub-model's sub-config."""
        self.loaded, self.index, self.tp_size = loaded, index, tp_size
        self.config = loaded.config_of("entries", index, config)
        self.stack_config = self.config  # the config whose per-layer lists at_layer(...) reads (not a layer's view)
        self.entry = loaded.mapping.entries[index]

    def pos(self, *key):
        return self.loaded.source.value(("entries", self.index) + key)

    def lookup(self, name: str) -> int:
        if "." in name:  # a sub-config's attribute by its path: vision_config.image_size
            return attribute_path(self.config, name)
        try:
            if hasattr(self.config, name):
                return getattr(self.config, name)
        except RuntimeError as e:  # transformers' AmbiguousGlobalPerLayerAttributeError: differs per layer
            raise ConfigAttributeError(
                f"the {type(self.config).__name__} cannot give one value of {name!r}: {e}. Use an attribute "
                "that holds one value for every layer, or split the entry with `when`") from e
        defaults = self.loaded.mapping.config_defaults
        if name in defaults:  # absent from this config: the default the model itself reads
            return defaults[name]
        # else an attribute of exactly one sub-config (DBRX keeps moe_num_experts in ffn_config)
        subs = {key: sub for key in getattr(self.config, "sub_configs", None) or {}
                if isinstance(sub := getattr(self.config, key, None), PretrainedConfig)}
        found = [key for key, sub in subs.items() if hasattr(sub, name)]
        if len(found) > 1:
            raise ConfigAttributeError(f"{name!r} is an attribute of several sub-configs of the "
                                       f"{type(self.config).__name__} ({', '.join(found)}) and not of the config "
                                       "itself; it is ambiguous")
        if found:
            return getattr(subs[found[0]], name)
        keys = set(self.config.to_dict()) | set(getattr(self.config, "attribute_map", {}))
        raise ConfigAttributeError(
            f"the {type(self.config).__name__} has no attribute {name!r}{did_you_mean(name, keys)}"
        )

    uneven = False  # the plan splits something unevenly: per_rank follows the uneven rule (check_per_rank)
    features = None  # {plain feature count: what each rank holds of it} (Planner.features), for per_rank(n)
    module: str | None = None  # the module planned (set by `at_layer`): at_layer(...) reads its layer's entry

    def eval(self, text, *key, tp_rank: int = 0) -> int:
        try:
            return expr.evaluate(text, self.lookup, self.tp_size, tp_rank, self.uneven,
                                 self.features if self.uneven else None, self.layer_entry)
        except TpmapError as e:
            raise self.error(type(e), str(e), *key, rule=_EVAL_RULES.get(type(e), "config-attribute")) from None

    def error(self, cls, message: str, *key, rule: str) -> TpmapError:
        return cls(f"{self.loaded.label(self.index)}: {message}", self.pos(*key), rule)

    def at_layer(self, name: str, views: dict) -> EntryContext:
        """This entry's context for the module `name` (whose layer at_layer(...) reads): in a heterogeneous config
        (transformers' per_layer_config: Step 3.5's sliding layers have their own head count), its expressions
        read the module's layer's config, `config.per_layer_config[i]` (cached in `views`); elsewhere the
        entry's config."""
        i = layer_index(name)
        layer = self._in_config(self.config)
        # not past the stack (a multi-token-prediction layer reads the config itself)
        if i is not None and getattr(self.config, "is_heterogeneous", False) and i < len(self.config.per_layer_config):
            key = (id(self.config), i)
            if key not in views:
                views[key] = self.config.per_layer_config[i]
            layer.config = views[key]
        layer.module = name
        return layer

    def layer_entry(self, name: str):
        """at_layer(name): the entry of the config's per-layer list `name` at this module's layer (`layer_index`,
        as `when_layer` reads it). Raises ConfigAttributeError where there is no such entry."""
        i = None if self.module is None else layer_index(self.module)
        if i is None:
            where = (f"{self.module} is in no stack of layers (no integer component in its name)" if self.module
                     else "this expression is read for no module")
            raise ConfigAttributeError(f"at_layer({name}) reads the entry of the module's layer, but {where}; "
                                       "use it on modules inside the stack (layers.*...)")
        values = self._in_config(self.stack_config).lookup(name)
        if not isinstance(values, (list, tuple)):
            raise ConfigAttributeError(f"at_layer({name}): the config's {name} is {values!r}, not a list with one "
                                       "entry per layer")
        if i >= len(values):
            raise ConfigAttributeError(f"at_layer({name}): {self.module} is layer {i}, but the config's {name} "
                                       f"lists {len(values)} layers")
        return values[i]

    def layer_contexts(self) -> list[EntryContext]:
        """This entry's context in each layer's own config of a heterogeneous config; none elsewhere."""
        if not getattr(self.config, "is_heterogeneous", False):
            return []
        return [self._in_config(layer_config) for layer_config in self.config.per_layer_config]

    def gives(self, name: str) -> bool:
        """Whether an expression here can read `name`."""
        try:
            self.lookup(name)
        except ConfigAttributeError:
            return False
        return True

    def _in_config(self, config) -> EntryContext:
        layer = copy.copy(self)
        layer.config = config
        return layer


def attribute_path(config, name: str):
    """The value at a dotted attribute path of a config (vision_config.image_size), or a ConfigAttributeError
    naming the part that is missing."""
    value = config
    parts = name.split(".")
    for k, part in enumerate(parts):
        if not hasattr(value, part):
            keys = set(value.to_dict()) if hasattr(value, "to_dict") else set()
            owner = type(config).__name__ + "".join("." + p for p in parts[:k])
            raise ConfigAttributeError(f"{owner} has no attribute {part!r}{did_you_mean(part, keys)}")
        value = getattr(value, part)
    return value


# A Param path not proven uneven: a tensor of 3 or more dims split along another dim than its first, as stacked
# experts [E, 2I, H] split along the intermediate width (grouped_mm's alignment, per-rank widths unproven).
STACKED_PARAM = ("a plain width of a Param entry's tensor of 3 or more dims split along another dim than the first "
                 "(grouped experts) that is not a multiple of 16 bytes")


class Planner:
    """Plans every entry of `loaded` on `model` at `tp_size`; see `build_plan`."""

    def __init__(self, model: nn.Module, loaded: MappingFile, tp_size: int, errors: list | None = None):
        self.model, self.loaded, self.tp_size, self.errors = model, loaded, tp_size, errors
        self.config = model.config
        self.base, self.prefix = base_prefix(model)
        self.modules = dict(self.base.named_modules())
        self.names = list(self.modules)
        self.owner: dict[str, int] = {}  # full tensor name -> index of the entry that splits it
        self.shards: list[ModuleShard] = []  # modules replaced (Column, Row, Norm; vocab_parallel)
        self.tensors: list[ParamLayout] = []  # bare tensors split in place (Param)
        self.updates: list[AttributeUpdate] = []
        self.reduces: list[str] = []  # modules whose output is summed over the ranks (Reduce)
        self.enters: list[str] = []  # modules whose output's gradient is summed over the ranks (Enter)
        self.layer_views: dict = {}  # (id(config), layer) -> config.per_layer_config[layer] (EntryContext.at_layer)
        self.inputs: list[InputSlice] = []
        self.routes: list[RouteSlice] = []
        self.seen_attr: dict[tuple[str, str], int] = {}
        self.applied: list[int] = []  # entries whose `when` matches this config
        self.uneven: list[str] = []  # tensors split by the uneven rule (engine.pieces), in planning order
        self.head_sections: list[tuple[int, int | None, int]] = []  # (heads, query_heads, entry) of every layout
        self.layouts: list[tuple[list, bool]] = []  # (sections, replicate) of every layout, for even_world_sizes
        # plain feature count -> what each rank holds of it, for per_rank(n) in Updates (None: laid out two ways)
        self.features: dict[int, tuple[int, ...] | None] = {}
        self.config_values: dict = {}  # (id(config object), attribute) -> the first Update setting it (shard copies
        # each config object once per rank, so the modules sharing it share its per-rank values)

    # -- driving ---------------------------------------------------------------------------------
    def fail(self, error: TpmapError) -> None:
        """Raise `error`, or record it and go on when collecting (tpmap lint)."""
        if self.errors is None:
            raise error
        self.errors.append(error)

    def plan_entries(self) -> None:
        kinds = {Column: self.linear, Row: self.linear, Update: self.update, Param: self.param,
                 Reduce: self.reduce, Enter: self.enter, Input: self.input, Norm: self.norm, Route: self.route}
        entries = list(enumerate(self.loaded.mapping.entries))  # Updates last: they read whether a split is uneven
        for i, entry in [e for e in entries if not isinstance(e[1], Update)] + [(None, None)] + [
                e for e in entries if isinstance(e[1], Update)]:
            if entry is None:  # every layout planned: may this mapping split unevenly, are the heads paired?
                try:
                    check_uneven_proven(self)
                    check_head_sections(self)
                    check_routes(self)
                except TpmapError as e:
                    self.fail(e)
                continue
            config = self.loaded.config_of("entries", i, self.config)  # a composed entry's sub-config
            if not entry_applies(entry, config, self.loaded.mapping.config_defaults,
                                 experts=self.loaded.experts):
                continue
            ctx = EntryContext(self.config, self.loaded, i, self.tp_size)
            try:
                if entry.when_layer and not self.any_layer(entry, ctx, config):
                    continue  # no layer of that kind in this config: not applied, as `when` (lint: when-never)
            except TpmapError as e:
                self.fail(e)
                continue
            self.applied.append(i)
            try:
                matched = self.match(entry, ctx)
                if entry.when_layer:  # a config without such layers has nothing to select, as `when` (lint: when-never)
                    matched = self.select_layers(entry, ctx, matched, config)
                for rel in matched:
                    before = len(self.errors) if self.errors is not None else 0
                    kinds[type(entry)](entry, ctx.at_layer(rel, self.layer_views), self.modules[rel], self.prefix + rel)
                    if self.errors is not None and len(self.errors) > before:
                        break  # the other modules of this entry would repeat the same problems
            except TpmapError as e:
                self.fail(e)
        self.applied.sort()

    def match(self, entry, ctx: EntryContext) -> list[str]:
        """The base model's modules (relative names) that the entry's pattern and classes match; none raises."""
        matched = match_entry(entry, self.modules)
        if not matched and entry.classes and match_modules(entry.module, self.names):
            found = sorted({type(self.modules[n]).__name__ for n in match_modules(entry.module, self.names)})
            raise ctx.error(PatternMatchError, f"pattern matches modules of class {', '.join(found)} only, "
                            f"none of classes {', '.join(entry.classes)}; valid choices: "
                            f"{', '.join(found)}", "classes", rule="pattern-no-match")
        if not matched:
            prefix = self.prefix
            raise ctx.error(PatternMatchError, f"pattern matches no module of {type(self.model).__name__} "
                            f"(relative to its base model{' ' + repr(prefix[:-1]) if prefix else ''})"
                            f"{suggest_module(entry.module, self.names)}", "module", rule="pattern-no-match")
        return matched

    def any_layer(self, entry, ctx: EntryContext, config) -> bool:
        try:
            return any_layer_selected(entry.when_layer, config, self.loaded.mapping.config_defaults)
        except ConfigAttributeError as e:
            raise ctx.error(ConfigAttributeError, str(e), "when_layer", rule="config-attribute") from None

    def select_layers(self, entry, ctx: EntryContext, matched: list[str], config) -> list[str]:
        """The matched modules of the layers `entry.when_layer` selects."""
        try:
            return [rel for rel in matched
                    if layer_selected(entry.when_layer, rel, config, self.loaded.mapping.config_defaults)]
        except ConfigAttributeError as e:
            raise ctx.error(ConfigAttributeError, str(e), "when_layer", rule="config-attribute") from None

    def claim(self, name: str, ctx: EntryContext) -> None:
        """Each tensor is split by one entry only."""
        if name in self.owner:
            j = self.owner[name]
            raise ctx.error(PatternMatchError, f"{name} is already claimed by {self.loaded.label(j)} "
                            f"({self.loaded.source.value(('entries', j, 'module'))}); each parameter may be "
                            "split by one entry only", "module", rule="double-match")
        self.owner[name] = ctx.index

    def layout(self, entry, dim_size: int, ctx: EntryContext, name: str, replicate: bool, uneven_ok: str = "",
               element_size: int = 0):
        """(pieces per rank, replicated) of a dimension of `dim_size` features laid out as `entry` says.

        A dimension the world size does not divide is split unevenly (`engine.pieces`) only where `uneven_ok`
        is "" (Column and Row, Norm, Param on bare tensors); elsewhere `uneven_ok` names the path, refused
        here. With `element_size` (stacked experts, `stacked_element_size`) plain sections are
        split in 16-byte units (`engine.pieces.aligned`), unevenly where the units do not divide: every rank's
        width stays aligned (and such a split is never refused: only sections without a unit are)."""
        def fail(message: str, key: tuple) -> TpmapError:
            return ctx.error(DivisibilityError, f"{name}: {message}", *key, rule="divisibility")

        def heads_key(k: int) -> tuple:
            return ("sections", k, "heads") if isinstance(entry.sections, list) else ("heads",)

        groups = None if entry.groups is None else ctx.eval(entry.groups, "groups")
        group_width = dim_size
        if groups is not None:
            if groups <= 0 or dim_size % groups:
                raise ctx.error(DivisibilityError, f"{name}: the split dim has {dim_size} features, not a multiple "
                                f"of {groups} groups", "groups", rule="fused-sections")
            group_width = dim_size // groups
        k = entry.sections if getattr(entry, "interleaved", False) else 1  # [a0 b0 a1 b1 ...]: feature j is k wide
        if k > 1 and dim_size % k:
            raise ctx.error(DivisibilityError, f"{name}: the split dim has {dim_size} features, not a multiple of "
                            f"its {k} interleaved sections", "sections", rule="fused-sections")
        sections = [(dim_size // k, None, None)] if k > 1 else self.sections(entry, group_width, ctx)
        if element_size:
            sections = [split.aligned(s, element_size) for s in sections]
        grouped = groups is not None and groups > 1
        uneven = [s for s in sections if split.uneven_at(s, self.tp_size, replicate)]
        # only plain sections without a unit are refused: heads are never a grouped matmul's split width
        if uneven_ok and not grouped and any(split.parts(s)[1] is None and split.parts(s)[3] == 1 for s in uneven):
            raise uneven_refused(ctx, name, uneven_ok, self.tp_size, sections, replicate)
        if grouped:
            pieces, replicated, unevenly = split.split_groups(groups, group_width, sections, self.tp_size,
                                                              replicate, fail, heads_key, allow_uneven=True)
            q = split.group_query_heads(groups, sections)
            # for even_world_sizes: the groups (and their query heads) split evenly, or not
            self.layouts.append(([(groups, groups)] if q is None else
                                 [(groups * q, groups * q), (groups, groups, groups * q)], replicate))
            if unevenly:  # per_rank(G) and per_rank(G * Q) read what each rank holds (a Row's q heads: no groups)
                self.uneven.append(name)
                if q is None:  # whole groups of another layout (split_groups refuses it with fewer groups than ranks)
                    counts = {groups: tuple(n for _, n in split.balanced(groups, self.tp_size))}
                else:
                    held_groups, held_query = split.uneven_group_counts(groups, q, self.tp_size)
                    counts = {groups * q: held_query} | ({groups: held_groups} if len(sections) > 1 else {})
                for n, held in counts.items():
                    self.features[n] = held if self.features.get(n, held) == held else None
            return pieces, replicated
        pieces, replicated = split.split_sections(sections, self.tp_size, replicate, fail, heads_key,
                                                  allow_uneven=True)
        if uneven:
            self.uneven.append(name)
        self.layouts.append((sections, replicate))
        self.head_sections += [(h, q, ctx.index) for _, h, q, _ in map(split.parts, sections) if h is not None]
        self.features.update(feature_counts(sections, pieces, self.features))
        return tuple(tuple((s * k, n * k) for s, n in p) for p in pieces), replicated  # feature j is k elements

    def sections(self, entry, dim_size: int, ctx: EntryContext) -> list[tuple[int, int | None, int | None]]:
        """Resolve the entry's blocks to (size, heads, query_heads) integers, the sizes summing to dim_size."""
        listed = isinstance(entry.sections, list)
        if isinstance(entry.sections, str):  # a count given as an expression (e.g. moe_num_experts)
            n = ctx.eval(entry.sections, "sections")
            if n < 1:
                raise ctx.error(DivisibilityError, f"sections evaluates to {n}; it must be at least 1", "sections",
                                rule="fused-sections")
            specs = [(None, entry.heads)] * n
            queries = [entry.query_heads] * n
        else:
            specs = entry.section_specs()
            queries = entry.query_specs()
        key = ("sections",) if entry.sections is not None else ()
        rule = "fused-sections" if len(specs) > 1 else "divisibility"
        reverse = getattr(entry, "reverse", True)

        def ev(value, k: int, field: str):
            return None if value is None else ctx.eval(value, *(("sections", k, field) if listed else (field,)))

        sizes = [ev(s, k, "size") for k, (s, _) in enumerate(specs)]
        heads = [ev(h, k, "heads") for k, (_, h) in enumerate(specs)]
        query = [ev(q, k, "query_heads") for k, q in enumerate(queries)]
        unsized = [i for i, s in enumerate(sizes) if s is None]
        if unsized:
            rest = dim_size - sum(s for s in sizes if s is not None)
            weights = {i: heads[i] or 1 for i in unsized}
            if rest <= 0 or rest % sum(weights.values()):
                raise ctx.error(DivisibilityError, f"the split dim has {dim_size} features; {rest} left for "
                                f"{len(unsized)} unsized sections weighted {list(weights.values())} does not divide"
                                + ("" if reverse else " (is reverse right?)" if len(specs) > 1 else ""),
                                *(key or ("heads",)), rule=rule)
            unit = rest // sum(weights.values())
            for i in unsized:
                sizes[i] = weights[i] * unit
        if sum(sizes) != dim_size:
            raise ctx.error(DivisibilityError, f"sections sum to {sum(sizes)} ({' + '.join(map(str, sizes))}) but "
                            f"the weight has {dim_size} features along the split dim"
                            + ("" if reverse else " (is reverse right?)"), *key, rule=rule)
        return list(zip(sizes, heads, query))

    # -- Column / Row ------------------------------------------------------------------------------
    def linear(self, entry, ctx: EntryContext, module: nn.Module, full: str) -> None:
        """A matrix split by output (Column) or input (Row) features; the module is replaced."""
        column = isinstance(entry, Column)
        dim, cls = split_dim(module, entry, ctx, full)
        for pname, _ in module.named_parameters(recurse=False):
            self.claim(f"{full}.{pname}", ctx)
        w = module.weight
        pieces, replicated = self.layout(entry, w.shape[dim], ctx, full, replicate=column)
        if replicated and column and entry.gather_output:
            raise ctx.error(DivisibilityError, f"{full}: gather_output cannot be combined with replicated heads "
                            f"at world size {self.tp_size}", "gather_output", rule="divisibility")
        weight = ParamLayout(name=f"{full}.weight", full_shape=tuple(w.shape), dim=dim, pieces=pieces,
                            replicated_heads=replicated)
        bias = None
        if getattr(module, "bias", None) is not None:
            b = module.bias
            bias = (ParamLayout(name=f"{full}.bias", full_shape=tuple(b.shape), dim=0, pieces=pieces,
                               replicated_heads=replicated) if column
                    else ParamLayout(name=f"{full}.bias", full_shape=tuple(b.shape), dim=None))
        self.shards.append(ModuleShard(name=full, style="column" if column else "row", module_class=cls,
                                       reverse=entry.reverse, gather_output=column and entry.gather_output,
                                       entry=ctx.index, weight=weight, bias=bias,
                                       copy_input=not column or entry.copy_input))

    # -- Update ------------------------------------------------------------------------------------
    def update(self, entry: Update, ctx: EntryContext, module: nn.Module, full: str) -> None:
        """Per-rank attribute values; a bad attribute is recorded and the others still checked."""
        ctx.uneven = bool(self.uneven)
        ctx.features = {n: held for n, held in self.features.items() if held is not None}
        for path, value_expr in entry.attributes.items():
            try:
                if self.uneven:
                    check_per_rank(value_expr, ctx, path, self.uneven, self.head_sections, self.layouts)
                update = attribute_update(module, full, path, value_expr, ctx, self.seen_attr)
                if update.via_config:
                    check_shared_config(resolve_attr(module, path)[0], update, ctx, self.config_values)
                self.updates.append(update)
            except TpmapError as e:
                self.fail(e)

    # -- Param -------------------------------------------------------------------------------------
    def param(self, entry: Param, ctx: EntryContext, module: nn.Module, full: str) -> None:
        """Bare parameters, buffers or ModuleLists of `module` split along `dim` (or kept partial).

        The entry's tensors are split alike: where one is a stacked-experts tensor split in aligned units
        (`stacked_element_size`), the others of the same width (its bias [E, 2I] beside [E, H, 2I]) take the
        same units, so every rank's bias matches its weight."""
        widths = aligned_widths(module, entry)
        for pname in entry.params:
            holder, tensor = _holder(module, pname)
            if holder is None:
                choices = [n for n, _ in module.named_parameters(recurse=False)]
                choices += [n for n, b in module.named_buffers(recurse=False) if b is not None]
                choices += [n for n, m in module.named_children() if isinstance(m, nn.ModuleList)]
                raise ctx.error(ModuleKindError, f"{full} ({type(module).__name__}) has no parameter, buffer or "
                                f"ModuleList {pname!r}{did_you_mean(pname, choices)}; it has: "
                                f"{', '.join(choices) or 'none'}", "params", rule="module-kind")
            name = f"{full}.{pname}"
            shape = (len(tensor),) if holder == "modules" else tuple(tensor.shape)
            self.claim(name, ctx)
            if entry.partial:
                if holder == "modules":
                    raise ctx.error(ModuleKindError, f"{name} is a ModuleList; partial is for tensors", "partial",
                                    rule="module-kind")
                self.tensors.append(ParamLayout(name=name, full_shape=shape, dim=None, partial=True, holder=holder))
                continue
            dim = entry.dim + len(shape) if entry.dim < 0 else entry.dim
            if not 0 <= dim < len(shape):
                raise ctx.error(ModuleKindError, f"{name} has shape {tuple(shape)}: dim {entry.dim} is out of range "
                                f"(0..{len(shape) - 1})", "dim", rule="module-kind")
            stacked = len(shape) >= 3 and dim != 0  # stacked experts [E, 2I, H] split inside each expert
            element_size = widths.get(shape[dim], 0) if holder == "parameter" else 0
            pieces, replicated = self.layout(entry, shape[dim], ctx, name,
                                             replicate=entry.replicate_heads,
                                             uneven_ok=STACKED_PARAM if stacked else "", element_size=element_size)
            self.tensors.append(ParamLayout(name=name, full_shape=shape, dim=dim, pieces=pieces,
                                           replicated_heads=replicated, holder=holder))

    # -- Reduce ------------------------------------------------------------------------------------
    def reduce(self, entry: Reduce, ctx: EntryContext, module: nn.Module, full: str) -> None:
        if full in self.reduces:
            raise ctx.error(PatternMatchError, f"{full} is already reduced by another entry", "module",
                            rule="double-match")
        self.reduces.append(full)

    # -- Enter -------------------------------------------------------------------------------------
    def enter(self, entry: Enter, ctx: EntryContext, module: nn.Module, full: str) -> None:
        if full in self.enters:
            raise ctx.error(PatternMatchError, f"{full} is already entered by another entry", "module",
                            rule="double-match")
        self.enters.append(full)

    # -- Input -------------------------------------------------------------------------------------
    def input(self, entry: Input, ctx: EntryContext, module: nn.Module, full: str) -> None:
        spec = input_slice(entry, ctx, module, full)
        if split.uneven_section(spec.heads, spec.heads, None, ctx.tp_size, True):
            self.uneven.append(f"{full}({entry.argument})")
        self.layouts.append(([(spec.heads, spec.heads)], True))
        self.inputs.append(spec)

    # -- Route -------------------------------------------------------------------------------------
    def route(self, entry: Route, ctx: EntryContext, module: nn.Module, full: str) -> None:
        """Whole experts per rank: the block each rank holds, by the plain heads rule on the expert count (the
        rule of the Param entry with ``heads: <E>`` that deals the stacked tensors), never replicated."""
        experts = ctx.eval(entry.count, "count")
        if experts < self.tp_size:
            raise ctx.error(DivisibilityError, f"{full}: {experts} experts cannot be dealt whole over world size "
                            f"{self.tp_size} (a rank would hold none, or two ranks the same expert and run its "
                            f"tokens twice); world sizes that work: 1..{experts}", "count", rule="expert-count")
        if experts % self.tp_size:
            self.uneven.append(f"{full}(experts)")
        held = []
        for r in range(self.tp_size):
            ids = expr.rank_heads(experts, self.tp_size, r)
            assert ids and ids == list(range(ids[0], ids[0] + len(ids))), (experts, self.tp_size, r, ids)
            held.append((ids[0], len(ids)))
        params = list(inspect.signature(module.forward).parameters)
        for key, name in (("index", entry.index), ("weights", entry.weights)):
            if name is not None and name not in params:
                raise ctx.error(ModuleKindError, f"{type(module).__name__}.forward has no argument {name!r}"
                                f"{did_you_mean(name, params)}; its arguments: {', '.join(params)}", key,
                                rule="module-kind")
        if any(r.module == full for r in self.routes):
            raise ctx.error(PatternMatchError, f"{full} is already routed by another entry", "module",
                            rule="double-match")
        self.routes.append(RouteSlice(
            module=full, index=entry.index, index_position=params.index(entry.index), weights=entry.weights,
            weights_position=-1 if entry.weights is None else params.index(entry.weights), experts=experts,
            held=tuple(held), entry=ctx.index))

    # -- Norm --------------------------------------------------------------------------------------
    def norm(self, entry: Norm, ctx: EntryContext, module: nn.Module, full: str) -> None:
        """A norm over split features: its weight (and bias) split like them, statistics all-reduced."""
        weight = getattr(module, "weight", None)
        own = [n for n, _ in module.named_parameters(recurse=False)]
        eps = next((getattr(module, a) for a in ("variance_epsilon", "eps", "epsilon")
                    if isinstance(getattr(module, a, None), float)), None)
        if entry.statistic == "l2" and not own and weight is None:  # nothing to split: only the statistic
            self.shards.append(l2_statistic_norm(entry, ctx, module, full, eps))
            return
        if not isinstance(weight, torch.Tensor) or weight.dim() != 1 or set(own) - {"weight", "bias"}:
            raise ctx.error(ModuleKindError, f"{full} ({type(module).__name__}) is not a norm with a 1-D weight "
                            "(+bias)", "module", rule="module-kind")
        if eps is None:
            raise ctx.error(ModuleKindError, f"{full} ({type(module).__name__}) has no float variance_epsilon/eps "
                            "attribute to read the epsilon from", "module", rule="module-kind")
        for pname in own:
            self.claim(f"{full}.{pname}", ctx)
        # uneven splits are exact: ShardedNorm divides the all-reduced sums by the full feature count
        pieces, replicated = self.layout(entry, weight.shape[0], ctx, full, replicate=True)
        if replicated and full not in self.uneven:  # even rule (vLLM's): refused as before uneven splits existed
            raise ctx.error(DivisibilityError, f"{full}: a Norm over replicated heads is not exact (a replicated "
                            f"head would count twice in the statistic); use a world size that divides the heads",
                            "heads", rule="divisibility")
        # uneven key/value heads held more than once: ShardedNorm counts each once (engine.shard.norm_copies)
        group_size = 0 if entry.group_size is None else ctx.eval(entry.group_size, "group_size")
        if entry.group_size is not None and (group_size <= 0 or weight.shape[0] % group_size):
            raise ctx.error(DivisibilityError, f"{full}: group_size {group_size} does not divide its "
                            f"{weight.shape[0]} features into whole groups", "group_size", rule="divisibility")
        w = ParamLayout(name=f"{full}.weight", full_shape=tuple(weight.shape), dim=0, pieces=pieces,
                        replicated_heads=replicated)
        b = (ParamLayout(name=f"{full}.bias", full_shape=tuple(module.bias.shape), dim=0, pieces=pieces,
                         replicated_heads=replicated) if "bias" in own else None)
        self.shards.append(ModuleShard(name=full, style="norm", module_class=type(module).__name__, reverse=False,
                                       gather_output=False, entry=ctx.index, weight=w, bias=b,
                                       statistic=entry.statistic, eps=eps, group_size=group_size,
                                       gate=entry.gate or ""))


def aligned_widths(module: nn.Module, entry) -> dict[int, int]:
    """{split width: element size} of the stacked-experts tensors (`stacked_element_size`) an entry names, so
    that its other tensors of the same width are split in the same aligned units."""
    out: dict[int, int] = {}
    for pname in [] if entry.partial else entry.params:
        holder, tensor = _holder(module, pname)
        if holder != "parameter":
            continue  # a missing name is reported by Planner.param; buffers and ModuleLists are never aligned
        dim = entry.dim + tensor.dim() if entry.dim < 0 else entry.dim
        size = stacked_element_size(tensor, holder, dim) if 0 <= dim < tensor.dim() else 0
        if size:
            out[tensor.shape[dim]] = max(size, out.get(tensor.shape[dim], 0))
    return out


def stacked_element_size(tensor, holder: str, dim: int) -> int:
    """The element size of a stacked-experts parameter (3 or more dims, split along another dim than the first:
    [E, 2I, H] along 2I), whose per-rank widths must keep transformers' grouped matmul strides 16-byte aligned
    (`engine.pieces.aligned`); 0 for any other tensor (no alignment)."""
    if holder != "parameter" or tensor.dim() < 3 or dim == 0:
        return 0
    return tensor.element_size()


def feature_counts(sections, pieces, known: dict) -> dict[int, tuple[int, ...] | None]:
    """{size: the count each rank holds} of the plain sections of one layout, for per_rank(size) in an Update;
    None for a size `known` holds laid out otherwise (per_rank of it would be ambiguous)."""
    out: dict[int, tuple[int, ...] | None] = {}
    offset = 0
    for size, heads, _, _ in map(split.parts, sections):
        if heads is None:
            held = tuple(sum(max(0, min(s + n, offset + size) - max(s, offset)) for s, n in p) for p in pieces)
            out[size] = held if known.get(size, held) == held and out.get(size, held) == held else None
        offset += size
    return out


def split_dim(module: nn.Module, entry, ctx: EntryContext, name: str) -> tuple[int, str]:
    """(weight dim holding the features this entry splits, short class name). Checks the module kind."""
    cls = type(module).__name__
    weight = getattr(module, "weight", None)
    extra = [n for n, _ in module.named_parameters() if n not in ("weight", "bias")]
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or extra or list(module.children()):
        raise ctx.error(ModuleKindError, f"module {name} ({cls}) is not a plain 2-D weight (+bias) module; "
                        "Column/Row shard nn.Linear, nn.Embedding or a weight stored [in, out] with reverse: "
                        "true (bare tensors: use a Param entry)", "module", rule="module-kind")
    column = isinstance(entry, Column)
    if isinstance(module, nn.Embedding):
        if entry.reverse:
            raise ctx.error(ModuleKindError, f"{name} is an nn.Embedding; remove reverse: true", "reverse",
                            rule="orientation")
        if not column:
            raise ctx.error(ModuleKindError, f"{name} is an nn.Embedding: only Column (split embedding_dim) "
                            "applies; a vocabulary split is the mapping's vocab-parallel feature", "kind",
                            rule="module-kind")
        return 1, cls
    if isinstance(module, nn.Linear):
        if entry.reverse:
            raise ctx.error(ModuleKindError, f"{name} is an nn.Linear, whose weight is [out, in]; remove "
                            "reverse: true", "reverse", rule="orientation")
        return (0 if column else 1), cls
    if not entry.reverse:
        raise ctx.error(ModuleKindError, f"{name} is a {cls}, not nn.Linear; if its weight is stored [in, out] "
                        "(as transformers' Conv1D) set reverse: true, otherwise it cannot be sharded by "
                        "Column/Row", "module", rule="orientation")
    return (1 if column else 0), cls


def attribute_update(module: nn.Module, full: str, path: str, value_expr, ctx: EntryContext,
                     seen_attr: dict[tuple[str, str], int]) -> AttributeUpdate:
    """One attribute of an Update entry: its value on every rank, checked against the full model's."""
    try:
        _, _, current = resolve_attr(module, path)
    except AttributeError:
        via_config = path.startswith("config.")
        owner = getattr(module, "config", None) if via_config else module
        attrs = [a for a in vars(owner) if not a.startswith("_")] if owner is not None else []
        if via_config:
            attrs = ["config." + a for a in attrs]
        raise ctx.error(ConfigAttributeError if via_config else ModuleKindError,
                        f"{full} ({type(module).__name__}) has no attribute {path!r}{did_you_mean(path, attrs)}",
                        "attributes", path,
                        rule="config-attribute" if via_config else "update-attribute") from None
    if (full, path) in seen_attr:
        raise ctx.error(PatternMatchError, f"{full}.{path} is already updated by entry "
                        f"{seen_attr[(full, path)]}", "attributes", path, rule="double-match")
    values = tuple(ctx.eval(value_expr, "attributes", path, tp_rank=r) for r in range(ctx.tp_size))
    if isinstance(current, int) and not isinstance(current, bool) and current >= 1:
        # a per-rank size is a positive part of the full one; anything else fails later, obscurely. Key/value
        # heads counted for a rank's query heads (per_rank(kv, q)) are the exception: at an uneven split a rank
        # holds a KV head once per run of its query heads, up to one per query head (40 query / 8 KV heads at
        # world size 3: 14 query heads read KV runs 5, 5, 4, so 14 local KV heads), so their bound is q.
        most = max([current] + [ctx.eval(args[1], "attributes", path)
                                for args in expr.per_rank_calls(value_expr) if len(args) == 2])
        bad = [(r, v) for r, v in enumerate(values) if not 1 <= v <= most]
        if bad:
            r, v = bad[0]
            raise ctx.error(DivisibilityError, f"{full}.{path} is {current} in the full model, but "
                            f"{value_expr!r} gives {v} on rank {r} at world size {ctx.tp_size}; a per-rank "
                            f"value must lie between 1 and {most}", "attributes", path, rule="divisibility")
    seen_attr[(full, path)] = ctx.index
    via_config = isinstance(resolve_attr(module, path)[0], PretrainedConfig)
    return AttributeUpdate(module=full, attribute=path, full_value=current, values=values, via_config=via_config,
                           entry=ctx.index)


def check_shared_config(owner, update: AttributeUpdate, ctx: EntryContext, seen: dict) -> None:
    """An Update through `config.` sets an attribute of a config object that several modules may share (every
    layer's attention holds the model's config): each rank gets one copy of that object, so all of them must be
    given the same values; per-layer values (at_layer(...)) belong on a module attribute."""
    attribute = update.attribute.rsplit(".", 1)[-1]
    first = seen.setdefault((id(owner), attribute), update)
    if first.values != update.values:
        raise ctx.error(PatternMatchError, f"{update.module}.{update.attribute} is {list(update.values)} per rank, "
                        f"but {first.module} shares that config object and sets it to {list(first.values)}: one "
                        "config object holds one value per rank; set a module attribute instead where the value "
                        "differs per layer", "attributes", update.attribute, rule="double-match")


def input_slice(entry: Input, ctx: EntryContext, module: nn.Module, full: str) -> InputSlice:
    """The heads of a forward argument that each rank keeps (an Input entry)."""
    params = list(inspect.signature(module.forward).parameters)
    if entry.argument not in params:
        raise ctx.error(ModuleKindError, f"{type(module).__name__}.forward has no argument "
                        f"{entry.argument!r}{did_you_mean(entry.argument, params)}; its arguments: "
                        f"{', '.join(params)}", "argument", rule="module-kind")
    heads = ctx.eval(entry.heads, "heads")

    def fail(message: str, key: tuple) -> TpmapError:
        return ctx.error(DivisibilityError, f"{full}({entry.argument}): {message}", "heads", rule="divisibility")

    # the same balanced rule as the query heads of the module's projections, so each rank keeps its own heads
    pieces, _ = split.split_sections([(heads, heads)], ctx.tp_size, True, fail, lambda k: ("heads",),
                                     allow_uneven=True)
    assert all(len(p) == 1 for p in pieces), ("a rank's heads of an Input are one contiguous run", pieces)
    return InputSlice(module=full, argument=entry.argument, position=params.index(entry.argument),
                      dim=entry.dim, heads=heads,
                      head_index=tuple(tuple(i for s, n in p for i in range(s, s + n)) for p in pieces),
                      flattened=entry.flattened, entry=ctx.index)


def even_world_sizes(sections, replicate: bool, up_to: int = 16) -> list[int]:
    """The world sizes up to `up_to` at which every section splits by the even rule."""
    return [w for w in range(1, up_to + 1) if not any(split.uneven_at(s, w, replicate) for s in sections)]


def uneven_refused(ctx: EntryContext, name: str, path: str, tp_size: int, sections, replicate: bool) -> TpmapError:
    """The error for a dimension that only an uneven split fits, on a path not proven uneven."""
    works = ", ".join(map(str, even_world_sizes(sections, replicate)))
    return ctx.error(UnevenSplitError, f"{name}: world size {tp_size} splits it unevenly, and uneven splits are "
                     f"not supported for {path} (only for Column, Row, Input and Norm entries and Param entries on "
                     f"bare tensors); world sizes that split it evenly: {works}", "module",
                     rule="divisibility")


def check_per_rank(text, ctx: EntryContext, path: str, uneven: list[str], head_sections, layouts) -> None:
    """At a world size that splits something unevenly, an Update value must be computed per rank: no
    ``tp_size`` / ``tp_rank`` (``x // tp_size`` is the even share, wrong on an uneven split), and every
    ``per_rank(n)`` names a head count the plan lays out plainly or the size of a section of plain features
    (split by the same balanced rule: an MLP width), every ``per_rank(kv, q)`` a count laid out as key/value
    heads of q query heads (`head_counts`). Raises UnevenSplitError saying how to rewrite."""
    where = f"{path}: {text!r}"
    if set(expr.names(text)) & set(expr.PER_RANK_NAMES):
        raise ctx.error(UnevenSplitError, f"{where} reads the world size, but at world size {ctx.tp_size} "
                        f"{uneven[0]} is split unevenly (ranks hold different counts): write the value per rank "
                        "with per_rank(heads) (e.g. num_attention_heads // tp_size -> per_rank(num_attention_heads), "
                        "hidden_size // tp_size -> per_rank(num_attention_heads) * head_dim), or use a world size "
                        "that divides it", "attributes", path, rule="divisibility")
    plain, kv = head_counts(head_sections, ctx.tp_size)
    plain = plain | set(ctx.features or ())  # feature counts the plan laid out (Planner.features)
    plain |= {size for sections, _ in layouts for size, heads, _, _ in map(split.parts, sections) if heads is None}
    for args in expr.per_rank_calls(text):
        values = tuple(ctx.eval(a, "attributes", path) for a in args)
        if len(values) == 1 and values[0] not in plain and values[0] in {k for k, _ in kv}:
            q = next(q for k, q in kv if k == values[0])
            raise ctx.error(UnevenSplitError, f"{where}: per_rank({args[0]}) counts {values[0]} key/value heads "
                            f"split unevenly after {q} query heads: write per_rank({args[0]}, <query heads>) "
                            f"(e.g. per_rank(num_key_value_heads, num_attention_heads))", "attributes", path,
                            rule="divisibility")
        if len(values) == 2 and values[0] == values[1]:  # as many KV heads as query heads: per_rank(n)
            values = values[:1]
        if (len(values) == 1 and values[0] not in plain) or (len(values) == 2 and values not in kv):
            counts = sorted(plain) + [f"{k} for {q}" for k, q in sorted(kv)]
            raise ctx.error(UnevenSplitError, f"{where}: per_rank({', '.join(args)}) = per_rank"
                            f"({', '.join(map(str, values))}) names no head count this plan lays out (its head "
                            f"counts: {', '.join(map(str, counts))}); at world size {ctx.tp_size}, which splits "
                            "unevenly, the value would not match the ranks' heads", "attributes", path,
                            rule="divisibility")


def head_counts(head_sections, tp_size: int) -> tuple[set[int], set[tuple[int, int]]]:
    """(plain head counts, (kv, query) pairs) of the head sections the plan laid out."""
    plain = {h for h, q, _ in head_sections if q is None or q == h}
    return plain, {(h, q) for h, q, _ in head_sections if q is not None and q != h}


def check_uneven_proven(planner: Planner) -> None:
    """An uneven split only for a mapping proven uneven (its `uneven: true`): a model's forward may read a
    per-rank size that no Update of an unproven mapping sets per rank."""
    if not planner.uneven or planner.loaded.mapping.uneven:
        return
    even = [w for w in range(1, 17) if not any(split.uneven_at(s, w, replicate)
                                                for sections, replicate in planner.layouts for s in sections)]
    raise UnevenSplitError(
        f"{planner.uneven[0]} would be split unevenly at world size {planner.tp_size} (ranks "
        f"holding different numbers of heads or features), and this mapping is not proven at uneven world "
        f"sizes (no `uneven: true`); world sizes that split this model evenly: "
        f"{', '.join(map(str, even)) or 'none up to 16'}", planner.loaded.source.value(("model_type",)), "divisibility")


def check_head_sections(planner: Planner) -> None:
    """At a world size that splits some heads unevenly, every head section is the same count of query heads
    or names it (query_heads): two plain counts (12 query and 4 key/value heads without query_heads) would be
    split independently, and a rank's query heads would not find their key/value heads. A model of several
    families of heads (a hybrid's attention and linear attention) names each family's own count as the query
    heads of its plain sections (``query_heads`` equal to ``heads``): each such count is split on its own, and one
    family (the attention's) may leave its count unnamed."""
    tp = planner.tp_size
    if not any(split.uneven_section(h, h, q, tp, True) for h, q, _ in planner.head_sections):
        return
    plain, kv = head_counts(planner.head_sections, tp)
    named = {q for _, q in kv} | {h for h, q, _ in planner.head_sections if q == h}  # declared query counts
    queries = plain | {q for _, q in kv}
    if len(queries) > 1 and len(plain - named) > 1:  # one family may go unnamed: the others name their counts
        unnamed = [(h, i) for h, q, i in planner.head_sections if q is None and h not in named]
        entry = next((i for h, i in unnamed if h != max(queries)), unnamed[0][1])
        ctx = EntryContext(planner.config, planner.loaded, entry, tp)
        raise ctx.error(UnevenSplitError, f"at world size {tp} the heads split unevenly, and the mapping lays out "
                        f"{len(queries)} head counts ({', '.join(map(str, sorted(queries)))}) each on its own: if "
                        "the smaller are key/value heads, add `query_heads: <query head count>` to their entries "
                        "(e.g. query_heads: num_attention_heads) so that each rank holds the key/value heads its "
                        "query heads read; a separate family of heads names its own count (query_heads equal to "
                        "heads); or use a world size that divides every head count", "heads", rule="divisibility")


def check_routes(planner: Planner) -> None:
    """A Route needs a Reduce on the same module: each rank's output is its experts' share of the sum."""
    for route in planner.routes:
        if route.module not in planner.reduces:
            ctx = EntryContext(planner.config, planner.loaded, route.entry, planner.tp_size)
            raise ctx.error(PatternMatchError, f"{route.module} is routed (Route) but not reduced: each rank's "
                            "output holds only its own experts' terms; add a Reduce entry on the same module",
                            "module", rule="route-reduce")


def l2_statistic_norm(entry: Norm, ctx: EntryContext, module: nn.Module, full: str,
                      eps: float | None) -> ModuleShard:
    """A Norm entry on an L2 norm without a weight: nothing to split, only its statistic summed."""
    if eps is None or list(module.children()):
        raise ctx.error(ModuleKindError, f"{full} ({type(module).__name__}) is not an L2 norm module: "
                        "no float eps / variance_epsilon, or it has submodules", "module", rule="module-kind")
    if entry.heads is not None or entry.sections is not None or entry.groups is not None:
        raise ctx.error(ModuleKindError, f"{full} ({type(module).__name__}) has no weight to lay out: "
                        "remove heads/sections/groups from this Norm entry", "module", rule="module-kind")
    return ModuleShard(name=full, style="norm", module_class=type(module).__name__, reverse=False,
                       gather_output=False, entry=ctx.index, weight=None, bias=None, statistic="l2", eps=eps)


def _holder(module: nn.Module, name: str) -> tuple[str | None, Any]:
    """('parameter' | 'buffer' | 'modules', the object) for a name directly on `module`, or (None, None)."""
    if name in module._parameters and module._parameters[name] is not None:
        return "parameter", module._parameters[name]
    if name in module._buffers and module._buffers[name] is not None:
        return "buffer", module._buffers[name]
    if isinstance(module._modules.get(name), nn.ModuleList):
        return "modules", module._modules[name]
    return None, None


def build_plan(model: nn.Module, loaded: MappingFile, tp_size: int, errors: list[TpmapError] | None = None) -> Plan:
    """Check the mapping against `model` and compute the plan for every rank. Reads no tensor data.

    A mapping that composes others (``compose``) is expanded over the model first (`composed`).
    Entries whose ``when`` does not match the model's config are skipped. Raises the first problem
    found. With an `errors` list, problems are appended to it instead and checking goes on with the
    next entry (one problem per entry, one per attribute of an Update), so `tpmap lint` reports them
    all; the returned plan then leaves the failed entries out.
    """
    loaded = composed(model, loaded, errors)
    for k, variant in enumerate(loaded.mapping.unsupported):
        config = loaded.config_of("unsupported", k, model.config)
        if config_matches(variant.when, config, loaded.mapping.config_defaults):
            e = UnsupportedConfigError(f"this {type(config).__name__} is a variant the mapping does not "
                                       f"support ({variant.when}): {variant.reason}",
                                       loaded.source.value(("unsupported", k, "when")), "unsupported")
            if errors is None:
                raise e
            errors.append(e)
            return Plan(model_type=loaded.mapping.model_type, tp_size=tp_size, base_prefix=base_prefix(model)[1],
                        modules=(), updates=(), source=loaded.source.path)
    p = Planner(model, loaded, tp_size, errors)
    p.plan_entries()
    for e in tie_errors(model, loaded, p.shards, p.tensors, p.owner):
        p.fail(e)
    grad_allreduce = []
    try:  # the whole-model features: vocab_parallel (its ModuleShards), grad_allreduce (parameter names)
        if loaded.mapping.vocab_parallel is not None:
            p.shards.extend(plan_vocab_parallel(model, loaded, tp_size, p.owner))
        grad_allreduce = plan_grad_allreduce(loaded, p.modules, p.prefix, p.owner)
    except TpmapError as e:
        p.fail(e)
    kept_whole = ((k.module, k.reason, len(match_modules(k.module, p.names))) for k in loaded.mapping.kept_whole)
    return Plan(model_type=loaded.mapping.model_type, tp_size=tp_size, base_prefix=p.prefix, modules=tuple(p.shards),
                updates=tuple(p.updates), source=loaded.source.path,
                grad_allreduce=tuple(dict.fromkeys(grad_allreduce)), tensors=tuple(p.tensors),
                reduces=tuple(p.reduces), inputs=tuple(p.inputs), routes=tuple(p.routes), enters=tuple(p.enters),
                kept_whole=tuple(k for k in kept_whole if k[2]), uneven=tuple(p.uneven),
                even_world_sizes=tuple(w for w in range(1, 17) if not any(
                    split.uneven_at(s, w, replicate) for sections, replicate in p.layouts for s in sections))
                if p.uneven else (),
                heads=tuple(sorted({h for h, q, _ in p.head_sections if q is None or q == h}, reverse=True)),
                refuse_sequence_parallel=loaded.mapping.refuse_sequence_parallel or "")


def check_expressions(config, loaded: MappingFile) -> list[TpmapError]:
    """Every config attribute that an expression of the mapping names, checked against `config`, for
    the entries that apply to `config` (their `when` matches).

    `build_plan` finds these only in entries whose pattern matches; `tpmap lint` checks them all.
    """
    out: list[TpmapError] = []
    for i, entry in enumerate(loaded.mapping.entries):
        ctx = EntryContext(config, loaded, i, 1)
        if not entry_applies(entry, ctx.config, loaded.mapping.config_defaults, experts=loaded.experts):
            continue
        # a heterogeneous config's per-layer attributes are read in each layer's config (EntryContext.at_layer):
        # a name every layer's config gives is fine
        layers = ctx.layer_contexts()
        for key, value in expression_keys(entry):
            for name in sorted(expr.names(value) - set(expr.PER_RANK_NAMES)):
                try:
                    ctx.lookup(name)
                except ConfigAttributeError as e:
                    if not (layers and all(layer.gives(name) for layer in layers)):
                        out.append(ctx.error(ConfigAttributeError, str(e), *key, rule="config-attribute"))
    return out
