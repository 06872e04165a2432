"""The `gyre` command.

    gyre train [--preset quick] [--set rl.lr=1e-4 ...] [--steps N] [--summary-json out.json]
    gyre sql "SELECT status, count(*) FROM executions GROUP BY 1" [--run RUN] [--format table|csv|json]
    gyre bench engine [--json]
    gyre bench processor [--json] [--quick]
    gyre presets

Config errors print one line naming the field and exit with code 2, before anything is written.
"""
from __future__ import annotations

import argparse
import json
import os
import sys


def _env_defaults() -> None:
    os.environ.setdefault("DO_NOT_TRACK", "1")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def cmd_train(args) -> int:
    from .config import ConfigError, load_config

    overrides = list(args.set or []) + ([f"rl.steps={args.steps}"] if args.steps is not None else [])
    try:
        cfg = load_config(args.preset, overrides)
        from .lake import Lake

        Lake(cfg.lake.root).check_writable()
    except (ConfigError, ValueError) as exc:
        print(f"gyre: config error: {exc}", file=sys.stderr)
        return 2
    if cfg.run.threads:
        import torch

        torch.set_num_threads(cfg.run.threads)
    from flows.train import train

    from .model import PolicyLoadError
    from .run import CheckpointError

    try:
        summary = train(preset=args.preset, overrides=list(args.set or []), steps=args.steps)
    except ConfigError as exc:
        print(f"gyre: config error: {exc}", file=sys.stderr)
        return 2
    except (CheckpointError, PolicyLoadError) as exc:
        print(f"gyre: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"gyre: interrupted; run the same command again to resume run '{cfg.run_id()}'", file=sys.stderr)
        return 130
    from .report import render_summary

    render_summary(summary)
    if args.summary_json:
        with open(args.summary_json, "w") as f:
            json.dump(summary, f, indent=1)
    return 0


def cmd_sql(args) -> int:
    from .config import load_config
    from .lake.sql import SqlRefused, run_sql

    root = args.lake or load_config(args.preset).lake.root
    try:
        print(run_sql(root, args.query, run_id=args.run, fmt=args.format))
    except SqlRefused as exc:
        print(f"gyre sql: {exc}", file=sys.stderr)
        return 2
    return 0


def cmd_bench(args) -> int:
    import contextlib

    with contextlib.redirect_stdout(sys.stderr):   # libraries' chatter must not break the JSON on stdout
        result = _run_bench(args)
    if result is None:
        print(f"gyre bench: unknown benchmark {args.what!r}", file=sys.stderr)
        return 2
    print(json.dumps(result, indent=None if args.json else 1))
    return 0


def _run_bench(args):
    if args.what == "engine":
        from bench.engine import bench_engine

        result = bench_engine()
    elif args.what == "processor":
        from bench.processor import bench_processor

        result = bench_processor(quick=args.quick)
    else:
        result = None
    return result


def main(argv: list[str] | None = None) -> int:
    _env_defaults()
    p = argparse.ArgumentParser(prog="gyre", description="Train LLM agents with online RL.")
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train", help="warm start, RL steps and evaluation, under Prefect")
    t.add_argument("--preset", default="default")
    t.add_argument("--set", action="append", metavar="KEY=VALUE", help="dotted override, e.g. rl.lr=1e-4")
    t.add_argument("--steps", type=int, default=None, help="number of RL steps (rl.steps)")
    t.add_argument("--summary-json", default=None, help="also write the final summary here")
    t.set_defaults(fn=cmd_train)
    q = sub.add_parser("sql", help="read-only SQL over the trajectory lake")
    q.add_argument("query")
    q.add_argument("--run", default=None, help="restrict the views to one run id")
    q.add_argument("--format", default="table", choices=("table", "csv", "json"))
    q.add_argument("--lake", default=None, help="lake root (default: the preset's lake.root)")
    q.add_argument("--preset", default="default")
    q.set_defaults(fn=cmd_sql)
    b = sub.add_parser("bench", help="benchmarks that print figures")
    b.add_argument("what", choices=("engine", "processor"))
    b.add_argument("--json", action="store_true", help="one line of JSON")
    b.add_argument("--quick", action="store_true", help="fewer repetitions and a smaller workload")
    b.set_defaults(fn=cmd_bench)
    ps = sub.add_parser("presets", help="list config presets")
    ps.set_defaults(fn=lambda a: print("\n".join(__import__("gyre_core.config", fromlist=["presets"]).presets())) or 0)
    args = p.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
