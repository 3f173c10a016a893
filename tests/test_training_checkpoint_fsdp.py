"""Training checkpoints (tpmap.training) of FSDP2 runs on 4 real gloo ranks: fully_shard over the dp dimension of
a (dp 2, tp 2) mesh, tpmap over tp. Each rank writes its dp chunk of its tp-local tensors into its tp rank's file
(the format of a DDP run), and a load reads only the rows a rank holds.

* Same shape: a run stopped at step 2 and resumed equals the uninterrupted run bit for bit (losses, every rank's
  chunk of every tensor and of AdamW's state, LR; fp32 and fp64; attention dropout 0.1 through the restored RNG;
  fully_shard on the whole model or on each block; LoRA), and a resumed rank reads no more bytes than it holds.
* Another shape: FSDP2 dp 2 x tp 2 -> tp 4 or -> DDP dp 2 x tp 2, and DDP dp 2 x tp 2, tp 2 or tp 4 -> FSDP2
  dp 2 x tp 2, within the bounds of tests/test_training_checkpoint.py's resharding (fp64, 1e-12).

The vocabulary has 254 rows: 127 per tp rank, so FSDP2 splits the embedding, the LM head and their AdamW state
into dp chunks of 64 and 63 rows and pads the second; a chunk written at a wrong row offset or with its padding
would shift or overwrite rows of the file. Planted once each, the default-tier case failed: a chunk written one row
late, or read one row early (the losses after the resume differ, or are nan); FSDP2's padded chunk (64 rows) written
as data (the losses differ); a load that reads the whole tp-local tensor and keeps its rows (1.22 MB read, 0.61 MB
held).
"""
from __future__ import annotations

import pytest
import training_checkpoint_fsdp_cases as cases
from test_training_checkpoint import RESHARD_LOSS_RTOL, RESHARD_PARAM_ATOL

SAME_SHAPE = [  # (model, dtype, wrap, lora); the first runs in the default tier
    ("llama", "float32", "fsdp_blocks", False),
    ("llama", "float64", "fsdp_blocks", False),
    ("llama", "float32", "fsdp", False),
    ("llama", "float64", "fsdp", False),
    ("llama", "float64", "fsdp", True),
    ("gpt2", "float64", "fsdp_blocks", False),  # tied LM head, a padded vocabulary row inside a dp chunk
]


@pytest.mark.parametrize("model,dtype,wrap,lora", [pytest.param(*c, marks=[pytest.mark.full] if i else [])
                                                   for i, c in enumerate(SAME_SHAPE)],
                         ids=[f"{m}-{d}-{w}" + "-lora" * lora for m, d, w, lora in SAME_SHAPE])
def test_fsdp_resume_at_the_same_shape_is_bit_for_bit(ranks, tmp_path, model, dtype, wrap, lora):
    if lora:
        pytest.importorskip("peft")
    spec = {"model": model, "dp": 2, "wrap": wrap, "dtype": dtype, "dropout": 0.1, "stop": 4, "save_at": 2,
            "lora": lora}
    results = ranks(4).run(cases.same_shape_case, spec, str(tmp_path / "ckpt"), timeout=300)
    for r in results:
        assert r["steps"] == [2, 3], r["steps"]
        assert r["losses_a"] == r["losses_b"], (r["losses_a"], r["losses_b"])  # exact
        assert r["local_same"] and r["optim_same"] and r["lr_same"], r
        assert r["optim_entries"] > 0
        if model == "llama":  # only this rank's rows (GPT-2's fused c_attn: the Reader reads whole rows of a block)
            assert 0 < r["read"]["bytes"] <= r["read"]["held"], r["read"]
    if model == "llama" and not lora:  # dp rank 1 holds 63 of the 127 vocabulary rows (FSDP2 pads it to 64)
        assert [r["uneven"] for r in results[2:]] == [[(63, 96)]] * 2, [r["uneven"] for r in results]


RESHARD = [  # (model, (ranks, dp, wrap) saved, (ranks, dp, wrap) resumed)
    ("llama", (4, 2, "fsdp_blocks"), (4, 1, None)),
    ("llama", (4, 2, "fsdp"), (4, 2, "ddp")),
    ("llama", (4, 2, "ddp"), (4, 2, "fsdp_blocks")),
    ("llama", (2, 1, None), (4, 2, "fsdp")),
    ("llama", (4, 1, None), (4, 2, "fsdp_blocks")),
    # GPT-2: Conv1D, a Row's bias (whole on every rank), a padded vocabulary. Not to another tp size: its key bias
    # has a gradient zero in exact arithmetic, whose rounding noise AdamW turns into 5.6e-12 (DDP -> tp 4 as well)
    ("gpt2", (4, 2, "fsdp_blocks"), (4, 2, "ddp")),
]


@pytest.mark.full  # 4 ranks, two runs each
@pytest.mark.parametrize("model,before,after", RESHARD,
                         ids=[f"{m}-{n}" for m, n in zip([c[0] for c in RESHARD], ["fsdp-to-tp4", "fsdp-to-ddp",
                              "ddp-to-fsdp", "tp2-to-fsdp", "tp4-to-fsdp", "fsdp-to-ddp"], strict=True)])
def test_fsdp_resume_at_another_shape_within_the_summation_order(ranks, tmp_path, model, before, after):
    folder = str(tmp_path / "ckpt")
    spec = {"model": model, "dtype": "float64", "stop": 5, "save_at": 2}
    a = ranks(before[0]).run(cases.resume_case, {**spec, "dp": before[1], "wrap": before[2]}, folder, False,
                             timeout=300)[0]
    b = ranks(after[0]).run(cases.resume_case, {**spec, "dp": after[1], "wrap": after[2]}, folder, True,
                            timeout=300)[0]
    assert sorted(b["losses"]) == [2, 3, 4]
    loss = max(abs(b["losses"][s] - a["losses"][s]) / abs(a["losses"][s]) for s in b["losses"])
    assert a["full"].keys() == b["full"].keys()
    param = max((a["full"][k] - b["full"][k]).abs().max().item() for k in a["full"])
    print(f"reshard {before} -> {after}: loss rel {loss:.3g}, param abs {param:.3g}")
    assert loss <= RESHARD_LOSS_RTOL and param <= RESHARD_PARAM_ATOL, (loss, param)


@pytest.mark.full  # 4 ranks
def test_fsdp_models_it_cannot_save_are_refused_on_every_rank(ranks, tmp_path):
    words = {"other_group": "pass as dp_group the mesh dimension", "tp_group": "pass as dp_group the mesh dimension",
             "shard_dim": "Shard(0) over the 1-D data-parallel mesh"}
    for r in ranks(4).run(cases.refusal_case, str(tmp_path / "ckpt"), timeout=300):
        assert set(r) == set(words)
        for kind, result in r.items():
            assert result["error"] == "TrainingCheckpointError" and words[kind] in result["message"], (kind, result)
