"""MLflow tracking: one MLflow run per Gyre run, resumed by id, with no duplicate points on resume.

The MLflow run id is kept in the run directory; a resumed run reopens it. Before logging a step's
metrics we ask MLflow which steps it already holds, so a step logged just before a crash is not
logged twice. `run_link` says where a person finds the run in the MLflow UI.
"""
from __future__ import annotations

import os
from pathlib import Path


def _mlflow(uri: str):
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    import mlflow

    if uri.startswith("sqlite:///"):
        create_sqlite_store(Path(uri[len("sqlite:///"):]))
    mlflow.set_tracking_uri(uri)
    return mlflow


def create_sqlite_store(path: Path) -> None:
    """Create a local MLflow store whole or not at all: its tables are made in a file beside it, which then
    takes the store's name in one step (a process killed while MLflow migrates its schema left a
    half-created `mlflow.db` that every later run in the directory failed on). A store that exists, or one
    another process created meanwhile, is left as it is."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists():
        return
    from mlflow.tracking import MlflowClient

    import time

    # a name of its own each attempt: MLflow caches a store per URI, so a retry in this process would
    # otherwise reuse the first attempt's (deleted) database
    tmp = path.with_name(f".{path.name}.creating-{os.getpid()}-{time.monotonic_ns()}")
    try:
        MlflowClient(tracking_uri=f"sqlite:///{tmp}").search_experiments(max_results=1)   # makes the tables
        try:
            os.link(tmp, path)            # the store appears complete, or not at all
        except FileExistsError:
            pass
    finally:
        tmp.unlink(missing_ok=True)


TAG_LIMIT = 5000   # characters MLflow keeps in a tag value (8000 on newer servers; stay under both)


class Tracker:
    def __init__(self, uri: str, experiment: str, run_dir: Path, run_name: str):
        self.mlflow = _mlflow(uri)
        from mlflow.tracking import MlflowClient

        self.uri = uri
        self.client = MlflowClient(tracking_uri=uri)
        id_file = run_dir / "mlflow_run_id"
        if id_file.exists():
            self.run_id = id_file.read_text().strip()
        else:
            exp = self.client.get_experiment_by_name(experiment)
            # a local store keeps artifacts beside the runs; a tracking server keeps them where it is told
            # to (`mlflow server --artifacts-destination`), so every host sees them
            local = (run_dir.parent.parent / "mlflow" / "artifacts").resolve().as_uri()
            exp_id = exp.experiment_id if exp else self.client.create_experiment(
                experiment, artifact_location=None if uri.startswith(("http://", "https://")) else local)
            self.run_id = self.client.create_run(exp_id, run_name=run_name).info.run_id
            id_file.write_text(self.run_id)

    def log_params(self, params: dict) -> None:
        have = self.client.get_run(self.run_id).data.params
        todo = {k: str(v)[:6000] for k, v in params.items() if k not in have}
        from mlflow.entities import Param

        items = [Param(k, v) for k, v in todo.items()]
        for i in range(0, len(items), 100):
            self.client.log_batch(self.run_id, params=items[i:i + 100])

    def logged_steps(self, key: str) -> set[int]:
        return {m.step for m in self.client.get_metric_history(self.run_id, key)}

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Log one step's metrics unless MLflow already has that step (resume safety)."""
        import time

        from mlflow.entities import Metric

        if not metrics:
            return
        probe = sorted(metrics)[0]
        if step in self.logged_steps(probe):
            return
        now = int(time.time() * 1000)
        items = [Metric(k, float(v), now, step) for k, v in metrics.items()]
        self.client.log_batch(self.run_id, metrics=items)

    def log_artifact(self, path: Path, subdir: str | None = None) -> None:
        self.client.log_artifact(self.run_id, str(path), subdir)

    def log_dir(self, path: Path | str, artifact_path: str) -> str:
        """Log a directory's files under `artifact_path`; returns `runs:/<run id>/<artifact_path>`."""
        self.client.log_artifacts(self.run_id, str(path), artifact_path)
        return f"runs:/{self.run_id}/{artifact_path}"

    def set_tags(self, tags: dict[str, str]) -> None:
        for k, v in tags.items():
            self.client.set_tag(self.run_id, k, v)

    def append_tag(self, key: str, value: str, limit: int = TAG_LIMIT) -> str:
        """Add `value` to the comma-separated list in tag `key` (once); the oldest entries go first when
        the list would pass MLflow's tag-length limit. Returns the new list."""
        items = [x for x in self.client.get_run(self.run_id).data.tags.get(key, "").split(",") if x]
        if value in items:
            return ",".join(items)
        items.append(value)
        while len(items) > 1 and len(",".join(items)) > limit:
            items.pop(0)
        joined = ",".join(items)
        self.client.set_tag(self.run_id, key, joined)
        return joined

    @property
    def experiment_id(self) -> str:
        if getattr(self, "_experiment_id", None) is None:
            self._experiment_id = self.client.get_run(self.run_id).info.experiment_id
        return self._experiment_id

    def link(self) -> dict[str, str]:
        return run_link(self.uri, self.experiment_id, self.run_id)

    def reopen(self) -> None:
        """Mark a finished (or failed) run as running again: a resumed Gyre run is working on it."""
        if self.client.get_run(self.run_id).info.status != "RUNNING":
            self.client.update_run(self.run_id, status="RUNNING")

    def finish(self, status: str = "FINISHED") -> None:
        self.client.set_terminated(self.run_id, status=status)


def run_link(uri: str, experiment_id: str, run_id: str) -> dict[str, str]:
    """Where the MLflow UI shows a run: `url`, and `hint` (the command that serves the UI first, for a
    tracking URI that is not an MLflow server, e.g. `sqlite:///...`; empty for an http(s) server)."""
    path = f"#/experiments/{experiment_id}/runs/{run_id}"
    if uri.startswith(("http://", "https://")):
        return {"url": f"{uri.rstrip('/')}/{path}", "hint": ""}
    return {"url": f"http://127.0.0.1:5000/{path}", "hint": f"mlflow ui --backend-store-uri {uri}"}


def flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out
