"""`tpmap draft MODEL_TYPE`: a starting mapping for a model type, written from a tiny model's structure.

The draft is a start, never a proof: `tpmap verify` proves it. How it is made, top to bottom:

1. A tiny config (`tiny_model`): the model type's default config with its sizes cut down by key name
   (hidden 96, 12 heads, 4 KV heads where the config has them, head_dim 8, intermediate 192, 2 layers,
   vocabulary 256, 64 positions). It becomes the draft's `verify` config.
2. The most useful class (`model_class`: seq2seq LM for encoder-decoders, masked LM, causal LM, base
   model, from transformers' auto mappings), built on the meta device: shapes only, no weights.
3. The repeated blocks (the elements of the outermost ModuleLists, as `tpmap lint` defines them) and
   their weights (nn.Linear, Conv1D, nn.Embedding), paired per block (`analyse_block`):

   * attention: the q/k/v projections by name (`Q_NAMES`, ...; fused: `QKV_NAMES`) that share a
     parent, with the nearest other weight that maps the q width back to the stream width (the Row);
   * MLPs, by shapes: a Row writes the stream (out = hidden) from an inner width; its Columns are the
     nearest weights that read the stream and produce that inner width (or twice it: a fused
     [gate | up], flagged TODO). Registration order does not matter; scopes (parent modules) do;
   * an nn.Embedding as wide as the head count (a relative position bias) is a Column by heads;
     everything else stays whole (`replicated:`, with a TODO).

4. Where the config class ships a `base_model_tp_plan`, it decides how the modules it names are split
   (`translate_plan`); groups it does not name at all come from the analysis, with a note.
5. Updates (`update_entries`): int attributes of each split group's modules whose names speak of sizes
   and whose value is one the group divides (heads, KV heads, groups, widths) become per-rank
   expressions, and head counts read as `self.config.X` in a forward become `config.X` updates. Each
   expression is checked against the default config's model too (it must give the full value there).
6. `vocab_parallel` from `get_input_embeddings()` / `get_output_embeddings()`; `world_sizes` where the
   engine's planner accepts the draft (default config) and the verify config's (tiny config).

Fused weights whose layout shapes cannot tell ([q|k|v] blocks or head-major; [gate|up] halves or
interleaved) carry a `# TODO` comment: nothing is guessed silently. No model names appear here,
only tables of projection, attribute and config key names.
"""
from __future__ import annotations

import inspect
import re
import textwrap
from dataclasses import dataclass, field
from typing import Any

from .errors import DraftError

# -- naming tables (names of projections, attributes and config keys; never of models) --------------
Q_NAMES = {"q_proj", "query", "q", "wq", "q_lin", "query_proj", "q_head", "q_linear"}
K_NAMES = {"k_proj", "key", "k", "wk", "k_lin", "key_proj", "k_head", "k_linear"}
V_NAMES = {"v_proj", "value", "v", "wv", "v_lin", "value_proj", "v_head", "v_linear"}
QKV_NAMES = {"qkv_proj", "c_attn", "query_key_value", "wqkv", "qkv", "in_proj", "w_pack", "qkv_linear", "att_proj"}
KV_NAMES = {"kv_proj", "key_value", "kv"}
O_NAMES = {"o_proj", "out_proj", "o", "out_lin", "attn_out"}  # in an attention scope: never an MLP's Row
ATTENTION_SCOPE = re.compile(r"att", re.IGNORECASE)  # attn, self_attn, attention, SelfAttention, ...

TINY = {"hidden": 96, "heads": 12, "kv_heads": 4, "head_dim": 8, "intermediate": 192, "layers": 2,
        "vocab": 256, "positions": 64, "experts": 4, "experts_per_token": 2, "expert_groups": 1}
