"""The examples run under torchrun on 2 CPU ranks, as a user would run them, and agree with 1 rank."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.full  # a torchrun job (new processes) per run


def torchrun(nproc: int, script: str, *args: str, timeout: float = 300) -> str:
    """Run an example under torchrun (--standalone picks a free port); kill its whole group on timeout."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           str(ROOT / "examples" / script), *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"torchrun {script} did not finish in {timeout} s\n{out}\n{err}")
    assert proc.returncode == 0, out + err
    return out


@pytest.mark.parametrize("extra", [[], ["--loss-parallel"]], ids=["gathered-logits", "loss-parallel"])
def test_train_example_matches_one_rank_and_saves_a_standard_checkpoint(tmp_path, extra):
    from transformers import AutoModelForCausalLM

    out2 = torchrun(2, "train.py", "--model-type", "llama", "--steps", "4", "--save", str(tmp_path / "tp2"), *extra)
    out1 = torchrun(1, "train.py", "--model-type", "llama", "--steps", "4", "--save", str(tmp_path / "tp1"))
    losses2 = [float(x) for x in re.findall(r"loss (\d+\.\d+)", out2)]
    losses1 = [float(x) for x in re.findall(r"loss (\d+\.\d+)", out1)]
    assert len(losses2) == 4 and losses2[-1] < losses2[0]  # it trains
    assert losses2 == pytest.approx(losses1, abs=2e-4)  # printed with 4 decimals
    tp2 = AutoModelForCausalLM.from_pretrained(tmp_path / "tp2").state_dict()
    tp1 = AutoModelForCausalLM.from_pretrained(tmp_path / "tp1").state_dict()
    assert tp2.keys() == tp1.keys()
    # fp32 AdamW turns rounding noise of near-zero gradient elements into parameter differences
    # (see test_training.py); 4 steps of lr 3e-3 move parameters by ~1.2e-2, measured difference 2e-4
    assert max((tp2[k] - tp1[k]).abs().max().item() for k in tp1) < 1e-3


def test_finetune_lora_example_matches_one_rank_and_saves_an_adapter_plain_peft_loads(tmp_path):
    """2 ranks train the same adapters as 1 (dropout 0, both from one fresh adapter that 2 ranks drew and saved);
    the saved folder is a standard, full-size adapter: plain PEFT on the unsharded base computes the loss that 2
    ranks continuing from it (--adapter) print."""
    pytest.importorskip("peft")
    import torch
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from tpmap.verify import tiny_config

    fresh = ("finetune_lora.py", "--model-type", "llama", "--steps", "0", "--dropout", "0", "--save")
    torchrun(2, *fresh, str(tmp_path / "init"))
    run = ("finetune_lora.py", "--model-type", "llama", "--adapter", str(tmp_path / "init"), "--steps", "4", "--save")
    out2 = torchrun(2, *run, str(tmp_path / "tp2"))
    out1 = torchrun(1, *run, str(tmp_path / "tp1"))
    losses2 = [float(x) for x in re.findall(r"loss (\d+\.\d+)", out2)]
    losses1 = [float(x) for x in re.findall(r"loss (\d+\.\d+)", out1)]
    assert len(losses2) == 4 and losses2[-1] < losses2[0]  # it trains
    assert losses2 == pytest.approx(losses1, abs=2e-4)  # printed with 4 decimals
    tp2 = load_file(tmp_path / "tp2" / "adapter_model.safetensors")
    tp1 = load_file(tmp_path / "tp1" / "adapter_model.safetensors")
    assert tp2.keys() == tp1.keys() and len(tp2) == 2 * 7 * tiny_config("llama").num_hidden_layers
    assert all(tp2[k].shape == tp1[k].shape for k in tp1)  # full size, whatever the world size
    assert max((tp2[k] - tp1[k]).abs().max().item() for k in tp1) < 1e-3  # AdamW on rounding noise
    # plain PEFT, unsharded, on the example's base and batch
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(tiny_config("llama"))
    batch = torch.randint(0, base.config.vocab_size, (4, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        plain = PeftModel.from_pretrained(base, tmp_path / "tp2")(input_ids=batch, labels=batch).loss.item()
    resumed = torchrun(2, "finetune_lora.py", "--model-type", "llama", "--steps", "1",
                       "--adapter", str(tmp_path / "tp2"))
    assert float(re.findall(r"loss (\d+\.\d+)", resumed)[0]) == pytest.approx(plain, abs=2e-4)
    assert plain < losses2[-1]  # the saved adapters are the trained ones, after the last step


def test_2d_example_dp2_tp2_matches_one_rank_and_saves_from_one_replica(tmp_path):
    """4 ranks as (dp 2, tp 2), each replica on half the batch, train like 1 rank on the whole batch."""
    from transformers import AutoModelForCausalLM

    args = ("--model-type", "llama", "--steps", "3", "--batch", "4", "--seq", "16")
    out4 = torchrun(4, "train_2d.py", "--dp", "2", "--tp", "2", *args, "--save", str(tmp_path / "dp2tp2"))
    out1 = torchrun(1, "train_2d.py", "--dp", "1", "--tp", "1", *args, "--save", str(tmp_path / "one"))
    losses4 = [float(x) for x in re.findall(r"loss (\d+\.\d+)", out4)]
    losses1 = [float(x) for x in re.findall(r"loss (\d+\.\d+)", out1)]
    assert len(losses4) == 3 and losses4[-1] < losses4[0]
    assert losses4 == pytest.approx(losses1, abs=2e-4)  # printed with 4 decimals
    got = AutoModelForCausalLM.from_pretrained(tmp_path / "dp2tp2").state_dict()
    want = AutoModelForCausalLM.from_pretrained(tmp_path / "one").state_dict()
    assert got.keys() == want.keys()
    assert max((got[k] - want[k]).abs().max().item() for k in want) < 1e-3  # fp32 AdamW, as above


def test_generate_example_matches_the_unsharded_model():
    out = torchrun(2, "generate.py", "--model-type", "gpt2", "--check")
    assert "rank 0: matches the unsharded model: True" in out and "rank 1: matches the unsharded model: True" in out
    tokens = eval(out.split("tokens:", 1)[1].splitlines()[0])  # a printed list of lists of ints
    assert len(tokens) == 2 and all(len(row) == 20 for row in tokens) and len(set(tokens[0])) > 1


def _torchrun_failing(script: str, *args: str, hang_guard: float = 120) -> tuple[int, str, float]:
    import time

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           str(ROOT / "examples" / script), *args]
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=hang_guard)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(f"torchrun {script} {' '.join(args)} was still running after {hang_guard} s")
    return proc.returncode, out, time.monotonic() - start


