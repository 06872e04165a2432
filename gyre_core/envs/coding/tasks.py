"""Repository tasks scored by tests, and the builder that makes them from a package with a test suite.

    tasks, stats = build_tasks(PackageSource.of(dir, "test_x.py", ["x/__init__.py"]))
    save_tasks(path, source, tasks);  source, tasks = load_tasks(path)

Two kinds, as SWE-smith synthesises tasks from real repositories and NL2Repo asks for code from specs:

- **fix**: one small mutation inside a function (a comparison or arithmetic operator swapped, `and`/`or`
  swapped, an integer constant off by one, a boolean flipped, a `not` dropped) that makes some of the
  package's own tests fail;
- **implement**: a function's body removed (its signature and docstring kept: the spec) so that some tests
  fail.

A candidate is kept only when the original code passes the whole suite and the broken code fails at least
one test and errs in no collection: those failing tests are the task's hidden tests. Every command runs in
the sandbox (`gyre_core.sandbox`). A task stores the function's line range with its original and broken
text: applying the broken text makes the task's workspace, and applying the original back is the oracle
patch. Tasks are split into train and held-out by function (a function's tasks are all on one side).
"""
from __future__ import annotations

import ast
import hashlib
import json
import random
import re
import shutil
import sys
import tempfile
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass, field
from pathlib import Path

FIX, IMPLEMENT = "fix", "implement"
PACKAGES = Path(__file__).parent / "packages"          # shipped package sources
SHIPPED = Path(__file__).parent / "tasks"               # shipped task sets


@dataclass(slots=True)
class PackageSource:
    root: str                   # the package's source tree (tests included)
    test_path: str              # the test file, relative to root (withheld from the agent)
    modules: list[str]          # the files whose functions become tasks, relative to root
    name: str = ""

    @classmethod
    def of(cls, root, test_path: str, modules: list[str], name: str = "") -> "PackageSource":
        return cls(str(root), test_path, list(modules), name or Path(root).name)


@dataclass(slots=True)
class CodingTask:
    id: str                     # <package>/<kind>/<function>/<n>
    kind: str                   # FIX | IMPLEMENT
    path: str                   # the file it breaks, relative to the package root
    function: str
    start: int                  # the function's lines [start, end] (1-based, inclusive)
    end: int
    original: str               # those lines as shipped (the oracle)
    broken: str                 # those lines in the task's workspace
    hidden_tests: list[str]     # test ids that fail on the broken code and pass on the original
    split: str                  # "train" | "heldout"
    mutation: str = ""          # what was changed (never shown to the agent)

    def statement(self) -> str:
        """The task as the agent is given it."""
        if self.kind == IMPLEMENT:
            return (f"The function `{self.function}` in `{self.path}` is not implemented. Implement it as its "
                    "docstring says; hidden tests will check it.")
        return (f"The function `{self.function}` in `{self.path}` has a bug: some of the package's tests of it "
                "fail. Find the bug and fix it; hidden tests will check it.")


@dataclass(slots=True)
class BuildStats:
    candidates: int = 0
    kept: int = 0
    rejected: dict = field(default_factory=dict)     # why -> count


def apply_segment(text: str, start: int, end: int, segment: str) -> str:
    """`text` with lines [start, end] replaced by `segment` (which holds whole lines)."""
    lines = text.splitlines(keepends=True)
    return "".join(lines[:start - 1]) + segment + "".join(lines[end:])


# -- mutations ---------------------------------------------------------------------------------------

_SWAPS = {"==": "!=", "!=": "==", "<": "<=", "<=": "<", ">": ">=", ">=": ">", "in": "not in", "not in": "in",
          "is": "is not", "is not": "is", "+": "-", "-": "+", "*": "//", "//": "*", "%": "//", "and": "or", "or": "and"}
_OP_TOKEN = re.compile(r"not\s+in|is\s+not|==|!=|<=|>=|//|\band\b|\bor\b|\bin\b|\bis\b|[<>+\-*%]")


def _offsets(text: str) -> list[int]:
    """Character offset of each line's start (index 0 unused: ast lines are 1-based)."""
    starts, pos = [0, 0], 0
    for line in text.splitlines(keepends=True):
        pos += len(line)
        starts.append(pos)
    return starts


def _pos(text: str, starts: list[int], line: int, col_bytes: int) -> int:
    """ast's (line, UTF-8 byte column) as a character offset."""
    line_text = text[starts[line]:starts[line + 1]]
    return starts[line] + len(line_text.encode()[:col_bytes].decode(errors="ignore"))


