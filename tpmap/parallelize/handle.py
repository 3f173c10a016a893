"""`tpmap.parallelize`: a tensor-parallel model driven from one ordinary Python process (a notebook, a
script, a small service), without torchrun.

    with tpmap.parallelize("path/to/model", 2, dtype=torch.bfloat16, device="cuda") as model:
        tokens = model.generate(input_ids, max_new_tokens=32)     # the tokens come back here

`parallelize` first checks what is cheap to check here: the arguments, and the plan, on a meta-device
model built from the checkpoint's config (a world size the mapping cannot serve is refused before any
worker starts). Then it spawns `world_size` workers (`tpmap.parallelize.rank_processes.Ranks`, gloo on CPU, NCCL with
``cuda:rank`` on GPUs), each of which loads only its own slices with `tpmap.from_pretrained`
(`tpmap/parallelize/worker.py`). This process holds no weights and no process group: each call sends its arguments
(token ids, keywords) to every worker and gets rank 0's answer back (tokens, outputs with the logits).

When something goes wrong:

* an error every worker raised alike, after the same number of collectives (a bad call, refused by
  `tpmap.parallelize.call_checks` before the model runs, or by transformers on every rank), is raised here with the
  worker's traceback as its cause; the workers are in step, so the handle stays usable;
* anything else (one worker raising alone, a worker dying, a worker silent past the collective timeout
  or `call_timeout`, Ctrl-C here) may leave the workers out of step: every worker is stopped,
  `RankFailure` is raised with each worker's traceback or status, the handle records why (`broken`)
  and later calls raise `HandleClosedError`;
* workers watch this process: when it exits or is killed, they exit too.
"""
from __future__ import annotations

import os
import threading
import time
import weakref
from collections.abc import Generator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from tpmap.checkpoint.load import plan_checkpoint
from tpmap.parallelize import worker
from tpmap.parallelize.errors import HandleBusyError, HandleClosedError, ParallelizeError
from tpmap.parallelize.rank_processes import RankFailure, Ranks, Setup, drain

_LOAD_TIMEOUT_S = 600.0  # the collective timeout while loading: ranks may read their slices at different speeds
# from_pretrained options that do not fit a handle driven from one process, and why
_REFUSED = {
    "world_size": "it is parallelize's second argument",
    "group": "parallelize starts the workers' process group itself",
    "loss_parallel": "a training option: the logits would stay split across the workers",
    "sequence_parallel": "a training option: hidden states would stay split across the workers",
    "output_loading_info": "parallelize returns a handle; the workers' loading reports go to their logs",
}


