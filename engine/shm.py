"""A same-host fast path for CPU collectives: all-reduce, all-gather and reduce-scatter through shared
memory instead of gloo's loopback TCP (the technique of DeepSpeed's shm all-reduce and vLLM's CPU backend).

On two CPU ranks a gloo all-reduce of a few KiB costs 0.4-0.8 ms, all of it latency; a decode step makes
~25 of them. Here each rank copies its tensor into its own slot of one shared segment, posts a sequence
number, waits until every peer has posted it, and reads the peers' slots directly.

    segment: | header: per rank (64-byte line) posted seq, pid | buffer 0: n slots | buffer 1: n slots |

(n = group_size, the number of ranks in the group: the tensor-parallel group or any other, dp x tp too.)

* **Sums in rank order.** Every rank computes ((slot 0 + slot 1) + slot 2) + ... for every element, so all
  ranks hold bit-identical results. At world size 2 that is gloo's result bit for bit (a + b == b + a); at
  3 and more, gloo's ring adds in another order, so results differ from gloo's by float rounding only.
  bf16 and fp16 sums of 3 or more slots accumulate in float32 and round once (`_sum_into`), as the unsharded
  matmul accumulates its products; gloo rounds after every add.
* **Double buffering.** Collective s writes buffer s % 2. A rank posts s only after finishing s - 1, and
  reaches s only after every peer posted s - 1, i.e. finished reading s - 2 = the buffer it now overwrites.
  Messages larger than a slot go in slot-sized chunks, one sequence number each.
* **Bounded waits.** A wait spins (not when the ranks outnumber the cores), then yields the CPU, then
  sleeps in short steps; past the first millisecond it checks every 10 ms whether the peers it waits
  for are alive (their pids, from the header) and raises `ShmPeerError` naming a dead one at once, or
  every missing rank after `TPMAP_SHM_TIMEOUT` seconds (default: the process group's timeout).
* **Nothing left behind.** The segment is a `memfd` (no name in /dev/shm): the peers open it through
  /proc/<pid of the group's first rank>/fd and the kernel frees it when the last rank exits, crash or not.
* **Chosen per group, the same way on every rank** (`for_group`, collective on the group's first use):
  only for gloo groups whose ranks share one host (hostname, boot id and pid namespace), on x86-64 (whose
  store order makes "copy, then post" visible in that order to the peers without fences). `TPMAP_SHM=0`
  turns it off, `TPMAP_SHM=1` demands it (`ShmUnavailableError` saying why where it cannot run), unset
  (auto) uses it wherever it can. Several groups (dp x tp) each get their own segment.

Under torch.compile the collectives are the custom ops `tpmap::shm_all_reduce`, `tpmap::shm_all_gather` and
`tpmap::shm_reduce_scatter` (traced as single graph nodes, no graph break), keyed by the group's handle.
"""
from __future__ import annotations

import mmap
import os
import platform
import socket
import threading
import time
import weakref

import torch
import torch.distributed as dist

HEADER = 4096  # per rank, one 64-byte line of int64: posted seq, pid, bytes posted in buffer 0, in buffer 1
LINE = 64
DEFAULT_SLOT_BYTES = 8 << 20  # per rank and buffer; larger messages go in chunks
SPINS = 2000  # polls before yielding the CPU
YIELD_S = 1e-3  # then yield until this long, then sleep in steps
SLEEP_S = 50e-6
CHECK_S = 0.01  # how often a long wait checks the peers' pids and the deadline
MAX_VIEWS = 256  # slot views kept per group (_slots)


class ShmUnavailableError(RuntimeError):
    """TPMAP_SHM=1 where the shared-memory path cannot run (the reason is in the message)."""


class ShmPeerError(RuntimeError):
    """A peer died or did not arrive within the timeout (named in the message)."""


class ShmMismatchError(RuntimeError):
    """Ranks posted different sizes to one collective: they are out of step (gloo raises on it too)."""


def _mode() -> str:
    value = os.environ.get("TPMAP_SHM", "auto").strip().lower()
    if value in ("0", "off", "false", "no"):
        return "off"
    if value in ("1", "on", "true", "yes", "force"):
        return "force"
    if value in ("", "auto"):
        return "auto"
    raise ValueError(f"TPMAP_SHM={value!r}: use 1 (force the shared-memory collectives), 0 (off) or auto")


