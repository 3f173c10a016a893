"""What experts.py and floor.py time, and how: a causal LM's forward, greedy decode and training step on fixed
random tokens, and a loop that times every variant of every task interleaved, round by round in an order that
rotates, each time the slowest rank's (a barrier before, the max over ranks after)."""
from __future__ import annotations

import statistics
import time
import warnings
from collections.abc import Callable

import torch
import torch.distributed as dist


def start() -> int:
    """The rank's setup, as every timing here assumes: one thread, a gloo group (torchrun's environment), third-party
    warnings off. Returns the world size."""
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    return dist.get_world_size()


def tokens(vocab: int, shape: tuple[int, int], seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


def forward(model, vocab: int, shape: tuple[int, int]) -> None:
    with torch.no_grad():
        model(tokens(vocab, shape))


def decode(model, vocab: int, new_tokens: int) -> None:
    """Greedy decode of exactly `new_tokens` after a prompt of 16 (min_new_tokens: no early stop)."""
    model.generate(tokens(vocab, (1, 16)), max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)


def train(model, vocab: int, autocast: bool = False) -> None:
    """One training step's forward and backward on (2, 128) tokens (bf16 autocast on CPU if asked)."""
    ids = tokens(vocab, (2, 128))
    model.train()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = model(ids, labels=ids).loss
    loss.backward()
    model.zero_grad(set_to_none=True)
    model.eval()


def timed(tasks: dict[str, Callable[[str], None]], variants: list[str], rounds: int,
          warmup: int = 2) -> dict[tuple[str, str], float]:
    """{(task, variant): median seconds} over `rounds` rounds after the first `warmup`; tasks[task](variant) runs
    one. The order of the variants rotates each round, so the machine's noise hits them alike."""
    times: dict[tuple[str, str], list[float]] = {(t, v): [] for t in tasks for v in variants}
    for round_ in range(rounds):
        for task, run in tasks.items():
            k = round_ % len(variants)
            for name in variants[k:] + variants[:k]:
                dist.barrier()
                start = time.perf_counter()
                run(name)
                took = torch.tensor([time.perf_counter() - start])
                dist.all_reduce(took, op=dist.ReduceOp.MAX)  # the slowest rank's
                if round_ >= warmup:
                    times[(task, name)].append(took.item())
    return {key: statistics.median(values) for key, values in times.items()}
