"""Rank-side cases for tests/test_compressed_tensors.py (importable by name in the rank processes)."""
from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist
from checkpoint_cases import _CountReads, _differences, _tensors
from transformers import AutoConfig, AutoModelForCausalLM

import tpmap
from tpmap.engine import slice_io

FORMATS = {"W8A8": "int-quantized", "FP8_DYNAMIC": "float-quantized", "W4A16": "pack-quantized",
           "W4A16_ASYM": "pack-quantized"}


def compress(folder: Path, preset: str, linears: set[str], group_size: int | None = None,
             scale_dtype: torch.dtype = torch.float32) -> None:
    """Turn the plain checkpoint in `folder` into compressed-tensors' layout for `preset`, in place: the weights of
    the nn.Linear modules `linears` (what the scheme's target "Linear" matches) and the experts' per-expert
    weights (nn.Linear modules in the layout llm-compressor quantizes), lm_head left out as llm-compressor does."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme
    from compressed_tensors.quantization.utils import calculate_qparams
    from safetensors.torch import load_file, save_file

    scheme = preset_name_to_scheme(preset, ["Linear"])
    if group_size is not None:
        scheme.weights.group_size = group_size
    fmt = FORMATS[preset]
    compressor = BaseCompressor.get_value_from_registry(fmt)
    tensors, out = load_file(folder / "model.safetensors"), {}
    for name, t in tensors.items():
        module = name.removesuffix(".weight")
        if not (name.endswith(".weight") and t.dim() == 2 and (module in linears or ".experts." in name)):
            out[name] = t
            continue
        w = t.float()  # [out, in]
        if scheme.weights.strategy == "group":
            grouped = w.reshape(w.shape[0], -1, scheme.weights.group_size)  # [out, in / g, g]
            low, high = grouped.amin(-1), grouped.amax(-1)  # [out, in / g]
        else:
            low, high = w.amin(1, keepdim=True), w.amax(1, keepdim=True)  # [out, 1]
        scale, zero_point = calculate_qparams(low, high, scheme.weights)
        scale = scale.to(scale_dtype)  # llm-compressor's: the model's dtype
        module = compressor.compress({"weight": w, "weight_scale": scale, "weight_zero_point": zero_point}, scheme)
        out.update({name.removesuffix("weight") + k: v for k, v in module.items()})
    save_file(out, folder / "model.safetensors", metadata={"format": "pt"})
    raw = json.loads((folder / "config.json").read_text())
    config = QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"], format=fmt,
                                quantization_status="compressed")
    raw["quantization_config"] = {**json.loads(config.model_dump_json()), "quant_method": "compressed-tensors"}
    (folder / "config.json").write_text(json.dumps(raw, indent=1))


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


def load_compressed(folder: str, reference: str | None = None, dtype: str = "float32",
                    experts: str | None = None) -> dict:
    """tpmap.from_pretrained of the compressed-tensors folder on this rank against tpmap.apply on transformers'
    own decompressed weights: every tensor bit for bit; the logits (rank 0); the bytes this rank read (every run
    on its own: GAP_BYTES 0). With `reference` (folders to write: one per rank): against compressed-tensors' own
    decompression of the whole tensors instead (for folders transformers cannot load). `experts`: the placement
    of MoE experts, for both; with it, the local size of every parameter too."""
    saved = slice_io.GAP_BYTES
    slice_io.GAP_BYTES = 0
    try:
        with _CountReads() as reads:
            got = tpmap.from_pretrained(folder, dtype=getattr(torch, dtype), experts=experts)
    finally:
        slice_io.GAP_BYTES = saved
    if reference:
        plain = library_dequantized(folder, f"{reference}-{dist.get_rank()}")
    else:
        plain = transformers_dequantized(folder, getattr(torch, dtype))[0]
    want = tpmap.apply(plain, dist.get_world_size(), experts=experts)
    with torch.no_grad():
        logits = got(input_ids(got.config.vocab_size)).logits
    return {"differ": _differences(_tensors(want), _tensors(got)), "read": reads.bytes,
            "logits": logits if dist.get_rank() == 0 else None,
            "numel": {n: p.numel() for n, p in got.named_parameters()},
            "quantization_config": hasattr(got.config, "quantization_config")}


def load_refused(folder: str) -> str:
    try:
        tpmap.from_pretrained(folder)
    except tpmap.TpmapError as e:
        return f"{type(e).__name__}: {e}"
    raise AssertionError("loaded")
