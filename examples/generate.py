"""Greedy generation with a tensor-parallel model; every rank produces the same tokens.

    torchrun --nproc-per-node 2 examples/generate.py --model DIR [--check]     # a checkpoint folder
    torchrun --nproc-per-node 2 examples/generate.py --model-type gpt2 --check # a tiny random model

With --model, each rank reads only its slices of the folder's safetensors (tpmap.from_pretrained);
without it, the mapping's tiny config gives a random model (no download). With --check, each rank
also generates with the unsharded model and reports whether the tokens match.

Out-of-step ranks (what happens when one rank fails or leaves its loop early; tested in CI):
``--fail-on-rank R`` raises inside rank R's third forward, ``--stop-early-on-rank R`` makes rank R
generate fewer tokens. The process group gets an explicit timeout (``--timeout``, 60 s here; gloo's
default is 30 minutes), so a rank blocked in a collective that its peers never join gives up.
"""
from __future__ import annotations

import argparse
import copy
import os
from datetime import timedelta

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

import tpmap
from tpmap.verify import large_init_, tiny_config


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None, help="a checkpoint folder (config.json + safetensors)")
    parser.add_argument("--model-type", default="gpt2", help="without --model: the tiny random model of this type")
    parser.add_argument("--new-tokens", type=int, default=20)
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--timeout", type=float, default=60.0, help="process-group timeout in seconds")
    parser.add_argument("--fail-on-rank", type=int, default=None, help="demo: this rank raises mid-generate")
    parser.add_argument("--stop-early-on-rank", type=int, default=None, help="demo: this rank generates fewer tokens")
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(seconds=args.timeout))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if cuda else "cpu")
    torch.manual_seed(0)
    if args.model:
        model = tpmap.from_pretrained(args.model, device=device)
        full = AutoModelForCausalLM.from_pretrained(args.model).to(device).eval() if args.check else None
    else:
        full = AutoModelForCausalLM.from_config(tiny_config(args.model_type)).eval()
        large_init_(full, seed=0)  # random weights with a wide spread: greedy decoding does not just repeat a token
        model = tpmap.apply(copy.deepcopy(full) if args.check else full, world_size).to(device)
        full = full.to(device)

    prompt = torch.tensor([[5, 6, 7, 8, 9, 10], [0, 0, 0, 11, 12, 13]], device=device)  # batch 2, left-padded
    mask = (torch.arange(6, device=device) >= torch.tensor([[0], [3]], device=device)).long()
    kwargs = dict(attention_mask=mask, max_new_tokens=args.new_tokens, do_sample=False, pad_token_id=0)
    if rank == args.fail_on_rank:
        calls = []

        def fail_third_forward(module, inputs):
            calls.append(1)
            if len(calls) == 3:
                raise RuntimeError(f"deliberate failure inside rank {rank}'s third forward")

        model.register_forward_pre_hook(fail_third_forward)
    if rank == args.stop_early_on_rank:
        kwargs = {**kwargs, "max_new_tokens": 3}
    tokens = model.generate(prompt, **kwargs)
    if rank == 0:
        print("tokens:", tokens[:, prompt.shape[1]:].tolist(), flush=True)
    if args.check:
        same = torch.equal(tokens, full.generate(prompt, **kwargs))
        print(f"rank {rank}: matches the unsharded model: {same}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
