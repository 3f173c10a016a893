"""Rank processes for tests/test_shm.py: the shared-memory collectives (tpmap.engine.shm) on their own gloo
groups, started per test (they must die, hang and disagree on purpose, which the shared rank pools must not).
Each process runs `main`, which puts (rank, result or the exception's type and message) on a queue."""
from __future__ import annotations

import os
import time
import traceback

import torch
import torch.distributed as dist


def main(rank: int, ws: int, port: int, scenario: str, env: dict, queue) -> None:
    os.environ.update(env)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=ws)
    try:
        queue.put((rank, "ok", globals()[scenario](rank, ws)))
    except Exception as e:  # reported to the test, which asserts on it
        queue.put((rank, type(e).__name__, f"{e}\n{traceback.format_exc()}"))
    finally:
        if scenario not in ("dead_peer", "hanging_peer"):
            dist.destroy_process_group()
        queue.close()
        queue.join_thread()  # the result is written to the pipe before the process ends
        os._exit(0)  # skip interpreter teardown (seconds)


def _rank_order_sum(parts: list[torch.Tensor]) -> torch.Tensor:
    """The oracle: ((x0 + x1) + x2) + ..., elementwise, what the shared-memory all-reduce promises; bf16 parts are
    added in float32 and the sum rounded to bf16 once."""
    if parts[0].dtype == torch.bfloat16:
        acc = parts[0].float()
        for p in parts[1:]:
            acc = acc + p.float()
        return acc.to(torch.bfloat16)
    out = parts[0].clone()
    for p in parts[1:]:
        out = out + p
    return out


def _everyone(t: torch.Tensor, group=None) -> list[torch.Tensor]:
    """Every rank's tensor, through gloo's all_gather (the reference path)."""
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return parts


def exact(rank: int, ws: int) -> dict:
    """all-reduce, all-gather and reduce-scatter through shared memory, against gloo's all_gather of the inputs
    and the rank-order sum, over dtypes and sizes that need many chunks (TPMAP_SHM_SLOT_BYTES is small);
    then 300 back-to-back all-reduces whose values change every call (a buffer reused too early shows)."""
    from tpmap.engine import collectives as C
    from tpmap.engine import shm

    chosen = shm.for_group(None) is not None
    bad = []
    g = torch.Generator().manual_seed(rank)
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.int64):
        for n in (1, 5, 1000, 7001):
            x = (torch.randn(n, generator=g) * 100).to(dtype)
            parts = _everyone(x)
            got = C._all_reduce(x, None)
            want = _rank_order_sum(parts)
            gloo = x.clone()
            dist.all_reduce(gloo)
            if not torch.equal(got, want):
                bad.append(("all_reduce", str(dtype), n))
            if ws == 2 and not torch.equal(got, gloo):
                bad.append(("all_reduce vs gloo", str(dtype), n))
            if not torch.equal(C._all_gather(x.view(1, n), None), torch.cat(parts).view(1, ws * n)):
                bad.append(("all_gather", str(dtype), n))
            rows = (torch.randn(3, 400, 7, generator=g) * 100).to(dtype)  # many rows a chunk, many chunks
            if not torch.equal(C._all_gather(rows, None), torch.cat(_everyone(rows), dim=-1)):
                bad.append(("all_gather rows", str(dtype), n))
            if not torch.equal(C.all_gather_stacked(rows, None), torch.stack(_everyone(rows))):
                bad.append(("all_gather_stacked", str(dtype), n))
            if not torch.equal(C._all_gather_along(x.view(n, 1), None, 0), torch.cat(parts).view(ws * n, 1)):
                bad.append(("all_gather_along", str(dtype), n))
            y = (torch.randn(ws * 3, n, generator=g) * 100).to(dtype)
            rows = _rank_order_sum(_everyone(y))[rank * 3 : (rank + 1) * 3]
            if not torch.equal(C._reduce_scatter_along(y, None, 0), rows):
                bad.append(("reduce_scatter", str(dtype), n))
    for i in range(300):
        x = torch.full((257,), float(rank * 1000 + i))  # integers: exact sums whatever the order
        want = float(sum(r * 1000 + i for r in range(ws)))
        if not torch.equal(C._all_reduce(x, None, fresh=True), torch.full((257,), want)):
            bad.append(("stress", i))
            break
    return {"chosen": chosen, "bad": bad}


