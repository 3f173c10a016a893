"""What a call through a `tpmap.parallelize` handle is checked for, on every worker, before the model runs.

Every worker runs the same checks on the same arguments, so a mistake raises the same error on every
worker before any collective: the workers stay in step and the handle stays usable. The checks catch
what would otherwise go wrong quietly, or later:

* token ids outside the vocabulary: the unsharded model raises an IndexError, but a vocabulary-parallel
  embedding looks such ids up as zero rows on every rank and answers with garbage;
* a keyword the model does not take (a typo): transformers' forwards pass unknown keywords on to
  attention code that ignores them. What counts as taken is transformers' own rule for generate's model
  arguments: the forward's parameters and the model-agnostic `TransformersKwargs`;
* outputs that stay split across the workers: the cache (each worker holds its own heads' keys and
  values) and attention weights (its own heads). generate keeps its cache inside the workers.
"""
from __future__ import annotations

import inspect

import torch
from torch import nn
from transformers.utils.generic import TransformersKwargs

from tpmap.language.errors import did_you_mean
from tpmap.parallelize.errors import InvalidCallError

_ID_INPUTS = ("input_ids", "decoder_input_ids")  # token-id arguments checked against the vocabulary
_CACHE_INPUTS = ("cache", "past_key_values")  # transformers 5's name and the one it still accepts
# taken without being in a forward's signature: by transformers' output decorators, or renamed (the cache)
_TAKEN_ANYWAY = {"return_dict", *_CACHE_INPUTS}


def check_forward(model: nn.Module, args: tuple, kwargs: dict) -> dict:
    """Refuse a forward call that would answer wrongly or return split outputs; the call's arguments by name."""
    named = _bind(model.forward, args, kwargs, "forward")
    for name in _CACHE_INPUTS:
        if named.get(name) is not None:
            raise InvalidCallError(f"forward got {name}=...: a cache cannot come from the driver, each worker "
                                   "holds its own heads' part of it; use generate(), which keeps it in the workers")
    if named.get("use_cache"):
        raise InvalidCallError("forward got use_cache=True: the cache would stay split across the workers (each "
                               "holds its own heads) and is not returned; use generate(), which keeps it there")
    _check_attentions(named, "forward")
    _check_ids(model, named)
    return named


def check_generate(model: nn.Module, args: tuple, kwargs: dict) -> None:
    """Refuse a generate call with ids outside the vocabulary, a cache, or attention weights asked for."""
    named = _bind(model.generate, args, kwargs, "generate", strict=False)
    for name in _CACHE_INPUTS:
        if named.get(name) is not None:
            raise InvalidCallError(f"generate got {name}=...: a cache cannot come from the driver (each worker "
                                   "holds its own heads' part of it)")
    _check_attentions(named, "generate")
    if named.get("inputs") is not None and getattr(model, "main_input_name", "input_ids") == "input_ids":
        named.setdefault("input_ids", named["inputs"])
    _check_ids(model, named)


def _bind(method, args: tuple, kwargs: dict, what: str, *, strict: bool = True) -> dict:
    """The call's arguments by name. Raises TypeError as Python would for a wrong call and, with `strict`,
    for a keyword the model does not take (that a ``**kwargs`` would otherwise swallow)."""
    signature = inspect.signature(method)
    bound = signature.bind(*args, **kwargs)  # TypeError: too many positional arguments, a name given twice
    named = {k: v for k, v in bound.arguments.items() if signature.parameters[k].kind != inspect.Parameter.VAR_KEYWORD}
    extra = next((v for k, v in bound.arguments.items()
                  if signature.parameters[k].kind == inspect.Parameter.VAR_KEYWORD), {})
    if strict:
        taken = set(signature.parameters) | TransformersKwargs.__optional_keys__ | _TAKEN_ANYWAY
        unknown = sorted(k for k in extra if k not in taken)
        if unknown:
            raise TypeError(f"{what}() got an unexpected keyword argument {unknown[0]!r}"
                            f"{did_you_mean(unknown[0], taken)}; the model takes: "
                            f"{', '.join(p for p in signature.parameters if p != 'kwargs')}")
    return named | extra


def _check_attentions(named: dict, what: str) -> None:
    if named.get("output_attentions"):
        raise InvalidCallError(f"{what} got output_attentions=True: each worker holds only its own heads' "
                               "attention weights, so they are not returned")


def _check_ids(model: nn.Module, named: dict) -> None:
    """Every token id in [0, vocabulary size), as the unsharded embedding requires."""
    vocab = _vocabulary_size(model)
    if vocab is None:
        return
    for name in _ID_INPUTS:
        ids = named.get(name)
        if not isinstance(ids, torch.Tensor) or ids.numel() == 0 or ids.is_floating_point():
            continue
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high >= vocab:
            bad = high if high >= vocab else low
            raise InvalidCallError(f"{name} holds id {bad}, outside the vocabulary [0, {vocab}): the unsharded "
                                   "model would raise an IndexError; the vocabulary-parallel one would look it "
                                   "up as zeros")


def _vocabulary_size(model: nn.Module) -> int | None:
    """The full vocabulary (a vocabulary-parallel embedding keeps the full size in ``num_embeddings``), else
    the config's; None for a model with neither (no token ids to check)."""
    try:
        rows = getattr(model.get_input_embeddings(), "num_embeddings", None)
    except NotImplementedError:  # transformers' answer for a model without token embeddings
        rows = None
    if isinstance(rows, int):
        return rows
    vocab = getattr(model.config.get_text_config(), "vocab_size", None)
    return vocab if isinstance(vocab, int) else None
