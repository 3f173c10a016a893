"""Rank processes on this machine: spawn once, run many tasks, report crashes and hangs.

Starting a process group with transformers imported costs seconds per process, so `Ranks` starts
``world_size`` processes once and then runs any number of importable functions on all of them. Two
users build on it: the tests' and `tpmap verify`'s `RankPool` below, and `tpmap.parallelize`'s handle
(`tpmap/parallelize/handle.py`), whose workers keep a model between calls (`tpmap/parallelize/worker.py`):

    with RankPool(4) as pool:
        results = pool.run(my_module.case, "some argument", timeout=120)   # one result per rank

How the processes are kept honest:

* each rank talks to this process over its own pipe; messages are pickled by the sender
  (`tpmap.parallelize.wire`: tensors' bytes out of band), so an object that cannot be sent fails where it can be
  reported, never in a queue's feeder thread;
* a rank that dies is seen at once (its process sentinel), one that does not answer within the
  task's timeout, or within `grace` seconds of another rank failing, is called hung; then every rank is
  killed and `RankFailure` raised with every rank's traceback or status;
* each rank reports how many collectives it issued during the task (the process group's sequence
  number), so a caller can tell an error raised identically on every rank, in step, from ranks left
  out of step (`Outcome.collectives`);
* ranks ignore Ctrl-C (this process decides: `answers` kills them on KeyboardInterrupt) and watch
  their parent: when this process is gone, a rank exits within a fraction of a second, whatever it was
  doing, so nothing is left behind by a crash or ``kill -9`` of this process.
"""
from __future__ import annotations

import math
import multiprocessing
import multiprocessing.util
import os
import pickle
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Generator
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import wait

import torch
import torch.distributed as dist

from tpmap.engine import shm
from tpmap.parallelize import wire
from tpmap.parallelize.quiet import quiet_if_asked

_PARENT_POLL_S = 0.2  # how often a rank checks that its parent is alive
_STOP = None  # the message that asks a rank to leave its loop
_READY = 0  # the task id of the "joined the process group" answer; tasks count from 1


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


class RemoteTraceback(Exception):
    """A rank's traceback as text: set as the ``__cause__`` of an exception re-raised in this process,
    so the printed traceback shows where the rank raised it."""

    def __init__(self, text: str):
        super().__init__(text)

    def __str__(self) -> str:
        return f'\n"""\n{self.args[0].rstrip()}\n"""'


@dataclass(kw_only=True)
class Outcome:
    """One rank's answer to one task."""
    ok: bool
    value: object = None  # the function's result (ok)
    error: str = ""  # the traceback (not ok)
    exception_only: str = ""  # the traceback's last part: "ValueError: message"
    exception: BaseException | None = None  # the exception itself, when it survived pickling
    collectives: int | None = None  # collectives issued during the task (None: not known)
    seconds: float = 0.0  # the task's time inside the rank

    def reraise(self) -> None:
        """Raise the rank's exception here, its traceback attached as the cause."""
        if self.exception is None:
            raise RuntimeError(self.exception_only.strip()) from RemoteTraceback(self.error)
        raise self.exception from RemoteTraceback(self.error)


@dataclass(frozen=True, kw_only=True)
class Setup:
    """How every rank starts: backend, one device per rank, threads, the collective timeout (seconds)."""
    backend: str
    devices: tuple[str, ...]
    threads: int
    collective_timeout: float


# -- in a rank process ------------------------------------------------------------------------------
class _Here:
    """This rank's state, in a rank process: its pipe, rank, device and the task it runs."""
    conn = None
    rank = -1
    device = torch.device("cpu")
    task = 0


def this_device() -> torch.device:
    """In a rank: the device this rank was given."""
    return _Here.device


def progress(payload) -> None:
    """In a rank, during a task: send `payload` to the driving process now (e.g. the token just generated)."""
    _send(("progress", _Here.task, _Here.rank, payload))


def set_collective_timeout(seconds: float) -> None:
    """In a rank: from now on a collective waiting longer than `seconds` fails (it started with the Setup's),
    on torch.distributed and on the shared-memory path alike."""
    dist.distributed_c10d._set_pg_timeout(timedelta(seconds=seconds))
    shm.set_timeout(seconds)


