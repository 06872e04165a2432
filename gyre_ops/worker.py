"""`gyre worker`: a Prefect worker for one device set, started only against a pool and queues that exist.

    gyre worker --pool gyre --queue rollout --queue train --devices 0,1 [--name cell-0] [--limit N] [--dry-run]

1. checks that PREFECT_API_URL is set and answers, and that the pool and every queue exist there
   (`gyre_ops.pools.check_pool`); otherwise one line on stderr naming what is missing, exit code 2
   (1 when the API does not answer). Prefect's own `prefect worker start` would create a missing pool
   or queue silently — empty, unlimited, and invisible to whoever meant another name.
2. replaces this process (`os.execvpe`) with `python -m prefect worker start --pool P --work-queue Q...
   --name NAME --no-create-pool-if-not-found [--limit N]`, with CUDA_VISIBLE_DEVICES set from --devices,
   so the pid a process manager holds is the worker's own and SIGTERM reaches it directly.

A worker that polls a cell queue (`rollout` or `train`) runs one flow run at a time unless --limit says
otherwise: a device set serves one cell (`elastic.launch=prefect` starts each cell agent as a flow run).

The worker's name says where it runs and what it serves: `<name or host>:<queues>:cuda<devices>`
(e.g. `cell-0:rollout+train:cuda0,1`). A running worker cannot change its queues; capacity moves between
`rollout` and `train` through the queues' concurrency limits (`gyre_ops.cells.move_cell`), so a cell's
worker polls both. Flow runs it starts inherit GYRE_WORKER_QUEUES, GYRE_DEVICES and
PREFECT_FLOWS_HEARTBEAT_FREQUENCY (default 30 s: without heartbeats a killed run is never marked Crashed).
"""
from __future__ import annotations

import os
import re
import signal
import socket
import sys
from typing import Iterable, TextIO

_DEVICE = re.compile(r"^(\d+|GPU-[0-9A-Za-z-]+|MIG-[0-9A-Za-z/-]+)$")
NO_DEVICES = ("none", "cpu")
HEARTBEAT_S = "30"
CELL_QUEUES = ("rollout", "train")


class WorkerArgError(ValueError):
    """A bad --devices / --queue / --name value; the message is one line."""


def parse_devices(text: str | None) -> str | None:
    """`0,1` -> "0,1"; `none` or `cpu` -> "" (hide every GPU); None -> None (inherit the environment).
    Device ids are indices or GPU-/MIG- UUIDs, each at most once."""
    if text is None:
        return None
    text = text.strip()
    if text.lower() in NO_DEVICES:
        return ""
    ids = [d.strip() for d in text.split(",")]
    bad = [d for d in ids if not _DEVICE.match(d)]
    if bad or not ids:
        raise WorkerArgError(f"--devices {text!r}: expected device ids like 0,1 (or GPU-/MIG- UUIDs, or `none`), "
                             f"bad: {', '.join(repr(b) for b in bad) or 'empty'}")
    if len(set(ids)) != len(ids):
        raise WorkerArgError(f"--devices {text!r}: a device is listed twice")
    return ",".join(ids)


def worker_name(queues: Iterable[str], devices: str | None, name: str | None = None) -> str:
    """`<name or hostname>:<queue+queue>:<cudaD,D | cpu | inherited devices>`."""
    base = name or socket.gethostname().split(".")[0] or "gyre"
    if devices is None:
        inherited = os.environ.get("CUDA_VISIBLE_DEVICES")
        dev = "cpu" if inherited == "" else (f"cuda{inherited}" if inherited else "all-devices")
    else:
        dev = f"cuda{devices}" if devices else "cpu"
    full = f"{base}:{'+'.join(queues)}:{dev}"
    if "/" in full or "%" in full:
        raise WorkerArgError(f"worker name {full!r} may not contain '/' or '%'")
    return full


def default_limit(queues: Iterable[str]) -> int | None:
    """1 for a cell worker (it polls `rollout` or `train`: one cell per device set), else no limit."""
    return 1 if any(q in CELL_QUEUES for q in queues) else None


def worker_command(pool: str, queues: list[str], devices: str | None, name: str,
                   limit: int | None = None) -> tuple[list[str], dict[str, str]]:
    """The argv and environment `gyre worker` execs (devices already parsed by `parse_devices`);
    `limit`: the most flow runs it runs at once (None: Prefect's default, no limit)."""
    argv = [sys.executable, "-m", "prefect", "worker", "start", "--pool", pool]
    for q in queues:
        argv += ["--work-queue", q]
    argv += ["--name", name, "--no-create-pool-if-not-found", "--install-policy", "never"]
    if limit is not None:
        argv += ["--limit", str(limit)]
    env = dict(os.environ)
    from .pools import api_url

    url = api_url()
    if url:
        env["PREFECT_API_URL"] = url          # the server the check ran against, whatever profile set it
    if devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = devices
    env["GYRE_WORKER_QUEUES"] = ",".join(queues)
    env["GYRE_DEVICES"] = devices if devices is not None else env.get("CUDA_VISIBLE_DEVICES", "")
    env.setdefault("PREFECT_FLOWS_HEARTBEAT_FREQUENCY", HEARTBEAT_S)
    return argv, env


def run_worker(pool: str, queues: list[str], devices: str | None = None, name: str | None = None,
               dry_run: bool = False, out: TextIO | None = None, err: TextIO | None = None,
               limit: int | None = None) -> int:
    """Check, then exec the worker (never returns on success unless `dry_run`: then print the command
    and the device environment, and return 0). Returns 2 for a bad argument or a missing pool/queue,
    1 when the API does not answer. `limit` None: `default_limit(queues)`."""
    from .pools import ApiNotConfigured, ApiUnreachable, check_pool

    out, err = out or sys.stdout, err or sys.stderr
    queues = list(dict.fromkeys(queues or ["default"]))
    try:
        devs = parse_devices(devices)
        full_name = worker_name(queues, devs, name)
        if limit is not None and limit < 1:
            raise WorkerArgError(f"--limit {limit}: a worker must be able to run at least one flow run")
    except WorkerArgError as exc:
        print(f"gyre worker: {exc}", file=err)
        return 2
    try:
        problem = check_pool(None, pool, queues)
    except ApiUnreachable as exc:
        print(f"gyre worker: {exc}", file=err)
        return 2 if isinstance(exc, ApiNotConfigured) else 1
    if problem:
        print(f"gyre worker: {problem}", file=err)
        return 2
    argv, env = worker_command(pool, queues, devs, full_name, limit if limit is not None else default_limit(queues))
    if dry_run:
        shown = {k: env[k] for k in ("PREFECT_API_URL", "CUDA_VISIBLE_DEVICES", "GYRE_WORKER_QUEUES") if k in env}
        print(" ".join(f"{k}={v}" for k, v in shown.items()), *argv, file=out)
        return 0
    print(f"gyre worker: starting {full_name!r} on pool {pool!r}, queue(s) {', '.join(queues)}", file=err)
    out.flush()
    err.flush()
    # A job started with `&` by a non-interactive shell (worker-gpu.sh, nohup) inherits SIGINT ignored;
    # Prefect's worker turns SIGTERM into SIGINT to itself, which would then be lost and the worker would
    # never stop. Exec with the default disposition so SIGTERM stops it.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.execvpe(argv[0], argv, env)
    return 0  # not reached
