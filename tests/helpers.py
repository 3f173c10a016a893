"""Helpers shared by the tests: edited copies of a shipped mapping, and one verify case run on real ranks."""
from __future__ import annotations

import re
from pathlib import Path

from tpmap import verify
from tpmap.language import source
from tpmap.parallelize.rank_processes import RankFailure


def mapping_text(origin: str) -> str:
    """The text of a shipped mapping (`origin` a model type) or of a mapping file (`origin` a path)."""
    shipped = source.shipped_files()
    return (shipped[origin] if origin in shipped else Path(origin)).read_text()


def replaced(text: str, old: str, new: str, *, every: bool = False, once: bool = False, where: str = "") -> str:
    """`text` with its first occurrence of `old` replaced by `new` (every occurrence with every=True).
    `old` must be in the text (exactly once with once=True), so a test whose mapping changed fails here
    instead of testing the unedited mapping."""
    found = text.count(old)
    assert (found == 1 if once else found > 0), f"{where or 'the text'} holds {old!r} {found} times; update the test"
    return text.replace(old, new, -1 if every else 1)


def edited(origin: str, old: str, new: str, *, every: bool = False, once: bool = False) -> str:
    """The text of a shipped mapping or mapping file (see mapping_text) with one edit (see replaced)."""
    return replaced(mapping_text(origin), old, new, every=every, once=once, where=origin)


def write_mapping(folder: Path, name: str, text: str) -> Path:
    """`text` written to folder/NAME.yaml."""
    path = Path(folder) / f"{name}.yaml"
    path.write_text(text)
    return path


def not_proven_uneven(folder: Path, model_type: str) -> Path:
    """A shipped mapping without its `uneven: true` line (a mapping not proven at uneven world sizes), written to
    folder/MODEL_TYPE.yaml."""
    text = mapping_text(model_type)
    line = next(x for x in text.splitlines(keepends=True) if x.startswith("uneven: true"))
    return write_mapping(folder, model_type, replaced(text, line, "", once=True))


def edited_copy(folder: Path, name: str, origin: str, old: str, new: str, *, every: bool = False,
                once: bool = False) -> Path:
    """A copy of a shipped mapping or mapping file with one edit (see edited), written to folder/NAME.yaml."""
    return write_mapping(folder, name, edited(origin, old, new, every=every, once=once))


def first_case(origin, world_size: int, **fields) -> verify.Case:
    """The first of `tpmap verify`'s cases for a mapping (model type or path) at `world_size` whose
    fields equal `fields` (config_name=..., verify_index=...)."""
    return next(c for c in verify.cases([str(origin)], [world_size])
                if all(getattr(c, k) == v for k, v in fields.items()))


def run_case(ranks, case: verify.Case) -> verify.Result:
    """One verify case as `tpmap verify` runs it: the forward on case.world_size ranks (in this process at
    world size 1) against the unsharded model, judged."""
    args = (case.ref, case.verify_index, case.class_name)
    per_rank = ranks(case.world_size).run(verify.forward_case, *args) if case.world_size > 1 else [
        verify.forward_case(*args)]
    assert len(per_rank) == case.world_size
    return verify.judge(case, per_rank)


DIFFERENCE = "a large difference"  # assert_caught's `expect` for a wrong mapping whose forward runs


def assert_caught(ranks, path, name: str, *, expect: str) -> None:
    """A known-wrong mapping at `path` is caught at world size 2, and by the failure it is known to cause:
    with expect=DIFFERENCE the forward runs and is off by more than 1e-3 relative; otherwise every rank
    raises, and `expect` is a regex found in each rank's traceback. A pass, or any other failure (a crash for
    an unrelated reason), fails the test."""
    case = first_case(path, 2)
    if expect == DIFFERENCE:
        result = run_case(ranks, case)  # an exception here is not the catch this mapping is known for
        assert not result.passed and result.rel_diff > 1e-3, f"wrong mapping {name}: {result.error or 'passed'}"
        return
    try:
        result = run_case(ranks, case)
    except RankFailure as e:
        unexpected = {r: text for r, text in e.per_rank.items() if not re.search(expect, text)}
        assert not unexpected, f"wrong mapping {name} failed, but not by {expect!r}:\n{e.summary()}"
        return
    raise AssertionError(f"wrong mapping {name} ran ({result.error or 'passed'}); expected it to raise {expect!r}")


def verify_index(ref: str, name: str) -> int:
    """The index of the verify config called `name` in mapping `ref`."""
    return next(i for i, v in enumerate(verify.resolve(ref).mapping.verify) if v.name == name)


def even_verify_index(ref: str, cls: str, ws: int) -> int | None:
    """The first verify config of `cls` listing `ws` whose plan at `ws` is even (None if none): what a test of a
    path that refuses uneven plans (quantized tensors) runs."""
    import torch
    import transformers

    import tpmap
    from tpmap import verify

    loaded = verify.resolve(ref)
    for i, v in enumerate(loaded.mapping.verify):
        if ws in v.world_sizes and cls in v.models:
            with torch.device("meta"):
                model = getattr(transformers, cls)(verify.tiny_config(ref, i))
            if not tpmap.plan(model, ws, mapping=loaded).uneven:
                return i
    return None


def load_with_head_negated(monkeypatch, owner) -> None:
    """Planted: `owner.from_pretrained` (an AutoModelForCausalLM as a module imported it) loads the unsharded model
    with its LM head negated, so the comparisons of `tpmap demo` and `tpmap verify --model` must fail."""
    import torch

    load = owner.from_pretrained

    def perturbed(*args, **kwargs):
        model = load(*args, **kwargs)
        with torch.no_grad():
            model.lm_head.weight.mul_(-1)
        return model
    monkeypatch.setattr(owner, "from_pretrained", perturbed)


def expert_bytes(file: Path, experts: int) -> tuple[list[int], int]:
    """(the bytes each expert's tensors take in a safetensors file that stores experts one tensor per expert
    ("...experts.<e>...": weights, scales), the bytes of everything else)."""
    from safetensors.torch import load_file

    stored = load_file(file)
    per_expert = [sum(t.numel() * t.element_size() for n, t in stored.items() if f".experts.{e}." in n)
                  for e in range(experts)]
    return per_expert, sum(t.numel() * t.element_size() for t in stored.values()) - sum(per_expert)
