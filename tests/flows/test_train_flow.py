"""The `smoke` RL flow under Prefect: what it must leave in the lake and in MLflow, and resume."""
import json
import shutil

import pytest
import yaml
import torch
from mlflow.tracking import MlflowClient

from flows.train import train
from gyre_core import phases
from gyre_core.lake.sql import connect
from gyre_core.processor.batch import context_sequences
from gyre_core.run import _CACHE as run_cache
from gyre_core.run import CONTROL_VERSION, RunDir
from gyre_core.trainer.publish import load_weights


# 4 tasks × 8 executions a step: from the smoke warm start about half of all groups of 4 came out with equal
# rewards, and the preset's 2 × 4 left seed 0's two RL steps without a gradient — the exact-weight checks of
# resume and replay below would then compare warm starts. With 4 × 8 the run's updates are real (asserted).
WORKLOAD = ["rollout.tasks_per_step=4", "rollout.group_size=8"]


def _overrides(tmp, name):
    return [f"run.out_root={tmp}/runs", f"lake.root={tmp}/lake", f"tracking.uri=sqlite:///{tmp}/mlflow.db",
            f"run.name={name}", *WORKLOAD]


def _assert_updates_were_real(run_dir) -> None:
    """The run's RL steps had a gradient, and its final weights are not the warm start's."""
    run = RunDir.open(run_dir)
    assert any(run.done(f"train_{s:04d}")["grad_norm"] > 0 for s in range(2))
    first, last = (load_weights(str(run.path / "weights" / f"v{v}.safetensors")) for v in (0, 2))
    assert any(not torch.equal(first[k], last[k]) for k in last)


def _q(con, sql):
    return con.execute(sql).fetchall()


@pytest.fixture(scope="module")
def clean_run(tmp_path_factory):
    """A smoke run that never crashed."""
    tmp = tmp_path_factory.mktemp("clean")
    return tmp, train(preset="smoke", overrides=_overrides(tmp, "flowtest"))


def test_smoke_flow_leaves_lake_rows_and_mlflow_metrics(clean_run):
    tmp_path, summary = clean_run
    B, G, steps_n, eval_n = 4, 8, 2, 16
    assert summary["rl_steps"] == steps_n and summary["eval_paired"] is True
    assert summary["eval_episodes"] == eval_n
    con = connect(str(tmp_path / "lake"), run_id="flowtest")
    # every RL step wrote B×G executions whose turns match their calls
    per_step = _q(con, "SELECT step, count(*) FROM executions WHERE split='train' GROUP BY 1 ORDER BY 1")
    assert per_step == [(0, B * G), (1, B * G)]
    mismatched = _q(con, """SELECT e.execution_id FROM executions e JOIN
                            (SELECT execution_id, count(*) n FROM calls GROUP BY 1) c USING (execution_id)
                            WHERE e.turns != c.n""")
    assert mismatched == []
    # scores: group-relative advantages sum to zero within each task
    sums = _q(con, "SELECT step, task_id, sum(advantage) FROM scores GROUP BY 1, 2")
    assert len(sums) == steps_n * B and all(abs(s) < 1e-9 for _, _, s in sums)
    # trained tokens: what the sampled paths carry, never more than was generated; the processor
    # says in SQL why any generated token was not trained (unselected leaf or pruned loop)
    gen = _q(con, "SELECT sum(tokens_generated) FROM executions WHERE split='train'")[0][0]
    trained = _q(con, "SELECT sum(n_trainable) FROM train_tokens")[0][0]
    assert gen == summary["tokens_generated"] and trained == summary["tokens_trained"]
    assert 0 < trained <= gen
    assert _q(con, "SELECT count(*) FROM tree_paths")[0][0] >= _q(con, "SELECT count(*) FROM train_tokens")[0][0]
    # the same held-out seeds before and after RL, and for the supervised-only control
    seeds = _q(con, """SELECT count(DISTINCT seed), count(*) FROM executions WHERE split = 'eval-sampled'""")
    assert seeds == [(eval_n, 3 * eval_n)]
    # MLflow: one point per RL step for each metric, the on-policy mismatch about 0
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db")
    run_id = summary["paths"]["mlflow_run_id"]
    for key in ("reward/mean", "rollout/success", "train/logprob_mismatch", "tokens/generated", "train/kl"):
        hist = client.get_metric_history(run_id, key)
        assert sorted(m.step for m in hist) == [0, 1], key
    assert all(m.value < 1e-3 for m in client.get_metric_history(run_id, "train/logprob_mismatch"))
    run = client.get_run(run_id)
    assert run.data.params["rollout.group_size"] == str(G)
    arts = {a.path for a in client.list_artifacts(run_id)}
    assert {"config.yaml", "summary.json", "reward_curve.png"} <= arts