CONFIG_KEYS = {  # config keys by the size they hold (the whole key must match)
    "kv_heads": r"num_key_value_heads|num_kv_heads|n_kv_heads|num_kv|multi_query_group_num|\w*key_value_heads",
    "heads": r"n_head|n_heads|num_heads|\w*attention_heads",
    "layers": r"n_layer|num_layers|\w*layers",
    "hidden": r"hidden_size|n_embd|n_embed|d_model|dim|embed_dim|model_dim|hidden_dim",
    "head_dim": r"head_dim|d_kv|kv_channels|attention_head_size|d_head",
    "intermediate": r"\w*intermediate_size|\w*ffn_dim|d_ff|n_inner|ffn_hidden_size|inner_hidden_size|"
                    r"intermediate_dim|mlp_dim|dim_feedforward|d_inner",
    "vocab": r"vocab_size",
    "positions": r"max_position_embeddings|n_positions|n_ctx|max_seq_len|max_sequence_length|max_target_positions",
    "experts": r"num_experts|num_local_experts|n_routed_experts|moe_num_experts",
    "experts_per_token": r"num_experts_per_tok|moe_top_k|moe_k|top_k|num_selected_experts",
    "expert_groups": r"n_group|topk_group|num_expert_group",
    "rotary_dim": r"rotary_dim",
}
CAPPED = ("layers", "experts", "experts_per_token", "expert_groups", "positions")  # lowered to TINY, never raised
SPECIAL_TOKENS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}  # other ids: 3
SIZE_ATTRIBUTE = re.compile(r"head|embed|dim|size|width|hidden|group|inner|split|intermediate|ffn|channel")
PER_HEAD_ATTRIBUTE = re.compile(r"(attention_)?head_(dim|size|width)|\w*(per_head|rot|rope)\w*|d_head|d_kv")
PLAN_COLUMN = {"colwise": {}, "packed_colwise": {"sections": 2}, "colwise_gather_output": {"gather_output": True}}
PLAN_ROW = {"rowwise": {}}
CLASS_MAPPINGS = ("MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES", "MODEL_FOR_MASKED_LM_MAPPING_NAMES",
                  "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "MODEL_MAPPING_NAMES")
CLASS_SUFFIXES = ("ForCausalLM", "Model")  # for config classes the auto mappings do not list
WORLD_SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)


# -- 1. the tiny config ---------------------------------------------------------------------------
def size_kind(key: str) -> str | None:
    """Which size a config key holds, by its name (CONFIG_KEYS), or None."""
    return next((kind for kind, pattern in CONFIG_KEYS.items() if re.fullmatch(pattern, key)), None)


def real_key(config, name: str) -> str:
    """The key a config stores `name` under (through its attribute_map: hidden_size -> n_embd)."""
    return getattr(config, "attribute_map", {}).get(name, name)


WIDTH_KINDS = ("hidden", "heads", "kv_heads", "head_dim", "intermediate", "rotary_dim")


def tiny_overrides(default, reduce_layers: bool = True, widths: bool = True) -> dict[str, Any]:
    """Overrides for `AutoConfig.for_model` that make the default config tiny, keyed as the config spells
    them. Sizes are set by key name (unset ones too: a None vocabulary or head_dim); an int key equal to
    the default hidden size follows it; per-layer lists are cut to the layer count; special token ids
    are moved into the tiny vocabulary. Nested configs (an encoder's, a text model's) are made tiny
    the same way, as dicts of their own overrides. `widths=False` leaves widths and head counts as they
    are (for configs whose sizes are tied in ways the tiny values break)."""
    values = default.to_dict()
    default_hidden = values.get(real_key(default, "hidden_size"))
    layers = values.get(real_key(default, "num_hidden_layers"))
    out: dict[str, Any] = {}
    for key, value in values.items():
        kind = size_kind(key)
        sub = getattr(default, key, None) if isinstance(value, dict) else None
        if hasattr(sub, "to_dict") and hasattr(sub, "model_type"):  # a nested config (encoder, text_config)
            nested = tiny_overrides(sub, reduce_layers, widths)
            if nested:
                out[key] = nested
            continue
        if key.endswith("_token_id") and value is not None:
            new = _token_id(key, value)
        elif isinstance(value, list) and reduce_layers and type(layers) is int and len(value) == layers > 2:
            new = value[:TINY["layers"]]
        elif type(value) is not int and not (value is None and kind in TINY and kind not in CAPPED):
            continue
        elif (kind == "layers" and not reduce_layers) or (not widths and (kind in WIDTH_KINDS or kind is None)):
            continue
        elif kind in CAPPED:
            new = min(value, TINY[kind])
        elif kind == "rotary_dim":
            new = min(value, TINY["head_dim"])
        elif kind == "hidden" and type(default_hidden) is int and value != default_hidden:
            new = value * TINY["hidden"] // default_hidden  # another width under a hidden-like name: scaled
        elif kind is not None:
            new = TINY[kind]
        elif value == default_hidden and value >= 32:
            new = TINY["hidden"]
        else:
            continue
        if new != value or kind in TINY:  # sizes are stated even where the default has them
            out[key] = new
    return out


