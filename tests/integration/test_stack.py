"""`gyre up` / `gyre down` for real: a Prefect server, an MLflow server, the pool, every deployment of
prefect.yaml and a worker; `train` triggered through the API exactly as the UI does (a flow run created
from the deployment with parameters), then checked in the lake and in MLflow; bad parameters fail fast;
and after `gyre down` nothing it started still runs or listens.

    .venv/bin/python -m pytest tests/integration/test_stack.py -q -p no:cacheprovider
"""
from __future__ import annotations

import socket

import psutil
import pytest

from gyre_ops.stack import StackError, StackSpec, down, listening, read_state, up


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("stack")
    spec = StackSpec(home=tmp / "home", prefect_port=_free_port(), mlflow_port=_free_port())
    state = up(spec, say=lambda m: None)
    try:
        yield spec, state, tmp
    finally:
        if read_state(spec.home) is not None:
            down(spec.home, say=lambda m: None)


def _run(spec, deployment: str, parameters: dict, timeout: int = 900):
    from prefect.deployments import run_deployment
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(updates={PREFECT_API_URL: spec.api_url}):
        return run_deployment(deployment, parameters=parameters, timeout=timeout)


def test_train_from_the_api_lands_in_the_lake_and_mlflow(stack):
    spec, state, tmp = stack
    assert listening(spec.host, spec.prefect_port) and listening(spec.host, spec.mlflow_port)
    with pytest.raises(StackError, match="already up"):
        up(spec, say=lambda m: None)
    overrides = [f"run.out_root={tmp}/runs", f"lake.root={tmp}/lake", "run.name=stacktest",
                 "eval.control=false"]
    fr = _run(spec, "gyre-train/train", {"preset": "smoke", "overrides": overrides, "steps": 1})
    assert fr.state.is_completed(), fr.state
    assert "stacktest" in fr.name
    from gyre_core.lake.sql import connect

    con = connect(str(tmp / "lake"), run_id="stacktest")
    assert con.execute("SELECT count(*) FROM executions WHERE split = 'train'").fetchall() == [(8,)]
    # the worker pointed the run at the stack's MLflow server
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=spec.mlflow_url)
    (run,) = client.search_runs([client.get_experiment_by_name("gyre").experiment_id],
                                "attributes.run_name = 'stacktest'")
    assert [m.step for m in client.get_metric_history(run.info.run_id, "reward/mean")] == [0]


def test_bad_parameters_fail_fast_with_the_config_error(stack):
    spec, _, tmp = stack
    fr = _run(spec, "gyre-train/train", {"preset": "smoke", "overrides": ["rl.lr=-1"]}, timeout=300)
    assert fr.state.is_failed()
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(updates={PREFECT_API_URL: spec.api_url}):
        from prefect.client.orchestration import get_client

        with get_client(sync_client=True) as c:
            tasks = c.read_task_runs()
    # the config was refused before the first task (nothing was prepared, no model was built)
    assert not [t for t in tasks if t.flow_run_id == fr.id]
    assert "rl.lr" in (fr.state.message or "") or "rl.lr" in str(fr.state.result(raise_on_failure=False))


def test_down_stops_exactly_what_up_started(stack):
    spec, state, _ = stack
    pids = [p["pid"] for p in state["processes"].values()]
    children = [c.pid for pid in pids for c in psutil.Process(pid).children(recursive=True)]
    stopped = down(spec.home, say=lambda m: None)
    assert set(stopped) == set(state["processes"])
    assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
                   for p in pids + children)
    assert not listening(spec.host, spec.prefect_port) and not listening(spec.host, spec.mlflow_port)
    assert read_state(spec.home) is None
    assert down(spec.home, say=lambda m: None) == {}
