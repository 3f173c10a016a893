"""Hugging Face `Trainer` on a tpmap model: `TensorParallelTrainer`, and `TensorParallelMixin` for other Trainer
subclasses (``class MySFT(TensorParallelMixin, SFTTrainer)``).

    model = tpmap.apply(model, group=mesh["tp"])                  # or tpmap.apply(model, world_size): tp only
    trainer = TensorParallelTrainer(model=model, args=TrainingArguments(...), train_dataset=...,
                                    dp_group=mesh["dp"])          # dp_group: only when tp < world size
    trainer.train(); trainer.save_model("out/")                   # every rank calls both

Trainer takes every rank for a data-parallel replica. On a tensor-parallel model that is wrong in five places,
and the mixin changes each through the Trainer method made for it, nothing else:

* Data (`_get_dataloader`): accelerate shards every loader over all ranks, so the ranks of one tp group get
  different batches (`InputMismatchError` at the first forward). The prepared loader's `BatchSamplerShard` is
  told the replicas instead -- ``num_processes = dp``, ``process_index = dp rank`` -- so replica d gets the
  batches d, d + dp, d + 2 dp, ... of the one seeded order, every rank of its tp group the same ones.
* Wrapping (`_wrap_model`): accelerate would wrap DDP over every rank (broadcasting rank 0's shards to all,
  then averaging different shards). The mixin asks accelerate for autocast and torch.compile only
  (`prepare_model(evaluation_mode=True)`, as Trainer does for models sharded by transformers itself) and wraps
  DDP over the dp group when dp > 1. Gradient accumulation skips its all-reduce through DDP's `no_sync`, as
  Trainer does for any DDP model.
* Loss scale (`get_tp_size`): Trainer divides the token count it gathers over every rank by the tp size
  (each tp rank counts the same tokens) and multiplies the loss by world / tp = dp, which DDP's average undoes.
  With tp from the tpmap model, a step's loss is sum(token losses) / N over the N tokens of the whole
  accumulated global batch, as for the unsharded model.
* Gradient norm (`_clip_grad_norm`): the norm of the local tensors differs between the ranks of a tp group, so
  they would clip differently and their replicated weights drift apart. The mixin clips by the norm of the
  unsharded gradient, `tpmap.training.clip_grad_norm_`: ||g||^2 = sum over ranks r of sum_i w_r(i) g_r(i)^2,
  one all-reduce over the tp group, with w = 1 / (ranks holding element i) -- 1/tp for a replicated parameter,
  1/k for a KV head held by k ranks, 0 on vocabulary padding, rank 0 only for a partial-sum term, LoRA adapters
  as tpmap.peft spreads them -- so every shard is scaled by the same factor.
* Evaluation (`evaluation_loop`): gathering metrics over every rank would repeat each replica's values tp
  times; the mixin gathers over the dp group and drops the padding of the last batch as accelerate does.

Saving: `save_model` writes the standard transformers checkpoint through `tpmap.save_pretrained` (replica 0's
tp group gathers, its rank 0 writes). Checkpoints (`save_steps`) add the whole training state -- model shards,
optimizer, scheduler -- through `tpmap.training.save` / `load` into ``checkpoint-N/tpmap_training/``; Trainer's
own files (trainer_state.json, per-rank RNG states) stay Trainer's, and ``resume_from_checkpoint`` reads them
back the same way. Refused with `TrainerSetupError`: TRL's fused LM head (SFTTrainer's loss: a log-softmax over
``lm_head.weight``, which is a vocabulary shard here), fp16 (GradScaler's per-rank inf check would let tp ranks
skip different steps; use bf16), FSDP and DeepSpeed (use `dp_group` and DDP), `load_best_model_at_end`,
`push_to_hub`, ``average_tokens_across_devices=False`` and iterable datasets (unsharded over replicas here).
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist
from accelerate.data_loader import BatchSamplerShard
from accelerate.utils import recursively_apply
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.parallel import DistributedDataParallel
from transformers import Trainer
from transformers.trainer import TRAINER_STATE_NAME, TRAINING_ARGS_NAME
from transformers.trainer_callback import TrainerState

from tpmap.api import PLAN_ATTR, group_of
from tpmap.checkpoint.save import save_pretrained
from tpmap.language.errors import TpmapError
from tpmap.training.grad_norm import clip_grad_norm_
from tpmap.training.grad_norm import grad_norm as unsharded_grad_norm
from tpmap.training.load import load
from tpmap.training.save import save

__all__ = ["STATE_DIR", "TensorParallelMixin", "TensorParallelTrainer", "TrainerSetupError"]

STATE_DIR = "tpmap_training"  # the training state's folder inside Trainer's checkpoint-N


class TrainerSetupError(TpmapError):
    """A Trainer setting that tensor parallelism cannot follow, or a checkpoint it cannot resume."""


class TensorParallelMixin:
    """Put before a `transformers.Trainer` subclass: ``class T(TensorParallelMixin, Trainer)``. The model: a
    tpmap model (`tpmap.apply` / `tpmap.from_pretrained`; at tp 1 a whole model, trained data parallel over every
    rank or `dp_group`). `dp_group` (a ProcessGroup or a 1-D DeviceMesh, ``mesh["dp"]``) is needed when the tp
    group is smaller than the world and larger than 1."""

    def __init__(self, *args, dp_group=None, **kwargs):
        super().__init__(*args, **kwargs)
        self._check_args()
        self._check_loss_path()
        sharded = getattr(self.model, PLAN_ATTR, None) is not None  # tpmap.apply at tp 1 returns the model as it was
        initialized = dist.is_initialized()
        world = dist.get_world_size() if initialized else 1
        self.tp_group = group_of(self.model)  # None: the default group
        self.tp_size = dist.get_world_size(self.tp_group) if initialized and sharded else 1
        self.tp_rank = dist.get_rank(self.tp_group) if initialized and sharded else 0
        self.dp_size = world // self.tp_size
        if dp_group is None and self.tp_size == 1 and world > 1:
            dp_group = dist.group.WORLD  # a whole model on every rank: plain data parallelism
        self.dp_group = dp_group.get_group() if isinstance(dp_group, DeviceMesh) else dp_group
        if self.dp_size > 1 and self.dp_group is None:
            raise TrainerSetupError(
                f"the model is tensor-parallel over {self.tp_size} of {world} ranks: pass dp_group= the data-parallel "
                f"group (with mesh = init_device_mesh(device, ({self.dp_size}, {self.tp_size}), mesh_dim_names=('dp', "
                f"'tp')): tpmap.apply(model, group=mesh['tp']) and TensorParallelTrainer(..., dp_group=mesh['dp']))")
        if self.dp_group is not None and dist.get_world_size(self.dp_group) != self.dp_size:
            raise TrainerSetupError(f"dp_group has {dist.get_world_size(self.dp_group)} ranks; with tp {self.tp_size} "
                                    f"of {world} ranks it must have {self.dp_size}")
        self.dp_rank = dist.get_rank(self.dp_group) if self.dp_group is not None else 0

    def _check_args(self) -> None:
        args = self.args
        refused = {
            "fp16": (args.fp16, "GradScaler's per-rank inf check would let tp ranks skip different steps: use bf16"),
            "fsdp": (bool(args.fsdp), "data parallelism goes through dp_group= (DDP over the dp group)"),
            "deepspeed": (bool(args.deepspeed), "data parallelism goes through dp_group= (DDP over the dp group)"),
            "load_best_model_at_end": (args.load_best_model_at_end, "not supported yet: load a checkpoint-N yourself"),
            "push_to_hub": (args.push_to_hub, "not supported yet: push the folder save_model writes"),
            "average_tokens_across_devices": (not args.average_tokens_across_devices,
                                              "keep it True (the default): Trainer's loss scale counts tokens over "
                                              "every rank and divides by the tp size"),
        }
        for name, (bad, why) in refused.items():
            if bad:
                raise TrainerSetupError(f"TensorParallelTrainer: TrainingArguments {name}={getattr(args, name)!r} "
                                        f"is refused: {why}")

    def _check_loss_path(self) -> None:
        """TRL's fused LM head (SFTTrainer, GRPO, ...: `trl.trainer.utils.add_fused_lm_head`) replaces the model's
        forward by one that runs the backbone and a log-softmax over ``get_output_embeddings().weight`` in its own
        kernel. Behind a vocabulary-parallel LM head that weight is this rank's vocabulary shard, so the softmax
        would normalize over V / tp entries: a wrong loss, silently."""
        code = getattr(getattr(self.model.forward, "__func__", None), "__code__", None)
        plan = getattr(self.model, PLAN_ATTR, None)
        if code is not None and code.co_name == "_fused_forward" and plan is not None and any(
                m.style == "vocab_head" for m in plan.modules):
            raise TrainerSetupError(
                "this Trainer computes the loss with TRL's fused LM head, a log-softmax over lm_head.weight, which "
                "tpmap splits over the vocabulary (each rank holds V / tp rows): the loss would be wrong. Use "
                "TensorParallelTrainer (transformers' loss on the model's own forward)")

    # ---- the tp size Trainer's loss scale and batch counts use
    def get_tp_size(self) -> int:
        return self.tp_size

    # ---- data: one stream per data-parallel replica
    def _get_dataloader(self, *args, **kwargs):
        loader = super()._get_dataloader(*args, **kwargs)
        if dist.is_initialized() and dist.get_world_size() > 1:
            shard = loader.batch_sampler if isinstance(loader.batch_sampler, BatchSamplerShard) else loader.sampler
            if not isinstance(shard, BatchSamplerShard) or shard.num_processes != dist.get_world_size():
                raise TrainerSetupError(
                    f"TensorParallelTrainer shards map-style datasets over the data-parallel replicas; this loader "
                    f"({type(loader.dataset).__name__}, sampler {type(shard).__name__}) is not one it can shard: "
                    f"use a map-style dataset (a datasets.Dataset or a torch Dataset with __len__)")
            shard.num_processes, shard.process_index = self.dp_size, self.dp_rank  # was: world size, global rank
        return loader

    # ---- wrapping: autocast and compile from accelerate, DDP over the dp group only
    def _wrap_model(self, model: nn.Module, training: bool = True, dataloader=None) -> nn.Module:
        if not training or self.accelerator.unwrap_model(model, keep_torch_compile=False) is not model:
            return super()._wrap_model(model, training, dataloader)
        if model not in self.accelerator._models:  # an evaluate() before train() has prepared it already
            model = self.accelerator.prepare_model(model, device_placement=False, evaluation_mode=True)
        model._is_accelerate_prepared = True  # accelerate's mark: Trainer's accelerator.prepare(model, ...) keeps it
        if self.dp_size == 1:
            return model
        handler = self.accelerator.ddp_handler
        kwargs = handler.to_kwargs() if handler is not None else {}
        device_ids = [self.args.device.index] if self.args.device.type == "cuda" else None
        return DistributedDataParallel(model, process_group=self.dp_group, device_ids=device_ids, **kwargs)

    # ---- the unsharded gradient's norm (tpmap.training.grad_norm: its weights cached per model)
    def _clip_grad_norm(self, model: nn.Module) -> torch.Tensor:
        self.accelerator.unscale_gradients()  # a no-op without a GradScaler
        return clip_grad_norm_(self.model, self.args.max_grad_norm, group=self.tp_group)  # one factor on all

    def _get_grad_norm(self, model: nn.Module, grad_norm=None):  # (Trainer passes grad_norm= by name)
        if grad_norm is not None:
            return grad_norm
        self.accelerator.unscale_gradients()
        return unsharded_grad_norm(self.model, group=self.tp_group)

    # ---- evaluation: metrics gathered over the replicas, not over every rank
    def evaluation_loop(self, *args, **kwargs):
        self.gather_function = self._gather_over_replicas  # Trainer resets it at the end of every loop
        return super().evaluation_loop(*args, **kwargs)

    def _all_gather_dp(self, tensor: torch.Tensor) -> torch.Tensor:
        """Concatenate every replica's `tensor` along dim 0 (in dp-rank order, the order of the batches)."""
        tensor = tensor.contiguous() if tensor.dim() else tensor.reshape(1)
        sizes = [torch.zeros(1, dtype=torch.long, device=tensor.device) for _ in range(self.dp_size)]
        dist.all_gather(sizes, torch.tensor([tensor.shape[0]], device=tensor.device), group=self.dp_group)
        longest = max(int(s) for s in sizes)
        padded = tensor.new_zeros((longest, *tensor.shape[1:]))
        padded[: tensor.shape[0]] = tensor
        parts = [torch.empty_like(padded) for _ in range(self.dp_size)]
        dist.all_gather(parts, padded, group=self.dp_group)
        return torch.cat([part[: int(n)] for part, n in zip(parts, sizes)])

    def _gather_over_replicas(self, data, use_gather_object: bool = False):
        """accelerate's gather_for_metrics over the dp group: each replica once, the last batch's padding dropped."""
        if self.dp_size > 1:
            if use_gather_object or not _all_tensors(data):
                parts = [None] * self.dp_size
                dist.all_gather_object(parts, data, group=self.dp_group)
                data = [x for part in parts for x in (part if isinstance(part, list) else [part])]
            else:
                data = recursively_apply(self._all_gather_dp, data)
        state = self.accelerator.gradient_state
        if state.end_of_dataloader and state.remainder > 0:
            data = data[: state.remainder] if isinstance(data, list) else recursively_apply(
                lambda t: t[: state.remainder], data)
        return data

    # ---- saving: a standard checkpoint from replica 0's tp group
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Every rank calls it (tpmap.save_pretrained is a collective over the tp group); the folder loads with
        AutoModel...from_pretrained."""
        output_dir = self.args.output_dir if output_dir is None else output_dir
        if self.dp_rank == 0:
            save_pretrained(self.model, output_dir)
        if self.args.should_save:
            os.makedirs(output_dir, exist_ok=True)
            if self.processing_class is not None:
                self.processing_class.save_pretrained(output_dir)
            torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))
        if dist.is_initialized():
            dist.barrier()

    # ---- checkpoints: the training state through tpmap.training.save / load, the rest Trainer's own
    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        save(os.path.join(output_dir, STATE_DIR), self.model, _inner(self.optimizer), self.lr_scheduler,
             step=self.state.global_step, dp_group=self.dp_group)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        if not os.path.isdir(os.path.join(resume_from_checkpoint, STATE_DIR)):
            raise TrainerSetupError(
                f"{resume_from_checkpoint} has no {STATE_DIR}/: resume needs a checkpoint written by "
                f"TensorParallelTrainer with save_only_model=False")
        # the weights are read with the optimizer's state, in _load_optimizer_and_scheduler (once it exists)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        state = load(os.path.join(checkpoint, STATE_DIR), self.model, _inner(self.optimizer), self.lr_scheduler,
                     dp_group=self.dp_group)
        saved = TrainerState.load_from_json(os.path.join(checkpoint, TRAINER_STATE_NAME)).global_step
        if state.step != saved:
            raise TrainerSetupError(f"{checkpoint}: the training state is of step {state.step}, {TRAINER_STATE_NAME} "
                                    f"of step {saved}; the folder mixes two checkpoints")


class TensorParallelTrainer(TensorParallelMixin, Trainer):
    """`transformers.Trainer` for a tpmap model (see the module docstring)."""


def _all_tensors(data) -> bool:
    """Whether `data` is tensors in lists, tuples and dicts only (accelerate's test for gather vs gather_object)."""
    try:
        recursively_apply(lambda x: x, data, error_on_other_type=True)
    except TypeError:
        return False
    return True


def _inner(optimizer):
    """The torch optimizer inside accelerate's AcceleratedOptimizer."""
    return getattr(optimizer, "optimizer", optimizer)
