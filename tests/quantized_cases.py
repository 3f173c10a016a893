"""Rank-side cases for tests/test_quantized_checkpoints.py (importable by name in the rank processes)."""
from __future__ import annotations

import tpmap


def load_refused(folder: str) -> str:
    """What tpmap.from_pretrained raises on this rank for a quantized checkpoint (it must raise)."""
    try:
        tpmap.from_pretrained(folder)
    except tpmap.QuantizedCheckpointError as e:
        return str(e)
    raise AssertionError("a quantized checkpoint loaded as plain tensors")
