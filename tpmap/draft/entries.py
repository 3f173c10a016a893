"""Steps 4 to 6 of a draft: entries from the analysis or the config's base_model_tp_plan, per-rank Updates,
vocab_parallel and the world sizes the planner accepts."""
from __future__ import annotations

import inspect
import re
from dataclasses import dataclass, field
from typing import Any

from torch import nn
from transformers.pytorch_utils import Conv1D

from tpmap.draft.analysis import (
    Block,
    Group,
    Keys,
    Weight,
    analyse_block,
    attention_role,
    block_weights,
    find_key,
)
from tpmap.draft.names import PER_HEAD_ATTRIBUTE, PLAN_COLUMN, PLAN_ROW, SIZE_ATTRIBUTE
from tpmap.engine import planner
from tpmap.engine.planner import resolve_attr
from tpmap.language import expr
from tpmap.language.patterns import match_modules


@dataclass
class Entry:
    """One draft entry; `notes` become comment lines above it. kind "whole": a `replicated:` pattern."""
    kind: str
    module: str
    fields: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def reverse(w: Weight) -> dict:
    return {"reverse": True} if w.reverse else {}


def group_entries(block: Block, group: Group, keys: Keys, head_dim: int | None) -> list[Entry]:
    """Columns for the group's columns and a Row for its row, with heads/sections from shapes and names."""
    out = []
    for c in group.columns:
        fields, notes = (attention_column(c, group.row, keys, head_dim) if group.kind == "attention"
                         else mlp_column(c, group.row))
        out.append(Entry("Column", block.pattern(c.rel), fields | reverse(c), notes))
    row_fields = {"heads": keys.heads} if group.kind == "attention" and keys.heads else {}
    return out + [Entry("Row", block.pattern(group.row.rel), row_fields | reverse(group.row))]


def attention_column(c: Weight, row: Weight, keys: Keys, head_dim: int | None) -> tuple[dict, list[str]]:
    """heads / sections of a q, k, v or fused projection, from its width (the q width is the row's input)."""
    role, width, q = attention_role(c), c.fan_out, row.fan_in
    kv, heads = keys.value(keys.kv_heads), keys.value(keys.heads)
    head_dim = q // heads if heads and q % heads == 0 else head_dim  # the q width tells it best
    kv_width = kv * head_dim if kv and head_dim else None
    if not keys.heads:
        return {}, [f"TODO: no config key holds the head count; add heads: to split {c.leaf} on head boundaries"]
    if role == "q" or (role in ("k", "v") and width == q):
        return {"heads": keys.heads}, []
    if role in ("k", "v") and width == kv_width:
        return {"heads": keys.kv_heads}, []
    if role == "qkv" and width == 3 * q:
        return {"heads": keys.heads}, [
            f"TODO: {c.leaf} is 3 x the q width: fused q/k/v, a layout shapes cannot tell. This plain split on head "
            "boundaries is right for a head-major [heads, 3, head_dim] layout; for [q | k | v] blocks one after the "
            "other set combined_qkv: true. Read the attention forward; tpmap verify tells."]
    if role == "qkv" and kv_width and width == q + 2 * kv_width:
        return {"combined_qkv": True, "sections": [{"heads": keys.heads}, {"heads": keys.kv_heads},
                                                   {"heads": keys.kv_heads}]}, [
            f"TODO: {c.leaf} is q + 2 x kv wide: fused q/k/v with fewer KV heads, assumed [q | k | v] blocks; if it "
            "is grouped per KV head ([kv, q_per_kv + 2, head_dim]) use groups: instead. tpmap verify tells."]
    if role == "kv" and kv_width and width == 2 * kv_width:
        return {"sections": 2, "heads": keys.kv_heads}, [
            f"TODO: {c.leaf} is 2 x the kv width: fused [k | v] blocks assumed (sections: 2); if k and v alternate "
            "per head, drop sections. tpmap verify tells."]
    return {}, [f"TODO: {c.leaf} has {width} output features, neither the q width {q} nor a fused layout of "
                "it that the head counts explain; set heads/sections by hand"]


