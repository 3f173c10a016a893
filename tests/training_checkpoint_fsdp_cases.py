"""Rank functions for tests/test_training_checkpoint_fsdp.py: training checkpoints of FSDP2 runs (fully_shard over
the dp dimension of a (dp, tp) mesh, tpmap over tp), saved and resumed at the same shape or another.

`run` trains a tiny Llama (the mapping's first verify config with a vocabulary of 254 rows: 127 per tp rank at tp 2,
so FSDP2's dp chunks are uneven -- 64 and 63 rows, the second padded by torch) for steps [start, stop) of a seeded
batch stream, each dp replica on its part of the batch, saving a training checkpoint after step `save_at`; with
`resume` it builds the model from another seed, scrambles the RNG, then loads. `wrap`: "fsdp" (the whole model one
unit), "fsdp_blocks" (each block, then the rest, as tests/data_parallel_cases.py), "ddp", or none (dp 1).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import training_checkpoint_cases as cases
import transformers
from torch.distributed.device_mesh import init_device_mesh
from transformers import AutoConfig

import tpmap
import tpmap.training
from tpmap import verify
from tpmap.api import group_of
from tpmap.checkpoint.safetensors import SafetensorsFile

VOCAB = 254  # 127 rows per rank at tp 2: odd, so the dp chunks of the vocabulary tensors are 64 and 63 rows
# model type -> (class, config overrides). GPT-2: a vocabulary of 257 -> 129 rows per rank at tp 2, the last of
# rank 1 a padding row; dp chunks of 65 and 64 rows; the LM head tied to the embedding
MODELS = {"llama": ("LlamaForCausalLM", {"vocab_size": VOCAB}), "gpt2": ("GPT2LMHeadModel", {})}


def build(dtype: torch.dtype, seed: int, dropout: float, model_type: str = "llama") -> torch.nn.Module:
    class_name, overrides = MODELS[model_type]
    config = AutoConfig.for_model(model_type, **{**verify.resolve(model_type).mapping.verify[0].config, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, class_name)(config)
    verify.large_init_(model, seed)
    model = model.to(dtype).train()
    from rank_cases import zero_dropout_

    zero_dropout_(model)
    for module in model.modules():
        if hasattr(module, "attention_dropout"):
            module.attention_dropout = dropout
    return model


def wrap(model: torch.nn.Module, how: str | None, dp_mesh):
    if how is None:
        return model
    if how == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        return DDP(model, process_group=dp_mesh.get_group())
    from torch.distributed.fsdp import fully_shard

    if how == "fsdp_blocks":
        blocks = next(m for m in tpmap_model(model).base_model.children() if isinstance(m, torch.nn.ModuleList))
        for block in blocks:
            fully_shard(block, mesh=dp_mesh)
    return fully_shard(model, mesh=dp_mesh)


def tpmap_model(model):
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def setup(spec: dict, seed: int):
    """(model as trained, the tpmap model inside, optimizer, scheduler, dp mesh or None, dp rank, dp size)."""
    dp = spec.get("dp", 1)
    mesh = init_device_mesh("cpu", (dp, dist.get_world_size() // dp), mesh_dim_names=("dp", "tp")) if dp > 1 else None
    dtype = getattr(torch, spec.get("dtype", "float64"))
    full = build(dtype, seed, spec.get("dropout", 0.0), spec.get("model", "llama"))
    model = tpmap.apply(full, group=mesh["tp"] if mesh else None)
    if spec.get("lora"):
        from peft import LoraConfig

        from tpmap import peft as tpmap_peft

        config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False,
                            target_modules=["q_proj", "k_proj", "o_proj", "down_proj"])
        model = tpmap_peft.get_peft_model(model, config)
    trained = wrap(model, spec.get("wrap"), mesh["dp"] if mesh else None)
    opt = torch.optim.AdamW([p for p in trained.parameters() if p.requires_grad], lr=2e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.3 * s))
    dp_mesh = mesh["dp"] if mesh else None
    return trained, model, opt, sched, dp_mesh, dp_mesh.get_local_rank() if mesh else 0, dp


def local(t: torch.Tensor) -> torch.Tensor:
    return (t.to_local() if hasattr(t, "to_local") else t).detach().clone()


class ReadCounter:
    """Bytes read from safetensors files in this process (SafetensorsFile.read_into) while active."""

    def __enter__(self):
        self.bytes, self.original = 0, SafetensorsFile.read_into

        def counted(file, buffer, offset):
            self.bytes += len(buffer)
            return self.original(file, buffer, offset)

        SafetensorsFile.read_into = counted
        return self

    def __exit__(self, *exc):
        SafetensorsFile.read_into = self.original


def run(spec: dict, folder: str, resume: bool) -> dict:
    """Train steps [start, stop), saving after `save_at` unless resuming. The mean loss of every step, this rank's
    local tensors and optimizer state, the full parameters (rank 0; not for LoRA), and for a resumed run the bytes
    it read against the bytes of its local tensors."""
    trained, model, opt, sched, dp_mesh, dp_rank, dp = setup(spec, seed=1 if resume else 0)
    torch.manual_seed(123 if not resume else 999)
    start, read = 0, None
    if resume:
        with ReadCounter() as counter:
            state = tpmap.training.load(folder, trained, opt, sched, dp_group=dp_mesh)
        held = sum(t.nbytes for t in _local_tensors(trained, opt))
        read = {"bytes": counter.bytes, "held": held}
        start = state.data_state["next_batch"]
    losses = {}
    for step in range(start, spec["stop"]):
        ids = cases.batch(step, model.config.vocab_size)
        loss = cases._loss(trained, ids[dp_rank * cases.BATCH // dp: (dp_rank + 1) * cases.BATCH // dp])
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()
        mean = loss.detach().clone().double()
        if dp > 1:
            dist.all_reduce(mean, group=dp_mesh.get_group())
        losses[step] = mean.item() / dp
        if not resume and step + 1 == spec["save_at"]:
            tpmap.training.save(folder, trained, opt, sched, step=step + 1, data_state={"next_batch": step + 1},
                                dp_group=dp_mesh)
    states = {k: local(v) for k, v in trained.state_dict().items()}
    optim = {(g, i, k): local(v) if isinstance(v, torch.Tensor) else v
             for g, group in enumerate(opt.param_groups) for i, p in enumerate(group["params"])
             for k, v in opt.state[p].items()}
    full = None if spec.get("lora") else _full(model, spec)
    return {"losses": losses, "local": states, "optim": optim, "lr": sched.get_last_lr(), "read": read,
            "full": full if dist.get_rank() == 0 else None}


def _local_tensors(model, opt) -> list[torch.Tensor]:
    """What this rank holds of the model's state dict and of the optimizer's tensor state (DTensors: the chunk)."""
    out = [local(v) for v in model.state_dict().values()]
    return out + [local(v) for state in opt.state.values() for v in state.values() if isinstance(v, torch.Tensor)]


def _full(model, spec: dict) -> dict:
    """The full (unsharded) state dict: FSDP2's dp chunks gathered into a plain copy of the tp model, which
    tpmap.full_state_dict gathers over tp (a collective: every rank)."""
    if not any(hasattr(p, "to_local") for p in model.parameters()):
        return tpmap.full_state_dict(model)
    plain = tpmap.apply(build(model.dtype, 0, 0.0, spec.get("model", "llama")), group=group_of(model))
    with torch.no_grad():
        for (name, t), (other, mine) in zip(model.state_dict().items(), plain.state_dict().items(), strict=True):
            assert name == other, (name, other)
            mine.copy_(t.full_tensor() if hasattr(t, "full_tensor") else t)
    return tpmap.full_state_dict(plain)


def same_shape_case(spec: dict, folder: str) -> dict:
    """A run saved at `save_at` and the same run resumed from it at the same shape: what differs."""
    a = run(spec, folder, resume=False)
    b = run(spec, folder, resume=True)
    steps = sorted(b["losses"])
    local_same = a["local"].keys() == b["local"].keys() and all(torch.equal(a["local"][k], b["local"][k])
                                                                for k in a["local"])
    optim_same = a["optim"].keys() == b["optim"].keys() and all(
        torch.equal(a["optim"][k], b["optim"][k]) if isinstance(a["optim"][k], torch.Tensor) else
        a["optim"][k] == b["optim"][k] for k in a["optim"])
    return {"steps": steps, "losses_a": [a["losses"][s] for s in steps], "losses_b": [b["losses"][s] for s in steps],
            "local_same": local_same, "optim_same": optim_same, "optim_entries": len(a["optim"]),
            "lr_same": a["lr"] == b["lr"], "read": b["read"],
            "uneven": sorted({tuple(t.shape) for t in a["local"].values() if t.dim() and t.shape[0] == 63})}


def resume_case(spec: dict, folder: str, resume: bool) -> dict:
    """One half of a reshard test: the uninterrupted run that saves, or the resumed run at this pool's shape."""
    out = run(spec, folder, resume)
    return {"losses": out["losses"], "full": out["full"]}


