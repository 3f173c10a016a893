"""Collectives and bytes per forward and per training step, for every shipped mapping, against the
Megatron minimum. Deterministic: counts, never times (tests/test_comm.py asserts them).

    torchrun --nproc-per-node 2 benchmarks/comm.py [--types llama,gpt2] [--json F] [--md F]

Each mapping's first verify config and class, at the world size of the torchrun job (a mapping whose
first config does not list it is skipped). Measured with `tpmap.engine.collectives.counting_collectives`
around one eval forward (no grad) and one forward + backward, with `check_inputs=False` (the input check
adds one all-gather of 40 bytes per forward, and none per decode step inside generate).

The Megatron minimum is computed from the *unsharded* model's dataflow, not from tpmap's collectives:
* forward all-reduces: one per vocab-parallel embedding call, one per Norm over split features (its
  statistic), and per call of a repeated block the number of dependent stages among the block's
  partial-sum modules (Row and Reduce entries): a module whose input does not depend on another's output
  in the same block (GPT-J's parallel attention and MLP, an MoE's shared expert beside its experts) could
  share that one's all-reduce, as Megatron's parallel-residual blocks do;
* forward all-gathers: one per LM-head call (the logits) and per `gather_output` Column call;
* backward all-reduces: one per distinct input of the split Columns (q, k and v read one tensor: one
  all-reduce) and per floating input of a Reduce (an MoE's hidden states and routing weights), one per
  Norm and per Enter call; plus the gradient sums of replicated parameters that see
  only this rank's activations (KV heads held by several ranks, `grad_allreduce`), listed apart.
"""
from __future__ import annotations

import argparse
import copy
import json


def _nodes_reachable(start, stop: set, limit: int = 200000) -> set:
    """Autograd nodes reachable backwards from `start` (stops at `stop` nodes, which are included)."""
    seen, todo = set(), [start] if start is not None else []
    while todo and len(seen) < limit:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if node in stop:
            continue
        todo.extend(n for n, _ in node.next_functions)
    return seen


def _roles(full, plan):
    """The module names each kind of collective attaches to: (blocks, names by style, partial sums, gathers,
    copies)."""
    from tpmap.engine.blocks import block_prefixes

    prefix = plan.base_prefix
    base = full.get_submodule(prefix[:-1]) if prefix else full
    blocks = {prefix + b for b in block_prefixes(base)}
    by_style: dict[str, set] = {}
    for m in plan.modules:
        by_style.setdefault(m.style, set()).add(m.name)
    partial_sums = by_style.get("row", set()) | set(plan.reduces)
    gathers = {m.name for m in plan.modules if m.style == "column" and m.gather_output} | by_style.get("vocab_head",
                                                                                                      set())
    copies = {m.name for m in plan.modules if m.style in ("column", "vocab_head") and m.copy_input}
    return blocks, by_style, partial_sums, gathers, copies


def megatron_minimum(full, plan, inputs: dict) -> dict:
    """The minimum collectives of one forward and backward of `full` (unsharded) split as `plan` says."""
    import torch

    blocks, by_style, partial_sums, gathers, copies = _roles(full, plan)
    counts = {"fwd_ar": 0, "fwd_ag": 0, "bwd_ar": 0}
    stack: list[list] = []  # per active block call: [(output node, level)]
    column_inputs: set = set()
    name_of: dict = {}  # partial-sum module -> its name
    input_node: dict = {}  # partial-sum module -> the autograd node of its input, this call
    handles = []

    def block_pre(module, args):
        stack.append([])

    def block_post(module, args, out):
        calls = stack.pop()
        counts["fwd_ar"] += max((level for _, level in calls), default=0)

    def partial_pre(module, args, kwargs):
        tensors = [a for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor)]
        input_node[module] = tensors[0].grad_fn if tensors else None
        if name_of[module] in plan.reduces:  # a Reduce's floating inputs get partial gradients: one sum each
            column_inputs.update((t.grad_fn, t.data_ptr(), tuple(t.shape)) for t in tensors
                                 if t.is_floating_point() and t.requires_grad)

    def partial_post(module, args, out):
        y = out[0] if isinstance(out, tuple) else out
        if not stack:  # a partial sum outside the blocks (a pooler's Row)
            counts["fwd_ar"] += 1
            return
        calls = stack[-1]
        earlier = dict(calls)
        reach = _nodes_reachable(input_node[module], set(earlier))
        level = 1 + max((lvl for node, lvl in earlier.items() if node in reach), default=0)
        calls.append((y.grad_fn, level))

    def column_pre(module, args, kwargs):
        x = next((a for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor)), None)
        if x is not None and x.requires_grad:
            column_inputs.add((x.grad_fn, x.data_ptr(), tuple(x.shape)))

    def count(key, n=1):
        def hook(module, args, out):
            counts[key] += n
        return hook

    for name, module in full.named_modules():
        if name in blocks:
            handles += [module.register_forward_pre_hook(block_pre), module.register_forward_hook(block_post)]
        if name in partial_sums:
            name_of[module] = name
            handles += [module.register_forward_pre_hook(partial_pre, with_kwargs=True),
                        module.register_forward_hook(partial_post)]
        if name in copies:
            handles.append(module.register_forward_pre_hook(column_pre, with_kwargs=True))
        if name in gathers:
            handles.append(module.register_forward_hook(count("fwd_ag")))
        if name in by_style.get("vocab_embedding", ()):
            handles.append(module.register_forward_hook(count("fwd_ar")))
        if name in by_style.get("norm", ()):
            handles += [module.register_forward_hook(count("fwd_ar")), module.register_forward_hook(count("bwd_ar"))]
        if name in plan.enters:
            handles.append(module.register_forward_hook(count("bwd_ar")))
    try:
        full.eval()
        with torch.enable_grad():
            full(**inputs)
    finally:
        for h in handles:
            h.remove()
    counts["bwd_ar"] += len(column_inputs)
    return counts


