"""Thin Prefect tasks of the `evaluate` and `lake-maintenance` flows, over `gyre_core.phases.evaluate_checkpoint` and
`gyre_core.lake.maintenance`. They pass the preset and overrides, run ids and small dicts, never tensors.
"""
from __future__ import annotations

from prefect import task

from gyre_core.config import load_config
from gyre_core.lake import Lake
from gyre_core.lake import maintenance as lm
from gyre_core.phases import evaluate_checkpoint as checkpoints


def _lake(preset: str, overrides: list[str]) -> Lake:
    return Lake.from_config(load_config(preset, overrides).lake)


# a bad checkpoint fails once, naming it; the evaluation itself is deterministic
@task(name="evaluate-checkpoint", task_run_name="evaluate-{label}", retries=0)
def evaluate_checkpoint(checkpoint: str, preset: str, overrides: list[str], label: str) -> dict:
    return checkpoints.evaluate_checkpoint(load_config(preset, overrides), checkpoint, label)


@task(name="lake-runs")
def lake_runs(preset: str, overrides: list[str], runs: list[str] | None) -> list[str]:
    return lm.lake_runs(_lake(preset, overrides), runs)


@task(name="retention", retries=1)
def retain(preset: str, overrides: list[str], runs: list[str], days: float, keep: list[str],
           dry_run: bool) -> list[dict]:
    return lm.retain(_lake(preset, overrides), days, keep, runs, dry_run)


@task(name="check", task_run_name="check-{run_id}", retries=1)
def check_run(preset: str, overrides: list[str], run_id: str, dry_run: bool) -> list[dict]:
    return lm.check_run(_lake(preset, overrides), run_id, dry_run)


@task(name="compact", task_run_name="compact-{run_id}", retries=1)
def compact_run(preset: str, overrides: list[str], run_id: str, dry_run: bool) -> dict:
    return lm.compact_run(_lake(preset, overrides), run_id, dry_run)
