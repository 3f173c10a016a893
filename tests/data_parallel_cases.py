"""Rank functions for tests/test_data_parallel.py: tensor parallelism inside a data-parallel layout.

On 4 ranks, a 2 x 2 DeviceMesh (dp, tp): ranks {0, 1} and {2, 3} are tensor-parallel groups, {0, 2}
and {1, 3} data-parallel groups. Each dp replica trains on its half of a batch; the reference is the
unsharded model trained on the whole batch, built on every rank in the same run.
"""
from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from transformers import AutoConfig

import tpmap
from tpmap import verify


def mesh_2x2():
    """A fresh (dp=2, tp=2) mesh over the 4 ranks. Every call creates new gloo subgroups (all ranks call
    it, in the same order, as new_group requires), so one per test is safe in a reused pool."""
    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))


def build(model_type: str, class_name: str, overrides: dict, dtype: torch.dtype) -> torch.nn.Module:
    """The mapping's first tiny config with `overrides`, the same on every rank (seeded, std 0.2 init)."""
    import transformers

    mapping = verify.resolve(model_type).mapping  # a model type, or a ref with a placement ("mixtral:experts=...")
    config = AutoConfig.for_model(mapping.model_type, **{**mapping.verify[0].config, **overrides})
    torch.manual_seed(0)
    model = getattr(transformers, class_name)(config)
    verify.large_init_(model, 0)
    model = model.to(dtype).train()
    if dtype == torch.float64 and model._can_set_experts_implementation():
        model.set_experts_implementation("eager")  # grouped_mm has no fp64 kernel
    from rank_cases import zero_dropout_
    zero_dropout_(model)  # the reference and the replicas must compute the same function
    return model


def _optimizer(name: str, params):
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1)
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)


def _loss(model, ids: torch.Tensor, kind: str) -> torch.Tensor:
    if kind != "exact":
        return model(input_ids=ids, labels=ids).loss  # transformers shifts the labels
    logits = model(input_ids=ids).logits  # (B, T, V)
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


def dp_tp_step_case(model_type: str, class_name: str, overrides: dict, optimizer: str, dtype_name: str,
                    loss_kind: str = "labels", wrap: str = "ddp", steps: int = 1) -> dict:
    """One training step of tpmap on the tp group, wrapped by DDP (or FSDP2, `wrap`) over the dp group, on this dp
    rank's half of a batch; against one step of the unsharded model on the whole batch.

    `loss_kind`: "labels" (transformers' loss, which computes in float32 whatever the dtype),
    "loss_parallel" (the same through tpmap's vocabulary-parallel cross-entropy), or "exact" (the
    cross-entropy of the gathered logits in the model's dtype: fp64 all through, for tight bounds).

    Returns the worst relative difference of the parameter *updates* (after `steps` - before): this rank's
    shard of every parameter against the same slice of the unsharded update."""
    import slicing_reference
    from torch.nn.parallel import DistributedDataParallel as DDP

    dtype = getattr(torch, dtype_name)
    mesh = mesh_2x2()
    dp_rank, tp_rank = mesh["dp"].get_local_rank(), mesh["tp"].get_local_rank()
    full = build(model_type, class_name, overrides, dtype)
    before = {n: p.detach().clone() for n, p in full.named_parameters()}
    gen = torch.Generator().manual_seed(3)
    batch = torch.randint(3, full.config.vocab_size, (4, 12), generator=gen)  # no padding: equal token counts
    batch = verify.place_ids(batch, verify.boundary_ids(full, (mesh["tp"].size(),)), gen)  # ids on shard boundaries
    half = batch[2 * dp_rank: 2 * dp_rank + 2]  # (2, 12): this dp replica's share

    sharded = tpmap.apply(copy.deepcopy(full), group=mesh["tp"], loss_parallel=loss_kind == "loss_parallel",
                          mapping=verify.resolve(model_type))
    if wrap == "ddp":
        wrapped = DDP(sharded, process_group=mesh["dp"].get_group())
    else:  # FSDP2: "fsdp" the whole model as one unit, "fsdp_blocks" each block, then the rest
        from torch.distributed.fsdp import fully_shard
        if wrap == "fsdp_blocks":
            blocks = next(m for m in sharded.base_model.children() if isinstance(m, torch.nn.ModuleList))
            for block in blocks:
                fully_shard(block, mesh=mesh["dp"])
        wrapped = fully_shard(sharded, mesh=mesh["dp"])
    opt = _optimizer(optimizer, wrapped.parameters())
    opt_full = _optimizer(optimizer, full.parameters())
    for _ in range(steps):
        opt.zero_grad()
        loss = _loss(wrapped, half, loss_kind)  # mean over this half; DDP averages the halves' grads
        loss.backward()
        opt.step()
        opt_full.zero_grad()
        loss_full = _loss(full, batch, loss_kind)  # mean over the whole batch
        loss_full.backward()
        opt_full.step()

    plan = sharded.tpmap_plan
    splits = slicing_reference.splits(full, verify.resolve(model_type), plan, plan.tp_size)  # not the engine's take
    worst, worst_name = 0.0, ""
    for name, p in sharded.named_parameters():
        local = p.full_tensor() if hasattr(p, "full_tensor") else p  # FSDP2: the dp shards gathered back
        want, was = full.get_parameter(name).detach(), before[name]
        if name in splits:
            split = splits[name]
            want, was = split.local(want, plan.tp_size, tp_rank), split.local(was, plan.tp_size, tp_rank)
        got_step, want_step = local.detach() - was, want - was
        rel = (got_step - want_step).abs().max().item() / max(want_step.abs().max().item(), 1e-30)
        if rel > worst:
            worst, worst_name = rel, name
    halves = torch.tensor([loss.item()], dtype=torch.float64)
    dist.all_reduce(halves, group=mesh["dp"].get_group())
    return {"worst_rel": worst, "worst_name": worst_name, "dp": dp_rank, "tp": tp_rank,
            "loss_diff": abs(halves.item() / 2 - loss_full.item()), "params": len(plan.params)}


