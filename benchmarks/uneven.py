"""The price of uneven partitions: for a 9-head and a 28-head Llama-shaped model, each rank's share at world sizes
2, 3, 4 (and 8) under three layouts, and the compute time of the slowest rank.

Layouts, per rank r of N:
* ``tpmap``: query heads balanced (H // N, one more on the first H % N ranks), each rank holding the KV heads its
  query heads read (`tpmap.language.expr.rank_heads`), MLP width and vocabulary balanced the same way;
* ``deepspeed``: DeepSpeed AutoTP's uneven layout, by whole KV groups (KV // N groups, one more on the first
  ranks; a rank's query heads are its groups' H / KV each), MLP width in balanced units of 64; n/a where there are
  fewer groups than ranks;
* ``even``: the divisible split, only at world sizes that divide the heads (the nearest such size is the
  alternative a user has today).

Time: a rank's compute is the forward of a model shaped as that rank's shard (its heads, KV heads, MLP width and
vocabulary rows; the hidden size and layers of the full model), run alone on one thread: the slowest rank's time
is what every rank waits for in a tensor-parallel forward, before communication (which is the same for every
layout: one all-reduce per block). A 2-core machine cannot run 3 or 4 ranks at once, so the ranks are timed one
after another. Memory: the rank's parameters in fp32 (MiB).

    python benchmarks/uneven.py [--tokens 1 128] [--repeat 5]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from tpmap.language import expr

MODELS = {  # name: (hidden, heads, kv heads, intermediate, layers, vocab)
    "9 heads (SmolLM2-135M shape, 6 layers)": (576, 9, 3, 1536, 6, 49152),
    "28 heads (Qwen2.5-7B head layout, hidden 1792, 2 layers)": (1792, 28, 4, 4864, 2, 32000),
}


def balanced(n: int, parts: int, r: int, unit: int = 1) -> int:
    units, extra = divmod(n // unit, parts)
    return (units + (r < extra)) * unit + (n % unit if r == parts - 1 else 0)


def shard_shapes(layout: str, model: tuple, n: int) -> list[tuple[int, int, int, int]] | None:
    """Per rank (query heads, KV heads held, MLP width, vocabulary rows), or None where the layout cannot serve n."""
    _, heads, kv, inter, _, vocab = model
    out = []
    for r in range(n):
        if layout == "even":
            if heads % n or (kv % n and n % kv):
                return None
            q, k = heads // n, max(kv // n, 1)
        elif layout == "deepspeed":
            if kv < n:
                return None
            groups = balanced(kv, n, r)
            q, k = groups * (heads // kv), groups
        else:
            q = len(expr.rank_heads(heads, n, r))
            k = len(expr.rank_heads(kv, n, r, heads))
        mlp = balanced(inter, n, r, 64 if layout == "deepspeed" else 1)
        out.append((q, k, mlp, -(-vocab // n)))
    return out


def rank_model(model: tuple, shape: tuple[int, int, int, int]) -> LlamaForCausalLM:
    hidden, heads, _, _, layers, _ = model
    q, k, mlp, vocab = shape
    config = LlamaConfig(hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=heads,
                         head_dim=hidden // heads, intermediate_size=mlp, num_hidden_layers=layers, vocab_size=vocab,
                         tie_word_embeddings=False)
    object.__setattr__(config, "num_attention_heads", q)  # a shard's count: the hidden size need not divide it
    object.__setattr__(config, "num_key_value_heads", k)
    return LlamaForCausalLM(config).eval()


def forward_times(model: tuple, shapes: set, tokens: tuple[int, int], repeat: int) -> dict[tuple, float]:
    """{shard shape: best forward ms}, the shapes timed round-robin (`repeat` rounds) so that a noisy moment of the
    machine hits every shape alike."""
    models = {shape: rank_model(model, shape) for shape in shapes}
    ids = {shape: torch.randint(0, shape[3], tokens) for shape in shapes}
    best = dict.fromkeys(shapes, float("inf"))
    with torch.inference_mode():
        for shape, m in models.items():  # warm-up
            m(input_ids=ids[shape])
        for _ in range(repeat):
            for shape, m in models.items():
                t = time.perf_counter()
                m(input_ids=ids[shape])
                best[shape] = min(best[shape], (time.perf_counter() - t) * 1e3)
    return best


def mib(model: tuple, shape: tuple) -> float:
    with torch.device("meta"):
        return sum(p.numel() for p in rank_model(model, shape).parameters()) * 4 / 2**20


def row(name: str, layout: str, n: int, model: tuple, times: dict, full_ms: float) -> str:
    shapes = shard_shapes(layout, model, n)
    if shapes is None:
        return f"| {name} | {n} | {layout} | n/a | | | |"
    heads = [s[0] for s in shapes]
    slowest = max(times[s] for s in shapes)
    sizes = [mib(model, s) for s in set(shapes)]
    return (f"| {name} | {n} | {layout} | {'/'.join(map(str, heads))} | {max(heads) / statistics.mean(heads):.2f} "
            f"| {slowest:.1f} ({full_ms / slowest:.2f}x) | {max(sizes):.0f} / {min(sizes):.0f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs=2, default=[1, 128])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--sizes", type=int, nargs="+", default=[2, 3, 4, 8])
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    print(f"forward {tuple(args.tokens)}, fp32, one thread, best of {args.repeat} (shapes interleaved)")
    print("| model | world size | layout | query heads per rank | max/mean heads | slowest rank ms (speed-up "
          "over unsharded) | max / min MiB per rank |")
    print("|---|---|---|---|---|---|---|")
    layouts = ("tpmap", "deepspeed", "even")
    for name, model in MODELS.items():
        full = (model[1], model[2], model[3], model[5])
        shapes = {full} | {s for n in args.sizes for layout in layouts for s in shard_shapes(layout, model, n) or ()}
        times = forward_times(model, shapes, tuple(args.tokens), args.repeat)
        print(f"| {name} | 1 | unsharded | {model[1]} | 1.00 | {times[full]:.1f} | {mib(model, full):.0f} |")
        for n in args.sizes:
            for layout in layouts:
                print(row(name, layout, n, model, times, times[full]), flush=True)


if __name__ == "__main__":
    main()
