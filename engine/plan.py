"""From a mapping and a model's structure to a plan: pure data, no tensor read or written.

The plan says, for every rank, which pieces of every sharded parameter it holds, which modules get
which parallel behaviour, and which attributes change to which per-rank values. Building it checks
everything (patterns match, parameters are claimed once, sizes divide, attributes exist); executing
it (`engine.shard`) then cannot fail on user input. The same pieces drive slicing a full tensor,
loading a rank's slice from a checkpoint, and gathering shards back into a full tensor.

Pieces: ``pieces[r]`` is a tuple of ``(start, length)`` ranges along ``dim`` of the full tensor; the
rank's local tensor is their concatenation, in order. A fused [q|k|v] weight at tp_size 2 with 4
heads of 8 gives rank 1 ``((16, 16), (48, 16), (80, 16))`` = [q_1 | k_1 | v_1].
"""
from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers import PretrainedConfig

from tpmap import expr
from tpmap.errors import (
    ConfigAttributeError,
    DivisibilityError,
    ModuleKindError,
    PatternMatchError,
    Position,
    TpmapError,
    did_you_mean,
)
from tpmap.loader import LoadedMapping
from tpmap.schema import Column, Update

Pieces = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class ParamShard:
    """How one parameter is spread over the ranks."""

    name: str  # full name in the model, e.g. transformer.h.0.attn.c_attn.weight
    full_shape: tuple[int, ...]
    dim: int | None  # the split dim; None: every rank holds the whole tensor
    pieces: tuple[Pieces, ...] = ()  # per rank, ranges along dim
    replicated_heads: bool = False  # some ranges are held by more than one rank (KV heads < tp_size)
    local_size: int | None = None  # padded length along dim on every rank (uneven vocabularies), else None
    aliases: tuple[str, ...] = ()  # other names of the same tensor (tied weights), re-pointed to the shard

    def local_shape(self, rank: int) -> tuple[int, ...]:
        if self.dim is None:
            return self.full_shape
        shape = list(self.full_shape)
        shape[self.dim] = self.local_size or sum(n for _, n in self.pieces[rank])
        return tuple(shape)

    def indices(self, rank: int) -> list[int]:
        """Full-tensor indices along dim held by `rank`, in local order."""
        return [i for start, n in self.pieces[rank] for i in range(start, start + n)]


@dataclass(frozen=True)
class ModuleShard:
    """A module replaced by its parallel counterpart."""

    name: str  # full module name
    style: str  # "column" | "row" | "vocab_embedding" | "vocab_head"
    module_class: str
    reverse: bool
    gather_output: bool
    entry: int  # index of the mapping entry (for messages); -1 for vocab_parallel
    weight: ParamShard
    bias: ParamShard | None


@dataclass(frozen=True)
class AttributeUpdate:
    module: str  # full module name
    attribute: str  # dotted path on the module; through `config` when via_config
    full_value: Any
    values: tuple[int, ...]  # per rank
    via_config: bool
    entry: int


@dataclass(frozen=True)
class Plan:
    model_type: str
    tp_size: int
    base_prefix: str  # "transformer." etc.: patterns are relative to this
    modules: tuple[ModuleShard, ...]
    updates: tuple[AttributeUpdate, ...]
    source: str = ""  # mapping file
    grad_allreduce: tuple[str, ...] = ()  # replicated parameters whose gradients are summed over ranks

    @property
    def params(self) -> dict[str, ParamShard]:
        out = {}
        for m in self.modules:
            out[m.weight.name] = m.weight
            if m.bias is not None:
                out[m.bias.name] = m.bias
        return out

    def table(self, rank: int | None = None) -> str:
        """A plain-text table of the plan (all ranks' pieces when rank is None)."""
        rows = [("parameter", "style", "full shape", "dim", "local shape", "pieces (start:len) per rank")]
        for m in self.modules:
            for p in (m.weight, m.bias):
                if p is None:
                    continue
                style = m.style + ("+gather" if m.gather_output else "") + (" rev" if m.reverse else "")
                if p.dim is None:
                    rows.append((p.name, style, _shape(p.full_shape), "-", _shape(p.full_shape), "replicated"))
                    continue
                ranks = range(self.tp_size) if rank is None else [rank]
                pieces = " | ".join(
                    f"r{r}:" + ",".join(f"{s}:{n}" for s, n in p.pieces[r]) for r in ranks
                )
                if p.local_size:
                    pieces += f" (padded to {p.local_size})"
                rows.append((p.name, style, _shape(p.full_shape), str(p.dim), _shape(p.local_shape(0)), pieces))
        for u in self.updates:
            vals = sorted(set(u.values))
            rows.append((f"{u.module}.{u.attribute}", "update", str(u.full_value), "-",
                         ",".join(map(str, vals)), "per-config-copy" if u.via_config else ""))
        for name in self.grad_allreduce:
            rows.append((name, "replicated", "", "-", "", "gradient all-reduced"))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        return "\n".join(lines)


