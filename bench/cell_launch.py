"""`gyre bench cells --json`: cell agents started as Prefect flow runs vs as local processes, side by side.

    gyre bench cells --json            # smoke preset, K = 2 real CPU cells, 3 RL steps each way (~4 minutes)
    python -m bench.cell_launch

`gyre up --devices cpu --devices cpu` in a temporary home on free ports (a real Prefect server, MLflow server,
a flow-run worker and two cell workers), then the same elastic RL phase twice under two run names:

- **process** (`elastic.launch=process`): `gyre_core.phases` in this process; the coordinator starts the
  two agents as its child processes.
- **prefect** (`elastic.launch=prefect`): `train` triggered from its deployment, as the UI's Run does; its
  `elastic-rl` task creates one `cell-agent` flow run per cell on queue `rollout`, which the cell workers
  pick up (each polls every PREFECT_WORKER_QUERY_SECONDS, 10 s by default) and run as the agents.

Per way: `start_s` (from launching the agents until every one has connected: the coordinator's clock),
`elastic_s` (the whole elastic phase, start-up and the writes after included), `step_s` (the phase's wall
time per RL step once the cells serve). `prefect_start_extra_s` is what starting the cells through Prefect
adds; `step_ratio` = prefect step_s / process step_s (once running, the cells are the same processes).
"""
from __future__ import annotations

import tempfile
import time
from pathlib import Path

STEPS = 3
ELASTIC = ["elastic.enabled=true", "elastic.cells=2", "elastic.policy=elastic", "elastic.micro_step_executions=2",
           "elastic.capacity=4"]
EVAL = ["eval.episodes=8", "eval.greedy_episodes=0", "eval.random_baseline=false", "eval.control=false"]


def _figures(run_dir: Path) -> dict:
    from gyre_core.run import RunDir

    m = RunDir.open(str(run_dir)).done("elastic")
    return {"start_s": round(m["start_s"], 3), "elastic_s": round(m["rl_wall_s"], 3), "step_s": round(m["step_s"], 3)}


def bench_cells() -> dict:
    from prefect.deployments import run_deployment
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from gyre_core import phases
    from gyre_core.config import load_config
    from gyre_core.ports import free_port
    from gyre_ops.stack import StackSpec, down, up

    with tempfile.TemporaryDirectory(prefix="gyre-bench-cells-") as tmp:
        tmp = Path(tmp)
        base = [f"run.out_root={tmp}/runs", f"lake.root={tmp}/lake", f"rl.steps={STEPS}", *ELASTIC, *EVAL]
        spec = StackSpec(home=tmp / "stack", prefect_port=free_port(), mlflow_port=free_port(),
                         device_sets=["cpu", "cpu"])
        up(spec, say=lambda m: None)
        try:
            cfg = load_config("smoke", base + ["run.name=process", "elastic.launch=process",
                                               f"tracking.uri=sqlite:///{tmp}/process-mlflow.db"])
            run_dir = phases.prepare(cfg)
            phases.warm_start(run_dir)
            phases.elastic_rl(run_dir)
            process = _figures(Path(run_dir))
            with temporary_settings(updates={PREFECT_API_URL: spec.api_url}):
                t0 = time.time()
                fr = run_deployment("gyre-train/train", timeout=1800, parameters={
                    "preset": "smoke", "overrides": base + ["run.name=prefect", "elastic.launch=prefect"]})
            if not fr.state.is_completed():
                raise RuntimeError(f"bench: the Prefect run ended {fr.state.type.value}: {fr.state.message}; "
                                   f"see {spec.home / 'logs'}")
            prefect = _figures(tmp / "runs" / "prefect") | {"flow_run_s": round(time.time() - t0, 1)}
        finally:
            down(spec.home, say=lambda m: None)
    return {"preset": "smoke", "k": 2, "rl_steps": STEPS, "process": process, "prefect": prefect,
            "prefect_start_extra_s": round(prefect["start_s"] - process["start_s"], 3),
            "step_ratio": round(prefect["step_s"] / process["step_s"], 3)}


if __name__ == "__main__":
    import json

    print(json.dumps(bench_cells(), indent=1))
