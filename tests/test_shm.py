"""The shared-memory fast path for CPU collectives (tpmap.engine.shm) on real gloo ranks of their own: exact
against gloo and the rank-order sum, several groups at once, a dead or hanging peer named within a bound,
ranks on (simulated) different hosts, the forced mode, and a segment that never has a name in /dev/shm.
Everything else in the suite runs on it too: the rank pools choose it automatically."""
from __future__ import annotations

import multiprocessing
import queue as queue_module
import socket

import pytest
import shm_cases
import torch

from tpmap.engine import shm

pytestmark = pytest.mark.skipif(shm._local_obstacle() is not None, reason=f"{shm._local_obstacle()}")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(scenario: str, ws: int, env: dict | None = None, *, timeout: float = 120, expect: int | None = None) -> dict:
    """Start `ws` fresh processes running shm_cases.<scenario>; {rank: (status, result)} of those that answered
    (`expect`: how many will; default all)."""
    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    port = _port()
    procs = [ctx.Process(target=shm_cases.main, args=(r, ws, port, scenario, env or {}, q), daemon=True)
             for r in range(ws)]
    for p in procs:
        p.start()
    out = {}
    try:
        for _ in range(ws if expect is None else expect):
            rank, status, result = q.get(timeout=timeout)
            out[rank] = (status, result)
    except queue_module.Empty:
        pytest.fail(f"{scenario}: only ranks {sorted(out)} answered within {timeout} s: {out}")
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return out


def _ok(out: dict) -> list:
    assert all(status == "ok" for status, _ in out.values()), out
    return [out[r][1] for r in sorted(out)]


@pytest.mark.parametrize("ws", [2, 3, 4])
def test_collectives_equal_gloo_and_the_rank_order_sum(ws):
    # 4 KiB slots: the 7001-element tensors go in many chunks, reduce-scatter in chunks of every row
    results = _ok(run("exact", ws, {"TPMAP_SHM_SLOT_BYTES": "4096"}))
    assert all(r["chosen"] for r in results)
    assert all(r["bad"] == [] for r in results), [r["bad"] for r in results]


def test_several_groups_at_once_each_with_its_own_segment():
    results = _ok(run("groups", 4))
    assert all(r["bad"] == [] for r in results), results
    assert all(r["world"] == [4.0, 4.0, 4.0] for r in results)
    assert all(-1 not in r["handles"] and r["handles"][0] != r["handles"][1] for r in results)


def test_a_dead_peer_is_named_at_once_not_a_hang():
    out = run("dead_peer", 3, {"TPMAP_SHM_TIMEOUT": "60"}, expect=2)
    for rank in (0, 1):
        status, result = out[rank]
        assert status == "ok" and result["message"] is not None, out[rank]
        assert "rank 2 (pid" in result["message"] and "died" in result["message"]
        assert result["seconds"] < 5, result  # the pid check, not the 60 s timeout


def test_a_hanging_peer_is_named_after_the_timeout():
    out = run("hanging_peer", 2, {"TPMAP_SHM_TIMEOUT": "2"}, expect=1)
    status, result = out[0]
    assert status == "ok" and result["message"] is not None, out
    assert "ranks [1] did not reach a shared-memory collective within 2 s" in result["message"]
    assert 2 <= result["seconds"] < 10


def test_a_destroyed_group_is_not_kept_alive():
    results = _ok(run("released", 2, {"TPMAP_TEST_PORT2": str(_port())}))
    assert all(r["chosen"] and r["total"] == [2.0] * 8 for r in results), results
    assert not any(r["alive"] for r in results), results


def test_ranks_out_of_step_fail_on_every_rank():
    out = run("out_of_step", 2)
    for status, message in out.values():
        assert status == "ShmMismatchError" and "posted [12, 16] bytes" in message, out


def test_ranks_on_different_hosts_stay_on_gloo():
    results = _ok(run("mixed_hosts", 2))
    assert [r["chosen"] for r in results] == [False, False]
    assert all(r["total"] == [1.0, 1.0, 1.0] for r in results)


def test_forcing_it_where_it_cannot_run_says_why_on_every_rank():
    out = run("mixed_hosts", 2, {"TPMAP_SHM": "1"})
    for status, message in out.values():
        assert status == "ShmUnavailableError", out
        assert "TPMAP_SHM=1" in message and "different hosts" in message and "[1] on elsewhere" in message


def test_turned_off_and_bad_setting():
    assert [r["chosen"] for r in _ok(run("off", 2, {"TPMAP_SHM": "0"}))] == [False, False]
    out = run("off", 2, {"TPMAP_SHM": "maybe"})
    assert all(status == "ValueError" and "TPMAP_SHM='maybe'" in m for status, m in out.values()), out


def test_the_segment_is_a_memfd_with_no_name_in_dev_shm():
    results = _ok(run("segment", 2))
    assert all(r["chosen"] for r in results)
    assert all(r["maps"] == ["/memfd:tpmap-shm (deleted)"] for r in results), results  # mapped, never named
    assert all(r["new_in_dev_shm"] == [] for r in results)


@pytest.mark.parametrize("ws", [2, pytest.param(3, marks=pytest.mark.full)])
def test_a_model_computes_the_same_on_both_paths(ws):
    results = _ok(run("model_both_paths", ws, timeout=240))
    for r in results:
        assert r["chosen"] == (True, False)
        assert r["rel"] < 1e-5 and r["same_tokens"] and r["tokens_vs_unsharded"], r
        if ws == 2:  # a + b == b + a: the two paths give the same bits
            assert r["same_logits"] and r["grads_equal"], r
        else:  # rank order against gloo's ring order: rounding only
            assert r["grad_rel"] < 1e-4, r


def test_compiled_collectives_are_custom_ops():
    # the fake implementations give the shapes the graph is traced with
    x = torch.empty(6, 4, device="meta")
    assert torch.ops.tpmap.shm_all_gather(x, 0, 3).shape == (18, 4)
    assert torch.ops.tpmap.shm_reduce_scatter(x, 0, 3).shape == (2, 4)
    assert torch.ops.tpmap.shm_all_reduce(x, 0).shape == (6, 4)
