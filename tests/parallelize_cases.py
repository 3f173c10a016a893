"""What the tests of `tpmap.parallelize` run: the tiny checkpoint, functions its workers run through
`Parallelized.run` (importable by name there) to fail on purpose, and, run as a script, a driver process
for the tests that interrupt or kill a driver.

    python tests/parallelize_cases.py CHECKPOINT MODE     # MODE: ctrl-c, kill, exit
"""
from __future__ import annotations

import json
import os
import signal
import sys
import time

import torch

from tpmap import verify

PROMPT = torch.tensor([[5, 6, 7, 8, 9, 10], [0, 0, 0, 11, 12, 13]])  # batch 2, the second left-padded
MASK = (torch.arange(6) >= torch.tensor([[0], [3]])).long()


def save_tiny_llama(path) -> torch.nn.Module:
    """The llama mapping's first tiny config (12 query heads, 2 KV heads, vocabulary 256) with a large init
    (std 0.2: a wrong split shows), saved to `path`; the unsharded model, in eval mode."""
    model = verify.build_model("llama", 0, "LlamaForCausalLM", seed=0, init_std=0.2)
    model.generation_config.pad_token_id = 0
    model.save_pretrained(path)
    return model


# -- run on every worker: fn(model, ...) ------------------------------------------------------------
def rank_of(model) -> int:
    import torch.distributed as dist

    return dist.get_rank()


def rank_and_query_rows(model) -> tuple[int, torch.Tensor]:
    """This worker's rank and its shard of the first layer's q_proj weight (its heads' rows)."""
    return rank_of(model), model.model.layers[0].self_attn.q_proj.weight.detach().clone()


def raise_in_forward_on(model, rank: int) -> None:
    """From now on, this rank's forward raises before its first collective (the others then wait for it)."""
    if rank_of(model) == rank:
        def fail(module, args, kwargs):
            raise RuntimeError(f"deliberate failure in rank {rank}'s forward")

        model.register_forward_pre_hook(fail, with_kwargs=True)


def hang_in_forward_on(model, rank: int) -> None:
    """From now on, this rank's forward sleeps for an hour (the others wait for it in a collective)."""
    if rank_of(model) == rank:
        model.register_forward_pre_hook(lambda module, args: time.sleep(3600))


def slow_forward(model, seconds: float) -> None:
    """Every forward sleeps `seconds` first, on every rank: a call that is still running when interrupted."""
    model.register_forward_pre_hook(lambda module, args: time.sleep(seconds))


# -- a driver process -------------------------------------------------------------------------------
def _driver(path: str, mode: str) -> None:
    import faulthandler

    import tpmap

    faulthandler.register(signal.SIGUSR1, all_threads=True)  # a test that finds this driver hung asks where
    handle = tpmap.parallelize(path, 2, device="cpu")
    print(json.dumps({"driver": os.getpid(), "workers": handle.pids}), flush=True)
    if mode == "exit":
        return  # no close(): the interpreter's exit must stop the workers
    if mode == "kill":
        signal.pause()  # until the test kills this process with SIGKILL
    handle.run(slow_forward, 0.5)
    if mode == "ctrl-c-other-thread":  # the kernel may hand a process's SIGINT to any thread not blocking it:
        import threading  # here it must go to a sleeping thread, the main thread waiting in the call meanwhile
        threading.Thread(target=time.sleep, args=(120,), daemon=True).start()
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    print("calling", flush=True)
    try:
        handle.generate(PROMPT, attention_mask=MASK, max_new_tokens=200)
    except KeyboardInterrupt:
        print(json.dumps({"interrupted": True, "broken": handle.broken, "workers_left": handle.pids}), flush=True)
        try:
            handle.generate(PROMPT, max_new_tokens=1)
        except tpmap.HandleClosedError as e:
            print(json.dumps({"after": str(e)}), flush=True)


if __name__ == "__main__":
    _driver(sys.argv[1], sys.argv[2])
