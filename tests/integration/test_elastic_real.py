"""Real cells: two agent processes that decode and train the smoke model, under the elastic policy.

Checked against independent references: every generated token's behaviour log-prob is recomputed by a
cache-free forward of the weights of the version recorded for that token (TITO with per-token versions,
reroutes included); every token's version is one the staleness bound allows for its burst; the published
versions are real updates (they differ from the warm start and from each other); the lake and the
completion markers hold what the step-by-step loop would leave, so evaluation reads the final version.
"""
from __future__ import annotations

import os

import pytest
import torch

from gyre_core import phases
from gyre_core.config import load_config
from gyre_core.model import load_policy
from gyre_core.run import RunDir
from gyre_core.trainer.publish import load_weights
from tests.listeners import Listeners

STEPS = 3          # burst 2 cannot start before version 1 exists (max_staleness 1)
# A workload where every burst carries a learning signal, so each step's update has something to compare: the
# corridor (every `forward` the warm-started policy takes moves the episode on) with per-turn progress credit
# (a group whose executions all earned the same reward has zero advantages, but its turns that moved towards
# the goal are still credited). On the smoke grid world, where a turn can leave the closeness unchanged, step 0
# had no signal at all in one CI run even with the credit (and in one run in five without it).
CREDIT = ["env.target=gyre_core.envs.scripted:ScriptedEnv", "env.kwargs={length: 6}",
          "rl.progress_credit=1.0", "processor.mode=flat"]     # (per-turn credit is for flat sequences)


def _batch(cfg, recs, step: int = 0):
    """The step's training batch as the step loop builds it from the records (`processor.step_batch`: dedup,
    group-relative advantages, the per-turn progress credit)."""
    from gyre_core.processor.step_batch import records_batch
    from gyre_core.seeds import sampling_seed

    return records_batch(recs, cfg, sampling_seed(cfg.run.seed, step))[0]


def _signal(cfg, recs) -> bool:
    """Does this step's batch carry a gradient: a trained token with a nonzero advantage?"""
    return any(w and a for sq in _batch(cfg, recs).sequences for w, a in zip(sq.weights, sq.advantages))


def _logprobs(model, prompt: list[int], completion: list[int], temperature: float) -> list[float]:
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + completion])).logits[0].float()
    logp = torch.log_softmax(logits / (temperature or 1.0), dim=-1)
    return [logp[len(prompt) - 1 + j, t].item() for j, t in enumerate(completion)]


def _assert_reference_update(cfg, run, recs, v0: dict, v1: dict) -> None:
    """Rebuild step 0's update in this process, as the step loop's trainer would make it from the records:
    the group advantages, each execution's sequences, one accumulation over all of them ÷ N, the clip and
    the optimizer step; `v1` (published by the cells) must match it. Elements whose gradient is at rounding
    level may differ by up to two learning rates: Adam's first step maps any gradient to about ±lr, and
    there the summation order (cells vs one trainer) decides the sign."""
    from gyre_core.elastic.stream import finish_step
    from gyre_core.model import load_policy as load
    from gyre_core.processor.batch import micro_batches
    from gyre_core.trainer.trainer import Trainer

    rl = cfg.rl
    batch = _batch(cfg, recs)
    model, tok = load(str(run.warm))
    model.load_state_dict(v0, strict=False)
    ref = Trainer(model, lr=rl.lr, zero_stage=cfg.trainer.zero_stage, grad_clip=rl.grad_clip,
                  pad_id=tok.pad_token_id or 0)
    for chunk in micro_batches(batch.sequences, rl.micro_batch_tokens):
        ref.micro_step(chunk, 1.0, objective="decoupled", temperature=cfg.rollout.temperature,
                       clip_low=rl.clip_low, clip_high=rl.clip_high, is_cap=cfg.elastic.is_cap,
                       negative_scale=rl.negative_scale, last=False)
    grads = {k: g.clone() for k, g in ref.gradients().items()}
    assert _signal(cfg, recs) and any(g.abs().max() > 0 for g in grads.values())    # step 0 had a signal
    norm = finish_step(ref, batch.n_executions)          # the pre-clip norm of the summed gradient ÷ N
    coef = min(1.0, rl.grad_clip / norm) / batch.n_executions
    got = dict(ref.model.named_parameters())
    n_sat = n_all = 0
    for name, g in grads.items():
        p, q = got[name].detach(), v1[name].to(got[name])       # the trainer's device and dtype
        # Adam's first step moves each weight by lr·ĝ/(|ĝ| + 1e-8): where |ĝ| ≥ 1e-7 that is ±lr within 10%
        # and float noise in ĝ cannot show; below, the step's size follows ĝ's noise (up to a sign flip)
        sat = (g * coef).abs() >= 1e-7
        n_sat, n_all = n_sat + int(sat.sum()), n_all + g.numel()
        assert torch.allclose(p[sat], q[sat], rtol=0, atol=1e-6), (name, (p - q)[sat].abs().max())
        assert ((p[~sat] - q[~sat]).abs() <= 2 * rl.lr + 1e-6).all(), name
    assert n_sat > 0.25 * n_all, (n_sat, n_all)    # tens of thousands of weights compared to 1e-6


