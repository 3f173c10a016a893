"""Cost of tpmap's input check (the per-forward fingerprint of every tensor argument, one all-gather of
5 numbers) on a Llama-shaped ~160M model, at world size 2 on real gloo ranks (1 thread each).

Measures, interleaved in one process pair so the machine's noise hits both alike:
* a (1, 8) forward with and without `check_inputs` (medians over many runs), and the hook alone;
* one decode step (a (1, 1) forward with a KV cache of 8) with and without it.
Target: under 2% of a (1, 8) forward, as the hook's median time / the forward's median time.

    python benchmarks/input_check.py [--runs 30] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

LLAMA_160M = dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=12,
                  intermediate_size=2048, vocab_size=32000, max_position_embeddings=512, tie_word_embeddings=False)


def measure(runs: int) -> dict:
    import copy

    import torch
    import torch.distributed as dist
    from transformers import AutoConfig, DynamicCache, LlamaForCausalLM

    import tpmap
    from tpmap.input_check import input_check

    torch.manual_seed(0)
    full = LlamaForCausalLM(AutoConfig.for_model("llama", **LLAMA_160M)).eval()
    ws = dist.get_world_size()
    checked = tpmap.apply(copy.deepcopy(full), ws)
    unchecked = tpmap.apply(full, ws, check_inputs=False)
    ids = torch.randint(3, 32000, (1, 8), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    hook = input_check(checked, None)
    times: dict[str, list[float]] = {k: [] for k in ("forward_checked", "forward_unchecked", "hook",
                                                      "decode_checked", "decode_unchecked")}

    def timed(key, fn):
        dist.barrier()
        start = time.perf_counter()
        fn()
        times[key].append(time.perf_counter() - start)

    with torch.no_grad():
        caches = {}
        for model, key in ((checked, "checked"), (unchecked, "unchecked")):
            cache = DynamicCache(config=model.config)
            model(input_ids=ids, attention_mask=mask, cache=cache, use_cache=True)
            caches[key] = cache
        step = torch.tensor([[42]])
        for _ in range(runs + 3):  # the first 3 rounds warm up and are dropped
            timed("forward_checked", lambda: checked(input_ids=ids, attention_mask=mask))
            timed("forward_unchecked", lambda: unchecked(input_ids=ids, attention_mask=mask))
            timed("hook", lambda: hook(checked, (), {"input_ids": ids, "attention_mask": mask}))
            for key, model in (("checked", checked), ("unchecked", unchecked)):
                cache = copy.deepcopy(caches[key])
                decode_mask = torch.ones(1, 9, dtype=torch.long)
                timed(f"decode_{key}", lambda model=model, cache=cache, m=decode_mask: model(
                    input_ids=step, cache=cache, use_cache=True, attention_mask=m))
    return {k: statistics.median(v[3:]) for k, v in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    from tpmap.parallelize.rank_processes import RankPool

    pool = RankPool(2)
    try:
        per_rank = pool.run(measure, args.runs, timeout=1800)
    finally:
        pool.close()
    slowest = {k: max(r[k] for r in per_rank) for k in per_rank[0]}
    rows = [
        ("(1, 8) forward, unchecked", slowest["forward_unchecked"]),
        ("(1, 8) forward, checked", slowest["forward_checked"]),
        ("the check alone", slowest["hook"]),
        ("decode step, unchecked", slowest["decode_unchecked"]),
        ("decode step, checked", slowest["decode_checked"]),
    ]
    print("Llama-shaped 160M, fp32, world size 2 (gloo, 1 thread per rank), median, slowest rank")
    for name, seconds in rows:
        print(f"  {name:<28} {seconds * 1e3:8.3f} ms")
    share = slowest["hook"] / slowest["forward_unchecked"]
    share_decode = slowest["hook"] / slowest["decode_unchecked"]
    print(f"  check / (1, 8) forward       {share:8.2%}   (target < 2%)")
    print(f"  check / decode step          {share_decode:8.2%}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"seconds": slowest, "check_share_forward": share, "check_share_decode": share_decode}, f,
                      indent=2)


if __name__ == "__main__":
    main()
