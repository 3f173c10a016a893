"""Rank functions for tests/test_uneven.py: a model at a world size that splits its heads unevenly, against the
unsharded model in the same run.

`round_trip`: rank 0 saves the unsharded model with transformers; every rank loads it with tpmap.from_pretrained
(each local tensor must equal its slice by tests/slicing_reference.py, bit for bit), saves it with
tpmap.save_pretrained, and rank 0 compares the saved tensors with transformers' own files, bit for bit."""
from __future__ import annotations

from pathlib import Path

import slicing_reference
import torch
import torch.distributed as dist
from safetensors.torch import load_file

import tpmap
from tpmap import verify


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(file)))
    return out


def round_trip(ref: str, verify_index: int, class_name: str, folder: str) -> dict:
    rank, ws = dist.get_rank(), dist.get_world_size()
    full = verify.build_model(ref, verify_index, class_name)
    source, saved = Path(folder) / "hf", Path(folder) / "tpmap"
    if rank == 0:
        full.save_pretrained(source)
    dist.barrier()
    model = tpmap.from_pretrained(str(source), model_class=class_name, mapping=verify.resolve(ref))
    splits = slicing_reference.splits(full, verify.resolve(ref), model.tpmap_plan, ws)
    full_params = dict(full.named_parameters())
    wrong = [name for name, p in model.named_parameters()
             if not torch.equal(p.detach(), splits[name].local(full_params[name], ws, rank) if name in splits
                                else full_params[name].detach())]
    tpmap.save_pretrained(model, saved)
    dist.barrier()
    full_numel = {name: p.numel() for name, p in full.named_parameters()}
    out = {"loaded_wrong": wrong, "uneven": list(model.tpmap_plan.uneven),  # what `tpmap plan` reports, and the truth:
           "planned_numel": model.tpmap_plan.rank_shares(full_numel)[rank] * sum(full_numel.values()),
           "local_numel": sum(p.numel() for p in model.parameters())}
    if rank == 0:
        want, got = _tensors(source), _tensors(saved)
        out["saved_keys_differ"] = sorted(set(want) ^ set(got))
        out["saved_wrong"] = [k for k in want if k in got and not (got[k].dtype == want[k].dtype
                                                                 and torch.equal(got[k], want[k]))]
        out["tensors"] = len(want)
    dist.barrier()
    return out


def _error(call) -> str:
    try:
        call()
    except ValueError as e:
        return f"{type(e).__name__}: {e}"
    return ""


def refused_paths(ref: str, verify_index: int, class_name: str, folder: str) -> dict:
    """What an uneven plan refuses on real ranks: a torchao-quantized model,
    quantization_config= on load (each the error message, "" when accepted)."""
    import torchao_cases

    ws = dist.get_world_size()
    full = verify.build_model(ref, verify_index, class_name)
    mapping = verify.resolve(ref)
    out = {}
    quantized = torchao_cases.quantize(verify.build_model(ref, verify_index, class_name), "int8_weight_only")
    out["torchao"] = _error(lambda: tpmap.apply(quantized, ws, mapping=mapping))
    if dist.get_rank() == 0:
        full.save_pretrained(Path(folder))
    dist.barrier()
    from torchao.quantization import Int8WeightOnlyConfig
    from transformers import TorchAoConfig
    out["quantization_config"] = _error(lambda: tpmap.from_pretrained(
        folder, model_class=class_name, mapping=mapping, quantization_config=TorchAoConfig(Int8WeightOnlyConfig())))
    return out
