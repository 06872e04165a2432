"""RL ablations from one shared warm start: each variant runs N RL steps and a paired held-out eval.

    .venv/bin/python bench/experiments/rl_ablation.py --preset default --steps 24 --eval-episodes 500 \
        --variant base: --variant lr5e-4:rl.lr=5e-4 --variant std:rl.advantage_norm=std,rl.lr=5e-4

The warm start (and the "before" evaluation) is computed once per base config in a run directory
named for the config hash; every variant copies it, applies its overrides (which must not touch
what the warm start depends on), and continues with the ordinary steps of `gyre_core.phases`. Rows
(setting, before, after, paired interval, minutes) are printed and appended to `--out` as JSON lines.
Run several invocations side by side (one thread each) to use both cores.
"""
from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import re
import shutil
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from gyre_core import phases  # noqa: E402
from gyre_core.config import load_config  # noqa: E402
from gyre_core.evaluation import EvalResult, paired  # noqa: E402
from gyre_core.run import DEMOS_PART, RunDir, eval_marker, step_marker  # noqa: E402

# what a variant may change: everything downstream of the warm start and the "before" evaluation
VARIANT_SECTIONS = ("rl.", "rollout.", "processor.")


def _base_run(preset: str, overrides: list[str], out_root: Path) -> RunDir:
    full = load_config(preset, overrides)
    probe = full.model_dump(mode="json")
    for k in ("rl", "processor", "eval"):   # what variants may change, and the eval (same seeds)
        probe.pop(k)
    probe["model"].pop("device")            # where the model computes is not what it computes
    probe["eval_episodes"] = full.eval.episodes
    key = hashlib.sha1(json.dumps(probe, sort_keys=True).encode()).hexdigest()[:10]
    out_root.mkdir(parents=True, exist_ok=True)
    with open(out_root / f"ablation-base-{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)    # invocations started side by side compute the base once
        return _base_run_locked(preset, overrides, out_root, key)


def _base_run_locked(preset: str, overrides: list[str], out_root: Path, key: str) -> RunDir:
    if (out_root / f"ablation-base-{key}" / "markers" / "eval_before.json").exists():
        return RunDir.open(out_root / f"ablation-base-{key}")   # done (perhaps by an older schema)
    cfg = load_config(preset, overrides + [f"run.name=ablation-base-{key}", f"run.out_root={out_root}",
                                           f"lake.root={out_root}/lake",
                                           f"tracking.uri=sqlite:///{out_root}/mlflow-base.db"])
    run = RunDir.open(phases.prepare(cfg))
    phases.warm_start(str(run.path))
    phases.evaluate(str(run.path), "before")
    return run


def _variant_run(base: RunDir, name: str, preset: str, overrides: list[str], extra: list[str]) -> RunDir:
    for o in extra:
        if not o.startswith(VARIANT_SECTIONS):
            raise SystemExit(f"variant override {o!r} would change the warm start; allowed: {VARIANT_SECTIONS}")
    path = base.path.parent / f"ablation-{name}"
    if path.exists():
        shutil.rmtree(path)
    shutil.copytree(base.path, path, ignore=shutil.ignore_patterns("batches", "ckpt", "v[1-9]*"))
    for sub in ("batches", "ckpt"):
        (path / sub).mkdir(exist_ok=True)
    for m in (path / "markers").glob("*.json"):
        if m.stem not in ("prepare", "warm_start", eval_marker("before")):
            m.unlink()
    root = base.path.parent
    cfg = load_config(preset, overrides + extra + [f"run.name=ablation-{name}", f"run.out_root={root}",
                                                   f"lake.root={root}/lake",
                                                   f"tracking.uri=sqlite:///{path}/mlflow.db"])
    (path / "config.yaml").write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
    _copy_part(base, cfg.run_id(), DEMOS_PART)   # the control trains on the warm start's demonstrations too
    return RunDir.open(path)


def _copy_part(base: RunDir, run_id: str, part: str) -> None:
    from gyre_core.lake import Lake

    lake = Lake(base.cfg.lake.root)
    lake.write_part(run_id, part, {t: lake.read(t, base.run_id, part) for t in ("executions", "calls")})


def run_control(base: RunDir, name: str, preset: str, overrides: list[str], minutes: float) -> dict:
    """The supervised-only control: behaviour cloning from the warm start for `minutes`."""
    run = _variant_run(base, name, preset, overrides, [])
    d, t0 = str(run.path), time.time()
    c = phases.control(d, budget_s=60 * minutes)
    return _row(base, name, [f"control {minutes} min"], phases.evaluate(d, "control"), time.time() - t0,
                sft_steps=c["sft_steps"])


def _row(base: RunDir, name: str, overrides: list[str], after: dict, seconds: float, **extra) -> dict:
    """One table row: the variant's sampled success against the shared "before", paired by seed."""
    b, a = (EvalResult.of(x["sampled"]) for x in (base.done(eval_marker("before")), after))
    diff = paired(b, a)
    return {"setting": name, "overrides": overrides, "before": b.success, "after": a.success,
            "diff": diff.mean, "ci95_low": diff.ci95_low, "ci95_high": diff.ci95_high, "episodes": b.episodes,
            "rl_minutes": seconds / 60, **extra}


def run_variant(base: RunDir, name: str, preset: str, overrides: list[str], extra: list[str]) -> dict:
    run = _variant_run(base, name, preset, overrides, extra)
    d, t0 = str(run.path), time.time()
    curve = []
    for step in range(run.cfg.rl.steps):
        phases.rollout(d, step)
        phases.score(d, step)
        phases.process(d, step)
        phases.train(d, step)
        phases.publish(d, step)
        ro, tr = run.done(step_marker("rollout", step)), run.done(step_marker("train", step))
        backtracks = tr.get("kl_backtracks", 0)
        curve.append({"step": step, "success": ro["success"], "partial": ro["partial"], "kl": tr["kl"],
                      "entropy": tr["entropy"], "kl_backtracks": backtracks})
        halved = f" (lr halved {backtracks}×)" if backtracks else ""
        print(f"  [{name}] step {step}: rollout success {ro['success']:.3f} partial {ro['partial']:.3f} "
              f"kl {tr['kl']:.4f}{halved} entropy {tr['entropy']:.3f}", flush=True)
    rl_s = time.time() - t0
    return _row(base, name, extra, phases.evaluate(d, "after"), rl_s, rl_steps=run.cfg.rl.steps, curve=curve)


def print_table(path: str) -> None:
    print("| setting | before | after | paired diff [95% CI] | minutes |\n|---|---|---|---|---|")
    for line in Path(path).read_text().splitlines():
        r = json.loads(line)
        what = ", ".join(r["overrides"]) or "preset as is"
        if r.get("base_overrides"):
            what += f" (base: {', '.join(r['base_overrides'])})"
        steps_ = f"{r['rl_steps']} RL steps, " if "rl_steps" in r else f"{r.get('sft_steps')} SFT steps, "
        print(f"| {r['setting']}: {what} | {100 * r['before']:.1f}% | {100 * r['after']:.1f}% | "
              f"{100 * r['diff']:+.1f} [{100 * r['ci95_low']:+.1f}, {100 * r['ci95_high']:+.1f}] | "
              f"{steps_}{r['rl_minutes']:.1f} |")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="default")
    ap.add_argument("--set", dest="overrides", action="append", default=[], help="base override (warm start too)")
    ap.add_argument("--steps", type=int, default=None, help="RL steps per variant (default: the preset's)")
    ap.add_argument("--eval-episodes", type=int, default=500)
    ap.add_argument("--variant", action="append", default=[],
                    help="NAME:override,override (empty: base); NAME:control=MINUTES runs the supervised control")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out-root", default="data/ablation")
    ap.add_argument("--out", default="data/ablation/rows.jsonl")
    ap.add_argument("--table", action="store_true", help="print the rows in --out as a markdown table and exit")
    args = ap.parse_args(argv)
    if args.table:
        print_table(args.out)
        return

    import torch

    torch.set_num_threads(args.threads)
    overrides = args.overrides + [f"eval.episodes={args.eval_episodes}", "eval.greedy_episodes=0"]
    if args.steps is not None:
        overrides.append(f"rl.steps={args.steps}")
    out_root = Path(args.out_root).resolve()
    out_root.mkdir(parents=True, exist_ok=True)
    base = _base_run(args.preset, overrides, out_root)
    b = base.done(eval_marker("before"))
    print(f"warm start: sampled {b['sampled']['success']:.3f}"
          + (f", random {b['random']['success']:.3f}" if "random" in b else "")
          + f" ({base.done('warm_start')['wall_s']:.0f} s)", flush=True)
    for spec in args.variant or ["base:"]:
        name, _, rest = spec.partition(":")
        if rest.startswith("control="):
            row = run_control(base, name, args.preset, overrides, float(rest.split("=", 1)[1]))
        else:
            extra = [o for o in re.split(r",(?=[a-z_]+\.[a-z_.]+=)", rest) if o]   # commas inside [a,b] stay
            row = run_variant(base, name, args.preset, overrides, extra)
        row["base_overrides"] = args.overrides
        row["episodes"] = args.eval_episodes
        print(f"{name:>20}: {row['before']:.3f} -> {row['after']:.3f}  diff {row['diff']:+.3f} "
              f"[{row['ci95_low']:+.3f}, {row['ci95_high']:+.3f}]  {row['rl_minutes']:.1f} min", flush=True)
        with open(args.out, "a") as fh:
            fh.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