def mlp_column(c: Weight, row: Weight) -> tuple[dict, list[str]]:
    if c.fan_out == 2 * row.fan_in:
        return {"sections": 2}, [
            f"TODO: {c.leaf} is twice the input of {row.leaf}: fused [gate | up] halves assumed (sections: 2); if "
            "gate and up are interleaved this is wrong. tpmap verify tells."]
    return {}, []


def analysis_entries(blocks: list[Block], stream: int, config, names: list[str]
                     ) -> tuple[list[Entry], list[tuple[Block, Group]]]:
    """Entries from the module structure of every block (merged by pattern), and the groups found."""
    entries: dict[str, Entry] = {}
    groups: list[tuple[Block, Group]] = []
    for block in blocks:
        keys = Keys.of(config, block.list_name)
        heads, head_dim = keys.sizes(stream)
        analysis = analyse_block(block_weights(block.module), stream, heads, head_dim)
        found = []
        for group in analysis.groups:
            groups.append((block, group))
            found += group_entries(block, group, keys, head_dim)
        found += [Entry("Column", block.pattern(w.rel), {"heads": keys.heads} if keys.heads else {},
                        [f"{w.leaf}: an nn.Embedding of one value per head (a position bias), split by heads"])
                  for w in analysis.head_embeddings]
        found += [Entry("whole", block.pattern(w.rel), notes=[
            f"TODO: {w.leaf} ({type(w.module).__name__} {w.fan_in} -> {w.fan_out}) pairs with no Column/Row"])
            for w in analysis.whole]
        for entry in found:
            merge_entry(entries, entry)
    return collapse(list(entries.values()), names), groups


def outside_head_embeddings(base, blocks: list[Block], config) -> list[Entry]:
    """nn.Embeddings outside the blocks as wide as the head count (a position bias the encoder builds once
    for every block): Columns by heads, so that each rank gets its heads' bias."""
    inside = tuple(b.name + "." for b in blocks)
    keys = Keys.of(config, "")
    out = []
    for name, module in base.named_modules():
        if (isinstance(module, nn.Embedding) and not (name + ".").startswith(inside) and keys.heads
                and module.embedding_dim == keys.value(keys.heads) and module is not base.get_input_embeddings()):
            out.append(Entry("Column", name, {"heads": keys.heads},
                             [f"{name}: an nn.Embedding of one value per head (a position bias), split by heads"]))
    return out


def merge_entry(entries: dict[str, Entry], entry: Entry) -> None:
    """Blocks that agree give one entry; a pattern the blocks disagree on is kept whole, flagged."""
    seen = entries.get(entry.module)
    if seen is None:
        entries[entry.module] = entry
    elif (seen.kind, seen.fields) != (entry.kind, entry.fields) and seen.kind != "whole":
        entries[entry.module] = Entry("whole", entry.module, notes=[
            f"TODO: the blocks differ here ({seen.kind} in one, {entry.kind} in another): kept whole; split it "
            "per block variant (`when:`)"])


def collapse(entries: list[Entry], names: list[str]) -> list[Entry]:
    """Entries alike but for a numbered component below the block (experts.0.w1 and experts.1.w1;
    expert_0 and expert_1) become one with that component globbed (experts.*.w1), so that a config with
    more of them is covered too; only where the glob matches exactly the modules the entries matched."""

    def glob(pattern: str) -> str:
        head, _, rest = pattern.partition(".*")
        return head + ".*" + re.sub(r"(?<=[._])(\w*?)\d+(?=\.|$)", r"\1*", rest)

    keyed: dict[tuple, list[Entry]] = {}
    for e in entries:
        keyed.setdefault((glob(e.module), e.kind, repr(e.fields)), []).append(e)
    out = []
    for (pattern, _, _), alike in keyed.items():
        covered = {n for e in alike for n in match_modules(e.module, names)}
        if len(alike) > 1 and set(match_modules(pattern, names)) == covered:
            out.append(Entry(alike[0].kind, pattern, alike[0].fields, alike[0].notes))
        else:
            out += alike
    return out