def test_a_rank_raising_mid_generate_ends_the_whole_job_and_names_the_rank():
    """torchrun sees rank 1 fail and stops rank 0, which was blocked in a collective: no 30-minute hang."""
    code, out, seconds = _torchrun_failing("generate.py", "--fail-on-rank", "1", "--timeout", "600")
    assert code != 0
    assert "deliberate failure inside rank 1's third forward" in out
    assert re.search(r"Root Cause \(first observed failure\):.*?rank\s*: 1", out, re.S), out[-3000:]
    assert seconds < 600  # ended by torchrun, well before the process-group timeout


def test_ranks_calling_generate_out_of_step_fail_at_once_on_every_rank():
    """Rank 0 asks for fewer tokens: before, it left early and rank 1 waited until the process-group
    timeout; now both ranks raise before the first forward."""
    code, out, seconds = _torchrun_failing("generate.py", "--stop-early-on-rank", "0", "--timeout", "600")
    assert code != 0 and "called generate with other settings than rank 0: max_new_tokens" in out, out[-3000:]
    assert seconds < 600  # not the process-group timeout


@pytest.fixture(scope="module")
def tiny_llama_folder(tmp_path_factory):
    """A checkpoint folder as a user would download one: the tiny llama, sharded into several files."""
    from transformers import AutoModelForCausalLM

    from tpmap.verify import large_init_, tiny_config

    folder = tmp_path_factory.mktemp("tiny-llama")
    model = AutoModelForCausalLM.from_config(tiny_config("llama"))
    large_init_(model, seed=0)
    model.save_pretrained(folder, max_shard_size="100KB")
    return folder


def test_train_example_loads_a_checkpoint_folder_and_saves_one(tmp_path, tiny_llama_folder):
    from transformers import AutoModelForCausalLM

    out2 = torchrun(2, "train.py", "--model", str(tiny_llama_folder), "--steps", "3", "--save", str(tmp_path / "tp2"))
    out1 = torchrun(1, "train.py", "--model", str(tiny_llama_folder), "--steps", "3")
    losses2 = [float(x) for x in re.findall(r"loss (\d+\.\d+)", out2)]
    losses1 = [float(x) for x in re.findall(r"loss (\d+\.\d+)", out1)]
    assert len(losses2) == 3 and losses2[-1] < losses2[0]
    assert losses2 == pytest.approx(losses1, abs=2e-4)
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "tp2").state_dict()
    before = AutoModelForCausalLM.from_pretrained(tiny_llama_folder).state_dict()
    assert saved.keys() == before.keys()
    assert max((saved[k] - before[k]).abs().max().item() for k in saved) > 1e-3  # trained, then saved whole


def test_generate_example_loads_a_checkpoint_folder(tiny_llama_folder):
    out = torchrun(2, "generate.py", "--model", str(tiny_llama_folder), "--check")
    assert "rank 0: matches the unsharded model: True" in out and "rank 1: matches the unsharded model: True" in out
