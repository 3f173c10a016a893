"""An opt-in path for small all-reduces of CUDA tensors: torch's symmetric memory.

On GPUs NCCL stays the path. For the decode-sized messages of tensor parallelism (a few KiB to about a
MiB per all-reduce) NCCL's cost is its latency, not bandwidth; torch's symmetric memory
(`torch.distributed._symmetric_memory`) maps every rank's buffer into every peer's address space, and
its one-shot kernel (`symm_mem::one_shot_all_reduce_out`) reads the peers' buffers directly and sums them
in one kernel launch -- the technique of vLLM's and torchtitan's small-message all-reduce.

    TPMAP_SYMM_MEM=1              on (default: off)
    TPMAP_SYMM_MEM_MAX_BYTES=N    the largest message it takes (default 1 MiB); larger ones go to NCCL

* **Off by default.** The project has not measured it on hardware yet: `benchmarks/gpu_check.py
  --symm-mem` compares it with NCCL (latency per message size, and the same logits) where two or more
  GPUs are lent. CI has no GPU; on CPU tensors the switch changes nothing (engine.shm is their path).
* **What it takes.** CUDA tensors of float32, bfloat16 or float16 of at most MAX_BYTES on an NCCL group;
  everything else (larger messages, float64, the gathers) takes the usual path.
* **Set up per group, the same way on every rank** (`for_group`), at the group's first CUDA all-reduce:
  one symmetric buffer per dtype, then torch's rendezvous (a collective). The switch must be the same on
  every rank (torchrun passes one environment to all).
* **No silent fallback.** The switch asks for this path: where it cannot run (the group's backend is not
  NCCL, torch has no symmetric-memory ops, the rendezvous fails, e.g. without peer access between the
  GPUs), `SymmMemUnavailableError` says why, naming the group's ranks.
* **Summation order.** Each rank sums every rank's buffer in the kernel; NCCL's ring or tree sums in
  another order, so results differ from NCCL's by float rounding. gpu_check verifies that the ranks hold
  bit-identical results, which tensor parallelism needs (replicated activations must not drift).
* **Eager only.** Under torch.compile the functional collectives are traced as before (NCCL).
"""
from __future__ import annotations

import os
import weakref

import torch
import torch.distributed as dist

DEFAULT_MAX_BYTES = 1 << 20
DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # the dtypes of torch's one-shot kernel


class SymmMemUnavailableError(RuntimeError):
    """TPMAP_SYMM_MEM=1 where the symmetric-memory all-reduce cannot run (the reason is in the message)."""


def enabled() -> bool:
    """The switch: TPMAP_SYMM_MEM (unset or 0: off; 1: on)."""
    value = os.environ.get("TPMAP_SYMM_MEM", "0").strip().lower()
    if value in ("", "0", "off", "false", "no"):
        return False
    if value in ("1", "on", "true", "yes"):
        return True
    raise ValueError(f"TPMAP_SYMM_MEM={value!r}: use 1 (small CUDA all-reduces through torch's symmetric "
                     f"memory) or 0 (off, the default)")


def max_bytes() -> int:
    value = os.environ.get("TPMAP_SYMM_MEM_MAX_BYTES", str(DEFAULT_MAX_BYTES))
    try:
        n = int(value)
    except ValueError:
        n = -1
    if n <= 0:
        raise ValueError(f"TPMAP_SYMM_MEM_MAX_BYTES={value!r}: a positive number of bytes, e.g. {DEFAULT_MAX_BYTES}")
    return n


def obstacle(backend: str, has_ops: bool) -> str | None:
    """Why a group whose collectives run on `backend` cannot use the path (None: it can try)."""
    if backend != "nccl":
        return (f"the group's backend is {backend!r}; torch's symmetric memory needs an NCCL group with one GPU "
                f"per rank")
    if not has_ops:
        return f"this torch ({torch.__version__}) has no symm_mem ops (torch.ops.symm_mem.one_shot_all_reduce_out)"
    return None


def _has_ops() -> bool:
    try:
        torch.ops.symm_mem.one_shot_all_reduce_out  # noqa: B018 (the lookup raises where the ops are missing)
    except (AttributeError, RuntimeError):
        return False
    return True


class SymmGroup:
    """One group's symmetric buffers (MAX_BYTES each, one per dtype), rendezvoused with the peers."""

    def __init__(self, group, device: torch.device, limit: int):
        import torch.distributed._symmetric_memory as symm_mem

        self.group_name = group.group_name
        self.limit = limit
        self.buffers = {}
        for dtype in DTYPES:  # the same order on every rank: each rendezvous is a collective
            buffer = symm_mem.empty(limit // dtype.itemsize, dtype=dtype, device=device)
            symm_mem.rendezvous(buffer, group)
            self.buffers[dtype] = buffer

    def takes(self, t: torch.Tensor) -> bool:
        return t.dtype in self.buffers and t.numel() * t.element_size() <= self.limit

    def all_reduce_(self, t: torch.Tensor) -> torch.Tensor:
        """The sum over the group, into t (contiguous): copy into this rank's buffer, one kernel reads all."""
        flat = t.view(-1)
        staged = self.buffers[t.dtype][: flat.numel()]  # (N,) in symmetric memory
        staged.copy_(flat)
        torch.ops.symm_mem.one_shot_all_reduce_out(staged, "sum", self.group_name, flat)
        return t


_GROUPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # group -> SymmGroup, weakly as engine.shm's


def for_group(t: torch.Tensor, group) -> SymmGroup | None:
    """The path for an all-reduce of CUDA tensor t on `group`, or None (NCCL). Set up at the group's first
    CUDA all-reduce while the switch is on; refuses with SymmMemUnavailableError where it cannot run."""
    if not enabled():
        return None
    group = group if group is not None else dist.group.WORLD
    if group not in _GROUPS:
        reason = obstacle(str(dist.get_backend(group)), _has_ops())
        if reason is None:
            try:
                _GROUPS[group] = SymmGroup(group, t.device, max_bytes())
            except RuntimeError as e:  # torch's own reason (no peer access between the GPUs, ...)
                reason = f"torch's rendezvous failed: {e}"
        if reason is not None:
            raise SymmMemUnavailableError(
                f"TPMAP_SYMM_MEM=1 but the symmetric-memory all-reduce cannot run for the group of ranks "
                f"{dist.get_process_group_ranks(group)}: {reason}. Unset TPMAP_SYMM_MEM (or set it to 0) to use NCCL.")
    chosen = _GROUPS[group]
    return chosen if chosen.takes(t) else None
