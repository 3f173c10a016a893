"""Each rank's random state: the default CPU generator (from which `engine.rng` draws the seeds of the dropout
regions), the CUDA generators when CUDA is in use, Python's `random` and NumPy's global state.

At the shape it was saved at, every rank gets its own state back: dropout masks continue as in an uninterrupted
run. At another shape there is no own state to get back; each rank takes the state of tensor-parallel rank 0 of
the data-parallel replica of the same index (modulo the saved number of replicas), so every rank of a
tensor-parallel group holds the same default stream, as replicated dropout needs; its masks then differ from an
uninterrupted run's (a sharded region's mask depends on the rank's heads, which changed).
"""
from __future__ import annotations

import base64
import random
import sys

import torch


def capture() -> dict:
    state = {"cpu": _b64(torch.get_rng_state()), "python": _python(random.getstate())}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [_b64(s) for s in torch.cuda.get_rng_state_all()]
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        kind, keys, pos, has_gauss, cached = numpy.random.get_state()
        state["numpy"] = [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)]
    return state


def restore(state: dict) -> None:
    torch.set_rng_state(_tensor(state["cpu"]))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all([_tensor(s) for s in state["cuda"]])
    numpy = sys.modules.get("numpy")
    if numpy is not None and "numpy" in state:
        kind, keys, pos, has_gauss, cached = state["numpy"]
        numpy.random.set_state((kind, numpy.array(keys, dtype=numpy.uint32), pos, has_gauss, cached))


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.numpy().tobytes()).decode()


def _tensor(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)


def _python(state) -> list:
    version, internal, gauss = state
    return [version, list(internal), gauss]
