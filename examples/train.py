"""Fine-tune a tiny random model for a few steps with tensor parallelism, then save a standard checkpoint.

    torchrun --nproc-per-node 2 examples/train.py --model-type llama --steps 5 [--save DIR] [--loss-parallel]

Every rank builds the same model (same seed) from the embedded tiny config of the mapping (no
download), shards it with tpmap.apply, and trains on the same batches; rank 0 prints the loss.
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
    parser.add_argument("--model-type", default="llama")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--save", default=None, help="write the unsharded checkpoint here (rank 0)")
    parser.add_argument("--loss-parallel", action="store_true", help="cross-entropy on vocabulary shards")
    parser.add_argument("--timeout", type=float, default=60.0,
                        help="process-group timeout in seconds: a rank that left the loop early ends the job then")
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(seconds=args.timeout))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if cuda else "cpu")

    torch.manual_seed(0)  # the same on every rank: same init, same batches, same replicated dropout
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

    state = tpmap.full_state_dict(model)  # a collective: every rank takes part
    if rank == 0 and args.save:
        # the unsharded state dict under the original names: a standard transformers checkpoint
        print(f"saving {len(state)} tensors to {args.save}", flush=True)
        AutoModelForCausalLM.from_config(model.config).save_pretrained(args.save, state_dict=state)
    dist.barrier()  # let rank 0 finish writing before any rank tears the group down
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