def _flow_runs(overrides):
    """The flow runs (oldest first) started with these overrides, found by their parameters alone."""
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as c:
        runs = [f for f in c.read_flow_runs() if (f.parameters or {}).get("overrides") == overrides]
    return sorted(runs, key=lambda f: f.start_time or f.created)


def test_prefect_shows_the_run_by_name_with_an_artifact_per_step_and_a_summary(clean_run):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (ArtifactFilter, ArtifactFilterFlowRunId, FlowRunFilter,
                                                FlowRunFilterId)

    tmp_path, summary = clean_run
    (fr,) = _flow_runs(_overrides(tmp_path, "flowtest"))
    assert fr.name == "train-flowtest"                   # the Gyre run id, from the config
    assert {"gyre-run:flowtest", f"mlflow-run:{summary['paths']['mlflow_run_id']}"} <= set(fr.tags)
    with get_client(sync_client=True) as c:
        tasks = c.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[fr.id])))
        arts = c.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[fr.id])))
    names = {t.name for t in tasks}
    assert {f"{t}-{s}" for t in ("rollout", "score", "process", "train", "publish") for s in (0, 1)} <= names
    assert {"evaluate-before", "evaluate-after", "evaluate-control"} <= names
    assert any(n.startswith("export-policy") for n in names)
    by_key = {a.key: a for a in arts}
    assert {"flowtest-step-0", "flowtest-step-1", "flowtest-summary", "flowtest-mlflow"} <= set(by_key)
    # each step's table holds that step's figures as its markers have them
    run = RunDir.open(tmp_path / "runs" / "flowtest")
    mlflow_id = summary["paths"]["mlflow_run_id"]
    exp_id = MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db").get_run(mlflow_id).info.experiment_id
    for s in (0, 1):
        art = by_key[f"flowtest-step-{s}"]
        assert art.type == "table" and art.task_run_id in {t.id for t in tasks if t.name == f"publish-{s}"}
        row = {r["figure"]: r["value"] for r in json.loads(art.data)}
        ro, sc, pr, tr = (run.done(f"{k}_{s:04d}") for k in ("rollout", "score", "process", "train"))
        pub = run.done(f"publish_{s + 1:04d}")
        expected = {"step": s, "policy_version": s + 1, "executions": ro["executions"], "success": ro["success"],
                    "partial": ro["partial"], "reward_mean": sc["reward_mean"],
                    "tokens_generated": ro["tokens_generated"], "tokens_trained": pr["tokens_trained"],
                    "executions_collapsed": sc["collapsed"], "time_rollout_s": ro["rollout_s"],
                    "time_score_s": sc["score_s"], "time_process_s": pr["process_s"], "time_train_s": tr["train_s"],
                    "time_publish_s": pub["metrics"]["time/publish_s"]}
        for k, v in expected.items():
            assert row[k] == pytest.approx(v, abs=1e-4), (s, k)
        assert row["run_id"] == "flowtest" and row["mlflow_run_id"] == mlflow_id
        assert row["mlflow_url"] == f"http://127.0.0.1:5000/#/experiments/{exp_id}/runs/{mlflow_id}"
        assert row["mlflow_url"] in art.description
    md = by_key["flowtest-summary"].data
    for ev in ("eval_before", "eval_after"):
        assert f"{100 * summary[ev]['success']:.1f}%" in md
    assert f"{100 * summary['diff']:+.1f} points [95% CI {100 * summary['ci95_low']:+.1f}" in md
    assert f"{100 * summary['control']['success']:.1f}%" in md and "RL − control" in md
    assert f"runs:/{mlflow_id}/policy" in md and f"mlflow ui --backend-store-uri sqlite:///{tmp_path}/mlflow.db" in md
    assert f"#/experiments/{exp_id}/runs/{mlflow_id}" in by_key["flowtest-mlflow"].data


