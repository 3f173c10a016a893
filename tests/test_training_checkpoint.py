"""Training checkpoints (tpmap.training) on real gloo ranks: a run stopped and resumed equals the run never
stopped -- bit for bit at the same shape (model tensors, optimizer state, LR, dropout masks through the restored
RNG, the data position), and within the tensor-parallel summation order at another tp x dp -- every bad input
raises on every rank before anything changes, a save killed halfway leaves the previous checkpoint, and export
writes what tpmap.save_pretrained writes.

Resharding tolerance (fp64, AdamW lr 2e-3, cross-entropy in fp64, 3 steps after the resume, Llama with 2 KV
heads, replicated at tp 4): the losses agree within RESHARD_LOSS_RTOL and the gathered parameters within
RESHARD_PARAM_ATOL of the uninterrupted run's (measured: see the constants). Another tp size sums the Row
all-reduces and the replicated KV-head gradients in another order; in fp32 AdamW turns that rounding noise of
near-zero gradient elements into parameter differences of ~1e-4 (tests/test_training.py), so the bound is
checked in fp64.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import training_checkpoint_cases as cases
from helpers import edited_copy

import tpmap
import tpmap.training

ROOT = Path(__file__).resolve().parents[1]
LLAMA = {"model_type": "llama", "class_name": "LlamaForCausalLM"}
RESHARD_LOSS_RTOL = 1e-12  # measured: 0, 0, 1.2e-16 (tp 2->4, 4->2, dp2xtp2->tp4)
RESHARD_PARAM_ATOL = 1e-12  # measured: 2.2e-16, 1.1e-16, 1.1e-16 (parameters ~0.2-1 in size)
# LoRA (adapters compared; the base is frozen) is held to the same bounds (measured: losses 0, 0, 1.2e-16,
# adapters 5.6e-17). Mixtral is not: transformers' router takes its softmax and routing weights in fp32
# (MixtralTopKRouter: router_logits.float()), so an fp64 run's MoE carries fp32 rounding, and the uninterrupted
# runs at tp 2 and at tp 4 already differ by up to 1.6e-8 (losses, relative) and 4.6e-7 (parameters) after 5 steps
# (measured, no checkpoint). The resumed runs stay below that (measured: 4.4e-9 / 1.6e-8 tp 2->4, 4.9e-9 / 6.6e-9
# tp 4->2); a wrong slice of any tensor is off by ~0.1-1.
MOE_RESHARD_LOSS_RTOL = 1e-7
MOE_RESHARD_PARAM_ATOL = 1e-6


def _same_shape(ranks, tmp_path, spec):
    results = ranks(2).run(cases.same_shape_case, spec, str(tmp_path / "ckpt"), timeout=300)
    for r in results:
        assert r["steps"] == list(range(spec["save_at"], spec["stop"])), r["steps"]
        assert r["losses_a"] == r["losses_b"], (r["losses_a"], r["losses_b"])  # exact, every step after the resume
        assert r["local_same"] and r["optim_same"] and r["lr_same"], r
        assert r["optim_entries"] > 0
    return results


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_same_shape_resume_is_bit_for_bit_with_dropout(ranks, tmp_path, dtype):
    """Attention dropout 0.1 (drawn in the sharded RNG regions): the restored RNG gives the same masks."""
    _same_shape(ranks, tmp_path, {**LLAMA, "dtype": dtype, "dropout": 0.1, "stop": 5, "save_at": 2})


@pytest.mark.parametrize("model_type,class_name", [("mixtral", "MixtralForCausalLM"),
                                                   ("qwen3_moe", "Qwen3MoeForCausalLM")])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.full
def test_same_shape_resume_is_bit_for_bit_moe(ranks, tmp_path, model_type, class_name, dtype):
    _same_shape(ranks, tmp_path, {"model_type": model_type, "class_name": class_name, "dtype": dtype,
                                  "dropout": 0.1, "stop": 4, "save_at": 2})


def test_same_shape_resume_is_bit_for_bit_lora(ranks, tmp_path):
    """LoRA on q/k (Column: B split like the base rows, replicated KV heads), o/down (Row: A split), dropout 0.1."""
    pytest.importorskip("peft")
    _same_shape(ranks, tmp_path, {**LLAMA, "lora": True, "dropout": 0.1, "stop": 4, "save_at": 2})


def test_same_shape_resume_is_bit_for_bit_with_whole_row_biases(ranks, tmp_path):
    """GPT-2: a Row's bias is whole on every rank (a plan layout without a split dim), tied embedding and head."""
    _same_shape(ranks, tmp_path, {"model_type": "gpt2", "class_name": "GPT2LMHeadModel", "stop": 4, "save_at": 2})


