"""The `evaluate` and `lake-maintenance` flows under Prefect.

`evaluate` must give, for a checkpoint given three ways (run directory, HF directory, `runs:/<id>/policy`
from MLflow), exactly the per-seed outcomes the run's own `phases.evaluate` recorded for that version;
`lake_maintenance` must delete exactly the old runs, keep the kept and recent ones, compact the rest
without changing a query's result, and change nothing in a dry run.
"""
import hashlib
import json
import math
import os
import re
from datetime import datetime, timedelta, timezone

import pytest
from mlflow.tracking import MlflowClient

from flows.evaluate import evaluate
from flows.lake_maintenance import lake_maintenance
from flows.train import train
from gyre_core.phases.evaluate_checkpoint import evaluate_checkpoint
from gyre_core.config import load_config
from gyre_core.lake import MANIFEST, Lake, calls_table, connect, executions_table
from gyre_core.lake.schema import SCORES
from gyre_core.model import load_policy, save_policy
from gyre_core.records import CallRecord, ExecutionRecord
from gyre_core.run import CheckpointError, RunDir
from gyre_core.trainer.publish import load_weights


def _overrides(tmp):
    return [f"run.out_root={tmp}/runs", f"lake.root={tmp}/lake", f"tracking.uri=sqlite:///{tmp}/mlflow.db"]


def _q(con, sql):
    return con.execute(sql).fetchall()


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A smoke run with one RL step (no supervised control): its `eval_after` is policy v1 on the held-out seeds.
    A longer warm start than smoke's makes some rollouts succeed, so the RL step has advantages and v1 ≠ v0."""
    tmp = tmp_path_factory.mktemp("evalsrc")
    ov = _overrides(tmp) + ["run.name=evalsrc", "rl.steps=1", "eval.control=false", "warmstart.steps=40"]
    train(preset="smoke", overrides=ov)
    return tmp, ov


