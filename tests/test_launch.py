"""The rank pool and `tpmap verify` report crashes and hangs instead of hanging."""
from __future__ import annotations

import subprocess
import sys
import time

import pytest

from tpmap import loader
from tpmap.launch import RankFailure

import rank_cases


def test_a_crashing_rank_is_reported_with_its_traceback(ranks):
    pool = ranks(2)
    with pytest.raises(RankFailure) as e:
        pool.run(rank_cases.crash_on_rank, 1, timeout=60)
    assert "deliberate failure on rank 1" in str(e.value) and "--- rank 1 ---" in str(e.value)
    assert e.value.per_rank[0] == "finished"
    assert pool.run(rank_cases.rank_and_size) == [(0, 2), (1, 2)]  # the pool starts afresh


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
    path = tmp_path / "neox_wrong.yaml"
    path.write_text(loader.shipped_files()["gpt_neox"].read_text().replace(
        "    heads: num_attention_heads\n  - kind: Row", "    combined_qkv: true\n  - kind: Row", 1))
    proc = _verify_cli(str(path), "-n", "2")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "FAIL" in proc.stdout and "0 passed, 1 failed" in proc.stdout


def test_verify_cli_passes_and_prints_the_table():
    proc = _verify_cli("gpt2", "-n", "1", "-n", "2")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "GPT2LMHeadModel" in proc.stdout and "2 passed, 0 failed" in proc.stdout


def test_verify_cli_rejects_unknown_model_types():
    proc = _verify_cli("not_a_model")
    assert proc.returncode == 2 and "supported: " in proc.stderr