def _send(message: tuple) -> None:
    wire.send(_Here.conn, wire.encode(message))


def _watch_parent(parent: int) -> None:
    """Exit as soon as the process that started this rank is gone (reparented), whatever the main thread
    is doing: computing, or blocked in a collective that will never complete."""
    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(_PARENT_POLL_S)
        os._exit(3)

    threading.Thread(target=watch, name="tpmap-parent-watch", daemon=True).start()


def _collectives() -> int | None:
    """Collectives this process has issued on the default group (its sequence number); None where the
    backend does not count them, which callers read as "not known to be in step"."""
    group = dist.distributed_c10d._get_default_group()
    count = getattr(group, "_get_sequence_number_for_group", None)
    try:
        return count() if count is not None else None
    except RuntimeError:  # a backend without the count: failures are then never taken to be in step
        return None


def _worker(rank: int, world_size: int, port: int, conn, parent: int, setup: Setup) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole terminal group; the driver decides
    quiet_if_asked()  # the tpmap command's ranks: no third-party noise (tpmap.parallelize.quiet)
    _watch_parent(parent)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    torch.set_num_threads(setup.threads)  # ranks share the machine's cores
    _Here.conn, _Here.rank, _Here.device = conn, rank, torch.device(setup.devices[rank])
    try:
        if _Here.device.type == "cuda":
            torch.cuda.set_device(_Here.device)
        dist.init_process_group(setup.backend, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=setup.collective_timeout),
                                device_id=_Here.device if _Here.device.type == "cuda" else None)
    except BaseException as e:
        _send(("done", _READY, rank, _failure(e)))
        return
    _send(("done", _READY, rank, dict(ok=True)))
    while True:
        try:
            message = wire.receive(conn)
        except EOFError:  # the driving process is gone
            break
        if message is _STOP:
            break
        _run(*message)
    dist.destroy_process_group()
    # leave at once: an interpreter holding transformers takes seconds to tear down, and nothing here needs it
    # beyond multiprocessing's finalizers (they unlink the semaphores, e.g. tqdm's lock) and flushed output
    multiprocessing.util._run_finalizers()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _run(task_id: int, blob: bytes) -> None:
    """Run one task (its function and arguments pickled apart, so that a failure to unpickle them is the
    task's error) and send its outcome: the result, or the exception with its traceback."""
    _Here.task = task_id
    before, start = _collectives(), time.perf_counter()
    try:
        fn, args, kwargs = pickle.loads(blob)
        reply = dict(ok=True, value=fn(*args, **kwargs))
    except BaseException as e:
        reply = _failure(e)
    after = _collectives()
    reply.update(seconds=time.perf_counter() - start, collectives=None if before is None else after - before)
    try:
        _send(("done", task_id, _Here.rank, reply))
    except Exception as e:  # the result does not pickle: say so instead of leaving the driver waiting
        text = f"the result of the task cannot be sent back: {type(e).__name__}: {e}"
        _send(("done", task_id, _Here.rank, dict(ok=False, error=text, exception_only=text,
                                                 seconds=reply["seconds"], collectives=reply["collectives"])))


def _failure(e: BaseException) -> dict:
    """An Outcome's fields for an exception raised here (call inside its except block: the traceback)."""
    return dict(ok=False, error=traceback.format_exc(), exception_only="".join(traceback.format_exception_only(e)),
                exception=_portable_exception(e))


def _portable_exception(e: BaseException) -> BaseException | None:
    """`e` if it survives pickling both ways (its class importable, its arguments rebuilding it); None
    otherwise, and the driver raises a RuntimeError with the traceback text instead."""
    try:
        pickle.loads(pickle.dumps(e))
    except Exception:  # reported: the traceback text still travels, only the exception object does not
        return None
    return e


# -- in the driving process -------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


SIGNAL_CHECK_S = 0.25  # longest wait for a rank's message before Python's pending signals are handled


