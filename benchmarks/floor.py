"""The floor of tensor parallelism on this machine: the same sharded model with every collective made local, so
each rank runs its own shard concurrently with the others and nothing is exchanged. No tensor-parallel run of that
layout can be faster; tpmap is reported as a percentage of it, beside the ratio to the unsharded model, all three
interleaved in one run (rounds rotate the order; the first two are warm-up; each time is the slowest rank's, a
barrier before and the max over ranks after; medians). 1 thread per rank.

    python -m torch.distributed.run --nproc-per-node 2 benchmarks/floor.py [--dtype float32|bfloat16] [--rounds 9]
    python -m torch.distributed.run --nproc-per-node 3 benchmarks/floor.py --dtype bfloat16 --accuracy-only --prompts 8

The floor model is tpmap's own sharded model run inside `no_collectives()`: shared-memory and torch.distributed
sums return the rank's own partial sum, gathers fill every slot with the rank's own part. Its outputs are wrong by
design (only its time is used), so decode runs a fixed number of new tokens (min_new_tokens = max_new_tokens).
The model is latency.py's Llama shape (170 M parameters: hidden 768, 12 layers, 12 heads, MLP 2048, vocabulary
32000). Tasks: forward (1, 8) and (4, 128), greedy decode of 32 tokens after 16 (tokens/s), a training step
(2, 128; loss.backward; in bf16 under CPU autocast with fp32 weights, as bf16 training runs).
"""
from __future__ import annotations

import argparse
import contextlib
import copy

import torch
import torch.distributed as dist
import transformers
from interleaved import decode, forward, start, timed, tokens, train

import tpmap
from tpmap.engine import shm as shm_path

VOCAB = 32000
CONFIG = dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=12,
              intermediate_size=2048, vocab_size=VOCAB, max_position_embeddings=512, tie_word_embeddings=False)
NEW_TOKENS = 32


def _fill_gather(out: torch.Tensor, t: torch.Tensor, dim: int) -> torch.Tensor:
    """`out` with every rank's slot along `dim` holding this rank's `t` (a gather with no one else)."""
    for part in out.split(t.shape[dim], dim=dim):
        part.copy_(t)
    return out


def _gather_list(parts: list[torch.Tensor], t: torch.Tensor, *args, **kwargs) -> None:
    for part in parts:
        part.copy_(t)


def _gather_into(out: torch.Tensor, t: torch.Tensor, *args, **kwargs) -> None:
    _fill_gather(out, t, 0)


def _nothing(*args, **kwargs) -> None:
    return None


