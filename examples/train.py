"""Fine-tune a model for a few steps with tensor parallelism, then save a standard checkpoint.

    torchrun --nproc-per-node 2 examples/train.py --model DIR --steps 5 --save OUT   # a checkpoint folder
    torchrun --nproc-per-node 2 examples/train.py --model-type llama --steps 5 [--save OUT] [--loss-parallel]
    torchrun --nproc-per-node 2 examples/train.py --steps 8 --save-every 2 --checkpoint-dir CKPT  # checkpoints
    torchrun --nproc-per-node 4 examples/train.py --steps 12 --resume CKPT   # continue, here at another tp size

With --model, each rank reads only its slices of the folder (tpmap.from_pretrained); without it,
every rank builds the same tiny random model (same seed) from the mapping's embedded config (no
download) and shards it with tpmap.apply. Every rank trains on the same batches, rows of a small fixed
corpus drawn by a seeded generator; rank 0 prints each step's loss at full precision (``step N loss X``).
--save-every N writes a training checkpoint (tpmap.training.save: weights, AdamW state, RNG, and how many batches
the data stream has given) into --checkpoint-dir every N steps; --resume DIR continues from its latest one, at any
number of ranks the mapping serves, and gives the same losses as a run never stopped. --max-grad-norm X clips
the gradient by the unsharded model's norm, the same factor on every rank (tpmap.training.clip_grad_norm_).
--save writes the unsharded model as a standard transformers checkpoint (tpmap.save_pretrained: rank 0 gathers
one tensor at a time), loadable by AutoModelForCausalLM.from_pretrained.
"""
from __future__ import annotations

import argparse
import os
from datetime import timedelta

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

import tpmap
import tpmap.training
from tpmap.verify import tiny_config


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None, help="a checkpoint folder (config.json + safetensors)")
    parser.add_argument("--model-type", default="llama", help="without --model: the tiny random model of this type")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--save", default=None, help="write the unsharded checkpoint to this folder")
    parser.add_argument("--loss-parallel", action="store_true", help="cross-entropy on vocabulary shards")
    parser.add_argument("--save-every", type=int, default=0, help="write a training checkpoint every N steps")
    parser.add_argument("--checkpoint-dir", default=None, help="where --save-every writes (DIR/step-N, DIR/latest)")
    parser.add_argument("--resume", default=None, help="continue from this training checkpoint directory")
    parser.add_argument("--max-grad-norm", type=float, default=None,
                        help="clip the gradient to this norm of the unsharded model's (tpmap.training.clip_grad_norm_)")
    parser.add_argument("--timeout", type=float, default=60.0,
                        help="process-group timeout in seconds: a rank that left the loop early ends the job then")
    args = parser.parse_args()
    if args.save_every and not args.checkpoint_dir:
        parser.error("--save-every needs --checkpoint-dir")

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(seconds=args.timeout))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if cuda else "cpu")

    torch.manual_seed(0)  # the same on every rank: same init, same batches, same replicated dropout
    if args.model:
        model = tpmap.from_pretrained(args.model, device=device, loss_parallel=args.loss_parallel).train()
    else:
        model = AutoModelForCausalLM.from_config(tiny_config(args.model_type))
        model = tpmap.apply(model, world_size, loss_parallel=args.loss_parallel).to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)

    vocab = model.config.vocab_size
    corpus = torch.randint(0, vocab, (16, 32), generator=torch.Generator().manual_seed(1))  # learned by heart
    order = torch.Generator().manual_seed(2)  # the data stream: which rows each batch takes

    def next_batch() -> torch.Tensor:
        return corpus[torch.randint(0, len(corpus), (4,), generator=order)].to(device)  # (4, 32)

    start = 0
    if args.resume:
        state = tpmap.training.load(args.resume, model, optimizer)
        start = state.step
        for _ in range(state.data_state["batches_drawn"]):  # the data stream where it was
            next_batch()
    for step in range(start, args.steps):
        batch = next_batch()
        loss = model(input_ids=batch, labels=batch).loss  # transformers shifts the labels
        loss.backward()
        if args.max_grad_norm is not None:  # not torch's clip_grad_norm_: its norm would be each rank's own shards'
            tpmap.training.clip_grad_norm_(model, args.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad()
        if rank == 0:
            print(f"step {step} loss {loss.item()!r}", flush=True)
        if args.save_every and (step + 1) % args.save_every == 0:
            tpmap.training.save(args.checkpoint_dir, model, optimizer, step=step + 1,
                                data_state={"batches_drawn": step + 1})

    if args.save:
        tpmap.save_pretrained(model, args.save)  # a collective: every rank takes part, rank 0 writes
        if rank == 0:
            print(f"saved to {args.save}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