def host_identity() -> str:
    """Ranks with the same identity can share memory: one kernel (boot id), one pid namespace (the peers
    are found and watched by pid), one host name."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        pidns = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return f"{socket.gethostname()}:{os.getpid()}"  # unknown: never equal to another process's
    return f"{socket.gethostname()}:{boot}:{pidns}"


def _local_obstacle() -> str | None:
    """Why this process cannot use the path (None: it can)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return (f"the CPU is {platform.machine()}, not x86-64: posting after the copy needs x86's store "
                f"order (no fences from Python)")
    if not hasattr(os, "memfd_create") or not os.path.isdir("/proc/self/fd"):
        return "no memfd_create or /proc (Linux only)"
    return None


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")  # a zombie is dead, only not yet reaped


# Keyed weakly on the process group: a strong key would keep a destroyed group (and its gloo threads) alive
# until interpreter shutdown, where tearing them down can abort the process.
_SET_TIMEOUTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # process group -> seconds, from set_timeout


def set_timeout(seconds: float, group=None) -> None:
    """From now on a shared-memory collective of `group` waits at most `seconds` for its peers (call it where
    the group's own timeout changes: torch.distributed's `_set_pg_timeout` is not visible from here)."""
    key = _group_key(group)
    _SET_TIMEOUTS[key] = seconds
    if _GROUPS.get(key) is not None:
        _GROUPS[key].timeout = seconds


def _timeout(group) -> float:
    """TPMAP_SHM_TIMEOUT, else set_timeout's, else the group's own collective timeout (init_process_group's)."""
    if "TPMAP_SHM_TIMEOUT" in os.environ:
        return float(os.environ["TPMAP_SHM_TIMEOUT"])
    if _group_key(group) in _SET_TIMEOUTS:
        return _SET_TIMEOUTS[_group_key(group)]
    pg = group if group is not None else dist.group.WORLD
    try:
        return pg._get_backend(torch.device("cpu")).options._timeout.total_seconds()
    except (AttributeError, RuntimeError):  # torch internals that may move: the default bound then
        return 1800.0