def parallelize(path, world_size: int, *, dtype=None, device=None, mapping=None, timeout: float = 300.0,
                call_timeout: float | None = None, seed: int = 0, **from_pretrained_kwargs) -> Parallelized:
    """Start `world_size` worker processes that each load their shard of the checkpoint folder `path`;
    return a handle that runs `generate` and forward calls on them from this process.

    * ``dtype``, ``mapping``, ``**from_pretrained_kwargs``: as `tpmap.from_pretrained` (``model_class``,
      ``attn_implementation``, config overrides, ...). The input check is off by default
      (``check_inputs=False``): every worker gets the same arguments by construction.
    * ``device``: ``"cuda"`` (worker r on ``cuda:r``, NCCL), ``"cpu"`` (gloo), or one device per worker;
      default: ``"cuda"`` when this machine has a GPU, else ``"cpu"``.
    * ``timeout``: seconds a collective may wait during a call; a worker that hangs while the others wait
      for it is found within ``timeout`` plus a few seconds, and every worker is stopped.
    * ``call_timeout``: an optional limit in seconds on each call as a whole.
    * ``seed``: every worker's torch seed, so that sampling draws alike on every worker.

    Use it as a context manager, or call ``close()``. A script must call it under
    ``if __name__ == "__main__":`` (the workers are spawned, which re-imports the script).
    """
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ParallelizeError(f"world_size must be a positive integer, not {world_size!r}")
    if not timeout > 0 or (call_timeout is not None and not call_timeout > 0):
        raise ParallelizeError(f"timeout ({timeout!r}) and call_timeout ({call_timeout!r}) must be positive seconds")
    devices = _devices(device, world_size)
    refused = sorted(k for k in from_pretrained_kwargs if k in _REFUSED)
    if refused:
        raise TypeError("tpmap.parallelize does not take " + "; ".join(f"{k} ({_REFUSED[k]})" for k in refused))
    kwargs = {"check_inputs": False, **from_pretrained_kwargs}
    start = time.perf_counter()
    # the planner's verdict, from the config alone: no weights, no process group, no worker yet
    plan_checkpoint(path, world_size, dtype=dtype, mapping=mapping,
                    **{k: v for k, v in kwargs.items() if k != "check_inputs"})
    planned = time.perf_counter()
    cuda = devices[0].startswith("cuda")
    setup = Setup(backend="nccl" if cuda else "gloo", devices=devices,
                  threads=max(1, (os.cpu_count() or 1) // world_size),
                  collective_timeout=max(timeout, _LOAD_TIMEOUT_S))
    handle = Parallelized(Ranks(world_size, setup, grace=min(10.0, timeout)), call_timeout)
    try:
        handle._ranks.start()
        started = time.perf_counter()
        loaded = handle._call(f"loading {path}", worker.load, path, dtype=dtype, mapping=mapping, seed=seed,
                              timeout=timeout, kwargs=kwargs)
    except BaseException:
        handle._stop()
        raise
    handle._configs = loaded
    handle.startup = Startup(plan_s=planned - start, spawn_s=started - planned, load_s=time.perf_counter() - started)
    return handle


def _devices(device, world_size: int) -> tuple[str, ...]:
    """One device name per worker."""
    if isinstance(device, (list, tuple)):
        chosen = [torch.device(d) for d in device]
        if len(chosen) != world_size:
            raise ParallelizeError(f"device lists {len(chosen)} devices for {world_size} workers")
        if len({d.type for d in chosen}) != 1 or chosen[0].type not in ("cpu", "cuda"):
            raise ParallelizeError(f"device {device!r}: every worker on 'cpu', or each on a GPU of its own")
        if chosen[0].type == "cuda" and (None in {d.index for d in chosen} or len(set(chosen)) < world_size):
            raise ParallelizeError(f"device {device!r}: name each worker's GPU, one GPU per worker (NCCL needs it)")
        return tuple(str(d) for d in chosen)
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    kind = torch.device(device)
    if kind.type == "cpu":
        return ("cpu",) * world_size
    if kind.type != "cuda":
        raise ParallelizeError(f"device {device!r}: parallelize places workers on 'cpu' or 'cuda'")
    if kind.index is not None:
        raise ParallelizeError(f"device {device!r}: 'cuda' puts worker r on cuda:r; to choose the GPUs, pass one "
                               "device per worker, or set CUDA_VISIBLE_DEVICES")
    if torch.cuda.device_count() < world_size:
        raise ParallelizeError(f"{world_size} workers need {world_size} GPUs; this machine has "
                               f"{torch.cuda.device_count()}: pass device='cpu' to run the workers on the CPU")
    return tuple(f"cuda:{r}" for r in range(world_size))


@dataclass(frozen=True)
class Startup:
    """Where `parallelize`'s time went: planning here, spawning the workers and their process group, loading."""
    plan_s: float
    spawn_s: float
    load_s: float

    @property
    def total_s(self) -> float:
        return self.plan_s + self.spawn_s + self.load_s


@dataclass(frozen=True)
class CallTiming:
    """The last call's round trip as this process saw it, and each worker's own time for it."""
    round_trip_s: float
    worker_s: tuple[float, ...]

    @property
    def overhead_s(self) -> float:
        """What the proxy adds: the round trip beyond the slowest worker's own time."""
        return self.round_trip_s - max(self.worker_s)


class Parallelized:
    """A model loaded by worker processes, one shard each, driven from this process (`tpmap.parallelize`).

    ``generate(...)`` and calling the handle (the forward) look like the model's own; ``config`` and
    ``generation_config`` are rank 0's, copied here once (changing them here changes nothing in the
    workers: pass settings to ``generate``). Calls from several threads take turns."""

    def __init__(self, ranks: Ranks, call_timeout: float | None):
        self._ranks, self._call_timeout = ranks, call_timeout
        self._configs: dict = {}
        self._lock = threading.Lock()
        self._holder: int | None = None  # the thread whose call is running
        self._closed = False
        self.broken: str | None = None  # why the workers were stopped, after a failure
        self.last_call: CallTiming | None = None
        self.startup: Startup | None = None
        self._stop = weakref.finalize(self, ranks.stop)  # also at garbage collection and interpreter exit

    # -- what the model shows --------------------------------------------------------------------
    @property
    def config(self):
        return self._configs["config"]

    @property
    def generation_config(self):
        return self._configs["generation_config"]

    @property
    def world_size(self) -> int:
        return self._ranks.world_size

    @property
    def pids(self) -> list[int]:
        """The workers' process ids (empty once they are stopped)."""
        return self._ranks.pids

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"stopped: {self.broken.splitlines()[0]}" if self.broken else "ready"
        model_type = getattr(self._configs.get("config"), "model_type", "?")
        return f"<tpmap.Parallelized {model_type} on {', '.join(self._ranks.setup.devices)} ({state})>"

    # -- calls -----------------------------------------------------------------------------------
    def generate(self, *args, streamer=None, **kwargs):
        """``model.generate(*args, **kwargs)`` on the workers; the tokens (or generate's output, without the
        cache) come back here. ``streamer`` (e.g. a TextStreamer) runs here, fed as the tokens come."""
        on_progress = None if streamer is None else streamer.put
        out = self._call("generate", worker.generate, _sendable(args), _sendable(kwargs), streamer is not None,
                         on_progress=on_progress)
        if streamer is not None:
            streamer.end()
        return out

    def stream(self, *args, **kwargs) -> Iterator[torch.Tensor]:
        """Generate, yielding each step's new tokens (a LongTensor of shape (batch,)) as the workers make them.
        The call starts at the first ``next()``. Breaking off early (``break``, ``close()``) waits for the
        call to finish in the workers, so that they stay in step (Ctrl-C meanwhile stops them)."""
        answers = self._answers("generate", worker.generate, _sendable(args), _sendable(kwargs), True)
        try:
            for step, tokens in enumerate(answers):
                if step:  # step 0 is the prompt, which generate hands its streamer first
                    yield tokens
        finally:
            drain(answers)  # broken off early: let the call finish in the workers, so they stay in step

    def __call__(self, *args, **kwargs):
        """The model's forward on the workers, without gradients or cache; the outputs (logits gathered,
        hidden states, loss) come back here."""
        return self._call("forward", worker.forward, _sendable(args), _sendable(kwargs))

    forward = __call__

    def run(self, fn, *args, **kwargs) -> list:
        """``fn(model, *args, **kwargs)`` on every worker's shard (`fn` importable by name, its results
        picklable); one result per worker, in rank order."""
        return self._call(f"run({getattr(fn, '__qualname__', fn)})", worker.run, fn, args, kwargs, every_rank=True)

    # -- lifecycle -------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the workers. A second close() raises HandleClosedError."""
        if self._closed:
            raise HandleClosedError("close() was already called on this handle")
        self._closed = True
        self._stop()

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> Parallelized:
        return self

    def __exit__(self, *exc) -> None:
        if not self._closed:
            self.close()

    # -- the protocol ----------------------------------------------------------------------------
    def _call(self, what: str, fn, *args, on_progress=None, every_rank: bool = False, **kwargs):
        """Run `fn` on every worker to the end, giving rank 0's progress payloads to `on_progress`; rank 0's
        result (every rank's with `every_rank`)."""
        answers = self._answers(what, fn, *args, **kwargs)
        while True:
            try:
                payload = next(answers)
            except StopIteration as stop:
                outcomes = stop.value
                break
            if on_progress is not None:
                try:
                    on_progress(payload)
                except BaseException as e:  # the caller's streamer raised, or Ctrl-C landed in it
                    answers.throw(e)  # `_answers` finishes the call or stops the workers, and re-raises
        return [o.value for o in outcomes] if every_rank else outcomes[0].value

    def _answers(self, what: str, fn, *args, **kwargs) -> Generator:
        """Run `fn` on every worker, yielding rank 0's progress payloads; return every worker's Outcome.

        An exception thrown in at a yield (the consumer's own code failed) lets the call finish in the
        workers, which stay in step; KeyboardInterrupt stops them instead."""
        with self._turn():
            start = time.perf_counter()  # the round trip includes sending: the workers start after it
            answers = None
            try:  # a Ctrl-C while the call is still being sent stops the workers too
                task = self._ranks.submit(fn, *args, **kwargs)
                answers = self._ranks.answers(task, self._call_timeout, what)
                while True:
                    try:
                        rank, payload = next(answers)
                    except StopIteration as stop:
                        outcomes = stop.value
                        break
                    if rank == 0:
                        yield payload
            except RankFailure as failure:  # the ranks are stopped already
                self._mark_broken(failure.summary())
                raise
            except KeyboardInterrupt:
                self._ranks.kill()
                self._mark_broken(f"interrupted (KeyboardInterrupt) during {what}")
                raise
            except BaseException:
                if answers is not None:
                    drain(answers)
                raise
            self.last_call = CallTiming(time.perf_counter() - start, tuple(o.seconds for o in outcomes))
        return self._judge(outcomes, what)

    def _judge(self, outcomes: list, what: str) -> list:
        """The outcomes when every worker succeeded. When every worker raised the same error after the same
        collectives, they are in step: raise it, with its traceback. Otherwise stop them all."""
        failed = [o for o in outcomes if not o.ok]
        if not failed:
            return outcomes
        if len(failed) == len(outcomes) and failed[0].collectives is not None and \
                len({(o.exception_only, o.collectives) for o in failed}) == 1:
            failed[0].reraise()
        self._ranks.kill()
        failure = RankFailure(f"{what} failed on {len(failed)} of {len(outcomes)} workers, which may have left them "
                              "out of step; every worker was stopped",
                              {r: o.error if not o.ok else "finished" for r, o in enumerate(outcomes)})
        self._mark_broken(failure.summary())
        raise failure

    @contextmanager
    def _turn(self):
        """This thread's turn to call the workers: one call at a time, never on a closed or stopped handle."""
        if self._holder == threading.get_ident():
            raise HandleBusyError("this thread's streamed generate is still open: finish it, or close() the "
                                  "iterator, before calling the handle again")
        self._check_open()
        with self._lock:
            self._check_open()  # closed or stopped while this thread waited for its turn
            self._holder = threading.get_ident()
            try:
                yield
            finally:
                self._holder = None

    def _check_open(self) -> None:
        if self._closed:
            raise HandleClosedError("this handle is closed (close(), or the end of its with block); start "
                                    "another with tpmap.parallelize")
        if self.broken:
            raise HandleClosedError(f"the workers of this handle were stopped after a failure:\n{self.broken}")

    def _mark_broken(self, reason: str) -> None:
        self.broken = reason
        self._stop()


def _sendable(value):
    """Call arguments as the workers get them: tensors on the CPU (each worker moves them to its own device;
    a CUDA tensor would arrive on the driver's device). Models are refused: weights never pass through here."""
    if isinstance(value, nn.Module):
        raise TypeError(f"a {type(value).__name__} cannot be sent to the workers (weights never pass through "
                        "the driver)")
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, (list, tuple)):
        return type(value)(_sendable(v) for v in value)
    if isinstance(value, dict):
        return {k: _sendable(v) for k, v in value.items()}
    return value