def _token_id(key: str, value):
    if isinstance(value, list):
        return [v if v < TINY["vocab"] else SPECIAL_TOKENS["eos_token_id"] for v in value]
    return value if value < TINY["vocab"] else SPECIAL_TOKENS.get(key, 3)


TINY_PARAMETERS = 20_000_000  # above this the verify config is not tiny: flagged
TINY_LEVELS = (  # (reduce layers, cut widths, note): tried in order until the config and the model build
    (True, True, ""),
    (False, True, "with 2 layers the config or the model fails ({}); the verify config keeps the default layer "
                  "count"),
    (True, False, "with the tiny widths the config or the model fails ({}); the verify config keeps the default "
                  "widths and head counts, so it is larger: cut them by hand where the model allows"),
)


def tiny_model(model_type: str, patch: dict | None = None):
    """(tiny config, its overrides, notes, model class, the model on the meta device). `patch`: values the
    default config lacks to build at all (a shipped mapping's `default_config`); they are part of the
    overrides. Where the config or the model fails with the tiny sizes, the layer count, then the widths
    keep their defaults (TINY_LEVELS), with a note; where all fail, a DraftError names the first failure."""
    import transformers
    from transformers import AutoConfig

    from .errors import did_you_mean

    if model_type not in transformers.CONFIG_MAPPING:
        raise DraftError(f"{model_type!r} is not a model_type of transformers {transformers.__version__}"
                         f"{did_you_mean(model_type, transformers.CONFIG_MAPPING)}")
    patch = patch or {}
    try:
        default = AutoConfig.for_model(model_type, **patch)
    except Exception as e:  # a config class that needs arguments (a composite): reported
        raise DraftError(f"the default config of {model_type!r} does not build: {type(e).__name__}: {e}") from e
    failures = []
    for reduce_layers, widths, note in TINY_LEVELS:
        overrides = merged(patch, tiny_overrides(default, reduce_layers, widths))
        try:
            config = AutoConfig.for_model(model_type, **overrides)
        except Exception as e:  # a config class rejecting the sizes: the next level, then reported
            failures.append(f"the tiny config of {model_type!r} is rejected: {type(e).__name__}: {str(e).strip()}")
            continue
        cls = model_class(model_type, config)
        try:
            model = build_meta(cls, config)
        except DraftError as e:  # the model failing on the sizes: the next level, then reported
            failures.append(str(e))
            continue
        notes = [note.format(failures[0])] if note else []
        size = sum(p.numel() for p in model.parameters())
        if size > TINY_PARAMETERS:
            notes.append(f"TODO: the verify config builds {size:,} parameters (a tiny one has about a million): "
                         "cut its sizes by hand before tpmap verify")
        return config, overrides, notes, cls, model
    raise DraftError(failures[0])


def merged(base: dict, over: dict) -> dict:
    """`over` on top of `base`, nested dicts merged key by key."""
    out = dict(base)
    for key, value in over.items():
        out[key] = merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def shipped_patch(model_type: str) -> dict:
    """The `default_config` of the shipped mapping of `model_type`, if there is one ({} otherwise)."""
    from . import loader

    files = loader.shipped_files()
    return dict(loader.load_file(files[model_type]).mapping.default_config) if model_type in files else {}


# -- 2. the model class ---------------------------------------------------------------------------
def model_class(model_type: str, config) -> type:
    """The most useful class: seq2seq LM (encoder-decoders), masked LM, causal LM, then the base model,
    from transformers' auto mappings; else named after the config class (FooConfig -> FooModel)."""
    import transformers
    from transformers.models.auto import modeling_auto

    names: list[str] = []
    for table in CLASS_MAPPINGS:
        if table.startswith("MODEL_FOR_SEQ_TO_SEQ") and not getattr(config, "is_encoder_decoder", False):
            continue
        found = getattr(modeling_auto, table).get(model_type)
        names += [found] if isinstance(found, str) else list(found or ())
    stem = type(config).__name__.removesuffix("Config")
    names += [stem + suffix for suffix in CLASS_SUFFIXES]
    for name in names:
        cls = getattr(transformers, name, None)
        if isinstance(cls, type) and getattr(getattr(cls, "config_class", None), "model_type", None) == model_type:
            return cls
    raise DraftError(f"no model class of transformers is registered for model_type {model_type!r} "
                     f"(tried {', '.join(names)})")


