"""The phases of a run, one module each, as plain functions over a run directory (the flow composes them).

    run_dir = prepare(cfg)                          # prepare.py    model + tokenizer, checked before any rollout
    warm_start(run_dir); evaluate(run_dir, "before")  # supervised.py, held_out.py
    for step in range(cfg.rl.steps):                # rl_step.py
        rollout(run_dir, step); score(run_dir, step); process(run_dir, step)
        train(run_dir, step); publish(run_dir, step)
    # or, with elastic.enabled, all steps streamed across cell agents: elastic_rl(run_dir)   (rl_on_cells.py)
    evaluate(run_dir, "after"); control(run_dir); evaluate(run_dir, "control")
    export_policy(run_dir)                          # export.py     the final policy into MLflow

Phases take and return paths or small JSON-able dicts, never tensors, and are idempotent: each checks
its completion marker and returns what it produced before (`gyre_core.run`). What they share — the
policy bundle, environments, the engine at a version, the run's lake records, the trainer at a version,
the MLflow tracker — is in `run_objects`; every seed stream in `gyre_core.seeds`. `evaluate_checkpoint.py`
evaluates any checkpoint (a run's version, an HF directory, an MLflow URI) with the same loop.
"""
from .rl_on_cells import HarnessWork, elastic_rl
from .held_out import evaluate
from .export import export_policy, tag_run
from .prepare import prepare
from .rl_step import process, publish, rollout, score, train
from .supervised import control, warm_start

__all__ = ["prepare", "warm_start", "evaluate", "rollout", "score", "process", "train", "publish", "elastic_rl",
           "HarnessWork", "control", "export_policy", "tag_run"]
