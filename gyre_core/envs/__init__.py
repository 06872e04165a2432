"""Environments: the Protocol, the plug-in loader and the contract check.

    from gyre_core.envs import load_env, check_environment
    env = load_env("gyre_core.envs.babyai:BabyAIEnv", level="BabyAI-GoToLocal-v0")
    problems = check_environment(env)   # [] when the env keeps the contract

A user's own environment plugs in the same way: `load_env("my_pkg.my_env:MyEnv", **kwargs)`, i.e.
`gyre train --set env.target=my_pkg.my_env:MyEnv`. See `protocol.py` for the contract and the optional
hooks, and `examples/custom_env.py` for a small complete example.
"""
from __future__ import annotations

import importlib
import inspect
import itertools
import math
import random
import sys
import time
from typing import Any

from gyre_core.envs.protocol import (
    HOOKS,
    Environment,
    Score,
    StepResult,
    env_actions,
    has_random_action,
    missing_members,
    random_action,
    supports,
)

__all__ = [
    "HOOKS", "Environment", "Score", "StepResult", "check_environment", "close_env", "configured_env",
    "env_actions", "has_random_action", "load_env", "missing_members", "random_action", "reset_env", "split_of",
    "supports",
]

# Text no environment should accept as an action.
INVALID_ACTION = "@@ not-an-action ?!"


def configured_env(env_cfg) -> Environment:
    """The environment a config's `env` section names (`target` with `kwargs`); anything that stops it from
    being made is a `ConfigError` naming `env.target`, so a run refuses it before any work."""
    from gyre_core.config import ConfigError

    try:
        return load_env(env_cfg.target, **env_cfg.kwargs)
    except ConfigError:
        raise
    except Exception as exc:  # noqa: BLE001 - a user's constructor may raise anything
        raise ConfigError(f"env.target: {exc}") from None


def load_env(target: str, **kwargs: Any) -> Environment:
    """Build the environment named by `target` ("module.path:callable") with `kwargs`; a target the
    machine's GYRE_ALLOW_ENVS does not allow is refused before anything is imported (`gyre_core.trust`).

    Raises ValueError (one line) when the module or attribute does not exist, or when the result does
    not satisfy the Environment Protocol (naming the missing members).
    """
    from ..trust import check_env_target

    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"env target {target!r} must look like 'module.path:callable'")
    check_env_target(target)            # before the module's code runs (GYRE_ALLOW_ENVS)
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"env target {target!r}: cannot import module {module_name!r} ({e})") from e
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"env target {target!r}: module {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"env target {target!r}: {attr!r} is not callable")
    env = obj(**kwargs)
    missing = missing_members(env)
    if missing:
        raise ValueError(
            f"env target {target!r} does not satisfy the Environment protocol: missing {', '.join(missing)}"
        )
    return env


def split_of(execution_split: str) -> str:
    """The split an environment is told, from an execution's: "train" (RL), "eval" (held-out evaluations:
    eval-sampled, eval-greedy, eval-random) or "demo" (demonstrations: the warm start's and the control's)."""
    return "eval" if execution_split.startswith("eval") else "train" if execution_split == "train" else "demo"


def reset_env(env, seed: int, split: str):
    """`env.reset(seed)`; an environment whose `reset` takes a `split` parameter is told which split the
    seed is for (`split_of`), so it need not guess from seed ranges."""
    kind = type(getattr(env.reset, "__self__", env))        # (a wrapper's reset is its environment's)
    takes = _RESET_TAKES_SPLIT.get(kind)
    if takes is None:
        try:
            takes = "split" in inspect.signature(env.reset).parameters
        except (TypeError, ValueError):
            takes = False
        _RESET_TAKES_SPLIT[kind] = takes
    return env.reset(seed, split=split_of(split)) if takes else env.reset(seed)


_RESET_TAKES_SPLIT: dict[type, bool] = {}


def close_env(env) -> None:
    """The environment's optional `close()`, once an execution is over (scored or failed): an interpreter, a
    container or a game process held per execution is let go. What `close()` raises is said, never fatal."""
    if supports(env, "close"):
        try:
            env.close()
        except Exception as exc:  # noqa: BLE001 - a failing close must not lose the execution
            print(f"gyre: {getattr(env, 'name', type(env).__name__)}.close() raised {type(exc).__name__}: {exc}",
                  file=sys.stderr)


