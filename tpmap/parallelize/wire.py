"""Messages between a driving process and its ranks over a multiprocessing pipe (`tpmap.parallelize.rank_processes`).

A message is pickled, except that every CPU tensor's bytes travel as a frame of their own, out of band
(pickle protocol 5): a large answer, such as a forward's logits, is copied neither into the pickle nor out
of it, and the receiver's tensor is built on the bytes as they arrive. Tensors arrive detached.

On the pipe, a message is three kinds of frames: the sizes of its buffers, the pickle, then each buffer.
"""
from __future__ import annotations

import io
import pickle

import torch


class _Pickler(pickle.Pickler):
    """pickle's Pickler, with plain CPU tensors reduced to (dtype, shape, their bytes out of band)."""

    def reducer_override(self, obj):
        if type(obj) is torch.Tensor and obj.device.type == "cpu" and obj.layout == torch.strided:
            flat = obj.detach().resolve_conj().resolve_neg().contiguous().reshape(-1)
            return _tensor, (flat.dtype, tuple(obj.shape), pickle.PickleBuffer(flat.view(torch.uint8).numpy()))
        return NotImplemented


def _tensor(dtype: torch.dtype, shape: tuple, data: bytearray) -> torch.Tensor:
    """The tensor over the received bytes (it keeps `data` alive)."""
    if not data:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(data, dtype=torch.uint8).view(dtype).view(shape)


def encode(message) -> list:
    """The frames of `message`. Raises here, as pickle does, when something in it cannot be pickled, so the
    sender can report it before anything is on the pipe."""
    buffers: list[pickle.PickleBuffer] = []
    head = io.BytesIO()
    _Pickler(head, protocol=5, buffer_callback=buffers.append).dump(message)
    raws = [b.raw() for b in buffers]
    return [pickle.dumps([r.nbytes for r in raws]), head.getbuffer(), *raws]


def send(conn, frames: list) -> None:
    """Write a message's frames (empty buffers are not written: their size says so)."""
    for i, frame in enumerate(frames):
        if i < 2 or frame.nbytes:
            conn.send_bytes(frame)


def receive(conn):
    """Read one message; EOFError when the other end is gone."""
    sizes = pickle.loads(conn.recv_bytes())
    head = conn.recv_bytes()
    buffers = []
    for size in sizes:
        data = bytearray(size)
        if size:
            conn.recv_bytes_into(data)
        buffers.append(data)
    return pickle.loads(head, buffers=buffers)