def refusal_case(folder: str) -> dict:
    """FSDP2 models tpmap.training does not save: fully_shard over a mesh other than dp_group, and a placement other
    than Shard(0) (shard_placement_fn). Each must raise on every rank."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    out = {}
    trained, _, opt, *_ = setup({"dp": 2, "wrap": "fsdp"}, seed=0)
    other = dist.new_group([0, 3]), dist.new_group([1, 2])  # covers the world with the tp groups, not the mesh's
    other = other[0] if dist.get_rank() in (0, 3) else other[1]
    for kind, group in {"other_group": other, "tp_group": group_of(tpmap_model(trained))}.items():
        out[kind] = _try_save(folder, trained, opt, group)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = tpmap.apply(build(torch.float64, 0, 0.0), group=mesh["tp"])
    shard1 = fully_shard(model, mesh=mesh["dp"], shard_placement_fn=lambda p: Shard(p.dim() - 1))
    out["shard_dim"] = _try_save(folder, shard1, None, mesh["dp"])
    return out


def _try_save(folder, model, opt, dp_group) -> dict:
    try:
        tpmap.training.save(folder, model, opt, step=1, dp_group=dp_group)
    except tpmap.TpmapError as e:
        return {"error": type(e).__name__, "message": str(e)}
    return {"error": None, "message": ""}
