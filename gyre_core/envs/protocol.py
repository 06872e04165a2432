"""The environment contract: what the harness needs from an environment.

    from gyre_core.envs import load_env, check_environment
    env = load_env("gyre_core.envs.babyai:BabyAIEnv", level="BabyAI-GoToLocal-v0")
    assert check_environment(env) == []

An environment is any object with the members of `Environment` (a Protocol: no base class to inherit).
Text in, text out: the harness shows `instructions()` as the system prompt, `mission()` and the
observations as user turns, and passes each decoded model completion to `step()` unchanged.

Optional hooks (use `supports(env, hook)` to ask whether an env has one):

- `expert_action(self) -> str | None` — the demonstrator's next action for the current state
  (one of `actions`), or None when it has none. Used to generate warm-start demonstrations through the
  real harness, so it must follow the state whatever actions were actually taken.
- `corpus(self, episodes: int, seed: int) -> Iterator[str]` — representative text (instructions,
  missions, observations, actions, summaries, error messages) for training a tokenizer. Deterministic
  in (episodes, seed) and must not disturb the env's current episode.
- `save_state(self) -> object` / `restore_state(self, state) -> None` — a deep-copy snapshot for
  forking executions; after `restore_state(s)` the same actions give the same observations as they
  did after `s` was saved, and `s` stays reusable (restore twice, fork twice). Both or neither.
- `progress(self) -> float` — how far the current episode is toward its goal, in [0, 1] (the partial
  score the state would get now; 1.0 once solved). Cheap, and it must not disturb the episode: the
  harness asks before every action and records it on the call (`CallRecord.progress`), which
  `rl.progress_credit` turns into per-turn credit.
- `tools(self) -> list[dict]` / `call_tool(self, name: str, arguments: dict) -> str` — tools the agent may
  call (OpenAI function schemas, `{"type": "function", "function": {"name", "description", "parameters"}}`)
  and their implementation, which returns the result text (an exception is shown to the agent as an
  error result), or a `StepResult` whose `done` ends the episode (a `submit` tool). The harness renders the tools with the model's chat template, parses tool calls from
  each completion (`harness/tools.py`) and answers them with `tool` messages; a completion without a
  tool call goes to `step()` as before (a final answer, or a text action). Both or neither.
- `setup_workspace(self, path: str) -> str` / `score_workspace(self, path: str) -> Score | None` — the task
  as an external agent harness (`harness.command`) meets it: after `reset(seed)`, write what the agent
  works on into the empty directory `path` (its working directory) and return the task text it is given
  (`GYRE_TASK`); when the agent has exited, score what it left in `path` (an exception is an evaluator
  failure, retried as `score`'s). Both or neither.
- `random_action(self, rng: random.Random) -> str` — what a uniformly random agent would do now (a text
  action, or a tool call in the harness's format): the random floor of evaluations and the noise of an
  imperfect demonstrator (`warmstart.expert_epsilon`). Without it both draw from `actions`; an environment
  with neither has no random floor.
- `expert_reply(self, messages: list[dict], tools: list[dict] | None) -> str` — the expert as an agent
  program's model: its reply (completion text, tool calls in the harness's format) to a request's OpenAI
  chat messages and tools, from what the conversation shows. The warm start serves it through the recording proxy, so an unmodified agent program
  (`harness.command`) records its own demonstrations as the exact tokens RL will see.
- `close(self) -> None` — called once an execution is over (scored or failed): let go of what the
  environment holds per execution (an interpreter, a game process, a container). An exception is reported
  and does not fail the execution.

`reset` may also take a keyword parameter `split`: the harness then calls `reset(seed, split=...)` with
"train" (an RL task), "eval" (a held-out evaluation) or "demo" (a demonstration for the warm start or the
control), so an environment with its own train/test data need not guess from the seed.

Actions are text: `actions` lists commands the agent may give (a word such as `forward`, or a phrase such
as `take red apple from counter`), which the uniform-random baseline draws from and the expert answers
with; `step()` receives whatever the model wrote and parses it as the environment likes. An open-ended
environment (free-text answers, no finite list) leaves `actions` empty (or out) and may offer
`random_action`; one that sets `free_text = True` says that every non-empty text is a valid action (a wrong
answer is still an answer), and the contract check then holds it to that instead of to refusing junk.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

REQUIRED_ATTRIBUTES = ("name",)
REQUIRED_METHODS = ("instructions", "reset", "mission", "step", "score", "summary")
HOOKS = ("expert_action", "corpus", "save_state", "restore_state", "progress", "tools", "call_tool",
         "setup_workspace", "score_workspace", "random_action", "expert_reply", "close")
PAIRED = (("save_state", "restore_state"), ("tools", "call_tool"), ("setup_workspace", "score_workspace"))


@dataclass(slots=True)
class StepResult:
    observation: str   # text shown to the agent next
    done: bool         # the episode is over (by the env's own rules: success, failure or env step cap)
    valid: bool = True  # False when the action text could not be parsed; observation then is a short
    #                     error message and the env state is unchanged


@dataclass(slots=True)
class Score:
    success: bool
    partial: float     # in [0, 1], computed from the state the execution left behind; 1.0 if success
    details: dict[str, float] = field(default_factory=dict)  # named sub-scores (e.g. subgoals_done, distance)


@runtime_checkable
class Environment(Protocol):
    name: str                              # e.g. the level id
    # optional: `actions: tuple[str, ...]`, commands (words or phrases) a uniform-random baseline draws from;
    # `free_text: bool`, every non-empty text is a valid action

    def instructions(self) -> str: ...     # system-prompt text: what the agent is and how to answer
    def reset(self, seed: int) -> str: ... # start episode `seed` (deterministic), return first observation
    #                                      (it may take `split` too: "train", "eval" or "demo")
    def mission(self) -> str: ...          # the current episode's task text
    def step(self, action: str) -> StepResult: ...  # `action`: the decoded completion (may hold junk)
    def score(self) -> Score | None: ...   # partial score of the state left behind; None: nothing to score
    #                                      (reward 0); an exception is an evaluator failure (retried)
    def summary(self) -> str: ...          # compact progress text (used when the harness compacts)


def missing_members(env: object) -> list[str]:
    """Names of required Protocol members `env` lacks (methods must also be callable)."""
    missing = [a for a in REQUIRED_ATTRIBUTES if not hasattr(env, a)]
    missing += [m for m in REQUIRED_METHODS if not callable(getattr(env, m, None))]
    return missing


def supports(env: object, hook: str) -> bool:
    """Whether `env` implements the optional `hook` (one of HOOKS). Save/restore count only as a pair."""
    if hook not in HOOKS:
        raise ValueError(f"unknown hook {hook!r}; known hooks: {', '.join(HOOKS)}")
    pair = next((p for p in PAIRED if hook in p), (hook,))
    return all(callable(getattr(env, h, None)) for h in pair)


def env_actions(env: object) -> tuple[str, ...]:
    """The env's listed actions (none for an open-ended env)."""
    return tuple(getattr(env, "actions", None) or ())


def has_random_action(env: object) -> bool:
    """Whether a uniformly random action can be drawn here (`random_action`, else a non-empty `actions`)."""
    return supports(env, "random_action") or bool(env_actions(env))


def random_action(env: object, rng) -> str:
    """A uniformly random action: the env's `random_action(rng)`, else one of `actions`."""
    if supports(env, "random_action"):
        return env.random_action(rng)
    acts = env_actions(env)
    if not acts:
        raise ValueError(f"environment {getattr(env, 'name', type(env).__name__)!r} lists no actions and has no "
                         "random_action hook: it has no random floor (set eval.random_baseline=false)")
    return rng.choice(acts)
