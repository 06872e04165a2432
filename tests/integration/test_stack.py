"""`gyre up` / `gyre down` for real: a Prefect server, an MLflow server, the pool, every deployment of
prefect.yaml and a worker; `train` triggered through the API exactly as the UI does (a flow run created
from the deployment with parameters), then checked in the lake and in MLflow; bad parameters fail fast;
a run whose worker and flow-run process are SIGKILLed is marked Crashed by the zombie automation, and
`prefect flow-run retry` resumes it to the weights of the run that never crashed; the nightly schedule is
what prefect.yaml says and can be switched on; and after `gyre down` nothing it started still runs or listens.

    .venv/bin/python -m pytest tests/integration/test_stack.py -q -p no:cacheprovider
"""
from __future__ import annotations

import datetime
import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
import torch

from gyre_core.ports import free_port
from gyre_ops.stack import StackError, StackSpec, down, listening, read_state, up


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("stack")
    # heartbeats come every 30 s; 60 s of silence marks a run Crashed (the shipped default is 90 s)
    # two CPU cell workers run the cell agents of elastic.launch=prefect
    # workers poll every 2 s and the scheduler loops every 5 s (Prefect's defaults: 10 s and 60 s), so the
    # tests wait on their subject, not on polling
    spec = StackSpec(home=tmp / "home", prefect_port=free_port(), mlflow_port=free_port(), zombie_after_s=60,
                     device_sets=["cpu", "cpu"], worker_poll_s=2, scheduler_loop_s=5)
    state = up(spec, say=lambda m: None)
    try:
        yield spec, state, tmp
    finally:
        if read_state(spec.home) is not None:
            down(spec.home, say=lambda m: None)


def _overrides(tmp, name: str) -> list[str]:
    return [f"run.out_root={tmp}/runs", f"lake.root={tmp}/lake", f"run.name={name}", "eval.control=false"]


# stacktest and crashtest: 4 tasks × 8 a step. The smoke preset's 2 × 4 gave seed 0's two RL steps no
# gradient (all groups' rewards equal), and the crash test's exact-weight check would compare warm starts.
WORKLOAD = ["rollout.tasks_per_step=4", "rollout.group_size=8"]


def _client(spec):
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(updates={PREFECT_API_URL: spec.api_url}):
        return get_client(sync_client=True)


def _wait(predicate, timeout_s: float, what: str, every_s: float = 1.0):
    t0 = time.time()
    while time.time() - t0 < timeout_s:
        out = predicate()
        if out:
            return out
        time.sleep(every_s)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")


def _run(spec, deployment: str, parameters: dict, timeout: int = 900):
    from prefect.deployments import run_deployment
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(updates={PREFECT_API_URL: spec.api_url}):
        return run_deployment(deployment, parameters=parameters, timeout=timeout)


def _stacktest(spec, tmp):
    """The clean two-step run through the deployment (the crash test's reference)."""
    return _run(spec, "gyre-train/train", {"preset": "smoke", "overrides": _overrides(tmp, "stacktest") + WORKLOAD,
                                           "steps": 2})


def test_train_from_the_api_lands_in_the_lake_and_mlflow(stack):
    spec, state, tmp = stack
    assert listening(spec.host, spec.prefect_port) and listening(spec.host, spec.mlflow_port)
    with pytest.raises(StackError, match="already up"):
        up(spec, say=lambda m: None)
    fr = _stacktest(spec, tmp)
    assert fr.state.is_completed(), fr.state
    assert "stacktest" in fr.name
    from gyre_core.lake.sql import connect

    con = connect(str(tmp / "lake"), run_id="stacktest")
    assert con.execute("SELECT count(*) FROM executions WHERE split = 'train'").fetchall() == [(2 * 4 * 8,)]
    # the worker pointed the run at the stack's MLflow server
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=spec.mlflow_url)
    (run,) = client.search_runs([client.get_experiment_by_name("gyre").experiment_id],
                                "attributes.run_name = 'stacktest'")
    assert [m.step for m in client.get_metric_history(run.info.run_id, "reward/mean")] == [0, 1]


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
    # cells that the rollout queue cannot admit are refused before anything is prepared
    too_many = ["elastic.enabled=true", "elastic.launch=prefect", "elastic.cells=5", f"run.out_root={tmp}/runs",
                "run.name=toomany"]
    fr = _run(spec, "gyre-train/train", {"preset": "smoke", "overrides": too_many}, timeout=300)
    assert fr.state.is_failed()
    assert "admits 4 cell(s)" in str(fr.state.result(raise_on_failure=False))
    assert not (tmp / "runs" / "toomany").exists()


