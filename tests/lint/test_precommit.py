"""The shipped pre-commit hooks, run by pre-commit itself from a scratch git repository (offline).

pre-commit is part of the `test` extra so that this runs in CI instead of being skipped. The hook
repository is a throwaway git repository holding this checkout's `.pre-commit-hooks.yaml` at one
commit (the file is what pre-commit reads from a hook repository; `language: system` hooks install
nothing), so the test checks the working tree's hook file, committed or not.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


def init_repo(path: Path) -> None:
    path.mkdir()
    git(path, "init", "-q")
    git(path, "config", "user.email", "test@example.com")
    git(path, "config", "user.name", "test")
    git(path, "config", "commit.gpgsign", "false")


def scratch_repositories(tmp_path: Path, hook: str) -> tuple[Path, list[str], dict]:
    """A hook repository holding this checkout's hook file, a user repository whose pre-commit config runs `hook`
    on a copy of mappings/llama.yaml: (the user repository, the pre-commit command, its environment)."""
    hooks = tmp_path / "hooks"
    init_repo(hooks)
    shutil.copy(ROOT / ".pre-commit-hooks.yaml", hooks / ".pre-commit-hooks.yaml")
    git(hooks, "add", ".")
    git(hooks, "commit", "-q", "-m", "hooks")
    rev = git(hooks, "rev-parse", "HEAD")

    user = tmp_path / "user"
    init_repo(user)
    (user / ".pre-commit-config.yaml").write_text(
        f"repos:\n  - repo: {hooks}\n    rev: {rev}\n    hooks:\n      - id: {hook}\n")
    (user / "mappings").mkdir()
    shutil.copy(ROOT / "mappings" / "llama.yaml", user / "mappings" / "llama.yaml")
    (user / "notes.yaml").write_text("not: [a mapping\n")  # outside mappings/: the hook must skip it
    git(user, "add", ".")

    env = {**os.environ, "PRE_COMMIT_HOME": str(tmp_path / "cache"),
           # `tpmap` of the interpreter running the tests, whatever PATH the caller has
           "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")}
    assert shutil.which("tpmap", path=env["PATH"]), "tpmap is not installed next to this python"
    return user, [sys.executable, "-m", "pre_commit", "run", "--all-files", "--color", "never"], env


def test_pre_commit_hook_from_a_scratch_repository(tmp_path):
    user, cmd, env = scratch_repositories(tmp_path, "tpmap-lint")

    ok = subprocess.run(cmd, cwd=user, env=env, capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "tpmap lint" in ok.stdout and "Passed" in ok.stdout

    text = (user / "mappings" / "llama.yaml").read_text()
    (user / "mappings" / "llama.yaml").write_text(text.replace("heads: num_key_value_heads", "heads: num_kv_heads"))
    bad = subprocess.run(cmd, cwd=user, env=env, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert "Failed" in bad.stdout
    assert ("mappings/llama.yaml:15:12: error: entry 1 (Column 'layers.*.self_attn.k_proj'): the LlamaConfig has "
            "no attribute 'num_kv_heads' (did you mean num_key_value_heads?) [config-attribute]") in bad.stdout


def test_schema_only_pre_commit_hook(tmp_path):
    """tpmap-lint-schema (`tpmap lint --schema-only`): a schema error fails the commit; a config attribute the model
    type's config lacks passes it, as documented (only the whole lint reads the config class)."""
    user, cmd, env = scratch_repositories(tmp_path, "tpmap-lint-schema")
    mapping = user / "mappings" / "llama.yaml"
    text = mapping.read_text()

    ok = subprocess.run(cmd, cwd=user, env=env, capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "tpmap lint --schema-only" in ok.stdout and "Passed" in ok.stdout

    mapping.write_text(text.replace("heads: num_key_value_heads", "heads: num_kv_heads"))
    missed = subprocess.run(cmd, cwd=user, env=env, capture_output=True, text=True, timeout=120)
    assert missed.returncode == 0 and "Passed" in missed.stdout, missed.stdout + missed.stderr

    mapping.write_text(text.replace("heads: num_key_value_heads", "haeds: num_key_value_heads", 1))
    bad = subprocess.run(cmd, cwd=user, env=env, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 1 and "Failed" in bad.stdout, bad.stdout + bad.stderr
    assert "mappings/llama.yaml:15:5: error: unknown key 'haeds' (did you mean heads?); " in bad.stdout
    assert bad.stdout.count(": error: ") == 1 and "[unknown-key]" in bad.stdout