def _shape(s) -> str:
    return "(" + ", ".join(map(str, s)) + ")"


def match(pattern: str, names) -> list[str]:
    """Module names matching `pattern`: a shell glob per dotted component, same number of components."""
    parts = pattern.split(".")
    return [
        n for n in names
        if n and len(n.split(".")) == len(parts) and all(fnmatch.fnmatchcase(a, p) for a, p in zip(n.split("."), parts))
    ]


def _suggest(pattern: str, names) -> str:
    """A close real module name, with layer numbers turned back into '*'."""
    generic = sorted({re.sub(r"(?<=\.)\d+(?=\.|$)|^\d+(?=\.)", "*", n) for n in names if n})
    close = did_you_mean(pattern, generic)
    return close or (f"; modules look like {generic[min(len(generic) - 1, 5)]!r}" if generic else "")


def base_prefix(model: nn.Module) -> tuple[nn.Module, str]:
    base = getattr(model, "base_model", model)
    if base is model:
        return model, ""
    for name, mod in model.named_modules():
        if mod is base:
            return base, name + "."
    raise AssertionError("model.base_model is not a submodule of the model")


# The `tpmap lint` rule id of each error kind raised while evaluating an expression.
_EVAL_RULES = {ConfigAttributeError: "config-attribute", DivisibilityError: "divisibility"}


class _Ctx:
    """Evaluation context for one entry: names its position (and lint rule) in every error it raises."""

    def __init__(self, config: PretrainedConfig, loaded: LoadedMapping, index: int, tp_size: int):
        self.config, self.loaded, self.index, self.tp_size = config, loaded, index, tp_size
        self.entry = loaded.mapping.entries[index]

    def pos(self, *key) -> Position:
        return self.loaded.source.value(("entries", self.index) + key)

    def lookup(self, name: str) -> int:
        if not hasattr(self.config, name):
            keys = set(self.config.to_dict()) | set(getattr(self.config, "attribute_map", {}))
            raise ConfigAttributeError(
                f"the {type(self.config).__name__} has no attribute {name!r}{did_you_mean(name, keys)}"
            )
        return getattr(self.config, name)

    def eval(self, text, *key, tp_rank: int = 0) -> int:
        try:
            return expr.evaluate(text, self.lookup, self.tp_size, tp_rank)
        except TpmapError as e:
            raise self.error(type(e), str(e), *key, rule=_EVAL_RULES.get(type(e), "config-attribute")) from None

    def error(self, cls, message: str, *key, rule: str) -> TpmapError:
        e = self.entry
        text = f"entry {self.index} ({e.kind} {e.module!r}): {message}"
        err = cls(f"{self.pos(*key)}: {text}")
        err.position, err.rule, err.message = self.pos(*key), rule, text
        return err


