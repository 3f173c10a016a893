"""Step 3 of a draft: the repeated blocks, their weights, and how they pair (attention by names, MLPs by shapes);
the config keys that name their sizes."""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from torch import nn
from transformers.pytorch_utils import Conv1D

from tpmap.draft.config import real_key, size_kind
from tpmap.draft.names import (
    ATTENTION_SCOPE,
    K_NAMES,
    KV_NAMES,
    O_NAMES,
    Q_NAMES,
    QKV_NAMES,
    TINY,
    V_NAMES,
)
from tpmap.engine.blocks import block_prefixes


@dataclass
class Weight:
    """One weight module of a block; `rel` is its path inside the block (self_attn.q_proj)."""
    rel: str
    module: Any
    fan_in: int
    fan_out: int
    reverse: bool = False  # stored [in, out] (transformers' Conv1D)
    embedding: bool = False

    @property
    def leaf(self) -> str:
        return self.rel.rsplit(".", 1)[-1].lower()

    @property
    def parent(self) -> str:
        return self.rel.rpartition(".")[0]


@dataclass
class Group:
    """A Column -> Row pair: `columns` read the stream and split their output, `row` sums it back."""
    kind: str  # "attention" | "mlp"
    columns: list[Weight]
    row: Weight

    @property
    def scope(self) -> str:
        """The innermost module holding every weight of the group (relative to the block)."""
        paths = [w.parent.split(".") if w.parent else [] for w in self.columns + [self.row]]
        common = []
        for parts in zip(*paths):
            if len(set(parts)) != 1:
                break
            common.append(parts[0])
        return ".".join(common)


@dataclass
class Analysis:
    """What one block holds: paired groups, embeddings split by heads, and weights left whole."""
    groups: list[Group] = field(default_factory=list)
    head_embeddings: list[Weight] = field(default_factory=list)
    whole: list[Weight] = field(default_factory=list)


@dataclass
class Block:
    """One repeated block: `name` (layers.0) in its list `list_name` (layers)."""
    name: str
    list_name: str
    module: Any

    def pattern(self, rel: str) -> str:
        return f"{self.list_name}.*" + (f".{rel}" if rel else "")


def blocks_of(base) -> list[Block]:

    return [Block(name, name.rpartition(".")[0], base.get_submodule(name)) for name in block_prefixes(base)]


def block_weights(block) -> list[Weight]:
    """The nn.Linear, Conv1D and nn.Embedding modules of a block, in registration order."""
    out = []
    for rel, module in block.named_modules():
        if isinstance(module, nn.Linear):
            out.append(Weight(rel, module, module.in_features, module.out_features))
        elif isinstance(module, Conv1D):
            out.append(Weight(rel, module, module.weight.shape[0], module.weight.shape[1], reverse=True))
        elif isinstance(module, nn.Embedding):
            out.append(Weight(rel, module, module.num_embeddings, module.embedding_dim, embedding=True))
    return out


def attention_role(w: Weight) -> str | None:
    for role, names in (("q", Q_NAMES), ("k", K_NAMES), ("v", V_NAMES), ("qkv", QKV_NAMES), ("kv", KV_NAMES)):
        if w.leaf in names:
            return role
    return None


def nearest(w: Weight, candidates: list[Weight]) -> list[Weight]:
    """The candidates in the innermost scope around `w` that holds any (walking up its parents)."""
    parts = w.rel.split(".")
    for k in range(len(parts) - 1, -1, -1):
        scope = ".".join(parts[:k])
        inside = [c for c in candidates if not scope or c.rel.startswith(scope + ".")]
        if inside:
            return inside
    return []


def analyse_block(weights: list[Weight], stream: int, heads: int, head_dim: int | None) -> Analysis:
    """Pair a block's weights into Column -> Row groups: attention first (by names), then MLPs (by shapes)."""
    result = Analysis()
    free = [w for w in weights if not w.embedding]
    result.head_embeddings = [w for w in weights if w.embedding and w.fan_out == heads]
    result.whole = [w for w in weights if w.embedding and w.fan_out != heads]
    for finder in (lambda found: attention_groups(found, heads, head_dim), lambda found: mlp_groups(found, stream)):
        for group in finder(free):
            result.groups.append(group)
            free = [w for w in free if all(w is not g for g in group.columns + [group.row])]
    result.whole += free
    return result


