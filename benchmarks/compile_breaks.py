"""Graph breaks of a tpmap model under torch.compile, against the unsharded model.

For each tiny verify model: `torch._dynamo.explain` of the eval forward and of a training forward
(train mode, loss from labels; AOT compiles its backward with it), with dropout set to 0 and as
configured, of the unsharded model and of the tpmap model at the launch's world size, with every
break reason printed. Breaks the unsharded model also has are transformers' own. Then result checks:
compiled (aot_eager) tpmap logits against eager tpmap's and the unsharded model's, and the
gradients of a compiled training step against an eager one.

    torchrun --nproc-per-node 2 benchmarks/compile_breaks.py [--models llama gpt2 bert mixtral] [--json out.json]
"""
from __future__ import annotations

import argparse
import copy
import json

import torch
import torch.distributed as dist

CASES = {"llama": "LlamaForCausalLM", "gpt2": "GPT2LMHeadModel", "bert": "BertForMaskedLM",
         "mixtral": "MixtralForCausalLM"}


def explain(fn, *args) -> tuple[int, list[str]]:
    """(graph breaks, one line per break reason) of fn(*args) under dynamo."""
    torch._dynamo.reset()
    report = torch._dynamo.explain(fn)(*args)
    reasons = []
    for b in report.break_reasons:
        frame = b.user_stack[-1] if b.user_stack else None
        where = f" @ {frame.filename.rsplit('/', 2)[-1]}:{frame.lineno}" if frame else ""
        reasons.append(f"{b.reason.splitlines()[0][:160]}{where}")
    return report.graph_break_count, reasons


def loss(model, inputs):  # a training forward: (B, T) ids -> scalar loss (backward is compiled with it)
    return model(**inputs, labels=inputs["input_ids"]).loss


def no_dropout_(model) -> None:
    """Every dropout probability to 0 (modules, float attributes, configs), then train() to rescan."""
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
        for holder in (m, getattr(m, "config", None)):
            for key, value in list(vars(holder).items()) if holder is not None else []:
                if ("dropout" in key or "pdrop" in key) and isinstance(value, float):
                    setattr(holder, key, 0.0)
    model.train()


def case(ref: str, class_name: str) -> dict:
    import tpmap
    from tpmap import verify

    ws = dist.get_world_size()
    full = verify.build_model(ref, 0, class_name)
    inputs = verify.case_inputs(ref, 0, full)
    sharded = tpmap.apply(copy.deepcopy(full), ws)
    row = {}
    for name, model in (("unsharded", full), ("tpmap", sharded)):
        row[f"{name}_forward"] = explain(lambda kw, model=model: model.eval()(**kw).logits, inputs)
        model.train()
        row[f"{name}_train_dropout"] = explain(lambda kw, model=model: loss(model, kw), inputs)
        no_dropout_(model)
        row[f"{name}_train"] = explain(lambda kw, model=model: loss(model, kw), inputs)
        model.eval()
    torch._dynamo.reset()
    with torch.no_grad():
        eager = sharded(**inputs).logits
        compiled = torch.compile(sharded, backend="aot_eager")(**inputs).logits
        want = full(**inputs).logits
    row["logits_compiled_vs_eager"] = (compiled - eager).abs().max().item()
    row["logits_compiled_vs_unsharded"] = (compiled - want).abs().max().item()
    sharded.train()
    grads = []
    for step in (sharded, torch.compile(sharded, backend="aot_eager")):
        sharded.zero_grad(set_to_none=True)
        loss(step, inputs).backward()
        grads.append({n: p.grad.clone() for n, p in sharded.named_parameters() if p.grad is not None})
    row["grads_compiled_vs_eager"] = max((grads[0][n] - grads[1][n]).abs().max().item() for n in grads[0])
    row["grads_same_keys"] = grads[0].keys() == grads[1].keys()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    results = {}
    for ref in args.models:
        results[ref] = row = case(ref, CASES[ref])
        if dist.get_rank() == 0:
            print(f"== {ref} ({CASES[ref]}) at world size {dist.get_world_size()}")
            for key in [f"{m}_{k}" for k in ("forward", "train", "train_dropout") for m in ("unsharded", "tpmap")]:
                count, reasons = row[key]
                print(f"  {key:24} {count} graph breaks")
                for r in dict.fromkeys(reasons):
                    print(f"      - {r} (x{reasons.count(r)})")
            print(f"  compiled (aot_eager) tpmap logits vs eager: {row['logits_compiled_vs_eager']:.2e}, vs unsharded: "
                  f"{row['logits_compiled_vs_unsharded']:.2e}; training-step grads vs eager: "
                  f"{row['grads_compiled_vs_eager']:.2e} (same params: {row['grads_same_keys']})")
    if args.json and dist.get_rank() == 0:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
