"""The opt-in symmetric-memory all-reduce for CUDA tensors (tpmap.engine.symm_mem). Its kernel needs GPUs
(benchmarks/gpu_check.py --symm-mem measures it there); what CPU ranks can prove: the switch's parsing, the
reasons it gives where it cannot run, and that CPU collectives ignore it."""
from __future__ import annotations

import pytest
from test_shm import _ok, run

from tpmap.engine import symm_mem


def test_the_switch_is_off_by_default_and_parsed(monkeypatch):
    monkeypatch.delenv("TPMAP_SYMM_MEM", raising=False)
    assert symm_mem.enabled() is False
    monkeypatch.setenv("TPMAP_SYMM_MEM", "1")
    assert symm_mem.enabled() is True
    monkeypatch.setenv("TPMAP_SYMM_MEM", "maybe")
    with pytest.raises(ValueError, match="TPMAP_SYMM_MEM='maybe': use 1"):
        symm_mem.enabled()
    monkeypatch.setenv("TPMAP_SYMM_MEM_MAX_BYTES", "lots")
    with pytest.raises(ValueError, match="TPMAP_SYMM_MEM_MAX_BYTES='lots': a positive number of bytes"):
        symm_mem.max_bytes()


def test_the_reasons_it_cannot_run():
    assert "backend is 'gloo'" in symm_mem.obstacle("gloo", True)
    assert "no symm_mem ops" in symm_mem.obstacle("nccl", False)
    assert symm_mem.obstacle("nccl", True) is None


def test_forced_on_a_gloo_group_it_refuses_and_cpu_collectives_ignore_it():
    results = _ok(run("symm_mem_switch", 2, {"TPMAP_SYMM_MEM": "1"}))
    for r in results:
        assert r["sum_ok"], r
        assert r["refused"] is not None and "TPMAP_SYMM_MEM=1" in r["refused"], r
        assert "ranks [0, 1]" in r["refused"] and "backend is 'gloo'" in r["refused"], r
