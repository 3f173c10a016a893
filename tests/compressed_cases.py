"""Rank-side cases for tests/test_compressed_tensors.py (importable by name in the rank processes)."""
from __future__ import annotations

import torch
import torch.distributed as dist
from checkpoint_cases import _CountReads, _differences, _tensors
from transformers import AutoConfig, AutoModelForCausalLM

import tpmap
from tpmap.engine import slice_io


def input_ids(vocab_size: int) -> torch.Tensor:
    return (torch.arange(24).reshape(2, 12) * 7 + 3) % vocab_size


def transformers_dequantized(folder: str) -> tuple[torch.nn.Module, torch.Tensor]:
    """(a plain model holding the weights transformers' own load of the folder decompresses, transformers' logits):
    transformers decompresses the weights on the first forward (which also fake-quantizes activations, if the
    scheme quantizes them); its decompressed weights, in a model built without the quantization_config."""
    quantized = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        logits = quantized(input_ids(quantized.config.vocab_size)).logits
    state = {k: v for k, v in quantized.state_dict().items() if not k.rpartition(".")[2].startswith("weight_")}
    config = AutoConfig.from_pretrained(folder)
    del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = plain.load_state_dict(state, strict=False)
    assert not unexpected and all("rotary" in m or "inv_freq" in m for m in missing), (missing, unexpected)
    return plain.eval(), logits


def load_compressed(folder: str) -> dict:
    """tpmap.from_pretrained of the compressed-tensors folder on this rank against tpmap.apply on transformers'
    own decompressed weights: every tensor bit for bit; the logits (rank 0); the bytes this rank read (every run
    on its own: GAP_BYTES 0)."""
    saved = slice_io.GAP_BYTES
    slice_io.GAP_BYTES = 0
    try:
        with _CountReads() as reads:
            got = tpmap.from_pretrained(folder, dtype=torch.float32)
    finally:
        slice_io.GAP_BYTES = saved
    plain, _ = transformers_dequantized(folder)
    want = tpmap.apply(plain, dist.get_world_size())
    with torch.no_grad():
        logits = got(input_ids(got.config.vocab_size)).logits
    return {"differ": _differences(_tensors(want), _tensors(got)), "read": reads.bytes,
            "logits": logits if dist.get_rank() == 0 else None,
            "quantization_config": hasattr(got.config, "quantization_config")}


def load_refused(folder: str) -> str:
    try:
        tpmap.from_pretrained(folder)
    except tpmap.TpmapError as e:
        return f"{type(e).__name__}: {e}"
    raise AssertionError("loaded")
