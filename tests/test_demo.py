"""`tpmap demo`, the README's main job: a tiny Llama with fixed weights sharded over 2 CPU workers by tpmap.parallelize,
its greedy tokens compared with the unsharded model's in the same run; and the comparison's failing side."""
from __future__ import annotations

import io

import transformers
from helpers import load_with_head_negated

from tpmap import cli, demo


def test_the_demo_generates_the_unsharded_tokens_on_two_cpu_workers(capsys, tmp_path):
    assert cli.main(["demo", "--new-tokens", "12", "--save", str(tmp_path / "tiny-llama")]) == 0
    assert (tmp_path / "tiny-llama" / "config.json").is_file()  # --save keeps the checkpoint the README's snippets load
    out = capsys.readouterr().out
    sharded = next(line for line in out.splitlines() if line.startswith("sharded over 2"))
    unsharded = next(line for line in out.splitlines() if line.startswith("unsharded"))
    assert sharded.split(None, 3)[3] == unsharded.split(None, 1)[1]  # the same token ids and text
    assert "equal: yes" in out


def test_the_demo_fails_when_the_tokens_differ(monkeypatch):
    """Planted: the unsharded model loaded with one weight perturbed -- the demo must say so and exit 1."""
    load_with_head_negated(monkeypatch, transformers.AutoModelForCausalLM)
    out = io.StringIO()
    assert demo.run(new_tokens=8, out=out) == 1
    assert "equal: NO" in out.getvalue()


def test_save_and_model_together_are_a_usage_error(capsys, tmp_path):
    assert cli.main(["demo", "--model", str(tmp_path), "--save", str(tmp_path / "x")]) == 2
    assert "cannot be combined with --model" in capsys.readouterr().err