def build_meta(cls, config, which: str = "the tiny config"):
    from .lint.rules import build_meta as build

    try:
        return build(cls, config)
    except Exception as e:  # a transformers constructor failing on this config: reported, not hidden
        raise DraftError(f"building {cls.__name__} from {which} failed: {type(e).__name__}: {e}") from e


def default_model(model_type: str, cls, patch: dict):
    """(the class built from the default config with layers cut to 2, as `tpmap lint` builds it, or
    None; a note saying why not)."""
    from .lint.rules import reduced_default_config

    try:
        config = reduced_default_config(model_type, patch)
    except Exception as e:  # the config class refusing the layer cut: reported in the draft
        return None, f"the default config with 2 layers is rejected ({type(e).__name__}: {e})"
    try:
        return build_meta(cls, config, "the default config"), ""
    except DraftError as e:
        return None, str(e)


# -- 3. blocks, weights, pairs --------------------------------------------------------------------
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
    from .lint.rules import block_prefixes

    return [Block(name, name.rpartition(".")[0], base.get_submodule(name)) for name in block_prefixes(base)]


def block_weights(block) -> list[Weight]:
    """The nn.Linear, Conv1D and nn.Embedding modules of a block, in registration order."""
    from torch import nn
    from transformers.pytorch_utils import Conv1D

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
    for finder in (lambda ws: attention_groups(ws, heads, head_dim), lambda ws: mlp_groups(ws, stream)):
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
    def of(cls, config, near: str) -> "Keys":
        """The keys of each kind, preferring the one at its tiny value (a config may keep its defaults)."""
        return cls(config, near, *(pick_key(config, kind, near) for kind in ("heads", "kv_heads", "hidden", "head_dim")))

    def value(self, key: str | None) -> int | None:
        return None if key is None else self.config.to_dict().get(key)

    def sizes(self, stream: int) -> tuple[int, int | None]:
        """(heads, head_dim); head_dim is stream / heads where the config does not state it."""
        heads = self.value(self.heads) or TINY["heads"]
        return heads, self.value(self.head_dim) or (stream // heads if stream % heads == 0 else None)


# -- 4. entries -----------------------------------------------------------------------------------
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
    from torch import nn

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
    from tpmap.engine.plan import match

    def glob(pattern: str) -> str:
        head, _, rest = pattern.partition(".*")
        return head + ".*" + re.sub(r"(?<=[._])(\w*?)\d+(?=\.|$)", r"\1*", rest)

    keyed: dict[tuple, list[Entry]] = {}
    for e in entries:
        keyed.setdefault((glob(e.module), e.kind, repr(e.fields)), []).append(e)
    out = []
    for (pattern, _, _), alike in keyed.items():
        covered = {n for e in alike for n in match(e.module, names)}
        if len(alike) > 1 and set(match(pattern, names)) == covered:
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
    from tpmap.engine.plan import match

    names = [n for n, _ in base.named_modules() if n]
    analysed_of = {n: e for e in analysed for n in match(e.module, names)}
    entries, grad_allreduce, notes, decided = [], [], [], set()
    for key, style in plan.items():
        hits = match(key, names)
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
                         "(see the README's long tail: Param, Reduce, Enter, Input, Norm); kept whole")
    untouched = {e.module for e in analysed if not any(n in decided for n in match(e.module, names))}
    for e in analysed:
        if e.module in untouched and e.kind != "whole":
            e.notes = e.notes + ["not in base_model_tp_plan: from the module structure"]
    return entries + [e for e in analysed if e.module in untouched], grad_allreduce, notes


def plan_entry(key: str, style: str, analysed: Entry | None, module) -> Entry:
    """A Column or Row for a plan style; heads/sections (and their TODOs) from the analysis when it found
    the same kind and the style adds nothing of its own."""
    from transformers.pytorch_utils import Conv1D

    kind = "Column" if style in PLAN_COLUMN else "Row"
    fields = dict(PLAN_COLUMN.get(style) or PLAN_ROW.get(style) or {})
    notes = [] if style in ("colwise", "rowwise") else [f"base_model_tp_plan: {style}"]
    if analysed is not None and analysed.kind == kind and not fields:
        fields, notes = dict(analysed.fields), notes + analysed.notes
    if isinstance(module, Conv1D):
        fields["reverse"] = True
    return Entry(kind, key, fields, notes)


def plan_miss(key: str, style: str, names: list[str]) -> str:
    from tpmap.engine.plan import match

    owner = key.rpartition(".")[0]
    if owner and match(owner, names):
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


