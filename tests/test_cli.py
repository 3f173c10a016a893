"""The command line's first-hour behaviour (issue 39): --version, a start-up without torch, a cut pipe, the unknown
model type's message, a verify that verified nothing, and the hints in two messages a new user meets first."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

import tpmap
from tpmap import cli
from tpmap.language import source

ROOT = Path(__file__).resolve().parent.parent


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)


def test_version_names_tpmap_torch_and_transformers(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--version"])
    out = capsys.readouterr().out
    assert exit_.value.code == 0
    from importlib import metadata
    assert tpmap.__version__ == metadata.version("tpmap")  # the package's and pyproject's agree
    assert out.startswith(f"tpmap {tpmap.__version__} (torch ") and ", transformers " in out and ", python 3." in out


def test_help_and_version_start_without_torch_or_transformers():
    """`import tpmap` is lazy (PEP 562): the parser, --help and --version import neither (4.8 s -> 0.1 s here)."""
    probe = _run("import sys, tpmap, tpmap.cli\n"
                 "tpmap.cli.build_parser().format_help()\n"
                 "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n"
                 "tpmap.apply  # a public name still resolves, importing what it needs\n"
                 "print('torch' in sys.modules)")
    assert probe.returncode == 0, probe.stderr
    assert probe.stdout.split("\n")[:2] == ["[]", "True"]


def test_every_public_name_resolves_and_is_listed():
    assert set(tpmap.__all__) == set(tpmap._WHERE)
    import importlib
    for name in tpmap.__all__:  # the object its module defines (LoadError is OtherRankError under an older name)
        assert getattr(tpmap, name) is getattr(importlib.import_module(tpmap._WHERE[name]), name)
        assert name in dir(tpmap)
    with pytest.raises(AttributeError, match="has no attribute 'aply'"):
        tpmap.aply  # noqa: B018


def test_a_reader_that_stops_early_gets_no_traceback():
    done = subprocess.run(f"{sys.executable} -m tpmap schema | head -1", shell=True, capture_output=True, text=True,
                          cwd=ROOT, timeout=120)
    assert done.stdout == "{\n" and "Traceback" not in done.stderr and "BrokenPipe" not in done.stderr


def test_an_unknown_model_type_names_the_nearest_three_and_where_to_look():
    files = source.shipped_files()
    message = source.unknown_model_type("lama", files)
    assert "Nearest shipped types: llama, mllama, llama4;" in message
    assert f"all {len(files)}: MODELS.md" in message and "docs/refused.md" in message
    assert "gpt2" not in message and len(message) < 600  # not the 4.4 KB list of every type
    refused = source.unknown_model_type("ibert", files)  # refused for good: its reason, from docs/refused.md
    assert "docs/refused.md: every projection is ibert's QuantLinear" in refused
    continued = source.unknown_model_type("gemma3n", files)  # an item continued on indented lines, named with notes
    assert "docs/refused.md: its vision tower is `TimmWrapperModel`" in continued and "CI therefore" in continued
    with pytest.raises(tpmap.UnknownModelTypeError, match="Nearest shipped types: llama, mllama, llama4"):
        source.for_model_type("lama")


def test_verify_of_an_unknown_type_prints_the_short_message(capsys):
    assert cli.main(["verify", "lama"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tpmap verify: no tpmap mapping for model_type 'lama'. Nearest shipped types:")
    assert len(err) < 700


def test_a_verify_that_verified_nothing_exits_3_and_says_so(tmp_path, capsys):
    text = (ROOT / "mappings" / "gpt2.yaml").read_text().replace("model_type: gpt2\n",
                                                                "model_type: gpt2\ntransformers: '<1.0'\n", 1)
    path = tmp_path / "gpt2.yaml"
    path.write_text(text)
    assert cli.main(["verify", str(path), "-n", "2"]) == cli.NOTHING_VERIFIED == 3
    captured = capsys.readouterr()
    assert "not verified: the mapping needs transformers<1.0" in captured.out
    assert "tpmap verify: nothing verified:" in captured.err
    assert "3 nothing verified" in cli.build_parser()._subparsers._group_actions[0].choices["verify"].description


def test_a_missing_checkpoint_folder_suggests_hf_download(tmp_path):
    from tpmap.checkpoint.safetensors import Checkpoint
    with pytest.raises(tpmap.CheckpointError, match=r"`hf download ORG/MODEL --local-dir DIR`"):
        Checkpoint.open(tmp_path / "absent")


def test_more_gpu_workers_than_gpus_suggests_the_cpu():
    import torch

    from tpmap.parallelize.handle import _devices
    with pytest.raises(tpmap.ParallelizeError, match=r"this machine has \d+: pass device='cpu' to run the workers"):
        _devices("cuda", torch.cuda.device_count() + 1)


def test_every_cli_argument_has_a_line_of_help():
    parser = cli.build_parser()
    commands = parser._subparsers._group_actions[0].choices
    missing = [f"{name} {action.dest}" for name, sub in commands.items() for action in sub._actions
               if not action.help and action.dest != "help"]
    assert not missing, missing


def test_verify_shows_progress_and_lines_up_long_names():
    from tpmap import verify
    assert verify.progress(3, 12, 61.0) == "[3/12 1:01 eta 3:03]"
    assert verify.progress(1, 2236, 3.0) == "[1/2236 0:03 eta 1:51:45]"
    short = verify.Case(ref="gpt2", model_type="gpt2", verify_index=0, config_name="mha12",
                        class_name="GPT2LMHeadModel", world_size=2)
    long = verify.Case(ref="granite_speech_plus", model_type="granite_speech_plus", verify_index=0,
                       config_name="mha12 [parallel]", class_name="GraniteSpeechPlusForConditionalGeneration",
                       world_size=2)
    widths = verify.Widths.of([short, long])
    def result(case):
        return verify.Result(case=case, passed=True, max_diff=1e-6, rel_diff=1e-7, params_local=5, params_full=10,
                             collectives={"all_reduce": 5})
    rows = [verify._row(result(c), 0.1, widths, "[1/2 0:01 eta 0:01]") for c in (short, long)]
    head = verify.header([short, long])
    column = head.index("tp_size") + len("tp_size") - 1  # the world size is right-aligned under its header
    assert all(row[column] == "2" and row[column + 1] == " " for row in rows), [head, *rows]
    assert all(row.endswith("pass (0.1s) [1/2 0:01 eta 0:01]") for row in rows)


def test_verify_takes_a_filter(capsys):
    assert cli.main(["verify", "gpt2", "-n", "1", "-k", "no such case"]) == 2
    assert "no case matches those world sizes and that filter" in capsys.readouterr().err


def test_the_command_prints_no_third_party_noise_and_the_library_keeps_it():
    """tpmap lint imports transformers, which imports torchao (the test extra): without the quieting, stderr carried
    torchao's 'Failed to load ...' lines and torch's pytree deprecation warnings. A program importing tpmap is left
    alone (the quieting is the command's, passed to its ranks through the environment)."""
    lint = subprocess.run([sys.executable, "-m", "tpmap", "lint", "mappings/gpt2.yaml"], capture_output=True,
                          text=True, cwd=ROOT, timeout=120)
    assert lint.returncode == 0 and lint.stdout == "1 file linted, no errors\n"
    assert lint.stderr == ""
    library = _run("import os, tpmap.api, tpmap.parallelize.rank_processes\n"
                   "from tpmap.parallelize.quiet import ENV\n"
                   "print(os.environ.get(ENV), os.environ.get('TRANSFORMERS_VERBOSITY'))")
    assert library.stdout == "None None\n"


def test_verify_runs_cases_at_once_with_jobs(capsys):
    """-j 2: two workers, each on its own ranks; every case runs once, passes, and comes back as its own result."""
    from tpmap import verify
    case_list = verify.cases(["gpt2"], [1, 2])
    assert len(case_list) == 2  # mha12 at 1 and 2: two workers, a pool each
    import threading
    rows, workers = [], set()

    def log(row):
        rows.append(row)
        workers.add(threading.current_thread().name)
    results = verify.run(case_list, log=log, jobs=2)
    assert len(workers) == 2  # each worker took a case (a case's ranks start in seconds: the other takes the next)
    assert [r.case for r in results] == case_list and all(r.passed for r in results)
    assert sorted((row.split()[1], row.split()[3]) for row in rows) == sorted(
        (c.config_name, str(c.world_size)) for c in case_list)
    assert cli.main(["verify", "gpt2", "-j", "0"]) == 2


def test_plan_of_a_users_checkpoint_folder_and_config_json(tmp_path, capsys):
    """tpmap plan DIR / config.json: the mapping, each rank's weights and KV cache, the world sizes that work for
    *this* config, the collectives. A 9-query / 3-KV-head Llama at 2 ranks: query heads 5 and 4; rank 0's read KV
    heads [0,0,0,1,1] (5 held, repeat_kv by 1), rank 1's [1,2,2,2] (4): worked out by hand, not by the code."""
    import json

    from transformers import LlamaConfig
    config = LlamaConfig(hidden_size=72, intermediate_size=100, num_hidden_layers=3, num_attention_heads=9,
                         num_key_value_heads=3, vocab_size=300, architectures=["LlamaForCausalLM"])
    config.save_pretrained(tmp_path)
    assert cli.main(["plan", str(tmp_path), "-n", "2", "--seq-len", "100"]) == 0
    out = capsys.readouterr().out
    assert "mapping " in out and "llama.yaml" in out and "(LlamaForCausalLM)" in out
    assert "world sizes that work for this config (of 1-16): 1, 2, 3, 4, 5, 6, 7, 8, 9\n" in out
    kv = [2 * 3 * n * 8 * 100 * 4 for n in (5, 4)]  # 2 (k, v) x layers x held KV heads x head_dim x tokens x fp32
    for r, (heads, cache) in enumerate(zip((5, 4), kv)):
        assert f"rank {r}: weights " in out
        assert f"{heads} query heads, KV cache at 100 tokens {cache / 2**20:.1f} MiB" in out
    assert ("# collectives per forward: 7 all-reduce(s) (6 Row outputs, 1 vocab-parallel embedding), "
            "1 all-gather(s)") in out
    json_file = tmp_path / "other.json"
    json_file.write_text(json.dumps({**json.loads((tmp_path / "config.json").read_text()), "num_attention_heads": 12,
                                     "num_key_value_heads": 4, "hidden_size": 96}))
    assert cli.main(["plan", str(json_file), "-n", "4"]) == 0
    assert "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12\n" in capsys.readouterr().out
    assert cli.main(["plan", str(tmp_path), "-n", "10"]) == 1
    assert "(world sizes that work for this config: 1, 2, 3, 4, 5, 6, 7, 8, 9)" in capsys.readouterr().err


def test_verify_model_proves_a_checkpoint_on_its_real_weights(tmp_path, capsys, monkeypatch):
    """tpmap verify --model DIR -n 3: logits and greedy tokens of the tiny Llama checkpoint (12 query / 2 KV heads:
    the KV heads shared unevenly at 3) against the unsharded model, with the memory; and the up-front refusal."""
    from tpmap import verify_model
    from tpmap.demo import tiny_checkpoint
    tiny_checkpoint(str(tmp_path))
    assert cli.main(["verify", "--model", str(tmp_path), "-n", "3"]) == 0
    out = capsys.readouterr().out
    assert "3 CPU workers" in out and ": ok" in out and "tokens: equal" in out and "result: pass" in out
    assert re.search(r"peak RSS: this process [\d.]+ [MG]iB, workers [\d.]+ [MG]iB, [\d.]+ [MG]iB, [\d.]+ [MG]iB", out)
    monkeypatch.setattr(verify_model, "available_bytes", lambda: 1000)
    assert cli.main(["verify", "--model", str(tmp_path)]) == 1
    assert "comparing needs about" in capsys.readouterr().err and "available" in verify_model.WontFitError.__doc__
    assert cli.main(["verify", "llama", "--model", str(tmp_path)]) == 2


@pytest.mark.full
def test_verify_model_fails_when_the_sharded_model_differs(tmp_path, monkeypatch):
    """Planted: the unsharded model loaded with its head negated: logits and tokens differ, result FAIL, exit 1."""
    import io

    from helpers import load_with_head_negated

    from tpmap import verify_model
    from tpmap.demo import tiny_checkpoint
    tiny_checkpoint(str(tmp_path))
    load_with_head_negated(monkeypatch, verify_model.AutoModelForCausalLM)
    out = io.StringIO()
    assert verify_model.run(str(tmp_path), 2, new_tokens=4, out=out) == 1
    assert ": FAIL" in out.getvalue() and "result: FAIL" in out.getvalue()
