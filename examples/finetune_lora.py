"""Fine-tune LoRA adapters on a tensor-parallel model (PEFT), then save a standard adapter folder.

    torchrun --nproc-per-node 2 examples/finetune_lora.py --model-type llama --steps 5 [--save OUT]
    torchrun --nproc-per-node 2 examples/finetune_lora.py --model DIR --steps 5 --save OUT [--adapter IN]

Needs `pip install 'tpmap[peft]'`. With --model, each rank reads only its slices of the checkpoint folder
(tpmap.from_pretrained); without it, every rank builds the same tiny random model (same seed) from the
mapping's embedded config (no download) and shards it with tpmap.apply. The base stays frozen; only the
adapters train (their whole tensors get the same gradient on every rank, so they stay equal). --adapter
continues from an adapter folder, each rank reading its slices of it. --save writes what PEFT writes for the
unsharded model (adapter_config.json, adapter_model.safetensors with full-size tensors) from rank 0: plain
`PeftModel.from_pretrained(unsharded_model, OUT)` loads it, and so does this script's --adapter at any world size.
"""
from __future__ import annotations

import argparse
import os
from datetime import timedelta

import torch
import torch.distributed as dist
from peft import LoraConfig
from transformers import AutoModelForCausalLM

import tpmap
import tpmap.peft
from tpmap.verify import tiny_config


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None, help="a checkpoint folder (config.json + safetensors)")
    parser.add_argument("--model-type", default="llama", help="without --model: the tiny random model of this type")
    parser.add_argument("--adapter", default=None, help="continue from this LoRA adapter folder")
    parser.add_argument("--targets", default="q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj",
                        help="comma-separated module names to put adapters on (PEFT's target_modules)")
    parser.add_argument("--r", type=int, default=8, help="LoRA rank")
    parser.add_argument("--alpha", type=float, default=16.0, help="LoRA alpha (the update is scaled by alpha / r)")
    parser.add_argument("--dropout", type=float, default=0.05, help="dropout on the adapters' input")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--save", default=None, help="write the adapter (full size) to this folder")
    parser.add_argument("--timeout", type=float, default=60.0,
                        help="process-group timeout in seconds: a rank that left the loop early ends the job then")
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(seconds=args.timeout))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if cuda else "cpu")

    torch.manual_seed(0)  # the same on every rank: same init, same batches, same replicated dropout
    if args.model:
        model = tpmap.from_pretrained(args.model, device=device)
    else:
        model = AutoModelForCausalLM.from_config(tiny_config(args.model_type))
        model = tpmap.apply(model, world_size).to(device)
    if args.adapter:  # each rank reads its slices of the adapter's split tensors
        model = tpmap.peft.from_pretrained(model, args.adapter, is_trainable=True)
    else:  # fresh adapters: PEFT's own init at full size, one seed on every rank, sliced
        config = LoraConfig(r=args.r, lora_alpha=args.alpha, target_modules=args.targets.split(","),
                            lora_dropout=args.dropout)
        model = tpmap.peft.get_peft_model(model, config)
    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    if rank == 0:
        count = sum(p.numel() for p in trainable)
        print(f"trainable (this rank's shards): {count:,} of {sum(p.numel() for p in model.parameters()):,}",
              flush=True)
    optimizer = torch.optim.AdamW(trainable, lr=args.lr)

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
