"""The `agent` preset's pipeline in miniature, on Gyre's tiny model: the warm start's demonstrations come from
the unmodified agent program (examples/workspace_agent.py) with the proxy serving the environment's expert as
its model; RL then runs the same program on the policy; the initial model, the warm start, RL and the control
are evaluated on the same held-out tasks."""
from flows.train import train
from gyre_core.lake.sql import connect
from gyre_core.run import RunDir

TINY = ["model.path=", "model.fetch=", "model.hidden_size=64", "model.num_layers=2", "model.num_heads=2",
        "model.num_kv_heads=1", "model.ffn_size=128", "model.vocab_size=400", "model.max_positions=4096",
        "engine.kind=local", "engine.dtype=auto", "engine.threads=null"]


def test_the_agent_pipeline_demonstrates_through_the_program_and_trains_it(tmp_path):
    overrides = TINY + [
        f"run.out_root={tmp_path}/runs", f"lake.root={tmp_path}/lake", f"tracking.uri=sqlite:///{tmp_path}/mlflow.db",
        "run.name=agentflow", "rl.steps=1", "rollout.tasks_per_step=2", "rollout.group_size=4", "eval.episodes=4",
        "warmstart.episodes=6", "warmstart.steps=2", "warmstart.batch_size=4", "warmstart.expert_epsilon=0.0",
        "warmstart.lr=3e-3", "warmstart.lr_final=null",
        # the tiny tokenizer spends more tokens on the program's prompt than SmolLM2's: compact later
        "harness.command=[python,examples/workspace_agent.py,--max-turns,8,--max-tokens,48,--compact-at,850]"]
    summary = train(preset="agent", overrides=overrides)
    run = RunDir.open(tmp_path / "runs" / "agentflow")
    ws = run.done("warm_start")
    assert ws["demos"] == 6 and ws["demo_success"] == 1.0      # the expert through the program solves every task
    con = connect(str(tmp_path / "lake"), run_id="agentflow")
    # demonstrations: the program's own calls, scripted (version -1), with its compaction as a new context
    demo = con.execute("""SELECT count(DISTINCT c.execution_id), min(list_min(c.versions)), max(list_max(c.versions)),
                                 count(*) FILTER (WHERE c.role = 'main-summary'), count(*) FILTER (WHERE c.tool_parse = 'ok')
                          FROM calls c JOIN executions e USING (execution_id) WHERE e.split = 'demo'""").fetchone()
    sites = run.cfg.env.kwargs["sites"]      # one read per named depot and one sum, in each demonstration
    assert demo[0] == 6 and demo[1] == demo[2] == -1 and demo[3] >= 6 and demo[4] == 6 * (sites + 1)
    rollout = con.execute("SELECT count(*), count(*) FILTER (WHERE status = 'failed') FROM executions WHERE step = 0").fetchone()
    assert rollout == (8, 0)
    for label in ("base", "before", "after", "control"):
        assert summary[{"base": "base", "before": "eval_before", "after": "eval_after"}.get(label, "control")]["episodes"] == 4
    assert "calls_per_execution" in summary["eval_before"] and summary["eval_before"]["calls_per_execution"] >= 1
    assert run.done("train_0000")["tokens_trained"] > 0
