"""The coding environment: a repository task, a workspace with the broken package, tools, tests as the evaluator.

    gyre train --preset coding-smoke
    env = CodingEnv(tasks="inflection")            # a shipped task set (gyre_core/envs/coding/tasks/*.json)

Each episode is one task (`tasks.py`): the seed picks it from the train tasks, or from the held-out ones
(functions never trained on) for seeds from `heldout_from` (the config's `env.eval_seed_start` by
default). The workspace is a copy of the package with the task's function broken and the test file
withheld. The agent works with tools, every command in the sandbox (`gyre_core.sandbox`):

    list_files(path)  read_file(path)  edit_file(path, old, new)  run(command)  run_tests(path)  submit()

and calls `submit`, or answers `done` without a tool call, when it is done. The evaluator copies what the
workspace left into a fresh directory with the withheld test file, runs it in a fresh sandbox, and scores
the fraction of the task's hidden tests that pass (partial); success is the whole suite passing. A runner that crashes or
times out is an evaluator failure (raised: retried, then the execution is dropped), never a zero.

The expert applies the oracle patch through the same `edit_file` tool, then answers: demonstrations for a
warm start, and the proof that every task is solvable (it must score 100%). An external agent harness
(`harness.command`, e.g. mini-swe-agent) gets the same workspace through `setup_workspace` and the same
evaluator through `score_workspace`.
"""
from __future__ import annotations

import json
import random
import shutil
import tempfile
from pathlib import Path

from ..protocol import Score, StepResult
from .tasks import EvaluatorError, apply_segment, load_tasks, run_tests

MAX_READ = 12_000          # characters a read_file returns
HELDOUT_FROM = 1_000_000_000

