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


def transformers_dequantized(folder: str, dtype: torch.dtype = torch.float32) -> tuple[torch.nn.Module, torch.Tensor]:
    """(a plain model holding the weights transformers' own load of the folder decompresses, transformers' logits):
    transformers decompresses the weights on the first forward (which also fake-quantizes activations, if the
    scheme quantizes them); its decompressed weights, in a model built without the quantization_config."""
    quantized = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
    with torch.no_grad():
        logits = quantized(input_ids(quantized.config.vocab_size)).logits
    state = {k: v for k, v in quantized.state_dict().items() if not k.rpartition(".")[2].startswith("weight_")}
    config = AutoConfig.from_pretrained(folder)
    del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=dtype)
    missing, unexpected = plain.load_state_dict(state, strict=False)
    assert not unexpected and all("rotary" in m or "inv_freq" in m for m in missing), (missing, unexpected)
    return plain.eval(), logits


def library_dequantized(folder: str, out: str) -> torch.nn.Module:
    """A plain model of the weights compressed-tensors' own compressor decompresses from the whole stored tensors
    (the reference where transformers cannot load the folder), saved to `out` and loaded by transformers."""
    import json
    import shutil
    from pathlib import Path

    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig
    from safetensors.torch import load_file, save_file

    raw = json.loads((Path(folder) / "config.json").read_text())
    quantization = raw.pop("quantization_config")
    parsed = QuantizationConfig.model_validate({k: v for k, v in quantization.items()
                                                if k in QuantizationConfig.model_fields})
    scheme = next(iter(parsed.config_groups.values()))
    compressor = BaseCompressor.get_value_from_registry(scheme.format or parsed.format)
    tensors, dense = load_file(Path(folder) / "model.safetensors"), {}
    for name in [n for n in tensors if n.endswith(".weight_scale")]:
        prefix = name.removesuffix("weight_scale")
        module = {k.removeprefix(prefix): tensors.pop(k) for k in list(tensors) if k.startswith(prefix + "weight_")}
        module.update({"weight": tensors.pop(prefix + "weight")} if prefix + "weight" in tensors else {})
        dense[prefix + "weight"] = compressor.decompress(module, scheme)["weight"].float()
    Path(out).mkdir(parents=True, exist_ok=True)
    save_file({**tensors, **dense}, Path(out) / "model.safetensors", metadata={"format": "pt"})
    (Path(out) / "config.json").write_text(json.dumps(raw))
    if (Path(folder) / "generation_config.json").exists():
        shutil.copy(Path(folder) / "generation_config.json", Path(out) / "generation_config.json")
    return AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()


def load_compressed(folder: str, reference: str | None = None, dtype: str = "float32") -> dict:
    """tpmap.from_pretrained of the compressed-tensors folder on this rank against tpmap.apply on transformers'
    own decompressed weights: every tensor bit for bit; the logits (rank 0); the bytes this rank read (every run
    on its own: GAP_BYTES 0). With `reference` (folders to write: one per rank): against compressed-tensors' own
    decompression of the whole tensors instead (for folders transformers cannot load)."""
    saved = slice_io.GAP_BYTES
    slice_io.GAP_BYTES = 0
    try:
        with _CountReads() as reads:
            got = tpmap.from_pretrained(folder, dtype=getattr(torch, dtype))
    finally:
        slice_io.GAP_BYTES = saved
    if reference:
        plain = library_dequantized(folder, f"{reference}-{dist.get_rank()}")
    else:
        plain = transformers_dequantized(folder, getattr(torch, dtype))[0]
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