class LatencyEnv:
    """`env` with every `step` taking `latency_s` longer (a sandboxed tool's round trip); all else as is."""

    def __init__(self, env: Environment, latency_s: float) -> None:
        self._env, self._latency = env, latency_s

    def step(self, action: str):
        time.sleep(self._latency)
        return self._env.step(action)

    def __getattr__(self, name: str):
        return getattr(self._env, name)


def check_environment(env: object, seeds: tuple[int, ...] = (0, 1), steps: int = 12) -> list[str]:
    """Contract violations of `env` (an empty list means it keeps the contract).

    Checks the required members and their types, reset determinism (same seed: same mission, same first
    observation, same observations for the same actions), that `step` returns a StepResult, that an
    unparseable action gives valid=False and leaves the state unchanged, that scores are in [0, 1], and
    the optional hooks (expert_action answers one of `actions` or None; save/restore reproduces the
    following observations; corpus yields strings deterministically without disturbing the episode;
    tools are well-formed function schemas with distinct names, and calling an unknown tool raises; a
    workspace is set up alike for the same seed and scores when untouched).
    Probes play `steps` actions per seed (random words, half replaced by the expert's when there is
    one), several times each, so keep `steps` small for slow envs.
    """
    missing = missing_members(env)
    if missing:
        return [f"missing required members: {', '.join(missing)}"]
    problems: list[str] = []
    checks = [_check_members, _check_reset, _check_steps, _check_invalid_action]
    if supports(env, "expert_action"):
        checks.append(_check_expert)
    if supports(env, "save_state"):
        checks.append(_check_save_restore)
    if supports(env, "corpus"):
        checks.append(_check_corpus)
    if supports(env, "progress"):
        checks.append(_check_progress)
    if supports(env, "tools"):
        checks.append(_check_tools)
    if supports(env, "setup_workspace"):
        checks.append(_check_workspace)
    for check in checks:
        try:
            problems += check(env, seeds, steps)
        except Exception as e:  # a crash is a violation too; report it and keep checking
            problems.append(f"{check.__name__[7:]}: raised {type(e).__name__}: {e}")
    return problems


# --- the individual checks; each returns a list of violations -------------------------------------

def _check_members(env: Any, seeds: tuple[int, ...], steps: int) -> list[str]:
    out = []
    if not isinstance(env.name, str) or not env.name:
        out.append("name must be a non-empty str")
    acts = getattr(env, "actions", ())
    if not isinstance(acts, tuple):
        out.append("actions must be a tuple of str (empty, or left out, for an open-ended env)")
    elif not all(isinstance(a, str) and a and a == a.strip() and "\n" not in a for a in acts):
        out.append("actions must be non-empty text on one line, without leading or trailing whitespace")
    elif len(set(acts)) != len(acts):
        out.append("actions must not repeat")
    text = env.instructions()
    if not isinstance(text, str) or not text.strip():
        out.append("instructions() must return non-empty text")
    if not isinstance(getattr(env, "free_text", False), bool):
        out.append("free_text must be a bool")
    if not acts and not supports(env, "random_action") and not supports(env, "expert_action"):
        out.append("an env without actions needs random_action or expert_action (the contract check, the "
                   "random floor and the warm start have nothing else to act with)")
    return out


def _check_reset(env: Any, seeds: tuple[int, ...], steps: int) -> list[str]:
    out = []
    before = env.instructions()
    for seed in seeds:
        first, mission = reset_env(env, seed, "train"), env.mission()
        if not isinstance(first, str) or not isinstance(mission, str):
            out.append(f"reset({seed}) and mission() must return str")
            continue
        ref = _rollout(env, seed, _probe(env, seed, steps))
        again = _rollout(env, seed, _probe(env, seed, steps))
        if reset_env(env, seed, "train") != first or env.mission() != mission:
            out.append(f"reset({seed}) is not deterministic: "
                       "a second reset gave a different observation/mission")
        elif [r.observation for r in ref] != [r.observation for r in again]:
            out.append(f"seed {seed}: the same actions gave different observations after two resets")
    if env.instructions() != before:
        out.append("instructions() must be the same for every episode")
    return out


