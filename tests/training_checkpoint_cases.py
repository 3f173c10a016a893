"""Rank functions for tests/test_training_checkpoint.py: training runs that save, stop and resume.

`run` trains a tiny model (the mapping's first verify config, init std 0.2) for steps [start, stop) of a seeded
batch stream, saving a training checkpoint after step `save_at`; with `resume` it first builds a model from
another seed, scrambles the RNG, then loads the checkpoint. A run and its resumed copy are compared by the test:
the same losses and tensors, bit for bit at the same shape, within the tensor-parallel summation order otherwise.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import transformers
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel as DDP
from transformers import AutoConfig

import tpmap
import tpmap.training
from tpmap import verify
from tpmap.execute import PLAN_ATTR

BATCH, SEQ = 4, 12


def build(model_type: str, class_name: str, dtype: torch.dtype, seed: int, dropout: float,
          overrides: dict | None = None) -> torch.nn.Module:
    """The mapping's first tiny config (with `overrides`), init std 0.2 from `seed`, training mode; dropout p on
    attention only."""
    from rank_cases import zero_dropout_

    config = AutoConfig.for_model(model_type, **{**verify.resolve(model_type).mapping.verify[0].config,
                                                 **(overrides or {})})
    torch.manual_seed(seed)
    model = getattr(transformers, class_name)(config)
    verify.large_init_(model, seed)
    model = model.to(dtype).train()
    if dtype == torch.float64 and model._can_set_experts_implementation():
        model.set_experts_implementation("eager")  # grouped_mm has no fp64 kernel
    zero_dropout_(model)
    for module in model.modules():  # attention dropout: drawn inside the sharded RNG region
        if hasattr(module, "attention_dropout"):
            module.attention_dropout = dropout
    return model


def batch(step: int, vocab: int) -> torch.Tensor:
    """The global batch of `step` (B, T): the data stream's position is the step."""
    return torch.randint(3, vocab, (BATCH, SEQ), generator=torch.Generator().manual_seed(1000 + step))


def _loss(model, ids: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=ids).logits  # (B, T, V) in the model's dtype: fp64 all through in fp64 runs
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