def attention_groups(weights: list[Weight], heads: int, head_dim: int | None) -> list[Group]:
    """q/k/v (or fused) projections that share a parent, with the output projection nearest to them
    that maps the q width back to the width they read."""
    named = [w for w in weights if attention_role(w)]
    groups: list[Group] = []
    for parent in dict.fromkeys(w.parent for w in named):
        columns = [w for w in named if w.parent == parent]
        widths = {q_width(c, heads, head_dim) for c in columns} - {None}
        rows = [w for w in weights if not attention_role(w) and w.fan_out == columns[0].fan_in
                and w.fan_in in widths and all(w is not g.row for g in groups)]
        row = nearest(columns[0], rows)
        if row:
            groups.append(Group("attention", columns, row[0]))
    return groups


def q_width(w: Weight, heads: int, head_dim: int | None) -> int | None:
    """The width of the query heads a projection implies: its output for q; a third of a fused q/k/v
    (or heads x head_dim where the thirds are unequal)."""
    role = attention_role(w)
    if role == "q":
        return w.fan_out
    if role == "qkv":
        return heads * head_dim if head_dim else (w.fan_out // 3 if w.fan_out % 3 == 0 else None)
    return None


def mlp_groups(weights: list[Weight], stream: int) -> list[Group]:
    """Rows write the stream from an inner width; their Columns are the nearest weights that read the
    stream and produce that inner width (or twice it: fused [gate | up])."""
    groups: list[Group] = []
    used: list[Weight] = []
    for row in weights:
        if (row.fan_out != stream or row.fan_in == stream or any(row is u for u in used)
                or (row.leaf in O_NAMES and ATTENTION_SCOPE.search(row.parent))):
            continue
        candidates = [c for c in weights if c is not row and all(c is not u for u in used)
                      and c.fan_in == stream and c.fan_out in (row.fan_in, 2 * row.fan_in)]
        columns = nearest(row, candidates)
        if columns:
            groups.append(Group("mlp", columns, row))
            used += columns + [row]
    return groups


# -- config keys named by expressions -------------------------------------------------------------
def find_key(config, kind: str, value: int | None, near: str = "") -> str | None:
    """The config key of `kind` (CONFIG_KEYS) holding `value`; among several, the one sharing most
    words with `near` (a block list such as decoder.layers), then the canonical one, then the shortest."""
    if value is None:
        return None
    hits = [k for k, v in config.to_dict().items() if type(v) is int and v == value and size_kind(k) == kind]
    words = set(re.split(r"[._]", near))
    canonical = {real_key(config, n) for n in ("num_attention_heads", "hidden_size", "num_key_value_heads")}
    return max(hits, key=lambda k: (len(words & set(k.split("_"))), k in canonical, -len(k)), default=None)


def pick_key(config, kind: str, near: str) -> str | None:
    """The config key of `kind` for a block list: the one at the tiny value if any, else by `find_key`'s
    order among those of that kind."""
    found = find_key(config, kind, TINY[kind], near)
    if found:
        return found
    values = {v for k, v in config.to_dict().items() if type(v) is int and size_kind(k) == kind}
    return next(iter(sorted(filter(None, (find_key(config, kind, v, near) for v in values)))), None)


@dataclass
class Keys:
    """The config keys the expressions of one block list name (None where the config has none)."""
    config: Any
    near: str
    heads: str | None = None
    kv_heads: str | None = None
    hidden: str | None = None
    head_dim: str | None = None

    @classmethod
    def of(cls, config, near: str) -> Keys:
        """The keys of each kind, preferring the one at its tiny value (a config may keep its defaults)."""
        return cls(config, near,
                   *(pick_key(config, kind, near) for kind in ("heads", "kv_heads", "hidden", "head_dim")))

    def value(self, key: str | None) -> int | None:
        return None if key is None else self.config.to_dict().get(key)

    def sizes(self, stream: int) -> tuple[int, int | None]:
        """(heads, head_dim); head_dim is stream / heads where the config does not state it."""
        heads = self.value(self.heads) or TINY["heads"]
        return heads, self.value(self.head_dim) or (stream // heads if stream % heads == 0 else None)
