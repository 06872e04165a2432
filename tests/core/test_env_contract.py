"""The environment contract: every built-in env and the example keep it; broken envs are caught.

    .venv/bin/python -m pytest tests/core/test_env_contract.py -q

To check your own env the same way: `check_environment(load_env("my_pkg.my_env:MyEnv")) == []`.
"""
from __future__ import annotations

import random
from pathlib import Path

import pytest

from gyre_core.envs import Environment, check_environment, load_env, supports
from gyre_core.envs.scripted import ScriptedEnv

BABYAI = "gyre_core.envs.babyai:BabyAIEnv"
TARGETS = [
    pytest.param(BABYAI, {"level": "BabyAI-GoToLocal-v0"}, id="GoToLocal"),
    pytest.param(BABYAI, {"level": "BabyAI-PutNextLocal-v0"}, id="PutNextLocal"),
    pytest.param(BABYAI, {"level": "BabyAI-BossLevel-v0", "max_steps": 500}, id="BossLevel"),
    pytest.param("gyre_core.envs.scripted:ScriptedEnv", {}, id="scripted"),
    pytest.param("gyre_core.envs.scripted:ScriptedEnv", {"length": 1}, id="scripted-1"),
    pytest.param("examples.custom_env:GuessEnv", {"high": 20}, id="guess"),
    pytest.param("gyre_core.envs.arithmetic:ArithmeticEnv", {}, id="arithmetic"),
    pytest.param("gyre_core.envs.arithmetic:ArithmeticToolEnv", {"ops": "+-*"}, id="arithmetic-tools"),
]


@pytest.fixture(autouse=True)
def _examples_importable(monkeypatch):
    # `examples/` is not an installed package; users run from the repo root, so make the tests do too.
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2]))


@pytest.mark.parametrize(("target", "kwargs"), TARGETS)
def test_env_keeps_the_contract(target, kwargs):
    if target == BABYAI:
        pytest.importorskip("minigrid")
    env = load_env(target, **kwargs)
    assert isinstance(env, Environment)
    assert check_environment(env) == []


def test_hooks_reported():
    assert all(supports(ScriptedEnv(), h)
               for h in ("expert_action", "corpus", "save_state", "restore_state", "progress"))
    guess = load_env("examples.custom_env:GuessEnv")
    assert supports(guess, "expert_action") and not supports(guess, "save_state")
    with pytest.raises(ValueError, match="unknown hook"):
        supports(guess, "teleport")


class NoScore:
    name, actions = "no-score", ("a",)

    def instructions(self): return "say a"
    def reset(self, seed): return "hi"
    def mission(self): return "m"
    def step(self, action): raise AssertionError
    def summary(self): return ""


def test_missing_score_is_named():
    assert check_environment(NoScore()) == ["missing required members: score"]
    with pytest.raises(ValueError, match=r"missing score$"):
        load_env(f"{__name__}:NoScore")


def test_load_env_errors_are_one_line():
    for target, match in [
        ("no_such_module_xyz:Env", "cannot import module 'no_such_module_xyz'"),
        ("gyre_core.envs.scripted:NoSuchEnv", "has no attribute 'NoSuchEnv'"),
        ("gyre_core.envs.scripted", "must look like 'module.path:callable'"),
    ]:
        with pytest.raises(ValueError, match=match) as err:
            load_env(target)
        assert "\n" not in str(err.value)


# --- broken variants of the scripted env: each breaks one rule, and only that rule is reported ------

class Nondeterministic(ScriptedEnv):
    def reset(self, seed):
        super().reset(seed)
        return f"cell 0, noise {random.random()}"


class InvalidMovesAnyway(ScriptedEnv):
    def step(self, action):
        res = super().step(action)
        if not res.valid:
            self._s["pos"] += 1
        return res


class ScoreOutOfRange(ScriptedEnv):
    def score(self):
        s = super().score()
        s.partial *= 2
        return s


class ForgetfulRestore(ScriptedEnv):
    def restore_state(self, state):
        pass


class WrongExpert(ScriptedEnv):
    def expert_action(self):
        return "fly"


class ProgressOutOfRange(ScriptedEnv):
    def progress(self):
        return 1.5


class ProgressThatMoves(ScriptedEnv):
    def progress(self):
        self._s["pos"] = min(self._s["pos"] + 1, self.length - 1)
        return super().progress()


class RandomWorkspace(ScriptedEnv):
    def setup_workspace(self, path):
        Path(path, "seed.txt").write_text(str(random.random()))
        return "do the task"

    def score_workspace(self, path):
        return self.score()


@pytest.mark.parametrize(("env", "expected"), [
    (Nondeterministic(), "reset(0) is not deterministic"),
    (InvalidMovesAnyway(), "an invalid action changed score() or summary()"),
    (ScoreOutOfRange(), "is outside [0, 1]"),
    (ForgetfulRestore(), "restore_state did not restore score()/summary()"),
    (WrongExpert(), "expert_action() returned 'fly', not one of actions or None"),
    (ProgressOutOfRange(), "progress() returned 1.5, not a number in [0, 1]"),
    (ProgressThatMoves(), "calling progress() changed the episode"),
    (RandomWorkspace(), "set up a different workspace"),
])
def test_broken_env_is_reported(env, expected):
    problems = check_environment(env, steps=8)
    assert any(expected in p for p in problems), problems
