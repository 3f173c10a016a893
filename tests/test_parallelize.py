"""`tpmap.parallelize` from a plain process (no torchrun): its answers equal the unsharded model's, computed
in the same run, and every failure it promises to handle is made to happen: a bad call, a worker that
raises alone, dies or hangs, Ctrl-C in the driver, a driver that exits or is killed."""
from __future__ import annotations

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from parallelize_cases import (
    MASK,
    PROMPT,
    hang_in_forward_on,
    raise_in_forward_on,
    rank_and_query_rows,
    save_tiny_llama,
)
from transformers import TextStreamer

import tpmap
from tpmap.parallelize import wire

ROOT = Path(__file__).resolve().parents[1]
CASES = ROOT / "tests" / "parallelize_cases.py"
GENERATE = dict(attention_mask=MASK, max_new_tokens=12, do_sample=False)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    return path, save_tiny_llama(path)


@pytest.fixture(scope="module")
def handle(checkpoint):
    with tpmap.parallelize(checkpoint[0], 2, device="cpu") as model:
        yield model


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def _gone(pid: int) -> bool:
    """The process has exited (a zombie waiting for its reaper counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def _all_gone(pids, within: float) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if all(_gone(p) for p in pids):
            return True
        time.sleep(0.1)
    return all(_gone(p) for p in pids)


# -- default tier -----------------------------------------------------------------------------------
def test_generate_and_forward_equal_the_unsharded_model(checkpoint, handle):
    _, full = checkpoint
    assert handle.world_size == 2 and len(handle.pids) == 2
    assert not torch.distributed.is_initialized()  # the driver holds no process group (and no weights)
    assert all(getattr(handle.config, k) == getattr(full.config, k)
               for k in ("model_type", "vocab_size", "num_attention_heads", "num_key_value_heads", "hidden_size"))
    assert handle.generation_config.pad_token_id == 0
    tokens = handle.generate(PROMPT, **GENERATE)
    assert torch.equal(tokens, full.generate(PROMPT, **GENERATE))
    with torch.no_grad():
        want = full(input_ids=PROMPT, attention_mask=MASK, labels=PROMPT, output_hidden_states=True)
    got = handle(input_ids=PROMPT, attention_mask=MASK, labels=PROMPT, output_hidden_states=True)
    assert type(got) is type(want) and got.cache is None
    assert _relative(got.logits, want.logits) < 1e-5
    assert abs(float(got.loss) - float(want.loss)) < 1e-5 * abs(float(want.loss))
    assert max(_relative(g, w) for g, w in zip(got.hidden_states, want.hidden_states)) < 1e-5
    assert handle.last_call.overhead_s < 1.0  # the benchmark measures it properly
    assert 0 < handle.startup.plan_s < handle.startup.total_s


@pytest.mark.full  # 3 more workers
def test_an_uneven_world_size_generates_and_forwards_as_the_unsharded_model(checkpoint):
    """12 query and 2 KV heads at 3 workers: rank 1's query heads read both KV heads (8|16|8 rows of k_proj)."""
    _, full = checkpoint
    from tpmap.checkpoint.load import plan_checkpoint

    assert plan_checkpoint(checkpoint[0], 3).uneven  # the case really is uneven
    with tpmap.parallelize(checkpoint[0], 3, device="cpu") as model:
        assert torch.equal(model.generate(PROMPT, **GENERATE), full.generate(PROMPT, **GENERATE))
        with torch.no_grad():
            want = full(input_ids=PROMPT, attention_mask=MASK)
        assert _relative(model(input_ids=PROMPT, attention_mask=MASK).logits, want.logits) < 1e-5