def test_the_mlflow_run_names_its_flow_run_and_holds_the_final_policy(clean_run, tmp_path):
    import mlflow

    from gyre_core.model import load_policy

    clean_tmp, summary = clean_run
    (fr,) = _flow_runs(_overrides(clean_tmp, "flowtest"))
    uri = f"sqlite:///{clean_tmp}/mlflow.db"
    mlflow_id = summary["paths"]["mlflow_run_id"]
    run = MlflowClient(tracking_uri=uri).get_run(mlflow_id)
    tags = run.data.tags
    assert tags["prefect.flow_run_id"] == tags["prefect.flow_run_ids"] == str(fr.id)
    assert tags["prefect.flow_run_name"] == fr.name == "train-flowtest"
    assert tags["prefect.deployment"] == "none"
    assert tags["gyre.lake_root"] == f"{clean_tmp}/lake" and tags["gyre.run_id"] == "flowtest"
    assert run.data.params["lake.root"] == f"{clean_tmp}/lake" and run.info.status == "FINISHED"
    # the final policy: `runs:/<id>/policy` is an HF directory holding the newest published weights
    assert summary["paths"]["policy_uri"] == f"runs:/{mlflow_id}/policy"
    assert tags["gyre.policy_version"] == "2"
    local = mlflow.artifacts.download_artifacts(artifact_uri=summary["paths"]["policy_uri"],
                                                dst_path=str(tmp_path), tracking_uri=uri)
    model, tok = load_policy(local)
    newest = load_weights(str(clean_tmp / "runs" / "flowtest" / "weights" / "v2.safetensors"))
    state = model.state_dict()
    assert newest.keys() <= state.keys()
    for k, v in newest.items():
        assert torch.equal(state[k], v), k
    assert len(tok) > 0


def test_artifact_keys_are_what_prefect_accepts():
    from tasks.artifacts import artifact_key

    assert artifact_key("My_Run.v2", "step", 12) == "my-run-v2-step-12"
    assert artifact_key("smoke-s0", "summary") == "smoke-s0-summary"


def test_resume_after_a_failed_task_skips_finished_steps(tmp_path, monkeypatch, clean_run):
    ov = _overrides(tmp_path, "resumetest")
    real_publish = phases.publish
    calls = {"n": 0}

    def flaky_publish(run_dir, step):
        if step == 1:
            calls["n"] += 1
            raise RuntimeError("injected crash while publishing step 1")
        return real_publish(run_dir, step)

    monkeypatch.setattr(phases, "publish", flaky_publish)
    with pytest.raises(RuntimeError, match="injected crash"):
        train(preset="smoke", overrides=ov)
    assert calls["n"] == 2          # the task's one retry ran too
    markers = tmp_path / "runs" / "resumetest" / "markers"
    before = {p.name: json.loads(p.read_text())["marked_at"] for p in markers.glob("*.json")}
    assert "train_0001.json" in before and "publish_0002.json" not in before

    monkeypatch.setattr(phases, "publish", real_publish)
    run_cache.clear()       # resume as a fresh process would: trainer and engine come from checkpoints
    summary = train(preset="smoke", overrides=ov)
    after = {p.name: json.loads(p.read_text())["marked_at"] for p in markers.glob("*.json")}
    for name, t in before.items():   # finished steps came back from their markers, not redone
        assert after[name] == t, name
    assert summary["rl_steps"] == 2
    con = connect(str(tmp_path / "lake"), run_id="resumetest")
    assert _q(con, "SELECT count(*) FROM executions WHERE split='train'") == [(2 * 4 * 8,)]
    assert _q(con, "SELECT count(*), count(DISTINCT execution_id) FROM executions")[0][0] == \
        _q(con, "SELECT count(DISTINCT execution_id) FROM executions")[0][0]
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db")
    hist = client.get_metric_history(summary["paths"]["mlflow_run_id"], "reward/mean")
    assert sorted(m.step for m in hist) == [0, 1]
    # one MLflow run for both flow runs: it names the one that finished it and lists both
    first, second = _flow_runs(ov)
    assert first.name == second.name == "train-resumetest"
    tags = client.get_run(summary["paths"]["mlflow_run_id"]).data.tags
    assert tags["prefect.flow_run_id"] == str(second.id)
    assert tags["prefect.flow_run_ids"] == f"{first.id},{second.id}"
    # the resumed run ends with exactly the weights of the run that never crashed (same seeds)
    clean_tmp, _ = clean_run
    crashed = load_weights(str(tmp_path / "runs" / "resumetest" / "weights" / "v2.safetensors"))
    clean = load_weights(str(clean_tmp / "runs" / "flowtest" / "weights" / "v2.safetensors"))
    assert crashed.keys() == clean.keys()
    for k in clean:
        assert torch.equal(crashed[k], clean[k]), k
    _assert_updates_were_real(clean_tmp / "runs" / "flowtest")


