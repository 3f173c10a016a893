"""What each worker process of `tpmap.parallelize` runs: load its shard once, then answer calls.

The handle (`tpmap/parallelize/handle.py`) sends these functions to every worker through
`tpmap.parallelize.rank_processes.Ranks`. A worker keeps the model it loaded in this module between calls
and runs each call as a torchrun rank would: the same function on the same arguments as every other worker,
checked first (`tpmap.parallelize.call_checks`) so that a bad call raises alike everywhere before any
collective. The outputs are the same on every rank (the logits are gathered, the tokens agree), so only
rank 0 sends them back: detached, on the CPU, without the cache (each worker holds only its own heads of it).
"""
from __future__ import annotations

import inspect

import torch
import torch.distributed as dist
from transformers.cache_utils import Cache
from transformers.generation.streamers import BaseStreamer
from transformers.utils import ModelOutput

from tpmap.checkpoint.load import from_pretrained
from tpmap.parallelize import rank_processes
from tpmap.parallelize.call_checks import check_forward, check_generate

_SPLIT_OUTPUTS = ("cache", "past_key_values")  # ModelOutput fields each worker holds its own part of


class _Loaded:
    """The model this worker loaded (one per worker process)."""
    model = None


def load(path, *, dtype, mapping, seed: int, timeout: float, kwargs: dict) -> dict | None:
    """Load this worker's shard with `tpmap.from_pretrained` (it reads only its own slices), then set the
    collective timeout calls run under. Rank 0 answers with the configs the driver's handle shows."""
    torch.manual_seed(seed)  # whatever the checkpoint lacks is initialized alike on every worker
    model = from_pretrained(path, device=rank_processes.this_device(), dtype=dtype, mapping=mapping, **kwargs)
    rank_processes.set_collective_timeout(timeout)
    _Loaded.model = model
    if dist.get_rank() != 0:
        return None
    return {"config": model.config, "generation_config": getattr(model, "generation_config", None)}


def generate(args: tuple, kwargs: dict, stream: bool):
    """model.generate on every worker; rank 0 returns the tokens (or the generate output), and with
    `stream` sends each step's tokens to the driver as they come."""
    model = _Loaded.model
    check_generate(model, args, kwargs)
    if stream:  # every worker gets a streamer, so every worker runs generate alike (beam search refuses one)
        kwargs = {**kwargs, "streamer": _Streamer(send=dist.get_rank() == 0)}
    device = rank_processes.this_device()
    out = model.generate(*_to(args, device), **_to(kwargs, device))
    return _portable(out) if dist.get_rank() == 0 else None


def forward(args: tuple, kwargs: dict):
    """The model's forward on every worker, without gradients and without a cache; rank 0 returns the
    outputs (the logits gathered once, by the vocabulary-parallel head, on every rank)."""
    model = _Loaded.model
    named = check_forward(model, args, kwargs)
    if "use_cache" not in named and "use_cache" in inspect.signature(model.forward).parameters:
        kwargs = {**kwargs, "use_cache": False}  # a cache would stay split across the workers, unused
    device = rank_processes.this_device()
    with torch.no_grad():
        out = model(*_to(args, device), **_to(kwargs, device))
    return _portable(out) if dist.get_rank() == 0 else None


def run(fn, args: tuple, kwargs: dict):
    """fn(model, *args, **kwargs) on this worker's model: `Parallelized.run`."""
    return fn(_Loaded.model, *args, **kwargs)


class _Streamer(BaseStreamer):
    """generate's streamer on a worker: rank 0's sends each `put` (the prompt, then each step's new tokens)
    to the driver at once; the others only keep their generate identical to rank 0's."""

    def __init__(self, send: bool):
        self.send = send

    def put(self, value) -> None:
        if self.send:
            rank_processes.progress(value.detach().cpu())

    def end(self) -> None:
        """Nothing to send: the driver ends its own streamer when the call's answer arrives."""


def _to(value, device: torch.device):
    """`value` with every tensor in it (through tuples, lists and dicts) moved to `device`."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, (list, tuple)):
        return type(value)(_to(v, device) for v in value)
    if isinstance(value, dict):
        return {k: _to(v, device) for k, v in value.items()}
    return value


def _portable(value):
    """`value` as the driver gets it: tensors detached and on the CPU, ModelOutputs without the cache,
    caches left out of tuples."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, Cache):
        return None
    if isinstance(value, ModelOutput):
        return type(value)(**{k: _portable(v) for k, v in value.items() if k not in _SPLIT_OUTPUTS})
    if isinstance(value, (list, tuple)):
        return type(value)(_portable(v) for v in value)
    if isinstance(value, dict):
        return {k: _portable(v) for k, v in value.items()}
    return value