def test_sgd_momentum_resume_is_bit_for_bit(ranks, tmp_path):
    _same_shape(ranks, tmp_path, {**LLAMA, "optimizer": "sgd", "stop": 4, "save_at": 2})


def _reshard(ranks, tmp_path, before: tuple[int, int], after: tuple[int, int],
             model: dict = LLAMA) -> tuple[float, float]:
    """Save at (world, dp) `before`, resume at `after`: the worst relative loss and absolute parameter
    differences from the uninterrupted run, over the steps after the resume and the final parameters (of a LoRA
    run: its adapters, the base being frozen)."""
    folder = str(tmp_path / "ckpt")
    spec = {**model, "dtype": "float64", "stop": 5, "save_at": 2}
    a = ranks(before[0]).run(cases.resume_case, {**spec, "dp": before[1]}, folder, False, timeout=300)[0]
    b = ranks(after[0]).run(cases.resume_case, {**spec, "dp": after[1]}, folder, True, timeout=300)[0]
    assert sorted(b["losses"]) == [2, 3, 4]
    loss = max(abs(b["losses"][s] - a["losses"][s]) / abs(a["losses"][s]) for s in b["losses"])
    assert a["full"].keys() == b["full"].keys() and len(a["full"]) > 0
    param = max((a["full"][k] - b["full"][k]).abs().max().item() for k in a["full"])
    return loss, param


@pytest.mark.full  # 4 ranks
@pytest.mark.parametrize("before,after", [((2, 1), (4, 1)), ((4, 1), (2, 1)), ((4, 2), (4, 1))],
                         ids=["tp2-to-tp4", "tp4-to-tp2", "dp2xtp2-to-tp4"])
def test_resume_at_another_shape_within_the_summation_order(ranks, tmp_path, before, after):
    loss, param = _reshard(ranks, tmp_path, before, after)
    print(f"reshard {before} -> {after}: loss rel {loss:.3g}, param abs {param:.3g}")
    assert loss <= RESHARD_LOSS_RTOL and param <= RESHARD_PARAM_ATOL, (loss, param)


MIXTRAL = {"model_type": "mixtral", "class_name": "MixtralForCausalLM"}


@pytest.mark.full  # 4 ranks
@pytest.mark.parametrize("model,before,after", [
    (MIXTRAL, (2, 1), (4, 1)), (MIXTRAL, (4, 1), (2, 1)),
    ({**LLAMA, "lora": True}, (2, 1), (4, 1)), ({**LLAMA, "lora": True}, (4, 1), (2, 1)),
    ({**LLAMA, "lora": True}, (4, 2), (4, 1))],
    ids=["moe-tp2-to-tp4", "moe-tp4-to-tp2", "lora-tp2-to-tp4", "lora-tp4-to-tp2", "lora-dp2xtp2-to-tp4"])
def test_moe_and_lora_resume_at_another_shape_within_the_summation_order(ranks, tmp_path, model, before, after):
    """Mixtral: fused experts split by their sections (4 experts, 2 KV heads replicated at tp 4); LoRA on q/k
    (Column: B split, replicated KV heads at tp 4) and o/down (Row: A split)."""
    if model.get("lora"):
        pytest.importorskip("peft")
    loss, param = _reshard(ranks, tmp_path, before, after, model)
    print(f"reshard {model['model_type']}{' lora' if model.get('lora') else ''} {before} -> {after}: "
          f"loss rel {loss:.3g}, param abs {param:.3g}")
    moe = model is MIXTRAL
    assert loss <= (MOE_RESHARD_LOSS_RTOL if moe else RESHARD_LOSS_RTOL), (loss, param)
    assert param <= (MOE_RESHARD_PARAM_ATOL if moe else RESHARD_PARAM_ATOL), (loss, param)


# SmolLM2's 9 query / 3 KV heads: tp 2 splits the query heads 5 / 4 and both ranks hold KV head 1 (its gradient
# summed over the two copies), tp 3 splits them evenly; the checkpoint stores each tensor whole-shaped by its layout.
LLAMA_9_3 = {**LLAMA, "overrides": {"hidden_size": 72, "num_attention_heads": 9, "num_key_value_heads": 3,
                                    "intermediate_size": 99}}


