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

from torch import nn

from tpmap import expr
from tpmap.errors import ConfigAttributeError, ModuleKindError, PatternMatchError, Position, TpmapError, did_you_mean
from tpmap.loader import LoadedMapping
from tpmap.schema import Update

from .pieces import Pieces, vocab_pieces  # noqa: F401  (vocab_pieces: re-exported for benchmarks/tests)




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
    partial: bool = False  # a term of a partial sum: rank 0 holds the tensor, the others zeros (Param partial)
    holder: str = "parameter"  # "parameter" | "buffer" | "modules" (a ModuleList cut by Param)

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
    style: str  # "column" | "row" | "norm" | "vocab_embedding" | "vocab_head"
    module_class: str
    reverse: bool
    gather_output: bool
    entry: int  # index of the mapping entry (for messages); -1 for vocab_parallel
    weight: ParamShard
    bias: ParamShard | None
    copy_input: bool = True  # Column: all-reduce the input's gradient (False after an Enter)
    statistic: str = ""  # Norm: "rms" | "layer"
    eps: float = 0.0  # Norm: the module's epsilon


@dataclass(frozen=True)
class AttributeUpdate:
    module: str  # full module name
    attribute: str  # dotted path on the module; through `config` when via_config
    full_value: Any
    values: tuple[int, ...]  # per rank
    via_config: bool
    entry: int


@dataclass(frozen=True)
class InputSlice:
    """A forward argument of a module sliced by heads before the module runs (Input entry)."""

    module: str  # full module name
    argument: str
    position: int  # index of the argument in forward's signature (for positional calls)
    dim: int
    heads: int  # heads along dim in the full tensor
    head_index: tuple[tuple[int, ...], ...]  # per rank: the heads it keeps
    flattened: bool  # dim holds batch x heads (batch-major)
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
    tensors: tuple[ParamShard, ...] = ()  # bare tensors split in place (Param entries)
    reduces: tuple[str, ...] = ()  # modules whose output is all-reduced (Reduce entries)
    inputs: tuple[InputSlice, ...] = ()  # forward arguments sliced by heads (Input entries)
    enters: tuple[str, ...] = ()  # modules whose output's gradient is all-reduced (Enter entries)
    kept_whole: tuple[tuple[str, str, int], ...] = ()  # (pattern, reason, modules matched): a partial mapping

    @property
    def params(self) -> dict[str, ParamShard]:
        """Every split tensor by full name: module weights/biases and Param tensors (not ModuleLists)."""
        out = {}
        for m in self.modules:
            out[m.weight.name] = m.weight
            if m.bias is not None:
                out[m.bias.name] = m.bias
        for t in self.tensors:
            if t.holder != "modules":
                out[t.name] = t
        return out

    def table(self, rank: int | None = None) -> str:
        """A plain-text table of the plan (all ranks' pieces when rank is None)."""
        rows = [("parameter", "style", "full shape", "dim", "local shape", "pieces (start:len) per rank")]
        for m in self.modules:
            for p in (m.weight, m.bias):
                if p is None:
                    continue
                style = m.style + ("+gather" if m.gather_output else "") + (" rev" if m.reverse else "") + (
                    f" {m.statistic}" if m.statistic else "")
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
        for t in self.tensors:
            ranks = range(self.tp_size) if rank is None else [rank]
            if t.partial:
                rows.append((t.name, "param partial", _shape(t.full_shape), "-", _shape(t.full_shape), "rank 0; zeros elsewhere"))
                continue
            pieces = " | ".join(f"r{r}:" + ",".join(f"{s}:{n}" for s, n in t.pieces[r]) for r in ranks)
            rows.append((t.name, f"param {t.holder}", _shape(t.full_shape), str(t.dim), _shape(t.local_shape(0)), pieces))
        for name in self.reduces:
            rows.append((name, "reduce", "", "-", "", "output all-reduced"))
        for name in self.enters:
            rows.append((name, "enter", "", "-", "", "output gradient all-reduced"))
        for i in self.inputs:
            heads = " | ".join(f"r{r}:{h[0]}..{h[-1]}" for r, h in enumerate(i.head_index))
            rows.append((f"{i.module}({i.argument})", "input", f"{i.heads} heads", str(i.dim), "", heads))
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