def _split_dim(module: nn.Module, entry, ctx: _Ctx, name: str) -> tuple[int, str]:
    """(weight dim holding the features this entry splits, short class name). Checks the module kind."""
    cls = type(module).__name__
    weight = getattr(module, "weight", None)
    extra = [n for n, _ in module.named_parameters() if n not in ("weight", "bias")]
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or extra or list(module.children()):
        raise ctx.error(ModuleKindError, f"module {name} ({cls}) is not a plain 2-D weight (+bias) module; "
                        "Column/Row shard nn.Linear, nn.Embedding or a weight stored [in, out] with reverse: true",
                        "module", rule="module-kind")
    column = isinstance(entry, Column)
    if isinstance(module, nn.Embedding):
        if entry.reverse:
            raise ctx.error(ModuleKindError, f"{name} is an nn.Embedding; remove reverse: true", "reverse",
                            rule="orientation")
        if not column:
            raise ctx.error(ModuleKindError, f"{name} is an nn.Embedding: only Column (split embedding_dim) applies; "
                            "a vocabulary split is the mapping's vocab-parallel feature", "kind", rule="module-kind")
        return 1, cls
    if isinstance(module, nn.Linear):
        if entry.reverse:
            raise ctx.error(ModuleKindError, f"{name} is an nn.Linear, whose weight is [out, in]; remove reverse: true",
                            "reverse", rule="orientation")
        return (0 if column else 1), cls
    if not entry.reverse:
        raise ctx.error(ModuleKindError, f"{name} is a {cls}, not nn.Linear; if its weight is stored [in, out] "
                        "(as transformers' Conv1D) set reverse: true, otherwise it cannot be sharded by Column/Row",
                        "module", rule="orientation")
    return (1 if column else 0), cls


def expression_keys(entry) -> list[tuple[tuple, Any]]:
    """(key path inside the entry, expression) for every expression an entry holds, in file order."""
    if isinstance(entry, Update):
        return [(("attributes", path), value) for path, value in entry.attributes.items()]
    out: list[tuple[tuple, Any]] = []
    if entry.heads is not None:
        out.append((("heads",), entry.heads))
    if isinstance(entry.sections, list):
        for k, sec in enumerate(entry.sections):
            out += [(("sections", k, f), v) for f, v in (("size", sec.size), ("heads", sec.heads)) if v is not None]
    return out


def _sections(entry, dim_size: int, ctx: _Ctx) -> list[tuple[int, int | None]]:
    """Resolve the entry's blocks to (size, heads) integers summing to dim_size."""
    specs = entry.section_specs()
    listed = isinstance(entry.sections, list)
    key = ("sections",) if entry.sections is not None else ()
    rule = "fused-sections" if len(specs) > 1 else "divisibility"

    def ev(value, k: int, name: str):
        return None if value is None else ctx.eval(value, *(("sections", k, name) if listed else (name,)))

    sizes = [ev(s, k, "size") for k, (s, _) in enumerate(specs)]
    heads = [ev(h, k, "heads") for k, (_, h) in enumerate(specs)]
    unsized = [i for i, s in enumerate(sizes) if s is None]
    if unsized:
        rest = dim_size - sum(s for s in sizes if s is not None)
        weights = {i: heads[i] or 1 for i in unsized}
        if rest <= 0 or rest % sum(weights.values()):
            raise ctx.error(DivisibilityError, f"the split dim has {dim_size} features; {rest} left for "
                            f"{len(unsized)} unsized sections weighted {list(weights.values())} does not divide"
                            + ("" if entry.reverse else " (is reverse right?)" if len(specs) > 1 else ""),
                            *(key or ("heads",)), rule=rule)
        unit = rest // sum(weights.values())
        for i in unsized:
            sizes[i] = weights[i] * unit
    if sum(sizes) != dim_size:
        raise ctx.error(DivisibilityError, f"sections sum to {sum(sizes)} ({' + '.join(map(str, sizes))}) but the "
                        f"weight has {dim_size} features along the split dim"
                        + (" (is reverse right?)" if not entry.reverse else ""), *key, rule=rule)
    return list(zip(sizes, heads))


def _heads_key(ctx: _Ctx, k: int) -> tuple:
    """Where the heads of section k are written: in the section when listed, else the entry's `heads`."""
    return ("sections", k, "heads") if isinstance(ctx.entry.sections, list) else ("heads",)


