"""A pool of real ranks on this machine: spawn once, run many cases, report crashes and hangs.

Starting a gloo process group with transformers imported costs seconds per process, so a `RankPool`
starts ``world_size`` processes once and then runs any number of functions on all of them:

    with RankPool(4) as pool:
        results = pool.run(my_module.case, "some argument", timeout=120)   # one result per rank

The function must be importable by name (defined at module top level); it runs on every rank with
``torch.distributed`` initialised (gloo). A rank that raises, dies or does not answer in time makes
`run` raise `RankFailure` with every rank's traceback; the pool then restarts on its next use, so
later cases are not poisoned by a rank stuck in a collective.
"""
from __future__ import annotations

import os
import queue
import socket
import time
import traceback
from datetime import timedelta

import torch.multiprocessing as mp


class RankFailure(RuntimeError):
    """One or more ranks raised, died or hung. `per_rank` holds each rank's traceback or status."""

    def __init__(self, what: str, per_rank: dict[int, str]):
        self.what, self.per_rank = what, per_rank
        details = "\n".join(f"--- rank {r} ---\n{msg.rstrip()}" for r, msg in sorted(per_rank.items()))
        super().__init__(f"{what}\n{details}")

    def summary(self) -> str:
        """One line per rank: the last line of its traceback (the exception), or its status."""
        lines = [self.what]
        for r, msg in sorted(self.per_rank.items()):
            last = next((line.strip() for line in reversed(msg.strip().splitlines()) if line.strip()), "")
            lines.append(f"  rank {r}: {last}")
        return "\n".join(lines)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, tasks, results, collective_timeout: float) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)  # ranks share the machine's cores
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=collective_timeout))
        results.put(("ready", rank, True, None))
    except BaseException:
        results.put(("ready", rank, False, traceback.format_exc()))
        return
    while True:
        task = tasks.get()
        if task is None:
            break
        task_id, fn, args, kwargs = task
        try:
            results.put((task_id, rank, True, fn(*args, **kwargs)))
        except BaseException:
            results.put((task_id, rank, False, traceback.format_exc()))
    dist.destroy_process_group()


class RankPool:
    def __init__(self, world_size: int, *, start_timeout: float = 180.0, collective_timeout: float = 60.0):
        self.world_size = world_size
        self.start_timeout, self.collective_timeout = start_timeout, collective_timeout
        self._procs: list = []
        self._next_id = 0

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self) -> None:
        ctx = mp.get_context("spawn")
        self._tasks = [ctx.Queue() for _ in range(self.world_size)]
        self._results = ctx.Queue()
        port = _free_port()
        self._procs = [
            ctx.Process(target=_worker, daemon=True,
                        args=(r, self.world_size, port, self._tasks[r], self._results, self.collective_timeout))
            for r in range(self.world_size)
        ]
        for p in self._procs:
            p.start()
        self._collect("ready", self.start_timeout, "starting the process group")

    def close(self) -> None:
        for p, q in zip(self._procs, getattr(self, "_tasks", [])):
            if p.pid is not None and p.is_alive():  # ask live ranks to leave their loop; the rest are killed
                q.put(None)
        deadline = time.monotonic() + 5
        for p in self._procs:
            if p.pid is not None:
                p.join(max(0.0, deadline - time.monotonic()))
        self._kill()

    def _kill(self) -> None:
        for p in self._procs:
            if p.pid is None:  # never started
                continue
            if p.is_alive():
                p.kill()
            p.join(5)
        self._procs = []

    def __enter__(self) -> RankPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- running ---------------------------------------------------------------------------------
    def run(self, fn, *args, timeout: float = 300.0, **kwargs) -> list:
        """Run fn(*args, **kwargs) on every rank; return the results in rank order."""
        if not self._procs:
            self.start()
        self._next_id += 1
        task_id = self._next_id
        for q in self._tasks:
            q.put((task_id, fn, args, kwargs))
        name = getattr(fn, "__qualname__", str(fn))
        return self._collect(task_id, timeout, f"running {name}{args}")

    def _collect(self, task_id, timeout: float, what: str) -> list:
        deadline = time.monotonic() + timeout
        out: dict[int, object] = {}
        failed: dict[int, str] = {}
        while len(out) + len(failed) < self.world_size:
            if failed:  # give the other ranks a short grace, then stop waiting for them
                deadline = min(deadline, time.monotonic() + 10)
            try:
                got_id, rank, ok, value = self._results.get(timeout=0.5)
            except queue.Empty:
                dead = [r for r, p in enumerate(self._procs) if not p.is_alive() and r not in out and r not in failed]
                for r in dead:
                    failed[r] = f"process died (exit code {self._procs[r].exitcode})"
                if time.monotonic() > deadline:
                    for r in range(self.world_size):
                        if r not in out and r not in failed:
                            failed[r] = f"no answer within {timeout:.0f} s (hung, e.g. in a collective)"
                    break
                continue
            if got_id != task_id:
                continue  # a late answer to a task that was given up on
            if ok:
                out[rank] = value
            else:
                failed[rank] = value
        if failed:
            self._kill()  # ranks may be stuck in a collective: start afresh on the next run
            for r in out:
                failed.setdefault(r, "finished")
            raise RankFailure(f"{what} failed on {self.world_size} ranks", failed)
        return [out[r] for r in range(self.world_size)]
