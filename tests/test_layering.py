"""The floor plan holds. Every module of tpmap/ and engine/ stands on one floor and imports only its own floor
or lower ones; the package root (`tpmap/__init__.py`) and `tpmap.errors` are the public facade, which may
import any floor and which no library module imports (a module that does closes a cycle through the root).

Read from the source with `ast`, so a new import that breaks a floor or closes a cycle fails here, whatever
the tests that run it. An import counts wherever it is: at module level, inside a function (a lazy import is
still a dependency), or as `importlib.import_module("tpmap.x")` / `__import__("tpmap.x")` with a literal name.
Only module-level imports can close an import-time cycle, so only they make the cycle graph."""
from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Lowest first. A name covers the module itself and everything under it (`tpmap.lint` covers tpmap/lint/*.py),
# so a new engine/*.py lands on the engine floor by its prefix. A new module anywhere else must be added here.
FLOORS = (
    ("mapping language", ("tpmap.language",)),
    ("engine", ("tpmap.engine",)),
    ("api", ("tpmap.api", "tpmap.api_errors", "tpmap.input_check", "tpmap.loss_parallel", "tpmap.compat",
             "tpmap.prepare", "tpmap.execute")),
    # checkpoint and peft are one floor in the docs; inside it peft stands on checkpoint (peft/adapters.py
    # registers its saving with checkpoint/save.py's delegate_saving) and checkpoint never imports peft
    ("checkpoint", ("tpmap.checkpoint",)),
    ("peft", ("tpmap.peft",)),
    # training state (checkpoints of model + optimizer + RNG, resharding, Trainer): over checkpoint and peft
    ("training", ("tpmap.training",)),
    ("parallelize", ("tpmap.parallelize",)),
    ("tools", ("tpmap.verify", "tpmap.verify_model", "tpmap.demo", "tpmap.plan_report", "tpmap.lint", "tpmap.draft",
               "tpmap.catalog", "tpmap.meta",
               "tpmap.tool_errors")),
    ("cli", ("tpmap.cli", "tpmap.__main__")),
)
FACADE = {"tpmap", "tpmap.errors"}  # exact names: `tpmap.errors` is the facade, `tpmap.engine.errors` is not
# cli.py and package __init__ files may import lazily (`tpmap --help` and `import tpmap` stay fast)
LAZY_ALLOWED = {"tpmap/cli.py", "tpmap/__init__.py"}
MAX_LAZY = 5  # function-local project imports anywhere else
IMPORTERS = {"import_module", "__import__"}  # importlib.import_module(...), import_module(...), __import__(...)


def find_modules(root: Path = ROOT) -> dict[str, Path]:
    """Dotted module name -> file, for every module of the installed package (engine/ is tpmap.engine)."""
    out = {}
    for folder, package in (("tpmap", "tpmap"), ("engine", "tpmap.engine")):
        for path in sorted((root / folder).rglob("*.py")):
            parts = list(path.relative_to(root / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join([package, *parts])] = path
    return out


def _lazy_nodes(tree: ast.Module) -> set[int]:
    """ids of every node inside a function or lambda: what runs at call time, not at import time."""
    inner = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            inner |= {id(n) for n in ast.walk(node) if n is not node}
    return inner


def _literal_import(node: ast.Call, package: str) -> str | None:
    """The module a call `import_module("x")` / `__import__("x")` names, when the name is a literal."""
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
    if name not in IMPORTERS or not node.args or not isinstance(node.args[0], ast.Constant):
        return None
    target = node.args[0].value
    if not isinstance(target, str):
        return None
    if target.startswith("."):  # relative: against a literal package= or this module's own package
        anchor = next((k.value.value for k in node.keywords
                       if k.arg == "package" and isinstance(k.value, ast.Constant)), package)
        level = len(target) - len(target.lstrip("."))
        parent = anchor.split(".")[: len(anchor.split(".")) - level + 1]
        target = ".".join(parent + [target.lstrip(".")]).rstrip(".")
    return target


@functools.cache
def imports_of(path: Path, module: str, known: frozenset[str]) -> list[tuple[str, bool]]:
    """(imported project module, at module level) for every import of `path`. `from a import b` names `a.b`
    when that is a module in `known`, else `a` (so `from tpmap import apply` names the facade `tpmap`)."""
    tree = ast.parse(path.read_text())
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    lazy = _lazy_nodes(tree)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        elif isinstance(node, ast.Call) and (target := _literal_import(node, package)):
            names = [target]
        else:
            continue
        out += [(n, id(node) not in lazy) for n in names if n == "tpmap" or n.startswith("tpmap.")]
    return out


def floor_of(module: str) -> int | None:
    """Index in FLOORS of the floor `module` stands on; None for the facade or a module no floor names."""
    if module in FACADE:
        return None
    for i, (_, names) in enumerate(FLOORS):
        if any(module == n or module.startswith(n + ".") for n in names):
            return i
    return None


def _cycles(graph: dict[str, list[str]]) -> list[list[str]]:
    """Every cycle a depth-first walk meets, except a package's __init__ with its own submodules (their own
    imports of the package name reach only names defined before). The root package is never excused."""
    state: dict[str, int] = {}
    cycles = []

    def excused(cycle):
        return any(p != "tpmap" and all(c == p or c.startswith(p + ".") for c in cycle) for p in cycle)

    def visit(m, stack):
        state[m] = 1
        for n in graph[m]:
            if state.get(n) == 1:
                cycle = stack[stack.index(n):] + [n]
                if not excused(cycle):
                    cycles.append(cycle)
            elif n not in state:
                visit(n, stack + [n])
        state[m] = 2

    for m in graph:
        if m not in state:
            visit(m, [m])
    return cycles


def check(modules: dict[str, Path]) -> dict[str, list[str]]:
    """Every violation of the floor plan in `modules`, by kind: 'unassigned', 'facade', 'upward', 'cycle'."""
    known = frozenset(modules)
    imports = {m: imports_of(p, m, known) for m, p in modules.items()}
    found = {"unassigned": [], "facade": [], "upward": [], "cycle": []}
    for m, imps in imports.items():
        if m in FACADE:
            continue
        here = floor_of(m)
        if here is None:
            found["unassigned"].append(f"{m} ({modules[m]}) stands on no floor: add it to FLOORS in "
                                       "tests/test_layering.py (and a row to docs/architecture.md's file map)")
            continue
        for n, top in imps:
            where = "" if top else " (inside a function)"
            if n in FACADE:
                found["facade"].append(f"{m} imports the facade {n}{where}: import from the module that "
                                       "defines the name (the root package imports every floor: a cycle)")
            elif n in known and floor_of(n) is not None and floor_of(n) > here:
                found["upward"].append(f"{m} (floor {FLOORS[here][0]}) imports {n} (floor "
                                       f"{FLOORS[floor_of(n)][0]}){where}")
    graph = {m: sorted({n for n, top in imps if top and n in known and n != m}) for m, imps in imports.items()}
    found["cycle"] = [" -> ".join(c) for c in _cycles(graph)]
    return found


MODULES = find_modules()
FOUND = check(MODULES)


def _rel(module: str) -> str:
    return str(MODULES[module].relative_to(ROOT))


def test_every_module_stands_on_a_floor():
    assert not FOUND["unassigned"], "\n".join(FOUND["unassigned"])


def test_no_library_module_imports_the_facade():
    assert not FOUND["facade"], "\n".join(FOUND["facade"])


def test_each_floor_imports_only_its_own_or_lower_ones():
    assert not FOUND["upward"], "\n".join(FOUND["upward"])


def test_no_import_cycle():
    assert not FOUND["cycle"], "\n".join(FOUND["cycle"])


def test_few_function_local_project_imports():
    known = frozenset(MODULES)
    lazy = [(_rel(m), n) for m, p in MODULES.items() if _rel(m) not in LAZY_ALLOWED
            for n, top in imports_of(p, m, known) if not top]
    assert len(lazy) <= MAX_LAZY, lazy


def _planted(tmp_path: Path, module: str, extra: str) -> dict[str, Path]:
    """The real tree with `extra` appended to `module`'s source (a module not in the tree is new)."""
    path = tmp_path / (module.replace(".", "_") + ".py")
    real = MODULES.get(module)
    path.write_text((real.read_text() if real else "") + "\n" + extra)
    return {**MODULES, module: path}


PLANTS = {
    # (a) a cycle through the package root: api imports the facade, which imports api
    "root cycle (import)": ("tpmap.api", "import tpmap\n", {"facade", "cycle"}),
    "root cycle (from)": ("tpmap.api", "from tpmap import apply\n", {"facade", "cycle"}),
    "the errors facade": ("tpmap.engine.shard", "from tpmap.errors import TpmapError\n", {"facade"}),
    "a cycle inside a floor": ("tpmap.api_errors", "from tpmap.api import apply\n", {"cycle"}),
    # (b) an upper floor importing a higher one, lazily
    "api imports cli": ("tpmap.input_check", "def f():\n    from tpmap import cli\n", {"upward"}),
    # (c) imports by a literal name, invisible to a plain import scan
    "import_module": ("tpmap.loss_parallel", "import importlib\n\ndef f():\n"
                      "    return importlib.import_module('tpmap.checkpoint.load')\n", {"upward"}),
    "__import__": ("tpmap.compat", "X = __import__('tpmap.parallelize.handle')\n", {"upward", "cycle"}),
    # (d) the engine importing upward
    "engine imports api": ("tpmap.engine.planner", "def f():\n    from tpmap.api import apply\n", {"upward"}),
    # (peft/adapters.py imports checkpoint/save.py at module level: this closes a cycle too)
    "checkpoint imports peft": ("tpmap.checkpoint.save", "from tpmap.peft import adapters\n", {"upward", "cycle"}),
    "a module on no floor": ("tpmap.newthing", "X = 1\n", {"unassigned"}),
}


@pytest.mark.parametrize("name", PLANTS)
def test_the_checker_reports_a_planted_violation(tmp_path, name):
    """Each kind of violation planted into a copy of one module is reported, and only that kind: the checks
    above cannot pass vacuously (the real tree passes them, asserted here too)."""
    module, extra, kinds = PLANTS[name]
    assert not any(FOUND.values()), FOUND
    found = check(_planted(tmp_path, module, extra))
    assert {k for k, v in found.items() if v} == kinds, found
    assert all(module in line for k in kinds for line in found[k]), found


def test_the_parser_sees_every_form_of_import(tmp_path):
    planted = tmp_path / "x.py"
    planted.write_text("import importlib\nfrom tpmap.api import apply\nfrom . import shard\n\n"
                       "def f():\n    from tpmap import verify\n    importlib.import_module('.sequence', "
                       "package='tpmap.engine')\n    __import__('tpmap.cli')\n")
    got = imports_of(planted, "tpmap.engine.x", frozenset(MODULES))
    assert got == [("tpmap.api", True), ("tpmap.engine.shard", True), ("tpmap.verify", False),
                   ("tpmap.engine.sequence", False), ("tpmap.cli", False)], got
    assert len(imports_of(MODULES["tpmap.engine.planner"], "tpmap.engine.planner", frozenset(MODULES))) > 3
    assert len(MODULES) > 40


def test_the_file_map_names_every_module():
    """docs/architecture.md's file map lists every module of tpmap/ and engine/, so a newcomer's map is whole."""
    page = (ROOT / "docs" / "architecture.md").read_text()
    missing = [_rel(m) for m in MODULES if f"`{_rel(m)}`" not in page]
    assert not missing, f"add these to docs/architecture.md's file map: {missing}"


# Functions no longer than this, outside tests: a longer one is split into named steps, or listed here with why.
MAX_FUNCTION_LINES = 80
LONG_FUNCTIONS: dict[str, str] = {}  # "path:function" -> why it stays long


def long_functions(root: Path = ROOT, folders=("tpmap", "engine", "benchmarks", "examples")) -> list[str]:
    out = []
    for folder in folders:
        for path in sorted((root / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    lines = node.end_lineno - node.lineno + 1
                    key = f"{path.relative_to(root)}:{node.name}"
                    if lines > MAX_FUNCTION_LINES and key not in LONG_FUNCTIONS:
                        out.append(f"{key} ({lines} lines)")
    return out


def test_no_function_over_80_lines():
    assert not long_functions(), "split into named steps (or list in LONG_FUNCTIONS with why)"


def test_the_length_check_sees_a_long_function(tmp_path):
    (tmp_path / "tpmap").mkdir()
    (tmp_path / "tpmap" / "x.py").write_text("def f():\n" + "    x = 1\n" * 80 + "\n\ndef g():\n    return 1\n")
    assert long_functions(tmp_path, ("tpmap",)) == ["tpmap/x.py:f (81 lines)"]
