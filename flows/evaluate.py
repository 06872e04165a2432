"""A checkpoint on the preset's held-out seeds, with the same seeds and sampling as a run's before/after
evaluation (`gyre_core.phases.evaluate_checkpoint`).

`checkpoint` is a run directory (its newest published version), an HF model directory, or an MLflow URI
such as `runs:/<mlflow run id>/policy`. The executions land in the lake as run `eval-<label>`, the result
in a new MLflow run tagged `gyre.kind=evaluate`. Run it with `gyre evaluate CHECKPOINT` or from the
`evaluate` deployment.
"""
from __future__ import annotations

from prefect import flow

from gyre_core.phases.evaluate_checkpoint import check_label
from gyre_core.config import load_config
from tasks import ops


@flow(name="gyre-evaluate", flow_run_name="evaluate-{label}", validate_parameters=True)
def evaluate(checkpoint: str, preset: str = "default", overrides: list[str] | None = None,
             episodes: int | None = None, label: str = "checkpoint") -> dict:
    overrides = list(overrides or []) + ([f"eval.episodes={episodes}"] if episodes is not None else [])
    load_config(preset, overrides)          # a bad parameter fails here, before any work
    check_label(label)
    return ops.evaluate_checkpoint(checkpoint, preset, overrides, label)
