"""`gyre bench prefect --json`: what Prefect costs per RL step, and the time from clicking Run to the first rollout.

    gyre bench prefect --json           # `default` preset, 5 RL steps each way: ~10 minutes on a 2-core CPU
    gyre bench prefect --quick --json   # `smoke` preset, 2 RL steps each way (~2 minutes)
    python -m bench.prefect_overhead [--quick]

Two runs of the same steps, one after the other in this script: the same preset and overrides under two run
names (run names do not enter the seeds). `same_final_weights` says whether they ended bit-identical: on
`smoke` they do; on `default` one update differs between processes at float-noise level (max |Δw| ~1e-8 from
identical batches), so later steps sample slightly different trajectories — comparable work, not identical.

- **plain**: in this process, `gyre_core.phases` called directly (prepare, warm start, evaluate-before, then
  rollout → score → process → train → publish per step). `plain_step_s`: the wall time from the call of
  `rollout(k)` to the return of `publish(k)`.
- **prefect**: `gyre up` in a temporary home on free ports (a real Prefect server, MLflow server, one worker),
  then `train` triggered from its deployment exactly as the UI's Run does (a flow run created with
  parameters). `prefect_step_s`: from the end of step k−1's `publish` task run (for step 0: the end of
  `evaluate-before`) to the end of step k's, from the task runs' timestamps in Prefect: task-run creation,
  state changes, the per-step artifact and the worker's flow-run process are all inside it.
- `overhead_frac` = (prefect_step_s − inner_step_s) / inner_step_s, where `inner_step_s` is the time inside
  the step functions of that same Prefect run (the phase times its markers record; `report.step_row`).
  `prefect_vs_plain` = prefect_step_s / plain_step_s compares the two runs side by side (it includes the
  two runs' noise, and the servers sharing this machine's cores). Aim: overhead ≤ 5%.
- **Run → first rollout**: `click_to_running_s` (a worker picked the run up and its process started the flow),
  `click_to_first_rollout_s` (the `rollout-0` task run started), and `orchestration_to_first_rollout_s`: the
  same less the work before the first rollout (the prepare, warm-start and evaluate-before task runs).
"""
from __future__ import annotations

import tempfile
import time
from pathlib import Path

EVAL_OVERRIDES = ["eval.episodes=16", "eval.greedy_episodes=0", "eval.random_baseline=false", "eval.control=false"]


def step_walls(task_times: dict[str, tuple[float, float]], n_steps: int) -> list[float]:
    """Each RL step's wall time in a flow run, from its task runs' (start, end) times: the end of step k's
    `publish-k` less the end of the task before the step (`publish-(k-1)`, or `evaluate-before` for step 0)."""
    out, prev = [], task_times["evaluate-before"][1]
    for k in range(n_steps):
        end = task_times[f"publish-{k}"][1]
        out.append(end - prev)
        prev = end
    return out


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def _plain(preset: str, overrides: list[str]) -> dict:
    from gyre_core import phases, report
    from gyre_core.config import load_config
    from gyre_core.run import RunDir

    cfg = load_config(preset, overrides)
    run_dir = phases.prepare(cfg)
    phases.run_objects.tracker(RunDir.open(run_dir))      # the MLflow run, opened up front as the flow's prepare task does
    t0 = time.time()
    phases.warm_start(run_dir)
    warm_s = time.time() - t0
    phases.evaluate(run_dir, "before")
    n = cfg.rl.steps
    walls = []
    for k in range(n):
        t0 = time.time()
        phases.rollout(run_dir, k)
        phases.score(run_dir, k)
        phases.process(run_dir, k)
        phases.train(run_dir, k)
        phases.publish(run_dir, k)
        walls.append(time.time() - t0)
    inner = [report.step_row(run_dir, k)["step_s"] for k in range(n)]
    return {"run_dir": run_dir, "step_walls": walls, "inner": inner, "warm_start_s": warm_s}


