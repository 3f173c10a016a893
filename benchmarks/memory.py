"""Per-rank parameter bytes of a Llama-shaped model with a 128k vocabulary, with and without the
vocabulary-parallel embedding and LM head. Computed from tpmap's plan on the meta device (no memory
is allocated, nothing is guessed): every parameter's local shape on rank 0. Also times building the
plan (all checks, 32 layers, 291 parameters) for each world size.

    python benchmarks/memory.py [--dtype-bytes 2] [--world-sizes 1 2 4 8]
"""
from __future__ import annotations

import argparse
import time

import torch
from transformers import AutoConfig, LlamaForCausalLM

import tpmap
from tpmap.language.source import for_model_type

# Llama-3-8B's shape (hidden 4096, 32 layers, 32 heads, 8 KV heads, MLP 14336, vocabulary 128256)
LLAMA3_8B = dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                 intermediate_size=14336, vocab_size=128256, tie_word_embeddings=False)


def rank0_bytes(model, world_size: int, mapping, dtype_bytes: int) -> int:
    plan = tpmap.plan(model, world_size, mapping=mapping)
    shards = plan.params
    total = 0
    for name, p in model.named_parameters():
        shape = shards[name].local_shape(0) if name in shards else tuple(p.shape)
        total += torch.Size(shape).numel() * dtype_bytes
    return total


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype-bytes", type=int, default=2, help="2 for bf16/fp16, 4 for fp32")
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2, 4, 8])
    args = parser.parse_args()

    with torch.device("meta"):
        model = LlamaForCausalLM(AutoConfig.for_model("llama", **LLAMA3_8B))
    with_vocab = for_model_type("llama")
    without_vocab = with_vocab.__class__(with_vocab.mapping.model_copy(update={"vocab_parallel": None}),
                                         with_vocab.source, with_vocab.data)
    full = sum(p.numel() for p in model.parameters()) * args.dtype_bytes
    print(f"Llama-shaped, vocabulary 128256, {args.dtype_bytes}-byte parameters; full model {full / 2**30:.2f} GiB")
    print(f"{'ws':>3} {'vocab-parallel GiB/rank':>24} {'replicated emb+head GiB/rank':>29} {'saved':>8} "
          f"{'plan ms':>8}")
    for ws in args.world_sizes:
        t0 = time.perf_counter()
        a = rank0_bytes(model, ws, with_vocab, args.dtype_bytes)
        plan_ms = (time.perf_counter() - t0) * 1e3
        b = rank0_bytes(model, ws, without_vocab, args.dtype_bytes)
        print(f"{ws:>3} {a / 2**30:>24.3f} {b / 2**30:>29.3f} {(b - a) / 2**30:>7.3f}G {plan_ms:>8.1f}")


if __name__ == "__main__":
    main()