def test_elastic_cells_run_as_flow_runs_of_the_cell_agent_deployment(stack):
    """elastic.launch=prefect: each cell agent is a flow run of `cell-agent` on queue `rollout`, run by a cell
    worker, a subflow of the train run; its role tag and the retag events follow the coordinator's switches."""
    spec, _, tmp = stack
    ov = _overrides(tmp, "celltest") + ["elastic.enabled=true", "elastic.launch=prefect", "elastic.cells=2",
                                        "elastic.micro_step_executions=2", "elastic.capacity=4"]
    fr = _run(spec, "gyre-train/train", {"preset": "smoke", "overrides": ov, "steps": 2})
    assert fr.state.is_completed(), fr.state
    client = _client(spec)
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId

    from gyre_ops.cells import retag_history

    dep = client.read_deployment_by_name("gyre-cell-agent/cell-agent")
    cells = sorted(client.read_flow_runs(deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[dep.id]))),
                   key=lambda r: r.name)
    assert [c.name for c in cells] == ["celltest-c0", "celltest-c1"]
    for c in cells:
        assert c.state.is_completed() and c.work_queue_name == "rollout"
        assert client.read_task_run(c.parent_task_run_id).flow_run_id == fr.id       # a subflow of this run
        assert {"gyre", "gyre-cell", "gyre-run:celltest", "role:rollout"} <= set(c.tags)   # home again
    summary = json.loads((tmp / "runs" / "celltest" / "elastic" / "summary.json").read_text())
    assert summary["launch"] == "prefect" and summary["dead_cells"] == [] and summary["switches"] >= 1
    for i, c in enumerate(cells):
        # the coordinator's own switch marks are the reference: placed, each switch, then home
        expected, cur = [("gyre.cell.placed", None, "rollout")], "rollout"
        for src, dst in [(m[2], m[3]) for m in summary["switch_marks"] if m[0] == i] + [(None, "rollout")]:
            if dst != cur:
                expected.append(("gyre.cell.retagged", cur, dst))
                cur = dst
        history = retag_history(client, f"celltest-c{i}")
        assert [(h["event"], h["from_queue"], h["to_queue"]) for h in history] == expected
        assert {h["flow_run"] for h in history} == {str(c.id)}
    limits = {q.name: q.concurrency_limit for q in client.read_work_queues(work_pool_name="gyre")}
    assert (limits["rollout"], limits["train"]) == (4, 0)          # infra/pools.yaml's again
    assert not [b for b in client.read_block_documents() if b.name.startswith("gyre-cell-key-")]
    from gyre_core.lake.sql import connect

    con = connect(str(tmp / "lake"), run_id="celltest")
    assert con.execute("SELECT step, count(*) FROM executions WHERE split = 'train' GROUP BY 1 ORDER BY 1"
                       ).fetchall() == [(0, 8), (1, 8)]


