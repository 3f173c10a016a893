"""The errors of `tpmap.parallelize` and its handle."""
from __future__ import annotations

from tpmap.language.errors import TpmapError

__all__ = [
    "HandleBusyError",
    "HandleClosedError",
    "InvalidCallError",
    "ParallelizeError",
]


class ParallelizeError(TpmapError):
    """`tpmap.parallelize` was asked for workers it cannot start: a world size that is not a positive integer,
    a device it cannot place them on, more GPUs than the machine has."""


class InvalidCallError(TpmapError):
    """A call to a `tpmap.parallelize` handle that its workers refuse before running the model: token ids
    outside the vocabulary, or an output that would stay split across the workers (the cache, attention
    weights). Raised on every worker alike, so the handle stays usable."""


class HandleClosedError(TpmapError):
    """A `tpmap.parallelize` handle was used after `close()` (or closed twice), or after its workers were
    stopped by a failure; the message says which."""


class HandleBusyError(TpmapError):
    """A `tpmap.parallelize` handle was called from the thread whose streamed generate is still open; finish
    or close that stream first."""
