"""Matrix multiplies per rank against the unsharded model's divided by the world size, op by op.

Target: each rank's matrix multiplies within 10% of the unsharded time / ws. This profiles the
forward of a Llama-shaped 160M model (latency.py's) on every rank, unsharded and tpmap interleaved, with
torch.profiler, and sums the self time of the matrix-multiply kernels (`aten::mm`, `aten::addmm`,
`aten::bmm`), grouped by input shapes so that each projection's sharded product is set beside its unsharded
one (q_proj [512, 768] x [768, 768] against [512, 768] x [768, 384] at ws 2). Reports per forward, the
slowest rank's: total matmul time, the ratio tpmap / (unsharded / ws), and the biggest products.

    torchrun --nproc-per-node 2 benchmarks/matmul.py [--batch 4] [--seq 128] [--runs 5] [--threads 1]
        [--json out.json]

Self times, not wall time: collectives and Python overhead are left out by construction, so this isolates
whether the sharded GEMMs themselves are as fast per FLOP as the unsharded ones.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from latency import rotated  # (the benchmarks folder is not a package)

MATMULS = ("aten::mm", "aten::addmm", "aten::bmm")
LLAMA = dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=12,
             intermediate_size=2048, vocab_size=32000, max_position_embeddings=512, tie_word_embeddings=False)


def profile_matmuls(model, ids, runs: int) -> dict:
    """{(op, input shapes): (calls per forward, self microseconds per forward)} over `runs` forwards."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        for _ in range(runs):
            model(input_ids=ids)
    out = {}
    for e in prof.key_averages(group_by_input_shape=True):
        if e.key in MATMULS:
            out[(e.key, str(e.input_shapes))] = (e.count / runs, e.self_cpu_time_total / runs)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--runs", type=int, default=5, help="forwards per profile (after one warm-up)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved profiles of each variant")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    import torch
    import torch.distributed as dist
    import transformers

    import tpmap

    dist.init_process_group("gloo")
    torch.set_num_threads(args.threads)
    rank, ws = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    full = transformers.LlamaForCausalLM(transformers.AutoConfig.for_model("llama", **LLAMA)).eval()
    variants = {"unsharded": full, "tpmap": tpmap.apply(copy.deepcopy(full), ws, check_inputs=False).eval()}
    ids = torch.randint(3, LLAMA["vocab_size"], (args.batch, args.seq), generator=torch.Generator().manual_seed(1))
    totals: dict[str, list[float]] = defaultdict(list)
    by_shape: dict[str, dict] = {}
    for i in range(args.rounds):
        for key, model in rotated(variants, i):
            with torch.no_grad():
                model(input_ids=ids)  # warm-up
            ops = profile_matmuls(model, ids, args.runs)
            totals[key].append(sum(us for _, us in ops.values()))
            by_shape[key] = ops
    median = {k: sorted(v)[len(v) // 2] for k, v in totals.items()}
    everyone = [None] * ws
    dist.all_gather_object(everyone, {"median": median, "by_shape": {k: {" ".join(s): v for s, v in d.items()}
                                                                     for k, d in by_shape.items()}})
    if rank == 0:
        slowest = {k: max(r["median"][k] for r in everyone) for k in variants}
        ratio = slowest["tpmap"] / (slowest["unsharded"] / ws)
        print(f"\n{time.strftime('%Y-%m-%d')}, {ws} ranks, gloo, {args.threads} thread(s) per rank, torch "
              f"{torch.__version__}; Llama-shaped 160M forward at ({args.batch}, {args.seq}), fp32\n")
        print("| variant | matmul self time per forward (slowest rank) | per rank / (unsharded / ws) |")
        print("|---|---|---|")
        print(f"| unsharded | {slowest['unsharded'] / 1e3:.1f} ms | - |")
        print(f"| tpmap | {slowest['tpmap'] / 1e3:.1f} ms | {ratio:.2f} |")
        print("\nBiggest products (rank 0, per forward): calls, ms")
        for key in variants:
            ops = sorted(everyone[0]["by_shape"][key].items(), key=lambda kv: -kv[1][1])[:6]
            for shape, (calls, us) in ops:
                print(f"  {key:9s} {shape:70s} {calls:5.0f} x  {us / 1e3:8.1f} ms")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"date": time.strftime("%Y-%m-%d"), "world_size": ws, "threads": args.threads,
                           "shape": [args.batch, args.seq], "slowest_ms": {k: v / 1e3 for k, v in slowest.items()},
                           "ratio_to_unsharded_over_ws": ratio, "ranks": everyone}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