def _prefect(preset: str, overrides: list[str], n: int, home: Path, run_dir: str) -> dict:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
    from prefect.deployments import run_deployment
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from gyre_core import report
    from gyre_core.ports import free_port
    from gyre_ops.stack import StackSpec, down, up

    spec = StackSpec(home=home, prefect_port=free_port(), mlflow_port=free_port())
    t0 = time.time()
    up(spec, say=lambda m: None)
    up_s = time.time() - t0
    try:
        with temporary_settings(updates={PREFECT_API_URL: spec.api_url}):
            click = time.time()
            fr = run_deployment("gyre-train/train", parameters={"preset": preset, "overrides": overrides},
                                timeout=0)
            with get_client(sync_client=True) as client:
                while not (fr := client.read_flow_run(fr.id)).state.is_final():
                    time.sleep(2)
                if not fr.state.is_completed():
                    raise RuntimeError(f"bench: the Prefect run ended {fr.state.type.value}: {fr.state.message}; "
                                       f"see {home / 'logs'}")
                runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[fr.id])))
        times = {t.name: (t.start_time.timestamp(), t.end_time.timestamp()) for t in runs}
        walls = step_walls(times, n)
        inner = [report.step_row(run_dir, k)["step_s"] for k in range(n)]

        def dur(name):
            return times[name][1] - times[name][0]

        before_rollout = dur("prepare") + dur("warm-start") + dur("evaluate-before")
        first_rollout = times["rollout-0"][0] - click
        return {"run_dir": run_dir, "step_walls": walls, "inner": inner, "stack_up_s": up_s,
                "click_to_running_s": fr.start_time.timestamp() - click,
                "click_to_first_rollout_s": first_rollout, "warm_start_s": dur("warm-start"),
                "orchestration_to_first_rollout_s": first_rollout - before_rollout}
    finally:
        down(home, say=lambda m: None)


def _same_weights(a: str, b: str, version: int) -> bool:
    import torch

    from gyre_core.run import RunDir
    from gyre_core.trainer.publish import load_weights

    wa, wb = (load_weights(RunDir.open(d).weights_uri(version)) for d in (a, b))
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def bench_prefect(quick: bool = False) -> dict:
    preset, n = ("smoke", 2) if quick else ("default", 5)
    with tempfile.TemporaryDirectory(prefix="gyre-bench-prefect-") as tmp:
        tmp = Path(tmp)
        base = [f"run.out_root={tmp}/runs", f"lake.root={tmp}/lake", f"rl.steps={n}", *EVAL_OVERRIDES]
        plain = _plain(preset, base + ["run.name=plain", f"tracking.uri=sqlite:///{tmp}/plain-mlflow.db"])
        pref = _prefect(preset, base + ["run.name=prefect"], n, tmp / "stack", str(tmp / "runs" / "prefect"))
        same = _same_weights(plain["run_dir"], pref["run_dir"], n)
    p_wall, p_inner, q_wall = _mean(pref["step_walls"]), _mean(pref["inner"]), _mean(plain["step_walls"])
    r = lambda x: round(x, 4)  # noqa: E731
    return {
        "preset": preset, "rl_steps": n, "same_final_weights": same,
        "plain_step_s": r(q_wall), "prefect_step_s": r(p_wall), "prefect_vs_plain": r(p_wall / q_wall),
        "inner_step_s": r(p_inner), "overhead_s_per_step": r(p_wall - p_inner),
        "overhead_frac": r((p_wall - p_inner) / p_inner),
        "plain_glue_frac": r((q_wall - _mean(plain["inner"])) / _mean(plain["inner"])),
        "click_to_running_s": r(pref["click_to_running_s"]),
        "click_to_first_rollout_s": r(pref["click_to_first_rollout_s"]),
        "orchestration_to_first_rollout_s": r(pref["orchestration_to_first_rollout_s"]),
        "warm_start_s": {"plain": r(plain["warm_start_s"]), "prefect": r(pref["warm_start_s"])},
        "stack_up_s": r(pref["stack_up_s"]),
        "per_step": {"plain_s": [r(x) for x in plain["step_walls"]], "prefect_s": [r(x) for x in pref["step_walls"]],
                     "prefect_inner_s": [r(x) for x in pref["inner"]]},
    }


if __name__ == "__main__":
    import argparse
    import json

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    print(json.dumps(bench_prefect(quick=ap.parse_args().quick), indent=1))
