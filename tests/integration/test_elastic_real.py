"""Real cells: two agent processes that decode and train the smoke model, under the elastic policy.

Checked against independent references: every generated token's behaviour log-prob is recomputed by a
cache-free forward of the weights of the version recorded for that token (TITO with per-token versions,
reroutes included); every token's version is one the staleness bound allows for its burst; the published
versions are real updates (they differ from the warm start and from each other); the lake and the
completion markers hold what the step-by-step loop would leave, so evaluation reads the final version.
"""
from __future__ import annotations

import torch

from gyre_core import steps as st
from gyre_core.config import load_config
from gyre_core.model import load_policy
from gyre_core.run import RunDir
from gyre_core.trainer.publish import load_weights

STEPS = 3          # burst 2 cannot start before version 1 exists (max_staleness 1)


def _logprobs(model, prompt: list[int], completion: list[int], temperature: float) -> list[float]:
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + completion])).logits[0].float()
    logp = torch.log_softmax(logits / (temperature or 1.0), dim=-1)
    return [logp[len(prompt) - 1 + j, t].item() for j, t in enumerate(completion)]


def test_real_cells_train_with_exact_per_token_versions(tmp_path):
    cfg = load_config("smoke", [
        f"run.out_root={tmp_path}/runs", f"lake.root={tmp_path}/lake", f"tracking.uri=sqlite:///{tmp_path}/m.db",
        "elastic.enabled=true", "elastic.mode=real", "elastic.cells=2", "elastic.policy=elastic",
        "elastic.micro_step_executions=2", "elastic.max_staleness=1", "elastic.capacity=4",
        f"rl.steps={STEPS}", "rl.lr=3e-3",
        "eval.episodes=8", "eval.greedy_episodes=0", "eval.random_baseline=false"])
    run_dir = st.prepare(cfg)
    st.warm_start(run_dir)
    summary = st.elastic_rl(run_dir)
    run = RunDir.open(run_dir)

    # the elastic phase left what the step loop leaves: a publish marker per version, a lake part per step
    assert st.latest_version(run) == STEPS
    assert summary["dead_cells"] == [] and summary["switches"] >= 1
    # both cells trained: the satellite's gradients went through the coordinator into the core's update
    assert set(summary["micro_steps_by_cell"]) == {"0", "1"}, summary["micro_steps_by_cell"]
    n_per_step = cfg.rollout.tasks_per_step * cfg.rollout.group_size
    records = {s: st._read_records(run, f"step={s}") for s in range(STEPS)}
    assert all(len(records[s]) == n_per_step for s in range(STEPS))

    # versions: real updates, each different from the one before
    model, _ = load_policy(str(run.warm))
    weights = {0: {k: v.clone() for k, v in model.state_dict().items()}}
    for v in range(1, STEPS + 1):
        weights[v] = load_weights(run.weights_uri(v))
        assert any(not torch.equal(weights[v][k], weights[v - 1][k]) for k in weights[v])

    # every token: a version the staleness bound allows for its burst, and its behaviour log-prob is what
    # that version's weights assign (recomputed without the engine's KV cache)
    by_version: dict[int, list] = {}
    for s, recs in records.items():
        for rec in recs:
            for call in rec.calls:
                assert len(call.versions) == len(call.completion_ids) == len(call.logprobs)
                assert all(max(0, s - 1) <= v <= s for v in call.versions), (s, call.versions)
                assert call.versions == sorted(call.versions)     # a rerouted call never goes back in time
                if call.versions:
                    by_version.setdefault(call.versions[0], []).append(call)
    assert set(by_version) >= {0, 1}
    checked = 0
    for v, calls in by_version.items():
        model.load_state_dict(weights[v], strict=False)
        for call in calls[:25]:
            if len(set(call.versions)) != 1:
                continue
            ref = _logprobs(model, call.prompt_ids, call.completion_ids, cfg.rollout.temperature)
            assert max(abs(a - b) for a, b in zip(ref, call.logprobs)) < 1e-4
            checked += 1
    assert checked >= 20

    # evaluation reads the final version; the summary counts the elastic phase's executions and tokens
    assert st.evaluate(run_dir, "after")["version"] == STEPS
    from gyre_core.report import summarize

    summary = summarize(run_dir, 0.0)
    assert summary["tokens_generated"] == sum(len(c.completion_ids) for recs in records.values()
                                              for r in recs for c in r.calls)
    assert summary["elastic"]["policy"] == "elastic" and summary["elastic"]["k"] == 2
    # every generated token of a kept execution is trained once (all cells' micro-steps summed)
    trainable = sum(len(c.completion_ids) for recs in records.values() for r in recs if r.status != "failed"
                    for c in r.calls)
    assert summary["tokens_trained"] == trainable
    assert summary["phase_s"]["elastic"] > 0
