"""The transformers version policy: pyproject's range is tpmap.compat's, an untested release is refused before
anything changes, and a mapping's own `transformers` range makes lint and verify skip it on other releases."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import tomllib
import torch
import transformers

import tpmap
from tpmap import compat
from tpmap.api_errors import TransformersVersionError
from tpmap.language import source
from tpmap.language.errors import MappingErrors

ROOT = Path(__file__).resolve().parents[1]


def test_pyproject_range_is_the_range_tpmap_checks_and_ci_installs():
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (dep,) = [d for d in deps if d.startswith("transformers")]
    assert dep == f"transformers{compat.TRANSFORMERS}"
    assert all(compat.mapping_applies(compat.TRANSFORMERS, v) for v in compat.PROVEN)
    ci = (ROOT / ".ci" / "run").read_text()
    oldest, newest = compat.PROVEN
    assert f"transformers=={oldest}" in ci  # the oldest release gets every mapping linted and verified
    # ... and the whole test set of a mapping whose own range excludes the newest release (skipped in the main run)
    assert ci.index(f"transformers=={oldest}") < ci.index("pytest -q --full --only-beyond-newest")
    assert transformers.__version__ == newest or not re.match(r"5\.\d+\.\d+$", transformers.__version__)


@pytest.mark.parametrize("version", ["5.22.2", "5.25.0", "6.0.0"])
def test_a_release_outside_the_range_is_refused_naming_it(version, monkeypatch):
    monkeypatch.delenv(compat.OVERRIDE, raising=False)
    with pytest.raises(TransformersVersionError, match=re.escape(f"transformers{compat.TRANSFORMERS}")):
        compat.check_transformers(version)
    monkeypatch.setenv(compat.OVERRIDE, "1")
    with pytest.warns(UserWarning, match="outside the range"):
        compat.check_transformers(version)


def test_apply_on_an_untested_release_leaves_the_model_untouched(monkeypatch):
    monkeypatch.delenv(compat.OVERRIDE, raising=False)
    monkeypatch.setattr(compat.transformers, "__version__", "5.99.0")
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                      num_key_value_heads=2, num_hidden_layers=1, vocab_size=64)
    model = transformers.LlamaForCausalLM(config)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(TransformersVersionError, match=r"5\.99\.0"):
        tpmap.apply(model, 2)
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


def _mapping_text(extra: str) -> str:
    text = (ROOT / "mappings" / "llama.yaml").read_text()
    return text.replace("model_type: llama\n", f"model_type: llama\n{extra}\n", 1)


def test_a_mapping_range_that_excludes_the_installed_release_is_skipped_by_lint_and_refused_by_apply(tmp_path):
    from tpmap import api
    from tpmap.lint import lint_file

    path = tmp_path / "llama.yaml"
    path.write_text(_mapping_text("transformers: '>=9.0'"))
    (d,) = lint_file(str(path))
    line = path.read_text().splitlines().index("transformers: '>=9.0'") + 1
    assert (d.severity, d.rule, d.line) == ("note", "transformers-version", line)
    assert "needs transformers>=9.0" in d.message
    config = transformers.LlamaConfig(num_hidden_layers=1)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    with pytest.raises(TransformersVersionError, match=r"needs transformers>=9\.0"):
        api.plan(model, 2, mapping=str(path))
    path.write_text(_mapping_text(f"transformers: '>={transformers.__version__}'"))
    assert lint_file(str(path)) == []  # admitted: linted as usual


def test_the_suite_skips_a_mapping_outside_its_range_and_ci_selects_it_on_the_oldest():
    """tests/conftest.py: a case of a mapping whose range excludes the installed release is skipped with the reason;
    --only-beyond-newest keeps exactly the cases of mappings whose range excludes the newest proven release."""
    import conftest

    beyond = [m for m in source.shipped_files() if (spec := conftest._release_range(m)) is not None
              and not compat.mapping_applies(spec, compat.PROVEN[-1])]
    assert "llama4" in beyond  # 5.24 cannot run Llama4ForConditionalGeneration even unsharded
    assert "llama4_text" not in beyond and "llama" not in beyond and "dory" not in beyond  # dory: >=5.24

    class Item:  # what the hook reads of a collected case, and records its marks
        def __init__(self, ref):
            self.callspec, self.marks = type("CallSpec", (), {"params": {"ref": ref}})(), []

        def add_marker(self, mark):
            self.marks.append(mark)

    items = [Item("llama4"), Item("llama"), Item("no_such_type")]
    conftest._skip_outside_range(items)
    here = compat.mapping_applies(conftest._release_range("llama4"))
    assert [len(i.marks) for i in items] == [0 if here else 1, 0, 0]
    if not here:
        assert "mappings/llama4.yaml needs transformers<5.24" in items[0].marks[0].kwargs["reason"]


def test_a_malformed_range_is_a_located_schema_error(tmp_path):
    with pytest.raises(MappingErrors, match=r"llama.yaml:\d+:\d+: transformers: .*not a version range"):
        source.load_text(_mapping_text("transformers: 'five point twenty four'"), "llama.yaml")
