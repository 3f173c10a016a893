"""The docs stay true to the tree: docs/testing.md's tables name every test file and only files that exist,
and no page a reader gets (docs, benchmarks, README, CONTRIBUTING, MODELS.md, examples) points at an issue
tracker the reader does not have ("issue 21", "(issue", "#21")."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TESTING = ROOT / "docs" / "testing.md"
# "issue 21", "issues 12 and 18", "(issue", "#21" (not a link anchor like `page.md#5-title`), "PR 7", "GH-7"
TRACKER = re.compile(r"\bissues?\s+#?\d+|\(issues?\b|(?<![\w/.-])#\d+\b|\bPRs?\s+#?\d+|\bGH-\d+", re.IGNORECASE)
READ_BY_USERS = ("docs/**/*.md", "benchmarks/*.md", "benchmarks/*.py", "examples/**/*.py", "examples/**/*.md",
                 "README.md", "CONTRIBUTING.md", "MODELS.md")


def _table_files(page: str) -> set[str]:
    """The `tests/...py` paths in the first cell of the page's table rows."""
    cells = (line.split("|")[1].strip() for line in page.splitlines() if line.startswith("| `tests/"))
    return {name for cell in cells for name in re.findall(r"`(tests/[\w/]+\.py)`", cell)}


def _test_files() -> set[str]:
    return {str(p.relative_to(ROOT)) for folder in ("tests", "tests/lint") for p in (ROOT / folder).glob("*.py")}


def test_testing_md_names_every_test_file_and_no_other():
    named = _table_files(TESTING.read_text())
    missing, gone = sorted(_test_files() - named), sorted(named - _test_files())
    assert not missing, f"add a row to docs/testing.md's tables for: {missing}"
    assert not gone, f"docs/testing.md names files that do not exist (renamed or removed?): {gone}"


def test_testing_md_mentions_only_existing_test_files():
    """Outside the tables too: every `tests/...` path the page names exists."""
    named = set(re.findall(r"tests/[\w/]+\.py", TESTING.read_text()))
    gone = sorted(n for n in named if not (ROOT / n).exists())
    assert not gone, f"docs/testing.md names files that do not exist: {gone}"


def _tracker_references(paths, root: Path = ROOT) -> list[str]:
    """'file:line: match' for every issue-tracker reference in `paths`."""
    return [f"{p.relative_to(root)}:{i}: {m.group(0)!r}" for p in paths
            for i, line in enumerate(p.read_text().splitlines(), 1) for m in TRACKER.finditer(line)]


def test_no_issue_tracker_numbers_in_what_readers_get():
    """A reader has no tracker: say what the work was, not its number."""
    paths = sorted({p for pattern in READ_BY_USERS for p in ROOT.glob(pattern)})
    assert len(paths) > 20
    found = _tracker_references(paths)
    assert not found, "rewrite these without the issue number:\n" + "\n".join(found)


@pytest.mark.parametrize("line", ["Against issue 21's targets:", "not attempted yet (issue 18).",
                                  "The baseline of issue 18 item 6", "see #21", "issues 12 and 18", "PR #7"])
def test_the_tracker_pattern_sees_each_form(tmp_path, line):
    page = tmp_path / "page.md"
    page.write_text(f"Some text.\n{line}\nA link: [x](architecture.md#5-the-collectives), `#include`, C#.\n")
    assert len(_tracker_references([page], tmp_path)) == 1


def test_the_tables_reader_sees_a_missing_and_a_gone_file():
    page = TESTING.read_text()
    assert "`tests/test_layering.py`" in page and "`tests/lint/regen.py`" in page
    edited = page.replace("| `tests/test_layering.py` |", "| `tests/test_hostile.py` |")
    assert _table_files(edited) == _table_files(page) - {"tests/test_layering.py"} | {"tests/test_hostile.py"}



PAGES = ("docs/*.md", "benchmarks/*.md", "examples/**/*.md", "README.md", "CONTRIBUTING.md", "MODELS.md")


def _anchors(page: Path) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces as hyphens."""
    return {re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
            for line in page.read_text().splitlines() if line.startswith("#")}


def _broken_links(pages) -> list[str]:
    """'page: link' for every relative link to a file that does not exist or a heading the page lacks."""
    broken = []
    for page in pages:
        for link in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"[a-z]+:", link):  # https:, mailto:
                continue
            path, _, anchor = link.partition("#")
            target = page.parent / path if path else page
            if not target.exists() or (anchor and target.suffix == ".md" and anchor not in _anchors(target)):
                broken.append(f"{page.relative_to(ROOT)}: {link}")
    return broken


def test_every_relative_link_in_the_docs_resolves():
    """A page merged, renamed or removed (docs/adding-a-model.md went into CONTRIBUTING.md) leaves no link."""
    pages = sorted({p for pattern in PAGES for p in ROOT.glob(pattern)})
    assert len(pages) > 15
    broken = _broken_links(pages)
    assert not broken, "fix these links:\n" + "\n".join(broken)