@pytest.mark.parametrize("channel", ["collective", "arrays"])
def test_real_cells_train_with_exact_per_token_versions(tmp_path, channel):
    cfg = load_config("smoke", [
        f"run.out_root={tmp_path}/runs", f"lake.root={tmp_path}/lake", f"tracking.uri=sqlite:///{tmp_path}/m.db",
        "elastic.enabled=true", "elastic.mode=real", "elastic.cells=2", "elastic.policy=elastic",
        f"elastic.grad_channel={channel}",
        "elastic.micro_step_executions=2", "elastic.max_staleness=1", "elastic.capacity=4",
        f"rl.steps={STEPS}", "rl.lr=3e-3", *CREDIT,
        "eval.episodes=8", "eval.greedy_episodes=0", "eval.random_baseline=false"])
    run_dir = phases.prepare(cfg)
    phases.warm_start(run_dir)
    with Listeners(os.getpid()) as sockets:
        summary = phases.elastic_rl(run_dir)
    run = RunDir.open(run_dir)

    # every socket the run listened on (coordinator, cells, their gradient groups) was on loopback
    assert sockets.exposed() == [], sockets.exposed()
    programs = {prog for _, prog, _, _ in sockets.found}
    assert any("gyre_core.elastic.agent" in p for p in programs), sockets.found   # the cells' were seen

    # the elastic phase left what the step loop leaves: a publish marker per version, a lake part per step
    assert run.latest_version() == STEPS
    assert summary["dead_cells"] == [] and summary["switches"] >= 1
    # model.device=auto: each agent computes where torch sees a device (its own GPU slice on a GPU host)
    here = "real/cuda:0" if torch.cuda.is_available() else "real/cpu"
    assert summary["cell_devices"] == {"0": here, "1": here}
    # both cells trained: the satellite's gradients reached the core's update (summed by a reduce over the
    # cells' own process group, or shipped through the coordinator as arrays)
    assert set(summary["micro_steps_by_cell"]) == {"0", "1"}, summary["micro_steps_by_cell"]
    assert summary["grad_channel"] == channel
    assert (summary["reduce_s_mean"] is not None) == (channel == "collective")
    n_per_step = cfg.rollout.tasks_per_step * cfg.rollout.group_size
    records = {s: phases.run_objects.read_records(run, f"step={s}") for s in range(STEPS)}
    assert all(len(records[s]) == n_per_step for s in range(STEPS))

    # versions: real updates — each differs from the one before whenever its burst carried a signal
    model, _ = load_policy(str(run.warm))
    weights = {0: {k: v.clone() for k, v in model.state_dict().items()}}
    changed = []
    for v in range(1, STEPS + 1):
        weights[v] = load_weights(run.weights_uri(v))
        changed.append(any(not torch.equal(weights[v][k], weights[v - 1][k]) for k in weights[v]))
        if _signal(cfg, records[v - 1]):
            assert changed[-1], v
    # some update was real (which bursts carry a signal depends on what the cells sampled, and that on how the
    # scheduler batched the calls: burst 0 alone had none in one run of the whole suite)
    assert any(changed)

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

    # v1 across processes (two cells' micro-steps, the satellite's gradients reduced or shipped to the core)
    # equals the update one trainer in this process makes on the same step-0 executions from v0
    _assert_reference_update(cfg, run, records[0], weights[0], weights[1])

    # evaluation reads the final version; the summary counts the elastic phase's executions and tokens
    assert phases.evaluate(run_dir, "after")["version"] == STEPS
    from gyre_core.report import summarize

    summary = summarize(run_dir, 0.0)
    assert summary["tokens_generated"] == sum(len(c.completion_ids) for recs in records.values()
                                              for r in recs for c in r.calls)
    assert summary["elastic"]["policy"] == "elastic" and summary["elastic"]["k"] == 2
    # every generated token of a trained execution (duplicates collapsed) is trained once (all cells' micro-steps)
    trainable = sum(sq.n_trainable for s, recs in records.items() for sq in _batch(cfg, recs, s).sequences)
    assert summary["tokens_trained"] == trainable
    assert summary["phase_s"]["elastic"] > 0


