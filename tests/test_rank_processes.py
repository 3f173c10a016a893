"""The rank pool and `tpmap verify` report crashes and hangs instead of hanging."""
from __future__ import annotations

import subprocess
import sys
import time

import pytest
import rank_cases
import torch
from helpers import edited_copy

from tpmap.parallelize.rank_processes import RankFailure


def test_a_crashing_rank_is_reported_with_its_traceback(ranks):
    pool = ranks(2)
    with pytest.raises(RankFailure) as e:
        pool.run(rank_cases.crash_on_rank, 1, timeout=60)
    assert "deliberate failure on rank 1" in str(e.value) and "--- rank 1 ---" in str(e.value)
    assert e.value.per_rank[0] == "finished"
    assert pool.run(rank_cases.rank_and_size) == [(0, 2), (1, 2)]  # the pool starts afresh


@pytest.mark.full  # 3 ranks
def test_a_hanging_rank_is_reported_within_the_timeout(ranks):
    pool = ranks(3)
    t0 = time.monotonic()
    with pytest.raises(RankFailure) as e:
        pool.run(rank_cases.hang_unless_rank0, timeout=5)
    assert time.monotonic() - t0 < 30
    assert "no answer within 5 s" in e.value.per_rank[1]
    assert pool.run(rank_cases.rank_and_size) == [(0, 3), (1, 3), (2, 3)]


def test_gather_output_restores_the_feature_order(ranks):
    assert max(ranks(2).run(rank_cases.gather_output_case)) < 1e-5


def _verify_cli(*args, timeout=240):
    return subprocess.run([sys.executable, "-m", "tpmap", "verify", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_verify_cli_fails_on_a_wrong_mapping(tmp_path):
    path = edited_copy(tmp_path, "neox_wrong", "gpt_neox", "    heads: num_attention_heads\n  - kind: Row",
                       "    combined_qkv: true\n  - kind: Row")
    proc = _verify_cli(str(path), "-n", "2")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "FAIL" in proc.stdout and "0 passed, 1 failed" in proc.stdout


def test_verify_cli_passes_and_prints_the_table():
    proc = _verify_cli("gpt2", "-n", "1", "-n", "2")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "GPT2LMHeadModel" in proc.stdout and "2 passed, 0 failed" in proc.stdout


def test_verify_cli_rejects_unknown_model_types():
    proc = _verify_cli("not_a_model")
    assert proc.returncode == 2
    assert "no tpmap mapping for model_type 'not_a_model'. Nearest shipped types:" in proc.stderr


def _meta(ref: str, index: int = 0, class_name: str | None = None):
    import torch
    import transformers

    from tpmap import verify

    spec = verify.resolve(ref).mapping.verify[index]
    with torch.device("meta"):
        return getattr(transformers, class_name or spec.models[0])(verify.tiny_config(ref, index))


def test_example_inputs_follow_the_model_class():
    """input_ids + attention_mask for a token model, decoder_input_ids for an encoder-decoder, and a
    declared main input for any other (Whisper's input_features, batch x mel bins x 2 * positions)."""
    import torch

    from tpmap import verify

    llama = verify.case_inputs("llama", 0, _meta("llama"))
    assert {k: tuple(v.shape) for k, v in llama.items()} == {"input_ids": (2, 10), "attention_mask": (2, 10)}
    assert llama["attention_mask"][1].tolist() == [1] * 7 + [0] * 3
    t5 = verify.case_inputs("t5", 0, _meta("t5"))
    assert {k: tuple(v.shape) for k, v in t5.items()} == {"input_ids": (2, 10), "attention_mask": (2, 10),
                                                          "decoder_input_ids": (2, 6)}
    for cls in ("WhisperForConditionalGeneration", "WhisperModel"):
        whisper = verify.case_inputs("whisper", 0, _meta("whisper", 0, cls))
        assert {k: tuple(v.shape) for k, v in whisper.items()} == {"input_features": (2, 8, 16),
                                                                   "decoder_input_ids": (2, 6)}
        assert whisper["input_features"].dtype == torch.float32 and whisper["decoder_input_ids"].min() >= 3


@pytest.mark.parametrize("ref", ["llama", "gpt2", "bert", "t5", "mixtral", "fsmt", "albert"])
def test_example_ids_hold_every_vocabulary_shard_boundary(ref):
    """Every rank's first and last vocabulary row at every world size the mapping verifies, and V - 1, among
    the unpadded ids of each ids input (encoder and decoder), special ids excepted; and a seed per mapping."""
    from tpmap import verify

    mapping = verify.resolve(ref).mapping
    sizes = {ws for spec in mapping.verify for ws in spec.world_sizes if ws > 1}
    for index, spec in enumerate(mapping.verify):
        model = _meta(ref, index)
        inputs = verify.case_inputs(ref, index, model)
        special = {v for k, v in model.config.to_dict().items() if k.endswith("_token_id") and isinstance(v, int)}
        for name, embedding in (("input_ids", model.get_input_embeddings()),
                                ("decoder_input_ids", getattr(model.get_decoder(), "embed_tokens", None))):
            if name not in inputs:
                continue
            rows = embedding.num_embeddings
            want = {rows - 1}
            for ws in sizes:
                per = -(-rows // ws)
                want |= {x for r in range(ws) if r * per < rows for x in (r * per, min((r + 1) * per, rows) - 1)}
            want = {x for x in want if x >= 3} - special
            ids = inputs[name] if name != "input_ids" else inputs[name][inputs["attention_mask"] == 1]
            assert want <= set(ids.reshape(-1).tolist()), (ref, spec.name, name, sorted(want - set(ids.tolist())))
    assert not torch.equal(verify.case_inputs("llama", 0, _meta("llama"))["input_ids"],
                           verify.case_inputs("mistral", 0, _meta("mistral"))["input_ids"])


def test_an_undeclared_main_input_is_a_located_error(tmp_path):
    from tpmap import verify
    from tpmap.language.errors import MappingError

    declared = ("    inputs:\n"
                "      input_features: {shape: [batch, num_mel_bins, 2 * max_source_positions], kind: float}\n")
    path = edited_copy(tmp_path, "whisper", "whisper", declared, "")
    with pytest.raises(MappingError) as e:
        verify.case_inputs(str(path), 0, _meta("whisper"))
    line = path.read_text().splitlines().index(next(x for x in path.read_text().splitlines()
                                                    if x.startswith("  - name: mha12"))) + 1
    assert str(e.value).startswith(f"{path}:{line}:5: verify config 'mha12': "), str(e.value)
    assert "main input is 'input_features'" in str(e.value) and "declare it in the verify config" in str(e.value)
    assert e.value.rule == "missing-key"


@pytest.mark.full  # a verify subprocess starting its own ranks
def test_verify_cli_runs_whisper_from_its_input_features():
    """Whisper needs input_features; verify used to feed input_ids only and report a mapping failure."""
    proc = _verify_cli("whisper", "-n", "2")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "WhisperForConditionalGeneration" in proc.stdout and "3 passed, 0 failed" in proc.stdout
