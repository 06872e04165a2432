"""The RL loop, one screen: warm start → N × (rollout → score → process → train → publish) → evaluate,
then the supervised-only control (the RL phase's wall time spent on more behaviour cloning) on the same seeds.
With `run.replay` (`gyre train --replay RUN`) the rollouts are a stored run's and nothing is evaluated.

Run it with `gyre train --preset quick` (which calls this flow), or from a Prefect deployment.
Rerunning with the same parameters resumes: finished steps return from their completion markers.
"""
from __future__ import annotations

import time

from prefect import flow

from gyre_core.config import load_config
from tasks import rl


@flow(name="gyre-train", flow_run_name="train-{preset}", validate_parameters=True)
def train(preset: str = "default", overrides: list[str] | None = None, steps: int | None = None) -> dict:
    overrides = list(overrides or []) + ([f"rl.steps={steps}"] if steps is not None else [])
    started_at = time.time()
    cfg = load_config(preset, overrides)          # a bad parameter fails here, before any work
    run_dir = rl.prepare(preset, overrides)
    evaluate = not cfg.run.replay                  # a replay trains on a stored run's trajectories only
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
    return rl.summarize(run_dir, started_at)
