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


@pytest.mark.parametrize("ws", [2, 4])
@pytest.mark.parametrize("case", DECODERS, ids=ids)
def test_same_greedy_tokens(ranks, case, ws):
    """Prompt 8: the prefill runs split (8 / ws tokens between blocks), the decode steps (T = 1) as plain TP."""
    for r in ranks(ws).run(sequence_cases.generate_case, *case):
        assert r["same_as_full"] and r["same_as_tp"], r
        assert r["block1_tokens"] == [8 // ws, 1, 1], r


@pytest.mark.parametrize("ws", [2, 4])
@pytest.mark.parametrize("case", [("llama", "LlamaForCausalLM"), ("bert", "BertForMaskedLM")], ids=ids)
def test_length_not_divisible_runs_as_plain_tp(ranks, case, ws):
    for r in ranks(ws).run(sequence_cases.grad_case, *case, torch.float32, 7):
        assert r["block1_tokens"] == [7], r  # not split
        assert r["logits_vs_tp"] == 0.0 and r["grad_vs_full"] <= GRAD_RTOL[torch.float32], r


@pytest.mark.parametrize("case", [("llama", "LlamaForCausalLM"), ("gpt2", "GPT2LMHeadModel"),
                                  ("opt", "OPTForCausalLM")], ids=ids)
def test_train_mode_and_checkpointing_keep_gradients_exact(ranks, case):
    """fp64, world size 4, dropout 0: the dropout-region hooks and recomputed blocks (gradient checkpointing:
    the split and the gathers run again in backward) change nothing."""
    for r in ranks(4).run(sequence_cases.grad_case, *case, torch.float64, 8, True, True):
        assert r["block1_tokens"] == [2], r
        assert r["grad_vs_full"] <= GRAD_RTOL[torch.float64] and r["grad_vs_tp"] <= GRAD_RTOL[torch.float64], r


def test_dropout_masks_per_rank_and_replayed(ranks):
    case = ("bert", "BertForMaskedLM", "bert.encoder.layer.0.attention.output.dropout")  # after a Row: split
    for r in ranks(2).run(sequence_cases.dropout_case, *case):
        assert r["mask_shape"][1] == 4, r  # this rank's 8 / 2 tokens
        assert r["ranks_agree_False"] and r["ranks_agree_True"], r
        assert r["dropout_changed_output_False"] and r["masks_differ"], r
        assert r["checkpointing_same_grads"] == 0.0, r


@pytest.mark.parametrize("case", [("llama", "LlamaForCausalLM"), ("opt", "OPTForCausalLM"),
                                  ("bert", "BertModel")], ids=ids)
def test_collectives_trade_all_reduce_for_reduce_scatter_and_all_gather(ranks, case):
    layers = verify.tiny_config(case[0]).num_hidden_layers
    for r in ranks(2).run(sequence_cases.collectives_case, *case):
        tp, sp = r["tp"], r["sp"]
        assert sp.get("reduce_scatter_tensor") == 2 * layers, r  # each block's two Rows
        assert sp.get("all_gather_into_tensor") == 2 * layers + 1, r  # each block's two Column parents + the end
        assert sp.get("all_reduce", 0) == tp["all_reduce"] - 2 * layers, r  # the vocabulary-parallel embedding


def test_mixing_split_and_unsplit_forwards_in_one_backward_raises(ranks):
    for r in ranks(2).run(sequence_cases.mixed_backward_case, "llama", "LlamaForCausalLM"):
        assert r["error"] is not None and "with and without sequence parallelism" in r["message"], r


@pytest.mark.parametrize("case, words", [
    (("t5", "T5ForConditionalGeneration"), "2 stacks of repeated blocks"),
    (("mixtral", "MixtralForCausalLM"), "model.layers.0.mlp.gate"),
    (("qwen3_moe", "Qwen3MoeForCausalLM"), "Reduce"),
    (("mamba", "MambaForCausalLM"), "backbone.layers.0.mixer"),
], ids=lambda c: c[0] if isinstance(c, tuple) else "")
def test_refused_models_name_the_module_and_stay_untouched(ranks, case, words):
    for r in ranks(2).run(sequence_cases.refused_case, *case):
        assert r["error"] == "SequenceParallelError" and words in r["message"], r
        assert r["untouched"], r


def test_world_size_one_still_checks():
    model = verify.build_model("t5", 0, "T5ForConditionalGeneration")
    with pytest.raises(tpmap.SequenceParallelError, match="2 stacks"):
        tpmap.apply(model, 1, sequence_parallel=True)
