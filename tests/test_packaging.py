"""The wheel installs `tpmap` and `tpmap.engine` (no top-level `engine`) and ships the YAML mappings."""
from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_wheel_contents(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q",
                    "-w", str(tmp_path), str(ROOT)], check=True, capture_output=True, timeout=300)
    wheel = next(tmp_path.glob("tpmap-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    assert "tpmap/__init__.py" in names and "tpmap/engine/plan.py" in names
    # every module of the source tree ships (pyproject lists packages one by one: a new subpackage is easy to miss)
    sources = {f"tpmap/{p.relative_to(ROOT / 'tpmap')}" for p in (ROOT / "tpmap").rglob("*.py")}
    sources |= {f"tpmap/engine/{p.relative_to(ROOT / 'engine')}" for p in (ROOT / "engine").rglob("*.py")}
    assert sources - names == set(), "add these packages to pyproject.toml's [tool.setuptools] packages"
    assert not any(n.startswith("engine/") for n in names)
    shipped = {p.name for p in (ROOT / "mappings").glob("*.yaml")}
    assert shipped and {f"tpmap/mappings/{n}" for n in shipped} <= names
    assert "tpmap/mappings/mapping.schema.json" in names  # what each YAML's $schema line points at
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    assert "tpmap = tpmap.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()
