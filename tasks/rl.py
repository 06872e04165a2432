"""Thin Prefect tasks over `gyre_core.phases`. They pass run-directory paths, never tensors.

Retries are safe: every step is idempotent through its completion marker in the run directory.
What a Prefect user sees besides the task runs (artifacts, MLflow links) comes from `tasks.artifacts`.
"""
from __future__ import annotations

from prefect import task

from gyre_core import phases, report
from gyre_core.config import load_config
from gyre_core.run import RunDir
from tasks import artifacts


@task(name="prepare", task_run_name="prepare", retries=0)
def prepare(preset: str, overrides: list[str]) -> str:
    cfg = load_config(preset, overrides)
    if cfg.elastic.enabled and cfg.elastic.launch == "prefect":   # refuse before any work, not at the RL phase
        from gyre_ops.cell_runs import check_launch

        check_launch(cfg.elastic.cells, cfg.elastic.pool)
    run_dir = phases.prepare(cfg)
    artifacts.link_run(run_dir)        # MLflow run <-> this flow run
    return run_dir


@task(name="warm-start", task_run_name="warm-start", retries=1)
def warm_start(run_dir: str) -> str:
    return phases.warm_start(run_dir)


@task(name="evaluate", task_run_name="evaluate-{label}", retries=1)
def evaluate(run_dir: str, label: str) -> dict:
    return phases.evaluate(run_dir, label)


@task(name="rollout", task_run_name="rollout-{step}", retries=1)
def rollout(run_dir: str, step: int) -> str:
    return phases.rollout(run_dir, step)


@task(name="score", task_run_name="score-{step}", retries=1)
def score(run_dir: str, step: int) -> dict:
    return phases.score(run_dir, step)


@task(name="process", task_run_name="process-{step}", retries=1)
def process(run_dir: str, step: int) -> str:
    return phases.process(run_dir, step)


@task(name="train", task_run_name="train-{step}", retries=1)
def train(run_dir: str, step: int) -> str:
    return phases.train(run_dir, step)


@task(name="publish", task_run_name="publish-{step}", retries=1)
def publish(run_dir: str, step: int) -> str:
    uri = phases.publish(run_dir, step)
    artifacts.step_artifact(run_dir, step)
    return uri


@task(name="elastic-rl", task_run_name="elastic-rl", retries=1)
def elastic(run_dir: str) -> dict:
    from gyre_ops.cell_runs import PrefectCellLauncher
    from gyre_ops.cells import RoleRecorder

    run = RunDir.open(run_dir)
    e = run.cfg.elastic
    launcher = PrefectCellLauncher(run.run_id, e.cells, e.pool) if e.launch == "prefect" else None
    # cell roles as queue moves in the pool (if it exists), and as each cell flow run's role tag
    roles = RoleRecorder(run.run_id, pool=e.pool, flow_runs=launcher.flow_runs if launcher else None)
    try:
        out = phases.elastic_rl(run_dir, on_role=roles, launcher=launcher)
    finally:
        roles.close()
    for step in range(RunDir.open(run_dir).latest_version()):    # one artifact per step, as the loop
        artifacts.step_artifact(run_dir, step)
    return out


@task(name="control", task_run_name="control", retries=1)
def control(run_dir: str) -> dict:
    return phases.control(run_dir)


@task(name="export-policy", task_run_name="export-policy", retries=1)
def export_policy(run_dir: str) -> str:
    return phases.export_policy(run_dir)


@task(name="summarize", task_run_name="summarize")
def summarize(run_dir: str, started_at: float) -> dict:
    summary = report.summarize(run_dir, started_at)
    artifacts.summary_artifact(run_dir, summary)
    return summary