@contextlib.contextmanager
def no_collectives():
    """Inside: every collective tpmap issues on CPU is local (shared memory and torch.distributed alike)."""
    fakes = {
        (shm_path, "all_reduce"): lambda t, shm: t,
        (shm_path, "all_gather"): lambda out, t, shm: _fill_gather(out, t, -1),
        (shm_path, "all_gather_into_tensor"): lambda out, t, shm: _fill_gather(out, t, 0),
        (shm_path, "reduce_scatter_tensor"): lambda out, t, shm: out.copy_(t[:out.shape[0]]),
        (dist, "all_reduce"): _nothing,
        (dist, "broadcast"): _nothing,
        (dist, "all_gather"): _gather_list,
        (dist, "all_gather_into_tensor"): _gather_into,
    }
    saved = {key: getattr(*key) for key in fakes}
    for (module, name), fake in fakes.items():
        setattr(module, name, fake)
    try:
        yield
    finally:
        for (module, name), real in saved.items():
            setattr(module, name, real)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--accuracy-only", action="store_true",
                        help="only the logits' distances and greedy tokens, over --prompts prompts (no timing)")
    parser.add_argument("--prompts", type=int, default=1)
    args = parser.parse_args()
    ws = start()
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    full = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG)).eval()
    trained = {"unsharded": full, "tpmap": tpmap.apply(copy.deepcopy(full), ws).eval()}  # fp32 weights: training
    models = {name: copy.deepcopy(m).to(dtype) for name, m in trained.items()}  # forward and decode in `dtype`
    bf16 = dtype == torch.bfloat16
    tasks = {"fwd 1x8": (lambda m: forward(m, VOCAB, (1, 8)), models),
             "fwd 4x128": (lambda m: forward(m, VOCAB, (4, 128)), models),
             f"decode {NEW_TOKENS}": (lambda m: decode(m, VOCAB, NEW_TOKENS), models),
             "train 2x128": (lambda m: train(m, VOCAB, bf16), trained)}
    forward(models["tpmap"], VOCAB, (1, 8))  # the group's collective path chosen (a collective) outside the floor

    def rel(a, b) -> float:
        return ((a - b).abs().max() / b.abs().max()).item()
    dists, same, same_fp32, decided, flips = [], 0, 0, 0, 0
    for seed in range(3, 3 + args.prompts):
        prompt = tokens(VOCAB, (1, 16), seed=seed)
        with torch.no_grad():  # tpmap against the unsharded model in the benchmark's dtype, both against fp32
            greedy = {n: m.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False) for n, m in models.items()}
            seq = greedy["unsharded"]  # teacher-forced: both models read the unsharded model's greedy sequence
            exact = full(seq).logits
            want, got = (models[n](seq).logits.float() for n in ("unsharded", "tpmap"))
        dists.append((rel(got, want), rel(want, exact), rel(got, exact)))
        same += torch.equal(greedy["unsharded"], greedy["tpmap"])
        same_fp32 += torch.equal(greedy["unsharded"], full.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False))
        # where the unsharded model's top-2 margin exceeds twice the logits' distance, tpmap must pick its token
        top = want[0, 15:-1].topk(2, dim=-1).values  # (NEW_TOKENS, 2): the steps that chose a new token
        clear = (top[:, 0] - top[:, 1]) > 2 * (got - want).abs().max()
        decided += int(clear.sum())
        flips += int((clear & (got[0, 15:-1].argmax(-1) != want[0, 15:-1].argmax(-1))).sum())
    worst = [max(d[i] for d in dists) for i in range(3)]
    if dist.get_rank() == 0:
        print(f"Llama 170M, {args.dtype}, ws={ws}, {args.prompts} prompt(s), worst: logits max rel tpmap vs unsharded "
              f"{worst[0]:.1e}; vs fp32: unsharded {worst[1]:.1e}, tpmap {worst[2]:.1e}; greedy tokens ({NEW_TOKENS} "
              f"new) equal to the unsharded model's on {same} of {args.prompts} prompts (the unsharded model's own "
              f"equal to fp32's on {same_fp32}); of the {decided} steps whose top-2 margin exceeds twice the logits' "
              f"distance, tpmap picks another token at {flips}", flush=True)
    if args.accuracy_only:
        dist.destroy_process_group()
        return
    def run(task: str, name: str) -> None:
        work, pool = tasks[task]
        if name == "floor":
            with no_collectives():
                work(pool["tpmap"])
        else:
            work(pool[name])

    variants = ["unsharded", "tpmap", "floor"]
    med = timed({task: (lambda name, task=task: run(task, name)) for task in tasks}, variants, args.rounds)
    if dist.get_rank() == 0:
        print("median seconds; x unsharded; tpmap as % of the floor's speed")
        for task in tasks:
            t = {v: med[(task, v)] for v in variants}
            print(f"  {task:12s} unsharded {t['unsharded']:.4f}  tpmap {t['tpmap']:.4f} "
                  f"({t['tpmap'] / t['unsharded']:.2f}x)  floor {t['floor']:.4f} "
                  f"({t['floor'] / t['unsharded']:.2f}x)  tpmap at {100 * t['floor'] / t['tpmap']:.0f}% of the floor")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
