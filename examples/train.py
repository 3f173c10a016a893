"""Fine-tune a model for a few steps with tensor parallelism, then save a standard checkpoint.

    torchrun --nproc-per-node 2 examples/train.py --model DIR --steps 5 --save OUT   # a checkpoint folder
    torchrun --nproc-per-node 2 examples/train.py --model-type llama --steps 5 [--save OUT] [--loss-parallel]

With --model, each rank reads only its slices of the folder (tpmap.from_pretrained); without it,
every rank builds the same tiny random model (same seed) from the mapping's embedded config (no
download) and shards it with tpmap.apply. Every rank trains on the same batches; rank 0 prints the
loss. --save writes the unsharded model as a standard transformers checkpoint (tpmap.save_pretrained:
rank 0 gathers one tensor at a time), loadable by AutoModelForCausalLM.from_pretrained.
"""
from __future__ import annotations

import argparse
import os
from datetime import timedelta

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

import tpmap
from tpmap.verify import tiny_config


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None, help="a checkpoint folder (config.json + safetensors)")
    parser.add_argument("--model-type", default="llama", help="without --model: the tiny random model of this type")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--save", default=None, help="write the unsharded checkpoint to this folder")
    parser.add_argument("--loss-parallel", action="store_true", help="cross-entropy on vocabulary shards")
    parser.add_argument("--timeout", type=float, default=60.0,
                        help="process-group timeout in seconds: a rank that left the loop early ends the job then")
    args = parser.parse_args()

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
    data = torch.Generator().manual_seed(1)
    batch = torch.randint(0, vocab, (4, 32), generator=data).to(device)  # one batch, learned by heart
    for step in range(args.steps):
        loss = model(input_ids=batch, labels=batch).loss  # transformers shifts the labels
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if rank == 0:
            print(f"step {step} loss {loss.item():.4f}", flush=True)

    if args.save:
        tpmap.save_pretrained(model, args.save)  # a collective: every rank takes part, rank 0 writes
        if rank == 0:
            print(f"saved to {args.save}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