@pytest.mark.fault("a training cell dies holding its gradient", "the update falls back to arrays relayed by the coordinator; versions stay exact")
def test_a_satellite_lost_holding_its_gradient_falls_back_to_arrays(tmp_path, monkeypatch):
    """Collective channel, colocated (both cells train step 0): the satellite is SIGKILLed right after its
    first micro-step counted, while its gradient is still held in its process. The run goes on with the
    core alone, its gradients as arrays, step 0's burst trained again: v1 still equals one trainer's update
    on step 0's executions, and nothing of the dead cell's gradient is in it."""
    from gyre_core.elastic import runtime
    from gyre_core.elastic.messages import MicroDone

    killed = []

    class KillSatellite(runtime.Coordinator):
        def _handle(self, cell, msg):
            super()._handle(cell, msg)
            if isinstance(msg, MicroDone) and cell == 1 and not killed and self.version == 0:
                assert self.channel == "collective" and self.micro_by_cell.get(1) == 1
                killed.append(self.now())
                self.connections.kill(1)

    monkeypatch.setattr(runtime, "Coordinator", KillSatellite)
    cfg = load_config("smoke", [
        f"run.out_root={tmp_path}/runs", f"lake.root={tmp_path}/lake", f"tracking.uri=sqlite:///{tmp_path}/m.db",
        "elastic.enabled=true", "elastic.mode=real", "elastic.cells=2", "elastic.policy=colocated",
        "elastic.micro_step_executions=1", "elastic.capacity=8", "rl.steps=2", "rl.lr=3e-3", *CREDIT,
        "eval.episodes=8", "eval.greedy_episodes=0", "eval.random_baseline=false"])
    run_dir = phases.prepare(cfg)
    phases.warm_start(run_dir)
    summary = phases.elastic_rl(run_dir)
    run = RunDir.open(run_dir)
    assert killed and summary["dead_cells"] == [1] and summary["grad_channel"] == "arrays"
    notes = " | ".join(summary["notes"])
    assert "as arrays from now on (cell 1 lost)" in notes and "micro-step(s) of step 0 redone" in notes, notes
    assert run.latest_version() == 2
    model, _ = load_policy(str(run.warm))
    v0 = {k: v.clone() for k, v in model.state_dict().items()}
    _assert_reference_update(cfg, run, phases.run_objects.read_records(run, "step=0"), v0, load_weights(run.weights_uri(1)))