# -- 4b. base_model_tp_plan -----------------------------------------------------------------------
def translate_plan(plan: dict[str, str], analysed: list[Entry], base) -> tuple[list[Entry], list[str], list[str]]:
    """(entries, grad_allreduce patterns, notes) from transformers' base_model_tp_plan: it says how the
    modules it names are split; the analysis adds heads, sections and reverse where it found the same
    kind. Analysed entries the plan does not touch stay as analysed (noted); those of a group the plan
    splits in part stay whole."""
    names = [n for n, _ in base.named_modules() if n]
    analysed_of = {n: e for e in analysed for n in match_modules(e.module, names)}
    entries, grad_allreduce, notes, decided = [], [], [], set()
    for key, style in plan.items():
        hits = match_modules(key, names)
        if not hits:
            notes.append(plan_miss(key, style, names))
        elif style in PLAN_COLUMN or style in PLAN_ROW:
            entries.append(plan_entry(key, style, analysed_of.get(hits[0]), base.get_submodule(hits[0])))
            decided.update(hits)
        elif style == "replicated_with_grad_allreduce":
            grad_allreduce.append(key)
        elif style == "rowwise_split_input":
            entries.append(Entry("whole", key, notes=[
                f"TODO: base_model_tp_plan: {style} (it takes the gathered output above it): kept whole. To split "
                "the pair, drop gather_output on its Columns, make this a Row and add the head-count Updates"]))
            decided.update(hits)
        elif style == "moe_tp_experts":
            notes.append(f"TODO: base_model_tp_plan: {key} is {style}: split its 3-D expert weights with Param "
                         "entries (gate_up [E, 2I, H]: dim 1, sections: 2; down [E, H, I]: dim 2) and sum the block "
                         "with a Reduce entry, as mappings/mixtral.yaml does; until then the experts stay whole")
        elif not style.startswith("embedding"):  # embedding_*: the vocabulary split is vocab_parallel
            notes.append(f"TODO: base_model_tp_plan: {key} is {style}, which has no direct tpmap kind "
                         "(see docs/mapping-schema.md, the long tail: Param, Reduce, Enter, Input, Norm); kept whole")
    untouched = {e.module for e in analysed if not any(n in decided for n in match_modules(e.module, names))}
    for e in analysed:
        if e.module in untouched and e.kind != "whole":
            e.notes = e.notes + ["not in base_model_tp_plan: from the module structure"]
    return entries + [e for e in analysed if e.module in untouched], grad_allreduce, notes


def plan_entry(key: str, style: str, analysed: Entry | None, module) -> Entry:
    """A Column or Row for a plan style; heads/sections (and their TODOs) from the analysis when it found
    the same kind and the style adds nothing of its own."""
    kind = "Column" if style in PLAN_COLUMN else "Row"
    fields = dict(PLAN_COLUMN.get(style) or PLAN_ROW.get(style) or {})
    notes = [] if style in ("colwise", "rowwise") else [f"base_model_tp_plan: {style}"]
    if analysed is not None and analysed.kind == kind and not fields:
        fields, notes = dict(analysed.fields), notes + analysed.notes
    if isinstance(module, Conv1D):
        fields["reverse"] = True
    return Entry(kind, key, fields, notes)


def plan_miss(key: str, style: str, names: list[str]) -> str:

    owner = key.rpartition(".")[0]
    if owner and match_modules(owner, names):
        return (f"TODO: base_model_tp_plan: {key} ({style}) is a bare tensor of {owner}: a Param entry splits it "
                "(with a Reduce on the module that sums it); kept whole")
    return f"base_model_tp_plan: {key} ({style}) matches no module of this config: skipped"


def groups_split(groups: list[tuple[Block, Group]], entries: list[Entry]) -> list[tuple[Block, Group]]:
    """The groups whose columns are all Columns without gather_output and whose row is a Row."""
    split = {e.module for e in entries if e.kind == "Row" or (e.kind == "Column" and not e.fields.get("gather_output"))}
    return [(b, g) for b, g in groups if all(b.pattern(w.rel) in split for w in g.columns + [g.row])]


