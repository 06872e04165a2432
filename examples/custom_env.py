"""A custom environment in ~80 lines: guess the secret number.

Plug it in by its dotted path (any importable `module:callable` works the same way):

    gyre train --set env.target=examples.custom_env:GuessEnv --set 'env.kwargs={"high": 20}'

and check it keeps the contract before training on it:

    python -c "from gyre_core.envs import load_env, check_environment as c; \
print(c(load_env('examples.custom_env:GuessEnv')))"     # [] means fine

The contract is `gyre_core.envs.Environment` (a Protocol: no base class, just these members).
Each episode hides a number in 1..high chosen from the seed; the agent answers one number per turn and
hears whether it was too high or too low. Actions are single words: the numbers themselves.
"""
from __future__ import annotations

import random

from gyre_core.envs import Score, StepResult


class GuessEnv:
    def __init__(self, high: int = 20, max_guesses: int = 6) -> None:
        self.name = f"guess-1-{high}"
        self.actions = tuple(str(n) for n in range(1, high + 1))  # the valid action words
        self.high, self.max_guesses = high, max_guesses
        self.secret, self.guesses = 1, []

    def instructions(self) -> str:  # the system prompt, the same for every episode
        return f"Guess the secret number; each turn answer with one number from 1 to {self.high}."

    def reset(self, seed: int) -> str:  # same seed, same episode
        self.secret = random.Random(seed).randint(1, self.high)
        self.guesses = []
        return "no guesses yet"

    def mission(self) -> str:
        return f"find the secret number between 1 and {self.high} in {self.max_guesses} guesses"

    def step(self, action: str) -> StepResult:
        words = action.strip().lower().split()
        if not words or words[0] not in self.actions:
            # Unparseable: say so, and leave the state exactly as it was.
            return StepResult(f"invalid answer; say one number from 1 to {self.high}",
                              done=self._done(), valid=False)
        if self._done():
            return StepResult(self._observe(), done=True)
        self.guesses.append(int(words[0]))
        return StepResult(self._observe(), done=self._done())

    def score(self) -> Score:
        # Partial credit from the state left behind: how close the last guess came.
        success = self.secret in self.guesses
        miss = abs(self.guesses[-1] - self.secret) if self.guesses else self.high
        closeness = 1 - min(miss, self.high - 1) / max(self.high - 1, 1)
        return Score(success=success, partial=1.0 if success else 0.5 * closeness,
                     details={"guesses": float(len(self.guesses)), "miss": float(miss)})

    def summary(self) -> str:  # what the agent keeps when its context is compacted
        guessed = " ".join(map(str, self.guesses)) or "none"
        return f"{self.mission()}; guessed so far: {guessed}; {self._observe()}"

    # Optional hook: a demonstrator (binary search) for warm-start demonstrations.
    def expert_action(self) -> str | None:
        if self._done():
            return None
        low = max([g + 1 for g in self.guesses if g < self.secret], default=1)
        high = min([g - 1 for g in self.guesses if g > self.secret], default=self.high)
        return str((low + high) // 2)

    def _done(self) -> bool:
        return self.secret in self.guesses or len(self.guesses) >= self.max_guesses

    def _observe(self) -> str:
        if not self.guesses:
            return "no guesses yet"
        last = self.guesses[-1]
        verdict = "correct" if last == self.secret else "too high" if last > self.secret else "too low"
        return f"{last} is {verdict}; {self.max_guesses - len(self.guesses)} guesses left"
