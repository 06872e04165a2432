"""The RL loop, one screen: warm start → N × (rollout → score → process → train → publish) → evaluate,
then the supervised-only control (the RL phase's wall time spent on more behaviour cloning) on the same seeds.
With `run.replay` (`gyre train --replay RUN`) the rollouts are a stored run's and nothing is evaluated.

Run it with `gyre train --preset quick` (which calls this flow), or from a Prefect deployment.
Rerunning with the same parameters resumes: finished steps return from their completion markers.
In Prefect the flow run is named `train-<run id>`; each RL step leaves a table artifact `<run-id>-step-<n>`,
the run a markdown `<run-id>-summary` and a link `<run-id>-mlflow` to its one MLflow run, whose `policy/`
artifact (`runs:/<mlflow run id>/policy`) is the final policy as an HF model directory.
"""
from __future__ import annotations

import time

from prefect import flow

from gyre_core.config import load_config
from tasks import rl


def run_name() -> str:
    """`train-<run id>`, the run id as the config resolves it; `train-<preset>` if the parameters are bad
    (the flow then fails on them, with the config's message)."""
    from prefect.runtime import flow_run

    p = flow_run.parameters
    preset = p.get("preset") or "default"
    if p.get("resume_from"):
        return f"train-{p['resume_from']}"
    try:
        return f"train-{load_config(preset, list(p.get('overrides') or [])).run_id()}"
    except Exception:  # noqa: BLE001 - naming must not be where a bad parameter is reported
        return f"train-{preset}"


@flow(name="gyre-train", flow_run_name=run_name, validate_parameters=True)
def train(preset: str = "default", overrides: list[str] | None = None, steps: int | None = None,
          resume_from: str | None = None) -> dict:
    """Train an agent with online RL and report the paired held-out evaluation.

    Args:
        preset: a config preset: smoke, quick, default or long (`gyre presets`).
        overrides: dotted config overrides, e.g. ["rl.lr=1e-4", "rollout.group_size=8"].
        steps: number of RL steps (rl.steps); unset keeps the preset's.
        resume_from: the run id of an earlier run with the same config to continue (its finished
            steps are not redone); unset derives the run id from the preset and seed.
    """
    overrides = list(overrides or []) + ([f"rl.steps={steps}"] if steps is not None else [])
    overrides += [f"run.name={resume_from}"] if resume_from else []
    started_at = time.time()
    cfg = load_config(preset, overrides)          # a bad parameter fails here, before any work
    run_dir = rl.prepare(preset, overrides)
    evaluate = not cfg.run.replay                  # a replay trains on a stored run's trajectories only
    if evaluate and cfg.eval.base:
        rl.evaluate(run_dir, "base")               # the initial model, on its fresh engine
    rl.warm_start(run_dir)
    if evaluate:
        rl.evaluate(run_dir, "before")
    if cfg.elastic.enabled:                        # the same steps, streamed across K cell agents
        rl.elastic(run_dir)
    for step in range(0 if cfg.elastic.enabled else cfg.rl.steps):
        rl.rollout(run_dir, step)
        rl.score(run_dir, step)
        rl.process(run_dir, step)
        rl.train(run_dir, step)
        rl.publish(run_dir, step)
    if evaluate:
        rl.evaluate(run_dir, "after")
    if evaluate and cfg.eval.control:
        rl.control(run_dir)
        rl.evaluate(run_dir, "control")
    rl.export_policy(run_dir)                      # the final policy into MLflow, as an HF directory
    return rl.summarize(run_dir, started_at)
