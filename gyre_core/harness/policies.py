"""Policies the harness can run: the model (through an engine), the environment's expert, uniform random.

The expert and the random policy answer through the same token path as the model (action text
tokenised, stop token appended), so demonstrations are exactly the sequences the model will see.
"""
from __future__ import annotations

import random

from ..envs.protocol import env_actions, has_random_action, random_action
from .loop import Completion, ModelCall


class EnginePolicy:
    """The model, through a batched engine (`gyre_core.engine.LocalEngine` or any with its interface)."""

    def __init__(self, engine, temperature: float):
        self.engine, self.temperature = engine, temperature

    def complete(self, calls: list[ModelCall]) -> list[Completion]:
        from ..engine import GenRequest

        reqs = [GenRequest(c.key, c.prompt_ids, c.max_new_tokens, self.temperature) for c in calls]
        outs = self.engine.generate(reqs)
        v = self.engine.version
        return [Completion(o.completion_ids, o.logprobs, o.finish_reason, v, o.entropy) for o in outs]

    def release(self, key: str) -> None:
        self.engine.release(key)


class _TextPolicy:
    """Base for policies that choose an action text without the model."""

    version = -1

    def __init__(self, tokenizer, stop_id: int):
        self.tokenizer, self.stop_id = tokenizer, stop_id
        self._cache: dict[str, list[int]] = {}

    def _ids(self, text: str) -> list[int]:
        if text not in self._cache:
            self._cache[text] = list(self.tokenizer.encode(text, add_special_tokens=False)) + [self.stop_id]
        return self._cache[text]

    def complete(self, calls: list[ModelCall]) -> list[Completion]:
        out = []
        for c in calls:
            ids = self._ids(self.choose_for(c.execution))
            out.append(Completion(ids, [0.0] * len(ids), "stop", self.version))
        return out

    def release(self, key: str) -> None:
        pass

    def choose_for(self, execution) -> str:
        return self.choose(execution.env)


class ExpertPolicy(_TextPolicy):
    """The environment's `expert_action()` hook (demonstrations for the warm start). With `epsilon` > 0 an
    imperfect demonstrator: at each turn, with that probability, a uniformly random action word instead
    (drawn from the episode's seed and turn, so the same demonstrations come out however calls are batched)."""

    def __init__(self, tokenizer, stop_id: int, epsilon: float = 0.0, seed: int = 0):
        super().__init__(tokenizer, stop_id)
        self.epsilon, self.seed = epsilon, seed

    def choose_for(self, execution) -> str:
        if self.epsilon > 0:
            rng = random.Random(f"{self.seed}:{execution.record.seed}:{execution.record.turns}")
            if rng.random() < self.epsilon and has_random_action(execution.env):
                return random_action(execution.env, rng)
        return self.choose(execution.env)

    def choose(self, env) -> str:
        action = env.expert_action()
        return action if action is not None else env_actions(env)[-1]


class RandomPolicy(_TextPolicy):
    """Uniform over the environment's actions (its `random_action`, else its action words): the floor every
    evaluation reports."""

    def __init__(self, tokenizer, stop_id: int, seed: int):
        super().__init__(tokenizer, stop_id)
        self.rng = random.Random(seed)

    def choose(self, env) -> str:
        return random_action(env, self.rng)
