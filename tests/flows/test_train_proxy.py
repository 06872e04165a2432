"""The `proxy-smoke` RL flow: every execution is examples/openai_agent.py (the official openai SDK) run as an
external harness through the recording proxy; its calls land in the lake as exact tokens with their
contexts and roles, the processor builds trees over them and an RL step trains on them."""
import torch

from flows.train import train
from gyre_core.lake.sql import connect
from gyre_core.run import RunDir
from gyre_core.trainer.publish import load_weights


def test_proxy_smoke_trains_an_unmodified_openai_sdk_agent(tmp_path):
    overrides = [f"run.out_root={tmp_path}/runs", f"lake.root={tmp_path}/lake", f"tracking.uri=sqlite:///{tmp_path}/mlflow.db",
                 "run.name=proxyflow", "rl.steps=1", "rollout.tasks_per_step=4", "eval.episodes=4",
                 "eval.greedy_episodes=0", "eval.control=false", "warmstart.episodes=8", "warmstart.steps=2"]
    summary = train(preset="proxy-smoke", overrides=overrides)
    assert summary["rl_steps"] == 1
    con = connect(str(tmp_path / "lake"), run_id="proxyflow")
    rows = con.execute("""SELECT e.status, count(DISTINCT e.execution_id), count(*) FILTER (WHERE c.role = 'sub-agent'),
                                 count(*) FILTER (WHERE c.role = 'main'), count(c.rerender_drift)
                          FROM executions e JOIN calls c USING (execution_id) WHERE e.step = 0 GROUP BY 1""").fetchall()
    [(status, n, sub, main, measured)] = rows
    assert status == "done" and n == 16 and sub == 16 and main >= 32 and measured > 0   # the helper once, main twice
    run = RunDir.open(tmp_path / "runs" / "proxyflow")
    processed, trained = run.done("process_0000"), run.done("train_0000")
    assert 0 < processed["tokens_unique"] < processed["tokens_flat"]     # shared prefixes trained once
    assert trained["tokens_trained"] > 0 and trained["grad_norm"] > 0
    first, after = load_weights(run.weights_uri(0)), load_weights(run.weights_uri(1))
    assert any(not torch.equal(first[k], after[k]) for k in after)
