"""Training checkpoints: `tpmap.training.save` / `load` against torch.distributed.checkpoint (DCP) saving and
loading the same per-rank state dicts, per rank: wall time and peak RSS during each phase.

    torchrun --nproc-per-node 2 benchmarks/training_checkpoint.py [--layers 18] [--dir /tmp] [--out FILE.json]

A Llama shape (hidden 1024, 16 heads, 4 KV heads, MLP 2816, vocabulary 32000; 18 layers: 266 M parameters,
1.06 GB in fp32) sharded over the ranks by tpmap, with AdamW state (exp_avg, exp_avg_sq: twice the weights;
created by one step on zero gradients). What each rank holds: its shard of the weights and of the optimizer state
(~1.6 GB per rank at tp 2). DCP is given the same tensors under rank-prefixed keys (``rank0/model/...``): plain
tensors under one name on every rank are taken by DCP as replicas and written once, which would drop the other
ranks' shards -- it has no way to describe tpmap's layouts (several pieces per rank, replicated KV heads,
vocabulary padding), so it can only store them as per-rank blobs, as here.

Memory, per rank and phase, measured during the phase itself: first the freed heap is given back to the system
(glibc's malloc_trim: building the full model and sharding it leaves hundreds of MiB of freed heap resident,
which would absorb the phase's allocations unseen), then the kernel's peak RSS is reset (/proc/self/clear_refs
"5": VmHWM := VmRSS) and VmRSS read ("before"); after the phase VmHWM is the peak. Reported: peak / before,
peak - before (MiB), and the peak against the rank's share (its model shards + optimizer state, "held"): peak /
held, and (peak - baseline) / held with baseline the RSS after the imports and the process group, before any
model (Python, torch, transformers: ~0.5 GiB that no checkpoint format changes). Both write through fsync
(tpmap.training: fsync per file; DCP's FileSystemWriter: sync_files=True). tpmap.training's save also hashes
its files (sha256, read back from the page cache), and its load checks every file's size and hashes each file
once (split over the ranks): both included in its times.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from transformers import LlamaConfig, LlamaForCausalLM

import tpmap
import tpmap.training


def status() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(value.split()[0]) * 1024
    return out


def trim() -> int:
    """Give freed heap back to the system (glibc); the RSS after it."""
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    return status()["VmRSS"]


def mib(n: int) -> float:
    return round(n / 2**20, 1)


def measure(what: str, fn, held: int, baseline: int) -> dict:
    """Run fn between barriers, the freed heap trimmed and the peak RSS reset first: its seconds, the RSS before
    and the peak during it."""
    dist.barrier()
    trim()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    before = status()["VmRSS"]
    start = time.perf_counter()
    fn()
    dist.barrier()
    seconds = time.perf_counter() - start
    peak = status()["VmHWM"]
    return {"what": what, "seconds": round(seconds, 3), "rss_before_mib": mib(before), "peak_mib": mib(peak),
            "peak_minus_before_mib": mib(peak - before), "peak_over_before": round(peak / before, 4),
            "peak_over_held": round(peak / held, 4),
            "peak_minus_baseline_over_held": round((peak - baseline) / held, 4)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=18)
    parser.add_argument("--dir", default=None, help="a folder for the checkpoints (a temporary one in it, removed)")
    parser.add_argument("--out", default=None, help="write the results as JSON here (rank 0)")
    parser.add_argument("--machine", default="", help="a description of the machine, stored with the results")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, ws = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    dist.barrier()
    baseline = trim()  # imports and the process group, no model yet
    config = LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=args.layers,
                         num_attention_heads=16, num_key_value_heads=4, vocab_size=32000)
    torch.manual_seed(0)
    model = tpmap.apply(LlamaForCausalLM(config), ws).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()  # creates exp_avg, exp_avg_sq, step
    opt.zero_grad(set_to_none=True)
    full_bytes = sum(p.numel() * 4 for p in LlamaForCausalLM._from_config(config, dtype=torch.float32)
                     .to("meta").parameters()) if rank == 0 else 0
    held = sum(t.numel() * t.element_size() for t in model.state_dict().values()) + sum(
        v.numel() * v.element_size() for s in opt.state.values() for v in s.values())

    where = [tempfile.mkdtemp(prefix="ckpt-bench-", dir=args.dir) if rank == 0 else None]
    dist.broadcast_object_list(where)  # one folder for every rank
    base = Path(where[0])
    ours, theirs = base / "tpmap", base / "dcp"

    def dcp_state():
        return {f"rank{rank}": {"model": model.state_dict(), "optim": opt.state_dict()}}

    rows = [measure("tpmap.training.save", lambda: tpmap.training.save(ours, model, opt, step=1), held, baseline),
            measure("dcp.save", lambda: dcp.save(dcp_state(), checkpoint_id=theirs), held, baseline),
            measure("tpmap.training.load", lambda: tpmap.training.load(ours, model, opt), held, baseline)]

    def dcp_load():
        state = dcp_state()
        dcp.load(state, checkpoint_id=theirs)
        opt.load_state_dict(state[f"rank{rank}"]["optim"])

    rows.append(measure("dcp.load", dcp_load, held, baseline))
    sizes = {"tpmap": sum(f.stat().st_size for f in (ours / "step-00000001").iterdir()),
             "dcp": sum(f.stat().st_size for f in theirs.iterdir())}
    everyone: list = [None] * ws
    dist.all_gather_object(everyone, {"rank": rank, "held_mib": mib(held), "baseline_rss_mib": mib(baseline),
                                      "rows": rows})
    if rank == 0:
        result = {"date": time.strftime("%Y-%m-%d"), "machine": args.machine, "world_size": ws, "layers": args.layers,
                  "model_fp32_gb": round(full_bytes / 1e9, 3), "bytes_on_disk": sizes, "ranks": everyone,
                  "torch": torch.__version__}
        print(json.dumps(result, indent=1))
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
        shutil.rmtree(base)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
