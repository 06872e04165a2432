"""The library's shape (issue 22): `gyre_core` never imports what is built around it (Prefect, the flows and
tasks, the CLI, gyre_ops, the benchmarks), and its modules import each other without cycles.

    .venv/bin/python -m pytest tests/core/test_architecture.py -q -p no:cacheprovider

Every module is found by walking gyre_core/ for .py files (a package's `__init__.py` is the package; a
directory without one is a namespace package, which has no module of its own). Nothing is skipped.
Many modules import their heavy dependencies inside functions, so besides importing every module with the
forbidden packages blocked, each file is parsed and every import at any depth is read: `import x`,
`from x import y` (relative ones resolved), and `importlib.import_module("x")` / `__import__("x")` with a
literal name.
"""
from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LIBRARY = "gyre_core"
# Prefect, the flows, the tasks, the benchmarks, the operations tools and the CLI (top-level names)
FORBIDDEN = ("prefect", "flows", "tasks", "bench", "gyre_ops", "gyre_cli")


# ---- reading the package ----------------------------------------------------------------------------
@dataclass
class Module:
    name: str
    path: Path
    is_package: bool                      # an __init__.py
    imports: list[tuple[int, str, tuple[str, ...]]] = field(default_factory=list)   # (line, module, names)


def modules(root: Path, package: str) -> dict[str, Module]:
    """Every module of `package` (the directory `root/package`) by dotted name, with every import it makes."""
    out = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if not all(p.isidentifier() for p in parts):     # data, not modules: e.g. a coding task's package source
            continue
        is_package = parts[-1] == "__init__"
        if is_package:
            parts.pop()
        m = Module(".".join(parts), path, is_package)
        m.imports = _imports(m)
        out[m.name] = m
    return out


def _absolute(m: Module, level: int, target: str | None) -> str:
    """The absolute module a `from <level dots><target> import ...` in `m` names."""
    if level == 0:
        return target or ""
    base = m.name.split(".") if m.is_package else m.name.split(".")[:-1]
    if level - 1 > len(base) - 1:
        raise AssertionError(f"{m.path}: relative import beyond the top-level package")
    base = base[:len(base) - (level - 1)]
    return ".".join(base + ([target] if target else []))


def _literal_import(node: ast.Call) -> str | None:
    """`importlib.import_module("x")`, `import_module("x")` or `__import__("x", ...)`: "x"."""
    f = node.func
    name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
    if name in ("import_module", "__import__") and node.args and isinstance(node.args[0], ast.Constant) \
            and isinstance(node.args[0].value, str) and not node.args[0].value.startswith("."):
        return node.args[0].value
    return None


def _imports(m: Module) -> list[tuple[int, str, tuple[str, ...]]]:
    tree = ast.parse(m.path.read_text(), filename=str(m.path))
    found = []
    for node in ast.walk(tree):                   # module level, functions, classes, try/except, if ...
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name, ()) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            found.append((node.lineno, _absolute(m, node.level, node.module), tuple(a.name for a in node.names)))
        elif isinstance(node, ast.Call) and (target := _literal_import(node)):
            found.append((node.lineno, target, ()))
    return sorted(found)


def forbidden_imports(mods: dict[str, Module], root: Path = ROOT, forbidden=FORBIDDEN) -> list[str]:
    """`path:line imports NAME` for every import, at any depth, of one of the `forbidden` top-level names."""
    return [f"{m.path.relative_to(root)}:{line} imports {target}"
            for m in mods.values() for line, target, _ in m.imports if target.partition(".")[0] in forbidden]