@pytest.mark.fault("SIGKILL of a Prefect worker mid-run", "the flow run is marked Crashed; a retry resumes it to the same weights")
def test_a_killed_run_is_marked_crashed_and_a_retry_resumes_it_exactly(stack):
    spec, state, tmp = stack
    from prefect.deployments import run_deployment
    from prefect.settings import PREFECT_API_URL, temporary_settings

    params = {"preset": "smoke", "overrides": _overrides(tmp, "crashtest") + WORKLOAD, "steps": 2}
    with temporary_settings(updates={PREFECT_API_URL: spec.api_url}):
        fr = run_deployment("gyre-train/train", parameters=params, timeout=0)   # what the UI's Run does
    client = _client(spec)
    markers = tmp / "runs" / "crashtest" / "markers"
    _wait(lambda: (markers / "train_0001.json").exists(), 600, "step 0 to be trained", every_s=0.05)
    worker = psutil.Process(state["processes"]["worker-cpu-0"]["pid"])
    orphans = worker.children(recursive=True)
    assert orphans, "the worker runs the flow in a child process"
    worker.send_signal(signal.SIGKILL)                       # the host's OOM killer, or a kill -9
    worker.wait(10)
    assert all(p.is_running() for p in orphans)              # SIGKILL of the worker leaves its run running
    for p in orphans:
        p.send_signal(signal.SIGKILL)
    psutil.wait_procs(orphans, timeout=10)
    before = {p.name: json.loads(p.read_text())["marked_at"] for p in markers.glob("*.json")}
    assert "train_0001.json" in before and "train_0002.json" not in before      # killed mid-run

    # no heartbeat for 60 s: the automation `gyre up` created marks it Crashed
    crashed = _wait(lambda: (r := client.read_flow_run(fr.id)).state.is_crashed() and r, 300,
                    "the zombie automation to mark the run Crashed", every_s=3)
    assert "no heartbeat" in (crashed.state.message or "")

    # `gyre up` again restarts exactly the dead worker; the CLI's retry (the UI's Retry) reschedules the run
    revived = up(spec, say=lambda m: None)
    assert set(revived["revived"][-1]["processes"]) == {"worker-cpu-0"}
    state["processes"].update(revived["processes"])          # so that `down` is checked against it too
    env = {**os.environ, "PREFECT_API_URL": spec.api_url}
    out = subprocess.run([sys.executable, "-m", "prefect", "flow-run", "retry", str(fr.id)], env=env,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    done = _wait(lambda: (r := client.read_flow_run(fr.id)).state.is_final() and r, 900, "the retried run to end",
                 every_s=3)
    assert done.state.is_completed(), done.state
    history = [s.type.value for s in client.read_flow_run_states(fr.id)]
    assert "CRASHED" in history and history[-1] == "COMPLETED"

    # finished steps came back from their markers, not redone; nothing lost or duplicated in the lake
    after = {p.name: json.loads(p.read_text())["marked_at"] for p in markers.glob("*.json")}
    assert all(after[name] == t for name, t in before.items())
    from gyre_core.lake.sql import connect

    con = connect(str(tmp / "lake"), run_id="crashtest")
    assert con.execute("SELECT step, count(*), count(DISTINCT execution_id) FROM executions WHERE split = 'train' "
                       "GROUP BY 1 ORDER BY 1").fetchall() == [(0, 32, 32), (1, 32, 32)]
    # the final policy is exactly the one of the run that never crashed (stacktest: same preset and seeds)
    from gyre_core.trainer.publish import load_weights

    if not (tmp / "runs" / "stacktest" / "markers" / "publish_0002.json").exists():   # run on its own
        assert _stacktest(spec, tmp).state.is_completed()
    resumed = load_weights(str(tmp / "runs" / "crashtest" / "weights" / "v2.safetensors"))
    clean = load_weights(str(tmp / "runs" / "stacktest" / "weights" / "v2.safetensors"))
    assert resumed.keys() == clean.keys() and all(torch.equal(resumed[k], clean[k]) for k in clean)
    warm = load_weights(str(tmp / "runs" / "stacktest" / "weights" / "v0.safetensors"))
    assert any(not torch.equal(warm[k], clean[k]) for k in clean)      # and RL moved it: real updates
    from mlflow.tracking import MlflowClient

    ml = MlflowClient(tracking_uri=spec.mlflow_url)
    (run,) = ml.search_runs([ml.get_experiment_by_name("gyre").experiment_id], "attributes.run_name = 'crashtest'")
    assert sorted(m.step for m in ml.get_metric_history(run.info.run_id, "reward/mean")) == [0, 1]
    assert run.data.tags["prefect.flow_run_id"] == str(fr.id)


def test_the_nightly_schedule_is_what_prefect_yaml_says_and_can_be_switched_on(stack):
    spec, _, _ = stack
    client = _client(spec)
    dep = client.read_deployment_by_name("gyre-train/train-nightly")
    (sched,) = dep.schedules
    assert (sched.schedule.cron, sched.schedule.timezone, sched.active) == ("0 2 * * *", "UTC", False)
    assert dep.parameters == {"preset": "default", "overrides": ["run.name=nightly"]}
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId

    def scheduled():
        return client.read_flow_runs(deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[dep.id])))

    assert scheduled() == []                                 # inactive: nothing scheduled
    client.update_deployment_schedule(dep.id, sched.id, active=True)    # the UI's toggle
    runs = _wait(scheduled, 120, "the scheduler to schedule the nightly runs", every_s=2)
    now = datetime.datetime.now(datetime.timezone.utc)        # the next 02:00 UTC, by hand
    expected = now.replace(hour=2, minute=0, second=0, microsecond=0)
    expected += datetime.timedelta(days=1) if expected <= now else datetime.timedelta(0)
    first = min(r.expected_start_time for r in runs)
    assert first == expected, (first, expected)
    assert all(r.state.is_scheduled() and r.parameters == dep.parameters for r in runs)
    client.update_deployment_schedule(dep.id, sched.id, active=False)   # back off: nothing runs at 02:00
    _wait(lambda: not [r for r in scheduled() if r.state.is_scheduled()], 60, "the scheduled runs to be removed")


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