def test_control_spends_the_rl_wall_time_on_the_same_tasks_and_seeds(clean_run):
    tmp_path, summary = clean_run
    run = RunDir.open(tmp_path / "runs" / "flowtest")
    ctrl = run.done("control")
    # the budget is the RL phase's time, summed here from each step's own markers
    phase_s = 0.0
    for s in range(summary["rl_steps"]):
        phase_s += run.done(f"rollout_{s:04d}")["rollout_s"] + run.done(f"score_{s:04d}")["score_s"]
        phase_s += run.done(f"process_{s:04d}")["process_s"] + run.done(f"train_{s:04d}")["train_s"]
        phase_s += run.done(f"publish_{s + 1:04d}")["metrics"]["time/publish_s"]
    assert ctrl["budget_s"] == pytest.approx(phase_s, rel=1e-9)
    assert ctrl["wall_s"] >= ctrl["budget_s"] and ctrl["sft_steps"] >= 1
    # the warm start's demonstrations and nothing else: no expert runs of the RL tasks
    con = connect(str(tmp_path / "lake"), run_id="flowtest")
    assert _q(con, "SELECT count(*) FROM executions WHERE split = 'control-demo'") == [(0,)]
    assert ctrl["demos"] == 0 and ctrl["sequences"] == run.done("warm_start")["sequences"]
    # evaluated on the same held-out seeds, with the same sampling stream
    before, after, control = (run.done(f"eval_{x}")["sampled"] for x in ("before", "after", "control"))
    assert control["seeds"] == before["seeds"] == after["seeds"]
    assert _q(con, "SELECT DISTINCT policy_version FROM executions WHERE execution_id LIKE '%eval-control%'") == \
        [(CONTROL_VERSION,)]
    # the summary's figures, recomputed from the per-seed outcomes
    n = len(control["seeds"])
    assert summary["control"]["success"] == pytest.approx(sum(control["successes"]) / n)
    d = [a - c for a, c in zip(after["successes"], control["successes"])]
    assert summary["rl_vs_control"]["diff"] == pytest.approx(sum(d) / n)
    # Agresti–Min: half an episode added to each cell of the RL × control table
    gain, loss = (d.count(1) + 0.5) / (n + 2), (d.count(-1) + 0.5) / (n + 2)
    se = ((gain + loss - (gain - loss) ** 2) / (n + 2)) ** 0.5
    assert summary["rl_vs_control"]["ci95_low"] == pytest.approx(gain - loss - 1.959964 * se, abs=1e-6)
    d = [a - b for a, b in zip(after["partials"], before["partials"])]      # the partial score's, RL − before
    mean = sum(d) / n
    se = (sum((x - mean) ** 2 for x in d) / (n - 1) / n) ** 0.5
    assert summary["partial_diff"]["diff"] == pytest.approx(mean)
    assert summary["partial_diff"]["ci95_high"] == pytest.approx(mean + 1.959964 * se, abs=1e-6)
    assert summary["control"]["episodes"] == n and summary["control"]["sft_steps"] == ctrl["sft_steps"]
    # the ceiling beside it: the expert's success on its demonstration seeds, from the lake
    demo = _q(con, "SELECT avg(success::INT), count(*) FROM executions WHERE split = 'demo'")[0]
    assert summary["expert"] == {"success": pytest.approx(demo[0]), "episodes": demo[1], "epsilon": 0.0}


