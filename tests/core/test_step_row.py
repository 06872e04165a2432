"""`report.step_row`: one RL step's figures from its markers (what the step's Prefect artifact shows),
for the step-by-step loop and for the elastic phase; `tracking.run_link`: where the MLflow UI shows a run."""
import pytest

from gyre_core import report
from gyre_core.phases.rl_step import step_metrics
from gyre_core.phases.run_objects import tracker
from gyre_core.config import load_config
from gyre_core.run import RunDir
from gyre_core.tracking import run_link


@pytest.fixture()
def run(tmp_path):
    cfg = load_config("smoke", [f"run.out_root={tmp_path}/runs", f"lake.root={tmp_path}/lake",
                                f"tracking.uri=sqlite:///{tmp_path}/mlflow.db", "run.name=Row_Test"])
    return RunDir.create(cfg)


def test_a_loop_step_row_has_each_phase_from_its_marker(run):
    run.mark("rollout_0000", {"executions": 8, "success": 0.375, "partial": 0.51234567, "tokens_generated": 300,
                              "rollout_s": 1.25})
    run.mark("score_0000", {"reward_mean": 0.4, "collapsed": 2, "score_s": 0.5})
    run.mark("process_0000", {"tokens_trained": 250, "process_s": 0.125})
    run.mark("train_0000", {"train_s": 2.0})
    with pytest.raises(ValueError, match="step 0 of run Row_Test is not published"):
        report.step_row(str(run.path), 0)
    run.mark("publish_0001", {"uri": run.weights_uri(1),
                              "metrics": {**step_metrics(run, 0), "time/publish_s": 0.0625}})
    row = report.step_row(str(run.path), 0)
    t = tracker(run)
    assert row == {"run_id": "Row_Test", "step": 0, "policy_version": 1, "executions": 8, "success": 0.375,
                   "partial": 0.5123, "reward_mean": 0.4, "tokens_generated": 300, "tokens_trained": 250,
                   "executions_collapsed": 2, "time_rollout_s": 1.25, "time_score_s": 0.5, "time_process_s": 0.125,
                   "time_train_s": 2.0, "time_publish_s": 0.0625, "step_s": 3.9375, "mlflow_run_id": t.run_id,
                   "mlflow_url": f"http://127.0.0.1:5000/#/experiments/{t.experiment_id}/runs/{t.run_id}"}


def test_an_elastic_step_row_has_the_step_time_and_no_phases(run):
    run.mark("publish_0001", {"uri": run.weights_uri(1), "metrics": {
        "rollout/executions": 8, "rollout/success": 0.5, "rollout/partial": 0.25, "reward/mean": 0.3,
        "tokens/generated": 400, "tokens/trained": 320.0, "time/elastic_step_s": 4.5}})
    row = report.step_row(str(run.path), 0)
    assert {k: row[k] for k in ("executions", "success", "tokens_generated", "tokens_trained", "step_s")} == \
        {"executions": 8, "success": 0.5, "tokens_generated": 400, "tokens_trained": 320, "step_s": 4.5}
    assert all(row[f"time_{k}_s"] is None for k in report.PHASES)
    assert row["executions_collapsed"] == 0


def test_run_links_point_at_the_mlflow_ui():
    assert run_link("http://mlflow:5000/", "3", "abc") == {"url": "http://mlflow:5000/#/experiments/3/runs/abc",
                                                           "hint": ""}
    assert run_link("sqlite:///data/mlflow/mlflow.db", "1", "abc") == {
        "url": "http://127.0.0.1:5000/#/experiments/1/runs/abc",
        "hint": "mlflow ui --backend-store-uri sqlite:///data/mlflow/mlflow.db"}
