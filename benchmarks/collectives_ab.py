"""Eager forward latency of the compile-ready collectives against the previous ones, interleaved in one
process pair (making tpmap traceable must not slow eager down).

"before" is the previous implementation, rebuilt in-process: every collective through its autograd
Function with a copy before the in-place all-reduce (also without grad), and no SharedCopy hooks.
"after" is the current code: without grad, no Function, the Row's and the vocab embedding's fresh
matmul results summed in place. A Llama-shaped ~34M model, fp32, inference mode, 1 thread per rank;
(1, 8) and (4, 128) forwards alternate A/B; medians over the runs, slowest rank. Optional:
torch.compile (inductor; needs a C++ compiler, minutes to compile on CPU) beside eager.

    torchrun --nproc-per-node 2 benchmarks/collectives_ab.py [--runs 40] [--inductor] [--json out.json]
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import json
import statistics
import time

import torch
import torch.distributed as dist

LLAMA_34M = dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=8,
                 intermediate_size=1408, vocab_size=8000, max_position_embeddings=512, tie_word_embeddings=False)


@contextlib.contextmanager
def previous_collectives():
    """The layers call the collectives as they did before: always the autograd Function (copy inside)."""
    from tpmap.engine import collectives as c
    from tpmap.engine import layers

    def reduce(x, group=None, *, fresh=False):
        return x if c._world(group) == 1 else c._ReduceFromTP.apply(x, group)

    def gather(x, group=None, order=None):
        return x if c._world(group) == 1 else c._GatherFromTP.apply(x, group, dist.get_rank(group), order)

    def total(x, group=None):
        return x if c._world(group) == 1 else c._SumOverTP.apply(x, group)

    saved = (layers.reduce_from_tp_region, layers.gather_from_tp_region, layers.sum_over_tp_region)
    layers.reduce_from_tp_region, layers.gather_from_tp_region, layers.sum_over_tp_region = reduce, gather, total
    try:
        yield
    finally:
        layers.reduce_from_tp_region, layers.gather_from_tp_region, layers.sum_over_tp_region = saved


def without_shared_copy_hooks(model) -> None:
    """Drop the SharedCopy scope hooks (they did not exist before; without grad they do nothing else)."""
    from tpmap.engine.collectives import SharedCopy

    for m in model.modules():
        for hooks in (m._forward_pre_hooks, m._forward_hooks):
            for key in [k for k, h in hooks.items() if isinstance(getattr(h, "__self__", None), SharedCopy)]:
                del hooks[key]
        m.__dict__.pop("shared_copy", None)


def timed(fn) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    elapsed = torch.tensor([time.perf_counter() - start])
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank
    return elapsed.item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=40)
    parser.add_argument("--inductor", action="store_true")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    from transformers import AutoConfig, LlamaForCausalLM

    import tpmap

    torch.manual_seed(0)
    full = LlamaForCausalLM(AutoConfig.for_model("llama", **LLAMA_34M)).eval()
    ws = dist.get_world_size()
    after = tpmap.apply(copy.deepcopy(full), ws, check_inputs=False)
    before = tpmap.apply(full, ws, check_inputs=False)
    without_shared_copy_hooks(before)
    variants = {"before": lambda ids: before_forward(before, ids), "after": lambda ids: after(input_ids=ids)}
    if args.inductor:
        compiled = torch.compile(after)
        variants["after+inductor"] = lambda ids: compiled(input_ids=ids)
    results = {}
    for shape in ((1, 8), (4, 128)):
        ids = torch.randint(3, LLAMA_34M["vocab_size"], shape, generator=torch.Generator().manual_seed(1))
        with torch.inference_mode():
            outs = {k: f(ids).logits for k, f in variants.items()}  # warm-up (and compile), and the same logits
            times = {k: [] for k in variants}
            for _ in range(args.runs):
                for k, f in variants.items():
                    times[k].append(timed(lambda f=f, ids=ids: f(ids)))
        med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        results[str(shape)] = {"median_ms": med, "after/before": med["after"] / med["before"],
                               "max|diff|": max((o - outs["before"]).abs().max().item() for o in outs.values())}
        if dist.get_rank() == 0:
            cols = "  ".join(f"{k} {v:8.2f} ms" for k, v in med.items())
            print(f"{shape!s:>9}  {cols}  after/before {med['after'] / med['before']:.3f}  "
                  f"max|diff| {results[str(shape)]['max|diff|']:.1e}")
    if args.json and dist.get_rank() == 0:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    dist.destroy_process_group()


def before_forward(model, ids):
    with previous_collectives():
        return model(input_ids=ids)


if __name__ == "__main__":
    main()
