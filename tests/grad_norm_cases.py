"""Rank functions for tests/test_grad_norm.py: `tpmap.training.grad_norm` / `clip_grad_norm_` on a sharded model
against torch's on the unsharded one, built from the same weights in the same run.

Each case runs one forward/backward of transformers' loss on both models (fp64, init std 0.15), then compares
the sharded norm with ``torch.nn.utils.get_total_norm`` of the unsharded gradients, clips both by a max_norm of a
third of that norm (torch's ``clip_grad_norm_`` on the unsharded model, tpmap's on the sharded one), and compares
every rank's clipped gradient with the slice of the unsharded clipped gradient that the independent reference
(tests/slicing_reference.py) assigns to it.
"""
from __future__ import annotations

import copy

import slicing_reference
import torch
import torch.distributed as dist
import transformers
from lora_cases import _base_name, _reference_slice
from rank_cases import _grad_report, loss_kwargs, loss_of, zero_dropout_

import tpmap
import tpmap.training
from tpmap import verify

INIT_STD = 0.15


def _models(ref: str, verify_index: int, class_name: str, overrides: dict, shard: bool = True):
    """(unsharded model, sharded copy, inputs with labels, whether they have labels): the mapping's tiny config
    with `overrides` (vocab_size, num_key_value_heads), fp64, train mode without dropout."""
    config = verify.tiny_config(ref, verify_index)
    for key, value in overrides.items():
        setattr(config, key, value)
    torch.manual_seed(0)
    full = getattr(transformers, class_name)(config)
    verify.large_init_(full, 0, INIT_STD)
    full = full.to(torch.float64).train()
    if full._can_set_experts_implementation():
        full.set_experts_implementation("eager")  # grouped_mm has no fp64 kernel
    zero_dropout_(full)
    inputs, has_labels = loss_kwargs(full, verify.example_inputs(full, seed=3))
    if not shard:
        return full, None, inputs, has_labels
    sharded = tpmap.apply(copy.deepcopy(full), dist.get_world_size(), mapping=verify.resolve(ref))
    return full, sharded, inputs, has_labels


def _padding(sharded) -> dict:
    """{parameter name: (dim, local rows past this rank's pieces)} of the split tensors padded on this rank."""
    rank, out = dist.get_rank(), {}
    for layout in sharded.tpmap_plan.params.values():
        if layout.local_size and layout.local_size > len(layout.indices(rank)):
            out[layout.name] = (layout.dim, layout.local_size - len(layout.indices(rank)))
    return out


def _grads(model) -> list[torch.Tensor]:
    return [p.grad for p in model.parameters() if p.grad is not None]


def _use_reference_slices(full, sharded, rank: int) -> None:
    """Every sharded gradient := this rank's reference slice of the unsharded gradient (replicated tensors whole,
    a vocabulary's padding rows 0): the norm is then checked exactly, whatever the forward's rounding."""
    plan = sharded.tpmap_plan
    splits = slicing_reference.splits(full, verify.resolve(plan.model_type), plan, plan.tp_size)
    full_params = dict(full.named_parameters(remove_duplicate=False))
    with torch.no_grad():
        for name, p in sharded.named_parameters():
            want = full_params[name].grad
            p.grad.copy_(splits[name].local(want, plan.tp_size, rank) if name in splits else want)


def dense_case(ref: str, verify_index: int, class_name: str, overrides: dict, norm_type: float) -> dict:
    """grad_norm and clip_grad_norm_ of a tpmap model against torch's on the unsharded model: "natural" from the
    gradients backward gave each side (MoE routers compute in float32 even in fp64: ~1e-7 apart, `before`), then
    everything else after `_use_reference_slices`.

    The padding rows of a vocabulary the tp size does not divide hold no element of the unsharded model; their
    gradient stays 0 (measured: `padding_grad`), so to show they count for nothing they are set to 1.0 before
    the norms (and back to 0 before the clipped gradients are compared)."""
    rank = dist.get_rank()
    full, sharded, inputs, has_labels = _models(ref, verify_index, class_name, overrides)
    loss_of(full, inputs, has_labels).backward()
    loss_of(sharded, inputs, has_labels).backward()
    want = torch.nn.utils.get_total_norm(_grads(full), norm_type)
    report = {"before": _grad_report(full, sharded, rank)["worst_rel"], "want": want.item(),
              "natural": tpmap.training.grad_norm(sharded, norm_type).item()}
    _use_reference_slices(full, sharded, rank)
    padding = _padding(sharded)
    report["padding_grad"] = 0.0
    with torch.no_grad():
        for name, (dim, rows) in padding.items():
            pad = sharded.get_parameter(name).grad.narrow(dim, -rows, rows)
            report["padding_grad"] = max(report["padding_grad"], pad.abs().max().item())
            pad.fill_(1.0)
    report.update({"norm": tpmap.training.grad_norm(sharded, norm_type).item(),
                   "local_torch": torch.nn.utils.get_total_norm(_grads(sharded), norm_type).item(),
                   "padded": sorted(padding), "cut_lists": sorted(
                       t.name for t in sharded.tpmap_plan.tensors if t.holder == "modules"), "replicated_kv": any(
                       layout.replicated_heads for layout in sharded.tpmap_plan.params.values())})
    max_norm = want.item() / 3
    report["clip_want"] = torch.nn.utils.clip_grad_norm_(full.parameters(), max_norm, norm_type).item()
    report["clip_total"] = tpmap.training.clip_grad_norm_(sharded, max_norm, norm_type).item()
    for name, (dim, rows) in padding.items():  # (no part of the unsharded model: left out of the comparison)
        sharded.get_parameter(name).grad.narrow(dim, -rows, rows).zero_()
    report["after"] = _grad_report(full, sharded, rank)["worst_rel"]
    report["clipped_by"] = torch.nn.utils.get_total_norm(_grads(full), norm_type).item() / want.item()
    return report


