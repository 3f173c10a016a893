"""The README's snippets marked `<!-- runnable: torchrun ... -->` run as written, on CPU, under torchrun, on the tiny
checkpoint `tpmap demo --save tiny-llama` writes (tpmap.demo.tiny_checkpoint), and print what the unsharded model
computes: the training snippet's loss, the generate snippet's tokens and a saved checkpoint equal to the loaded one."""
from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
RUNNABLE = re.compile(r"<!-- runnable: (.+?) -->\n```python\n(.*?)```", re.S)


def snippets(text: str) -> list[tuple[list[str], str]]:
    """(launcher words, code) of each snippet marked runnable."""
    return [(shlex.split(cmd), code) for cmd, code in RUNNABLE.findall(text)]


@pytest.fixture(scope="module")
def ran(tmp_path_factory) -> tuple[Path, list[str]]:
    """Each marked snippet of README.md run under its launcher in a folder holding tiny-llama: (folder, outputs)."""
    from tpmap.demo import tiny_checkpoint

    folder = tmp_path_factory.mktemp("readme")
    tiny_checkpoint(str(folder / "tiny-llama"))
    outs = []
    for i, (launcher, code) in enumerate(snippets((ROOT / "README.md").read_text())):
        assert launcher[0] == "torchrun", launcher
        script = folder / f"snippet{i}.py"
        script.write_text(code)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", *launcher[1:], str(script)]
        proc = subprocess.run(cmd, cwd=folder, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, f"README snippet {i} failed:\n{code}\n{proc.stdout}\n{proc.stderr}"
        outs.append(proc.stdout)
    return folder, outs


def test_the_readme_marks_its_two_usage_snippets_runnable():
    marked = snippets((ROOT / "README.md").read_text())
    assert len(marked) == 2 and all("tiny-llama" in code for _, code in marked)
    assert "tpmap.apply(" in marked[0][1] and "tpmap.from_pretrained(" in marked[1][1]


def _per_rank(out: str, what: str) -> dict[int, str]:
    """{rank: value} from the ranks' lines; two ranks' prints may share a line (their writes interleave)."""
    return {int(r): v for r, v in re.findall(rf"rank (\d+): {what}", out)}


def test_the_apply_snippet_trains_with_the_unsharded_loss(ran):
    from transformers import AutoModelForCausalLM

    folder, outs = ran
    losses = _per_rank(outs[0], r"loss (\d+\.\d{4})")
    assert sorted(losses) == [0, 1] and losses[0] == losses[1]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(folder / "tiny-llama")
    batch = torch.randint(0, model.config.vocab_size, (2, 16))
    assert float(losses[0]) == pytest.approx(model(input_ids=batch, labels=batch).loss.item(), abs=2e-4)


def test_the_from_pretrained_snippet_generates_the_unsharded_tokens_and_saves_them_back(ran):
    from transformers import AutoModelForCausalLM

    folder, outs = ran
    tokens = _per_rank(outs[1], r"(\[[\d, ]*\])")
    assert sorted(tokens) == [0, 1] and tokens[0] == tokens[1]
    model = AutoModelForCausalLM.from_pretrained(folder / "tiny-llama").eval()
    with torch.no_grad():
        want = model.generate(torch.tensor([[2, 40, 17, 95, 33]]), max_new_tokens=8, do_sample=False)
    assert tokens[0] == str(want[0].tolist())
    saved = AutoModelForCausalLM.from_pretrained(folder / "tiny-llama-saved").state_dict()
    assert saved.keys() == model.state_dict().keys()
    assert all(torch.equal(saved[k], v) for k, v in model.state_dict().items())
