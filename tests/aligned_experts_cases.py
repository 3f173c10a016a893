"""Rank functions for tests/test_aligned_experts.py: a bf16 Mixtral loaded by tpmap.from_pretrained, whose stacked
experts are split in units of 8 bf16 elements (16 bytes), run through transformers' grouped matmul against the
unsharded bf16 model in the same run."""
from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

import tpmap
from tpmap import verify


def bf16_forward(ref: str, verify_index: int, class_name: str, folder: str) -> dict:
    exact = verify.build_model(ref, verify_index, class_name)  # fp32: what both bf16 models round
    full = verify.build_model(ref, verify_index, class_name).to(torch.bfloat16)
    if dist.get_rank() == 0:
        full.save_pretrained(Path(folder))
    dist.barrier()
    model = tpmap.from_pretrained(folder, model_class=class_name, dtype=torch.bfloat16, mapping=verify.resolve(ref))
    ids = verify.case_inputs(ref, verify_index, full)["input_ids"]
    with torch.no_grad():
        want, got = full(input_ids=ids).logits.float(), model(input_ids=ids).logits.float()
        fp32 = exact(input_ids=ids).logits
    down = model.get_submodule("model.layers.0.mlp.experts").down_proj
    return {"max_diff": (got - want).abs().max().item(), "scale": want.abs().max().item(),
            "sharded_vs_fp32": (got - fp32).abs().max().item(), "unsharded_vs_fp32": (want - fp32).abs().max().item(),
            "width": down.shape[2], "dtype": str(down.dtype),
            "implementation": model.config._experts_implementation}