def test_uneven_same_shape_resume_is_bit_for_bit(ranks, tmp_path):
    results = _same_shape(ranks, tmp_path, {**LLAMA_9_3, "dtype": "float64", "stop": 4, "save_at": 2})
    assert all(r["uneven"] for r in results)


@pytest.mark.parametrize("before,after", [
    ((2, 1), (3, 1)), pytest.param((3, 1), (2, 1), marks=pytest.mark.full),
    pytest.param((2, 1), (4, 1), marks=pytest.mark.full), pytest.param((4, 2), (3, 1), marks=pytest.mark.full)],
    ids=["tp2-to-tp3", "tp3-to-tp2", "tp2-to-tp4", "dp2xtp2-to-tp3"])
def test_uneven_resume_at_another_shape_within_the_summation_order(ranks, tmp_path, before, after):
    """Saved at an uneven tp size (under DDP too), resumed at an even one (and back): the bounds of even
    resharding."""
    loss, param = _reshard(ranks, tmp_path, before, after, LLAMA_9_3)
    print(f"reshard uneven llama 9q/3kv tp {before} -> {after}: loss rel {loss:.3g}, param abs {param:.3g}")
    assert loss <= RESHARD_LOSS_RTOL and param <= RESHARD_PARAM_ATOL, (loss, param)


def test_bad_input_raises_on_every_rank_and_changes_nothing(ranks, tmp_path):
    changed = edited_copy(tmp_path, "llama_changed", "llama", "name: gqa-kv6", "name: gqa-kv6-renamed", once=True)
    results = ranks(2).run(cases.bad_input_case, str(tmp_path / "ckpt"), str(changed), timeout=300)
    words = {"missing_file": "is missing", "truncated": "bytes, the manifest records", "corrupted": "corrupted",
             "sgd": "the optimizer given is a torch.optim.sgd.SGD",
             "param_groups": "1 parameter groups, the one given 2",
             "no_optimizer": "no optimizer was given", "other_model": "this model is gpt2",
             "other_config": "another llama model", "mapping_changed": "the mapping changed since the save",
             "dp_group_wrong": "pass dp_group=",
             "other_scheduler": "the scheduler given is a torch.optim.lr_scheduler.StepLR",
             "other_shape": "[192, 96] in the checkpoint and [256, 96] in the model (full shapes)"}
    for r in results:
        assert set(r) == set(words), set(r) ^ set(words)
        for kind, result in r.items():
            assert result["error"] == "TrainingCheckpointError", (kind, result)
            assert words[kind] in result["message"], (kind, result["message"])
            assert result["untouched"], kind


def test_a_change_in_a_composed_mapping_file_is_refused(ranks, tmp_path):
    """Llava's mapping composes llama.yaml (here a copy beside it, named by `mapping:`): the same files in another
    folder load; the composed file with one entry changed (o_proj's `heads` dropped: the same split at tp 2, so
    only the mapping's identity tells) is refused, on every rank, with nothing changed."""
    from helpers import edited, mapping_text, replaced, write_mapping

    top = replaced(mapping_text("llava"), "config: text_config", "config: text_config\n    mapping: llama.yaml",
                   once=True)
    folders = {}
    for name, llama in (("saved", mapping_text("llama")), ("same", mapping_text("llama")),
                        ("changed", edited("llama", "module: layers.*.self_attn.o_proj\n    heads: num_attention_heads",
                                           "module: layers.*.self_attn.o_proj", once=True))):
        (tmp_path / name).mkdir()
        write_mapping(tmp_path / name, "llama", llama)
        folders[name] = str(write_mapping(tmp_path / name, "llava", top))
    results = ranks(2).run(cases.compose_case, str(tmp_path / "ckpt"), folders["saved"], folders["same"],
                           folders["changed"], timeout=300)
    for r in results:
        assert r["same"]["error"] is None, r["same"]
        assert r["changed"]["error"] == "TrainingCheckpointError", r["changed"]
        assert "the mapping changed since the save" in r["changed"]["message"] and r["changed"]["untouched"]


