"""`gyre bench elastic --json`: colocated vs async vs elastic on one documented workload, real and emulated.

    gyre bench elastic --json            # ~3 minutes alone on a 2-core CPU (longer beside other jobs)
    gyre bench elastic --quick --json    # fewer steps and async splits

1. **Real K = 2** (`real`): the smoke model (warm-started on 80 demonstrations, 60 steps) on BabyAI GoToObj, 2 cell agents of one CPU thread each, the
   run's own harness and environment with `REAL_LATENCY_S` of environment latency per turn (a sandboxed
   tool's round trip), under each policy from the same warm start; then each policy's final policy is
   evaluated on the same held-out seeds (`eval_success`, beside the warm start's `eval_success_before`;
   each policy's run repeats the same deterministic warm start, so the three start from equal weights).
   The real colocated run also *calibrates* the emulated fleet: its call latency and environment turn as
   the executions lived them (`turn_times`: a call's latency at the batch sizes that run had, an
   execution's first call left out as it includes waiting for a slot; the gap between calls, which holds
   the harness's own work besides `REAL_LATENCY_S`), training seconds per trained call, update seconds
   and switch times become the emulated device's costs. How the cells' decoding slows as their batch fills
   is measured on their model (`decode_load`, `bench/decode_load.py`): the emulated device and the
   simulator slow down by that β, and the calibrated call time is the lived one with it divided out
   (`others_in_flight`). The colocated real run's `sim_rel_err` is measured on the run the calibration
   came from.
2. **Emulated K = 8** (`emulated`, clearly labelled): the same router, controller, queues and agent
   processes, device work replaced by those calibrated waits, on the documented long-tailed workload
   `WORKLOAD` (lognormal calls per execution, capped at a timeout, environment latency per call). `async`
   runs at every split in the sweep and reports the best.
3. **Simulator** (`sim`): `gyre_core.elastic.sim` predicts each policy's `step_s` on the same emulated
   workload, with the call and turn times the emulated colocated run measured (`sim_calibration`:
   messaging and thread scheduling on two cores lengthen both a little), and for the real fleet on the
   real runs' calls per execution with the real colocated run's calibration; `sim_rel_err` is the largest
   relative error of predicted vs measured `step_s` (the colocated runs are the ones calibrated on).
   `step_s_floor` (`sim.step_s_floor`) is the floor under any policy on that fleet — every cell-second
   used with every slot full, or the critical path that the staleness bound gates — and
   `max_speedup_vs_async` the measured async step over it: no role policy can beat the best async split
   by more than that on this workload.
4. **Cost-aware** (`cost_aware_vs_*`): the `cost-aware` policy on the same emulated fleet, against the
   measured colocated / async / elastic runs and the floor; `emulated_training_heavy` the same fleet with
   training 62% of the device work (where the waterlevel loses to a static split), elastic vs cost-aware vs
   async at the simulator's best split; `min_vs_best_static` the worst ratio of cost-aware's step time to
   the best static split over the simulator tables' regimes (`_elastic`: the waterlevel's; `_adaptive`: the
   verl-style switch's); `adaptive_baseline_vs_async` that switch on async's best split vs async, simulated.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import statistics
import tempfile
import time

from gyre_core.config import ElasticConfig, load_config
from gyre_core.elastic.runtime import run_elastic
from gyre_core.elastic.sim import simulate, step_s_floor
from gyre_core.elastic.workload import Workload

POLICIES = ("colocated", "async", "elastic")
REAL_LATENCY_S = 0.05          # environment latency per turn in the real runs
REAL_STEPS = 4
# the emulated fleet's workload; device costs are replaced by the real cells' calibration
WORKLOAD = Workload(name="bench-long-tail", executions_per_step=64, steps=4, calls_median=10.0, calls_sigma=0.9,
                    max_calls=40, env_s=REAL_LATENCY_S, seed=7)
K_EMULATED, CAPACITY_EMULATED, MICRO_EMULATED = 8, 8, 4


def _real_config(policy: str, root: str, steps: int, eval_episodes: int):
    return load_config("smoke", [
        f"run.out_root={root}/runs-{policy}", f"lake.root={root}/lake", f"tracking.uri=sqlite:///{root}/mlflow.db",
        "elastic.enabled=true", "elastic.mode=real", "elastic.cells=2", f"elastic.policy={policy}",
        "elastic.capacity=8", "elastic.micro_step_executions=2", "elastic.async_train_cells=1",
        f"env.latency_s={REAL_LATENCY_S}", "rollout.tasks_per_step=4", f"rl.steps={steps}",
        "warmstart.episodes=80", "warmstart.steps=60",
        f"eval.episodes={eval_episodes}", "eval.greedy_episodes=0", "eval.random_baseline=false", "eval.control=false"])


def run_real(policy: str, root: str, steps: int, eval_episodes: int) -> dict:
    """One real K = 2 run of `policy`: warm start, the elastic RL phase, evaluation before and after."""
    from gyre_core import phases
    from gyre_core.run import RunDir, step_part

    cfg = _real_config(policy, root, steps, eval_episodes)
    run_dir = phases.prepare(cfg)
    phases.warm_start(run_dir)
    before = phases.evaluate(run_dir, "before")
    t0 = time.time()
    summary = phases.elastic_rl(run_dir)
    wall = time.time() - t0
    after = phases.evaluate(run_dir, "after")
    run = RunDir.open(run_dir)
    records = [r for s in range(steps) for r in phases.run_objects.read_records(run, step_part(s))]
    times = [[(c.t_start, c.t_end) for c in r.calls] for r in records if r.status != "failed"]
    return {"summary": summary, "wall_s": wall, "records_calls": [r.turns for r in records],
            "policy_dir": str(run.warm), "call_spans": times,
            "turn_times": turn_times(times),
            "trained_calls": sum(r.turns for r in records if r.status != "failed"),
            "executions_per_step": cfg.rollout.tasks_per_step * cfg.rollout.group_size,
            "eval_success_before": before["sampled"]["success"], "eval_success": after["sampled"]["success"],
            "timeline_png": str(run.path / "elastic" / "role_timeline.png")}


def turn_times(executions: list[list[tuple[float, float]]]) -> tuple[float, float]:
    """(call_s, env_s) as executions lived them, from each execution's calls' (start, end) times: a call's
    latency (an execution's first call left out: it includes waiting for a slot) and the gap between one
    call's end and the next one's start (the environment turn, with the harness's own work in it)."""
    calls = [e - b for ts in executions for b, e in ts[1:]]
    gaps = [ts[i + 1][0] - ts[i][1] for ts in executions for i in range(len(ts) - 1)]
    return statistics.mean(calls), statistics.mean(gaps)


def others_in_flight(executions: list[list[tuple[float, float]]], cells: int) -> float:
    """The mean number of OTHER calls in flight on a call's cell while it runs: over each call's span, the
    time-average number of calls in flight (itself included) spread evenly over `cells` rolling-out cells
    (the router sends a call to the least-loaded one), less itself. Averaged over the calls `turn_times`
    counts (an execution's first call left out: it includes waiting for a slot); every call adds load."""
    import numpy as np

    def as_spans(calls):
        a = np.array(calls, dtype=float).reshape(-1, 2)
        return a[a[:, 1] > a[:, 0]]

    spans = as_spans([c for ts in executions for c in ts])
    counted = as_spans([c for ts in executions for c in ts[1:]])
    if not len(counted):
        return 0.0
    t = np.concatenate([spans[:, 0], spans[:, 1]])
    step = np.concatenate([np.ones(len(spans)), -np.ones(len(spans))])
    order = np.argsort(t, kind="stable")
    t, level = t[order], np.cumsum(step[order])            # calls in flight from t[i] to t[i + 1]
    area = np.concatenate([[0.0], np.cumsum(level[:-1] * np.diff(t))])
    inside = np.interp(counted[:, 1], t, area) - np.interp(counted[:, 0], t, area)
    return float(np.mean(np.maximum(inside / (counted[:, 1] - counted[:, 0]) / cells - 1.0, 0.0)))


def calibrate(real: dict, switch: dict, beta: float) -> Workload:
    """The emulated device's costs, from a real run: a call's latency and an environment turn as the
    executions lived them (`turn_times`), the call's latency alone on its cell (the lived one divided by
    1 + β·the other calls in flight beside it, β = `decode_slowdown` measured on the cell's model), seconds
    per trained call, per update, per switch."""
    s = real["summary"]
    calls = real["trained_calls"]
    call_s, env_s = real["turn_times"]
    alone = call_s / (1 + beta * others_in_flight(real["call_spans"], 2))
    return dataclasses.replace(
        WORKLOAD, call_s=alone, env_s=env_s, decode_slowdown=beta,
        train_s_per_call=s["micro_s_total"] / max(calls, 1),
        optimizer_s=s["optim_s_mean"], publish_s=0.0,     # the core publishes inside its update
        switch_to_train_s=switch["to_train"], switch_to_rollout_s=switch["to_rollout"])


def _policy_figures(res) -> dict:
    d = res.to_dict()
    return {k: d[k] for k in ("step_s", "busy_frac", "switch_s_rollout_to_train", "switch_s_train_to_rollout",
                              "switches", "reroutes", "stale_dropped")} | {
        "busy_rollout": res.busy.get("rollout"), "busy_train": res.busy.get("train")}


def _speedups(step_s: dict) -> dict:
    return {"speedup_vs_colocated": step_s["colocated"] / step_s["elastic"],
            "speedup_vs_async": step_s["async"] / step_s["elastic"]}


def bench_elastic(quick: bool = False, out_dir: str = "data/bench/elastic") -> dict:
    steps = 2 if quick else REAL_STEPS
    eval_episodes = 64 if quick else 200
    os.makedirs(out_dir, exist_ok=True)
    root = tempfile.mkdtemp(prefix="gyre-bench-elastic-")
    out: dict = {"workload": WORKLOAD.to_dict(), "real_latency_s": REAL_LATENCY_S}
    try:
        # 1. real K = 2
        real = {p: run_real(p, root, steps, eval_episodes) for p in POLICIES}
        for p, r in real.items():
            shutil.copy(r["timeline_png"], os.path.join(out_dir, f"real-{p}.png"))
        sw_train = [r["summary"]["switch_s_rollout_to_train"] for r in real.values()
                    if r["summary"]["switch_s_rollout_to_train"] is not None]
        sw_roll = [r["summary"]["switch_s_train_to_rollout"] for r in real.values()
                   if r["summary"]["switch_s_train_to_rollout"] is not None]
        switch = {"to_train": statistics.mean(sw_train) if sw_train else 0.0,
                  "to_rollout": statistics.mean(sw_roll) if sw_roll else 0.0}
        real_step = {p: r["summary"]["step_s"] for p, r in real.items()}
        out["real"] = {
            "k": 2, "steps": steps, "eval_episodes": eval_episodes,
            **{p: {k: r["summary"][k] for k in ("step_s", "busy_frac", "switch_s_rollout_to_train",
                                                 "switch_s_train_to_rollout", "switches", "reroutes",
                                                 "stale_dropped", "call_s_mean", "optim_s_mean",
                                                 "grad_channel", "reduce_s_mean")}
               | {"eval_success_before": r["eval_success_before"], "eval_success": r["eval_success"]}
               for p, r in real.items()},
            **_speedups(real_step)}
        # how the real cells' decoding slows as their batch fills (`bench/decode_load.py`, the cells' model
        # on the in-process engine, one thread): the emulated device and the simulator slow down as much
        from bench.decode_load import local_engine

        out["decode_load"] = local_engine(real["colocated"]["policy_dir"], loads=(1, 2, 4, 8))
        beta = out["decode_load"]["beta"]
        # the simulator on the real fleet: the real runs' calls per execution as a trace
        trace = tuple(c for r in real.values() for c in r["records_calls"])
        base = calibrate(real["colocated"], switch, beta)
        real_w = dataclasses.replace(base, trace=trace, executions_per_step=real["colocated"]["executions_per_step"],
                                     steps=steps,
                                     max_calls=max(trace))
        sim_real = {p: simulate(real_w, 2, 8, p, 1, 1, 2).step_s for p in POLICIES}
        out["real"]["sim_step_s"] = sim_real
        out["real"]["sim_rel_err"] = max(abs(sim_real[p] - real_step[p]) / real_step[p] for p in POLICIES)

        # 2. emulated K = 8, calibrated from the real cells
        w = dataclasses.replace(base, steps=2 if quick else WORKLOAD.steps)
        out["calibrated"] = {k: getattr(w, k) for k in ("call_s", "env_s", "train_s_per_call", "optimizer_s",
                                                        "switch_to_train_s", "switch_to_rollout_s",
                                                        "decode_slowdown")}
        ecfg = lambda policy, split=1: ElasticConfig(   # noqa: E731
            policy=policy, cells=K_EMULATED, mode="emulated", capacity=CAPACITY_EMULATED,
            async_train_cells=split, micro_step_executions=MICRO_EMULATED, max_staleness=1)
        emu = {p: run_elastic(ecfg(p), w) for p in ("colocated", "elastic")}
        splits = (1, 2) if quick else (1, 2, 3, 4)
        sweep = {s: run_elastic(ecfg("async", s), w) for s in splits}
        best = min(sweep, key=lambda s: sweep[s].step_s)
        emu["async"] = sweep[best]
        for p, r in emu.items():
            r.plot(os.path.join(out_dir, f"emulated-{p}.png"))
        emu_step = {p: r.step_s for p, r in emu.items()}
        # the simulator predicts the emulated fleet from what its colocated run measured per call (alone on
        # its cell, as in `calibrate`) and per turn (messaging and thread scheduling on this machine's two
        # cores lengthen both a little)
        e_times = [log.times for log in emu["colocated"].executions]
        e_call, e_env = turn_times(e_times)
        e_call /= 1 + beta * others_in_flight(e_times, K_EMULATED)
        w_sim = dataclasses.replace(w, call_s=e_call, env_s=e_env)
        sim = {p: simulate(w_sim, K_EMULATED, CAPACITY_EMULATED, p, best if p == "async" else 1, 1, MICRO_EMULATED)
               for p in POLICIES}
        out["emulated"] = {
            "k": K_EMULATED, "capacity": CAPACITY_EMULATED, "steps": w.steps,
            **{p: _policy_figures(r) for p, r in emu.items()},
            "async_split": best, "async_sweep_step_s": {str(s): r.step_s for s, r in sweep.items()},
            "sim_calibration": {"call_s": e_call, "env_s": e_env},
            **_speedups(emu_step),
            "sim_step_s": {p: r.step_s for p, r in sim.items()},
            "sim_speedup_vs_colocated": sim["colocated"].step_s / sim["elastic"].step_s,
            "sim_speedup_vs_async": sim["async"].step_s / sim["elastic"].step_s,
            "sim_rel_err": max(abs(sim[p].step_s - emu_step[p]) / emu_step[p] for p in POLICIES)}
        # the floor under any policy (work over the K cells, or the staleness-gated critical path), with the
        # emulated fleet's own per-call and per-turn times: how much better than async any policy could be
        floor = step_s_floor(w_sim, K_EMULATED, CAPACITY_EMULATED, 1)
        out["emulated"].update(step_s_floor=floor, max_speedup_vs_async=emu_step["async"] / floor,
                               elastic_over_floor=emu_step["elastic"] / floor)
        # 4. the cost-aware policy on the same emulated fleet, and on a training-heavy variant of the workload
        # (training 62% of the device work, where the waterlevel loses to a static split) beside the waterlevel
        # and async at the split the simulator finds best there; the worst ratio to the best static split
        # over the regimes of the simulator's tables (bench/experiments/sim_train_share.py)
        from bench.experiments.sim_train_share import min_vs_best_static

        emu_ca = run_elastic(ecfg("cost-aware"), w)
        heavy = dataclasses.replace(w, train_s_per_call=w.call_s * 1.6)
        split = min(range(1, K_EMULATED), key=lambda s: simulate(dataclasses.replace(w_sim, train_s_per_call=w_sim.call_s
                                                                                       * 1.6), K_EMULATED,
                                                                   CAPACITY_EMULATED, "async", s, 1,
                                                                   MICRO_EMULATED).step_s)
        heavy_runs = {"elastic": run_elastic(ecfg("elastic"), heavy), "cost-aware": run_elastic(ecfg("cost-aware"), heavy),
                      "async": run_elastic(ecfg("async", split), heavy)}
        hs = {p: r.step_s for p, r in heavy_runs.items()}
        out["emulated_training_heavy"] = {"train_s_per_call": heavy.train_s_per_call, "async_split": split,
                                          "step_s": hs, "cost_aware_vs_elastic": hs["elastic"] / hs["cost-aware"],
                                          "cost_aware_vs_async": hs["async"] / hs["cost-aware"]}
        worst = min_vs_best_static()
        ca = emu_ca.step_s
        out.update(cost_aware_vs_async=emu_step["async"] / ca, cost_aware_vs_colocated=emu_step["colocated"] / ca,
                   cost_aware_vs_elastic=emu_step["elastic"] / ca, cost_aware_vs_floor=ca / floor,
                   min_vs_best_static=worst["cost-aware"], min_vs_best_static_elastic=worst["elastic"],
                   min_vs_best_static_adaptive=worst["adaptive"],
                   # verl-style adaptive switching on async's best split, in the simulator on the emulated fleet
                   adaptive_baseline_vs_async=sim["async"].step_s / simulate(
                       w_sim, K_EMULATED, CAPACITY_EMULATED, "adaptive", best, 1, MICRO_EMULATED).step_s)
        # the headline figures, at the top level
        out.update(
            step_s={p: emu_step[p] for p in POLICIES},
            busy_frac={p: emu[p].busy.get("overall") for p in POLICIES},
            speedup_vs_colocated=out["emulated"]["speedup_vs_colocated"],
            speedup_vs_async=out["emulated"]["speedup_vs_async"], async_split=best,
            switch_s_rollout_to_train=switch["to_train"], switch_s_train_to_rollout=switch["to_rollout"],
            sim_rel_err=out["emulated"]["sim_rel_err"],
            eval_success={p: real[p]["eval_success"] for p in POLICIES},
            eval_success_before=real["colocated"]["eval_success_before"],
            pngs=sorted(os.path.join(out_dir, f) for f in os.listdir(out_dir) if f.endswith(".png")))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return out


if __name__ == "__main__":
    import sys

    print(json.dumps(bench_elastic(quick="--quick" in sys.argv), indent=1))