class ShmGroup:
    """The shared segment of one process group and the collectives over it. Calls must come in the same
    order on every rank, as for any collective."""

    def __init__(self, fd: int, rank: int, group_size: int, ranks: list[int], pids: list[int], slot_bytes: int,
                 timeout: float):
        self.group_ranks, self.rank, self.group_size, self.pids = ranks, rank, group_size, pids
        self.slot_bytes, self.timeout = slot_bytes, timeout
        self.handle = -1  # index in _HANDLES once chosen
        self._map = mmap.mmap(fd, HEADER + 2 * group_size * slot_bytes)  # the mapping keeps the memfd alive
        self._bytes = torch.frombuffer(self._map, dtype=torch.uint8)
        self._words = memoryview(self._map)[:HEADER].cast("q")  # int64 words of the header
        self._seq = 0
        self._lock = threading.Lock()
        self._peers = [r for r in range(group_size) if r != rank]
        self._views: dict = {}  # (buffer, nbytes, dtype) -> every rank's slot (_slots)
        # more ranks than cores: a spinning rank takes the core a peer needs to arrive, so yield at once
        self._spins = SPINS if group_size <= len(os.sched_getaffinity(0)) else 0
        self._words[self._line(rank) + 1] = os.getpid()

    @staticmethod
    def _line(r: int) -> int:
        return r * (LINE // 8)

    def _slot(self, buffer: int, r: int, nbytes: int, dtype: torch.dtype) -> torch.Tensor:
        start = HEADER + (buffer * self.group_size + r) * self.slot_bytes
        return self._bytes[start : start + nbytes].view(dtype)

    def _slots(self, buffer: int, nbytes: int, dtype: torch.dtype) -> list[torch.Tensor]:
        """Every rank's slot of `buffer` as `nbytes` of `dtype`; the views are kept (a decode step sends the
        same few sizes every time: slicing and viewing anew would cost more than the copy)."""
        key = (buffer, nbytes, dtype)
        slots = self._views.get(key)
        if slots is None:
            if len(self._views) >= MAX_VIEWS:  # many sizes (growing prompts): start over
                self._views.clear()
            slots = self._views[key] = [self._slot(buffer, r, nbytes, dtype) for r in range(self.group_size)]
        return slots

    def _wait(self, seq: int) -> None:
        words, line = self._words, self._line
        waiting = [r for r in self._peers if words[line(r)] < seq]
        spins, start, checked = 0, 0.0, 0.0
        while waiting:
            waiting = [r for r in waiting if words[line(r)] < seq]
            if not waiting:
                return
            spins += 1
            if spins < self._spins:
                continue
            now = time.monotonic()
            if not start:
                start = checked = now
            elif now - start < YIELD_S:
                os.sched_yield()
            else:
                time.sleep(SLEEP_S)
                if now - checked >= CHECK_S:
                    checked = now
                    self._check(waiting, now - start)

    def _check(self, waiting: list[int], waited: float) -> None:
        dead = [r for r in waiting if not _alive(self.pids[r])]
        if dead:
            raise ShmPeerError(", ".join(f"rank {self.group_ranks[r]} (pid {self.pids[r]})" for r in dead)
                               + f" died during a shared-memory collective (rank {self.group_ranks[self.rank]} "
                               f"waited {waited:.1f} s for it)")
        if waited > self.timeout:
            missing = [self.group_ranks[r] for r in waiting]
            raise ShmPeerError(f"Timed out: ranks {missing} did not reach a shared-memory "
                               f"collective within {self.timeout:g} s (TPMAP_SHM_TIMEOUT); rank "
                               f"{self.group_ranks[self.rank]} waited for them")

    def _exchange(self, mine: torch.Tensor) -> list[torch.Tensor]:
        """Put `mine` (flat, at most a slot) in this rank's slot, wait for every peer's: every rank's slot (read
        them before this rank's next collective, whose post tells the peers this buffer is free again)."""
        self._seq += 1
        seq, buffer = self._seq, self._seq % 2
        nbytes = mine.numel() * mine.element_size()
        slots = self._slots(buffer, nbytes, mine.dtype)
        slots[self.rank].copy_(mine)
        words, line = self._words, self._line(self.rank)
        words[line + 2 + buffer] = nbytes
        words[line] = seq  # the post, after the copy: x86 keeps the stores in order
        self._wait(seq)
        if any(words[self._line(r) + 2 + buffer] != nbytes for r in self._peers):
            sizes = [words[self._line(r) + 2 + buffer] for r in range(self.group_size)]
            raise ShmMismatchError(
                f"ranks {self.group_ranks} posted {sizes} bytes to one shared-memory collective (number "
                f"{seq} of the group): they called different collectives or shapes, out of step")
        return slots

    def _elements(self, t: torch.Tensor, parts: int = 1) -> int:
        return max(1, self.slot_bytes // (t.element_size() * parts))

    def all_reduce_(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over the group in place (t contiguous): rank order, the same bits on every rank."""
        flat = t.view(-1)
        step = self._elements(t)
        with self._lock:
            for i in range(0, flat.numel(), step):
                out = flat if step >= flat.numel() else flat[i : i + step]
                _sum_into(out, self._exchange(out))
        return t

    def all_gather_into(self, out: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """out (group_size * n elements, contiguous) <- every rank's t (n elements), rank-major."""
        flat, rows = t.reshape(-1), out.view(self.group_size, -1)  # (n,), (group_size, n)
        step = self._elements(t)
        with self._lock:
            for i in range(0, flat.numel(), step):
                for r, s in enumerate(self._exchange(flat[i : i + step])):
                    rows[r, i : i + s.numel()].copy_(s)
        return out

    def all_gather_last_into(self, out: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """out (..., group_size * F), contiguous <- every rank's t (..., F), rank-major along the last dim: each slot
        is copied straight to its place (no stacked copy and concatenation after)."""
        f = t.shape[-1]
        rows, dst = t.reshape(-1, f), out.view(-1, self.group_size, f)  # (n, F), (n, group_size, F)
        step = max(1, self.slot_bytes // (f * t.element_size()))  # whole rows per chunk
        if f * t.element_size() > self.slot_bytes:  # a row larger than a slot: through the stacked path
            stacked = self.all_gather_into(t.new_empty((self.group_size, *t.shape)), t)
            return out.copy_(torch.cat(stacked.unbind(0), dim=-1))
        with self._lock:
            for i in range(0, rows.shape[0], step):
                for r, s in enumerate(self._exchange(rows[i : i + step].reshape(-1))):
                    dst[i : i + s.numel() // f, r].copy_(s.view(-1, f))
        return out

    def reduce_scatter_into(self, out: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """out (n elements) <- the sum over ranks of chunk `rank` of every rank's t (group_size * n elements)."""
        rows, dst = t.reshape(self.group_size, -1), out.view(-1)  # (group_size, n), (n,)
        step = self._elements(t, self.group_size)
        with self._lock:
            for i in range(0, dst.numel(), step):
                part = rows[:, i : i + step].contiguous()  # (group_size, k): chunk i of every destination
                k = part.shape[1]
                mine = [s.view(self.group_size, k)[self.rank] for s in self._exchange(part.view(-1))]
                _sum_into(dst[i : i + k], mine)
        return out


HALF = (torch.bfloat16, torch.float16)


def _sum_into(out: torch.Tensor, parts: list[torch.Tensor]) -> torch.Tensor:
    """out <- ((parts[0] + parts[1]) + parts[2]) + ..., elementwise. bf16 and fp16 sums of 3 or more parts are
    accumulated in float32 and rounded once, as a matmul accumulates its products: the all-reduce adds one rounding
    to the ranks' partial sums, not group_size - 1 (with 2 parts a half-precision add is that already)."""
    if out.dtype in HALF and len(parts) > 2:
        acc = parts[0].float()  # (n,) float32
        for p in parts[1:]:
            acc.add_(p)
        return out.copy_(acc)
    torch.add(parts[0], parts[1], out=out)
    for p in parts[2:]:
        out.add_(p)
    return out


_GROUPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # process group -> ShmGroup | None (first use)
_HANDLES: list[ShmGroup] = []  # handle -> group, for the custom ops
_UNDECIDED = object()


def _group_key(group):
    return group if group is not None else dist.group.WORLD


def chosen(group) -> ShmGroup | None:
    """The group's ShmGroup if it was set up and chosen, else None; never communicates."""
    return _GROUPS.get(_group_key(group))


def for_group(group) -> ShmGroup | None:
    """The group's ShmGroup, deciding on first use (collective over the group: every rank of it must call
    this at the same point, as it does at its first collective), or None where gloo stays the path."""
    key = _group_key(group)
    shm = _GROUPS.get(key, _UNDECIDED)  # one lookup: a call on the hot path
    if shm is _UNDECIDED:
        _GROUPS[key] = shm = _setup(group)
    return shm


def _setup(group) -> ShmGroup | None:
    mode = _mode()
    group_size, rank = dist.get_world_size(group), dist.get_rank(group)
    backend = dist.get_backend(group)
    obstacle = _local_obstacle() if mode != "off" else "TPMAP_SHM=0"
    if obstacle is None and backend != "gloo":
        obstacle = f"the group's backend is {backend}, not gloo"
    fd = None
    slot_bytes = int(os.environ.get("TPMAP_SHM_SLOT_BYTES", DEFAULT_SLOT_BYTES))
    if obstacle is None and rank == 0:
        try:
            fd = os.memfd_create("tpmap-shm", os.MFD_CLOEXEC)
            os.ftruncate(fd, HEADER + 2 * group_size * slot_bytes)
        except OSError as e:
            obstacle = f"memfd_create failed: {e}"
    mine = dict(mode=mode, obstacle=obstacle, host=host_identity(), pid=os.getpid(), fd=fd, slot_bytes=slot_bytes)
    everyone: list = [None] * group_size
    dist.all_gather_object(everyone, mine, group=group)
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(group_size))
    reason = _reason(everyone, ranks, group_size)
    shm = None
    if reason is None:
        first = everyone[0]
        opened = None
        try:
            if rank != 0:  # the peers open rank 0's memfd, which stays open until all of them have mapped it
                fd = os.open(f"/proc/{first['pid']}/fd/{first['fd']}", os.O_RDWR)
            shm = ShmGroup(fd, rank, group_size, ranks, [e["pid"] for e in everyone], first["slot_bytes"],
                           _timeout(group))
        except OSError as e:
            opened = f"rank {ranks[rank]} could not map the segment: {e}"
        outcomes: list = [None] * group_size
        dist.all_gather_object(outcomes, opened, group=group)  # every rank mapped (or failed) before any closes
        failed = [o for o in outcomes if o]
        reason = failed[0] if failed else None
    if fd is not None:
        os.close(fd)
    if reason is None:
        _HANDLES.append(shm)
        shm.handle = len(_HANDLES) - 1
        return shm
    if any(e["mode"] == "force" for e in everyone):
        raise ShmUnavailableError(f"TPMAP_SHM=1 but the shared-memory collectives cannot run for the group of "
                                  f"ranks {ranks}: {reason}. Unset TPMAP_SHM (or set it to 0) to use "
                                  f"torch.distributed")
    return None


def _reason(everyone: list[dict], ranks: list[int], group_size: int) -> str | None:
    """Why the group cannot use shared memory (the same answer on every rank), None if it can."""
    if group_size == 1:
        return "a group of one rank has nothing to share"
    for r, e in enumerate(everyone):
        if e["obstacle"]:
            return f"rank {ranks[r]}: {e['obstacle']}"
    hosts = sorted({e["host"] for e in everyone})
    if len(hosts) > 1:
        by_host = {h: [ranks[r] for r, e in enumerate(everyone) if e["host"] == h] for h in hosts}
        return "its ranks are on different hosts: " + "; ".join(f"{v} on {h.split(':')[0]}"
                                                               for h, v in by_host.items())
    if len({e["slot_bytes"] for e in everyone}) > 1:
        return "TPMAP_SHM_SLOT_BYTES differs between ranks"
    return None


# Counted by engine.collectives.counting_collectives under the torch.distributed names they replace; under
# torch.profiler each shows as one `tpmap::shm_*` range (its waits included), as gloo's calls do.
def _profiled(name: str, fn, *args):
    if not torch.autograd._profiler_enabled():
        return fn(*args)
    with torch.profiler.record_function(name):
        return fn(*args)


def all_reduce(t: torch.Tensor, shm: ShmGroup) -> torch.Tensor:
    return _profiled("tpmap::shm_all_reduce", shm.all_reduce_, t)


def all_gather(out: torch.Tensor, t: torch.Tensor, shm: ShmGroup) -> torch.Tensor:
    """(..., F) -> out (..., group_size * F), rank-major along the last dim (the features' all-gather; counted as
    torch.distributed's list all_gather)"""
    return _profiled("tpmap::shm_all_gather", shm.all_gather_last_into, out, t)


def all_gather_into_tensor(out: torch.Tensor, t: torch.Tensor, shm: ShmGroup) -> torch.Tensor:
    return _profiled("tpmap::shm_all_gather", shm.all_gather_into, out, t)


def reduce_scatter_tensor(out: torch.Tensor, t: torch.Tensor, shm: ShmGroup) -> torch.Tensor:
    return _profiled("tpmap::shm_reduce_scatter", shm.reduce_scatter_into, out, t)


# Graph-safe custom ops for torch.compile: out of place, the group by its handle.
@torch.library.custom_op("tpmap::shm_all_reduce", mutates_args=())
def shm_all_reduce_op(x: torch.Tensor, handle: int) -> torch.Tensor:
    return _HANDLES[handle].all_reduce_(x.contiguous().clone())


@shm_all_reduce_op.register_fake
def _(x, handle):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("tpmap::shm_all_gather", mutates_args=())
def shm_all_gather_op(x: torch.Tensor, handle: int, group_size: int) -> torch.Tensor:
    """(n0, ...) -> (group_size * n0, ...), rank-major along dim 0 (funcol.all_gather_tensor's layout)."""
    x = x.contiguous()
    out = x.new_empty((group_size * x.shape[0], *x.shape[1:]))
    return _HANDLES[handle].all_gather_into(out, x)


@shm_all_gather_op.register_fake
def _(x, handle, group_size):
    return x.new_empty((group_size * x.shape[0], *x.shape[1:]))


@torch.library.custom_op("tpmap::shm_reduce_scatter", mutates_args=())
def shm_reduce_scatter_op(x: torch.Tensor, handle: int, group_size: int) -> torch.Tensor:
    """(group_size * n0, ...) summed over ranks -> this rank's chunk (n0, ...) along dim 0."""
    x = x.contiguous()
    out = x.new_empty((x.shape[0] // group_size, *x.shape[1:]))
    return _HANDLES[handle].reduce_scatter_into(out, x)


@shm_reduce_scatter_op.register_fake
def _(x, handle, group_size):
    return x.new_empty((x.shape[0] // group_size, *x.shape[1:]))