def _setup(spec: dict, seed: int):
    """(model as trained: DDP-wrapped under dp, the tpmap model, optimizer, scheduler, dp group, dp rank)."""
    dp = spec.get("dp", 1)
    world = dist.get_world_size()
    tp_group = dp_group = None
    dp_rank = 0
    if dp > 1:
        mesh = init_device_mesh("cpu", (dp, world // dp), mesh_dim_names=("dp", "tp"))
        tp_group, dp_group, dp_rank = mesh["tp"], mesh["dp"], mesh["dp"].get_local_rank()
    dtype = getattr(torch, spec.get("dtype", "float32"))
    full = build(spec["model_type"], spec["class_name"], dtype, seed, spec.get("dropout", 0.0), spec.get("overrides"))
    model = tpmap.apply(full, group=tp_group, mapping=spec.get("mapping"))
    if spec.get("lora"):
        from peft import LoraConfig

        from tpmap import peft as tpmap_peft

        config = LoraConfig(r=4, lora_alpha=8, lora_dropout=spec.get("dropout", 0.0), init_lora_weights=False,
                            target_modules=["q_proj", "k_proj", "o_proj", "down_proj"])
        model = tpmap_peft.get_peft_model(model, config)
    trained = DDP(model, process_group=dp_group.get_group()) if dp > 1 else model
    params = [p for p in trained.parameters() if p.requires_grad]
    if spec.get("optimizer", "adamw") == "sgd":
        opt = torch.optim.SGD(params, lr=0.05, momentum=0.9)
    else:
        opt = torch.optim.AdamW(params, lr=2e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.3 * s))
    return trained, model, opt, sched, dp_group, dp_rank, dp


def run(spec: dict, folder: str, resume: bool) -> dict:
    """Train steps [start, spec["stop"]); save after step spec["save_at"] (when not resuming). Returns the mean
    loss of every step, this rank's local tensors and optimizer state, and the full parameters (rank 0)."""
    trained, model, opt, sched, dp_group, dp_rank, dp = _setup(spec, seed=1 if resume else 0)
    torch.manual_seed(123 if not resume else 999)  # the dropout stream; a resumed run must get it from the checkpoint
    start = 0
    if resume:
        state = tpmap.training.load(folder, trained, opt, sched, dp_group=dp_group)
        start = state.data_state["next_batch"]
    losses = {}
    vocab = model.config.vocab_size
    for step in range(start, spec["stop"]):
        ids = batch(step, vocab)
        mine = ids[dp_rank * BATCH // dp: (dp_rank + 1) * BATCH // dp]
        loss = _loss(trained, mine)
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()
        mean = loss.detach().clone().double()
        if dp > 1:
            dist.all_reduce(mean, group=dp_group.get_group())
        losses[step] = mean.item() / dp
        if not resume and step + 1 == spec["save_at"]:
            tpmap.training.save(folder, trained, opt, sched, step=step + 1, data_state={"next_batch": step + 1},
                                dp_group=dp_group)
    local = {k: v.detach().clone() for k, v in model.state_dict().items()}
    optim = {(g, i, k): v.clone() if isinstance(v, torch.Tensor) else v
             for g, group in enumerate(opt.param_groups) for i, p in enumerate(group["params"])
             for k, v in opt.state[p].items()}
    gathered = _adapters(model, folder, resume, dp_rank) if spec.get("lora") else tpmap.full_state_dict(model)
    plan = getattr(tpmap.training.layout.base_model(model), PLAN_ATTR)
    return {"losses": losses, "local": local, "optim": optim, "lr": sched.get_last_lr(), "uneven": bool(plan.uneven),
            "full": gathered if dist.get_rank() == 0 else None, "rank": dist.get_rank()}


def _adapters(model, folder: str, resume: bool, dp_rank: int) -> dict | None:
    """The full LoRA tensors, gathered by tpmap.peft.save_pretrained into a PEFT folder beside the checkpoint (the
    base weights are frozen); read on rank 0, None elsewhere."""
    from safetensors.torch import load_file

    from tpmap import peft as tpmap_peft

    out = Path(folder).parent / f"adapters-{'resumed' if resume else 'whole'}-{dist.get_world_size()}-dp{dp_rank}"
    tpmap_peft.save_pretrained(model, out)
    dist.barrier()
    return load_file(out / "adapter_model.safetensors") if dist.get_rank() == 0 else None


def same_shape_case(spec: dict, folder: str) -> dict:
    """A run saved at `save_at` and the same run resumed from it, at the same shape: what differs."""
    a = run(spec, folder, resume=False)
    b = run(spec, folder, resume=True)
    steps = sorted(b["losses"])
    return {"steps": steps, "losses_a": [a["losses"][s] for s in steps], "losses_b": [b["losses"][s] for s in steps],
            "local_same": a["local"].keys() == b["local"].keys()
            and all(torch.equal(a["local"][k], b["local"][k]) for k in a["local"]),
            "optim_same": a["optim"].keys() == b["optim"].keys()
            and all(torch.equal(a["optim"][k], b["optim"][k]) if isinstance(a["optim"][k], torch.Tensor)
                    else a["optim"][k] == b["optim"][k] for k in a["optim"]),
            "optim_entries": len(a["optim"]), "lr_same": a["lr"] == b["lr"], "uneven": a["uneven"]}


def resume_case(spec: dict, folder: str, resume: bool) -> dict:
    """One half of a reshard test: the uninterrupted run that saves, or the resumed run at this pool's shape."""
    out = run(spec, folder, resume)
    return {"losses": out["losses"], "full": out["full"]}


# -- bad input ------------------------------------------------------------------------------------------------
def _signature(model, opt) -> dict:
    return {"model": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "optim": {} if opt is None else {
                (i, k): v.clone() for i, p in enumerate(opt.param_groups[0]["params"]) if p in opt.state
                for k, v in opt.state[p].items() if isinstance(v, torch.Tensor)},
            "rng": torch.get_rng_state().clone()}


def _same(a: dict, b: dict) -> bool:
    return (a["model"].keys() == b["model"].keys()
            and all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
            and a["optim"].keys() == b["optim"].keys() and all(torch.equal(a["optim"][k], b["optim"][k])
                                                               for k in a["optim"])
            and torch.equal(a["rng"], b["rng"]))


def _try_load(folder, model, opt, sched=None, **kw) -> dict:
    before = _signature(model, opt)
    try:
        tpmap.training.load(folder, model, opt, sched, **kw)
    except tpmap.TpmapError as e:
        return {"error": type(e).__name__, "message": str(e), "untouched": _same(before, _signature(model, opt))}
    return {"error": None, "message": "", "untouched": _same(before, _signature(model, opt))}


def _damaged_copy(folder: Path, name: str, damage) -> Path:
    """A copy of the step folder with one file damaged (rank 0 makes it; every rank waits)."""
    target = folder.parent / f"damaged-{name}"
    if dist.get_rank() == 0:
        shutil.copytree(folder, target)
        damage(target)
    dist.barrier()
    return target


def bad_input_case(folder: str, changed_mapping: str) -> dict:
    """Save one step of Llama at this world size, then try each bad resume; each must raise on every rank and
    leave the model, the optimizer and the RNG as they were."""
    spec = {"model_type": "llama", "class_name": "LlamaForCausalLM", "stop": 1, "save_at": 1}
    run(spec, folder, resume=False)
    step = Path(folder) / "step-00000001"
    out = {}
    _, model, opt, *_ = _setup(spec, seed=1)
    first = step / "tp-00000-of-00002.safetensors"
    second = step / "tp-00001-of-00002.safetensors"

    def truncate(t):
        with open(t / first.name, "r+b") as f:
            f.truncate(first.stat().st_size - 64)

    def flip(t):
        with open(t / second.name, "r+b") as f:
            f.seek(second.stat().st_size // 2)
            byte = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([byte[0] ^ 0x10]))

    out["missing_file"] = _try_load(_damaged_copy(step, "missing", lambda t: (t / second.name).unlink()), model, opt)
    out["truncated"] = _try_load(_damaged_copy(step, "truncated", truncate), model, opt)
    out["corrupted"] = _try_load(_damaged_copy(step, "flipped", flip), model, opt)
    out["sgd"] = _try_load(folder, model, torch.optim.SGD(model.parameters(), lr=0.1))
    params = list(model.parameters())
    two_groups = torch.optim.AdamW([{"params": params[:3]}, {"params": params[3:], "weight_decay": 0.0}], lr=1e-3)
    out["param_groups"] = _try_load(folder, model, two_groups)
    out["no_optimizer"] = _try_load(folder, model, None)
    other = tpmap.apply(build("gpt2", "GPT2LMHeadModel", torch.float32, 0, 0.0), dist.get_world_size())
    out["other_model"] = _try_load(folder, other, torch.optim.AdamW(other.parameters()))
    full = build("llama", "LlamaForCausalLM", torch.float32, 0, 0.0)
    full.config.rope_theta = 500.0  # the same tensors, another function
    if hasattr(full.config, "rope_parameters"):
        full.config.rope_parameters = {**full.config.rope_parameters, "rope_theta": 500.0}
    other_config = tpmap.apply(full, dist.get_world_size())
    out["other_config"] = _try_load(folder, other_config, torch.optim.AdamW(other_config.parameters()))
    _, changed, opt2, *_ = _setup({**spec, "mapping": changed_mapping}, seed=1)
    out["mapping_changed"] = _try_load(folder, changed, opt2)
    out["dp_group_wrong"] = _try_load(folder, model, opt, dp_group=dist.group.WORLD)
    out["other_scheduler"] = _try_load(folder, model, opt, torch.optim.lr_scheduler.StepLR(opt, 1))
    wider = tpmap.apply(build("llama", "LlamaForCausalLM", torch.float32, 0, 0.0, {"intermediate_size": 256}),
                        dist.get_world_size())  # the MLP's weights are [256, 96] and [96, 256], not 192
    out["other_shape"] = _try_load(folder, wider, torch.optim.AdamW(wider.parameters()))
    return out


def compose_case(folder: str, saved: str, same: str, changed: str) -> dict:
    """Llava (a mapping composing a language model's and a vision tower's files) saved under mapping `saved`,
    loaded into models sharded by `same` (the same content in another folder) and by `changed` (a composed
    file edited): {which: _try_load's result}."""
    def sharded(mapping: str):
        model = tpmap.apply(build("llava", "LlavaForConditionalGeneration", torch.float32, 0, 0.0), mapping=mapping)
        return model, torch.optim.AdamW(model.parameters())

    model, opt = sharded(saved)
    tpmap.training.save(folder, model, opt, step=1)
    return {name: _try_load(folder, *sharded(mapping)) for name, mapping in (("same", same), ("changed", changed))}


def from_pretrained_case(hf: str, folder: str) -> dict:
    """A run built by tpmap.from_pretrained from `hf` (a real config.json's extra keys) trains a step and saves;
    a second run built the same way from the same folder loads it: {load's result, the loaded weights equal the
    saved ones}."""
    def built():
        model = tpmap.from_pretrained(hf).train()
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3)

    model, opt = built()
    torch.manual_seed(0)  # the same RNG state on every rank (training mode)
    _loss(model, batch(0, model.config.vocab_size)).backward()
    opt.step()
    tpmap.training.save(folder, model, opt, step=1)
    saved = {k: v.detach().clone() for k, v in model.state_dict().items()}
    again, opt2 = built()
    result = _try_load(folder, again, opt2)
    result["equal"] = all(torch.equal(saved[k], v) for k, v in again.state_dict().items())
    return result


def export_case(model_type: str, class_name: str, ckpt: str, hf: str) -> dict:
    """One training step, then both a training checkpoint and tpmap.save_pretrained of the same weights."""
    spec = {"model_type": model_type, "class_name": class_name, "stop": 1, "save_at": 1}
    trained, model, opt, sched, *_ = _setup(spec, seed=0)
    loss = _loss(trained, batch(0, model.config.vocab_size))
    loss.backward()
    opt.step()
    tpmap.training.save(ckpt, trained, opt, sched, step=1)
    tpmap.save_pretrained(model, hf)
    return {"rank": dist.get_rank()}