@pytest.mark.fault("the coordinator (the elastic phase) crashes", "a rerun resumes at the newest published version")
def test_a_crashed_elastic_phase_resumes_at_the_newest_published_version(tmp_path, monkeypatch):
    """The coordinator dies right after version 2 is published (step 1 landed): rerunning keeps steps 0–1
    as they are and runs only step 2, on cells that start from v2's weights (checked token by token). With a
    KL bound no update meets, the core redoes each update once from the step's checkpoint at half the rate."""
    import json

    from gyre_core.lake.store import MANIFEST

    cfg = load_config("smoke", [
        f"run.out_root={tmp_path}/runs", f"lake.root={tmp_path}/lake", f"tracking.uri=sqlite:///{tmp_path}/m.db",
        "elastic.enabled=true", "elastic.mode=real", "elastic.cells=2", "elastic.policy=elastic",
        "elastic.micro_step_executions=2", "elastic.capacity=4", f"rl.steps={STEPS}", "rl.lr=3e-3",
        "rl.max_kl=1e-30", "rl.kl_backtracks=1"])
    run_dir = phases.prepare(cfg)
    phases.warm_start(run_dir)
    run = RunDir.open(run_dir)
    land = phases.rl_on_cells.land_elastic_step

    def crash_after_step_1(run_, t, step, recs, ts, step_s):
        land(run_, t, step, recs, ts, step_s)
        if step == 1:
            raise RuntimeError("the coordinator's host went away")
    monkeypatch.setattr(phases.rl_on_cells, "land_elastic_step", crash_after_step_1)
    with pytest.raises(RuntimeError, match="went away"):
        phases.elastic_rl(run_dir)
    monkeypatch.setattr(phases.rl_on_cells, "land_elastic_step", land)
    assert run.latest_version() == 2 and run.done("elastic") is None
    lake = phases.run_objects.run_lake(run)
    def manifest(s):
        return json.loads(lake.fs.cat_file(f"{lake.part_dir(run.run_id, f'step={s}')}/{MANIFEST}"))
    manifests = {s: manifest(s) for s in (0, 1)}
    kept = {s: phases.run_objects.read_records(run, f"step={s}") for s in (0, 1)}

    summary = phases.elastic_rl(run_dir)
    assert summary["resumed_from"] == 2 and summary["steps"] == 1 and run.latest_version() == STEPS
    n_per_step = cfg.rollout.tasks_per_step * cfg.rollout.group_size
    for s in (0, 1):       # the landed steps were not redone
        assert manifest(s) == manifests[s] and len(kept[s]) == n_per_step
    recs = phases.run_objects.read_records(run, "step=2")
    assert len(recs) == n_per_step
    # step 2 ran on v2's weights: no token of an older version, and the log-probs are v2's own
    model, _ = load_policy(str(run.warm))
    model.load_state_dict(load_weights(run.weights_uri(2)), strict=False)
    checked = 0
    for rec in recs:
        for call in rec.calls:
            assert set(call.versions) == {2}, call.versions   # v3 needs all of step 2: nothing newer yet
            if checked < 25:
                ref = _logprobs(model, call.prompt_ids, call.completion_ids, cfg.rollout.temperature)
                assert max(abs(a - b) for a, b in zip(ref, call.logprobs)) < 1e-4
                checked += 1
    # v3 is step 2's update on v2: it moves the weights exactly when some group's rewards differ (a group
    # of equal rewards has zero advantages, as when every execution fails alike)
    v2, v3 = load_weights(run.weights_uri(2)), load_weights(run.weights_uri(3))
    groups: dict[str, set] = {}
    for r in recs:
        groups.setdefault(r.task_id, set()).add(r.reward)
    signal = any(len(g) > 1 for g in groups.values())
    assert any(not torch.equal(v2[k], v3[k]) for k in v3) == signal, groups
    # the KL guard measured every update (against the weights the step trained from); one past the bound was
    # redone once, from the step's checkpoint on the core, at half the rate (an update with no signal still
    # moves the weights through Adam's running moments, so nearly every step is past 1e-30)
    redone = 0
    for v in (1, 2, 3):
        m = run.done(f"publish_{v:04d}")["metrics"]
        past = m["train/kl"] > 1e-30
        assert (m["train/kl_backtracks"], m["train/lr"]) == ((1, 1.5e-3) if past else (0, 3e-3)), m
        redone += past
    assert redone >= max(1, int(signal))      # (the redo from the checkpoint ran on a real cell)
    # the phase's wall time adds up the steps of both invocations (the control's budget)
    per_step = [run.done(f"publish_{v:04d}")["metrics"]["time/elastic_step_s"] for v in (1, 2, 3)]
    assert all(x > 0 for x in per_step) and summary["rl_wall_s"] >= sum(per_step)