def mutations(text: str, func: ast.FunctionDef) -> list[tuple[int, int, str, str]]:
    """Candidate single-token mutations inside `func`: (char start, char end, replacement, description)."""
    starts = _offsets(text)
    end_of = lambda n: _pos(text, starts, n.end_lineno, n.end_col_offset)   # noqa: E731
    start_of = lambda n: _pos(text, starts, n.lineno, n.col_offset)          # noqa: E731
    out = []
    body = func.body[1:] if ast.get_docstring(func) is not None else func.body
    for stmt in body:
        for node in ast.walk(stmt):
            gaps = []
            if isinstance(node, ast.Compare):
                operands = [node.left] + node.comparators
                gaps = [(end_of(a), start_of(b)) for a, b in zip(operands, operands[1:])]
            elif isinstance(node, ast.BinOp):
                gaps = [(end_of(node.left), start_of(node.right))]
            elif isinstance(node, ast.BoolOp):
                gaps = [(end_of(a), start_of(b)) for a, b in zip(node.values, node.values[1:])]
            for a, b in gaps:
                m = _OP_TOKEN.search(text, a, b)
                if m is not None:
                    tok = re.sub(r"\s+", " ", m.group(0))
                    if tok in _SWAPS:
                        out.append((m.start(), m.end(), _SWAPS[tok], f"{tok} -> {_SWAPS[tok]} at line {node.lineno}"))
            if isinstance(node, ast.Constant) and type(node.value) is int:
                out.append((start_of(node), end_of(node), str(node.value + 1),
                            f"{node.value} -> {node.value + 1} at line {node.lineno}"))
            elif isinstance(node, ast.Constant) and type(node.value) is bool:
                out.append((start_of(node), end_of(node), str(not node.value),
                            f"{node.value} -> {not node.value} at line {node.lineno}"))
            elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
                out.append((start_of(node), end_of(node), text[start_of(node.operand):end_of(node.operand)],
                            f"`not` dropped at line {node.lineno}"))
    return out


def unimplemented(text: str, func: ast.FunctionDef) -> str | None:
    """The function's lines with its body (after the docstring) replaced by `raise NotImplementedError`, or
    None for a function without a docstring (no spec to implement from)."""
    if ast.get_docstring(func) is None or len(func.body) < 2:
        return None
    lines = text.splitlines(keepends=True)
    doc = func.body[0]
    indent = re.match(r"\s*", lines[func.body[1].lineno - 1]).group(0)
    return "".join(lines[func.lineno - 1:doc.end_lineno]) + f"{indent}raise NotImplementedError\n"


# -- running a package's tests ---------------------------------------------------------------------------

@dataclass(slots=True)
class TestRun:
    passed: set[str]
    failed: set[str]            # failures and errors
    collected: bool             # the suite was collected without errors
    seconds: float


def run_tests(workspace: Path, test_path: str, limits=None) -> TestRun:
    """The package's test file run by pytest in a sandbox on `workspace`; per-test outcomes from its JUnit
    report. Raises `EvaluatorError` when the runner itself fails (timeout, no report)."""
    from ...sandbox import Sandbox, SandboxLimits

    report = workspace / ".gyre-report.xml"
    report.unlink(missing_ok=True)
    box = Sandbox(workspace, limits or SandboxLimits(wall_s=120, cpu_s=120, memory_mb=2048, processes=32))
    r = box.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--tb=no", "--no-header",
                 f"--junitxml={report.name}", test_path])
    if r.timed_out:
        raise EvaluatorError(f"the test runner timed out after {box.limits.wall_s} s")
    if not report.exists():
        raise EvaluatorError(f"the test runner left no report (exit {r.exit_code}): {r.output[-300:]}")
    passed, failed, collected = set(), set(), True
    for case in ET.parse(report).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        if case.find("error") is not None and not case.get("name"):
            collected = False
        if case.find("failure") is not None or case.find("error") is not None:
            failed.add(name)
        elif case.find("skipped") is None:
            passed.add(name)
    if r.exit_code in (2, 3, 4) or not (passed or failed):     # interrupted, internal error, usage, nothing
        collected = False
    report.unlink(missing_ok=True)
    return TestRun(passed, failed, collected, r.seconds)


class EvaluatorError(RuntimeError):
    """The evaluator itself failed (not the tests): retried, then the execution is dropped."""


# -- the builder -------------------------------------------------------------------------------------------

def heldout_function(package: str, function: str, share: float) -> bool:
    """A function's side of the split, fixed by its name: about `share` of functions are held out."""
    h = int(hashlib.sha256(f"{package}:{function}".encode()).hexdigest()[:8], 16)
    return h / 0xFFFFFFFF < share