def _check_steps(env: Any, seeds: tuple[int, ...], steps: int) -> list[str]:
    out = []
    for seed in seeds:
        probe = _probe(env, seed, steps)  # (recording the probe plays it once; start over)
        reset_env(env, seed, "train")
        out += _score_problems(env, f"seed {seed} after reset")
        for i, action in enumerate(probe):
            res = _act(env, action)
            if not isinstance(res, StepResult):
                return out + [f"step() must return StepResult, got {type(res).__name__}"]
            types = (type(res.observation), type(res.done), type(res.valid))
            if types != (str, bool, bool):
                out.append("StepResult fields must be (str, bool, bool)")
            if not res.valid:
                out.append(f"step({action!r}) with an action from `actions` (or `random_action`) gave valid=False")
            out += _score_problems(env, f"seed {seed} step {i}")
            if not isinstance(env.summary(), str):
                out.append("summary() must return str")
            if res.done:
                break
    return sorted(set(out), key=out.index)


def _check_invalid_action(env: Any, seeds: tuple[int, ...], steps: int) -> list[str]:
    out = []
    for seed in seeds:
        probe = _probe(env, seed, steps)
        ref = _rollout(env, seed, probe)
        at = len(ref) // 2  # inject in the middle of the episode, before a step that was not yet done
        reset_env(env, seed, "train")
        for action in probe[:at]:
            _act(env, action)
        score_before, summary_before = env.score(), env.summary()
        bad = env.step(INVALID_ACTION)
        if getattr(env, "free_text", False):   # every non-empty text is an action: junk must be taken as one
            if not isinstance(bad, StepResult) or not bad.valid or not isinstance(bad.observation, str):
                out.append(f"free_text env: step({INVALID_ACTION!r}) must return StepResult with valid=True")
            continue
        if not isinstance(bad, StepResult) or bad.valid:
            out.append(f"step({INVALID_ACTION!r}) must return StepResult with valid=False")
            continue
        if not isinstance(bad.observation, str) or not bad.observation:
            out.append("an invalid action must give a short error message as observation")
        if bad.done:
            out.append("an invalid action must not end the episode")
        if env.score() != score_before or env.summary() != summary_before:
            out.append("an invalid action changed score() or summary(): the state must stay unchanged")
        rest = _run(env, probe[at:])
        if [r.observation for r in rest] != [r.observation for r in ref[at:]]:
            out.append("an invalid action changed the state: later observations differ")
    return out


def _tool_calls(env: Any, action: str):
    """The tool calls `action` makes (the harness's format) when `env` has tools; None if it makes none."""
    from gyre_core.harness.tools import PARSE_NONE, parse_tool_calls

    if not supports(env, "tools") or "<tool_call>" not in action:
        return None
    parsed = parse_tool_calls(action)
    return None if parsed.status == PARSE_NONE else parsed


def _act(env: Any, action: str) -> StepResult:
    """One turn as the harness plays it: tool calls run through `call_tool` (their results are the
    observation; a failing tool is an error result), anything else goes to `step`."""
    from gyre_core.harness.tools import PARSE_OK

    parsed = _tool_calls(env, action)
    if parsed is None:
        return env.step(action)
    if parsed.status != PARSE_OK:
        return StepResult(f"malformed tool call: {parsed.error}", done=False, valid=False)
    results = []
    for c in parsed.calls:
        try:
            out = env.call_tool(c.name, c.arguments)
        except Exception as exc:  # noqa: BLE001 - a tool's failure is the agent's observation
            out = f"error: {type(exc).__name__}: {exc}"
        if isinstance(out, StepResult):
            return out
        results.append(str(out))
    return StepResult("\n".join(results), done=False)


def _expert_tool_calls(env: Any, action: str, tools: set[str]) -> str | None:
    """An expert action that is tool calls (the harness's format): run them as the harness would. None: not
    tool calls; "": ran; else what went wrong."""
    from gyre_core.harness.tools import PARSE_MALFORMED, PARSE_NONE, parse_tool_calls

    parsed = parse_tool_calls(action, tools)
    if parsed.status == PARSE_NONE:
        return None
    if parsed.status == PARSE_MALFORMED:
        return f"a malformed tool call ({parsed.error})"
    for c in parsed.calls:
        try:
            env.call_tool(c.name, c.arguments)
        except Exception as exc:  # noqa: BLE001 - the expert's own call must work
            return f"its call of {c.name} raised {type(exc).__name__}: {exc}"
    return ""