def test_control_with_rl_tasks_adds_expert_runs_of_exactly_the_rl_seeds(tmp_path, clean_run):
    """`eval.control_rl_tasks`: the control also learns from one expert execution of every RL task."""
    src_tmp, _ = clean_run
    shutil.copytree(src_tmp / "lake", tmp_path / "lake")
    shutil.copytree(src_tmp / "runs" / "flowtest", tmp_path / "flowtest")
    d = tmp_path / "flowtest"
    cfg = yaml.safe_load((d / "config.yaml").read_text())
    cfg["eval"]["control_rl_tasks"] = True
    cfg["lake"]["root"] = str(tmp_path / "lake")
    (d / "config.yaml").write_text(yaml.safe_dump(cfg))
    (d / "markers" / "control.json").unlink()
    run_cache.clear()
    ctrl = phases.control(str(d), budget_s=0.0)
    con = connect(str(tmp_path / "lake"), run_id="flowtest")
    rl_seeds = _q(con, "SELECT DISTINCT seed FROM executions WHERE split = 'train' ORDER BY 1")
    assert _q(con, "SELECT seed FROM executions WHERE split = 'control-demo' ORDER BY 1") == rl_seeds
    run = RunDir.open(d)
    fresh = [r for r in phases.run_objects.read_records(run, "control-demos") if r.success]
    # the warm start's sequences plus the successful new demonstrations' contexts
    assert ctrl["demos"] == len(rl_seeds) and len(fresh) >= 1
    assert ctrl["sequences"] == run.done("warm_start")["sequences"] + sum(len(context_sequences(r)) for r in fresh)


def test_replay_trains_on_the_stored_trajectories_without_rollouts(tmp_path, monkeypatch, clean_run):
    """`gyre train --replay RUN`: the stored run's demonstrations and step executions, no rollout and no
    evaluation — and since training is deterministic, exactly the stored run's weights at the end."""
    clean_tmp, clean_summary = clean_run

    def no_rollouts(*a, **k):
        raise AssertionError("a replay must not roll out")

    monkeypatch.setattr(phases.rl_step, "_roll_out", no_rollouts)
    monkeypatch.setattr(phases.supervised, "demonstrations", no_rollouts)
    monkeypatch.setattr(phases, "evaluate", no_rollouts)
    ov = [f"run.out_root={tmp_path}/runs", f"lake.root={clean_tmp}/lake",
          f"tracking.uri=sqlite:///{tmp_path}/mlflow.db", *WORKLOAD]
    from gyre_core.config import ConfigError
    with pytest.raises(ConfigError, match="no run 'nosuchrun' in the lake"):
        train(preset="smoke", overrides=ov + ["run.replay=nosuchrun"])
    with pytest.raises(ConfigError, match="lacks step=2, step=3 for rl.steps=4"):
        train(preset="smoke", overrides=ov + ["run.replay=flowtest"], steps=4)
    run_cache.clear()
    summary = train(preset="smoke", overrides=ov + ["run.replay=flowtest"])
    assert summary["run_id"] == "flowtest-replay" and summary["rl_steps"] == 2
    assert summary["eval_paired"] is False
    con = connect(str(clean_tmp / "lake"))
    cols = "step, execution_id, task_id, reward, n_calls, tokens_generated"
    for part in ("step=0", "step=1", "demos"):
        s = part.split("=")[-1]
        where = f"step = {s}" if s.isdigit() else "split = 'demo'"
        src = _q(con, f"SELECT {cols} FROM executions WHERE run_id = 'flowtest' AND {where} ORDER BY 2")
        assert src and _q(con, f"SELECT {cols} FROM executions WHERE run_id = 'flowtest-replay' AND {where} "
                               f"ORDER BY 2") == src, part
    n_calls = "SELECT count(*) FROM calls JOIN executions USING (run_id, step, execution_id) WHERE run_id = '{}'"
    assert _q(con, n_calls.format("flowtest-replay")) == \
        _q(con, n_calls.format("flowtest") + " AND split IN ('train', 'demo')")
    for v in (1, 2):
        mine = load_weights(str(tmp_path / "runs" / "flowtest-replay" / "weights" / f"v{v}.safetensors"))
        theirs = load_weights(str(clean_tmp / "runs" / "flowtest" / "weights" / f"v{v}.safetensors"))
        for k in theirs:
            assert torch.equal(mine[k], theirs[k]), (v, k)
    _assert_updates_were_real(tmp_path / "runs" / "flowtest-replay")


