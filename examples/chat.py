"""Chat with a tensor-parallel model from one plain Python process: no torchrun, no code on every rank.

    python examples/chat.py --model DIR --world-size 2               # a checkpoint folder with its tokenizer
    python examples/chat.py --world-size 2 --prompt "Hello" --check  # a tiny random Llama, no download

`tpmap.parallelize` starts the workers (one per GPU with --device cuda, gloo ranks on CPU), each loading
only its own slices of the checkpoint; this process keeps no weights. Tokens are printed as they come
(a TextStreamer runs here, fed by the workers). Without --prompt it reads lines from stdin until an
empty line or end of input. With --check (the tiny model), the tokens are compared with the unsharded
model's, loaded in this process for the purpose.

The same lines work in a notebook, one per cell:

    handle = tpmap.parallelize("path/to/model", 2, dtype=torch.bfloat16, device="cuda")
    handle.generate(ids, max_new_tokens=64, streamer=TextStreamer(tokenizer, skip_prompt=True))
    handle.close()
"""
from __future__ import annotations

import argparse
import sys
import tempfile

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, TextStreamer

import tpmap
from tpmap.demo import tiny_checkpoint  # a tiny Llama with fixed weights and a character-level tokenizer


def prompt_ids(tokenizer, text: str) -> torch.Tensor:
    """The prompt as the model expects it: through its chat template when it has one."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                             return_tensors="pt", return_dict=True)["input_ids"]
    return tokenizer(text, return_tensors="pt")["input_ids"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None, help="a checkpoint folder with its tokenizer (default: a tiny one)")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when there is a GPU)")
    parser.add_argument("--dtype", default=None, help="e.g. bfloat16 (default: the checkpoint's)")
    parser.add_argument("--prompt", default=None, help="one prompt instead of reading stdin")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--check", action="store_true", help="compare with the unsharded model's tokens")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tiny:
        folder = args.model
        if folder is None:
            tiny_checkpoint(tiny)
            folder = tiny
        tokenizer = AutoTokenizer.from_pretrained(folder)
        dtype = getattr(torch, args.dtype) if args.dtype else None
        with tpmap.parallelize(folder, args.world_size, dtype=dtype, device=args.device) as model:
            s = model.startup
            print(f"{model!r}: ready in {s.total_s:.1f} s (spawn {s.spawn_s:.1f} s, load {s.load_s:.1f} s)",
                  file=sys.stderr)
            full = AutoModelForCausalLM.from_pretrained(folder).eval() if args.check else None
            lines = [args.prompt] if args.prompt is not None else iter(sys.stdin.readline, "")
            for line in lines:
                if not line.strip():
                    break
                ids = prompt_ids(tokenizer, line.strip())
                settings = dict(max_new_tokens=args.new_tokens, do_sample=False,
                                pad_token_id=model.generation_config.pad_token_id or tokenizer.pad_token_id)
                tokens = model.generate(ids, streamer=TextStreamer(tokenizer, skip_prompt=True), **settings)
                if full is not None:
                    print(f"matches the unsharded model: {torch.equal(tokens, full.generate(ids, **settings))}")


if __name__ == "__main__":  # the workers are spawned: they re-import this file, which must not start them again
    main()
