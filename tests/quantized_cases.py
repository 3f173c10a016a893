"""Rank-side cases for tests/test_quantized_checkpoints.py (importable by name in the rank processes)."""
from __future__ import annotations

import torch
import torch.distributed as dist
import transformers
from checkpoint_cases import _CountReads, _differences, _tensors

import tpmap
from tpmap.checkpoint import fp8
from tpmap.engine import slice_io


def load_refused(folder: str) -> str:
    """What tpmap.from_pretrained raises on this rank for a quantized checkpoint (it must raise)."""
    try:
        tpmap.from_pretrained(folder)
    except tpmap.CheckpointError as e:
        return str(e)
    raise AssertionError("a quantized checkpoint loaded as plain tensors")


def input_ids(vocab_size: int) -> torch.Tensor:
    return (torch.arange(24).reshape(2, 12) * 7 + 3) % vocab_size


def load_fp8(folder: str, plain: str, dtype: str | None = None, experts: str | None = None) -> dict:
    """tpmap.from_pretrained of the FP8 folder on this rank, against tpmap.from_pretrained of `plain` (the same
    weights dequantized by the test and stored unquantized): every tensor bit for bit; the logits (rank 0),
    the parameter bytes this rank keeps, the local size of every parameter and the bytes it read (every run on
    its own: GAP_BYTES 0, so no gap between a Row weight's runs is read). Weights are dequantized a few rows at a
    time (CHUNK_ELEMENTS 3000: blocks of rows that do not fall on scale blocks), as large ones are. `experts`: the
    placement of MoE experts (tpmap.from_pretrained's)."""
    torch_dtype = getattr(torch, dtype) if dtype else None
    saved = slice_io.GAP_BYTES, fp8.CHUNK_ELEMENTS
    slice_io.GAP_BYTES, fp8.CHUNK_ELEMENTS = 0, 3000
    try:
        with _CountReads() as reads:
            got = tpmap.from_pretrained(folder, dtype=torch_dtype, experts=experts)
    finally:
        slice_io.GAP_BYTES, fp8.CHUNK_ELEMENTS = saved
    want = tpmap.from_pretrained(plain, dtype=torch_dtype, experts=experts)
    with torch.no_grad():
        logits = got(input_ids(got.config.vocab_size)).logits
    params = dict(got.named_parameters())
    return {
        "differ": _differences(_tensors(want), _tensors(got)),
        "logits": logits if dist.get_rank() == 0 else None,
        "param_bytes": sum(p.numel() * p.element_size() for p in params.values()),
        "numel": {n: p.numel() for n, p in params.items()},
        "read": reads.bytes,
        "dtype": str(got.dtype),
        "quantization_config": hasattr(got.config, "quantization_config"),
    }


def against_transformers(folder: str, dtype: str) -> dict:
    """tpmap.from_pretrained of the FP8 folder against tpmap.apply on transformers' own load of it (which
    dequantizes on CPU), every tensor bit for bit."""
    torch_dtype = getattr(torch, dtype)
    full = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch_dtype)
    quantized = [type(m).__name__ for m in full.modules() if "FP8" in type(m).__name__]
    want = tpmap.apply(full, dist.get_world_size())
    got = tpmap.from_pretrained(folder, dtype=torch_dtype)
    return {"differ": _differences(_tensors(want), _tensors(got)), "fp8_modules": quantized,
            "dtype": str(got.dtype)}