# -- 5. updates -----------------------------------------------------------------------------------
def size_expressions(group: Group, keys: Keys, head_dim: int | None) -> dict[int, list[str]]:
    """value in the full model -> candidate per-rank expressions, for the sizes a split group divides."""
    if group.kind == "mlp":
        return {group.row.fan_in: width_expressions(group.row.fan_in, "intermediate", keys)}
    heads, kv = keys.value(keys.heads), keys.value(keys.kv_heads)
    if not heads:
        return {}
    out = {heads: [f"{keys.heads} // tp_size"], group.row.fan_in: width_expressions(group.row.fan_in, "hidden", keys)}
    if kv and kv != heads:
        out[kv] = [f"per_rank({keys.kv_heads})"]
        out[heads // kv] = [f"per_rank({keys.heads}) // per_rank({keys.kv_heads})"]
        if head_dim:
            dims = [keys.head_dim] if keys.head_dim else []
            dims += [f"({keys.hidden} // {keys.heads})"] if keys.hidden else []
            out[kv * head_dim] = [f"per_rank({keys.kv_heads}) * {d}" for d in dims]
    return out


def width_expressions(width: int, kind: str, keys: Keys) -> list[str]:
    """Candidate per-rank expressions of a width: heads // tp_size * head_dim, key // tp_size for a key
    that holds it, a multiple of the hidden size."""
    out = []
    if keys.heads and keys.head_dim and width == keys.value(keys.heads) * keys.value(keys.head_dim):
        out.append(f"{keys.heads} // tp_size * {keys.head_dim}")
    key = find_key(keys.config, kind, width, keys.near)
    out += [f"{key} // tp_size"] if key else []
    hidden = keys.value(keys.hidden)
    if hidden and width % hidden == 0:
        out.append(f"{keys.hidden} // tp_size" if width == hidden else f"{width // hidden} * {keys.hidden} // tp_size")
    return out


def scanned_modules(group: Group) -> list[str]:
    """The group's scope and the modules between it and each column (relative to the block)."""
    scope = group.scope
    out = [scope]
    for c in group.columns:
        parts = c.parent.split(".") if c.parent else []
        out += [".".join(parts[:k]) for k in range(len(scope.split(".")) + 1 if scope else 1, len(parts) + 1)]
    return list(dict.fromkeys(out))


def attribute_candidates(module, values: dict[int, list[str]]) -> dict[str, list[str]]:
    """Int attributes of `module` whose names speak of sizes and whose value the group divides, and head
    counts read as `self.config.X` in its forward: attribute path -> candidate expressions."""
    out = {}
    for name, value in vars(module).items():
        if (type(value) is int and value in values and not name.startswith("_") and SIZE_ATTRIBUTE.search(name)
                and not PER_HEAD_ATTRIBUTE.fullmatch(name)):
            out[name] = values[value]
    config = getattr(module, "config", None)
    if config is not None and hasattr(config, "to_dict"):
        for name in sorted(set(re.findall(r"self\.config\.(\w+)", forward_source(module)))):
            value = getattr(config, name, None)
            if type(value) is int and value in values and "head" in name:
                out[f"config.{name}"] = values[value]
    return {k: v for k, v in out.items() if v}


def forward_source(module) -> str:
    try:
        return inspect.getsource(type(module).forward)
    except (OSError, TypeError):  # a forward without Python source (a builtin): nothing to read
        return ""


def update_entries(split: list[tuple[Block, Group]], config, stream: int,
                   models: list) -> tuple[list[Entry], list[str]]:
    """One Update per module pattern, and notes for attributes left out. An attribute is updated when
    every module the pattern matches has it, with the first candidate expression that gives its full
    value on every model built (tiny and default config)."""
    updates: dict[str, dict[str, str]] = {}
    notes = []
    for block, group in split:
        keys = Keys.of(config, block.list_name)
        values = size_expressions(group, keys, keys.sizes(stream)[1])
        for rel in scanned_modules(group):
            pattern = block.pattern(rel)
            for path, candidates in attribute_candidates(block.module.get_submodule(rel), values).items():
                chosen = next((e for e in candidates if holds(e, pattern, path, models)), None)
                if chosen is not None:
                    updates.setdefault(pattern, {})[path] = chosen
                elif all(on_every(pattern, path, m) for m in models):
                    notes.append(f"TODO: {pattern}.{path} holds a size this draft splits, but none of "
                                 f"{', '.join(candidates)} gives its value on every config: add an Update by hand")
    return [Entry("Update", p, {"attributes": a}) for p, a in updates.items()], list(dict.fromkeys(notes))


def holds(expression: str, pattern: str, path: str, models: list) -> bool:
    """Whether `expression` at world size 1 equals `path` on every module `pattern` matches in each model."""
    for model in models:
        base = model.base_model
        names = [n for n, _ in base.named_modules() if n]
        hits = match_modules(pattern, names) if pattern else []
        if not hits or not on_every(pattern, path, model):
            return False
        try:
            value = expr.evaluate(expression, lambda n, model=model: getattr(model.config, n), 1)
        except (AttributeError, ValueError):  # a name this config lacks, an inexact division: not this one
            return False
        if any(resolve_attr(base.get_submodule(n), path)[2] != value for n in hits):
            return False
    return True


def on_every(pattern: str, path: str, model) -> bool:

    base = model.base_model
    hits = match_modules(pattern, [n for n, _ in base.named_modules() if n])
    for n in hits:
        try:
            resolve_attr(base.get_submodule(n), path)
        except AttributeError:
            return False
    return bool(hits)


def place_updates(entries: list[Entry], updates: list[Entry]) -> list[Entry]:
    """Each Update right after the last entry inside the module it updates."""
    out = list(entries)
    for update in updates:
        inside = [i for i, e in enumerate(out) if e.module.startswith(update.module + ".")]
        out.insert(inside[-1] + 1 if inside else len(out), update)
    return out


# -- 6. vocabulary, world sizes -------------------------------------------------------------------
def vocab_parallel(model) -> tuple[dict[str, bool] | None, list[str]]:
    """({embedding, lm_head} or None, notes): a plain nn.Embedding input embedding and nn.Linear LM head
    are split along the vocabulary. A subclass with its own forward (a scaled lookup) stays whole: the
    vocab-parallel module would replace that forward."""
    notes = []
    try:
        emb = model.get_input_embeddings()
    except NotImplementedError as e:  # a model without one token embedding (a dual encoder, audio)
        emb = None
        notes.append(f"{type(model).__name__} has no input embedding to split along the vocabulary ({e})")
    head = model.get_output_embeddings()
    embedding = isinstance(emb, nn.Embedding) and type(emb).forward is nn.Embedding.forward
    if isinstance(emb, nn.Embedding) and not embedding:
        notes.append(f"the input embedding is a {type(emb).__name__} with its own forward (a scaled lookup, say); "
                     "vocab_parallel would replace that forward, so it stays whole")
    lm_head = (isinstance(head, nn.Linear) and type(head).forward is nn.Linear.forward
               and (not isinstance(emb, nn.Embedding) or head.weight.shape[0] == emb.weight.shape[0]))
    if lm_head and isinstance(emb, nn.Embedding) and head.weight is emb.weight and not embedding:
        lm_head = False  # tied to an embedding that stays whole
    shared = emb.weight if isinstance(emb, nn.Embedding) else None  # its sharers are split with it
    others = [n for n, m in model.named_modules() if lm_head and isinstance(m, nn.Embedding)
              and m.weight is head.weight and m.weight is not shared]
    if others:  # a second input embedding (a decoder's) tied to the head: a vocab-parallel head would cut it
        lm_head = False
        notes.append(f"TODO: the LM head shares its weight with {', '.join(others)}, which is not the input "
                     "embedding: vocab_parallel would split that weight under a plain nn.Embedding, so the head "
                     "stays whole")
    return ({"embedding": embedding, "lm_head": lm_head} if embedding or lm_head else None), notes


def supported_world_sizes(model, loaded, candidates) -> list[int]:
    """The world sizes at which the engine's planner accepts the mapping on `model`."""
    out = []
    for tp_size in candidates:
        errors: list = []
        planner.build_plan(model, loaded, tp_size, errors)
        if not errors:
            out.append(tp_size)
    return out
