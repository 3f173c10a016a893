"""A prepared check for a machine with a GPU (not part of CI): the sharded model on CUDA tensors.

Ranks are real processes in a gloo group (one GPU cannot host an NCCL group of several ranks). Each
rank shards the model on the CPU with tpmap.apply, moves it to the GPU, and compares against the
unsharded model on the GPU: forward, gradients (replicated KV heads at world size 4), greedy generate,
and train-mode dropout (the CUDA generator is swapped in sharded regions). Also times forwards.

    python benchmarks/gpu_check.py [--world-sizes 2 4]     # prints one line per case, then a verdict
"""
from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

CASES = [("gpt2", 0, "GPT2LMHeadModel"), ("llama", 0, "LlamaForCausalLM"), ("t5", 0, "T5ForConditionalGeneration")]


def rank_check(ref: str, index: int, cls: str) -> dict:
    import rank_cases
    import torch.distributed as dist

    import tpmap
    from tpmap import verify
    from tpmap.engine.shard import take

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    ws, rank = dist.get_world_size(), dist.get_rank()
    cpu_model = verify.build_model(ref, index, cls)
    full = copy.deepcopy(cpu_model).to(device)
    sharded = tpmap.apply(copy.deepcopy(cpu_model), ws).to(device)  # shard on the CPU, then move: the usual order
    inputs, _ = rank_cases.loss_kwargs(full, verify.case_inputs(ref, index, full))
    inputs = {k: v.to(device) for k, v in inputs.items()}
    out_full, out = full(**inputs), sharded(**inputs)
    fwd = (verify.main_output(out) - verify.main_output(out_full)).abs().max().item()
    scale = verify.main_output(out_full).abs().max().item()
    out_full.loss.backward()
    out.loss.backward()
    grads = {n: p.grad for n, p in full.named_parameters()}
    plan, worst = sharded.tpmap_plan, 0.0
    gmax = max(g.abs().max().item() for g in grads.values() if g is not None)
    for name, p in sharded.named_parameters():
        want = grads[name]
        if p.grad is None or want is None:
            continue
        if name in plan.params:
            want = take(want, plan.params[name], rank)
        worst = max(worst, (p.grad - want).abs().max().item() / max(want.abs().max().item(), 1e-2 * gmax))
    gen_ids = inputs["input_ids"][:, :6]
    kwargs = dict(max_new_tokens=20, min_new_tokens=20, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        same_tokens = torch.equal(full.eval().generate(gen_ids, **kwargs), sharded.eval().generate(gen_ids, **kwargs))
    sharded.train()
    torch.manual_seed(3)
    with torch.no_grad():
        y = verify.main_output(sharded(**{k: v.to(device) for k, v in verify.case_inputs(ref, index, full).items()}))
    everyone = [torch.empty_like(y) for _ in range(ws)]
    dist.all_gather(everyone, y.contiguous())
    agree = all(torch.equal(everyone[0], o) for o in everyone)
    sharded.eval()
    timings = {}
    for name, model in (("full", full.eval()), ("sharded", sharded)):
        with torch.no_grad():
            for _ in range(3):
                model(**inputs)
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(10):
                model(**inputs)
            if device.type == "cuda":
                torch.cuda.synchronize()
            timings[name] = (time.perf_counter() - t0) / 10 * 1e3
    return {"device": str(next(sharded.parameters()).device), "fwd_rel": fwd / scale, "grad_rel": worst,
            "same_tokens": same_tokens, "dropout_ranks_agree": agree, "ms_full": timings["full"],
            "ms_sharded": timings["sharded"]}


def main() -> int:
    from tpmap.launch import RankFailure, RankPool

    parser = argparse.ArgumentParser()
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    args = parser.parse_args()
    print(f"torch {torch.__version__}, cuda available: {torch.cuda.is_available()}", flush=True)
    failed = 0
    for ws in args.world_sizes:
        with RankPool(ws) as pool:
            for case in CASES:
                try:
                    per_rank = pool.run(rank_check, *case, timeout=300)
                except RankFailure as e:
                    print(f"ws{ws} {case[0]}: FAIL\n{e}", flush=True)
                    failed += 1
                    continue
                ok = all(r["fwd_rel"] < 1e-5 and r["grad_rel"] < 1e-3 and r["same_tokens"] and r["dropout_ranks_agree"]
                         for r in per_rank)
                failed += not ok
                r = per_rank[0]
                print(f"ws{ws} {case[0]:8s} {r['device']:7s} fwd {max(x['fwd_rel'] for x in per_rank):.1e} "
                      f"grad {max(x['grad_rel'] for x in per_rank):.1e} "
                      f"tokens {all(x['same_tokens'] for x in per_rank)} "
                      f"dropout-agree {all(x['dropout_ranks_agree'] for x in per_rank)} "
                      f"fwd ms full {r['ms_full']:.2f} sharded {r['ms_sharded']:.2f}  {'ok' if ok else 'FAIL'}",
                      flush=True)
    print(f"{'all ok' if not failed else f'{failed} failed'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
