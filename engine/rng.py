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
only in training mode; in eval mode nothing is drawn or swapped.
"""
from __future__ import annotations

import threading

import torch

_GOLDEN = 0x9E3779B97F4A7C15  # spreads rank offsets over the seed space
_state = threading.local()


def in_sharded_region() -> bool:
    return getattr(_state, "saved", None) is not None


def enter_sharded_region(tp_rank: int, device: torch.device) -> None:
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


def leave_sharded_region() -> None:
    saved = getattr(_state, "saved", None)
    if saved is None:
        return
    cpu_state, device, cuda_state = saved
    torch.set_rng_state(cpu_state)
    if cuda_state is not None:
        torch.cuda.set_rng_state(cuda_state, device)
    _state.saved = None
