"""Data parallel x tensor parallel: tpmap inside each group of --tp ranks, DDP across the --dp replicas.

    torchrun --nproc-per-node 4 examples/train_2d.py --dp 2 --tp 2                  # one node, CPU/gloo
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
        examples/train_2d.py --dp 2 --tp 8 --model DIR                               # tp inside a node
    torchrun --nproc-per-node 4 examples/train_2d.py --dp 2 --tp 2 --save-every 2 --checkpoint-dir CKPT
    torchrun --nproc-per-node 4 examples/train_2d.py --dp 1 --tp 4 --resume CKPT --steps 8   # another shape

The ranks form a (dp, tp) DeviceMesh. tp is the last dimension, so a tensor-parallel group is --tp
consecutive ranks -- one node's GPUs under torchrun, where the all-reduces of every layer stay on the
fast links -- and the dp groups (one gradient all-reduce per step, by DDP) span the nodes. Each replica
trains on its own slice of the global batch (--batch sequences per step); the loss printed is the mean
over the replicas, so runs with any --dp x --tp agree; it is printed at full precision (``step N loss X``). Each
step's global batch is rows of a small fixed corpus drawn by a seeded generator. --save-every N writes a training
checkpoint (tpmap.training.save, with dp_group) into --checkpoint-dir every N steps; --resume DIR continues from
its latest one at any --dp x --tp the mapping serves. --save writes the unsharded model as a standard
transformers checkpoint from replica 0 (its tp group gathers; the other replicas hold the same weights).
--max-grad-norm X clips the DDP-averaged gradient by the unsharded model's norm (tpmap.training.clip_grad_norm_ on
the DDP model: the tp group's all-reduce is enough, the replicas' gradients being equal).
"""
from __future__ import annotations

import argparse
import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel as DDP
from transformers import AutoModelForCausalLM

import tpmap
import tpmap.training
from tpmap.verify import tiny_config


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dp", type=int, required=True, help="data-parallel replicas")
    parser.add_argument("--tp", type=int, required=True, help="tensor-parallel ranks per replica (--dp x --tp = world)")
    parser.add_argument("--model", default=None, help="a checkpoint folder (config.json + safetensors)")
    parser.add_argument("--model-type", default="llama", help="without --model: the tiny random model of this type")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch", type=int, default=8, help="global batch (sequences per step), split over --dp")
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--save", default=None, help="write the unsharded checkpoint to this folder")
    parser.add_argument("--save-every", type=int, default=0, help="write a training checkpoint every N steps")
    parser.add_argument("--checkpoint-dir", default=None, help="where --save-every writes (DIR/step-N, DIR/latest)")
    parser.add_argument("--resume", default=None, help="continue from this training checkpoint directory")
    parser.add_argument("--max-grad-norm", type=float, default=None,
                        help="clip the gradient to this norm of the unsharded model's (tpmap.training.clip_grad_norm_)")
    parser.add_argument("--timeout", type=float, default=60.0, help="process-group timeout in seconds")
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(seconds=args.timeout))
    if args.dp * args.tp != dist.get_world_size() or args.batch % args.dp:
        raise SystemExit(f"--dp {args.dp} x --tp {args.tp} must equal the world size {dist.get_world_size()}, "
                         f"and --dp must divide --batch {args.batch}")
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    mesh = init_device_mesh(device.type, (args.dp, args.tp), mesh_dim_names=("dp", "tp"))
    dp_rank = mesh["dp"].get_local_rank()

    torch.manual_seed(0)  # the same on every rank: same init, same replicated dropout within a tp group
    if args.model:
        model = tpmap.from_pretrained(args.model, group=mesh["tp"], device=device)
    else:
        model = AutoModelForCausalLM.from_config(tiny_config(args.model_type))
        model = tpmap.apply(model, group=mesh["tp"]).to(device)  # tp 1: the model unchanged
    model.train()
    ddp = DDP(model, process_group=mesh["dp"].get_group())  # averages gradients over the replicas
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=3e-3)

    corpus = torch.randint(0, model.config.vocab_size, (2 * args.batch, args.seq),
                           generator=torch.Generator().manual_seed(1))  # learned by heart
    order = torch.Generator().manual_seed(2)  # the data stream: which rows each global batch takes
    per_replica = args.batch // args.dp

    def next_batch() -> torch.Tensor:
        batch = corpus[torch.randint(0, len(corpus), (args.batch,), generator=order)]  # (batch, seq), every rank
        return batch[dp_rank * per_replica: (dp_rank + 1) * per_replica].to(device)  # this replica's slice

    start = 0
    if args.resume:
        state = tpmap.training.load(args.resume, ddp, optimizer, dp_group=mesh["dp"])
        start = state.step
        for _ in range(state.data_state["batches_drawn"]):  # the data stream where it was
            next_batch()
    for step in range(start, args.steps):
        mine = next_batch()
        loss = ddp(input_ids=mine, labels=mine).loss  # transformers shifts the labels
        loss.backward()
        if args.max_grad_norm is not None:  # not torch's clip_grad_norm_: its norm would be each rank's own shards'
            tpmap.training.clip_grad_norm_(ddp, args.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean, group=mesh["dp"].get_group())  # for printing: the mean over the replicas
        if dist.get_rank() == 0:
            print(f"step {step} loss {mean.item() / args.dp!r}", flush=True)
        if args.save_every and (step + 1) % args.save_every == 0:
            tpmap.training.save(args.checkpoint_dir, ddp, optimizer, step=step + 1,
                                data_state={"batches_drawn": step + 1}, dp_group=mesh["dp"])

    if args.save and dp_rank == 0:  # one replica: a collective over its tp group, whose rank 0 writes
        tpmap.save_pretrained(model, args.save)
        if dist.get_rank() == 0:
            print(f"saved to {args.save}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
