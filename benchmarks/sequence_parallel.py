"""Activation memory of a training step with and without sequence parallelism, per rank, no GPU needed.

Counts the bytes autograd saves for backward in one forward of a Llama-shaped model (the activations a
training step holds at its peak, before backward frees them), through
`torch.autograd.graph.saved_tensors_hooks`: every saved tensor's storage once (views and tensors saved twice
share it), parameters left out. Deterministic: no timing noise. Also times one training step (forward +
backward) of each, interleaved in the same process so the machine's load hits both alike (relative only).

    python benchmarks/sequence_parallel.py [--world-sizes 2 4] [--batch 2] [--seq 512] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

LLAMA = dict(hidden_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=8,
             intermediate_size=1408, vocab_size=8192, max_position_embeddings=4096, tie_word_embeddings=False)


def saved_bytes(model, inputs) -> tuple[int, int]:
    """(all, inside the blocks): bytes of the distinct storages autograd saves in one forward, parameters
    excluded. A storage counts as inside when it is first saved while a decoder layer runs."""
    import torch

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, tuple[int, bool]] = {}
    inside = [False]
    hooks = []
    for layer in model.model.layers:
        hooks.append(layer.register_forward_pre_hook(lambda *a: inside.__setitem__(0, True)))
        hooks.append(layer.register_forward_hook(lambda *a: inside.__setitem__(0, False)))

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params and storage.data_ptr() not in seen:
            seen[storage.data_ptr()] = (storage.nbytes(), inside[0])
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(**inputs).loss
    loss.backward()
    model.zero_grad(set_to_none=True)
    for h in hooks:
        h.remove()
    return sum(n for n, _ in seen.values()), sum(n for n, i in seen.values() if i)


def measure(batch: int, seq: int, steps: int) -> dict:
    import copy

    import torch
    import torch.distributed as dist
    from transformers import AutoConfig, LlamaForCausalLM

    import tpmap

    torch.manual_seed(0)
    full = LlamaForCausalLM(AutoConfig.for_model("llama", **LLAMA)).train()  # dropout 0 in Llama's config
    ws = dist.get_world_size()
    ids = torch.randint(3, LLAMA["vocab_size"], (batch, seq), generator=torch.Generator().manual_seed(1))
    inputs = dict(input_ids=ids, labels=ids)
    models = {"unsharded": full,
              "tp": tpmap.apply(copy.deepcopy(full), ws, check_inputs=False),
              "sp": tpmap.apply(copy.deepcopy(full), ws, check_inputs=False, sequence_parallel=True)}
    out = {}
    for key, model in models.items():
        out[f"{key}_bytes"], out[f"{key}_block_bytes"] = saved_bytes(model, inputs)
    times: dict[str, list[float]] = {"tp": [], "sp": []}
    for _ in range(steps):
        for key in ("tp", "sp"):
            t0 = time.perf_counter()
            models[key](**inputs).loss.backward()
            times[key].append(time.perf_counter() - t0)
            models[key].zero_grad(set_to_none=True)
    out |= {f"{k}_step_s": statistics.median(v[1:]) for k, v in times.items()}
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    from tpmap.parallelize.rank_processes import RankPool

    print(f"Llama-shaped {LLAMA['num_hidden_layers']} layers, hidden {LLAMA['hidden_size']}, vocabulary "
          f"{LLAMA['vocab_size']}, fp32, batch ({args.batch}, {args.seq}); autograd's saved tensors per rank (max)")
    print("MiB saved for backward: all of the forward | inside the decoder layers (what SP splits)")
    print(f"{'ws':>3} {'unsharded':>16} {'TP':>14} {'SP':>14} {'SP/TP':>12} {'TP step s':>10} {'SP step s':>10}")
    results = {}
    for ws in args.world_sizes:
        with RankPool(ws) as pool:
            per_rank = pool.run(measure, args.batch, args.seq, args.steps, timeout=3600)
        r = {k: max(p[k] for p in per_rank) for k in per_rank[0]}
        results[ws] = r
        mib = {k: r[f"{k}_bytes"] / 2**20 for k in ("unsharded", "tp", "sp")}
        blk = {k: r[f"{k}_block_bytes"] / 2**20 for k in ("unsharded", "tp", "sp")}
        cells = [f"{mib[k]:7.1f} |{blk[k]:6.1f}" for k in ("unsharded", "tp", "sp")]
        ratio = f"{mib['sp'] / mib['tp']:5.2f} |{blk['sp'] / blk['tp']:5.2f}"
        print(f"{ws:>3} {cells[0]:>16} {cells[1]:>14} {cells[2]:>14} {ratio:>12} {r['tp_step_s']:>10.3f} "
              f"{r['sp_step_s']:>10.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
