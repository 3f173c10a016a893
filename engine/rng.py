"""Dropout randomness under tensor parallelism: Megatron's model-parallel RNG, made checkpoint-safe.

* Replicated regions (everything outside a Column -> Row pair: embeddings, residual dropout, norms):
  every rank draws from the default generator in the same order with the same shapes, so with the
  same seed on all ranks their dropout masks, and so the replicated activations, are identical.
* Sharded regions (after a Column, before its Row: attention probabilities of this rank's heads, MLP
  activations of this rank's features): ranks must draw *different* numbers, or every rank's shard
  would get the same mask. On entering one in training mode, a seed is drawn from the default
  generator (the same draw on every rank, so the default streams stay in step), the generator is
  reseeded with a rank-specific function of it for the region, and the default stream is restored
  on leaving. Since the region's seed comes from the default stream, activation checkpointing, which
  replays the default stream, replays the same masks (Megatron needs its own checkpoint for that).

Regions are entered by `ColumnParallelLinear` (without gather_output) and left by `RowParallelLinear`,
only in training mode; in eval mode nothing is drawn or swapped. The Row leaves even when its product
raises: activation checkpointing stops a replay early by raising from the pack hook of the last tensor it
needs, which is usually a Row's input, and a region left open there would make every later replay and
step skip the reseeding (the masks of the sharded regions, and so the gradients, wrong). `RegionGuard`
makes sure no region outlives a forward of the model.

Under torch.compile: dynamo cannot put RNG state changes in a graph (it graph-breaks on
get/set_rng_state and manual_seed on purpose: AOT graphs drop them), and inductor draws a graph's
random numbers from seeds taken at the graph's start. So in a model with dropout (`has_dropout`),
entering and leaving a region run outside the graph (a graph break each), which keeps the masks
rank-specific with any backend; in a model without dropout (the usual LLM config) a compiled
training forward skips the swap, nothing being drawn inside. `DropoutWatch` tells which, per model.
"""
from __future__ import annotations

import contextlib
import threading

import torch
from torch import nn

_GOLDEN = 0x9E3779B97F4A7C15  # spreads rank offsets over the seed space
_state = threading.local()


def in_sharded_region() -> bool:
    return getattr(_state, "saved", None) is not None


class DropoutWatch:
    """Whether a model has dropout, for the compiled RNG region: scanned at apply and on every
    ``model.train(...)`` call (see `engine.shard`); a probability raised later without calling
    ``train()`` again is not seen. Eager forwards swap the generator in training mode regardless."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.present = has_dropout(model)

    def rescan(self) -> None:
        self.present = has_dropout(self.model)


def has_dropout(model: nn.Module) -> bool:
    """Any dropout probability above 0: a Dropout module's p, or a float attribute of a module or of
    its config whose name says dropout (``attention_dropout``, ``attn_pdrop``, ...)."""
    for module in model.modules():
        if isinstance(module, nn.modules.dropout._DropoutNd) and module.p > 0:
            return True
        config = getattr(module, "config", None)
        if isinstance(config, float) and config > 0:
            return True  # a probability stored as `config` (Idefics' gated cross-attention layer): assume dropout
        for holder in (module, config if hasattr(config, "__dict__") else None):
            for key, value in (vars(holder).items() if holder is not None else ()):
                if ("dropout" in key or "pdrop" in key) and isinstance(value, float) and value > 0:
                    return True
    return False


def enter_sharded_region(tp_rank: int, device: torch.device, watch: DropoutWatch | None = None) -> None:
    if torch.compiler.is_compiling():
        if watch is None or watch.present:
            _enter_outside_graph(tp_rank, device)
        return
    _enter(tp_rank, device)


def leave_sharded_region(watch: DropoutWatch | None = None) -> None:
    if torch.compiler.is_compiling():
        if watch is None or watch.present:
            _leave_outside_graph()
        return
    _leave()


def _enter(tp_rank: int, device: torch.device) -> None:
    if in_sharded_region():
        return  # q, k and v columns all open the same region
    seed = int(torch.randint(0, 2**62, (1,)).item())  # same draw on every rank
    cuda = device.type == "cuda"
    _state.saved = (torch.get_rng_state(), device, torch.cuda.get_rng_state(device) if cuda else None)
    region_seed = (seed + _GOLDEN * (tp_rank + 1)) % 2**63
    torch.default_generator.manual_seed(region_seed)
    if cuda:
        with torch.cuda.device(device):
            torch.cuda.manual_seed(region_seed)


def _leave() -> None:
    saved = getattr(_state, "saved", None)
    if saved is None:
        return
    cpu_state, device, cuda_state = saved
    torch.set_rng_state(cpu_state)
    if cuda_state is not None:
        torch.cuda.set_rng_state(cuda_state, device)
    _state.saved = None


@contextlib.contextmanager
def replicated_draws():
    """Draw from the default stream even inside a sharded region: for randomness applied to a replicated
    tensor there (a LoRA adapter's dropout on the input of k_proj, which runs after q_proj has opened the
    region), which must be the same on every rank. Outside a region it does nothing; inside, the region's
    generator state is set aside, the default stream's state (saved on entering) is used and saved back as
    advanced, and the region's state is restored."""
    saved = getattr(_state, "saved", None)
    if saved is None:
        yield
        return
    cpu_state, device, cuda_state = saved
    cuda = cuda_state is not None
    region = (torch.get_rng_state(), torch.cuda.get_rng_state(device) if cuda else None)
    torch.set_rng_state(cpu_state)
    if cuda:
        torch.cuda.set_rng_state(cuda_state, device)
    try:
        yield
    finally:
        _state.saved = (torch.get_rng_state(), device, torch.cuda.get_rng_state(device) if cuda else None)
        torch.set_rng_state(region[0])
        if cuda:
            torch.cuda.set_rng_state(region[1], device)


class RegionGuard:
    """No sharded region outlives a forward of the model: hooks on its root module.

    * ``close`` (a forward hook that runs even when the forward raises): a region an exception left open
      between a Column and its Row is left, restoring the default stream, so the ranks stay in step.
    * ``open`` (a pre-hook): a region still open when a forward starts is forgotten without restoring
      anything. Only a replay can leave one (a Row and a sequence-parallel block leave theirs even when they
      raise, as activation checkpointing does to stop a replay early), and the replay restores the default
      stream itself.

    Compiled forwards skip both: they enter and leave regions outside the graph, in pairs.
    """

    def open(self, *_):
        if not torch.compiler.is_compiling():
            _state.saved = None

    def close(self, *_):
        if not torch.compiler.is_compiling():
            _leave()


_enter_outside_graph = torch.compiler.disable(_enter, reason="tpmap: rank-specific RNG region (dropout)")
_leave_outside_graph = torch.compiler.disable(_leave, reason="tpmap: rank-specific RNG region (dropout)")