def _check_expert(env: Any, seeds: tuple[int, ...], steps: int) -> list[str]:
    """The expert's actions are action words (or, for an env with tools, tool calls in the harness's format,
    which must run), and scores stay in range along its episodes."""
    tools = ({t["function"]["name"] for t in env.tools() if isinstance(t, dict) and isinstance(t.get("function"), dict)
              and isinstance(t["function"].get("name"), str)} if supports(env, "tools") else None)
    out: list[str] = []
    for seed in seeds:
        reset_env(env, seed, "train")
        for i in range(4 * steps):
            action = env.expert_action()
            if action is None:
                break
            if tools is not None and (called := _expert_tool_calls(env, action, tools)) is not None:
                if called:
                    return [f"expert_action(): {called}"]
                continue
            if env_actions(env) and action not in env_actions(env):
                return [f"expert_action() returned {action!r}, not one of actions or None"]
            res = env.step(action)
            if not res.valid:
                return [f"expert_action() returned {action!r}, which step() rejected"]
            out += _score_problems(env, f"seed {seed} expert step {i}")
            if res.done:
                break
    return sorted(set(out), key=out.index)


def _check_save_restore(env: Any, seeds: tuple[int, ...], steps: int) -> list[str]:
    out = []
    for seed in seeds:
        probe = _probe(env, seed, 2 * steps)
        at = len(_rollout(env, seed, probe)) // 2  # fork mid-episode (right after reset if it is short)
        reset_env(env, seed, "train")
        _run(env, probe[:at])
        state, score, summary = env.save_state(), env.score(), env.summary()
        first = [r.observation for r in _run(env, probe[at:])]
        for attempt in ("first", "second"):
            env.restore_state(state)
            if env.score() != score or env.summary() != summary:
                out.append(f"seed {seed}: {attempt} restore_state did not restore score()/summary()")
            again = [r.observation for r in _run(env, probe[at:])]
            if again != first:
                out.append(f"seed {seed}: after the {attempt} restore_state "
                           "the same actions gave other observations")
    return sorted(set(out), key=out.index)


def _check_corpus(env: Any, seeds: tuple[int, ...], steps: int) -> list[str]:
    texts = list(itertools.islice(env.corpus(2, 0), 500))
    if not texts or not all(isinstance(t, str) for t in texts):
        return ["corpus() must yield at least one str, and only str"]
    if list(itertools.islice(env.corpus(2, 0), 500)) != texts:
        return ["corpus(episodes, seed) must be deterministic"]
    probe = _probe(env, seeds[0], 2)
    ref = _rollout(env, seeds[0], probe)
    if len(ref) < 2 or ref[0].done:
        return []
    reset_env(env, seeds[0], "train")
    _act(env, probe[0])
    list(itertools.islice(env.corpus(1, 7), 200))
    if _act(env, probe[1]).observation != ref[1].observation:
        return ["corpus() disturbed the current episode"]
    return []


def _check_tools(env: Any, seeds: tuple[int, ...], steps: int) -> list[str]:
    """`tools()`: a non-empty list of {"type": "function", "function": {"name": str, "parameters": dict}}
    with distinct names; `call_tool` with a name not declared raises (the agent then sees an error)."""
    tools = env.tools()
    if not isinstance(tools, list) or not tools:
        return ["tools: tools() must return a non-empty list of function schemas"]
    problems, names = [], []
    for t in tools:
        fn = t.get("function") if isinstance(t, dict) else None
        if not (isinstance(t, dict) and t.get("type") == "function" and isinstance(fn, dict)
                and isinstance(fn.get("name"), str) and isinstance(fn.get("parameters", {}), dict)):
            problems.append(f"tools: {t!r:.120} is not {{'type': 'function', 'function': {{'name': ..., 'parameters': {{...}}}}}}")
            continue
        names.append(fn["name"])
    if len(set(names)) != len(names):
        problems.append(f"tools: tool names repeat: {names}")
    reset_env(env, seeds[0], "train")
    try:
        env.call_tool("\x00no such tool", {})
        problems.append("tools: call_tool with an undeclared name returned instead of raising")
    except Exception:  # noqa: BLE001 - raising is what is asked
        pass
    return problems