# a real config.json (meta-llama/Llama-3.2-1B's keys, sizes made tiny), with keys LlamaConfig does not define
REAL_CONFIG = {
    "_name_or_path": "meta-llama/Llama-3.2-1B", "architectures": ["LlamaForCausalLM"], "attention_bias": False,
    "attention_dropout": 0.0, "bos_token_id": 1, "eos_token_id": [2, 3], "head_dim": 8, "hidden_act": "silu",
    "hidden_size": 96, "initializer_range": 0.02, "intermediate_size": 192, "max_position_embeddings": 64,
    "mlp_bias": False, "model_type": "llama", "num_attention_heads": 12, "num_hidden_layers": 2,
    "num_key_value_heads": 2, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 2.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 32, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "transformers_version": "4.45.0.dev0", "use_cache": True, "vocab_size": 256,
    "model_card_url": "https://example.org/card", "custom_training_notes": {"stage": 2, "tokens": [1, 2]},
}


def test_a_run_built_by_from_pretrained_resumes_into_one_built_the_same_way(ranks, tmp_path):
    """No false refusal from the config comparison: a real config.json's keys (extra ones, rope_scaling,
    torch_dtype, a list of EOS ids) survive from_pretrained, save and load."""
    from transformers import AutoConfig, LlamaForCausalLM

    hf, weights = tmp_path / "hf", tmp_path / "weights"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps(REAL_CONFIG, indent=2))
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    LlamaForCausalLM(AutoConfig.from_pretrained(hf)).save_pretrained(weights)
    shutil.copy(weights / "model.safetensors", hf / "model.safetensors")  # the real config.json stays as written
    results = ranks(2).run(cases.from_pretrained_case, str(hf), str(tmp_path / "ckpt"), timeout=300)
    for r in results:
        assert r["error"] is None, r["message"]
        assert r["equal"]


def test_check_resume_refuses_a_shape_the_mapping_cannot_serve(ranks, tmp_path):
    ranks(2).run(cases.resume_case, {**LLAMA, "stop": 1, "save_at": 1}, str(tmp_path), False, timeout=300)
    assert tpmap.training.check_resume(tmp_path, 4).tp_size == 4
    assert tpmap.training.check_resume(tmp_path, 5).uneven  # llama splits unevenly: 12 heads as 3/3/2/2/2
    with pytest.raises(tpmap.TrainingCheckpointError, match=r"cannot resume at tp 13: .*12 heads cannot be split "
                                                            r"over world size 13"):
        tpmap.training.check_resume(tmp_path, 13)


@pytest.mark.parametrize("model_type,class_name", [("gpt2", "GPT2LMHeadModel"), ("mixtral", "MixtralForCausalLM")])
def test_export_equals_save_pretrained(ranks, tmp_path, model_type, class_name):
    """Tied weights (GPT-2) and fused experts reverted to per-expert tensors (Mixtral): the exported folder is
    byte for byte what tpmap.save_pretrained wrote, and transformers loads it."""
    from transformers import AutoModelForCausalLM

    ckpt, hf, out = tmp_path / "ckpt", tmp_path / "hf", tmp_path / "exported"
    ranks(2).run(cases.export_case, model_type, class_name, str(ckpt), str(hf), timeout=300)
    tpmap.training.export(ckpt, out)
    names = sorted(p.name for p in hf.iterdir())
    assert names == sorted(p.name for p in out.iterdir())
    for name in names:
        assert (hf / name).read_bytes() == (out / name).read_bytes(), name
    loaded = AutoModelForCausalLM.from_pretrained(out).state_dict()
    assert len(loaded) > 0


def test_export_checkpoint_cli(ranks, tmp_path):
    ckpt = tmp_path / "ckpt"
    ranks(2).run(cases.resume_case, {**LLAMA, "stop": 1, "save_at": 1}, str(ckpt), False, timeout=300)
    from tpmap.cli import main

    assert main(["export-checkpoint", str(ckpt), str(tmp_path / "out")]) == 0
    assert (tmp_path / "out" / "model.safetensors").is_file()
    assert main(["export-checkpoint", str(tmp_path / "nothing"), str(tmp_path / "out2")]) == 1


# -- a save killed halfway -------------------------------------------------------------------------------------
def _torchrun(nproc: int, *args: str, env=None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           str(ROOT / "examples" / "train.py"), *args]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, **(env or {})})


def _losses(out: str) -> dict[int, float]:
    return {int(s): float(x) for s, x in re.findall(r"^step (\d+) loss (\S+)$", out, re.M)}


def _finish(proc: subprocess.Popen, timeout: float = 300) -> tuple[int, str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"torchrun did not finish in {timeout} s\n{out}\n{err}")
    return proc.returncode, out + err


