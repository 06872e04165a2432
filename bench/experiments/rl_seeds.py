"""RL vs before vs the supervised control across independent training runs of one preset.

    gyre train --preset default --summary-json a.json                       # run 1 (run.seed 0)
    gyre train --preset default --set run.seed=1 --set env.train_seed_start=100000 --summary-json b.json
    .venv/bin/python bench/experiments/rl_seeds.py data/runs/default-s0 data/runs/default-s1

Each run differs in its model initialisation, sampling, demonstrations and RL tasks, and is evaluated on
the same held-out seeds. Prints one row per run (before, after, control, RL − before and RL − control with
their paired 95% intervals) and a pooled row: per held-out seed, each policy's outcome averaged over the
runs, then the same paired interval over seeds. The pooled interval holds the evaluation's sampling and
seed noise for these runs; the spread between the runs' own differences (printed beside) is the part
that another training run would add, which two or three runs can only hint at.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from gyre_core.evaluation import paired_binary, paired_difference  # noqa: E402
from gyre_core.run import RunDir, eval_marker  # noqa: E402


def _outcomes(run: RunDir, label: str, metric: str) -> tuple[list[int], list[float]] | None:
    m = run.done(eval_marker(label))
    if m is None:
        return None
    key = "successes" if metric == "success" else "partials"
    return m["sampled"]["seeds"], [float(x) for x in m["sampled"][key]]


# what a control borrowed from another run must share with this one: the warm start and the evaluation
_WARM_START_PREFIXES = ("run.seed", "env.", "model.", "harness.", "warmstart.", "eval.episodes")


def load_run(run_dir: Path, metric: str, control_from: Path | None = None) -> dict:
    """A finished run's per-seed outcomes before RL, after RL and of the control (None if it had none).

    `control_from`: take the control from that run instead — another RL setting from the same warm start
    (e.g. an ablation row, which has none of its own); their configs must agree on the warm start."""
    run = RunDir.open(run_dir)
    got = {name: _outcomes(run, name, metric) for name in ("before", "after", "control")}
    if control_from is not None:
        mine, theirs = _flat_config(run_dir), _flat_config(control_from)
        differ = sorted(k for k in set(mine) | set(theirs) if k.startswith(_WARM_START_PREFIXES)
                        and mine.get(k) != theirs.get(k))
        if differ:
            raise SystemExit(f"{run_dir}: the control's run {control_from} has another warm start "
                             f"({', '.join(differ)})")
        got["control"] = _outcomes(RunDir.open(control_from), "control", metric)
        if got["control"] is None:
            raise SystemExit(f"{control_from}: no control evaluation")
    if got["before"] is None or got["after"] is None:
        raise SystemExit(f"{run_dir}: no before/after evaluation (is the run finished?)")
    seeds = got["before"][0]
    for name, g in got.items():
        if g is not None and g[0] != seeds:
            raise SystemExit(f"{run_dir}: the {name} evaluation used other seeds than the one before RL")
    return {"run": run_dir.name, "seeds": seeds, **{k: (g[1] if g else None) for k, g in got.items()}}


# what may differ between runs of one experiment (besides paths): the training randomness
_RUN_KEYS = {"run.name", "run.seed", "run.out_root", "env.train_seed_start", "lake.root", "tracking.uri"}


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def _flat_config(run_dir: Path) -> dict:
    return _flat(yaml.safe_load((run_dir / "config.yaml").read_text()) or {})


def config_differences(run_dirs: list[Path]) -> list[str]:
    """Config keys (other than seeds, names and paths) on which the runs disagree."""
    cfgs = [_flat_config(d) for d in run_dirs]
    keys = set().union(*cfgs) - _RUN_KEYS
    return sorted(k for k in keys if len({json.dumps(c.get(k), sort_keys=True) for c in cfgs}) > 1)


def _interval(first: list[float], second: list[float]) -> dict:
    """The paired interval: Agresti–Min's for one run's 0/1 outcomes, the plain one for seeds averaged over runs."""
    if all(x in (0, 1) for x in (*first, *second)):
        return paired_binary([int(x) for x in first], [int(x) for x in second]).as_summary()
    return paired_difference(first, second).as_summary()


def compare_runs(runs: list[dict]) -> dict:
    """Per-run rows and the pooled row (outcomes averaged per seed over the runs)."""
    seeds = runs[0]["seeds"]
    if any(r["seeds"] != seeds for r in runs):
        raise SystemExit("the runs were evaluated on different held-out seeds; pooling needs the same")
    rows = []
    for r in runs:
        row = {"run": r["run"], "before": statistics.fmean(r["before"]), "after": statistics.fmean(r["after"]),
               "rl": _interval(r["before"], r["after"])}
        if r["control"] is not None:
            row["control"] = statistics.fmean(r["control"])
            row["rl_vs_control"] = _interval(r["control"], r["after"])
        rows.append(row)

    def mean_per_seed(key: str) -> list[float] | None:
        if any(r[key] is None for r in runs):
            return None
        return [statistics.fmean(xs) for xs in zip(*(r[key] for r in runs))]

    before, after, control = mean_per_seed("before"), mean_per_seed("after"), mean_per_seed("control")
    pooled = {"run": f"pooled ({len(runs)} runs)", "before": statistics.fmean(before),
              "after": statistics.fmean(after), "rl": _interval(before, after)}
    if control is not None:
        pooled["control"] = statistics.fmean(control)
        pooled["rl_vs_control"] = _interval(control, after)
    spread = {}
    if len(runs) > 1:
        spread["rl"] = statistics.stdev(row["rl"]["diff"] for row in rows)
        if control is not None:
            spread["rl_vs_control"] = statistics.stdev(row["rl_vs_control"]["diff"] for row in rows)
    return {"seeds": len(seeds), "runs": rows, "pooled": pooled, "between_run_std": spread}


def _fmt(row: dict, scale: float, digits: int) -> str:
    def v(x: float, sign: str = "") -> str:
        return f"{x * scale:{sign}.{digits}f}"

    def iv(d: dict | None) -> str:
        return "—" if d is None else f"{v(d['diff'], '+')} [{v(d['ci95_low'], '+')}, {v(d['ci95_high'], '+')}]"
    ctrl = v(row["control"]) if "control" in row else "—"
    return (f"| {row['run']} | {v(row['before'])} | {v(row['after'])} | {ctrl} | "
            f"{iv(row['rl'])} | {iv(row.get('rl_vs_control'))} |")


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("run_dirs", nargs="+", type=Path, help="finished run directories (data/runs/<run id>)")
    p.add_argument("--metric", choices=("success", "partial"), default="success")
    p.add_argument("--json", action="store_true", help="print the figures as JSON instead of a table")
    p.add_argument("--control-from", nargs="+", default=None, metavar="DIR",
                   help="one per run directory: take that run's control from DIR instead ('-': its own)")
    args = p.parse_args(argv)
    if len({d.resolve() for d in args.run_dirs}) < len(args.run_dirs):
        raise SystemExit("the same run directory was given twice; pooling needs independent runs")
    controls = args.control_from or ["-"] * len(args.run_dirs)
    if len(controls) != len(args.run_dirs):
        raise SystemExit(f"--control-from: {len(controls)} given for {len(args.run_dirs)} run directories")
    out = compare_runs([load_run(d, args.metric, None if c == "-" else Path(c))
                        for d, c in zip(args.run_dirs, controls)])
    out["config_differences"] = config_differences(args.run_dirs)
    if args.json:
        print(json.dumps(out, indent=1))
        return out
    scale, digits = (100.0, 1) if args.metric == "success" else (1.0, 3)
    what = "success (%; differences in points)" if args.metric == "success" else "partial score"
    print(f"{what} on {out['seeds']} held-out seeds, paired 95% intervals\n")
    print("| run | before | after RL | control | RL − before | RL − control |")
    print("|---|---:|---:|---:|---:|---:|")
    for row in out["runs"] + [out["pooled"]]:
        print(_fmt(row, scale, digits))
    if out["config_differences"]:
        print(f"\nnote: the runs' configs differ beyond seeds: {', '.join(out['config_differences'])}")
    for k, v in out["between_run_std"].items():
        print(f"\nbetween-run std of {k}: {v * scale:.{digits}f}")
    return out


if __name__ == "__main__":
    main()
