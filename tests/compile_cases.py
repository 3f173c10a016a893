"""torch.compile cases run on every rank (tests/test_compile.py): graph breaks, and compiled results
against eager tpmap and the unsharded model in the same run. Backend aot_eager: the graphs dynamo and
AOT autograd capture, run without inductor (which needs a C++ compiler on CPU)."""
from __future__ import annotations

import copy

import rank_cases
import torch
import torch.distributed as dist

import tpmap
from tpmap import verify


def _breaks(fn, inputs: dict) -> dict:
    torch._dynamo.reset()
    report = torch._dynamo.explain(fn)(inputs)
    reasons = [f"{b.reason.splitlines()[0][:200]} @ {b.user_stack[-1].filename}:{b.user_stack[-1].lineno}"
               if b.user_stack else b.reason.splitlines()[0][:200] for b in report.break_reasons]
    return {"count": report.graph_break_count, "reasons": reasons}


def graph_breaks(ref: str, class_name: str) -> dict:
    """Graph breaks of an eval forward and of a training forward (loss from labels, dropout as the
    config sets it), unsharded and tpmap."""
    full = verify.build_model(ref, 0, class_name)
    inputs, _ = rank_cases.loss_kwargs(full, verify.case_inputs(ref, 0, full))
    sharded = tpmap.apply(copy.deepcopy(full), dist.get_world_size(), mapping=verify.resolve(ref))
    out = {}
    for name, model in (("unsharded", full), ("tpmap", sharded)):
        out[f"{name}_forward"] = _breaks(lambda kw, model=model: model.eval()(**kw).logits, inputs)
        out[f"{name}_train"] = _breaks(lambda kw, model=model: model.train()(**kw).loss, inputs)
    torch._dynamo.reset()
    return out


def compiled_logits(ref: str, class_name: str) -> dict:
    """Compiled (aot_eager) tpmap logits against eager tpmap's and the unsharded model's."""
    torch._dynamo.reset()
    full = verify.build_model(ref, 0, class_name)
    inputs = verify.case_inputs(ref, 0, full)
    sharded = tpmap.apply(copy.deepcopy(full), dist.get_world_size(), mapping=verify.resolve(ref))
    with torch.no_grad():
        want, eager = full(**inputs).logits, sharded(**inputs).logits
        compiled = torch.compile(sharded, backend="aot_eager")(**inputs).logits
    torch._dynamo.reset()
    return {"vs_eager": (compiled - eager).abs().max().item(), "vs_unsharded": (compiled - want).abs().max().item(),
            "scale": want.abs().max().item()}


def compiled_training_step(ref: str, class_name: str) -> dict:
    """A compiled (aot_eager) forward + backward: per-shard gradients against the unsharded gradients'
    slices (rank_cases._grad_report), and the loss."""
    torch._dynamo.reset()
    rank = dist.get_rank()
    full = verify.build_model(ref, 0, class_name)
    inputs, has_labels = rank_cases.loss_kwargs(full, verify.case_inputs(ref, 0, full))
    sharded = tpmap.apply(copy.deepcopy(full), dist.get_world_size(), mapping=verify.resolve(ref))
    loss_full = rank_cases.loss_of(full, inputs, has_labels)
    loss_full.backward()
    loss = rank_cases.loss_of(torch.compile(sharded, backend="aot_eager"), inputs, has_labels)
    loss.backward()
    report = rank_cases._grad_report(full, sharded, rank)
    report["loss_diff"] = abs(loss.item() - loss_full.item())
    torch._dynamo.reset()
    return report


def compiled_dropout(ref: str, class_name: str) -> dict:
    """Training mode with dropout, same seed: the compiled forward gives eager tpmap's output (whose
    masks tests/test_training.py checks: rank-specific inside sharded regions), and ranks agree."""
    torch._dynamo.reset()
    full = verify.build_model(ref, 0, class_name)
    inputs = verify.case_inputs(ref, 0, full)
    model = tpmap.apply(full, dist.get_world_size()).train()
    outputs = []
    for step in (model, torch.compile(model, backend="aot_eager")):
        torch.manual_seed(1234)
        with torch.no_grad():
            outputs.append(verify.main_output(step(**inputs)))
    with torch.no_grad():
        eval_out = verify.main_output(model.eval()(**inputs))
    everyone = [torch.empty_like(outputs[1]) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, outputs[1].contiguous())
    torch._dynamo.reset()
    return {"vs_eager": (outputs[0] - outputs[1]).abs().max().item(),
            "dropout_active": not torch.allclose(outputs[0], eval_out),
            "ranks_agree": all(torch.equal(everyone[0], o) for o in everyone)}
