"""Steps 1 and 2 of a draft: the tiny config (sizes cut down by key name) and the model class, built
on the meta device."""
from __future__ import annotations

import re
from typing import Any

import transformers
from transformers import AutoConfig
from transformers.models.auto import modeling_auto

from tpmap.draft.names import (
    CAPPED,
    CLASS_MAPPINGS,
    CLASS_SUFFIXES,
    CONFIG_KEYS,
    SPECIAL_TOKENS,
    TINY,
)
from tpmap.language import source
from tpmap.language.errors import did_you_mean
from tpmap.meta import auto_classes, reduced_default_config
from tpmap.meta import build_meta as build_meta_model
from tpmap.tool_errors import DraftError


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
        elif ((type(value) is not int and not (value is None and kind in TINY and kind not in CAPPED))
              or (kind == "layers" and not reduce_layers) or (not widths and (kind in WIDTH_KINDS or kind is None))):
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
    files = source.shipped_files()
    return dict(source.read_file(files[model_type]).mapping.default_config) if model_type in files else {}


# -- 2. the model class ---------------------------------------------------------------------------
def model_class(model_type: str, config) -> type:
    """The most useful class: seq2seq LM (encoder-decoders), masked LM, causal LM, then the base model,
    from transformers' auto mappings; else named after the config class (FooConfig -> FooModel)."""
    names: list[str] = []
    for table in CLASS_MAPPINGS:
        if table.startswith("MODEL_FOR_SEQ_TO_SEQ") and not getattr(config, "is_encoder_decoder", False):
            continue
        found = getattr(modeling_auto, table).get(model_type)
        names += [found] if isinstance(found, str) else list(found or ())
    stem = type(config).__name__.removesuffix("Config")
    names += [stem + suffix for suffix in CLASS_SUFFIXES]
    registered = auto_classes(model_type)  # a model type may reuse another's classes (InternLM3 -> Llama)
    for name in names:
        cls = getattr(transformers, name, None)
        config_type = getattr(getattr(cls, "config_class", None), "model_type", None)
        if isinstance(cls, type) and (config_type == model_type or name in registered):
            return cls
    raise DraftError(f"no model class of transformers is registered for model_type {model_type!r} "
                     f"(tried {', '.join(names)})")


def build_meta(cls, config, which: str = "the tiny config"):

    try:
        return build_meta_model(cls, config)
    except Exception as e:  # a transformers constructor failing on this config: reported, not hidden
        raise DraftError(f"building {cls.__name__} from {which} failed: {type(e).__name__}: {e}") from e


def default_model(model_type: str, cls, patch: dict):
    """(the class built from the default config with layers cut to 2, as `tpmap lint` builds it, or
    None; a note saying why not)."""
    try:
        config = reduced_default_config(model_type, patch)
    except Exception as e:  # the config class refusing the layer cut: reported in the draft
        return None, f"the default config with 2 layers is rejected ({type(e).__name__}: {e})"
    try:
        return build_meta(cls, config, "the default config"), ""
    except DraftError as e:
        return None, str(e)