def test_a_checkpoint_given_three_ways_scores_as_the_runs_own_evaluation(trained, tmp_path):
    tmp, ov = trained
    run = RunDir.open(tmp / "runs" / "evalsrc")
    after = run.done("eval_after")                 # phases.evaluate of the newest version, inside `train`
    assert after["version"] == 1
    # version 1 as an HF directory, and that directory logged to MLflow as a run's `policy/` artifacts
    model, tok = load_policy(run.policy0)
    model.load_state_dict(load_weights(run.weights_uri(1)), strict=False)
    hf = tmp_path / "hf-v1"
    save_policy(model, tok, hf)
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp}/mlflow.db")
    store = client.create_experiment("policies", artifact_location=(tmp_path / "artifacts").as_uri())
    source = client.create_run(store).info.run_id
    client.log_artifacts(source, str(hf), "policy")

    given = {"run": str(run.path), "hf": str(hf), "mlflow": f"runs:/{source}/policy"}
    results = {kind: evaluate(checkpoint=ck, preset="smoke", overrides=ov, label=kind) for kind, ck in given.items()}

    seeds = [1_000_000_000 + i for i in range(16)]           # env.eval_seed_start + i, eval.episodes = 16
    k = sum(after["sampled"]["successes"])
    # the 95% Wilson interval, written out
    z = 1.959963984540054
    centre = (k / 16 + z * z / 32) / (1 + z * z / 16)
    half = z / (1 + z * z / 16) * math.sqrt(k / 16 * (1 - k / 16) / 16 + z * z / (4 * 16 * 16))
    for kind, r in results.items():
        assert r["kind"] == kind and r["checkpoint"] == given[kind]
        for mode, n in (("sampled", 16), ("greedy", 8)):
            assert r[mode]["seeds"] == after[mode]["seeds"] == seeds[:n]
            assert r[mode]["successes"] == after[mode]["successes"], (kind, mode)
            assert r[mode]["partials"] == after[mode]["partials"], (kind, mode)
        assert r["episodes"] == 16 and r["success"] == k / 16 == after["sampled"]["success"]
        assert r["ci95_low"] == pytest.approx(max(0.0, centre - half))
        assert r["ci95_high"] == pytest.approx(min(1.0, centre + half))
        assert r["seeds_hash"] == hashlib.sha256(",".join(map(str, seeds)).encode()).hexdigest()[:16]
        assert r["warnings"] == []
    assert results["run"]["policy_version"] == 1 and results["hf"]["policy_version"] == -1

    # the lake: each evaluation is run eval-<kind>, part eval=<kind>, seed by seed the run's eval-after rows,
    # down to every generated token and its log-prob (which tell v1 from v0 even where the outcomes agree)
    con = connect(str(tmp / "lake"))

    def tokens(where):
        return _q(con, "SELECT e.seed, e.success, e.partial, e.turns, c.call_index, c.completion_ids, c.logprobs "
                       "FROM executions e JOIN calls c USING (run_id, step, execution_id) "
                       f"WHERE {where} ORDER BY e.seed, c.call_index")

    want = tokens("e.run_id = 'evalsrc' AND e.execution_id LIKE '%/eval-after-sampled/%'")
    assert len({row[0] for row in want}) == 16
    assert tokens("e.run_id = 'evalsrc' AND e.execution_id LIKE '%/eval-before-sampled/%'") != want
    for kind in given:
        assert tokens(f"e.run_id = 'eval-{kind}' AND e.split = 'eval-sampled'") == want, kind
        assert _q(con, f"SELECT count(*) FROM executions WHERE run_id = 'eval-{kind}'") == [(16 + 8,)]
    assert Lake(str(tmp / "lake")).parts("eval-hf") == ["eval=hf"]

    # MLflow: one run per evaluation in the config's experiment, tagged with what was evaluated
    exp = client.get_experiment_by_name("gyre")
    found = {r.data.tags["gyre.eval_label"]: r
             for r in client.search_runs([exp.experiment_id], "tags.`gyre.kind` = 'evaluate'")}
    assert sorted(found) == ["hf", "mlflow", "run"]
    for kind, r in found.items():
        assert r.info.run_id == results[kind]["mlflow_run_id"] and r.info.status == "FINISHED"
        assert r.data.tags["gyre.checkpoint"] == given[kind]
        assert r.data.metrics["eval/success"] == k / 16 and r.data.metrics["eval/episodes"] == 16
    assert found["run"].data.tags["gyre.policy_version"] == "1"


def test_a_run_version_named_with_at_v_scores_as_that_versions_own_evaluation(trained, tmp_path):
    """`<run dir>@v<N>`: version N of the run, not its newest — v0 reproduces the run's `eval_before`
    episode by episode, v1 its `eval_after`; a version not published, or @v on an HF dir, is refused."""
    tmp, ov = trained
    cfg = load_config("smoke", ov)
    run = RunDir.open(tmp / "runs" / "evalsrc")
    b, a = run.done("eval_before")["sampled"], run.done("eval_after")["sampled"]
    assert (b["successes"], b["partials"]) != (a["successes"], a["partials"])   # the two versions tell apart
    for version, marker in ((0, "eval_before"), (1, "eval_after")):
        want = run.done(marker)
        got = evaluate_checkpoint(cfg, f"{run.path}@v{version}", f"at-v{version}")
        assert got["policy_version"] == version and got["kind"] == "run"
        for mode in ("sampled", "greedy"):
            assert got[mode]["seeds"] == want[mode]["seeds"]
            assert got[mode]["successes"] == want[mode]["successes"], (version, mode)
            assert got[mode]["partials"] == want[mode]["partials"], (version, mode)
        assert got["warnings"] == []
    # another seed range for training tasks is not another environment; another turn limit is another harness
    other = load_config("smoke", ov + ["env.train_seed_start=12345", "harness.max_turns=7"])
    by_id = evaluate_checkpoint(other, "evalsrc@v0", "at-v0-id")        # a bare run id under run.out_root
    assert by_id["policy_version"] == 0 and by_id["resolved"] == str(run.path)
    assert len(by_id["warnings"]) == 1 and by_id["warnings"][0].startswith("run 'evalsrc' was trained with harness")
    assert "'max_turns': 7" in by_id["warnings"][0]
    with pytest.raises(CheckpointError, match="run 'evalsrc' has published versions 0 – 1, not 2"):
        evaluate_checkpoint(cfg, f"{run.path}@v2", "x")
    model, tok = load_policy(run.policy0)
    save_policy(model, tok, tmp_path / "hf")
    with pytest.raises(CheckpointError, match="@v0 names a version of a Gyre run directory"):
        evaluate_checkpoint(cfg, f"{tmp_path / 'hf'}@v0", "x")