def test_a_bad_call_raises_in_the_driver_and_the_handle_keeps_working(checkpoint, handle):
    _, full = checkpoint
    bad = [
        (lambda: handle.generate(torch.tensor([[3, 256]]), max_new_tokens=2), tpmap.InvalidCallError,
         "id 256, outside the vocabulary [0, 256)"),
        (lambda: handle(input_idz=PROMPT), TypeError, "'input_idz' (did you mean input_ids?)"),
        (lambda: handle(input_ids=PROMPT, use_cache=True), tpmap.InvalidCallError, "use_cache=True"),
        (lambda: handle.generate(PROMPT, max_new_tokenz=3), ValueError, "max_new_tokenz"),  # transformers' own
        # raised alike on every worker after the forward's collectives: still in step
        (lambda: handle(input_ids=PROMPT, labels=torch.full_like(PROMPT, 300)), IndexError, "out of bounds"),
        (lambda: handle.generate(PROMPT, logits_processor=lambda ids, scores: scores), TypeError, "cannot be sent"),
    ]
    for call, error, message in bad:
        start = time.monotonic()
        with pytest.raises(error, match=None) as info:
            call()
        assert time.monotonic() - start < 10, message
        assert message in str(info.value), str(info.value)
        if "cannot be sent" not in message:  # raised on the workers: their traceback is the cause
            assert isinstance(info.value.__cause__, tpmap.RemoteTraceback)
            assert "Traceback (most recent call last)" in str(info.value.__cause__)
        assert handle.broken is None
    assert torch.equal(handle.generate(PROMPT, **GENERATE), full.generate(PROMPT, **GENERATE))


def test_run_answers_in_rank_order(checkpoint, handle):
    """`run` returns one result per worker in rank order: result r is rank r's, by its rank and by its shard
    (rank r holds heads [6r, 6r + 6) of q_proj: rows [r * n, (r + 1) * n) of the unsharded weight)."""
    _, full = checkpoint
    whole = full.model.layers[0].self_attn.q_proj.weight  # [12 heads * head_dim, hidden]
    n = whole.shape[0] // 2
    results = handle.run(rank_and_query_rows)
    assert [rank for rank, _ in results] == [0, 1]
    for r, (_, rows) in enumerate(results):
        assert torch.equal(rows, whole[r * n:(r + 1) * n]), f"result {r} is not rank {r}'s shard"


def test_streaming_to_a_text_streamer_and_as_an_iterator(checkpoint, handle):
    _, full = checkpoint
    prompt, kwargs = PROMPT[:1], dict(max_new_tokens=6, do_sample=False)
    want = full.generate(prompt, **kwargs)[0, prompt.shape[1]:].tolist()
    assert [int(t) for t in handle.stream(prompt, **kwargs)] == want

    class Tokens:  # a tokenizer whose text is the ids, so the streamer's text can be checked exactly
        def decode(self, ids, **_):
            return "".join(f"<{int(i)}>" for i in ids)

    class Collect(TextStreamer):
        def on_finalized_text(self, text, stream_end=False):
            printed.append(text)

    printed: list[str] = []
    handle.generate(prompt, streamer=Collect(Tokens(), skip_prompt=True), **kwargs)
    assert "".join(printed) == "".join(f"<{i}>" for i in want)
    stream = handle.stream(prompt, **kwargs)
    assert int(next(stream)) == want[0]
    with pytest.raises(tpmap.HandleBusyError):
        handle.generate(prompt, **kwargs)
    stream.close()  # broken off: the call finishes in the workers, which stay in step
    assert handle.generate(prompt, **kwargs)[0, prompt.shape[1]:].tolist() == want

    class Failing(Collect):  # a driver-side streamer that fails mid-call: the call still ends in step
        def put(self, value):
            if len(printed) > 2:
                raise KeyError("the streamer's own bug")
            super().put(value)

    printed.clear()
    with pytest.raises(KeyError, match="own bug"):
        handle.generate(prompt, streamer=Failing(Tokens(), skip_prompt=True), **kwargs)
    assert handle.broken is None
    assert handle.generate(prompt, **kwargs)[0, prompt.shape[1]:].tolist() == want


