"""Expert placement, side by side in one interleaved run: tpmap's experts="parallel" (whole experts per rank),
experts="split" (every expert split along its width), Hugging Face's expert parallelism
(`from_pretrained(..., distributed_config=DistributedConfig(tp_size=ws, ep_size=ws))`, where it runs) and the
unsharded model. Rounds rotate the order; the first two are warm-up; each time is the slowest rank's (a barrier
before, the max over ranks after), the median of the rest. fp32, 1 thread per rank.

    python -m torch.distributed.run --nproc-per-node 2 benchmarks/experts.py --shape qwen3_moe [--rounds 7]

Shapes (hidden 512, 4 layers, scaled down from the real models, the experts' width kept in proportion to the
hidden size, so the experts stay as thin as in the real model):
  mixtral      8 experts of width 1792 (3.5 x hidden), top-2
  qwen3_moe    64 experts of width 192 (Qwen3-30B-A3B: 768 of 2048), top-8
  deepseek_v3  64 routed experts of width 144 (DeepSeek-V3: 2048 of 7168), top-8 in 8 groups (4 chosen), one
               shared expert, MLA attention, the first layer dense
Tasks: forward (1, 8) and (4, 128), greedy decode of 16 tokens after 16, a training step (2, 128; loss.backward).
"""
from __future__ import annotations

import argparse
import copy
import tempfile

import torch
import torch.distributed as dist
import transformers
from interleaved import decode, forward, start, timed, tokens, train

import tpmap

VOCAB = 8000
COMMON = dict(hidden_size=512, num_hidden_layers=4, vocab_size=VOCAB, max_position_embeddings=512)
SHAPES = {
    "mixtral": ("mixtral", "MixtralForCausalLM", dict(
        num_attention_heads=8, num_key_value_heads=8, intermediate_size=1792, num_local_experts=8,
        num_experts_per_tok=2)),
    "qwen3_moe": ("qwen3_moe", "Qwen3MoeForCausalLM", dict(
        num_attention_heads=8, num_key_value_heads=4, head_dim=64, intermediate_size=1536, moe_intermediate_size=192,
        num_experts=64, num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])),
    "deepseek_v3": ("deepseek_v3", "DeepseekV3ForCausalLM", dict(
        num_attention_heads=8, num_key_value_heads=8, q_lora_rank=192, kv_lora_rank=128, qk_rope_head_dim=32,
        qk_nope_head_dim=64, v_head_dim=64, intermediate_size=1408, moe_intermediate_size=144, n_routed_experts=64,
        num_experts_per_tok=8, n_group=8, topk_group=4, n_shared_experts=1, first_k_dense_replace=1)),
}


TASKS = {"fwd 1x8": lambda m: forward(m, VOCAB, (1, 8)), "fwd 4x128": lambda m: forward(m, VOCAB, (4, 128)),
         "decode 16": lambda m: decode(m, VOCAB, 16), "train 2x128": lambda m: train(m, VOCAB)}


def hf_expert_parallel(cls, full, ws: int):
    """HF's own EP on the same weights (saved by rank 0, loaded by every rank), or the reason it does not run."""
    folder = [tempfile.mkdtemp(prefix="tpmap-ep-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(folder, src=0)
    if dist.get_rank() == 0:
        full.save_pretrained(folder[0])
    dist.barrier()
    try:
        config = transformers.DistributedConfig(tp_size=ws, ep_size=ws)
        model = cls.from_pretrained(folder[0], distributed_config=config).eval()
        forward(model, VOCAB, (1, 8))  # runs at all?
        return model
    except Exception as e:  # reported beside the table: HF's EP on CPU is one of the things measured
        return f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=list(SHAPES), default="mixtral")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    ws = start()
    model_type, cls_name, shape = SHAPES[args.shape]
    cls = getattr(transformers, cls_name)
    config = transformers.AutoConfig.for_model(model_type, **COMMON, **shape)
    torch.manual_seed(0)
    full = cls(config).eval()
    models = {"unsharded": full,
              "split": tpmap.apply(copy.deepcopy(full), ws, experts="split").eval(),
              "parallel": tpmap.apply(copy.deepcopy(full), ws, experts="parallel").eval()}
    hf = hf_expert_parallel(cls, full, ws)
    if not isinstance(hf, str):
        models["hf_ep"] = hf
    ids = tokens(VOCAB, (2, 32), seed=2)
    with torch.no_grad():  # each variant's logits against the unsharded model's: a fast wrong layout is no result
        want = full(ids).logits
        rel = {name: ((m(ids).logits - want).abs().max() / want.abs().max()).item() for name, m in models.items()}
    med = timed({task: (lambda name, run=run: run(models[name])) for task, run in TASKS.items()}, list(models),
                args.rounds)
    if dist.get_rank() == 0:
        params = sum(p.numel() for p in full.parameters()) / 1e6
        print(f"{args.shape} ({params:.0f}M parameters) ws={ws}, seconds (x unsharded):")
        for task in TASKS:
            print(f"  {task:12s}", "  ".join(f"{name} {med[(task, name)]:.4f} "
                                             f"({med[(task, name)] / med[(task, 'unsharded')]:.2f})"
                                             for name in models))
        print("  logits vs unsharded (max rel):", "  ".join(f"{name} {r:.1e}" for name, r in rel.items()))
        if isinstance(hf, str):
            print(f"  hf_ep does not run: {hf}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
