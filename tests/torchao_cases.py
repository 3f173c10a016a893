"""torchao-quantized models sharded by tpmap.apply, on real ranks (run by tests/test_torchao.py): the unsharded
quantized model is the reference, built in the same run; the sharded model's quantized tensors are checked
against the plan's local shapes."""
from __future__ import annotations

import copy

import torch
import torch.distributed as dist

import tpmap
from tpmap import verify


def _config(scheme: str):
    import torchao.quantization as q

    return {"int8_weight_only": lambda: q.Int8WeightOnlyConfig(),
            "int8_weight_only_group16": lambda: q.Int8WeightOnlyConfig(granularity=q.PerGroup(16)),
            "int8_per_tensor": lambda: q.Int8WeightOnlyConfig(granularity=q.PerTensor()),
            "int4_group16": lambda: q.IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=q.PerGroup(16)),
            "int4_per_row": lambda: q.IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=q.PerAxis(0)),
            "float8_weight_only": lambda: q.Float8WeightOnlyConfig(),
            "int8_dynamic_activation": lambda: q.Int8DynamicActivationInt8WeightConfig()}[scheme]()


def quantize(model: torch.nn.Module, scheme: str) -> torch.nn.Module:
    """Every nn.Linear but the LM head (the output embeddings), as torchao's quantize_ is usually called; for a
    scheme `X+experts`, X on the linears and the MoE experts' stacked weights too (by parameter name)."""
    from torchao.quantization import FqnToConfig, quantize_

    scheme, _, experts = scheme.partition("+")
    head = model.get_output_embeddings()
    quantize_(model, _config(scheme), filter_fn=lambda m, name: isinstance(m, torch.nn.Linear) and m is not head)
    if experts:
        names = [n for n, _ in model.named_parameters() if n.rsplit(".", 2)[-2] == "experts"]
        quantize_(model, FqnToConfig({n: _config(scheme) for n in names}), filter_fn=None)
    return model


def nbytes(t: torch.Tensor) -> int:
    """Bytes of a tensor, a quantized tensor subclass counted by its inner tensors (data, scales, zero points)."""
    if hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        return sum(nbytes(getattr(t, n)) for n in names if isinstance(getattr(t, n), torch.Tensor))
    return t.numel() * t.element_size()


def torchao_case(ref: str, verify_index: int, class_name: str, scheme: str) -> dict:
    ws, rank = dist.get_world_size(), dist.get_rank()
    full = quantize(verify.build_model(ref, verify_index, class_name), scheme)
    inputs = verify.case_inputs(ref, verify_index, full)
    with torch.no_grad():
        want = verify.main_output(full(**inputs))
    quantized = {n for n, p in full.named_parameters() if hasattr(p, "__tensor_flatten__")}
    full_bytes = sum(nbytes(p) for n, p in full.named_parameters() if n in quantized)
    model = copy.deepcopy(full)
    try:
        sharded = tpmap.apply(model, ws, mapping=verify.resolve(ref))
    except tpmap.TpmapError as e:  # and the model as it was
        untouched = [(n, type(m)) for n, m in model.named_modules()] == [(n, type(m)) for n, m in full.named_modules()]
        return {"refused": f"{type(e).__name__}: {e}", "untouched": untouched and all(
            p.shape == q.shape for p, q in zip(model.parameters(), full.parameters(), strict=True))}
    with torch.no_grad():
        got = verify.main_output(sharded(**inputs))
    plan = sharded.tpmap_plan.params
    local = dict(sharded.named_parameters())
    shapes_ok = all(tuple(local[n].shape) == plan[n].local_shape(rank) for n in quantized if n in plan)
    return {"refused": None, "rel": ((got - want).abs().max() / want.abs().max()).item(),
            "quantized": len(quantized), "split": sum(1 for n in quantized if n in plan and plan[n].dim is not None),
            "experts": sum(1 for n in quantized if n in plan and plan[n].dim is not None and ".experts." in n),
            "still_quantized": sum(1 for n in quantized if hasattr(local[n], "__tensor_flatten__")),
            "shapes_ok": shapes_ok, "full_bytes": full_bytes,
            "rank_bytes": sum(nbytes(local[n]) for n in quantized)}


def from_pretrained_case(folder: str, class_name: str, scheme: str, dtype: str) -> dict:
    """tpmap.from_pretrained(folder, quantization_config=TorchAoConfig(...)) against transformers' own load with
    the same config (the whole weights quantized), in the same run: logits, and every quantized tensor of this
    rank dequantized against the independent reference's slice of transformers' dequantized tensor, bit for bit."""
    import slicing_reference
    import transformers

    ws, rank = dist.get_world_size(), dist.get_rank()
    cls, torch_dtype = getattr(transformers, class_name), getattr(torch, dtype)
    config = lambda: transformers.TorchAoConfig(_config(scheme))  # noqa: E731
    full = cls.from_pretrained(folder, dtype=torch_dtype, quantization_config=config())
    got = tpmap.from_pretrained(folder, model_class=class_name, dtype=torch_dtype, quantization_config=config())
    ids = torch.randint(0, full.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, mine = full(ids).logits, got(ids).logits
    quantized = {n: p for n, p in full.named_parameters() if hasattr(p, "__tensor_flatten__")}
    loaded = tpmap.read_mapping(full)
    splits = slicing_reference.splits(full, loaded, tpmap.plan(full, ws, mapping=loaded), ws)
    local = dict(got.named_parameters())
    differ = [n for n, p in quantized.items() if not hasattr(local[n], "__tensor_flatten__") or not torch.equal(
        local[n].dequantize(), splits[n].local(p.dequantize(), ws, rank) if n in splits else p.dequantize())]
    return {"rel": ((mine - want).abs().max() / want.abs().max()).item(), "quantized": len(quantized),
            "split": sum(1 for n in quantized if n in splits), "differ": differ,
            "config": type(getattr(got.config, "quantization_config", None)).__name__,
            "full_bytes": sum(nbytes(p) for p in quantized.values()),
            "rank_bytes": sum(nbytes(local[n]) for n in quantized)}


def from_pretrained_refused(folder: str, class_name: str, scheme: str) -> dict:
    """The error tpmap.from_pretrained raises for this scheme at this world size, and the tensor bytes it read."""
    import transformers
    from checkpoint_cases import _CountReads

    with _CountReads() as reads:
        try:
            tpmap.from_pretrained(folder, model_class=class_name,
                                  quantization_config=transformers.TorchAoConfig(_config(scheme)))
        except tpmap.TpmapError as e:
            return {"refused": f"{type(e).__name__}: {e}", "read": reads.bytes}
    return {"refused": None, "read": reads.bytes}