def test_the_wire_carries_tensors_out_of_band():
    """Tensor bytes travel as frames of their own and come back equal: dtypes, empty, 0-d, strided, conj."""
    import multiprocessing.connection

    message = {"f": torch.randn(2, 3), "empty": torch.empty(0, 5), "scalar": torch.tensor(3.5),
               "bf16": torch.randn(4).bfloat16(), "bool": torch.tensor([True, False]), "t": torch.randn(3, 4).t(),
               "conj": torch.randn(2, dtype=torch.cfloat).conj(), "param": torch.nn.Parameter(torch.ones(2)),
               "nested": [torch.arange(3), ("x", 1)]}
    frames = wire.encode(message)
    # sizes, pickle, then one frame per tensor (a Parameter's data is a plain tensor), in bytes
    assert [f.nbytes for f in frames[2:]] == [24, 0, 4, 8, 2, 48, 16, 8, 24]
    here, there = multiprocessing.Pipe()
    wire.send(here, frames)
    got = wire.receive(there)
    for key, want in message.items():
        if key == "nested":
            assert torch.equal(got[key][0], want[0]) and got[key][1] == want[1]
        else:
            assert got[key].dtype == want.dtype and got[key].shape == want.shape
            assert torch.equal(got[key].resolve_conj(), want.detach().resolve_conj()), key


def test_a_world_size_the_mapping_cannot_serve_is_refused_before_any_worker_starts(checkpoint):
    before = multiprocessing.active_children()
    start = time.monotonic()
    with pytest.raises(tpmap.DivisibilityError, match="12"):  # 12 query heads over 13 ranks
        tpmap.parallelize(checkpoint[0], 13, device="cpu")
    assert multiprocessing.active_children() == before and time.monotonic() - start < 30
    with pytest.raises(TypeError, match="loss_parallel"):
        tpmap.parallelize(checkpoint[0], 2, device="cpu", loss_parallel=True)
    with pytest.raises(tpmap.ParallelizeError, match="cuda:r"):
        tpmap.parallelize(checkpoint[0], 2, device="cuda:1")


# -- full tier --------------------------------------------------------------------------------------
@pytest.mark.full
def test_an_encoder_decoder_generates_streams_and_forwards_as_the_unsharded_model(tmp_path):
    from tpmap import verify

    full = verify.build_model("t5", 0, "T5ForConditionalGeneration", init_std=0.2)
    full.generation_config.update(pad_token_id=0, decoder_start_token_id=0)
    full.save_pretrained(tmp_path)
    ids, kwargs = PROMPT[:1], dict(max_new_tokens=6, do_sample=False)
    with tpmap.parallelize(tmp_path, 2, device="cpu") as model:
        want = full.generate(ids, **kwargs)
        assert torch.equal(model.generate(ids, **kwargs), want)
        assert [int(t) for t in model.stream(ids, **kwargs)] == want[0, 1:].tolist()  # after the start token
        with torch.no_grad():
            logits = full(input_ids=ids, decoder_input_ids=want[:, :4]).logits
        assert _relative(model(input_ids=ids, decoder_input_ids=want[:, :4]).logits, logits) < 1e-5


@pytest.mark.full
def test_a_closed_handle_refuses_calls_and_a_second_close(checkpoint):
    model = tpmap.parallelize(checkpoint[0], 1, device="cpu")
    pids = model.pids
    assert torch.equal(model.generate(PROMPT, **GENERATE), checkpoint[1].generate(PROMPT, **GENERATE))
    model.close()
    assert _all_gone(pids, within=10) and model.pids == []
    start = time.monotonic()
    with pytest.raises(tpmap.HandleClosedError, match="closed"):
        model.generate(PROMPT, max_new_tokens=1)
    with pytest.raises(tpmap.HandleClosedError, match="already"):
        model.close()
    assert time.monotonic() - start < 1


@pytest.mark.full
def test_a_worker_raising_alone_stops_every_worker_with_its_traceback(checkpoint):
    with tpmap.parallelize(checkpoint[0], 2, device="cpu", timeout=5) as model:
        pids = model.pids
        model.run(raise_in_forward_on, 1)
        with pytest.raises(tpmap.RankFailure) as info:
            model.generate(PROMPT, **GENERATE)
        assert "deliberate failure in rank 1's forward" in info.value.per_rank[1]
        assert "Traceback (most recent call last)" in info.value.per_rank[1]
        assert "no answer" in info.value.per_rank[0] or "Timed out" in info.value.per_rank[0]
        assert _all_gone(pids, within=10)
        assert "deliberate failure" in model.broken
        with pytest.raises(tpmap.HandleClosedError, match="stopped after a failure"):
            model(input_ids=PROMPT)