def groups(rank: int, ws: int) -> dict:
    """dp x tp on 4 ranks: tp groups [0, 1], [2, 3] and dp groups [0, 2], [1, 3], collectives interleaved on both;
    each group gets its own segment."""
    from tpmap.engine import collectives as C
    from tpmap.engine import shm

    tp = [dist.new_group([0, 1]), dist.new_group([2, 3])][rank // 2]
    dp = [dist.new_group([0, 2]), dist.new_group([1, 3])][rank % 2]
    handles = (shm.for_group(tp).handle, shm.for_group(dp).handle)
    bad = []
    for i in range(50):
        a = C._all_reduce(torch.full((33,), float(rank + i)), tp)
        b = C._all_reduce(torch.full((5000,), float(10 * rank + i)), dp)
        tp_ranks, dp_ranks = [rank // 2 * 2, rank // 2 * 2 + 1], [rank % 2, rank % 2 + 2]
        if not torch.equal(a, torch.full((33,), float(sum(r + i for r in tp_ranks)))):
            bad.append(("tp", i))
        if not torch.equal(b, torch.full((5000,), float(sum(10 * r + i for r in dp_ranks)))):
            bad.append(("dp", i))
    whole = C._all_reduce(torch.ones(3), None)  # the world group too, after the others
    return {"handles": handles, "bad": bad, "world": whole.tolist()}


def released(rank: int, ws: int) -> dict:
    """A group that took the shared-memory path (and a set_timeout) is freed by destroy_process_group: tpmap's
    tables must not keep it alive until interpreter shutdown, where its gloo threads' teardown can abort."""
    import gc
    import weakref

    from tpmap.engine import collectives as C
    from tpmap.engine import shm

    group = dist.new_group(list(range(ws)))
    shm.set_timeout(30.0, group)
    total = C._all_reduce(torch.ones(8), group)
    ref, chosen = weakref.ref(group), shm.chosen(group) is not None
    del group
    dist.destroy_process_group()
    gc.collect()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{os.environ['TPMAP_TEST_PORT2']}", rank=rank,
                            world_size=ws)  # main's finally destroys a group
    return {"chosen": chosen, "total": total.tolist(), "alive": ref() is not None}


def _timed_all_reduce() -> dict:
    """One all-reduce a peer will not join: how long until ShmPeerError, and its message (None: no error)."""
    from tpmap.engine import collectives as C
    from tpmap.engine import shm

    start = time.monotonic()
    try:
        C._all_reduce(torch.ones(4), None)
    except shm.ShmPeerError as e:
        return {"seconds": time.monotonic() - start, "message": str(e)}
    return {"seconds": time.monotonic() - start, "message": None}


def dead_peer(rank: int, ws: int) -> dict:
    """The last rank dies after the path is chosen; the others must raise ShmPeerError naming it, quickly."""
    from tpmap.engine import collectives as C
    from tpmap.engine import shm

    assert shm.for_group(None) is not None
    C._all_reduce(torch.ones(4), None)
    if rank == ws - 1:
        os._exit(3)
    return _timed_all_reduce()


def out_of_step(rank: int, ws: int) -> dict:
    """Rank 0 all-reduces 3 elements, the others 4: an error on every rank, not a sum of mismatched slots."""
    from tpmap.engine import collectives as C

    C._all_reduce(torch.ones(3 if rank == 0 else 4), None)
    return {}


def hanging_peer(rank: int, ws: int) -> dict:
    """The last rank never arrives; the others raise after TPMAP_SHM_TIMEOUT naming it."""
    from tpmap.engine import shm

    assert shm.for_group(None) is not None
    if rank == ws - 1:
        time.sleep(30)
        return {}
    return _timed_all_reduce()


def mixed_hosts(rank: int, ws: int) -> dict:
    """Rank 1 reports another host: the path is not chosen (TPMAP_SHM unset: gloo runs, right) or refused
    (TPMAP_SHM=1: ShmUnavailableError on every rank)."""
    from tpmap.engine import collectives as C
    from tpmap.engine import shm

    if rank == 1:
        shm.host_identity = lambda: "elsewhere:boot:1"
    chosen = shm.for_group(None)
    total = C._all_reduce(torch.full((3,), float(rank)), None)
    return {"chosen": chosen is not None, "total": total.tolist()}


def segment(rank: int, ws: int) -> dict:
    """Where the segment lives: a memfd mapped by every rank, with no name in /dev/shm."""
    from tpmap.engine import shm

    before = set(os.listdir("/dev/shm"))
    chosen = shm.for_group(None) is not None
    with open("/proc/self/maps") as f:
        maps = [line.split(None, 5)[-1].strip() for line in f if "tpmap-shm" in line]
    return {"chosen": chosen, "maps": sorted(set(maps)), "new_in_dev_shm": sorted(set(os.listdir("/dev/shm")) - before),
            "pid": os.getpid()}


def off(rank: int, ws: int) -> dict:
    from tpmap.engine import shm

    return {"chosen": shm.for_group(None) is not None}


def model_both_paths(rank: int, ws: int) -> dict:
    """A tiny Llama sharded twice over the same ranks, once on a group that takes the shared-memory path and
    once on one that stays on gloo (TPMAP_SHM=0 when it is first used): logits, per-shard gradients and
    greedy tokens of the two agree with each other (bit for bit at ws 2, where a + b == b + a) and with
    the unsharded model."""
    from transformers import AutoConfig, AutoModelForCausalLM

    import tpmap
    from tpmap.engine import shm

    cfg = AutoConfig.for_model("llama", hidden_size=96, num_attention_heads=12, num_key_value_heads=6,
                               intermediate_size=192, num_hidden_layers=2, vocab_size=256,
                               max_position_embeddings=64, initializer_range=0.2)
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(cfg)
    ids = torch.randint(0, 256, (2, 9))
    fast, slow = dist.new_group(list(range(ws))), dist.new_group(list(range(ws)))
    os.environ["TPMAP_SHM"] = "0"
    shm.for_group(slow)
    os.environ["TPMAP_SHM"] = "auto"
    out = {}
    for name, group in (("shm", fast), ("gloo", slow)):
        model = AutoModelForCausalLM.from_config(cfg)
        model.load_state_dict(ref.state_dict())
        tpmap.apply(model, group=group)
        logits = model(input_ids=ids).logits
        logits.float().pow(2).mean().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        tokens = model.generate(ids, max_new_tokens=5, do_sample=False)
        out[name] = (logits.detach(), grads, tokens)
    want = ref(input_ids=ids).logits
    rel = ((out["shm"][0] - want).abs().max() / want.abs().max()).item()
    same_logits = torch.equal(out["shm"][0], out["gloo"][0])
    grads_equal = all(torch.equal(out["shm"][1][n], out["gloo"][1][n]) for n in out["shm"][1])
    fast_g, slow_g = out["shm"][1], out["gloo"][1]
    grad_rel = max(((fast_g[n] - slow_g[n]).abs().max() / slow_g[n].abs().max().clamp_min(1e-30)).item()
                   for n in fast_g)
    return {"chosen": (shm.chosen(fast) is not None, shm.chosen(slow) is not None), "rel": rel,
            "same_logits": same_logits, "grads_equal": grads_equal, "grad_rel": grad_rel,
            "same_tokens": torch.equal(out["shm"][2], out["gloo"][2]),
            "tokens_vs_unsharded": torch.equal(out["shm"][2], ref.generate(ids, max_new_tokens=5, do_sample=False))}


def symm_mem_switch(rank: int, ws: int) -> dict:
    """TPMAP_SYMM_MEM=1 (torch's symmetric memory, engine.symm_mem) on a gloo group: asked for directly, it
    refuses with the reason; CPU all-reduces through the engine ignore it (their path is engine.shm or gloo)."""
    from tpmap.engine import collectives as C
    from tpmap.engine import symm_mem

    try:
        symm_mem.for_group(torch.zeros(4), None)
        refused = None
    except symm_mem.SymmMemUnavailableError as e:
        refused = str(e)
    x = torch.arange(6, dtype=torch.float32) * (rank + 1)
    total = C.all_reduce_(x.clone(), None)
    return {"refused": refused, "sum_ok": torch.equal(total, torch.arange(6, dtype=torch.float32) * ws * (ws + 1) / 2)}
