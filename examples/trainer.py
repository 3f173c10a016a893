"""Fine-tune through Hugging Face's Trainer: tpmap inside each group of --tp ranks, data parallel across groups.

    torchrun --nproc-per-node 2 examples/trainer.py --tp 2 --steps 6                  # tp 2 (CPU: gloo)
    torchrun --nproc-per-node 4 examples/trainer.py --tp 2 --steps 6                  # dp 2 x tp 2
    torchrun --nproc-per-node 2 examples/trainer.py --tp 2 --steps 6 --save-steps 3   # checkpoint-3, checkpoint-6
    torchrun --nproc-per-node 2 examples/trainer.py --tp 2 --steps 9 --save-steps 3 --resume   # from checkpoint-6
    torchrun --nproc-per-node 8 examples/trainer.py --tp 8 --model DIR --bf16 --save OUT        # a real checkpoint

`tpmap.training.trainer.TensorParallelTrainer` is transformers' Trainer with the changes tensor parallelism needs
(docs/training.md#hugging-face-trainer): every rank of a tp group gets the same batches, each data-parallel
replica its own, DDP runs over the replicas only, the gradient norm is the unsharded model's. With dp = world /
--tp > 1 the ranks form a (dp, tp) DeviceMesh. Without --model: a tiny random model of --model-type, trained on
a fixed set of random sequences (learned by heart, so the loss falls); with --model: that checkpoint, on the same
kind of random sequences of its vocabulary. Rank 0 prints ``step N loss X`` at every optimizer step (X in full
precision: runs with any --tp and dp agree to fp32 rounding).
"""
from __future__ import annotations

import argparse
import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from transformers import AutoModelForCausalLM, TrainerCallback, TrainingArguments

import tpmap
from tpmap.training.trainer import TensorParallelTrainer
from tpmap.verify import large_init_, tiny_config


class Sequences(torch.utils.data.Dataset):
    """A fixed set of random token sequences; labels = input_ids (transformers shifts them)."""

    def __init__(self, n: int, length: int, vocab: int):
        self.ids = torch.randint(0, vocab, (n, length), generator=torch.Generator().manual_seed(1))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class PrintLoss(TrainerCallback):
    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and logs and "loss" in logs:
            print(f"step {state.global_step} loss {logs['loss']!r}", flush=True)


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", type=int, required=True, help="tensor-parallel ranks per replica (divides the world)")
    parser.add_argument("--steps", type=int, default=6, help="optimizer steps")
    parser.add_argument("--model", default=None, help="a checkpoint folder (config.json + safetensors)")
    parser.add_argument("--model-type", default="llama", help="without --model: the tiny random model of this type")
    parser.add_argument("--batch", type=int, default=8, help="global batch (sequences per optimizer step)")
    parser.add_argument("--grad-accum", type=int, default=2, help="gradient accumulation steps")
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--samples", type=int, default=24, help="sequences in the training set")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--bf16", action="store_true", help="bf16 autocast")
    parser.add_argument("--output", default="trainer_output", help="Trainer's output_dir (checkpoints)")
    parser.add_argument("--save-steps", type=int, default=0, help="write checkpoint-N every K steps (0: never)")
    parser.add_argument("--resume", action="store_true", help="resume from the last checkpoint in --output")
    parser.add_argument("--save", default=None, help="write the trained model as a standard checkpoint here")
    parser.add_argument("--timeout", type=float, default=60.0, help="process-group timeout in seconds")
    return parser.parse_args()


def build(args: argparse.Namespace, tp_group, device: torch.device):
    torch.manual_seed(0)  # the same on every rank: same init, same replicated dropout within a tp group
    if args.model:
        return tpmap.from_pretrained(args.model, group=tp_group, device=device)
    model = AutoModelForCausalLM.from_config(tiny_config(args.model_type))
    large_init_(model, 0, 0.15)  # larger than transformers' default init: a visible loss curve in a few steps
    return tpmap.apply(model, group=tp_group)


def main() -> None:
    args = parse()
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(seconds=args.timeout))
    world = dist.get_world_size()
    dp = world // args.tp
    if dp * args.tp != world or args.batch % (dp * args.grad_accum):
        raise SystemExit(f"--tp {args.tp} must divide the world size {world}, and dp ({dp}) x --grad-accum "
                         f"({args.grad_accum}) must divide --batch {args.batch}")
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    mesh = init_device_mesh(device.type, (dp, args.tp), mesh_dim_names=("dp", "tp")) if dp > 1 else None
    model = build(args, mesh["tp"] if mesh is not None else None, device)

    training = TrainingArguments(
        output_dir=args.output, max_steps=args.steps, per_device_train_batch_size=args.batch // dp // args.grad_accum,
        gradient_accumulation_steps=args.grad_accum, learning_rate=args.lr, logging_steps=1, bf16=args.bf16,
        save_strategy="steps" if args.save_steps else "no", save_steps=args.save_steps or 500, report_to="none",
        use_cpu=not cuda, disable_tqdm=True, seed=0)
    trainer = TensorParallelTrainer(
        model=model, args=training, train_dataset=Sequences(args.samples, args.seq, model.config.vocab_size),
        callbacks=[PrintLoss()], dp_group=mesh["dp"] if mesh is not None else None)
    trainer.train(resume_from_checkpoint=True if args.resume else None)
    if args.save:
        trainer.save_model(args.save)  # every rank: replica 0's tp group gathers, its rank 0 writes
        if dist.get_rank() == 0:
            print(f"saved to {args.save}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