def test_vllm_cells_abort_reroute_and_keep_exact_versions(tmp_path):
    """`engine.kind=vllm`: each cell rolls out on its own vLLM-CPU server and trains with its own trainer,
    under the elastic policy. Every token's log-prob is what the weights of its recorded version assign
    (float32 server and reference), whatever switches, aborts, reroutes and reloads happened."""
    cfg = load_config("smoke", [
        f"run.out_root={tmp_path}/runs", f"lake.root={tmp_path}/lake", f"tracking.uri=sqlite:///{tmp_path}/m.db",
        "elastic.enabled=true", "elastic.mode=real", "elastic.cells=2", "elastic.policy=elastic",
        "elastic.micro_step_executions=2", "elastic.max_staleness=1", "elastic.capacity=4",
        "engine.kind=vllm", "engine.dtype=float32", "engine.kv_cache_gib=1",
        f"rl.steps={STEPS}", "rl.lr=3e-3", *CREDIT,
        "eval.episodes=8", "eval.greedy_episodes=0", "eval.random_baseline=false"])
    run_dir = phases.prepare(cfg)
    phases.warm_start(run_dir)
    summary = phases.elastic_rl(run_dir)
    run = RunDir.open(run_dir)
    assert run.latest_version() == STEPS and summary["dead_cells"] == []
    assert set(summary["cell_devices"].values()) == {"vllm/cpu"}
    # whether a switch catches calls in flight (a reroute) depends on timing; the abort → continue and the
    # mid-call reload are checked deterministically on the device (test_vllm_engine.py)
    assert summary["switches"] >= 1
    records = {s: phases.run_objects.read_records(run, f"step={s}") for s in range(STEPS)}
    model, _ = load_policy(str(run.warm))
    weights = {0: {k: v.clone() for k, v in model.state_dict().items()}}
    weights.update({v: load_weights(run.weights_uri(v)) for v in range(1, STEPS + 1)})
    checked = 0
    for s, recs in records.items():
        for rec in recs:
            for call in rec.calls:
                assert len(call.versions) == len(call.completion_ids) == len(call.logprobs)
                assert all(max(0, s - 1) <= v <= s for v in call.versions) and call.versions == sorted(call.versions)
                if checked >= 60 or not call.completion_ids:
                    continue
                # each token against the weights of its own version (a call may span two)
                for v in sorted(set(call.versions)):
                    model.load_state_dict(weights[v], strict=False)
                    ref = _logprobs(model, call.prompt_ids, call.completion_ids, cfg.rollout.temperature)
                    mine = [(r, lp) for r, lp, cv in zip(ref, call.logprobs, call.versions) if cv == v]
                    assert max(abs(r - lp) for r, lp in mine) < 1e-3
                checked += 1
    assert checked >= 40


def test_an_external_harness_on_real_cells_through_the_router(tmp_path):
    """`proxy-smoke` on two real cells: every execution is examples/openai_agent.py, its calls through the proxy
    and the elastic router to the cell agents; each token's log-prob is that of its recorded version."""
    from gyre_core.phases.run_objects import read_records

    cfg = load_config("proxy-smoke", [
        f"run.out_root={tmp_path}/runs", f"lake.root={tmp_path}/lake", f"tracking.uri=sqlite:///{tmp_path}/m.db",
        "elastic.enabled=true", "elastic.mode=real", "elastic.cells=2", "elastic.policy=elastic",
        "elastic.micro_step_executions=2", "elastic.max_staleness=1", "elastic.capacity=4",
        "rl.steps=2", "rl.lr=3e-3", "eval.episodes=4", "eval.greedy_episodes=0"])
    run_dir = phases.prepare(cfg)
    phases.warm_start(run_dir)
    summary = phases.elastic_rl(run_dir)
    run = RunDir.open(run_dir)
    assert run.latest_version() == 2 and summary["dead_cells"] == []
    model, _ = load_policy(str(run.warm))
    checked = 0
    for s in range(2):
        recs = read_records(run, f"step={s}")
        assert len(recs) == 8 and all(r.status == "done" for r in recs), [r.error for r in recs]
        assert {c.role for r in recs for c in r.calls} >= {"sub-agent", "main"}
        calls = [c for r in recs for c in r.calls]
        assert all(max(0, s - 1) <= v <= s for c in calls for v in c.versions)
        for v in {c.versions[0] for c in calls if c.versions}:
            model.load_state_dict(load_weights(run.weights_uri(v)), strict=False)
            for c in [c for c in calls if c.versions and set(c.versions) == {v}][:6]:
                ref = _logprobs(model, c.prompt_ids, c.completion_ids, cfg.rollout.temperature)
                assert max(abs(a - b) for a, b in zip(ref, c.logprobs)) < 1e-4
                checked += 1
    assert checked >= 6
