"""Models on the meta device: shapes only, no memory, no weights, no process group.

What `tpmap lint` and `tpmap draft` build to read a model type's structure: its default config with
the layer counts cut down, and a model of each class on the meta device.
"""
from __future__ import annotations

import inspect
import re

import torch
from transformers import AutoConfig, PretrainedConfig

_LAYER_KEY = re.compile(r"layers")


def reduced_default_config(model_type: str, patch: dict | None = None):
    """The default config of `model_type` with every layer count (`num_hidden_layers` through the
    config's attribute_map, and any integer key containing 'layers', e.g. a decoder's; in its sub-configs
    too) at most 2.

    Hybrid stacks keep enough layers to hold one of each kind in the config's ``layer_types`` (the
    transformers convention for per-layer kinds): Jamba's first attention layer is layer 4, and with
    2 layers the attention entries of its mapping would match nothing.

    `patch`: the mapping's ``default_config`` (values transformers' own defaults lack to build at all)."""
    patch = dict(patch or {})
    config = AutoConfig.for_model(model_type, **patch)
    overrides = _fewer_layers(config)
    return AutoConfig.for_model(model_type, **{**patch, **overrides}) if overrides else config  # cut wins


def _fewer_layers(config) -> dict:
    """The overrides that cut `config`'s layer counts, its sub-configs' too (a multimodal model's
    text_config and vision_config, given back whole as dicts)."""
    overrides: dict = {k: 2 for k, v in config.to_dict().items()
                       if _LAYER_KEY.search(k) and type(v) is int and v > 2}
    if type(getattr(config, "num_hidden_layers", None)) is int and config.num_hidden_layers > 2:
        overrides["num_hidden_layers"] = max(2, _layers_for_every_kind(config))
    for key in getattr(config, "sub_configs", None) or {}:
        sub = getattr(config, key, None)
        inner = _fewer_layers(sub) if isinstance(sub, PretrainedConfig) else {}
        if inner:
            whole = sub.to_dict()
            n = inner.get("num_hidden_layers")
            if n is not None:  # what is given per layer keeps the first n layers' entries:
                # kind lists (layer_types, Step 3.5's mlp_layer_types), one per layer
                inner |= {k: v[:n] for k, v in whole.items() if k.endswith("layer_types") and isinstance(v, list)
                          and len(v) == whole.get("num_hidden_layers")}
                # settings keyed by layer index (Gemma 4's per_layer_config)
                inner |= {k: _first_layers(v, n) for k, v in whole.items() if _is_per_layer(k, v)}
            overrides[key] = {**whole, **inner}
    return overrides


def _is_per_layer(key: str, value) -> bool:
    """Whether a config value is a dict of settings keyed by layer index ({"11": {...}}) under a layer key."""
    return ("layer" in key and isinstance(value, dict) and bool(value)
            and all(str(k).lstrip("-").isdigit() for k in value))


def _first_layers(per_layer: dict, n: int) -> dict:
    """The entries of a per-layer dict for the first `n` layers (a negative index counts from the end: dropped)."""
    return {k: v for k, v in per_layer.items() if 0 <= int(k) < n}


def _layers_for_every_kind(config) -> int:
    """How many leading layers include every kind listed in ``config.layer_types`` (0 without one)."""
    try:
        kinds = config.layer_types
    except Exception:  # a property that cannot be computed for this config
        return 0
    if not isinstance(kinds, (list, tuple)) or len(kinds) != config.num_hidden_layers:
        return 0
    first: dict = {}
    for i, kind in enumerate(kinds):
        first.setdefault(str(kind), i)
    return max(first.values(), default=-1) + 1


def config_keys(config) -> set[str]:
    """Names a config accepts: its attributes, its attribute_map aliases and its __init__ parameters."""
    keys = set(config.to_dict()) | set(getattr(config, "attribute_map", {}))
    for cls in type(config).__mro__:
        init = cls.__dict__.get("__init__")
        if init is not None:
            keys |= {n for n, p in inspect.signature(init).parameters.items()
                     if n != "self" and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
    return keys


def build_meta(cls, config):
    with torch.device("meta"):  # shapes only: no memory, no weights read, nothing initialised
        return cls(config)


def auto_classes(model_type: str) -> set[str]:
    """Every class name that one of transformers' auto mappings (MODEL_*_MAPPING_NAMES) registers for
    `model_type`: a model type may reuse another's classes (transformers builds LlamaForCausalLM for
    InternLM3Config), which are then classes of this model type too."""
    from transformers.models.auto import modeling_auto

    out: set[str] = set()
    for name, table in vars(modeling_auto).items():
        if name.startswith("MODEL_") and name.endswith("_MAPPING_NAMES") and isinstance(table, dict):
            value = table.get(model_type)
            out.update([value] if isinstance(value, str) else value or ())
    return out
