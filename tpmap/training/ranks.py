"""Where this rank stands in the run -- tensor-parallel group, data-parallel group -- and how the ranks agree on
a failure: every rank raises the same error, or none does."""
from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch import nn

from tpmap.api import group_of
from tpmap.prepare import process_group
from tpmap.training.errors import TrainingCheckpointError
from tpmap.training.layout import base_model, plan_of


@dataclass(frozen=True)
class Shape:
    tp_rank: int
    tp_size: int
    dp_rank: int
    dp_size: int
    rank: int  # in the default group (every rank of the run)
    world: int

    @classmethod
    def of(cls, model: nn.Module, dp_group) -> Shape:
        """`model` unwrapped (not DDP); `dp_group`: the data-parallel ProcessGroup or 1-D DeviceMesh, or None."""
        on = dist.is_available() and dist.is_initialized()
        plan = plan_of(model)
        tp_size = plan.tp_size if plan is not None else 1
        tp_rank = dist.get_rank(group_of(base_model(model))) if plan is not None else 0
        dp = process_group(dp_group) if dp_group is not None else None
        dp_size, dp_rank = (dist.get_world_size(dp), dist.get_rank(dp)) if dp is not None else (1, 0)
        rank, world = (dist.get_rank(), dist.get_world_size()) if on else (0, 1)
        if tp_size * dp_size != world:
            raise TrainingCheckpointError(
                f"the run has {world} ranks but the model is tensor-parallel over {tp_size} and dp_group has "
                f"{dp_size}: under data parallelism pass dp_group= (the data-parallel group or mesh['dp']), so that "
                "tp x dp covers every rank")
        return cls(tp_rank, tp_size, dp_rank, dp_size, rank, world)


def _on() -> bool:
    return dist.is_available() and dist.is_initialized()


def barrier() -> None:
    if _on():
        dist.barrier()


def all_gather(value) -> list:
    if not _on():
        return [value]
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def agree(error: Exception | None) -> None:
    """A collective: raise on every rank if any rank failed -- its own error on the failing rank, a
    TrainingCheckpointError with the first failure's message on the others."""
    failures = [(r, m) for r, m in enumerate(all_gather(None if error is None else str(error))) if m is not None]
    if not failures:
        return
    if error is not None:
        raise error
    rank, message = failures[0]
    raise TrainingCheckpointError(f"rank {rank} failed: {message}")