def _pieces(sections, tp_size: int, column: bool, ctx: _Ctx, name: str) -> tuple[tuple[Pieces, ...], bool]:
    per_rank: list[list[tuple[int, int]]] = [[] for _ in range(tp_size)]
    replicated = False
    offset = 0
    for k, (size, heads) in enumerate(sections):
        if heads is not None:
            if heads <= 0 or size % heads:
                raise ctx.error(DivisibilityError, f"{name}: a section of {size} features cannot hold {heads} heads",
                                *_heads_key(ctx, k), rule="divisibility")
            head = size // heads
            if heads % tp_size == 0:
                n = heads // tp_size
                for r in range(tp_size):
                    per_rank[r].append((offset + r * n * head, n * head))
            elif column and tp_size % heads == 0:
                replicated = True
                for r in range(tp_size):  # vLLM's rule: rank r uses head r // (tp_size / heads)
                    per_rank[r].append((offset + (r // (tp_size // heads)) * head, head))
            else:
                why = "neither divides the other" if column else "a Row input cannot be replicated"
                raise ctx.error(DivisibilityError, f"{name}: {heads} heads cannot be split over world size "
                                f"{tp_size} ({why}); use a world size that divides {heads}",
                                *_heads_key(ctx, k), rule="divisibility")
        else:
            if size % tp_size:
                raise ctx.error(DivisibilityError, f"{name}: {size} features cannot be split over world size {tp_size}",
                                "module", rule="divisibility")
            n = size // tp_size
            for r in range(tp_size):
                per_rank[r].append((offset + r * n, n))
        offset += size
    merged = []
    for ranges in per_rank:
        out: list[tuple[int, int]] = []
        for s, n in ranges:
            if out and out[-1][0] + out[-1][1] == s:
                out[-1] = (out[-1][0], out[-1][1] + n)
            else:
                out.append((s, n))
        merged.append(tuple(out))
    return tuple(merged), replicated


def _resolve_attr(module: nn.Module, path: str):
    """(owner object, last name, value) for a dotted attribute path, or raise AttributeError."""
    obj = module
    parts = path.split(".")
    for p in parts[:-1]:
        obj = getattr(obj, p)
    return obj, parts[-1], getattr(obj, parts[-1])


def build(model: nn.Module, loaded: LoadedMapping, tp_size: int, errors: list[TpmapError] | None = None) -> Plan:
    """Check the mapping against `model` and compute the plan for every rank. Reads no tensor data.

    Raises the first problem found. With an `errors` list, problems are appended to it instead and
    checking goes on with the next entry (one problem per entry, one per attribute of an Update), so
    `tpmap lint` reports them all; the returned plan then leaves the failed entries out.
    """
    mapping = loaded.mapping
    config = model.config
    base, prefix = base_prefix(model)
    modules = dict(base.named_modules())
    names = list(modules)
    owner: dict[str, int] = {}  # full param name -> entry index
    shards: list[ModuleShard] = []
    updates: list[AttributeUpdate] = []
    seen_attr: dict[tuple[str, str], int] = {}

    for i, entry in enumerate(mapping.entries):
        ctx = _Ctx(config, loaded, i, tp_size)
        try:
            _entry(entry, ctx, modules, names, prefix, model, owner, shards, updates, seen_attr, errors)
        except TpmapError as e:
            if errors is None:
                raise
            errors.append(e)
    _check_ties(model, {p for m in shards for p in (m.weight.name, m.bias and m.bias.name) if p}, owner, loaded,
                errors)
    grad_allreduce = []
    try:
        grad_allreduce = _whole_model_features(model, loaded, tp_size, owner, shards, names, modules, prefix)
    except TpmapError as e:
        if errors is None:
            raise
        errors.append(e)
    return Plan(mapping.model_type, tp_size, prefix, tuple(shards), tuple(updates), loaded.source.path,
                tuple(dict.fromkeys(grad_allreduce)))


def _located(cls, position: Position, message: str, rule: str) -> TpmapError:
    """An error about a mapping line outside the entries (`path:line:col: message`, lint rule id)."""
    err = cls(f"{position}: {message}")
    err.position, err.rule, err.message = position, rule, message
    return err


def _whole_model_features(model, loaded, tp_size, owner, shards, names, modules, prefix):
    """vocab_parallel (appends its ModuleShards to `shards`) and grad_allreduce (returns parameter names)."""
    mapping = loaded.mapping
    if mapping.vocab_parallel is not None:
        shards.extend(_vocab_parallel(model, mapping.vocab_parallel, tp_size, owner, loaded))
    grad_allreduce = []
    for pattern in mapping.grad_allreduce:
        hits = match(pattern, names)
        if not hits:
            i = mapping.grad_allreduce.index(pattern)
            raise _located(PatternMatchError, loaded.source.value(("grad_allreduce", i)),
                           f"grad_allreduce pattern {pattern!r} matches no module{_suggest(pattern, names)}",
                           "pattern-no-match")
        for rel in hits:
            for pname, _ in modules[rel].named_parameters():
                full = f"{prefix}{rel}.{pname}"
                if full in owner:
                    raise _located(PatternMatchError, loaded.source.value(("grad_allreduce",)),
                                   f"{full} is sharded by entry {owner[full]}; grad_allreduce is for parameters "
                                   "kept whole", "double-match")
                grad_allreduce.append(full)
    return grad_allreduce


def vocab_pieces(vocab: int, tp_size: int) -> tuple[tuple[Pieces, ...], int]:
    """Megatron's padded vocabulary split: every rank holds ceil(V/ws) rows, the last ones padded."""
    per_rank = -(-vocab // tp_size)
    pieces = []
    for r in range(tp_size):
        start = min(r * per_rank, vocab)
        pieces.append(((start, min(per_rank, vocab - start)),))
    return tuple(pieces), per_rank


def _names_of(model: nn.Module) -> dict[int, list[str]]:
    """id(parameter) -> every name it has in the model (tied parameters have several)."""
    by_id: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    return by_id


def _vocab_parallel(model: nn.Module, spec, tp_size: int, owner: dict, loaded: LoadedMapping) -> list[ModuleShard]:
    """ModuleShards for the input embedding (and every nn.Embedding sharing its weight) and the LM head."""
    pos = loaded.source.value(("vocab_parallel",))
    by_id = _names_of(model)
    named = dict(model.named_modules())
    emb = model.get_input_embeddings() if spec.embedding else None
    head = model.get_output_embeddings() if spec.lm_head else None
    if spec.embedding and not isinstance(emb, nn.Embedding):
        raise _located(ModuleKindError, pos, f"vocab_parallel.embedding: {type(model).__name__}.get_input_embeddings() "
                       f"is {type(emb).__name__}, not an nn.Embedding; set embedding: false", "module-kind")
    if head is not None and not isinstance(head, nn.Linear):
        raise _located(ModuleKindError, pos, f"vocab_parallel.lm_head: the output embedding is a "
                       f"{type(head).__name__}, not an nn.Linear; set lm_head: false", "module-kind")
    # One half of a tied pair split alone would leave the other half holding the shard (a whole LM head
    # with a vocabulary slice for a weight: wrong-sized logits; a plain lookup into a slice: IndexError).
    # Every holder of a split weight must be a module this split replaces.
    replaced = {n for n, m in named.items()
                if m is head or (emb is not None and isinstance(m, nn.Embedding) and m.weight is emb.weight)}
    for module in (m for m in (emb, head) if m is not None):
        holders = {n.rpartition(".")[0] for n in by_id[id(module.weight)]}
        whole = sorted(holders - replaced)
        if whole:
            half, other = ("embedding", "lm_head") if module is emb else ("lm_head", "embedding")
            mine = next(n for n, m in named.items() if m is module)
            message = (f"vocab_parallel.{half} splits {mine}.weight along the vocabulary, but it is "
                       f"tied to {', '.join(n + '.weight' for n in whole)}, which stays whole"
                       + (f" (vocab_parallel.{other}: false)" if not getattr(spec, other) else "")
                       + f"; set both embedding and lm_head to true, or untie them (tie_word_embeddings: false)")
            raise _located(PatternMatchError, loaded.source.key(("vocab_parallel",)), message, "tied-parameter")
    vocab = emb.weight.shape[0] if emb is not None else (head.weight.shape[0] if head is not None else None)
    if vocab is None:
        return []
    pieces, per_rank = vocab_pieces(vocab, tp_size)
    shards = []

    def shard_of(param) -> ParamShard:
        names = by_id[id(param)]
        for n in names:
            if n in owner:
                raise _located(PatternMatchError, pos, f"{n} is in the vocabulary split and also claimed by entry "
                               f"{owner[n]}", "double-match")
        return ParamShard(names[0], tuple(param.shape), 0, pieces, False, per_rank, tuple(names[1:]))

    if emb is not None:
        from .layers import lookup_bypass  # the same rule the engine's class swap relies on

        weight = shard_of(emb.weight)
        for name, module in named.items():
            if isinstance(module, nn.Embedding) and module.weight is emb.weight:
                bypass = lookup_bypass(type(module))
                if bypass is not None:
                    raise _located(ModuleKindError, pos, f"vocab_parallel.embedding: {name} is a "
                                   f"{type(module).__name__} whose {bypass} does not call super().forward, so "
                                   "a vocabulary-split lookup cannot run under it (it would index the shard with "
                                   "full-vocabulary ids); set vocab_parallel.embedding: false to keep it whole "
                                   "(and lm_head: false if the LM head is tied to it)", "module-kind")
                shards.append(ModuleShard(name, "vocab_embedding", type(module).__name__, False, False, -1, weight, None))
    if head is not None:
        if head.weight.shape[0] != vocab:
            raise _located(ModuleKindError, pos, f"the LM head has {head.weight.shape[0]} rows but the embedding "
                           f"{vocab}; set lm_head: false", "module-kind")
        name = next(n for n, m in named.items() if m is head)
        weight = shard_of(head.weight)
        bias = shard_of(head.bias) if head.bias is not None else None
        shards.append(ModuleShard(name, "vocab_head", type(head).__name__, False, True, -1, weight, bias))
    return shards


def _entry(entry, ctx: _Ctx, modules, names, prefix, model, owner, shards, updates, seen_attr, errors) -> None:
    """Plan one entry on every module it matches; raises its first problem (Update: see `_updates`)."""
    i, loaded, tp_size = ctx.index, ctx.loaded, ctx.tp_size
    matched = match(entry.module, names)
    if not matched:
        raise ctx.error(PatternMatchError, f"pattern matches no module of {type(model).__name__} (relative to "
                        f"its base model{' ' + repr(prefix[:-1]) if prefix else ''}){_suggest(entry.module, names)}",
                        "module", rule="pattern-no-match")
    for rel in matched:
        module, full = modules[rel], prefix + rel
        if isinstance(entry, Update):
            before = len(errors) if errors is not None else 0
            updates.extend(_updates(module, full, entry, ctx, seen_attr, errors))
            if errors is not None and len(errors) > before:
                return  # the other modules of this entry would repeat the same problems
            continue
        column = isinstance(entry, Column)
        dim, cls = _split_dim(module, entry, ctx, full)
        for pname, _ in module.named_parameters(recurse=False):
            if f"{full}.{pname}" in owner:
                j = owner[f"{full}.{pname}"]
                raise ctx.error(PatternMatchError, f"parameter {full}.{pname} is already claimed by entry {j} "
                                f"({loaded.source.value(('entries', j, 'module'))}); each parameter may be "
                                "matched by one Column/Row entry only", "module", rule="double-match")
            owner[f"{full}.{pname}"] = i
        w = module.weight
        sections = _sections(entry, w.shape[dim], ctx)
        pieces, replicated = _pieces(sections, tp_size, column, ctx, full)
        if replicated and column and entry.gather_output:
            raise ctx.error(DivisibilityError, f"{full}: gather_output cannot be combined with replicated heads "
                            f"at world size {tp_size}", "gather_output", rule="divisibility")
        weight = ParamShard(f"{full}.weight", tuple(w.shape), dim, pieces, replicated)
        bias = None
        if getattr(module, "bias", None) is not None:
            b = module.bias
            bias = (ParamShard(f"{full}.bias", tuple(b.shape), 0, pieces, replicated) if column
                    else ParamShard(f"{full}.bias", tuple(b.shape), None))
        shards.append(ModuleShard(full, "column" if column else "row", cls, entry.reverse,
                                  column and entry.gather_output, i, weight, bias))


def _updates(module, full, entry: Update, ctx: _Ctx, seen, errors=None) -> list[AttributeUpdate]:
    """The updates of one module; with `errors`, a bad attribute is recorded and the others still checked."""
    out = []
    for path, value_expr in entry.attributes.items():
        try:
            out.append(_update(module, full, path, value_expr, ctx, seen))
        except TpmapError as e:
            if errors is None:
                raise
            errors.append(e)
    return out


def _update(module, full, path: str, value_expr, ctx: _Ctx, seen) -> AttributeUpdate:
    try:
        _, _, current = _resolve_attr(module, path)
    except AttributeError:
        via_config = path.startswith("config.")
        owner = getattr(module, "config", None) if via_config else module
        attrs = [a for a in vars(owner) if not a.startswith("_")] if owner is not None else []
        if via_config:
            attrs = ["config." + a for a in attrs]
        raise ctx.error(ConfigAttributeError if via_config else ModuleKindError,
                        f"{full} ({type(module).__name__}) has no attribute {path!r}{did_you_mean(path, attrs)}",
                        "attributes", path, rule="config-attribute" if via_config else "update-attribute") from None
    if (full, path) in seen:
        raise ctx.error(PatternMatchError, f"{full}.{path} is already updated by entry {seen[(full, path)]}",
                        "attributes", path, rule="double-match")
    values = tuple(ctx.eval(value_expr, "attributes", path, tp_rank=r) for r in range(ctx.tp_size))
    seen[(full, path)] = ctx.index
    via_config = isinstance(_resolve_attr(module, path)[0], PretrainedConfig)
    return AttributeUpdate(full, path, current, values, via_config, ctx.index)


def check_expressions(config: PretrainedConfig, loaded: LoadedMapping) -> list[TpmapError]:
    """Every config attribute that an expression of the mapping names, checked against `config`.

    `build` finds these only in entries whose pattern matches; `tpmap lint` checks them all.
    """
    out: list[TpmapError] = []
    for i, entry in enumerate(loaded.mapping.entries):
        ctx = _Ctx(config, loaded, i, 1)
        for key, value in expression_keys(entry):
            for name in sorted(expr.names(value) - set(expr.PER_RANK_NAMES)):
                try:
                    ctx.lookup(name)
                except ConfigAttributeError as e:
                    out.append(ctx.error(ConfigAttributeError, str(e), *key, rule="config-attribute"))
    return out


def _check_ties(model: nn.Module, sharded: set[str], owner: dict[str, int], loaded: LoadedMapping,
                errors: list[TpmapError] | None = None) -> None:
    """A sharded parameter must not also be used, tied, by a module that stays whole."""
    for names in _names_of(model).values():
        if len(names) > 1 and any(n in sharded for n in names) and not all(n in sharded for n in names):
            message = (f"parameter {names[0]} is tied to {', '.join(names[1:])}; shard all of them "
                       "with the same entry or none")
            entry = next(owner[n] for n in names if n in owner)
            position = loaded.source.value(("entries", entry, "module"))
            err = PatternMatchError(message)
            e = loaded.mapping.entries[entry]
            text = f"entry {entry} ({e.kind} {e.module!r}): {message}"
            err.position, err.rule, err.message = position, "tied-parameter", text
            if errors is None:
                raise err
            errors.append(err)