class Ranks:
    """``world_size`` spawned rank processes with ``torch.distributed`` initialised, taking tasks.

    `submit` sends one task (an importable function and its arguments) to every rank; `answers` yields
    what the ranks send while it runs (`progress`) and returns one `Outcome` per rank, or kills every rank
    and raises `RankFailure` when one died or hung. What to do with a rank that raised is the caller's
    choice (the outcomes say whether the ranks stayed in step)."""

    def __init__(self, world_size: int, setup: Setup, *, grace: float = 10.0):
        self.world_size, self.setup, self.grace = world_size, setup, grace
        self._procs: list = []
        self._conns: list = []
        self._next_id = _READY

    @property
    def started(self) -> bool:
        return bool(self._procs)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def start(self, timeout: float | None = None) -> None:
        """Spawn the ranks and wait until every one has joined the process group."""
        ctx = multiprocessing.get_context("spawn")
        port = _free_port()
        pipes = [ctx.Pipe() for _ in range(self.world_size)]
        self._conns = [here for here, _ in pipes]
        self._procs = [ctx.Process(target=_worker, daemon=True, name=f"tpmap-rank-{r}",
                                   args=(r, self.world_size, port, there, os.getpid(), self.setup))
                       for r, (_, there) in enumerate(pipes)]
        try:
            for p in self._procs:
                p.start()
        except BaseException:
            self.kill()
            raise
        for _, there in pipes:
            there.close()  # the ranks hold these ends now: a rank's death reads as end-of-file here
        what = "starting the process group"
        try:
            outcomes = drain(self.answers(_READY, timeout, what))
        except RankFailure as e:
            if not any(m.startswith("process died") for m in e.per_rank.values()):
                raise
            raise RankFailure(e.what + " (ranks are spawned: they re-import the main script, so a script must "
                              "start them under `if __name__ == \"__main__\":`; a rank's own error is on this "
                              "process's stderr)", e.per_rank) from None
        if not all(o.ok for o in outcomes):
            self.kill()
            raise RankFailure(f"{what} failed on {self.world_size} ranks",
                              {r: o.error if not o.ok else "started" for r, o in enumerate(outcomes)})

    def submit(self, fn, *args, **kwargs) -> int:
        """Send fn(*args, **kwargs) to every rank; return the task's id. Arguments that cannot be pickled
        raise TypeError here, before any rank is sent anything."""
        try:
            blob = pickle.dumps((fn, args, kwargs), protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as e:
            name = getattr(fn, "__qualname__", repr(fn))
            raise TypeError(f"the arguments of {name} cannot be sent to the ranks: {type(e).__name__}: {e}") from e
        self._next_id += 1
        frames = wire.encode((self._next_id, blob))
        for conn in self._conns:
            try:
                wire.send(conn, frames)
            except OSError:  # the rank is gone: `answers` reports its death, with its exit code
                continue
        return self._next_id

    def answers(self, task_id: int, timeout: float | None,
                what: str) -> Generator[tuple[int, object], None, list[Outcome]]:
        """Yield (rank, payload) for every `progress` message of the task; return every rank's Outcome.

        A rank that dies, or is silent past `timeout` (None: no limit) or past `grace` seconds after
        another rank failed, makes every rank stop and RankFailure raise. So does Ctrl-C here."""
        deadline = math.inf if timeout is None else time.monotonic() + timeout
        done: dict[int, Outcome] = {}
        failed: dict[int, str] = {}
        graced = False  # a rank has failed: the others have `grace` seconds left
        try:
            while len(done) + len(failed) < self.world_size:
                live = [r for r in range(self.world_size) if r not in done and r not in failed]
                left = max(0.0, deadline - time.monotonic())  # inf without a timeout
                # in slices: a Ctrl-C that the kernel hands to another thread of this process (torch's) sets
                # Python's flag without interrupting this wait; the main thread acts on it only between waits
                ready = wait([self._conns[r] for r in live] + [self._procs[r].sentinel for r in live],
                             min(left, SIGNAL_CHECK_S))
                for r in live:
                    if self._conns[r] in ready or self._procs[r].sentinel in ready:
                        message = self._receive(r)
                        if message is None:
                            failed[r] = self._death(r)
                        elif message[0] == "progress" and message[1] == task_id:
                            yield r, message[3]
                        elif message[0] == "done" and message[1] == task_id:
                            done[r] = Outcome(**message[3])
                if not graced and (failed or any(not o.ok for o in done.values())):
                    graced, deadline = True, min(deadline, time.monotonic() + self.grace)
                if time.monotonic() >= deadline:
                    for r in range(self.world_size):
                        if r not in done and r not in failed:
                            failed[r] = (f"no answer within {self.grace:.0f} s of another rank failing" if graced
                                         else f"no answer within {timeout:.0f} s") + " (hung, e.g. in a collective)"
        except KeyboardInterrupt:
            self.kill()
            raise
        if failed:
            self.kill()
            raise RankFailure(f"{what} failed on {self.world_size} ranks",
                              failed | {r: o.error if not o.ok else "finished" for r, o in done.items()})
        return [done[r] for r in range(self.world_size)]

    def _receive(self, rank: int):
        """The next message from `rank`; None when there is none and its pipe is closed (the rank is gone)."""
        conn = self._conns[rank]
        try:
            if not conn.poll():  # only the process sentinel is ready: it is gone, and sent nothing more
                return None
            return wire.receive(conn)
        except (EOFError, OSError):
            return None

    def _death(self, rank: int) -> str:
        self._procs[rank].join(1)
        return f"process died (exit code {self._procs[rank].exitcode})"

    def stop(self) -> None:
        """Ask live ranks to leave their loop (they leave the process group), then kill what is left."""
        for p, conn in zip(self._procs, self._conns):
            if p.pid is not None and p.is_alive():
                try:
                    wire.send(conn, wire.encode(_STOP))
                except OSError:  # its pipe is already closed: the rank is on its way out, killed below
                    continue
        deadline = time.monotonic() + 5
        for p in self._procs:
            if p.pid is not None:
                p.join(max(0.0, deadline - time.monotonic()))
        self.kill()

    def kill(self) -> None:
        """Kill every rank at once (they may be stuck in a collective) and wait for them to be gone."""
        started = [p for p in self._procs if p.pid is not None]
        for p in started:
            if p.is_alive():
                p.kill()
        for p in started:
            p.join(5)
        for conn in self._conns:
            conn.close()
        self._procs, self._conns = [], []


class RankPool(Ranks):
    """Gloo ranks on CPU, one thread each, for running test cases: any failure restarts the pool on its next
    use, so later cases are not poisoned by a rank stuck in a collective.

    The function must be importable by name (defined at module top level); it runs on every rank with
    ``torch.distributed`` initialised. A rank that raises, dies or does not answer in time makes `run`
    raise `RankFailure` with every rank's traceback."""

    def __init__(self, world_size: int, *, start_timeout: float = 180.0, collective_timeout: float = 60.0):
        super().__init__(world_size, Setup(backend="gloo", devices=("cpu",) * world_size, threads=1,
                                           collective_timeout=collective_timeout))
        self.start_timeout = start_timeout

    def start(self, timeout: float | None = None) -> None:
        super().start(self.start_timeout if timeout is None else timeout)

    def close(self) -> None:
        self.stop()

    def __enter__(self) -> RankPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def run(self, fn, *args, timeout: float = 300.0, **kwargs) -> list:
        """Run fn(*args, **kwargs) on every rank; return the results in rank order."""
        if not self.started:
            self.start()
        name = getattr(fn, "__qualname__", str(fn))
        what = f"running {name}{args}"
        outcomes = drain(self.answers(self.submit(fn, *args, **kwargs), timeout, what))
        if not all(o.ok for o in outcomes):
            self.kill()  # ranks may be out of step: start afresh on the next run
            raise RankFailure(f"{what} failed on {self.world_size} ranks",
                              {r: o.error if not o.ok else "finished" for r, o in enumerate(outcomes)})
        return [o.value for o in outcomes]


def drain(answers: Generator, on_progress=None):
    """Run a generator to its end, giving each item it yields to `on_progress`; return what it returns."""
    while True:
        try:
            item = next(answers)
        except StopIteration as stop:
            return stop.value
        if on_progress is not None:
            on_progress(item)