def update_entries(split: list[tuple[Block, Group]], config, stream: int, models: list) -> tuple[list[Entry], list[str]]:
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
    from tpmap import expr
    from tpmap.engine.plan import match, resolve_attr

    for model in models:
        base = model.base_model
        names = [n for n, _ in base.named_modules() if n]
        hits = match(pattern, names) if pattern else []
        if not hits or not on_every(pattern, path, model):
            return False
        try:
            value = expr.evaluate(expression, lambda n: getattr(model.config, n), 1)
        except (AttributeError, ValueError):  # a name this config lacks, an inexact division: not this one
            return False
        if any(resolve_attr(base.get_submodule(n), path)[2] != value for n in hits):
            return False
    return True


def on_every(pattern: str, path: str, model) -> bool:
    from tpmap.engine.plan import match, resolve_attr

    base = model.base_model
    hits = match(pattern, [n for n, _ in base.named_modules() if n])
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
    from torch import nn

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
    from tpmap.engine import plan as planning

    out = []
    for ws in candidates:
        errors: list = []
        planning.build(model, loaded, ws, errors)
        if not errors:
            out.append(ws)
    return out


# -- 7. the YAML text -----------------------------------------------------------------------------
WIDTH = 110
YAML_WORDS = {"true", "false", "yes", "no", "on", "off", "null", "y", "n"}  # plain, YAML reads them as non-strings


