"""Functions the tests run on every rank of a RankPool (importable by name in the rank processes).
Each one computes the unsharded reference itself, in the same run, and returns plain data."""
from __future__ import annotations

import copy
import time

import torch
import torch.distributed as dist

import tpmap
from tpmap import verify


def state_signature(model: torch.nn.Module) -> dict:
    """Everything a failed apply must leave untouched: names, shapes, values, module classes, config."""
    return {
        "params": {k: (tuple(v.shape), v.detach().clone()) for k, v in model.state_dict().items()},
        "classes": {n: type(m).__name__ for n, m in model.named_modules()},
        "config": model.config.to_dict(),
    }


def same_signature(a: dict, b: dict) -> bool:
    return (
        a["classes"] == b["classes"]
        and a["config"] == b["config"]
        and a["params"].keys() == b["params"].keys()
        and all(a["params"][k][0] == b["params"][k][0] and torch.equal(a["params"][k][1], b["params"][k][1])
                for k in a["params"])
    )


def apply_error(ref: str, class_name: str, world_size: int | None, mapping_text: str | None = None,
                twice: bool = False) -> dict:
    """apply() that is expected to fail: the error type/message, and whether the model stayed as it was."""
    model = verify.build_model(ref, 0, class_name)
    mapping = None
    if mapping_text is not None:
        from tpmap.loader import load_text
        mapping = load_text(mapping_text, "<test mapping>")
    if twice:
        tpmap.apply(model, dist.get_world_size(), mapping=mapping)
    before = state_signature(model)
    try:
        tpmap.apply(model, world_size, mapping=mapping)
    except ValueError as e:
        return {"error": type(e).__name__, "message": str(e), "untouched": same_signature(before, state_signature(model))}
    return {"error": None, "message": "", "untouched": same_signature(before, state_signature(model))}


def crash_on_rank(rank_to_fail: int) -> int:
    if dist.get_rank() == rank_to_fail:
        raise RuntimeError(f"deliberate failure on rank {rank_to_fail}")
    return dist.get_rank()


def hang_unless_rank0() -> int:
    """Rank 0 returns; the others wait in an all-reduce that rank 0 never joins."""
    if dist.get_rank() != 0:
        dist.all_reduce(torch.ones(1))
    return dist.get_rank()


def rank_and_size() -> tuple[int, int]:
    return dist.get_rank(), dist.get_world_size()


def sleep_then_rank(seconds: float) -> int:
    time.sleep(seconds)
    return dist.get_rank()


def untouched_after_failed_apply_in_group(ref: str, class_name: str) -> dict:
    """A world size different from the group's must fail before anything changes."""
    return apply_error(ref, class_name, dist.get_world_size() + 1)


def gather_output_case() -> float:
    """A Column with gather_output on fused [q|k|v] returns the full output in the original order."""
    loaded = verify.resolve("gpt2")
    entries = list(loaded.mapping.entries)
    entries[0] = entries[0].model_copy(update={"gather_output": True})
    loaded.mapping = loaded.mapping.model_copy(update={"entries": entries})
    full = verify.build_model("gpt2", 0, "GPT2LMHeadModel")
    sharded = tpmap.apply(copy.deepcopy(full), dist.get_world_size(), mapping=loaded)
    x = torch.randn(2, 5, full.config.n_embd, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = full.transformer.h[0].attn.c_attn(x)
        got = sharded.transformer.h[0].attn.c_attn(x)
    return (want - got).abs().max().item()
