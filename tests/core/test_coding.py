"""Coding tasks and their environment: the builder on a package written here (its mutations and kept tasks
worked out by hand), the shipped task set solved by the expert through the tools, the evaluator's
isolation from what an agent leaves behind, and evaluator failures raised (never scored 0).

    .venv/bin/python -m pytest tests/core/test_coding.py -q
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from gyre_core.envs.coding.env import CodingEnv
from gyre_core.envs.coding.tasks import (FIX, IMPLEMENT, EvaluatorError, PackageSource, apply_segment, build_tasks,
                                         load_tasks, run_tests, save_tasks)
from gyre_core.sandbox import SandboxLimits

MODULE = '''def add(a, b):
    """The sum."""
    return a + b


def is_even(n):
    """Whether n is even."""
    return n % 2 == 0


def shout(s):
    return s.upper()
'''

TESTS = '''from mini import add, is_even, shout


def test_add():
    assert add(2, 3) == 5


def test_even():
    assert is_even(4) and not is_even(3)


def test_shout():
    assert shout("a") == "A"
'''


@pytest.fixture()
def mini(tmp_path):
    root = tmp_path / "mini-1.0"
    root.mkdir()
    (root / "mini.py").write_text(MODULE)
    (root / "test_mini.py").write_text(TESTS)
    return PackageSource.of(root, "test_mini.py", ["mini.py"], "mini")


def test_the_builder_keeps_exactly_the_candidates_that_break_tests(mini, tmp_path):
    tasks, stats = build_tasks(mini, per_function=3, heldout_share=0.5)
    got = sorted((t.function, t.kind, t.mutation) for t in tasks)
    # add: `+ -> -` breaks test_add; its body removed breaks it too.
    # is_even: `% -> //`, `== -> !=`, `2 -> 3`, `0 -> 1` each break test_even (4 // 2 == 0 is False; 4 % 3 == 0
    # is False; ...) — 3 kept (per_function), the 4th rejected as enough; its body removed breaks it.
    # shout: no operator or constant to mutate, no docstring to implement from: nothing.
    assert [g for g in got if g[0] == "add"] == [("add", FIX, "+ -> - at line 3"), ("add", IMPLEMENT, "body removed")]
    even = [g for g in got if g[0] == "is_even"]
    assert len(even) == 4 and sum(g[1] == FIX for g in even) == 3
    assert not [g for g in got if g[0] == "shout"]
    assert stats.candidates == 7 and stats.kept == 6 and stats.rejected == {"enough for the function": 1}
    for t in tasks:
        assert t.hidden_tests == [f"test_mini::{'test_add' if t.function == 'add' else 'test_even'}"]
        assert t.split == ("heldout" if t.function in {u.function for u in tasks if u.split == "heldout"} else "train")
        whole = MODULE
        broken = apply_segment(whole, t.start, t.end, t.broken)
        assert broken != whole and apply_segment(broken, t.start, t.end, t.original) == whole   # the oracle patch
    save_tasks(tmp_path / "mini.json", mini, tasks, stats)
    src, again = load_tasks(tmp_path / "mini.json")
    assert again == tasks and src.test_path == "test_mini.py"


def test_the_expert_solves_shipped_tasks_through_the_tools():
    env = CodingEnv("inflection")
    for seed in (0, 1, 2, 1_000_000_000):          # train tasks, and a held-out one
        env.reset(seed)
        before = env.score()
        assert before.partial == 0.0 and not before.success           # every hidden test fails on the broken code
        assert "test_inflection.py" not in env.call_tool("list_files", {})    # the tests are withheld
        action = env.expert_action()
        call = json.loads(action.split("<tool_call>")[1].split("</tool_call>")[0])
        assert env.call_tool(call["name"], call["arguments"]).startswith("Edited")
        assert env.step(env.expert_action()).done
        after = env.score()
        assert after.success and after.partial == 1.0
        assert after.details["hidden_passed"] == len(env.task.hidden_tests)
    assert {t.split for t in env.train} == {"train"} and {t.split for t in env.heldout} == {"heldout"}
    assert not {t.function for t in env.train} & {t.function for t in env.heldout}      # split by function


def test_run_tests_runs_the_workspaces_tests_and_docstring_examples_in_the_sandbox():
    env = CodingEnv("inflection")
    env.reset(3)                        # a fix task: `ordinal`, whose docstring examples show the bug
    assert env.task.function == "ordinal" and env.task.kind == "fix"
    out = env.call_tool("run_tests", {})
    assert out.startswith("exit 1") and "FAILED inflection/__init__.py::inflection.ordinal" in out
    # an agent's own test file runs too, and nothing of the withheld suite is there to run
    (env.workspace / "test_mine.py").write_text("from inflection import ordinal\ndef test_1():\n"
                                                "    assert ordinal(1) == 'st'\n")
    assert "1 passed" in env.call_tool("run_tests", {"path": "test_mine.py"})
    old, new = env.oracle_edit()
    env.call_tool("edit_file", {"path": env.task.path, "old": old, "new": new})
    out = env.call_tool("run_tests", {})
    assert out.startswith("exit 0") and "failed" not in out
    with pytest.raises(ValueError, match="outside the workspace"):
        env.call_tool("run_tests", {"path": "../"})


def test_what_an_agent_adds_cannot_change_the_score():
    env = CodingEnv("inflection")
    env.reset(1)
    ws = env.workspace
    (ws / "conftest.py").write_text("import pytest\ndef pytest_collection_modifyitems(items):\n"
                                    "    for i in items: i.add_marker(pytest.mark.skip)\n")
    (ws / "test_inflection.py").write_text("def test_ok():\n    pass\n")
    (ws / "pytest.ini").write_text("[pytest]\naddopts = -p no:python\n")
    s = env.score()
    assert s.partial == 0.0 and not s.success       # the withheld tests ran, on the shipped package's layout


@pytest.mark.fault("an evaluator that hangs", "killed at its wall clock and counted as an evaluator failure")
def test_an_evaluator_that_hangs_is_an_evaluator_failure(mini, tmp_path):
    (Path(mini.root) / "test_mini.py").write_text("import time\ndef test_slow():\n    time.sleep(100)\n")
    with pytest.raises(EvaluatorError, match="timed out"):
        run_tests(Path(mini.root), "test_mini.py", SandboxLimits(wall_s=3))


def test_an_unknown_task_set_names_the_shipped_ones():
    with pytest.raises(ValueError, match=r"shipped: inflection"):
        CodingEnv("no-such-set")


def test_the_expert_through_gyres_harness_calls_the_tool_and_scores():
    from gyre_core.config import HarnessConfig
    from gyre_core.harness.conversation import ChatFormat
    from gyre_core.harness.loop import ExecutionSpec, run_executions
    from gyre_core.harness.policies import ExpertPolicy
    from gyre_core.model import IM_END, train_tokenizer

    tok = train_tokenizer(list(CodingEnv("inflection").corpus(4, 0)), vocab_size=400)
    stop = tok.convert_tokens_to_ids(IM_END)
    specs = [ExecutionSpec("r", 0, f"r/e{i}", f"t{i}", seed, "train") for i, seed in enumerate((5, 1_000_000_007))]
    recs = run_executions(specs, ExpertPolicy(tok, stop), HarnessConfig(max_turns=4, context_tokens=50_000,
                                                                         max_new_tokens=4096),
                          lambda: CodingEnv("inflection"), ChatFormat(tok), {stop: IM_END}, 2)
    for r in recs:
        first, last = r.calls
        assert first.tool_parse == "ok" and len(first.tool_call_ids) == 1 and first.tool_spans     # the edit
        assert last.tool_parse == "none" and r.status == "done" and r.success and r.partial == 1.0

    class Submits(CodingEnv):           # ends with the `submit` tool instead of the answer `done`
        def expert_action(self):
            action = super().expert_action()
            return action if action != "done" else '<tool_call>\n{"name": "submit", "arguments": {}}\n</tool_call>'

    rec = run_executions(specs[:1], ExpertPolicy(tok, stop), HarnessConfig(max_turns=4, context_tokens=50_000,
                                                                            max_new_tokens=4096),
                         lambda: Submits("inflection"), ChatFormat(tok), {stop: IM_END}, 1)[0]
    assert [c.tool_parse for c in rec.calls] == ["ok", "ok"] and rec.turns == 2     # no turn after the submit
    assert rec.status == "done" and rec.success and rec.invalid_actions == 0


def test_the_experts_minimal_edit_restores_every_shipped_task_byte_for_byte(tmp_path):
    env = CodingEnv("inflection")
    for i, t in enumerate(env.train + env.heldout):
        env.task, env.workspace = t, tmp_path / str(i)
        env.workspace.mkdir()
        env.setup_workspace(str(env.workspace))
        old, new = env.oracle_edit()
        assert len(old) < len(t.broken) or t.broken.count("\n") <= 2     # fewer lines than the whole function
        env.call_tool("edit_file", {"path": t.path, "old": old, "new": new})
        assert (env.workspace / t.path).read_text() == (Path(env.source.root) / t.path).read_text(), t.id
    env.workspace = None