def match_entry(entry, modules: dict) -> list[str]:
    """The modules an entry applies to: its pattern's matches, kept to its `classes` when it names any."""
    matched = match(entry.module, modules)
    if entry.classes:
        matched = [n for n in matched if type(modules[n]).__name__ in entry.classes]
    return matched


def suggest(pattern: str, names) -> str:
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


def expression_keys(entry) -> list[tuple[tuple, Any]]:
    """(key path inside the entry, expression) for every expression an entry holds, in file order."""
    if isinstance(entry, Update):
        return [(("attributes", path), value) for path, value in entry.attributes.items()]
    out: list[tuple[tuple, Any]] = []
    for key in ("heads", "groups"):
        if getattr(entry, key, None) is not None:
            out.append(((key,), getattr(entry, key)))
    sections = getattr(entry, "sections", None)
    if isinstance(sections, str):
        out.append((("sections",), sections))
    if isinstance(sections, list):
        for k, sec in enumerate(sections):
            out += [(("sections", k, f), v) for f, v in (("size", sec.size), ("heads", sec.heads)) if v is not None]
    return out


def resolve_attr(module: nn.Module, path: str):
    """(owner object, last name, value) for a dotted attribute path, or raise AttributeError."""
    obj = module
    parts = path.split(".")
    for p in parts[:-1]:
        obj = getattr(obj, p)
    return obj, parts[-1], getattr(obj, parts[-1])


def build(model: nn.Module, loaded: LoadedMapping, tp_size: int, errors: list[TpmapError] | None = None) -> Plan:
    """Check the mapping against `model` and compute the plan for every rank. Reads no tensor data.

    Entries whose ``when`` does not match the model's config are skipped. Raises the first problem
    found. With an `errors` list, problems are appended to it instead and checking goes on with the
    next entry (one problem per entry, one per attribute of an Update), so `tpmap lint` reports them
    all; the returned plan then leaves the failed entries out.
    """
    from tpmap.errors import UnsupportedConfigError
    from tpmap.schema import config_matches

    from .planner import Planner

    for k, variant in enumerate(loaded.mapping.unsupported):
        if config_matches(variant.when, model.config):
            e = _located(UnsupportedConfigError, loaded.source.value(("unsupported", k, "when")),
                         f"this {type(model.config).__name__} is a variant the mapping does not support "
                         f"({variant.when}): {variant.reason}", "unsupported")
            if errors is None:
                raise e
            errors.append(e)
            return Plan(loaded.mapping.model_type, tp_size, base_prefix(model)[1], (), (), loaded.source.path)
    p = Planner(model, loaded, tp_size, errors)
    p.plan_entries()
    sharded = {t for m in p.shards for t in (m.weight.name, m.bias and m.bias.name) if t}
    sharded |= {t.name for t in p.tensors}
    _check_ties(model, sharded, p.owner, loaded, errors)
    grad_allreduce = []
    try:
        grad_allreduce = _whole_model_features(model, loaded, tp_size, p.owner, p.shards, p.names, p.modules,
                                               p.prefix)
    except TpmapError as e:
        p.fail(e)
    kept_whole = tuple((k.module, k.reason, len(match(k.module, p.names))) for k in loaded.mapping.kept_whole)
    return Plan(loaded.mapping.model_type, tp_size, p.prefix, tuple(p.shards), tuple(p.updates), loaded.source.path,
                tuple(dict.fromkeys(grad_allreduce)), tuple(p.tensors), tuple(p.reduces), tuple(p.inputs), tuple(p.enters),
                tuple(k for k in kept_whole if k[2]))


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
                           f"grad_allreduce pattern {pattern!r} matches no module{suggest(pattern, names)}",
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


def check_expressions(config, loaded: LoadedMapping) -> list[TpmapError]:
    """Every config attribute that an expression of the mapping names, checked against `config`, for
    the entries that apply to `config` (their `when` matches).

    `build` finds these only in entries whose pattern matches; `tpmap lint` checks them all.
    """
    from tpmap.schema import config_matches

    from .planner import EntryContext

    out: list[TpmapError] = []
    for i, entry in enumerate(loaded.mapping.entries):
        if not config_matches(entry.when, config):
            continue
        ctx = EntryContext(config, loaded, i, 1)
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
