"""Sequence parallelism (`tpmap.apply(..., sequence_parallel=True)`) on real gloo ranks at world sizes 2 and
4, against the unsharded model and plain TP in the same run: logits, per-shard gradients (fp32 1e-4, fp64
1e-6, the bounds of test_training.py), greedy generate, the split itself, collective counts, refusals."""
from __future__ import annotations

import pytest
import torch

import tpmap
from tpmap import verify

import sequence_cases

GRAD_RTOL = {torch.float32: 1e-4, torch.float64: 1e-6}
LOGIT_RTOL = {torch.float32: 1e-5, torch.float64: 1e-10}
DENSE = [  # (mapping, class): every dense decoder family the issue names, and two encoders
    ("llama", "LlamaForCausalLM"), ("mistral", "MistralForCausalLM"), ("qwen2", "Qwen2ForCausalLM"),
    ("qwen3", "Qwen3ForCausalLM"), ("gemma2", "Gemma2ForCausalLM"), ("gemma3_text", "Gemma3ForCausalLM"),
    ("phi3", "Phi3ForCausalLM"), ("gpt2", "GPT2LMHeadModel"), ("gpt_neox", "GPTNeoXForCausalLM"),
    ("opt", "OPTForCausalLM"), ("falcon", "FalconForCausalLM"),
    ("bert", "BertForMaskedLM"), ("roberta", "RobertaForMaskedLM"),
]
DECODERS = [c for c in DENSE if c[0] not in ("bert", "roberta")]


def ids(case):
    return case[0]


@pytest.mark.parametrize("ws", [2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("case", DENSE, ids=ids)
def test_same_logits_and_gradients(ranks, case, dtype, ws):
    for r in ranks(ws).run(sequence_cases.grad_case, *case, dtype):
        assert r["block1_tokens"] == [8 // ws], r  # the activations between blocks really are split
        assert r["logits_vs_full"] <= LOGIT_RTOL[dtype] and r["logits_vs_tp"] <= LOGIT_RTOL[dtype], r
        assert r["checked"] > 0 and r["grad_vs_full"] <= GRAD_RTOL[dtype], r
        assert r["grad_vs_tp"] <= GRAD_RTOL[dtype], r
