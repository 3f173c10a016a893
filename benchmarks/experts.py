"""Expert placement: experts="parallel" (whole experts per rank) vs "split" (every expert split along its width) vs
the unsharded model, interleaved in one run (rounds rotate the order; the first two are warm-up; each time is the
slowest rank's). fp32, 1 thread per rank. A Mixtral-shaped model: hidden 512, 6 layers, E experts of width I, top-2.

    python -m torch.distributed.run --nproc-per-node 2 benchmarks/experts.py 16 256   # many thin experts
    python -m torch.distributed.run --nproc-per-node 2 benchmarks/experts.py 8 1024

2026-12-07, this 2-core machine, ws 2 (one run each; tpmap / unsharded):
E=16 I=256:  fwd 1x8 split 0.82, parallel 0.81; fwd 4x128 0.61 / 0.66; decode 0.91 / 0.98; train 0.55 / 0.62
E=8 I=1024:  fwd 1x8 split 0.67, parallel 0.75; fwd 4x128 0.57 / 0.67; decode 0.79 / 0.87; train 0.50 / 0.59
Split wins on CPU at ws 2 at both shapes: with whole experts the slowest rank is the one whose experts drew more
tokens this step, while split experts give every rank an equal share of every expert's work."""

from __future__ import annotations

import copy
import statistics
import sys
import time
import warnings

import torch
import torch.distributed as dist
import transformers

import tpmap

VOCAB = 8000


def forward(model, shape) -> None:
    ids = torch.randint(0, VOCAB, shape, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        model(ids)


def decode(model) -> None:
    ids = torch.randint(0, VOCAB, (1, 16), generator=torch.Generator().manual_seed(1))
    model.generate(ids, max_new_tokens=16, min_new_tokens=16, do_sample=False)


def train(model) -> None:
    ids = torch.randint(0, VOCAB, (2, 128), generator=torch.Generator().manual_seed(1))
    model.train()
    model(ids, labels=ids).loss.backward()
    model.zero_grad(set_to_none=True)
    model.eval()


def main() -> None:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    ws = dist.get_world_size()
    experts, width = int(sys.argv[1]), int(sys.argv[2])
    config = transformers.AutoConfig.for_model(
        "mixtral", hidden_size=512, num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=8,
        intermediate_size=width, num_local_experts=experts, num_experts_per_tok=2, vocab_size=VOCAB,
        max_position_embeddings=512)
    torch.manual_seed(0)
    full = transformers.MixtralForCausalLM(config).eval()
    models = {"unsharded": full,
              "split": tpmap.apply(copy.deepcopy(full), ws, experts="split").eval(),
              "parallel": tpmap.apply(copy.deepcopy(full), ws, experts="parallel").eval()}
    tasks = {"fwd 1x8": lambda m: forward(m, (1, 8)), "fwd 4x128": lambda m: forward(m, (4, 128)),
             "decode 16": decode, "train 2x128": train}
    times: dict[tuple[str, str], list[float]] = {(t, v): [] for t in tasks for v in models}
    for round_ in range(7):
        for task, run in tasks.items():
            names = list(models)
            for name in names[round_ % 3:] + names[:round_ % 3]:
                dist.barrier()
                start = time.perf_counter()
                run(models[name])
                took = torch.tensor([time.perf_counter() - start])
                dist.all_reduce(took, op=dist.ReduceOp.MAX)  # the slowest rank's
                if round_ >= 2:
                    times[(task, name)].append(took.item())
    if dist.get_rank() == 0:
        print(f"E={experts} I={width} ws={ws}")
        for task in tasks:
            base = statistics.median(times[(task, "unsharded")])
            print(f"{task:12s}", "  ".join(f"{name}: {statistics.median(times[(task, name)]):.4f}s "
                                           f"({statistics.median(times[(task, name)]) / base:.2f})" for name in models))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
