"""A LoRA training step on a tensor-parallel model against unsharded PEFT, side by side, in one run.

    torchrun --nproc-per-node 2 benchmarks/lora.py [--runs 10] [--threads 1] [--r 16] [--quick] [--md OUT]

A Llama-shaped 160M (benchmarks/latency.py's: hidden 768, 12 layers, 12 heads, intermediate 2048, vocabulary
32000), fp32, built from its config on every rank with one seed (no download). Two variants, each holding the
same LoRA adapters (r 16 on q/k/v/o and gate/up/down, alpha 32, dropout 0; PEFT's init, saved once and loaded
by tpmap, each rank reading its slices):

* unsharded: plain `peft.get_peft_model` on the whole model, on every rank at once (each rank one process of
  `--threads` threads, as a single-process run would be);
* tpmap: `tpmap.apply` over the world, then `tpmap.peft.get_peft_model`.

A step is forward + backward + AdamW on the adapters at batch (4, 128), labels = inputs. The variants are timed
interleaved, round by round (the slowest rank's time per round; median and 10th-90th percentile), after two
warm-up rounds. Memory per rank is counted from the tensors after a step, exactly: parameters (base and
adapters), adapter gradients and AdamW state.
"""
from __future__ import annotations

import argparse
import copy
import datetime
import os
import platform
import shutil
import sys
import tempfile

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from latency import MODELS, QUICK, Timer, rotated, summary  # (the benchmarks folder is not a package)

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def persistent_bytes(model, optimizer) -> dict:
    """This rank's parameters, adapter gradients and optimizer state, in bytes."""
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    adapters = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    grads = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters() if p.grad is not None)
    state = sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values()
                if isinstance(t, torch.Tensor))
    return {"params": params, "adapters": adapters, "grads": grads, "optimizer": state,
            "total": params + grads + state}


def _arguments():
    """The command line (--quick for a smoke run)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--r", type=int, default=16)
    parser.add_argument("--quick", action="store_true", help="a tiny model: a smoke run")
    parser.add_argument("--md", default=None, help="also write the table (with date and machine) to this file")
    return parser.parse_args()


def _report(args, variants, rows, memory, same_losses, warmup, ws) -> None:
    """Rank 0's table: step times and memory per variant, and the largest loss difference."""
    unsharded_s = rows["unsharded PEFT"]["median"]
    mib = 2**20
    size = sum(p.numel() for p in variants["unsharded PEFT"].parameters()) / 1e6
    lines = [f"LoRA training step, Llama-shaped {size:.0f}M"
             f"{' (quick)' if args.quick else ''}, fp32, r {args.r} on {'/'.join(TARGETS)}, batch (4, 128), "
             f"AdamW; {ws} ranks x {args.threads} thread(s), gloo; {datetime.date.today()}, "
             f"{platform.machine()} {os.cpu_count()} cores, torch {torch.__version__}",
             "",
             "| variant | step s (median) | p10-p90 | vs unsharded | params MiB/rank | adapters MiB | "
             "grads MiB | AdamW MiB | total MiB/rank |",
             "|---|---|---|---|---|---|---|---|---|"]
    for key, r in rows.items():
        m = memory[key]
        lines.append(f"| {key} | {r['median']:.3f} | {r['p10']:.3f}-{r['p90']:.3f} | "
                     f"{r['median'] / unsharded_s:.2f}x | {m['params'] / mib:.1f} | {m['adapters'] / mib:.2f} | "
                     f"{m['grads'] / mib:.2f} | {m['optimizer'] / mib:.2f} | {m['total'] / mib:.1f} |")
    lines += ["", f"largest difference of the two variants' losses over the {warmup + args.runs} steps: "
                  f"{same_losses:.2e} (the same adapters, the same batch)"]
    text = "\n".join(lines)
    print(text, flush=True)
    if args.md:
        with open(args.md, "w") as f:
            f.write(text + "\n")


def main() -> None:
    args = _arguments()

    import transformers
    from peft import LoraConfig
    from peft import get_peft_model as plain_peft_model

    import tpmap
    import tpmap.peft

    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo")
    ws, rank = dist.get_world_size(), dist.get_rank()
    model_type, class_name, overrides = MODELS["llama"]
    if args.quick:
        overrides = {**overrides, **{k: v for k, v in QUICK.items() if k in overrides}}
    config = transformers.AutoConfig.for_model(model_type, **overrides)
    torch.manual_seed(0)
    base = getattr(transformers, class_name)(config).eval()

    def lora():
        return LoraConfig(r=args.r, lora_alpha=2 * args.r, target_modules=TARGETS, lora_dropout=0.0)

    unsharded = plain_peft_model(copy.deepcopy(base), lora())
    folder = [tempfile.mkdtemp(prefix="tpmap-lora-bench-") if rank == 0 else None]
    if rank == 0:
        unsharded.save_pretrained(folder[0])  # the same adapters for tpmap, each rank reading its slices
    dist.broadcast_object_list(folder)
    sharded = tpmap.peft.from_pretrained(tpmap.apply(copy.deepcopy(base), ws), folder[0], is_trainable=True)
    dist.barrier()
    if rank == 0:
        shutil.rmtree(folder[0])
    variants = {"unsharded PEFT": unsharded, f"tpmap ws {ws}": sharded}
    del base
    optimizers = {k: torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-4)
                  for k, m in variants.items()}
    batch = torch.randint(0, config.vocab_size, (4, 128), generator=torch.Generator().manual_seed(1))
    losses = {}

    def step(key):
        model, optimizer = variants[key], optimizers[key]
        optimizer.zero_grad(set_to_none=False)
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        losses.setdefault(key, []).append(loss.item())

    timer = Timer(torch.device("cpu"))
    warmup = 2
    for i in range(warmup + args.runs):
        for key, _ in rotated(variants, i):
            timer(key, lambda key=key: step(key))
    memory = {k: persistent_bytes(m, optimizers[k]) for k, m in variants.items()}
    rows = {k: summary(timer.rounds(k, warmup)) for k in variants}
    same_losses = max(abs(a - b) for a, b in zip(*losses.values(), strict=True))  # every step, both variants

    if rank == 0:
        _report(args, variants, rows, memory, same_losses, warmup, ws)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
