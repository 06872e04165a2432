"""`gyre bench channel --json`: satellites' gradients to the core — process-group reduce vs arrays relayed.

    gyre bench channel --json          # ~6 minutes on a 2-core CPU
    python -m bench.grad_channel

The same elastic RL phase (smoke preset on a wider model, `WIDE`: ~3.2M parameters, so a gradient is ~12 MB;
K real CPU cells, `colocated` so every cell trains every step) twice, side by side, each from the same
deterministic warm start:

- **collective** (`elastic.grad_channel=collective`, the default): satellites keep their micro-steps'
  gradients; at each update the cells of the prefix that trained sum them onto the core with one gloo
  reduce over their own process group (`gyre_core.elastic.collective`). Nothing passes the coordinator.
- **arrays**: after each micro-step a satellite pickles its gradient to the coordinator, which forwards it to
  the core, which adds it in.

Per channel: `step_s`, `relayed_mb` (gradient bytes through the coordinator), `grad_mb` (one gradient),
`reduce_s_mean` (the core's wait in the reduce, the collective's whole cost on the update path),
`optim_s_mean`, satellite micro-steps. The two phases sample the same tasks from equal weights but their
executions differ (timing decides routing), so `step_s` compares the channels' cost, not bit-equal work.
"""
from __future__ import annotations

import shutil
import tempfile
import time

WIDE = ["model.hidden_size=256", "model.num_layers=4", "model.num_heads=4", "model.num_kv_heads=2",
        "model.ffn_size=768"]
STEPS = 3


def _run(root: str, channel: str, cells: int) -> dict:
    from gyre_core import phases
    from gyre_core.config import load_config
    from gyre_core.run import RunDir

    cfg = load_config("smoke", WIDE + [
        f"run.out_root={root}/runs", f"run.name={channel}", f"lake.root={root}/lake",
        f"tracking.uri=sqlite:///{root}/mlflow.db", "elastic.enabled=true", "elastic.mode=real",
        f"elastic.cells={cells}", "elastic.policy=colocated", f"elastic.grad_channel={channel}",
        "elastic.micro_step_executions=1", "elastic.capacity=8", f"rl.steps={STEPS}",
        "eval.episodes=8", "eval.greedy_episodes=0", "eval.random_baseline=false", "eval.control=false"])
    run_dir = phases.prepare(cfg)
    phases.warm_start(run_dir)          # deterministic: both channels start from equal weights
    t0 = time.time()
    s = phases.elastic_rl(run_dir)
    from gyre_core.model import load_policy

    model, _ = load_policy(str(RunDir.open(run_dir).warm))
    grad_bytes = 4 * sum(p.numel() for p in model.parameters())
    sat = sum(v for k, v in s["micro_steps_by_cell"].items() if k != "0")
    return {"step_s": round(s["step_s"], 3), "elastic_s": round(time.time() - t0, 2),
            "relayed_mb": round(s["relayed_bytes"] / 2**20, 2), "grad_mb": round(grad_bytes / 2**20, 2),
            "reduce_s_mean": s["reduce_s_mean"], "optim_s_mean": s["optim_s_mean"],
            "satellite_micro_steps": sat, "grad_channel": s["grad_channel"]}


def bench_channel(cells: int = 2) -> dict:
    root = tempfile.mkdtemp(prefix="gyre-bench-channel-")
    try:
        collective = _run(root, "collective", cells)
        arrays = _run(root, "arrays", cells)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return {"preset": "smoke", "model": WIDE, "k": cells, "rl_steps": STEPS, "collective": collective,
            "arrays": arrays, "step_ratio_arrays_over_collective": round(arrays["step_s"] / collective["step_s"], 3)}


if __name__ == "__main__":
    import json
    import os

    os.environ.setdefault("GYRE_QUIET", "1")
    print(json.dumps(bench_channel(), indent=1))