@pytest.mark.full  # three torchrun jobs
def test_a_save_killed_halfway_leaves_the_previous_checkpoint(tmp_path):
    ckpt, pause = tmp_path / "ckpt", tmp_path / "pause"
    pause.mkdir()
    killed = _torchrun(2, "--steps", "6", "--save-every", "2", "--checkpoint-dir", str(ckpt),
                       env={cases_pause_env(): f"4:{pause}"})
    deadline = time.monotonic() + 240
    while not (pause / "rank1.pid").is_file():
        assert killed.poll() is None and time.monotonic() < deadline, _finish(killed)[1]
        time.sleep(0.2)
    os.kill(int((pause / "rank1.pid").read_text()), signal.SIGKILL)  # rank 1, inside the save of step 4
    code, _ = _finish(killed)
    assert code != 0
    assert (ckpt / "latest").read_text().strip() == "step-00000002"
    assert not (ckpt / "step-00000004").exists() and (ckpt / ".tmp-step-00000004").exists()
    code, resumed = _finish(_torchrun(2, "--steps", "6", "--resume", str(ckpt)))
    assert code == 0, resumed
    code, whole = _finish(_torchrun(2, "--steps", "6"))
    assert code == 0, whole
    got, want = _losses(resumed), _losses(whole)
    assert sorted(got) == [2, 3, 4, 5] and len(want) == 6
    assert got == {s: want[s] for s in got}  # bit for bit: printed as repr(float)


# put on PYTHONPATH as sitecustomize.py: every Python process of the job runs it at startup
PAUSE_IN_STEP_HOOK = '''
import os

_spec = os.environ.get("TPMAP_TEST_PAUSE_IN_STEP")  # "STEP:DIR": rank 1 pauses inside 0-based training step STEP
if _spec and os.environ.get("RANK") == "1":
    import time

    from torch.optim.optimizer import register_optimizer_step_pre_hook

    _step, _folder = _spec.split(":", 1)
    _calls = [0]

    def _pause(optimizer, args, kwargs):  # after the step's backward (its all-reduces), before its update
        if _calls[0] == int(_step):
            with open(os.path.join(_folder, "pid.tmp"), "w") as f:
                f.write(str(os.getpid()))
            os.rename(os.path.join(_folder, "pid.tmp"), os.path.join(_folder, "rank1.pid"))
            time.sleep(600)
        _calls[0] += 1

    register_optimizer_step_pre_hook(_pause)
'''


@pytest.mark.full  # three torchrun jobs
def test_a_rank_killed_in_the_middle_of_a_training_step_resumes_from_latest(tmp_path):
    """--save-every 2: rank 1 is killed inside step 4 (0-based; after its backward, before its optimizer step),
    the step after the save of step 4, while rank 0 goes on into the next step's collectives. Resumed from the
    folder, the run's losses from step 4 on are the uninterrupted run's, bit for bit."""
    ckpt, pause, hooks = tmp_path / "ckpt", tmp_path / "pause", tmp_path / "hooks"
    pause.mkdir()
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(PAUSE_IN_STEP_HOOK)
    path = os.pathsep.join(p for p in (str(hooks), os.environ.get("PYTHONPATH", "")) if p)
    killed = _torchrun(2, "--steps", "8", "--save-every", "2", "--checkpoint-dir", str(ckpt),
                       env={"PYTHONPATH": path, "TPMAP_TEST_PAUSE_IN_STEP": f"4:{pause}"})
    deadline = time.monotonic() + 240
    while not (pause / "rank1.pid").is_file():
        assert killed.poll() is None and time.monotonic() < deadline, _finish(killed)[1]
        time.sleep(0.2)
    os.kill(int((pause / "rank1.pid").read_text()), signal.SIGKILL)  # rank 1, in the middle of step 4
    code, out = _finish(killed)
    assert code != 0
    assert (ckpt / "latest").read_text().strip() == "step-00000004"
    assert sorted(p.name for p in ckpt.iterdir()) == ["latest", "step-00000002", "step-00000004"]
    code, resumed = _finish(_torchrun(2, "--steps", "8", "--resume", str(ckpt)))
    assert code == 0, resumed
    code, whole = _finish(_torchrun(2, "--steps", "8"))
    assert code == 0, whole
    got, want, before_kill = _losses(resumed), _losses(whole), _losses(out)
    assert sorted(got) == [4, 5, 6, 7] and len(want) == 8 and {0, 1, 2, 3} <= set(before_kill)
    assert before_kill == {s: want[s] for s in before_kill}  # the killed run was the same run until then
    assert got == {s: want[s] for s in got}  # bit for bit: printed as repr(float)