def scalar(value) -> str:
    """YAML for a value of a draft (flow style), read back by YAML as the same value and type."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if value != value or value in (float("inf"), float("-inf")):
            return {"nan": ".nan", "inf": ".inf", "-inf": "-.inf"}[repr(value)]
        mantissa, e, exponent = repr(value).partition("e")
        return (mantissa if "." in mantissa else mantissa + ".0") + (f"e{int(exponent):+03d}" if e else "")
    if isinstance(value, list):
        return "[" + ", ".join(scalar(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {scalar(v)}" for k, v in value.items()) + "}"
    text = str(value)
    plain = re.fullmatch(r"[A-Za-z_][\w.*/ ()+-]*(?<! )", text) and text.lower() not in YAML_WORDS
    return text if plain else '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def comment(notes: list[str], indent: str) -> list[str]:
    return [line for note in notes for line in textwrap.wrap(
        note, WIDTH, initial_indent=indent + "# ", subsequent_indent=indent + "#   ", break_on_hyphens=False)]


def flow(items: dict, indent: int) -> str:
    """A flow mapping wrapped at WIDTH, continuation lines under its first key."""
    parts = [f"{k}: {scalar(v)}" for k, v in items.items()]
    if not parts:
        return "{}"
    lines, line = [], "{"
    for k, part in enumerate(parts):
        part += "," if k < len(parts) - 1 else "}"
        if indent + len(line) + len(part) > WIDTH and line.strip() != "{":
            lines.append(line.rstrip())
            line = " " * (indent + 1)
        line += part + " "
    return "\n".join(lines + [line.rstrip()])


def render_entry(entry: Entry) -> list[str]:
    lines = comment(entry.notes, "  ") + [f"  - kind: {entry.kind}", f"    module: {scalar(entry.module)}"]
    for key, value in entry.fields.items():
        if key == "attributes":
            lines += ["    attributes:"] + [f"      {path}: {scalar(e)}" for path, e in value.items()]
        elif key == "sections" and isinstance(value, list):
            lines += ["    sections:"] + [f"      - {k}: {scalar(v)}" for section in value for k, v in section.items()]
        else:
            lines.append(f"    {key}: {scalar(value)}")
    return lines


@dataclass
class Draft:
    model_type: str
    model_class: str
    config: dict
    entries: list[Entry]
    whole: list[Entry]
    grad_allreduce: list[str]
    vocab_parallel: dict | None
    header: list[str]
    notes: list[str]
    default_config: dict = field(default_factory=dict)  # from a shipped mapping: what the default lacks
    world_sizes: list[int] = field(default_factory=lambda: [1])
    verify_world_sizes: list[int] = field(default_factory=lambda: [1])

    def render(self) -> str:
        lines = ["# yaml-language-server: $schema=mapping.schema.json"] + comment(self.header + self.notes, "")
        lines += [f"model_type: {self.model_type}",
                  f"world_sizes: {scalar(self.world_sizes)}   # where the planner accepts this draft (default config)"]
        if self.default_config:
            lines.append(f"default_config: {scalar(self.default_config)}   # from the shipped mapping")
        lines.append("entries:")
        for entry in self.entries:
            lines += render_entry(entry)
        if self.whole:
            lines.append("replicated:   # kept whole on every rank")
            for entry in self.whole:
                lines += comment(entry.notes, "  ") + [f"  - {scalar(entry.module)}"]
        if self.grad_allreduce:
            lines.append(f"grad_allreduce: {scalar(self.grad_allreduce)}   # base_model_tp_plan: "
                         "replicated_with_grad_allreduce")
        if self.vocab_parallel:
            lines.append(f"vocab_parallel: {scalar(self.vocab_parallel)}")
        if any(isinstance(v, dict) for v in self.config.values()):  # nested configs: one key a line
            config = ["    config:"] + [f"      {k}: {flow(v, 8 + len(k)) if isinstance(v, dict) else scalar(v)}"
                                         for k, v in self.config.items()]
        else:
            config = [f"    config: {flow(self.config, 12)}"]
        lines += ["verify:", "  - name: tiny", *config,
                  f"    models: [{self.model_class}]", f"    world_sizes: {scalar(self.verify_world_sizes)}"]
        return "\n".join(lines) + "\n"

    def load(self):
        """The draft loaded as a mapping; a schema failure is a drafter bug, reported with the text."""
        from .errors import MappingErrors
        from .loader import load_text

        text = self.render()
        try:
            return load_text(text, f"<draft of {self.model_type}>")
        except MappingErrors as e:
            raise DraftError(f"the draft of {self.model_type!r} fails the schema (a tpmap bug):\n{e}\n{text}") from None


# -- the whole draft ------------------------------------------------------------------------------
def draft(model_type: str) -> str:
    """The draft mapping of `model_type` as YAML text; it loads with `tpmap.loader.load_text`.
    Raises DraftError when no draft can be made (the config or model does not build, no pairs)."""
    import transformers

    patch = shipped_patch(model_type)
    config, overrides, notes, cls, model = tiny_model(model_type, patch)
    default, default_note = default_model(model_type, cls, patch)
    blocks = blocks_of(model.base_model)
    if not blocks:
        raise DraftError(f"{cls.__name__} has no repeated blocks (no nn.ModuleList of layers): nothing to pair")
    stream = getattr(config, "hidden_size", None) or TINY["hidden"]
    names = [n for n, _ in model.base_model.named_modules() if n]
    entries, groups = analysis_entries(blocks, stream, config, names)
    entries += outside_head_embeddings(model.base_model, blocks, config)
    tp_plan = dict(getattr(config, "base_model_tp_plan", None) or {})
    grad_allreduce: list[str] = []
    if tp_plan:
        entries, grad_allreduce, plan_notes = translate_plan(tp_plan, entries, model.base_model)
        notes += plan_notes
    updates, update_notes = update_entries(groups_split(groups, entries), config, stream,
                                           [model] + ([default] if default is not None else []))
    split = place_updates([e for e in entries if e.kind != "whole"], updates)
    if not split:
        raise DraftError(f"found no Column/Row pair in the blocks of {cls.__name__} (weights: "
                         f"{', '.join(e.module for e in entries) or 'none'}): write the mapping by hand")
    vocab, vocab_notes = vocab_parallel(model)
    source = ("its base_model_tp_plan (which decides how the modules it names are split) and the module structure"
              if tp_plan else "the module structure")
    header = [f"Draft by `tpmap draft {model_type}` (transformers {transformers.__version__}): from {source} of "
              f"{cls.__name__}, built on the meta device from the tiny config under verify. A start, not a proof: "
              "resolve the TODOs, then `tpmap lint FILE` and `tpmap verify FILE`."]
    d = Draft(model_type, cls.__name__, overrides, split, [e for e in entries if e.kind == "whole"],
              grad_allreduce, vocab, header, notes + update_notes + vocab_notes, patch)
    d.verify_world_sizes = supported_world_sizes(model, d.load(), [1, 2, 3, 4]) or [1]
    d.world_sizes = supported_world_sizes(default, d.load(), WORLD_SIZES) if default is not None else []
    if not d.world_sizes:
        d.world_sizes = d.verify_world_sizes
        d.notes.append("TODO: world_sizes are the tiny config's: " + (
            default_note or "the planner accepts no world size on the default config"))
    d.load()
    return d.render()
