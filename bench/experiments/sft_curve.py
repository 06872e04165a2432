"""How far behaviour cloning goes: held-out success of the supervised policy at checkpoints.

    .venv/bin/python bench/experiments/sft_curve.py --preset default --name cos --checkpoints 100,200,400,800 \
        --set warmstart.episodes=2000 --set warmstart.steps=800 --set warmstart.lr_final=1e-4

One warm start (`warmstart.steps` supervised steps on `warmstart.episodes` expert demonstrations, with
the preset's learning-rate schedule); at each checkpoint the current weights are evaluated on the
same held-out seeds with the same sampling stream, so checkpoints are paired with each other. Prints
success per checkpoint and the paired difference to the previous one; appends JSON lines to `--out`.
Where the curve flattens is the supervised plateau that RL has to beat (issue 4).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from gyre_core import phases  # noqa: E402
from gyre_core.config import DEMO_SEED_OFFSET, load_config  # noqa: E402
from gyre_core.evaluation import EvalResult, paired  # noqa: E402
from gyre_core.run import RunDir  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="default")
    ap.add_argument("--name", required=True)
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--checkpoints", default="100,200,400")
    ap.add_argument("--eval-episodes", type=int, default=500)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out-root", default="data/ablation")
    ap.add_argument("--out", default="data/ablation/sft_curve.jsonl")
    args = ap.parse_args(argv)

    import torch

    from gyre_core.model import load_policy
    from gyre_core.trainer.publish import publish_weights

    torch.set_num_threads(args.threads)
    out_root = Path(args.out_root).resolve()
    out_root.mkdir(parents=True, exist_ok=True)
    marks = sorted(int(c) for c in args.checkpoints.split(","))
    cfg = load_config(args.preset, args.overrides + [
        f"eval.episodes={args.eval_episodes}", "eval.greedy_episodes=0", "eval.random_baseline=false",
        f"warmstart.steps={max(marks)}", f"run.name=sft-{args.name}", f"run.out_root={out_root}",
        f"lake.root={out_root}/lake", f"tracking.uri=sqlite:///{out_root}/mlflow-sft.db"])
    run = RunDir.open(phases.prepare(cfg))
    d, t0 = str(run.path), time.time()
    seeds = [cfg.env.train_seed_start + DEMO_SEED_OFFSET + i for i in range(cfg.warmstart.episodes)]
    records = phases.supervised.demonstrations(run, seeds, "demo", "demonstrations")
    good = [r for r in records if r.success]
    model, tok = load_policy(str(run.policy0))
    rows: list[dict] = []
    train_s = [0.0]
    last = [time.time()]

    def on_step(k: int, trainer) -> None:
        if k not in marks:
            return
        train_s[0] += time.time() - last[0]
        publish_weights(trainer.state_dict(), run.weights_uri(k))
        res = phases.evaluate(d, f"sft{k}", version=k)
        cur = EvalResult.of(res["sampled"])
        row = {"name": args.name, "overrides": args.overrides, "sft_steps": k, "success": cur.success,
               "partial": cur.partial, "episodes": cur.episodes, "train_minutes": train_s[0] / 60,
               "lr": phases.supervised.supervised_lr(cfg.warmstart, k - 1, cfg.warmstart.steps)}
        if rows:
            prev = EvalResult.of(rows[-1].pop("_res"))
            diff = paired(prev, cur)
            row.update(diff_prev=diff.mean, ci95_low=diff.ci95_low, ci95_high=diff.ci95_high)
        print(f"[{args.name}] {k:5d} SFT steps ({row['train_minutes']:.1f} min training): success "
              f"{cur.success:.3f}" + (f"  vs previous {row['diff_prev']:+.3f} [{row['ci95_low']:+.3f}, "
                                     f"{row['ci95_high']:+.3f}]" if "diff_prev" in row else ""), flush=True)
        with open(args.out, "a") as fh:
            fh.write(json.dumps(row) + "\n")
        row["_res"] = res["sampled"]
        rows.append(row)
        last[0] = time.time()

    phases.supervised.behaviour_cloning(run, model, tok, good, "supervised steps", n_steps=cfg.warmstart.steps,
                                        on_step=on_step)
    print(f"[{args.name}] done in {(time.time() - t0) / 60:.1f} min", flush=True)


if __name__ == "__main__":
    main()
