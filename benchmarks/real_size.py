"""Real size: a 1.1 B Llama-shaped and a 0.9 B Mixtral-shaped bf16 checkpoint at world size 2, tpmap against the
unsharded model and HF native TP, in one run: load time, peak memory per rank while loading, time to first token,
decode tokens/s, and whether the greedy tokens agree.

    python -m torch.distributed.run --nproc-per-node 2 benchmarks/real_size.py [--models llama mixtral]
        [--workdir /tmp/tpmap_real_size] [--rounds 3] [--prompt 128] [--new 32]

The checkpoints are load.py's (random bf16, laid out as save_pretrained lays them out, 500 MB shards), written
once into --workdir by rank 0 and read from the page cache after (the first variant pays no disk either way).

* **unsharded**: `Cls.from_pretrained(dtype=bfloat16)` on rank 0 alone with 2 threads, the whole machine, while
  the other ranks wait at a barrier: what a user runs without tensor parallelism.
* **tpmap**: `tpmap.from_pretrained(dtype=bfloat16)`, every rank, 1 thread each.
* **HF native TP**: `Cls.from_pretrained(dtype=bfloat16, distributed_config=DistributedConfig(tp_size=ws))`,
  1 thread each.

Per variant: load wall time, and load plus the first generated token (transformers maps the checkpoint and reads
its pages at first use: its load alone is not the time to a model that runs); peak resident memory growth over both
(VmHWM, reset before each load through /proc/self/clear_refs, minus the resident memory before: anonymous and
file-backed pages together); time to first token (prefill of a --prompt-token prompt and one new token); decode
tokens/s (from a 16-token prompt, --new + 1 greedy tokens against 1: new / the difference). Every figure is the
worst rank's; times are medians over --rounds interleaved rounds (the order rotates), the first token after loading
the warm-up.
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import statistics
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import transformers
from load import MODELS, write_checkpoint

import tpmap

VARIANTS = ["unsharded", "tpmap", "hf_tp"]
LABELS = {"unsharded": "unsharded (1 process, 2 threads)", "hf_tp": "HF native TP"}  # and "tpmap ws N"


def _kib(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key + ":"))


def _worst(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _runs_here(variant: str) -> bool:
    return variant != "unsharded" or dist.get_rank() == 0


def _threads(variant: str) -> None:
    torch.set_num_threads(dist.get_world_size() if variant == "unsharded" else 1)


def load(variant: str, folder: Path, cls, prompt: torch.Tensor) -> tuple[object, float, float, float]:
    """(model or None on ranks that do not run it, load s, load and first token s, peak growth MiB), the worst rank's.
    The first token counts: transformers maps the checkpoint and reads a page at its first use, in the forward."""
    model, peak, loaded = None, 0.0, 0.0
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # the earlier models' freed heap back to the kernel: growth is this load's
    dist.barrier()
    start = time.perf_counter()
    if _runs_here(variant):
        _threads(variant)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM := the resident memory now
        before = _kib("VmRSS")
        if variant == "unsharded":
            model = cls.from_pretrained(folder, dtype=torch.bfloat16)
        elif variant == "tpmap":
            model = tpmap.from_pretrained(folder, dtype=torch.bfloat16)
        else:
            config = transformers.DistributedConfig(tp_size=dist.get_world_size())
            model = cls.from_pretrained(folder, dtype=torch.bfloat16, distributed_config=config)
        model.eval()
        loaded = time.perf_counter() - start
        generate(model, prompt, 1)
        peak = (_kib("VmHWM") - before) / 1024
    took = time.perf_counter() - start
    dist.barrier()
    return model, _worst(loaded), _worst(took), _worst(peak)


def generate(model, prompt: torch.Tensor, new: int) -> tuple[float, torch.Tensor | None]:
    if model is None:
        return 0.0, None
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=new, min_new_tokens=new, do_sample=False)
    return time.perf_counter() - start, out


def bench(name: str, folder: Path, args) -> list[dict]:
    class_name, _ = MODELS[name]
    cls = getattr(transformers, class_name)
    vocab = transformers.AutoConfig.from_pretrained(folder).vocab_size
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, vocab, (1, args.prompt), generator=gen)
    short = torch.randint(0, vocab, (1, 16), generator=gen)  # decode's prompt: its prefill small beside the tokens
    models, rows = {}, {}
    for v in VARIANTS:
        models[v], loaded, ready, peak = load(v, folder, cls, prompt)
        rows[v] = {"model": name, "variant": v, "load_s": loaded, "ready_s": ready, "peak_mib": peak}
    runs = {"ttft": (prompt, 1), "short": (short, 1), "decode": (short, args.new + 1)}
    times = {(v, run): [] for v in VARIANTS for run in runs}
    tokens = {}
    for r in range(args.rounds):
        k = r % len(VARIANTS)
        for v in VARIANTS[k:] + VARIANTS[:k]:
            _threads(v)
            for run, (ids, n) in runs.items():
                dist.barrier()
                took, out = generate(models[v] if _runs_here(v) else None, ids, n)
                times[(v, run)].append(_worst(took))
                if run == "decode" and out is not None:
                    tokens[v] = out[0, ids.shape[1]:].tolist()
    for v in VARIANTS:
        med = {run: statistics.median(times[(v, run)]) for run in runs}
        rows[v].update(ttft_s=med["ttft"], tok_s=args.new / max(med["decode"] - med["short"], 1e-9),
                       same_tokens=tokens.get(v) == tokens.get("unsharded") if dist.get_rank() == 0 else None)
    del models
    gc.collect()
    return [rows[v] for v in VARIANTS]


def table(rows: list[dict], ws: int, args) -> str:
    base = {r["model"]: r for r in rows if r["variant"] == "unsharded"}
    out = [f"| model | variant | load s | load + first token s | peak growth/rank MiB | "
           f"TTFT ({args.prompt} tokens) s | decode tok/s | x unsharded tok/s | greedy tokens = unsharded |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        b = base[r["model"]]
        out.append(f"| {r['model']} | {LABELS.get(r['variant'], f'tpmap ws {ws}')} | "
                   f"{r['load_s']:.1f} | {r['ready_s']:.1f} | {r['peak_mib']:.0f} | {r['ttft_s']:.2f} | "
                   f"{r['tok_s']:.2f} | "
                   f"{r['tok_s'] / b['tok_s']:.2f} | {'-' if r['variant'] == 'unsharded' else r['same_tokens']} |")
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["llama", "mixtral"], choices=["llama", "mixtral"])
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/tpmap_real_size"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new", type=int, default=32)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    dist.init_process_group("gloo")
    ws = dist.get_world_size()
    rows = []
    for name in args.models:
        folder = args.workdir / name
        if dist.get_rank() == 0 and not (folder / "config.json").exists():
            class_name, overrides = MODELS[name]
            write_checkpoint(folder, class_name, overrides, "500MB")
        dist.barrier()
        rows += bench(name, folder, args)
        if dist.get_rank() == 0:
            print(table(rows, ws, args), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