# ---- the import graph and its cycles ----------------------------------------------------------------
def import_graph(mods: dict[str, Module], parents: bool = False) -> dict[str, dict[str, int]]:
    """module -> {module it imports: first line}, among `mods` only. `from p import x` imports the module
    p.x when there is one, else p; importing a package is importing its __init__ (a namespace package has
    none). With `parents`, the parent packages' __init__s an import also runs count too (`import a.b.c`
    runs a/__init__ and a/b/__init__), except the importing module's own ancestors (already running)."""
    graph: dict[str, dict[str, int]] = {name: {} for name in mods}
    for m in mods.values():
        for line, target, names in m.imports:
            if names:                       # from target import names: each a submodule, or from target
                subs = [f"{target}.{n}" for n in names if f"{target}.{n}" in mods]
                hits = subs + ([target] if len(subs) < len(names) else [])
            else:                           # import target
                hits = [target]
            if parents:
                own = {m.name.rsplit(".", k)[0] for k in range(1, m.name.count(".") + 1)}
                hits += [p for t in hits for p in (t.rsplit(".", k)[0] for k in range(1, t.count(".") + 1))
                         if p not in own]
            for t in hits:
                if t in mods and t != m.name:
                    graph[m.name].setdefault(t, line)
    return graph


def strongly_connected(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module, each sorted (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        work = [(root, iter(sorted(graph[root])))]
        while work:
            v, edges = work[-1]
            for w in edges:
                if w not in index:                  # descend; v's remaining edges wait on the iterator
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:                                   # v is done
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    component = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        component.append(w)
                        if w == v:
                            break
                    if len(component) > 1:
                        out.append(sorted(component))
    return sorted(out)


def describe_cycles(mods: dict[str, Module], parents: bool = False) -> list[str]:
    """One line per cycle: its modules and the imports between them (`a:LINE -> b`)."""
    graph = import_graph(mods, parents)
    lines = []
    for component in strongly_connected(graph):
        inside = set(component)
        edges = [f"{a}:{line} -> {b}" for a in component for b, line in sorted(graph[a].items()) if b in inside]
        lines.append(f"{' <-> '.join(component)}  ({'; '.join(edges)})")
    return lines


# ---- gyre_core ---------------------------------------------------------------------------------------
_IMPORT_ALL = textwrap.dedent("""
    import importlib, json, sys, traceback

    blocked, names, out = set(json.loads(sys.argv[1])), json.loads(sys.argv[2]), sys.argv[3]

    class Blocked:
        def find_spec(self, name, path=None, target=None):
            if name.partition(".")[0] in blocked:
                raise ImportError(f"blocked import of {name!r}")
            return None

    sys.meta_path.insert(0, Blocked())
    failed = {}
    for name in names:
        try:
            importlib.import_module(name)
        except (Exception, SystemExit) as e:
            where = [f for f in traceback.extract_tb(e.__traceback__) if "/gyre_core/" in f.filename]
            at = f" (at {where[-1].filename}:{where[-1].lineno})" if where else ""
            failed[name] = f"{type(e).__name__}: {e}{at}"
    with open(out, "w") as f:
        json.dump(failed, f)
""")


@pytest.mark.parametrize("order", ["sorted", "reversed"])   # an import that works only after another is found
def test_every_library_module_imports_with_the_forbidden_packages_blocked(tmp_path, order):
    names = sorted(modules(ROOT, LIBRARY), reverse=order == "reversed")
    out = tmp_path / "failed.json"
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "TOKENIZERS_PARALLELISM": "false", "DO_NOT_TRACK": "1"}
    # cwd is the repository root, so flows/, tasks/, bench/ and gyre_ops/ are importable: only the finder stops them
    proc = subprocess.run([sys.executable, "-c", _IMPORT_ALL, json.dumps(FORBIDDEN), json.dumps(names), str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    failed = json.loads(out.read_text())
    assert not failed, "modules of gyre_core that do not import with " + ", ".join(FORBIDDEN) + " blocked:\n" + \
        "\n".join(f"  {k}: {v}" for k, v in failed.items())
    assert len(names) > 40 and "gyre_core.lake.sql" in names      # the walk found the package


def test_no_library_module_imports_a_forbidden_package_even_lazily():
    found = forbidden_imports(modules(ROOT, LIBRARY))
    assert not found, "gyre_core must not import " + ", ".join(FORBIDDEN) + ":\n" + "\n".join(f"  {x}" for x in found)


def test_no_import_cycle_among_library_modules():
    cycles = describe_cycles(modules(ROOT, LIBRARY), parents=True)
    assert not cycles, "import cycles among gyre_core modules:\n" + "\n".join(f"  {c}" for c in cycles)


# the elastic scheduler knows work through its `Work` protocol: nothing of runs, phases or their reports
ABOVE_ELASTIC = ("gyre_core.phases", "gyre_core.run", "gyre_core.report", "gyre_core.tracking")


def test_the_elastic_package_imports_nothing_above_it():
    graph = import_graph(modules(ROOT, LIBRARY), parents=True)
    found = [f"{m}:{line} -> {t}" for m, edges in graph.items() if m.startswith("gyre_core.elastic")
             for t, line in edges.items() if t.startswith(ABOVE_ELASTIC)]
    assert not found, "gyre_core.elastic imports from above it:\n" + "\n".join(f"  {x}" for x in found)


# ---- the checks themselves, on small packages ---------------------------------------------------------
def _package(root: Path, files: dict[str, str]) -> dict[str, Module]:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(textwrap.dedent(text))
    return modules(root, "pkg")


def test_cycle_detector_finds_lazy_and_relative_cycles_and_nothing_else(tmp_path):
    mods = _package(tmp_path / "cycle", {
        "pkg/__init__.py": "",
        "pkg/a.py": "def f():\n    from pkg import b\n",          # lazy, inside a function
        "pkg/b.py": "from . import a\n",                             # relative, a submodule
        "pkg/c.py": "import pkg.sub\n",                              # a package: its __init__
        "pkg/sub/__init__.py": "class K:\n    def m(self):\n        from .. import c\n",
        "pkg/sub/d.py": "from pkg.a import f\nfrom ..sub import e\n",  # d -> a, d -> e: no way back
        "pkg/sub/e.py": "import json\nfrom pkg import a as _a\n",
    })
    graph = import_graph(mods)
    assert graph["pkg.b"] == {"pkg.a": 1} and graph["pkg.c"] == {"pkg.sub": 1}
    assert graph["pkg.sub"] == {"pkg.c": 3} and graph["pkg.sub.d"] == {"pkg.a": 1, "pkg.sub.e": 2}
    assert strongly_connected(graph) == [["pkg.a", "pkg.b"], ["pkg.c", "pkg.sub"]]
    assert describe_cycles(mods)[0] == "pkg.a <-> pkg.b  (pkg.a:2 -> pkg.b; pkg.b:1 -> pkg.a)"

    chain = _package(tmp_path / "chain", {
        "pkg/__init__.py": "", "pkg/a.py": "import pkg.b\n", "pkg/b.py": "def f():\n    from pkg import c\n",
        "pkg/c.py": "import pkg\nimport pkg.c\n",       # its package's __init__ and itself: no cycle of two
    })
    assert import_graph(chain)["pkg.c"] == {"pkg": 1} and strongly_connected(import_graph(chain)) == []

    # through a parent package's __init__: c imports pkg.sub.d, which runs pkg/sub/__init__, which imports c
    hidden = _package(tmp_path / "hidden", {
        "pkg/__init__.py": "", "pkg/c.py": "from pkg.sub.d import x\n",
        "pkg/sub/__init__.py": "from pkg import c\n", "pkg/sub/d.py": "x = 1\nfrom pkg.sub import e\n",
        "pkg/sub/e.py": "",
    })
    assert strongly_connected(import_graph(hidden)) == []          # only what the imports name
    assert import_graph(hidden, parents=True)["pkg.c"] == {"pkg.sub.d": 1, "pkg.sub": 1}
    assert import_graph(hidden, parents=True)["pkg.sub.d"] == {"pkg.sub.e": 2}   # not its own package
    assert strongly_connected(import_graph(hidden, parents=True)) == [["pkg.c", "pkg.sub"]]

    # a longer ring, entered from outside it: one component of three
    ring = {"x": {"a": 1}, "a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1, "d": 1}, "d": {}}
    assert strongly_connected(ring) == [["a", "b", "c"]]


def test_forbidden_imports_are_found_at_any_depth(tmp_path):
    mods = _package(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/a.py": "import json\n\ndef f():\n    try:\n        import prefect.flows\n    except ImportError:\n"
                    "        pass\n",
        "pkg/b.py": "class C:\n    def m(self):\n        from bench.lake import x\n        from .a import f\n",
        "pkg/c.py": "import importlib\nM = importlib.import_module('gyre_ops.stack')\nN = __import__('json')\n",
        "pkg/d.py": "import flowsy, tasks_extra, benchmark\nfrom pkg import a\n",   # names that only start alike
    })
    assert forbidden_imports(mods, root=tmp_path) == [
        "pkg/a.py:5 imports prefect.flows", "pkg/b.py:3 imports bench.lake", "pkg/c.py:2 imports gyre_ops.stack"]


# ---- every name imported from the project exists ------------------------------------------------------
PROJECT = ("gyre_core", "gyre_ops", "gyre_cli", "bench", "flows", "tasks")


def top_level_names(m: Module) -> set[str]:
    """What `from m import NAME` can take without running m: its top-level functions, classes, assigned and
    imported names (inside top-level if/try blocks too); None of them when m uses `import *`."""
    names: set[str] = set()

    def visit(body):
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                for t in (node.targets if isinstance(node, ast.Assign) else [node.target]):
                    names.update(n.id for n in ast.walk(t) if isinstance(n, ast.Name))
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                for a in node.names:
                    if a.name == "*":
                        names.add("*")
                    names.add(a.asname or a.name.partition(".")[0])
            elif isinstance(node, (ast.If, ast.Try, ast.With)):
                visit(node.body)
                for extra in (getattr(node, "orelse", []), getattr(node, "finalbody", []),
                              *[h.body for h in getattr(node, "handlers", [])]):
                    visit(extra)
    visit(ast.parse(m.path.read_text(), filename=str(m.path)).body)
    return names


def unresolved_imports(mods: dict[str, Module], root: Path = ROOT) -> list[str]:
    """`path:line: from X import NAME` for each import (at any depth, lazy ones included) of a module of
    `mods` that does not exist, or of a name it neither defines at top level nor has as a submodule."""
    out, tops = [], {name.partition(".")[0] for name in mods}
    defined = {}
    for m in mods.values():
        for line, target, names in m.imports:
            if target.partition(".")[0] not in tops:
                continue
            where = f"{m.path.relative_to(root)}:{line}"
            if target not in mods:
                if not any(n and f"{target}.{n}" in mods for n in names):
                    out.append(f"{where}: no module {target}")
                continue
            have = defined.setdefault(target, top_level_names(mods[target]))
            if "*" in have:
                continue
            out += [f"{where}: from {target} import {n}" for n in names
                    if n != "*" and n not in have and f"{target}.{n}" not in mods]
    return out


def test_every_name_imported_from_the_project_exists():
    """A lazy import inside a function runs only when that function does: a name moved or renamed elsewhere
    broke `gyre bench prefect` and `gyre bench cells` (they imported a `_free_port` no longer there) and
    nothing in the suite ran them."""
    mods = {}
    for package in PROJECT:
        mods.update(modules(ROOT, package))
    found = unresolved_imports(mods)
    assert not found, "imports of names that do not exist:\n" + "\n".join(f"  {x}" for x in found)
    assert len(mods) > 100


def test_unresolved_imports_are_found_lazy_relative_and_of_missing_modules(tmp_path):
    mods = _package(tmp_path, {
        "pkg/__init__.py": "from pkg.a import f\n",
        "pkg/a.py": "import os\nX: int = 1\nif os.name:\n    def f():\n        from pkg.b import gone\n"
                    "else:\n    f = None\ntry:\n    from json import dumps as g\nexcept ImportError:\n    g = None\n",
        "pkg/b.py": "def h():\n    from pkg.a import f, g, X, os, missing\n    from . import a, nosuch\n"
                    "    from pkg.sub import deep\n    import pkg.nowhere\n",
        "pkg/sub/__init__.py": "", "pkg/sub/deep.py": "",
        "pkg/c.py": "from pkg.star import anything\n", "pkg/star.py": "from os.path import *\n",
    })
    assert unresolved_imports(mods, root=tmp_path) == [
        "pkg/a.py:5: from pkg.b import gone", "pkg/b.py:2: from pkg.a import missing",
        "pkg/b.py:3: from pkg import nosuch", "pkg/b.py:5: no module pkg.nowhere"]