TOOLS = [
    {"type": "function", "function": {"name": "list_files", "description": "List the files under a directory.",
                                      "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}},
    {"type": "function", "function": {"name": "read_file", "description": "Read a file.",
                                      "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                                                     "required": ["path"]}}},
    {"type": "function", "function": {
        "name": "edit_file", "description": "Replace the one occurrence of `old` in a file by `new`.",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}, "old": {"type": "string"},
                                                        "new": {"type": "string"}}, "required": ["path", "old", "new"]}}},
    {"type": "function", "function": {"name": "run", "description": "Run a shell command in the workspace (no network).",
                                      "parameters": {"type": "object", "properties": {"command": {"type": "string"}},
                                                     "required": ["command"]}}},
    {"type": "function", "function": {
        "name": "run_tests", "description": "Run pytest on a file or directory of the workspace: the tests there and "
        "the examples in the docstrings (the hidden tests are not in the workspace).",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}},
    {"type": "function", "function": {"name": "submit", "description": "Submit the workspace as it is: the task ends.",
                                      "parameters": {"type": "object", "properties": {}}}},
]
TEST_COMMAND = ["python", "-m", "pytest", "-q", "--doctest-modules", "-p", "no:cacheprovider", "--tb=short",
                "--no-header"]


class CodingEnv:
    def __init__(self, tasks: str = "inflection", heldout_from: int = HELDOUT_FROM, command_s: float = 30.0) -> None:
        self.workspace: Path | None = None
        self.source, all_tasks = load_tasks(tasks)
        self.train = [t for t in all_tasks if t.split == "train"]
        self.heldout = [t for t in all_tasks if t.split == "heldout"]
        if not self.train or not self.heldout:
            raise ValueError(f"task set {tasks!r} needs train and held-out tasks ({len(self.train)} / {len(self.heldout)})")
        self.name = f"coding-{self.source.name}"
        self.actions = ("done",)
        self.heldout_from, self.command_s = heldout_from, command_s
        self.task = None
        self.edits = 0
        self._expert_step = 0

    # -- the episode --------------------------------------------------------------------------------------
    def instructions(self) -> str:
        return ("You are a software engineer working in a Python repository. Use the tools to read, edit and run "
                "code. When the task is done, call `submit` (or answer `done` without a tool call).")

    def reset(self, seed: int) -> str:
        pool = self.heldout if seed >= self.heldout_from else self.train
        self.task = pool[random.Random(seed).randrange(len(pool))]
        self._drop_workspace()
        self.workspace = Path(tempfile.mkdtemp(prefix="gyre-code-"))
        self.setup_workspace(str(self.workspace))
        self.edits, self._expert_step = 0, 0
        return f"Files: {', '.join(self._files(self.workspace))}"

    def mission(self) -> str:
        return self.task.statement()

    def step(self, action: str) -> StepResult:
        """A completion without a tool call: `done` ends the episode; anything else is a reminder."""
        if "done" in action.lower():
            return StepResult("Submitted.", done=True)
        return StepResult("Call a tool (list_files, read_file, edit_file, run, run_tests), or `submit` (or answer "
                          "`done`) when the task is done.", done=False, valid=False)

    def score(self) -> Score:
        """The evaluator on the workspace as it stands (kept until the next reset, or the env is dropped)."""
        return self.score_workspace(str(self.workspace))

    def summary(self) -> str:
        return f"{self.mission()} Edits so far: {self.edits}."

    # -- tools ---------------------------------------------------------------------------------------------
    def tools(self) -> list[dict]:
        return TOOLS

    def call_tool(self, name: str, arguments: dict) -> str:
        ws = self.workspace
        if name == "list_files":
            return "\n".join(self._files(self._path(arguments.get("path", ".")))) or "(empty)"
        if name == "read_file":
            text = self._path(arguments["path"]).read_text(errors="replace")
            return text if len(text) <= MAX_READ else text[:MAX_READ] + f"\n... ({len(text) - MAX_READ} more characters)"
        if name == "edit_file":
            path, old, new = self._path(arguments["path"]), str(arguments["old"]), str(arguments["new"])
            text = path.read_text()
            n = text.count(old) if old else 0
            if n != 1:
                raise ValueError(f"`old` occurs {n} times in {arguments['path']}; it must occur exactly once")
            path.write_text(text.replace(old, new))
            self.edits += 1
            return f"Edited {arguments['path']}."
        if name == "run":
            return self._run(str(arguments["command"]))
        if name == "submit":
            return StepResult("Submitted.", done=True)
        if name == "run_tests":
            return self._run(TEST_COMMAND + [str(self._path(arguments.get("path", ".")).relative_to(ws.resolve()))])
        raise ValueError(f"no tool {name!r}")

    def _run(self, command: str | list[str]) -> str:
        """A command in the workspace's sandbox: its exit status and the tail of its output."""
        from ...sandbox import Sandbox, SandboxLimits

        r = Sandbox(self.workspace, SandboxLimits(wall_s=self.command_s, cpu_s=int(self.command_s))).run(command)
        return f"exit {r.exit_code}{' (timed out)' if r.timed_out else ''}\n{r.output[-4000:]}"

    def _path(self, rel: str) -> Path:
        p = (self.workspace / rel).resolve()
        if not p.is_relative_to(self.workspace.resolve()):
            raise ValueError(f"{rel}: outside the workspace")
        return p

    @staticmethod
    def _files(d: Path) -> list[str]:
        return sorted(str(p.relative_to(d)) for p in d.rglob("*") if p.is_file() and not p.name.startswith(".gyre"))

    def corpus(self, episodes: int, seed: int):
        """Text for a tokenizer: the package's source, the tools, the tasks' statements and the replies."""
        yield Path(self.source.root, *self.source.modules[0].split("/")).read_text() if self.source.modules else ""
        for rel in self.source.modules[1:]:
            yield Path(self.source.root, rel).read_text()
        yield json.dumps(TOOLS)
        rng = random.Random(seed)
        for _ in range(episodes):
            t = rng.choice(self.train)
            yield t.statement()
            yield json.dumps({"name": "edit_file", "arguments": {"path": t.path, "old": t.broken, "new": t.original}})
        yield self.instructions()
        yield self.step("").observation

    # -- the expert ------------------------------------------------------------------------------------------
    def expert_action(self) -> str | None:
        """The oracle patch through `edit_file` (the fewest lines that make it, with context enough to be
        unique in the file), then the answer."""
        self._expert_step += 1
        if self._expert_step == 1:
            old, new = self.oracle_edit()
            call = {"name": "edit_file", "arguments": {"path": self.task.path, "old": old, "new": new}}
            return f"<tool_call>\n{json.dumps(call)}\n</tool_call>"
        return "done"

    def oracle_edit(self) -> tuple[str, str]:
        """(old, new) for `edit_file`: the lines where the broken function differs from the original, widened
        by a line at a time until `old` occurs once in the broken file."""
        t = self.task
        b, o = t.broken.splitlines(keepends=True), t.original.splitlines(keepends=True)
        head = 0
        while head < min(len(b), len(o)) and b[head] == o[head]:
            head += 1
        tail = 0
        while tail < min(len(b), len(o)) - head and b[-1 - tail] == o[-1 - tail]:
            tail += 1
        text = (self.workspace / t.path).read_text() if self.workspace else t.broken
        lo, hi_b, hi_o = head, len(b) - tail, len(o) - tail
        while True:
            old, new = "".join(b[lo:hi_b]), "".join(o[lo:hi_o])
            if old and text.count(old) == 1:
                return old, new
            if lo == 0 and hi_b == len(b):
                return t.broken, t.original
            lo, hi_b, hi_o = max(0, lo - 1), min(len(b), hi_b + 1), min(len(o), hi_o + 1)

    # -- the workspace, for Gyre's harness and for an external one -------------------------------------------
    def setup_workspace(self, path: str) -> str:
        """The package with the task's function broken, its test file withheld; the task text."""
        src = Path(self.source.root)
        dst = Path(path)
        for f in self._files(src):
            if f == self.source.test_path or "__pycache__" in f:
                continue
            (dst / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src / f, dst / f)
        t = self.task
        (dst / t.path).write_text(apply_segment((src / t.path).read_text(), t.start, t.end, t.broken))
        (dst / "TASK.md").write_text(t.statement() + "\n")
        return t.statement()

    def score_workspace(self, path: str) -> Score:
        """The withheld tests on what `path` holds, in a fresh directory and sandbox."""
        t = self.task
        src = Path(self.source.root)
        with tempfile.TemporaryDirectory(prefix="gyre-eval-") as tmp:
            # the package as shipped, with the workspace's version of each of its own files: nothing the agent
            # added (a conftest.py, a pytest.ini, a sitecustomize) takes part, and the tests are the withheld ones
            work = Path(tmp) / "pkg"
            shutil.copytree(src, work, ignore=shutil.ignore_patterns("__pycache__"))
            for f in self._files(src):
                mine = Path(path) / f
                if f != self.source.test_path and mine.is_file() and not mine.is_symlink():
                    shutil.copyfile(mine, work / f)
            run = run_tests(work, self.source.test_path)
        if not run.collected and not run.passed:
            # the agent's code does not even import: every hidden test fails (the evaluator worked)
            return Score(False, 0.0, {"hidden_passed": 0.0, "suite_failed": float(len(run.failed))})
        hidden = set(t.hidden_tests)
        passed = len(hidden & run.passed)
        return Score(not run.failed and hidden <= run.passed, passed / len(hidden),
                     {"hidden_passed": float(passed), "suite_failed": float(len(run.failed))})

    def _drop_workspace(self) -> None:
        if self.workspace is not None:
            shutil.rmtree(self.workspace, ignore_errors=True)
            self.workspace = None

    def __del__(self) -> None:
        self._drop_workspace()


__all__ = ["CodingEnv", "EvaluatorError"]