def cases_pause_env() -> str:
    from tpmap.training.save import PAUSE_ENV

    return PAUSE_ENV


# -- the commit sequence, stopped after each filesystem step ---------------------------------------------------
class _Killed(BaseException):  # not an Exception: nothing in the code under test may catch it
    pass


_MUTATIONS = ("mkdir", "rename", "replace", "unlink", "rmdir")  # what changes a folder (rmtree: unlink, rmdir)


def _one_rank_save(root: Path, step: int, ident: str):
    """A one-rank save's temporary folder, written as save's ranks write it: (tmp, manifest, reported)."""
    from tpmap.training import files

    tmp = root / f"{files.TMP_PREFIX}{step:08d}"
    shutil.rmtree(tmp, ignore_errors=True)  # a killed save's, as save() does
    tmp.mkdir(parents=True)
    (tmp / files.tensor_file(0, 1)).write_bytes(os.urandom(4096))
    (tmp / files.rng_file(0, 0)).write_text(json.dumps({"ident": ident}))
    reported = {p.name: {"size": p.stat().st_size, "sha256": files.digest(p)} for p in tmp.iterdir()}
    manifest = {"format": files.FORMAT, "version": files.VERSION, "step": step, "extra": {"ident": ident},
                "tp_size": 1, "dp_size": 1}
    return tmp, manifest, reported


def _commit_killed_after(monkeypatch, root: Path, step: int, ident: str, kill_after: int | None) -> bool:
    """Rank 0's commit of a one-rank save, stopped right after its `kill_after`-th filesystem change (as SIGKILL
    would: nothing after it runs); True when it finished first."""
    from tpmap.training.ranks import Shape
    from tpmap.training.save import _commit

    tmp, manifest, reported = _one_rank_save(root, step, ident)
    done = [0]

    def counting(real):
        def counted(*args, **kwargs):
            out = real(*args, **kwargs)
            done[0] += 1
            if done[0] == kill_after:
                raise _Killed
            return out
        return counted

    with monkeypatch.context() as patch:
        for name in _MUTATIONS:
            patch.setattr(os, name, counting(getattr(os, name)))
        try:
            _commit(root, tmp, step, manifest, reported, Shape(0, 1, 0, 1, 0, 1))
        except _Killed:
            return False
    return True


def _loadable(root: Path) -> str:
    """What load reads from the parent folder, checked as load checks it (every file, sizes and sha256): the
    ident of the complete save `latest` names."""
    from tpmap.training import files

    folder = files.resolve(root)
    manifest = files.read_manifest(folder)
    files.check_files(folder, manifest, sorted(manifest["files"]), hash_these=set(manifest["files"]))
    return manifest["extra"]["ident"]


@pytest.mark.parametrize("before", [[2], [2, 4]], ids=["new-step", "same-step-again"])
def test_a_commit_stopped_after_any_filesystem_step_leaves_a_complete_checkpoint(monkeypatch, tmp_path, before):
    """Saves of `before` complete, then a save of step 4 stopped after its 1st, 2nd, ... filesystem change: the
    parent folder loads, as the previous save or the new one, never a missing or partial folder; the next save
    of step 4 (not stopped) is then the one `latest` names and leaves no other folder of step 4 behind."""
    stops = 0
    for kill_after in range(1, 100):
        root = tmp_path / f"k{kill_after}"
        for i, step in enumerate(before):
            assert _commit_killed_after(monkeypatch, root, step, f"before-{i}", None)
        finished = _commit_killed_after(monkeypatch, root, 4, "new", kill_after)
        assert _loadable(root) in ({f"before-{len(before) - 1}", "new"} if not finished else {"new"}), kill_after
        assert _commit_killed_after(monkeypatch, root, 4, "next", None)
        assert _loadable(root) == "next"
        assert [p.name for p in root.iterdir() if p.name.startswith((".", "step-00000004"))] == \
            [(root / "latest").read_text().strip()], sorted(p.name for p in root.iterdir())
        if finished:
            break
        stops += 1
    assert stops >= 3, stops  # the manifest, the rename, `latest`: each a step a kill can follow
