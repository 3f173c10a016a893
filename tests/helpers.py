"""Helpers shared by the tests: edited copies of a shipped mapping, and one verify case run on real ranks."""
from __future__ import annotations

from pathlib import Path

from tpmap import verify
from tpmap.language import source


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


def assert_caught(ranks, path, name: str) -> None:
    """A known-wrong mapping at `path` is caught at world size 2: a large difference or an error, never a pass."""
    try:
        result = run_case(ranks, first_case(path, 2))
    except Exception as e:  # a shape error inside the forward is also a catch
        assert "RankFailure" in type(e).__name__ or isinstance(e, RuntimeError)
        return
    assert not result.passed
    assert result.rel_diff > 1e-3, f"wrong mapping {name} was off by only {result.rel_diff:.2g}"
