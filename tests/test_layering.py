"""The floor plan holds: the mapping language (tpmap.language) at the bottom, the engine over it, the API,
checkpoints and tools on top. Read from the source with `ast`, so a new import that breaks a layer or
closes a cycle fails here, whatever the tests that run it."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# cli.py and package __init__ files may import lazily (`tpmap --help` and `import tpmap` stay fast)
LAZY_ALLOWED = {"tpmap/cli.py", "tpmap/__init__.py"}
MAX_LAZY = 5  # function-local project imports anywhere else


def _modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the installed package (engine/ is tpmap.engine)."""
    out = {}
    for folder, package in (("tpmap", "tpmap"), ("engine", "tpmap.engine")):
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join([package, *parts])] = path
    return out


MODULES = _modules()


def _imports(path: Path, module: str) -> list[tuple[str, bool]]:
    """(imported project module, at module level) for every import of `path`."""
    tree = ast.parse(path.read_text())
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    top = {id(n) for n in tree.body} | {id(n) for node in tree.body if isinstance(node, ast.If) for n in node.body}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        else:
            continue
        out += [(n, id(node) in top) for n in names if n == "tpmap" or n.startswith("tpmap.")]
    return out


IMPORTS = {m: _imports(p, m) for m, p in MODULES.items()}


def _rel(module: str) -> str:
    return str(MODULES[module].relative_to(ROOT))


def test_the_mapping_language_imports_nothing_above_it():
    bad = [(m, n) for m, imps in IMPORTS.items() if m.startswith("tpmap.language") for n, _ in imps
           if not n.startswith("tpmap.language")]
    assert not bad, bad


def test_the_engine_imports_only_the_mapping_language():
    bad = [(m, n) for m, imps in IMPORTS.items() if m.startswith("tpmap.engine") for n, _ in imps
           if not n.startswith(("tpmap.language", "tpmap.engine"))]
    assert not bad, bad


def test_few_function_local_project_imports():
    lazy = [(_rel(m), n) for m, imps in IMPORTS.items() if _rel(m) not in LAZY_ALLOWED for n, top in imps if not top]
    assert len(lazy) <= MAX_LAZY, lazy


def test_no_import_cycle():
    graph = {m: sorted({n for n, top in imps if top and n in MODULES and n != m}) for m, imps in IMPORTS.items()}
    # a package's __init__ that imports its submodules is not a cycle with them: their own imports of the
    # package name only reach names defined before (Python resolves submodules on their own)
    state: dict[str, int] = {}
    cycles = []

    def visit(m, stack):
        state[m] = 1
        for n in graph[m]:
            if state.get(n) == 1:
                cycle = stack[stack.index(n):] + [n]
                if not all(c == cycle[0] or c.startswith(cycle[0] + ".") for c in cycle[1:-1]):
                    cycles.append(cycle)
            elif n not in state:
                visit(n, stack + [n])
        state[m] = 2

    for m in graph:
        if m not in state:
            visit(m, [m])
    assert not cycles, cycles


def test_the_oracle_sees_a_planted_upward_import(tmp_path):
    """The parser finds an upward import when one is there (the checks above cannot pass vacuously)."""
    planted = tmp_path / "x.py"
    planted.write_text("from tpmap.api import apply\n\ndef f():\n    from tpmap import verify\n")
    assert _imports(planted, "tpmap.engine.x") == [("tpmap.api", True), ("tpmap.verify", False)]
    assert len(IMPORTS["tpmap.engine.planner"]) > 3 and len(MODULES) > 40


def test_the_file_map_names_every_module():
    """docs/architecture.md's file map lists every module of tpmap/ and engine/, so a newcomer's map is whole."""
    page = (ROOT / "docs" / "architecture.md").read_text()
    missing = [_rel(m) for m in MODULES if f"`{_rel(m)}`" not in page]
    assert not missing, f"add these to docs/architecture.md's file map: {missing}"
