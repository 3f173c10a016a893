"""What driving a tensor-parallel model from one plain process costs (`tpmap.parallelize`): the startup,
and what the proxy adds to each call beyond the workers' own time.

For each model (a tiny Llama and a ~40M Llama-shaped one, saved once to a temporary folder):

* startup: `parallelize`'s own split (`handle.startup`): planning in the driver, spawning the workers and
  their process group, loading the shards;
* per call, over many calls: the driver's round trip and each worker's own time for it, measured inside
  the worker around the call (`handle.last_call`); the overhead is the round trip beyond the slowest
  worker (pickling the arguments and the answer, the pipes, waking up). Target: at most 5 ms per
  generate call.

    python benchmarks/parallelize.py [--calls 40] [--world-size 2] [--json benchmarks/parallelize.json]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import tempfile

MODELS = {
    "llama-tiny": dict(hidden_size=96, num_attention_heads=12, num_key_value_heads=2, intermediate_size=192,
                       num_hidden_layers=2, vocab_size=256, max_position_embeddings=64),
    "llama-40m": dict(hidden_size=512, num_attention_heads=8, num_key_value_heads=8, intermediate_size=1376,
                      num_hidden_layers=8, vocab_size=32000, max_position_embeddings=512, tie_word_embeddings=False),
}


def _cpu() -> str:
    """The CPU's model name (Linux), else the architecture."""
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):  # not Linux, or no model name: the architecture says less but something
        return platform.machine()


def _stats(values: list[float]) -> dict:
    ordered = sorted(values)
    return {"median_ms": statistics.median(ordered) * 1e3, "p90_ms": ordered[int(0.9 * (len(ordered) - 1))] * 1e3,
            "max_ms": ordered[-1] * 1e3}


def measure(name: str, config: dict, world_size: int, calls: int) -> dict:
    import torch
    from transformers import AutoConfig, LlamaForCausalLM

    import tpmap

    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as folder:
        LlamaForCausalLM(AutoConfig.for_model("llama", **config)).eval().save_pretrained(folder)
        handle = tpmap.parallelize(folder, world_size, device="cpu")
    with handle:
        vocab = config["vocab_size"]
        prompt = torch.randint(3, vocab, (1, 8), generator=torch.Generator().manual_seed(1))
        batch = torch.randint(3, vocab, (2, 64), generator=torch.Generator().manual_seed(2))
        cases = {
            "generate 1x8, 1 new token": lambda: handle.generate(prompt, max_new_tokens=1, do_sample=False),
            "generate 1x8, 16 new tokens": lambda: handle.generate(prompt, max_new_tokens=16, do_sample=False),
            "forward 1x8": lambda: handle(input_ids=prompt),
            "forward 2x64 (logits back)": lambda: handle(input_ids=batch),
        }
        timings: dict[str, list] = {case: [] for case in cases}
        for i in range(calls + 3):  # interleaved, so the machine's noise hits every case alike; 3 warm-up rounds
            for case, call in cases.items():
                call()
                if i >= 3:
                    timings[case].append(handle.last_call)
        startup = handle.startup
    results = {}
    for case, runs in timings.items():
        results[case] = {"round_trip": _stats([t.round_trip_s for t in runs]),
                         "workers": _stats([max(t.worker_s) for t in runs]),
                         "overhead": _stats([t.overhead_s for t in runs]), "calls": len(runs)}
    params = sum(p.numel() for p in LlamaForCausalLM(AutoConfig.for_model("llama", **config)).parameters())
    return {"model": name, "params": params, "world_size": world_size,
            "startup_s": {"plan": startup.plan_s, "spawn": startup.spawn_s, "load": startup.load_s,
                          "total": startup.total_s},
            "calls": results}


def main() -> None:
    import torch
    import transformers

    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=40)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    report = {"date": datetime.date.today().isoformat(),
              "machine": f"{_cpu()}, {os.cpu_count()} cores, CPU workers (gloo, "
                         f"{max(1, (os.cpu_count() or 1) // args.world_size)} thread(s) each), shared with other jobs",
              "torch": torch.__version__, "transformers": transformers.__version__,
              "results": [measure(name, config, args.world_size, args.calls) for name, config in MODELS.items()]}
    for r in report["results"]:
        s = r["startup_s"]
        print(f"{r['model']} ({r['params'] / 1e6:.1f}M params, world size {r['world_size']}): startup "
              f"{s['total']:.1f} s (plan {s['plan']:.2f}, spawn {s['spawn']:.1f}, load {s['load']:.1f})")
        for case, c in r["calls"].items():
            print(f"  {case:30s} round trip {c['round_trip']['median_ms']:8.2f} ms, workers "
                  f"{c['workers']['median_ms']:8.2f} ms, overhead median {c['overhead']['median_ms']:.2f} "
                  f"p90 {c['overhead']['p90_ms']:.2f} max {c['overhead']['max_ms']:.2f} ms")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