def _check_workspace(env: Any, seeds: tuple[int, ...], steps: int) -> list[str]:
    """`setup_workspace(path)` returns the task text, the same files and text for the same seed; the untouched
    workspace scores as a Score (or None) with partial in [0, 1]."""
    import tempfile
    from pathlib import Path

    def snapshot(seed: int):
        with tempfile.TemporaryDirectory() as d:
            reset_env(env, seed, "train")
            task = env.setup_workspace(d)
            files = {str(f.relative_to(d)): f.read_bytes() for f in sorted(Path(d).rglob("*")) if f.is_file()}
            score = env.score_workspace(d)
        return task, files, score

    out = []
    for seed in seeds:
        (task, files, score), (task2, files2, _) = snapshot(seed), snapshot(seed)
        if not isinstance(task, str) or not task:
            out.append(f"workspace: setup_workspace returned {task!r:.80}, not the task text")
        if (task, files) != (task2, files2):
            out.append(f"workspace: seed {seed} set up a different workspace or task the second time")
        if score is not None and not (isinstance(score, Score) and 0.0 <= score.partial <= 1.0):
            out.append(f"workspace: score_workspace of an untouched workspace gave {score!r:.80}")
    return out


def _check_progress(env: Any, seeds: tuple[int, ...], steps: int) -> list[str]:
    """progress() is a number in [0, 1] at every state of a probe, 1.0 once solved, and asking it does not
    change what the episode does next."""
    out = []
    for seed in seeds:
        probe = _probe(env, seed, steps)
        ref = _rollout(env, seed, probe)
        reset_env(env, seed, "train")
        for i, action in enumerate(probe):
            p = env.progress()
            if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 <= p <= 1.0:
                out.append(f"seed {seed}: progress() returned {p!r}, not a number in [0, 1]")
                break
            env.progress()
            if _act(env, action).observation != ref[i].observation:
                out.append(f"seed {seed}: calling progress() changed the episode")
                break
        else:
            if env.score().success and env.progress() != 1.0:
                out.append(f"seed {seed}: progress() is {env.progress()!r} in a solved episode, not 1.0")
    return sorted(set(out), key=out.index)


# --- helpers ----------------------------------------------------------------------------------------

def _probe(env: Any, seed: int, steps: int) -> list[str]:
    """A fixed action sequence for `seed` (the same on every call of a deterministic env): random
    words, half of them replaced by the expert's when it has one, so probes also reach deep states.
    Recorded from one rollout; it stops at the action that ended the episode."""
    rng = random.Random(seed * 7919 + 17)
    use_expert = supports(env, "expert_action")
    reset_env(env, seed, "train")
    out: list[str] = []
    for _ in range(steps):
        action = None
        if use_expert and rng.random() < 0.5:
            try:
                action = env.expert_action()
            except Exception:  # reported by the expert check; probe randomly here
                use_expert = False
        if action is None or (env_actions(env) and action not in env_actions(env)
                              and _tool_calls(env, action) is None):
            if not has_random_action(env):
                break
            action = random_action(env, rng)
        out.append(action)
        if _act(env, action).done:
            break
    return out


def _rollout(env: Any, seed: int, actions: list[str]) -> list[StepResult]:
    reset_env(env, seed, "train")
    return _run(env, actions)


def _run(env: Any, actions: list[str]) -> list[StepResult]:
    """Step through `actions`, stopping after the step that ended the episode."""
    results = []
    for a in actions:
        results.append(_act(env, a))
        if results[-1].done:
            break
    return results


def _score_problems(env: Any, where: str) -> list[str]:
    s = env.score()
    if not isinstance(s, Score):
        return [f"{where}: score() must return Score, got {type(s).__name__}"]
    out = []
    if not isinstance(s.success, bool):
        out.append("Score.success must be bool")
    p = s.partial
    if not isinstance(p, (int, float)) or math.isnan(p) or not 0.0 <= p <= 1.0:
        out.append(f"{where}: Score.partial={p!r} is outside [0, 1]")
    elif s.success and p != 1.0:
        out.append(f"{where}: Score.partial must be 1.0 on success, got {p}")
    if not isinstance(s.details, dict) or not all(
        isinstance(k, str) and isinstance(v, (int, float)) for k, v in s.details.items()
    ):
        out.append("Score.details must map str to numbers")
    return out
