"""The fault table and its figures.

    gyre bench faults [--json] [--quick]     # run every test marked `fault` or `bad_input`; the counts
    gyre bench faults --table                # the fault table (docs/faults.md) from the tests' markers
    python -m bench.faults --write           # ... written into docs/faults.md

A test proves a row of the table by carrying `@pytest.mark.fault("fault", "what Gyre promises")`; a test
of bad input carries `@pytest.mark.bad_input("what")`. The table is read from those markers in the test
sources (no test is imported), so it cannot name a test that does not exist. The counts come from a pytest
run of exactly those tests: `faults_tried` / `faults_survived` and `bad_inputs_tried` /
`bad_inputs_refused` are test items (a parametrized test counts once per case), and `executions_lost` /
`executions_duplicated` are what the fault tests counted in the lake after resuming (tests/conftest.py).
"""
from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TABLE_START = "<!-- fault table: `gyre bench faults --table` writes what follows, from the tests' markers -->"
TABLE_END = "<!-- end of the fault table -->"


@dataclass(frozen=True)
class Row:
    fault: str
    promise: str
    test: str          # tests/core/test_x.py::test_name


def _marks(fn: ast.FunctionDef, kind: str) -> list[list[str]]:
    out = []
    for d in fn.decorator_list:
        if (isinstance(d, ast.Call) and isinstance(d.func, ast.Attribute) and d.func.attr == kind
                and isinstance(d.func.value, ast.Attribute) and d.func.value.attr == "mark"):
            out.append([a.value for a in d.args if isinstance(a, ast.Constant)])
    return out


def marked(kind: str, root: Path = ROOT) -> list[tuple[str, list[str]]]:
    """(test id, marker arguments) of every test function in tests/ marked `kind`, in file order."""
    found = []
    for path in sorted((root / "tests").rglob("test_*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for args in _marks(node, kind):
                    found.append((f"{path.relative_to(root)}::{node.name}", args))
    return found


def fault_rows(root: Path = ROOT) -> list[Row]:
    return [Row(args[0], args[1], test) for test, args in marked("fault", root)]


def render_table(rows: list[Row]) -> str:
    """One line per fault (its tests together), in the order the tests come."""
    by_fault: dict[tuple[str, str], list[str]] = {}
    for r in rows:
        by_fault.setdefault((r.fault, r.promise), []).append(r.test)
    lines = ["| fault | what Gyre promises | the test that proves it |", "|---|---|---|"]
    for (fault, promise), tests in by_fault.items():
        cell = "<br>".join(f"`{t}`" for t in tests)
        lines.append(f"| {fault} | {promise} | {cell} |")
    return "\n".join(lines)


def render_bad_inputs(root: Path = ROOT) -> str:
    """The bad-input tests, a line each."""
    lines = ["| bad input | refused by |", "|---|---|"]
    lines += [f"| {args[0]} | `{test}` |" for test, args in marked("bad_input", root)]
    return "\n".join(lines)


def render(root: Path = ROOT) -> str:
    """What `gyre bench faults --table` prints and docs/faults.md holds: both tables."""
    return render_table(fault_rows(root)) + "\n\nBad input:\n\n" + render_bad_inputs(root)


def table_in(doc: str) -> str:
    """The generated table as it stands in a document."""
    start, end = doc.index(TABLE_START) + len(TABLE_START), doc.index(TABLE_END)
    return doc[start:end].strip()


def bench_faults(quick: bool = False) -> dict:
    """Run the marked tests (`quick`: those under tests/core only) and return the counts."""
    where = ["tests/core"] if quick else ["tests"]
    with tempfile.TemporaryDirectory() as tmp:
        summary = Path(tmp) / "faults.json"
        env = dict(os.environ, GYRE_FAULT_SUMMARY=str(summary))
        t0 = time.time()
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m",
                               "fault or bad_input", *where], cwd=ROOT, env=env, stdout=sys.stderr)
        if not summary.exists():
            raise RuntimeError(f"the fault tests did not run (pytest exited with {proc.returncode})")
        result = json.loads(summary.read_text())
    result.update(wall_s=round(time.time() - t0, 1), pytest_rc=proc.returncode,
                  faults_listed=len({(r.fault, r.promise) for r in fault_rows()}), scope=" ".join(where))
    return result


def write_doc(path: Path = ROOT / "docs" / "faults.md") -> None:
    """Put the tables from the markers into docs/faults.md (`python -m bench.faults --write`)."""
    doc = path.read_text()
    start, end = doc.index(TABLE_START) + len(TABLE_START), doc.index(TABLE_END)
    path.write_text(doc[:start] + "\n" + render() + "\n" + doc[end:])


if __name__ == "__main__":
    if sys.argv[1:] == ["--write"]:
        write_doc()
    else:
        print(render())