def test_an_update_past_max_kl_is_redone_at_half_the_learning_rate(tmp_path):
    """`rl.max_kl`: a bound no update can meet makes each step undo and redo its update `kl_backtracks`
    times, halving the rate each time and keeping the last try — so a replay of a run made at a quarter of
    the rate, guarded at the full rate, ends at exactly that run's weights (the same stored batches; Adam's
    steps are about ±lr a weight, so an unguarded full-rate replay would land ~7e-5 away)."""
    # per-turn progress credit: every step carries a signal even where each group's rewards came out equal
    ov = _overrides(tmp_path, "quarter") + ["processor.mode=flat", "rl.progress_credit=1.0",
                                            "eval.episodes=4", "eval.greedy_episodes=0"]
    run_cache.clear()
    train(preset="smoke", overrides=ov + ["rl.lr=2.5e-5"])
    run_cache.clear()
    train(preset="smoke", overrides=ov + ["run.name=guarded", "run.replay=quarter", "rl.max_kl=1e-30",
                                          "rl.kl_backtracks=2"])
    runs = {name: RunDir.open(tmp_path / "runs" / name) for name in ("guarded", "quarter")}
    weights = {(name, v): load_weights(str(runs[name].path / "weights" / f"v{v}.safetensors"))
               for name in runs for v in (0, 1, 2)}
    for step in (0, 1):
        guarded = runs["guarded"].done(f"train_{step:04d}")
        quarter = runs["quarter"].done(f"train_{step:04d}")
        assert guarded["kl_backtracks"] == 2 and guarded["lr"] == 2.5e-5
        assert quarter["kl_backtracks"] == 0 and quarter["lr"] == 2.5e-5
        assert (guarded["kl"], guarded["grad_norm"]) == (quarter["kl"], quarter["grad_norm"])
        assert quarter["grad_norm"] > 0
        before, after = weights["quarter", step], weights["quarter", step + 1]
        assert 1e-5 < max((after[k] - before[k]).abs().max().item() for k in after) < 1e-4   # ~±2.5e-5 a weight
        for k, ref in weights["quarter", step + 1].items():
            assert torch.equal(weights["guarded", step + 1][k], ref), (step, k)
    # the checkpoint keeps the configured rate: a resumed run does not inherit a step's halvings
    run_cache.clear()
    trainer = phases.run_objects.trainer_at(RunDir.open(runs["guarded"].path), 2)
    assert [g["lr"] for g in trainer.optimizer.param_groups] == [1e-4] * len(trainer.optimizer.param_groups)


def test_a_run_on_an_s3_lake(tmp_path, s3_server):
    """`lake.root = s3://...` end to end on a real S3-compatible server on loopback (moto's server mode):
    the run writes, reads (score, process, dedup, the summary) and SQL through s3fs."""
    import s3fs

    options = {k: v for k, v in s3_server.items() if k != "anon"}
    s3fs.S3FileSystem(**options).makedirs("gyre-flow", exist_ok=True)
    ov = [f"run.out_root={tmp_path}/runs", f"tracking.uri=sqlite:///{tmp_path}/mlflow.db", "run.name=s3run",
          "lake.root=s3://gyre-flow/lake", f"lake.storage_options={json.dumps(options)}",
          "eval.control=false", "eval.episodes=8", "eval.greedy_episodes=0"]
    run_cache.clear()
    summary = train(preset="smoke", overrides=ov, steps=1)
    con = connect("s3://gyre-flow/lake", run_id="s3run", storage_options=options)
    assert _q(con, "SELECT split, count(*) FROM executions GROUP BY 1 ORDER BY 1") == \
        [("demo", 40), ("eval-random", 8), ("eval-sampled", 16), ("train", 8)]
    assert _q(con, "SELECT sum(n_trainable) FROM train_tokens")[0][0] == summary["tokens_trained"] > 0
    # dedup ran over the S3 lake: every execution stands for itself or for its kept twin
    assert _q(con, "SELECT sum(multiplicity) FROM scores WHERE NOT excluded") == [(8,)]
    assert _q(con, "SELECT count(*) FROM scores WHERE (multiplicity = 0) != (kept_as != execution_id)") == [(0,)]
    assert {p for (p,) in _q(con, "SELECT part FROM steps")} >= {"demos", "step=0", "score=0", "process=0"}
    assert not list((tmp_path).glob("**/*.parquet"))          # nothing of the lake landed on local disk