def test_a_checkpoint_that_is_not_one_fails_naming_it(trained, tmp_path, capsys):
    tmp, ov = trained
    missing = str(tmp_path / "no-such-run")
    with pytest.raises(CheckpointError, match=re.escape(repr(missing)) + ": no such file or directory"):
        evaluate(checkpoint=missing, preset="smoke", overrides=ov, label="missing")
    assert "eval-missing" not in Lake(str(tmp / "lake")).runs()            # nothing was evaluated
    cfg = load_config("smoke", ov)
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="'.*empty': neither a Gyre run directory"):
        evaluate_checkpoint(cfg, str(tmp_path / "empty"), "x")
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "config.json").write_text("{}")                    # config, but no tokenizer or weights
    with pytest.raises(CheckpointError, match="'.*half': policy .*half: no tokenizer files"):
        evaluate_checkpoint(cfg, str(tmp_path / "half"), "x")
    with pytest.raises(CheckpointError, match=re.escape("'runs:/0123456789abcdef/policy': cannot download it")):
        evaluate_checkpoint(cfg, "runs:/0123456789abcdef/policy", "x")
    from gyre_cli.main import main

    sets = [x for o in ov for x in ("--set", o)]
    assert main(["evaluate", missing, "--preset", "smoke", *sets]) == 1
    assert missing in capsys.readouterr().err
    assert "eval-x" not in Lake(str(tmp / "lake")).runs()
    # the command's good path: --episodes takes the first N held-out seeds (greedy: at most as many)
    assert main(["evaluate", "evalsrc", "--preset", "smoke", *sets, "--episodes", "4", "--label", "cli", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["kind"] == "run" and out["policy_version"] == 1 and out["episodes"] == 4
    assert out["sampled"]["seeds"] == out["greedy"]["seeds"] == [1_000_000_000 + i for i in range(4)]
    assert out["lake"] == {"root": f"{tmp}/lake", "run_id": "eval-cli", "part": "eval=cli"}


# ---- lake maintenance on a hand-made lake -------------------------------------------------------------
def _records(run: str, step: int) -> list[ExecutionRecord]:
    calls = [CallRecord(f"e{i}", 0, 0, "main", [1, 2, 3 + i], [10 + i, 11], [-0.5, -0.25], [step, step])
             for i in range(2)]
    return [ExecutionRecord(run, step, f"e{i}", "task", 100 + step, "train", "grid", reward=0.5 * i,
                            success=bool(i), turns=1, calls=[c]) for i, c in enumerate(calls)]


def _run(lake: Lake, run: str, steps: int, days_old: float) -> None:
    for s in range(steps):
        recs = _records(run, s)
        lake.write_part(run, f"step={s}", {"executions": executions_table(recs), "calls": calls_table(recs)})
        lake.write_part(run, f"score={s}", {"scores": SCORES.empty_table()})
    recs = _records(run, -2)
    lake.write_part(run, "eval-before", {"executions": executions_table(recs), "calls": calls_table(recs)})
    when = (datetime.now(timezone.utc) - timedelta(days=days_old)).isoformat()
    for part in lake.parts(run):                       # as if every part had been committed then
        path = f"{lake.part_dir(run, part)}/{MANIFEST}"
        body = json.loads(lake.fs.cat_file(path))
        lake.fs.pipe(path, json.dumps({**body, "written_at": when}).encode())


def _files(root) -> dict[str, tuple[int, str]]:
    out = {}
    for d, _, names in os.walk(root):
        for n in names:
            p = os.path.join(d, n)
            out[p] = (os.path.getsize(p), hashlib.sha256(open(p, "rb").read()).hexdigest())
    return out


QUERY = "SELECT run_id, step, execution_id, reward, success FROM executions WHERE step >= 0 ORDER BY ALL"


def test_lake_maintenance_deletes_old_runs_keeps_the_rest_and_compacts_them(tmp_path):
    root = str(tmp_path / "lake")
    lake = Lake(root)
    _run(lake, "old", 3, days_old=10)
    _run(lake, "old-kept", 3, days_old=10)
    _run(lake, "recent", 3, days_old=1)
    _run(lake, "old-busy", 3, days_old=10)
    busy = lake.part_dir("old-busy", "step=3")         # a writer at work: files, no manifest yet
    lake.fs.makedirs(busy, exist_ok=True)
    lake.fs.pipe(f"{busy}/executions.parquet", b"being written")
    con = connect(root)
    before = _q(con, QUERY)
    con.close()
    assert {r for r, *_ in before} == {"old", "old-kept", "recent", "old-busy"}
    bad = f"{lake.part_dir('recent', 'eval-before')}/calls.parquet"
    lake.fs.pipe(bad, b"not parquet")                  # a damaged file the check must find
    old_bytes = sum(size for p, (size, _) in _files(root).items() if f"{os.sep}runs{os.sep}old{os.sep}" in p)
    params = dict(preset="smoke", overrides=[f"lake.root={root}"], retention_days=5, keep_runs=["old-kept"])

    snapshot = _files(root)
    dry = lake_maintenance(**params, dry_run=True)
    assert _files(root) == snapshot                    # nothing changed
    assert dry["dry_run"] and dry["deleted"] == [{"run_id": "old", "parts": 7, "files": 18, "bytes": old_bytes,
                                                  "age_days": pytest.approx(10, abs=0.01)}]
    assert [(q["run_id"], q["part"], q["table"]) for q in dry["quarantined"]] == [("recent", "eval-before", "calls")]
    assert dry["runs"]["recent"]["compaction"]["would_merge"] == ["score=0", "step=0", "score=1", "step=1"]
    assert dry["runs"]["old-busy"]["compaction"]["skipped"] == "a part is being written"

    done = lake_maintenance(**params)
    assert [d["run_id"] for d in done["deleted"]] == ["old"] and done["deleted_bytes"] == old_bytes
    assert not os.path.exists(os.path.join(root, "runs", "old"))
    assert sorted(lake.runs()) == ["old-busy", "old-kept", "recent"]
    retention = {r: v["retention"]["reason"] for r, v in done["runs"].items() if v["retention"]["action"] == "keep"}
    assert retention == {"old-kept": "in keep_runs", "recent": "newest commit 1.00 d old",
                         "old-busy": "wrote a part in the last hour (may be running)"}
    for run in ("old-kept", "recent"):                 # finished steps 0 and 1 merged (2 is each run's newest)
        (c,) = done["runs"][run]["compaction"]["compactions"]
        assert sorted(c["covers"]) == ["score=0", "score=1", "step=0", "step=1"]
    assert done["runs"]["old-busy"]["compaction"]["skipped"] == "a part is being written"
    assert lake.fs.exists(f"{busy}/executions.parquet")             # the writer's files are untouched
    (q,) = done["quarantined"]
    assert (q["run_id"], q["part"], q["table"]) == ("recent", "eval-before", "calls")
    assert not os.path.exists(bad) and os.path.isdir(os.path.join(root, "_quarantine", "recent", "eval-before"))
    con = connect(root)
    assert _q(con, QUERY) == [row for row in before if row[0] != "old"]
    con.close()
    # a second pass has nothing left to do
    again = lake_maintenance(**params)
    assert again["deleted"] == [] and again["quarantined"] == []
    assert all(v["compaction"].get("parts", 0) == 0 for v in again["runs"].values())
