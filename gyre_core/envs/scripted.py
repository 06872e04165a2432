"""A tiny deterministic corridor environment for tests (no dependencies, microseconds per step).

    from gyre_core.envs.scripted import ScriptedEnv
    env = ScriptedEnv(length=5)
    env.reset(3)                       # 'cell 0 of 5, step 0'
    env.step("forward")                # StepResult('cell 1 of 5, step 1', done=False, valid=True)

The agent starts in cell 0 of a corridor of `length` cells. `forward` advances one cell, `back` steps
back (not below 0), `wait` does nothing, `done` ends the episode (a failure unless at the end).
Reaching cell `length` ends the episode with success. The episode also ends after `max_steps`
actions (default 3 * length). The seed only changes the mission text, so episodes of different seeds
are distinguishable while the dynamics stay trivially predictable.
Score: success = reached the end; partial = position / length (1.0 on success);
details = {"position": position, "steps": steps}.
Implements every optional hook: expert_action (always `forward`), corpus, save_state/restore_state, progress.
"""
from __future__ import annotations

import copy
from collections.abc import Iterator

from gyre_core.envs.protocol import Score, StepResult


class ScriptedEnv:
    actions = ("forward", "back", "wait", "done")

    def __init__(self, length: int = 5, max_steps: int | None = None, crash_seeds: tuple[int, ...] = ()) -> None:
        """`crash_seeds`: episodes whose third step() call raises (a sandbox dying), to test failure handling."""
        if length < 1:
            raise ValueError(f"length must be >= 1, got {length}")
        self.name = f"corridor-{length}"
        self.length = length
        self.max_steps = max_steps if max_steps is not None else 3 * length
        self.crash_seeds = tuple(crash_seeds)
        self._s = {"seed": 0, "pos": 0, "steps": 0, "done": False}

    def instructions(self) -> str:
        return "You walk a corridor; answer with one word: " + ", ".join(self.actions) + "."

    def reset(self, seed: int) -> str:
        self._s = {"seed": seed, "pos": 0, "steps": 0, "done": False}
        return self._observe()

    def mission(self) -> str:
        return f"walk to cell {self.length} (episode {self._s['seed']})"

    def step(self, action: str) -> StepResult:
        s = self._s
        s["calls"] = s.get("calls", 0) + 1
        if s["seed"] in self.crash_seeds and s["calls"] == 3:
            raise RuntimeError(f"sandbox of episode {s['seed']} died")
        words = action.strip().lower().split()
        word = words[0] if words else ""
        if word not in self.actions:
            return StepResult(f"invalid action {action.strip()[:20]!r}; answer with one of: "
                              + ", ".join(self.actions), done=s["done"], valid=False)
        if s["done"]:
            return StepResult(self._observe(), done=True)
        s["steps"] += 1
        if word == "forward":
            s["pos"] += 1
        elif word == "back":
            s["pos"] = max(0, s["pos"] - 1)
        s["done"] = word == "done" or s["pos"] >= self.length or s["steps"] >= self.max_steps
        return StepResult(self._observe(), done=s["done"])

    def score(self) -> Score:
        pos, success = self._s["pos"], self._s["pos"] >= self.length
        return Score(success=success, partial=1.0 if success else pos / self.length,
                     details={"position": float(pos), "steps": float(self._s["steps"])})

    def summary(self) -> str:
        return f"{self.mission()}; {self._observe()}"

    # --- optional hooks ---
    def progress(self) -> float:
        return min(self._s["pos"] / self.length, 1.0)

    def expert_action(self) -> str | None:
        return None if self._s["done"] else "forward"

    def corpus(self, episodes: int, seed: int) -> Iterator[str]:
        env = ScriptedEnv(self.length, self.max_steps)  # a copy: the current episode stays untouched
        yield env.instructions()
        for e in range(episodes):
            yield env.reset(seed + e)
            yield env.mission()
            yield env.step("xyzzy").observation
            while (action := env.expert_action()) is not None:
                yield action
                yield env.step(action).observation
            yield env.summary()

    def save_state(self) -> object:
        return copy.deepcopy(self._s)

    def restore_state(self, state: object) -> None:
        self._s = copy.deepcopy(state)

    def _observe(self) -> str:
        return f"cell {self._s['pos']} of {self.length}, step {self._s['steps']}"
