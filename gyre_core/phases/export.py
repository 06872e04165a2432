"""The run in MLflow: tagging its one MLflow run, and exporting the final policy as an HF directory.

    tag_run(run_dir, {"prefect.flow_run_id": ...})   # the orchestrator's ids; returns where the run is
    export_policy(run_dir)                           # runs:/<mlflow run id>/policy
"""
from __future__ import annotations

from ..run import CheckpointError, RunDir
from .run_objects import tracker


def tag_run(run_dir: str, tags: dict[str, str], append: dict[str, str] | None = None) -> dict[str, str]:
    """Tag the run's MLflow run (e.g. with the orchestrator's ids, as plain strings) and mark it running.

    `append` adds each value to a comma-separated list tag instead (every invocation that worked on a
    resumed run stays findable). Also logs `config.yaml` now, so a run that crashes still has it.
    Returns the Gyre run id and where the MLflow run is: its id, experiment id, tracking URI, UI `url`
    and `hint` (see `tracking.run_link`)."""
    run = RunDir.open(run_dir)
    t = tracker(run)
    t.reopen()
    t.set_tags(tags)
    for k, v in (append or {}).items():
        t.append_tag(k, v)
    t.log_artifact(run.path / "config.yaml")
    return {"run_id": run.run_id, "mlflow_run_id": t.run_id, "experiment_id": t.experiment_id, "uri": t.uri,
            **t.link()}


POLICY_ARTIFACT = "policy"   # `runs:/<mlflow run id>/policy`: the newest policy as an HF model directory


def export_policy(run_dir: str) -> str:
    """Log the newest published policy version to the MLflow run as an HF model directory under
    `policy/`, so that `runs:/<mlflow run id>/policy` downloads a directory `model.load_policy` loads.
    Idempotent per (MLflow run, version); returns that URI."""
    run = RunDir.open(run_dir)
    t = tracker(run)
    v = run.latest_version()
    if (m := run.done("export_policy")) is not None and m["version"] == v and m["mlflow_run_id"] == t.run_id:
        return m["uri"]
    import tempfile

    from ..model import _tied_keys, load_policy, save_policy
    from ..trainer.publish import load_weights

    weights = load_weights(run.weights_uri(v))
    policy_dir = run.warm if run.done("warm_start") else run.policy0   # the model the weights fit
    model, tok = load_policy(str(policy_dir), dtype=next(iter(weights.values())).dtype)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    if unexpected or set(missing) - _tied_keys(model):
        raise CheckpointError(f"published weights {run.weights_uri(v)} do not fit the model in {policy_dir}: "
                              f"missing {sorted(set(missing) - _tied_keys(model))[:3]}, unexpected {sorted(unexpected)[:3]}")
    with tempfile.TemporaryDirectory(prefix="gyre-policy-") as d:
        save_policy(model, tok, d)
        uri = t.log_dir(d, POLICY_ARTIFACT)
    t.set_tags({"gyre.policy_version": str(v), "gyre.policy_uri": uri})
    return run.mark("export_policy", {"version": v, "uri": uri, "mlflow_run_id": t.run_id,
                                      "weights": run.weights_uri(v)})["uri"]
