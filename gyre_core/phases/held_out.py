"""Held-out evaluation: the one loop that scores a policy on the config's held-out seeds.

    evaluate(run_dir, "before")      # a run's warm start (v0); "after": its newest version; "control"
    records, summaries = held_out(cfg, label, modes, ...)   # the loop itself (`phases.evaluate_checkpoint` uses it too)

Every evaluation draws the same seeds (`env.eval_seed_start` + i for i < `eval.episodes`) and the same
sampling stream (`seeds.eval_stream`), so a run's before/after and any checkpoint's figures are paired.
Modes: the sampled policy at `rollout.temperature`, the greedy one on the first `eval.greedy_episodes`
seeds, and (for a run's "before") a uniform-random floor.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from ..config import GyreConfig
from ..run import BASE_VERSION, CONTROL_VERSION, RunDir, eval_marker, eval_part
from ..seeds import eval_stream
from ..ui import phase
from .run_objects import engine_at, policy_bundle, run_policy, write_records


@dataclass(slots=True, frozen=True)
class EvalMode:
    name: str                   # sampled | greedy | random
    temperature: float | None   # None: the random policy
    episodes: int               # the first `episodes` held-out seeds


def eval_modes(cfg: GyreConfig, greedy: bool = True, floor: bool = False) -> list[EvalMode]:
    """Sampled always; greedy (on the first `eval.greedy_episodes` seeds) and the uniform-random floor on request."""
    modes = [EvalMode("sampled", cfg.rollout.temperature, cfg.eval.episodes)]
    if greedy and cfg.eval.greedy_episodes:
        modes.append(EvalMode("greedy", 0.0, min(cfg.eval.greedy_episodes, cfg.eval.episodes)))
    if floor and cfg.eval.random_baseline:
        modes.append(EvalMode("random", None, cfg.eval.episodes))
    return modes


def held_out(cfg: GyreConfig, label: str, modes: list[EvalMode], run_id: str, version: int, execution_prefix: str,
             run_specs, engine=None, random_policy=None) -> tuple[list, dict[str, dict]]:
    """Run each mode on its held-out seeds; (all records, {mode: summary dict}).

    `run_specs(specs, policy, on_finish)` runs executions through the harness; the engine is reseeded to
    the evaluation stream before each mode, so every evaluation of every policy samples alike. Execution
    ids are `<execution_prefix><mode>/<i>`."""
    from ..evaluation import summarize
    from ..harness.loop import ExecutionSpec
    from ..harness.policies import EnginePolicy

    all_seeds = [cfg.env.eval_seed_start + i for i in range(cfg.eval.episodes)]
    records, out = [], {}
    for mode in modes:
        seeds = all_seeds[:mode.episodes]
        specs = [ExecutionSpec(run_id, -2, f"{execution_prefix}{mode.name}/{i}", f"seed{s}", s, f"eval-{mode.name}",
                               version) for i, s in enumerate(seeds)]
        if mode.temperature is None:
            policy = random_policy
        else:
            engine.reseed(eval_stream(cfg.run.seed))      # same sampling stream before and after
            policy = EnginePolicy(engine, mode.temperature)
        with phase(f"evaluate {label}: {mode.name}", len(specs)) as tick:
            recs = run_specs(specs, policy, lambda r: tick())
        records += recs
        out[mode.name] = {**summarize(label, mode.name, seeds, [r.success for r in recs], [r.partial for r in recs],
                                     [r.turns for r in recs]).to_dict(), **agent_stats(recs)}
    return records, out


def evaluate(run_dir: str, label: str, version: int | None = None) -> dict:
    """Sampled policy (and greedy, random beside it) on the held-out seeds; recomputed if the version moved.

    "base" is the initial model (before the warm start: `eval.base`), "before" the warm-started policy (v0),
    "control" the supervised-only control, anything else the newest RL version."""
    run = RunDir.open(run_dir)
    if version is None:
        version = {"base": BASE_VERSION, "before": 0, "control": CONTROL_VERSION}.get(label, None)
        version = run.latest_version() if version is None else version
    if (m := run.done(eval_marker(label))) is not None and m["version"] == version:
        return m
    from ..harness.policies import RandomPolicy

    cfg, t0 = run.cfg, time.time()
    b = policy_bundle(run)
    modes = eval_modes(cfg, greedy=label not in ("control", "base"), floor=label == "before")   # sampled, as RL is
    engine = engine_at(run, version) if any(m.temperature is not None for m in modes) else None
    records, summaries = held_out(
        cfg, label, modes, run.run_id, version, f"{run.run_id}/eval-{label}-",
        lambda specs, policy, on_finish: run_policy(run, specs, policy, on_finish), engine=engine,
        random_policy=RandomPolicy(b.tokenizer, b.stop_id, cfg.run.seed))
    write_records(run, eval_part(label), records)
    return run.mark(eval_marker(label), {"label": label, "version": version, **summaries,
                                         "wall_s": time.time() - t0})


def agent_stats(records) -> dict[str, float]:
    """What an agent did, per execution: model calls, compactions (contexts opened from a summary), and, for an
    environment with tools, tool calls made and the share of completions whose tool call could not be parsed
    (the malformed ones among those that tried a tool call or answered)."""
    n = max(len(records), 1)
    out = {"calls_per_execution": sum(len(r.calls) for r in records) / n,
           "compactions_per_execution": sum(r.compactions for r in records) / n}
    parsed = [c for r in records for c in r.calls if c.tool_parse]
    if parsed:
        out["tool_calls_per_execution"] = sum(len(c.tool_spans) for c in parsed) / n
        out["tool_parse_failure_rate"] = sum(c.tool_parse == "malformed" for c in parsed) / len(parsed)
    return out