def measure(model_type: str) -> dict | None:
    """On every rank: the measured collectives and the minimum, for the mapping's first config and class."""
    import torch
    import torch.distributed as dist

    import tpmap
    from tpmap import verify
    from tpmap.engine.collectives import counting_collectives

    ws = dist.get_world_size()
    mapping = verify.resolve(model_type).mapping
    spec = mapping.verify[0]
    if ws not in spec.world_sizes:
        return None
    cls = spec.models[0]
    full = verify.build_model(model_type, 0, cls)
    inputs = verify.case_inputs(model_type, 0, full)
    sharded = tpmap.apply(copy.deepcopy(full), ws, mapping=verify.resolve(model_type), check_inputs=False).eval()
    plan = sharded.tpmap_plan
    with torch.no_grad(), counting_collectives() as forward:
        sharded(**inputs)
    if spec.grad_mode == "train":  # a backward that needs training mode (Reformer, RWKV)
        sharded.train()
        torch.manual_seed(0)  # the same RNG state on every rank (the input check is off, dropout may draw)
    with counting_collectives() as step:
        out = sharded(**inputs)
        logits = verify.main_output(out)
        logits.float().square().mean().backward()  # every output feeds the loss
    minimum = megatron_minimum(full, plan, inputs)
    return {
        "model_type": model_type, "class": cls, "world_size": ws,
        "forward": dict(forward), "forward_bytes": dict(forward.bytes),
        "step": dict(step), "step_bytes": dict(step.bytes),
        "minimum": minimum,
    }


def row(r: dict) -> dict:
    ar, ag = r["forward"].get("all_reduce", 0), r["forward"].get("all_gather", 0)
    m = r["minimum"]
    step_ar = r["step"].get("all_reduce", 0)
    return {
        "model_type": r["model_type"], "fwd_ar": ar, "fwd_ag": ag, "min_fwd_ar": m["fwd_ar"], "min_fwd_ag": m["fwd_ag"],
        "fwd_kib": sum(r["forward_bytes"].values()) / 1024, "step_ar": step_ar,
        "min_step_ar": m["fwd_ar"] + m["bwd_ar"], "param_syncs": step_ar - ar - m["bwd_ar"],
        "step_kib": sum(r["step_bytes"].values()) / 1024,
        "at_minimum": ar == m["fwd_ar"] and ag == m["fwd_ag"],
    }


def markdown(rows: list[dict], ws: int) -> str:
    lines = [f"Collectives at world size {ws} (first verify config and class of each mapping; tiny configs: "
             "bytes are of those sizes). ar = all-reduce, ag = all-gather; *step* = forward + backward; "
             "*param syncs* = gradient all-reduces of replicated parameters (KV heads shared by ranks, "
             "`grad_allreduce`).", "",
             "| model type | fwd ar | min | fwd ag | min | fwd KiB | step ar | min (activations) | param syncs | "
             "step KiB | at minimum |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| `{r['model_type']}` | {r['fwd_ar']} | {r['min_fwd_ar']} | {r['fwd_ag']} | {r['min_fwd_ag']} | "
                     f"{r['fwd_kib']:.0f} | {r['step_ar']} | {r['min_step_ar']} | {r['param_syncs']} | "
                     f"{r['step_kib']:.0f} | {'yes' if r['at_minimum'] else '**no**'} |")
    above = [r for r in rows if not r["at_minimum"]]
    lines += ["", f"{len(rows) - len(above)} of {len(rows)} mappings at the forward minimum."]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--types", default=None, help="comma-separated model types (default: every mapping)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--md", default=None)
    args = parser.parse_args()

    import torch
    import torch.distributed as dist

    from tpmap.language import source

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    types = args.types.split(",") if args.types else sorted(source.shipped_files())
    results = []
    for model_type in types:
        r = measure(model_type)
        if r is not None:
            results.append(r)
    if dist.get_rank() == 0:
        rows = [row(r) for r in results]
        text = markdown(rows, dist.get_world_size())
        print(text)
        if args.md:
            with open(args.md, "w") as f:
                f.write(text + "\n")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