def mesh_group_case() -> dict:
    """apply takes the tp dimension of a mesh; the model remembers its group, so full_state_dict and
    save_pretrained gather over it by default (not over every rank); a 2-D mesh is refused."""
    mesh = mesh_2x2()
    full = build("llama", "LlamaForCausalLM", {"num_key_value_heads": 1}, torch.float32)
    sharded = tpmap.apply(copy.deepcopy(full), group=mesh["tp"])
    gathered = tpmap.full_state_dict(sharded)  # no group given: the tp group it was sharded over
    want = full.state_dict()
    same = gathered.keys() == want.keys() and all(torch.equal(gathered[k], want[k]) for k in want)
    errors = {}
    for name, group in {"2d": mesh, "int": 3}.items():
        try:
            tpmap.apply(copy.deepcopy(full), group=group)
        except tpmap.TpmapError as e:
            errors[name] = (type(e).__name__, str(e))
    return {"tp_size": sharded.tpmap_plan.tp_size, "same_state": same, "errors": errors}


def dp_save_case(folder: str) -> dict:
    """Under data parallelism, one replica saves (tpmap.save_pretrained defaults to the tp group); the
    folder loads with plain transformers and equals the unsharded model."""
    from transformers import AutoModelForCausalLM

    mesh = mesh_2x2()
    full = build("gpt2", "GPT2LMHeadModel", {}, torch.float32)
    sharded = tpmap.apply(copy.deepcopy(full), group=mesh["tp"])
    if mesh["dp"].get_local_rank() == 0:
        tpmap.save_pretrained(sharded, folder)
    dist.barrier()
    loaded = AutoModelForCausalLM.from_pretrained(folder).state_dict()
    want = full.state_dict()
    return {"same": all(torch.equal(loaded[k], want[k]) for k in loaded) and len(loaded) > 0}


def dp_generate_case() -> dict:
    """Data-parallel replicas generate from their own prompts and lengths (the input and generate checks
    compare within the tp group only); each equals the unsharded model's greedy tokens."""
    mesh = mesh_2x2()
    dp = mesh["dp"].get_local_rank()
    full = build("llama", "LlamaForCausalLM", {"num_key_value_heads": 1}, torch.float32).eval()
    sharded = tpmap.apply(copy.deepcopy(full), group=mesh["tp"])
    prompt = torch.randint(3, full.config.vocab_size, (1, 5), generator=torch.Generator().manual_seed(10 + dp))
    settings = dict(max_new_tokens=4 + 2 * dp, do_sample=False, pad_token_id=0)
    got = sharded.generate(prompt, **settings)
    want = full.generate(prompt, **settings)
    return {"dp": dp, "tokens": got.tolist(), "same": torch.equal(got, want)}
