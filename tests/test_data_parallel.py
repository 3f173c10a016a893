"""Data parallel x tensor parallel on 4 real gloo ranks: a (dp=2, tp=2) DeviceMesh, tpmap on the tp
dimension, DDP over the dp dimension, each replica on its half of a batch. One training step must equal
one step of the unsharded model on the whole batch (built on every rank, same run): every rank's shard
of every parameter *update* against the same slice of the unsharded update, relative to the largest
element of that update.

Bounds (measured on this machine in brackets):
* fp64 with the loss computed in fp64 ("exact"), SGD: 1e-10 [<= 4e-14]. transformers' own loss upcasts
  logits to float32 whatever the dtype, hence the "exact" loss for the tight cases.
* fp64 AdamW: 1e-6 [gpt2 1.2e-8, llama 1e-11]: AdamW divides each gradient element by its magnitude, so
  GPT-2's key bias, whose gradient is zero in exact arithmetic and pure rounding noise, moves by noise.
* Mixtral fp64: 1e-5 [1.4e-7 to 1.4e-6 depending on the batch]: its router's softmax runs in float32
  whatever the dtype.
* fp32 (transformers' loss or loss_parallel), SGD: 1e-4 [1.7e-5]: sharding and the batch split reorder
  float sums.
A wrong group (DDP over every rank, or tpmap over the default group) is off by O(1). FSDP2
(`fully_shard` over the dp mesh) instead of DDP: the same bounds, over two steps.
"""
from __future__ import annotations

import data_parallel_cases
import pytest

pytestmark = pytest.mark.full  # 4 ranks per test

KV1 = {"num_key_value_heads": 1}  # one KV head at tp 2: replicated, its gradient summed over the tp group
QKLN_KV3 = {"num_key_value_heads": 3}  # StableLM's per-KV-head norms (a ModuleList): KV head 1 on both tp ranks

STEP_CASES = [  # (model_type, class, config overrides, optimizer, dtype, loss, bound)
    ("llama", "LlamaForCausalLM", KV1, "sgd", "float64", "exact", 1e-10),
    ("llama", "LlamaForCausalLM", KV1, "adamw", "float64", "exact", 1e-6),
    ("llama", "LlamaForCausalLM", KV1, "sgd", "float32", "labels", 1e-4),
    ("gpt2", "GPT2LMHeadModel", {}, "sgd", "float64", "exact", 1e-10),
    ("gpt2", "GPT2LMHeadModel", {}, "adamw", "float64", "exact", 1e-6),
    ("gpt2", "GPT2LMHeadModel", {}, "sgd", "float32", "loss_parallel", 1e-4),
    ("qwen3", "Qwen3ForCausalLM", {}, "sgd", "float64", "exact", 1e-10),  # grad_allreduce q/k norms
    ("mixtral", "MixtralForCausalLM", KV1, "sgd", "float64", "exact", 1e-5),  # Param experts + Reduce
    ("mixtral:experts=parallel", "MixtralForCausalLM", KV1, "sgd", "float64", "exact", 1e-10),  # whole experts
    ("stablelm", "StableLmForCausalLM", QKLN_KV3, "sgd", "float64", "exact", 1e-10),  # norms on two tp ranks
]


@pytest.mark.parametrize("model_type,class_name,overrides,optimizer,dtype,loss,bound", STEP_CASES,
                         ids=[f"{c[0]}-{c[3]}-{c[4]}-{c[5]}" for c in STEP_CASES])
def test_ddp_over_dp_of_tpmap_over_tp_equals_one_unsharded_step(ranks, model_type, class_name, overrides,
                                                                optimizer, dtype, loss, bound):
    results = ranks(4).run(data_parallel_cases.dp_tp_step_case, model_type, class_name, overrides, optimizer, dtype,
                           loss)
    assert [(r["dp"], r["tp"]) for r in results] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for r in results:
        assert r["params"] > 0
        assert r["worst_rel"] < bound, r
        assert r["loss_diff"] < (1e-12 if loss == "exact" else 1e-5), r  # mean of the halves' losses


FSDP_CASES = [  # FSDP2 over dp: the whole model as one unit ("fsdp") or each block, then the rest
    ("llama", "LlamaForCausalLM", KV1, "sgd", "float64", "exact", "fsdp", 1e-10),
    ("llama", "LlamaForCausalLM", KV1, "sgd", "float64", "exact", "fsdp_blocks", 1e-10),
    ("qwen3", "Qwen3ForCausalLM", {}, "adamw", "float64", "exact", "fsdp_blocks", 1e-6),
    ("gpt2", "GPT2LMHeadModel", {}, "sgd", "float32", "loss_parallel", "fsdp_blocks", 1e-4),
    ("mixtral", "MixtralForCausalLM", KV1, "sgd", "float64", "exact", "fsdp", 1e-5),
    ("gpt_oss", "GptOssForCausalLM", {}, "sgd", "float64", "exact", "fsdp", 1e-10),  # partial expert bias
    ("mixtral:experts=parallel", "MixtralForCausalLM", KV1, "sgd", "float64", "exact", "fsdp_blocks", 1e-10),
    ("stablelm", "StableLmForCausalLM", QKLN_KV3, "sgd", "float64", "exact", "fsdp_blocks", 1e-10),
]


@pytest.mark.parametrize("model_type,class_name,overrides,optimizer,dtype,loss,wrap,bound", FSDP_CASES,
                         ids=[f"{c[0]}-{c[3]}-{c[4]}-{c[6]}" for c in FSDP_CASES])
def test_fsdp2_over_dp_of_tpmap_over_tp_equals_unsharded_steps(ranks, model_type, class_name, overrides,
                                                               optimizer, dtype, loss, wrap, bound):
    """fully_shard swaps every parameter for a DTensor (and an unsharded one in forward): tpmap's gradient
    hooks (replicated KV heads, grad_allreduce norms) must follow, or those gradients are wrong by O(1).
    Two steps: the hooks hold on the parameters FSDP2 uses the second time too."""
    results = ranks(4).run(data_parallel_cases.dp_tp_step_case, model_type, class_name, overrides, optimizer, dtype,
                           loss,
                           wrap, 2)
    for r in results:
        assert r["worst_rel"] < bound, r


def test_apply_takes_the_tp_dimension_of_a_mesh_and_remembers_its_group(ranks):
    for r in ranks(4).run(data_parallel_cases.mesh_group_case):
        assert r["tp_size"] == 2
        assert r["same_state"]  # full_state_dict without group= gathers over the tp group, not every rank
        assert r["errors"]["2d"][0] == "ProcessGroupError" and "group=mesh['tp']" in r["errors"]["2d"][1]
        assert r["errors"]["int"][0] == "ProcessGroupError" and "not int" in r["errors"]["int"][1]


def test_one_data_parallel_replica_saves_a_standard_checkpoint(ranks, tmp_path):
    assert all(r["same"] for r in ranks(4).run(data_parallel_cases.dp_save_case, str(tmp_path / "out")))


def test_data_parallel_replicas_generate_their_own_prompts(ranks):
    results = ranks(4).run(data_parallel_cases.dp_generate_case)
    assert all(r["same"] for r in results)
    assert results[0]["tokens"] == results[1]["tokens"] != results[2]["tokens"] == results[3]["tokens"]