def lora_case(ws_overrides: dict, targets: list[str], modules_to_save: list[str]) -> dict:
    """The same on a LoRA model (tpmap.peft.get_peft_model) against plain PEFT with the same adapter values:
    Llama, adapters split (B's rows of a Column, replicated with its KV heads; A's columns of a Row) and whole,
    and a trained copy of the vocabulary-parallel LM head (modules_to_save). The norm of the tpmap model inside
    (`base_norm`, cached before PEFT added its adapters) is the same: the cache follows the parameters."""
    from peft import LoraConfig
    from peft import get_peft_model as unsharded_peft_model

    import tpmap.peft

    ws, rank = dist.get_world_size(), dist.get_rank()
    full, sharded, inputs, has_labels = _models("llama", 0, "LlamaForCausalLM", ws_overrides)
    plan = sharded.tpmap_plan
    splits = slicing_reference.splits(full, verify.resolve("llama"), plan, ws)

    def config():
        return LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False, lora_dropout=0.0,
                          modules_to_save=modules_to_save)

    assert tpmap.training.grad_norm(sharded).item() == 0.0  # no gradients yet; its weights cached for `sharded`
    torch.manual_seed(1)
    full_peft = unsharded_peft_model(full, config())
    sharded_peft = tpmap.peft.get_peft_model(sharded, config())
    full_named = dict(full_peft.named_parameters())

    def reference(name, full_tensor):  # this rank's slice of an adapter tensor (or of its gradient)
        base, which = _base_name(name)
        return _reference_slice(full_tensor.detach(), which, splits.get(base), False, ws, rank)

    trained = [(name, p) for name, p in sharded_peft.named_parameters() if p.requires_grad]
    with torch.no_grad():
        for name, p in trained:
            p.copy_(reference(name, full_named[name]))
    loss_of(full_peft, inputs, has_labels).backward()
    loss_of(sharded_peft, inputs, has_labels).backward()

    def worst() -> float:
        return max(((p.grad - reference(name, full_named[name].grad)).abs().max()
                    / full_named[name].grad.abs().max().clamp_min(1e-30)).item() for name, p in trained)

    want = torch.nn.utils.get_total_norm(_grads(full_peft))
    report = {"norm": tpmap.training.grad_norm(sharded_peft).item(), "want": want.item(),
              "base_norm": tpmap.training.grad_norm(sharded).item(),  # (the model PEFT injected its adapters into)
              "local_torch": torch.nn.utils.get_total_norm(_grads(sharded_peft)).item(), "before": worst(),
              "trained": len(trained),
              "split_adapters": sum(1 for name, p in trained if p.shape != full_named[name].shape)}
    max_norm = want.item() / 3
    report["clip_want"] = torch.nn.utils.clip_grad_norm_(full_peft.parameters(), max_norm).item()
    report["clip_total"] = tpmap.training.clip_grad_norm_(sharded_peft, max_norm).item()
    report["after"] = worst()
    return report


def ddp_case(overrides: dict) -> dict:
    """dp 2 x tp 2: a tpmap Llama over mesh["tp"] inside DDP over mesh["dp"], each replica one half of the batch;
    grad_norm and clip_grad_norm_ of the DDP model against torch's on the unsharded model's whole-batch gradient
    (same token count per half, so the mean loss of the whole batch is the mean of the halves' losses)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.parallel import DistributedDataParallel as DDP

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp_rank, tp_rank = mesh["dp"].get_local_rank(), mesh["tp"].get_local_rank()
    full, _, _, _ = _models("llama", 0, "LlamaForCausalLM", overrides, shard=False)
    sharded = DDP(tpmap.apply(copy.deepcopy(full), group=mesh["tp"], mapping=verify.resolve("llama")),
                  process_group=mesh["dp"].get_group())
    ids = torch.randint(3, full.config.vocab_size, (4, 10), generator=torch.Generator().manual_seed(5))
    full(input_ids=ids, labels=ids).loss.backward()
    half = ids[2 * dp_rank: 2 * dp_rank + 2]
    sharded(input_ids=half, labels=half).loss.backward()
    inner = sharded.module
    want = torch.nn.utils.get_total_norm(_grads(full))
    report = {"before": _grad_report(full, inner, tp_rank)["worst_rel"], "want": want.item(),
              "norm": tpmap.training.grad_norm(sharded).item(),
              "local_torch": torch.nn.utils.get_total_norm(_grads(inner)).item()}
    max_norm = want.item() / 3
    report["clip_want"] = torch.nn.utils.clip_grad_norm_(full.parameters(), max_norm).item()
    report["clip_total"] = tpmap.training.clip_grad_norm_(sharded, max_norm).item()
    report["after"] = _grad_report(full, inner, tp_rank)["worst_rel"]
    try:  # the world (4 ranks) for the tp group of a model sharded over 2
        tpmap.training.grad_norm(sharded, group=dist.group.WORLD)
        report["wrong_group"] = None
    except tpmap.training.GradNormError as e:
        report["wrong_group"] = str(e)
    return report


def refused_case() -> dict:
    """The messages of the norm types grad_norm and clip_grad_norm_ refuse (None: not refused)."""
    from tpmap.training import GradNormError

    _, sharded, _, _ = _models("llama", 0, "LlamaForCausalLM", {})
    out = {}
    for key, call in (("p0", lambda: tpmap.training.grad_norm(sharded, 0)),
                      ("minus_inf", lambda: tpmap.training.clip_grad_norm_(sharded, 1.0, float("-inf")))):
        try:
            call()
            out[key] = None
        except GradNormError as e:
            out[key] = str(e)
    return out