def build_tasks(src: PackageSource, per_function: int = 3, kinds: tuple[str, ...] = (FIX, IMPLEMENT),
                heldout_share: float = 0.3, seed: int = 0, progress=None) -> tuple[list[CodingTask], BuildStats]:
    """Tasks from `src` (see the module's text); `progress(done, total)` after each candidate."""
    stats = BuildStats()
    root = Path(src.root)
    with tempfile.TemporaryDirectory(prefix="gyre-build-") as tmp:
        work = Path(tmp) / "pkg"
        shutil.copytree(root, work)
        base = run_tests(work, src.test_path)
        if base.failed or not base.collected or not base.passed:
            raise ValueError(f"{src.name}: the original code must pass its whole suite ({len(base.failed)} fail)")
        plans = []
        rng = random.Random(seed)
        for rel in src.modules:
            text = (root / rel).read_text()
            for func in [n for n in ast.parse(text).body if isinstance(n, ast.FunctionDef)]:
                lines = text.splitlines(keepends=True)
                original = "".join(lines[func.lineno - 1:func.end_lineno])
                cands = []
                if FIX in kinds:
                    muts = mutations(text, func)
                    rng.shuffle(muts)
                    for a, b, rep, what in muts[:per_function * 3]:
                        broken_text = text[:a] + rep + text[b:]
                        seg = "".join(broken_text.splitlines(keepends=True)[func.lineno - 1:func.end_lineno])
                        cands.append((FIX, seg, what))
                if IMPLEMENT in kinds and (seg := unimplemented(text, func)) is not None:
                    cands.append((IMPLEMENT, seg, "body removed"))
                plans.append((rel, text, func, original, cands))
        total = sum(len(p[4]) for p in plans)
        done = 0
        tasks: list[CodingTask] = []
        for rel, text, func, original, cands in plans:
            kept = {FIX: 0, IMPLEMENT: 0}
            split = "heldout" if heldout_function(src.name, func.name, heldout_share) else "train"
            for kind, seg, what in cands:
                done += 1
                stats.candidates += 1
                if kept[kind] >= (per_function if kind == FIX else 1):
                    stats.rejected["enough for the function"] = stats.rejected.get("enough for the function", 0) + 1
                    continue
                (work / rel).write_text(apply_segment(text, func.lineno, func.end_lineno, seg))
                try:
                    run = run_tests(work, src.test_path)
                except EvaluatorError:
                    run = None
                (work / rel).write_text(text)
                why = ("runner failed" if run is None else "not collected" if not run.collected
                       else "no test fails" if not run.failed else None)
                if why is not None:
                    stats.rejected[why] = stats.rejected.get(why, 0) + 1
                else:
                    tasks.append(CodingTask(f"{src.name}/{kind}/{func.name}/{kept[kind]}", kind, rel, func.name,
                                            func.lineno, func.end_lineno, original, seg, sorted(run.failed), split,
                                            what))
                    kept[kind] += 1
                    stats.kept += 1
                if progress:
                    progress(done, total)
    return tasks, stats


def fetch_sdist(requirement: str, into: str | Path) -> Path:
    """`pip download` the source distribution of `requirement` (e.g. `inflection==0.5.1`) into `into` and unpack
    it; the unpacked source tree."""
    import subprocess
    import tarfile
    import zipfile

    into = Path(into)
    into.mkdir(parents=True, exist_ok=True)
    r = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:", "-d",
                        str(into), requirement], capture_output=True, text=True)
    archives = [p for p in into.iterdir() if p.name.endswith((".tar.gz", ".zip"))]
    if r.returncode or not archives:
        raise ValueError(f"pip could not download the sdist of {requirement!r}: {r.stderr.strip()[-300:]}")
    archive = archives[0]
    if archive.name.endswith(".zip"):
        with zipfile.ZipFile(archive) as z:
            z.extractall(into)
    else:
        with tarfile.open(archive) as t:
            t.extractall(into, filter="data")
    roots = [p for p in into.iterdir() if p.is_dir()]
    if len(roots) != 1:
        raise ValueError(f"the sdist of {requirement!r} did not unpack into one directory")
    return roots[0]


def save_tasks(path, src: PackageSource, tasks: list[CodingTask], stats: BuildStats | None = None) -> None:
    """A task set: the package it was built from (relative to `PACKAGES` when shipped) and its tasks."""
    root = Path(src.root).resolve()
    shipped = root.is_relative_to(PACKAGES.resolve())
    body = {"package": {"name": src.name, "root": str(root.relative_to(PACKAGES.resolve())) if shipped else str(root),
                        "shipped": shipped, "test_path": src.test_path, "modules": src.modules},
            "stats": asdict(stats) if stats else None, "tasks": [asdict(t) for t in tasks]}
    Path(path).write_text(json.dumps(body, indent=1) + "\n")


def load_tasks(path) -> tuple[PackageSource, list[CodingTask]]:
    """A task set: a path, or the name of a shipped one (`inflection`)."""
    p = Path(path)
    if not p.exists() and (SHIPPED / f"{path}.json").exists():
        p = SHIPPED / f"{path}.json"
    if not p.exists():
        have = ", ".join(sorted(x.stem for x in SHIPPED.glob("*.json"))) or "none"
        raise ValueError(f"task set {path!r}: no such file, nor a shipped set (shipped: {have})")
    body = json.loads(p.read_text())
    pk = body["package"]
    root = PACKAGES / pk["root"] if pk.get("shipped") else Path(pk["root"])
    return PackageSource(str(root), pk["test_path"], pk["modules"], pk["name"]), [CodingTask(**t) for t in body["tasks"]]
