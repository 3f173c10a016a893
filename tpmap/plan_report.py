"""`tpmap plan DIR_OR_CONFIG -n N`: what tensor parallelism does to *your* model, before running anything.

From a checkpoint folder (its config.json) or a config.json file, on the meta device (no weights read, no memory):
the mapping chosen, each rank's share and bytes of the weights, of the KV cache at a given length, the world sizes
that work for this config (not for the mapping's tiny ones), and the collectives of one forward.

    tpmap plan path/to/llama -n 2 --seq-len 8192

The KV-cache figure is the standard attention cache, 2 x layers x this rank's key/value heads x head_dim x length x
bytes per element, for a batch of 1; latent attention (MLA), sliding windows and SSM states store other shapes, and
the line says so where the config has no key/value heads to count.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers
from transformers import AutoConfig

from tpmap.api import plan as make_plan
from tpmap.language import expr
from tpmap.language.errors import TpmapError
from tpmap.language.source import for_model_type, read_file

MAX_WORLD_SIZE = 16  # the world sizes tried for "world sizes that work"


def is_user_config(arg: str) -> bool:
    """A checkpoint folder (holding config.json) or a .json file, as opposed to a model type or mapping file."""
    p = Path(arg)
    return (p.is_dir() and (p / "config.json").is_file()) or (p.is_file() and p.suffix == ".json")


def load_config(arg: str):
    p = Path(arg)
    if p.is_dir():
        return AutoConfig.from_pretrained(p)
    data = json.loads(p.read_text(encoding="utf-8"))
    if "model_type" not in data:
        raise ValueError(f"{arg}: a config.json needs a 'model_type' (transformers writes one with save_pretrained)")
    return AutoConfig.for_model(data.pop("model_type"), **data)


def _model_class(config, loaded, override: str | None):
    architectures = getattr(config, "architectures", None) or []
    names = [override] if override else [*architectures, *loaded.mapping.verify[0].models]
    for name in names:
        cls = getattr(transformers, name, None)
        if cls is not None:
            return cls
        if override:
            raise ValueError(f"--model-class {override!r} is not a transformers class")
    raise ValueError(f"no transformers class for {config.model_type!r}: pass --model-class")


def report(arg: str, world_size: int, *, mapping: str | None = None, model_class: str | None = None,
           dtype: str | None = None, seq_len: int = 4096) -> str:
    """The report's text (see the module docstring). Raises TpmapError where world size `world_size` cannot
    serve the config, after naming the world sizes that can."""
    config = load_config(arg)
    loaded = read_file(mapping) if mapping else for_model_type(config.model_type)
    cls = _model_class(config, loaded, model_class)
    with torch.device("meta"):  # shapes only
        model = cls(config)
    dt = getattr(torch, dtype) if dtype else config_dtype(config)
    size = dt.itemsize
    works = world_sizes_that_work(model, loaded)
    lines = [f"# {arg}: {config.model_type} ({cls.__name__}), mapping {loaded.source.path}",
             f"# world sizes that work for this config (of 1-{MAX_WORLD_SIZE}): {', '.join(map(str, works)) or 'none'}"]
    try:
        plan = make_plan(model, world_size, mapping=loaded)
    except TpmapError as e:
        raise type(e)(f"{e}\n(world sizes that work for this config: {', '.join(map(str, works))})") from None
    full = {name: p.numel() for name, p in model.named_parameters()}
    total = sum(full.values())
    shares = plan.rank_shares(full)
    kv = kv_cache_bytes(config, world_size, seq_len, size)
    full_kv = kv_cache_bytes(config, 1, seq_len, size)
    lines.append(f"# world size {world_size}, {dt} ({size} bytes per element), {total:,} parameters "
                 f"({gib(total * size)} unsharded" + (f"; KV cache {gib(full_kv[0])}" if full_kv else "") + ")")
    for r, share in enumerate(shares):
        heads = f", {plan.rank_heads()[r]} query heads" if plan.heads else ""
        cache = f", KV cache at {seq_len} tokens {gib(kv[r])}" if kv else ""
        lines.append(f"rank {r}: weights {share:.1%} = {gib(share * total * size)}{heads}{cache}")
    if not kv:
        lines.append("# KV cache: not estimated (the config has no num_key_value_heads/num_attention_heads and "
                     "head_dim to count)")
    lines.append(f"# collectives per forward: {collectives(plan)}")
    return "\n".join(lines)


def world_sizes_that_work(model, loaded) -> list[int]:
    out = []
    for ws in range(1, MAX_WORLD_SIZE + 1):
        try:
            make_plan(model, ws, mapping=loaded)
        except TpmapError:
            continue
        out.append(ws)
    return out


def kv_cache_bytes(config, world_size: int, seq_len: int, size: int) -> list[int] | None:
    """Per rank: the standard attention KV cache for one sequence of `seq_len` tokens, or None where the text config
    has no heads to count."""
    text = config.get_text_config()
    q = getattr(text, "num_attention_heads", None)
    layers = getattr(text, "num_hidden_layers", None)
    if not isinstance(q, int) or not isinstance(layers, int):
        return None
    kv = getattr(text, "num_key_value_heads", None) or q
    head_dim = getattr(text, "head_dim", None) or getattr(text, "hidden_size", 0) // q
    held = [expr.rank_heads(kv, world_size, r, query=q) for r in range(world_size)]
    if not head_dim or any(h is None for h in held):
        return None
    return [2 * layers * len(h) * head_dim * seq_len * size for h in held]


def collectives(plan) -> str:
    """The collectives one forward runs, from the plan (each module called once): all-reduces after Rows, Reduces,
    the vocab-parallel embedding and split norms; all-gathers of gathered outputs."""
    styles = [m.style for m in plan.modules]
    reduce = {"Row outputs": styles.count("row"), "Reduce outputs": len(plan.reduces),
              "vocab-parallel embedding": styles.count("vocab_embedding"),
              "norm statistics (split features)": styles.count("norm")}
    gathers = sum(m.gather_output for m in plan.modules)
    parts = ", ".join(f"{n} {what}" for what, n in reduce.items() if n)
    return f"{sum(reduce.values())} all-reduce(s) ({parts or 'none'}), {gathers} all-gather(s)"


def config_dtype(config) -> torch.dtype:
    """The dtype a checkpoint's config names (a torch.dtype or its name), float32 where it names none."""
    dt = getattr(config, "dtype", None) or torch.float32
    return getattr(torch, dt) if isinstance(dt, str) else dt


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**26 else f"{n / 2**20:.1f} MiB"