@pytest.mark.full
def test_a_killed_worker_is_detected_at_once(checkpoint):
    with tpmap.parallelize(checkpoint[0], 2, device="cpu") as model:
        pids = model.pids
        os.kill(pids[1], signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(tpmap.RankFailure) as info:
            model.generate(PROMPT, **GENERATE)
        assert time.monotonic() - start < 15
        assert info.value.per_rank[1] == f"process died (exit code {-signal.SIGKILL})"
        assert _all_gone(pids, within=10) and "process died" in model.broken


@pytest.mark.full
def test_a_hanging_worker_is_detected_within_the_timeout(checkpoint):
    with tpmap.parallelize(checkpoint[0], 2, device="cpu", timeout=5) as model:
        pids = model.pids
        model.run(hang_in_forward_on, 1)
        start = time.monotonic()
        with pytest.raises(tpmap.RankFailure) as info:
            model.generate(PROMPT, **GENERATE)
        assert time.monotonic() - start < 5 + 5 + 10  # the collective timeout, the grace, slack for a busy machine
        assert "no answer" in info.value.per_rank[1] and "hung" in info.value.per_rank[1]
        assert _all_gone(pids, within=10)


def _interruptible() -> None:
    """Ctrl-C as at a terminal: a job started in the background of a non-interactive shell (`cmd &`, how a CI
    script may run pytest) inherits SIGINT ignored, and Python then installs no KeyboardInterrupt handler."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _driver(path, mode: str) -> tuple[subprocess.Popen, dict]:
    proc = subprocess.Popen([sys.executable, str(CASES), str(path), mode], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, preexec_fn=_interruptible)
    line = proc.stdout.readline()
    assert line, proc.communicate()[1]
    return proc, json.loads(line)


@pytest.mark.full
@pytest.mark.parametrize("mode", ["ctrl-c", "ctrl-c-other-thread"])
def test_ctrl_c_in_the_driver_stops_the_workers(checkpoint, mode):
    """Also when the signal lands on another thread of the driver (what CI's failures were: the main thread stayed
    in an unbounded wait for the workers, never running Python's handler)."""
    proc, started = _driver(checkpoint[0], mode)
    try:
        assert proc.stdout.readline() == "calling\n"
        time.sleep(1.0)  # inside generate: 200 forwards of 0.5 s each
        proc.send_signal(signal.SIGINT)
        try:
            out, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:  # hung (seen twice in CI under load, never alone): say where
            proc.send_signal(signal.SIGUSR1)
            time.sleep(2)
            proc.kill()
            out, err = proc.communicate()
            pytest.fail(f"the driver did not finish within 30 s of Ctrl-C; its output: {out!r}; its stacks:\n"
                        f"{err[-6000:]}")
    finally:
        proc.kill()
    report, after = (json.loads(line) for line in out.splitlines())
    assert report["interrupted"] and "KeyboardInterrupt" in report["broken"] and report["workers_left"] == []
    assert "stopped after a failure" in after["after"]
    assert _all_gone(started["workers"], within=5), err


@pytest.mark.full
@pytest.mark.parametrize("mode", ["kill", "exit"])
def test_a_driver_that_is_killed_or_exits_leaves_no_workers(checkpoint, mode):
    proc, started = _driver(checkpoint[0], mode)
    try:
        if mode == "kill":
            proc.send_signal(signal.SIGKILL)  # no cleanup runs in the driver: the workers watch their parent
        proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert _all_gone(started["workers"], within=10)


@pytest.mark.full
def test_the_chat_example_runs_from_a_plain_process_and_matches_the_unsharded_model():
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "chat.py"), "--prompt", "Hello", "--new-tokens", "8",
                           "--check", "--device", "cpu"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "matches the unsharded model: True" in proc.stdout and "ready in" in proc.stderr
