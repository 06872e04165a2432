"""`gyre up` / `gyre down`: a local stack a team would run — a real Prefect server and an MLflow server on
127.0.0.1, the work pool and its queues, every deployment of prefect.yaml, and the workers.

    gyre up                      # prints the Prefect UI and MLflow URLs
    gyre up                      # again, after a worker or server died: restarts exactly those
    gyre down                    # stops exactly what `gyre up` started (and what those started)

State lives in `<home>/stack.json` (default home `data/stack/`): the pid of every process started, the
ports, and the URLs. Each process runs in its own session with its log in `<home>/logs/`. Flow runs
started by the workers send heartbeats (PREFECT_FLOWS_HEARTBEAT_FREQUENCY), and an automation marks a
flow run Crashed when they stop: without both, a self-hosted server never notices a killed run.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent          # the project root: prefect.yaml, flows/, tasks/
ZOMBIE_AUTOMATION = "gyre: crash zombie flow runs"
HEARTBEAT_S = 30                                       # Prefect emits heartbeats only at >= 30 s


class StackError(RuntimeError):
    """`gyre up` cannot start (a port is taken, a server did not come up, ...). The message says which."""


@dataclass
class StackSpec:
    home: Path = field(default_factory=lambda: ROOT / "data" / "stack")
    host: str = "127.0.0.1"
    prefect_port: int = 4200
    mlflow_port: int = 5000
    pool: str = "gyre"
    queue: str = "default"                             # where flow runs (train, evaluate, maintenance) go
    cpu_workers: int = 1
    device_sets: list[str] = field(default_factory=list)   # e.g. ["0,1", "2,3"]: one cell worker each
    deploy: bool = True
    zombie_after_s: int = 3 * HEARTBEAT_S
    worker_poll_s: float = 10.0                        # how often a worker asks for flow runs (Prefect's default)
    scheduler_loop_s: float = 60.0                     # how often the server schedules deployments' runs

    @property
    def api_url(self) -> str:
        return f"http://{self.host}:{self.prefect_port}/api"

    @property
    def mlflow_url(self) -> str:
        return f"http://{self.host}:{self.mlflow_port}"


def _state_file(home: Path) -> Path:
    return Path(home) / "stack.json"


def read_state(home: Path) -> dict | None:
    f = _state_file(home)
    return json.loads(f.read_text()) if f.exists() else None


def _alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _port_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def listening(host: str, port: int) -> bool:
    """Whether something accepts connections on host:port."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.5)
        return s.connect_ex((host, port)) == 0


def _wait_http(url: str, timeout_s: float, proc: subprocess.Popen, what: str, log: Path) -> None:
    t0 = time.time()
    while time.time() - t0 < timeout_s:
        if proc.poll() is not None:
            raise StackError(f"{what} exited with code {proc.returncode} while starting; see {log}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise StackError(f"{what} did not answer {url} within {timeout_s:.0f} s; see {log}")


class _Launcher:
    """Starts processes in their own sessions, logging to files, and remembers them for `down`."""

    def __init__(self, home: Path, env: dict[str, str]):
        self.home, self.env, self.procs = home, env, {}
        (home / "logs").mkdir(parents=True, exist_ok=True)

    def start(self, name: str, cmd: list[str], extra_env: dict[str, str] | None = None) -> subprocess.Popen:
        log = self.home / "logs" / f"{name}.log"
        out = open(log, "ab")
        proc = subprocess.Popen(cmd, cwd=ROOT, env={**self.env, **(extra_env or {})}, stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        out.close()
        self.procs[name] = {"pid": proc.pid, "cmd": cmd, "log": str(log)}
        return proc


def _bin(name: str) -> str:
    """An executable of this environment (the venv's prefect, not whatever is on PATH)."""
    here = Path(sys.executable).parent / name
    return str(here) if here.exists() else name


def up(spec: StackSpec, say=print) -> dict:
    """Start the stack; returns its state (also written to `<home>/stack.json`)."""
    home = Path(spec.home).resolve()
    state = read_state(home)
    if state:
        dead = [name for name, p in state["processes"].items() if not _alive(p["pid"])]
        if not dead:
            raise StackError(f"a stack is already up (state in {_state_file(home)}); run `gyre down` first")
        if len(dead) < len(state["processes"]):
            return _revive(home, state, dead, say)
    for what, port in (("Prefect", spec.prefect_port), ("MLflow", spec.mlflow_port)):
        if not _port_free(spec.host, port):
            raise StackError(f"port {spec.host}:{port} for the {what} server is taken; choose another "
                             f"(--{what.lower()}-port) or stop what listens there")
    home.mkdir(parents=True, exist_ok=True)
    env = _stack_env(spec, home)
    launch = _Launcher(home, env)
    started = time.time()
    try:
        say(f"starting the Prefect server on {spec.api_url} ...")
        server = launch.start("prefect-server", [_bin("prefect"), "server", "start", "--host", spec.host,
                                                 "--port", str(spec.prefect_port)])
        say(f"starting the MLflow server on {spec.mlflow_url} ...")
        (home / "mlflow" / "artifacts").mkdir(parents=True, exist_ok=True)
        mlflow = launch.start("mlflow-server", [
            sys.executable, "-m", "mlflow", "server", "--host", spec.host, "--port", str(spec.mlflow_port),
            "--workers", "1", "--backend-store-uri", f"sqlite:///{home / 'mlflow' / 'mlflow.db'}",
            "--artifacts-destination", str(home / "mlflow" / "artifacts")])
        _wait_http(f"{spec.api_url}/health", 120, server, "the Prefect server", home / "logs" / "prefect-server.log")
        _wait_http(f"{spec.mlflow_url}/health", 120, mlflow, "the MLflow server", home / "logs" / "mlflow-server.log")
        from prefect.settings import PREFECT_API_URL, temporary_settings

        with temporary_settings(updates={PREFECT_API_URL: spec.api_url}):
            _prepare_server(spec, say)
        if spec.deploy:
            say("deploying everything in prefect.yaml ...")
            out = subprocess.run([_bin("prefect"), "--no-prompt", "deploy", "--all"], cwd=ROOT, env=env,
                                 capture_output=True, text=True)
            (home / "logs" / "deploy.log").write_text(out.stdout + out.stderr)
            if out.returncode != 0:
                raise StackError(f"`prefect deploy --all` failed; see {home / 'logs' / 'deploy.log'}")
        for i in range(spec.cpu_workers):
            launch.start(f"worker-cpu-{i}", [_bin("gyre"), "worker", "--pool", spec.pool, "--queue", spec.queue,
                                             "--name", f"cpu-{i}"])
        for i, devices in enumerate(spec.device_sets):   # one cell agent each (elastic.launch=prefect), limit 1
            launch.start(f"worker-cell-{i}", [_bin("gyre"), "worker", "--pool", spec.pool, "--queue", "rollout",
                                              "--queue", "train", "--devices", devices, "--name", f"cell-{i}"])
    except BaseException:
        _stop(launch.procs)
        raise
    state = {"spec": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(spec).items()},
             "processes": launch.procs, "api_url": spec.api_url, "ui_url": spec.api_url[: -len("/api")],
             "mlflow_url": spec.mlflow_url, "started_at": started, "start_s": round(time.time() - started, 1)}
    _state_file(home).write_text(json.dumps(state, indent=1))
    return state


def _stack_env(spec: StackSpec, home: Path) -> dict[str, str]:
    """The environment of every process of the stack. The caller's Prefect settings and torch.distributed
    rendezvous are its own, not the stack's."""
    dist = {"MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"}
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_") and k not in dist}
    env.update({
        "PREFECT_HOME": str(home / "prefect"), "PREFECT_API_URL": spec.api_url,
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "DO_NOT_TRACK": "1",
        "PREFECT_FLOWS_HEARTBEAT_FREQUENCY": str(HEARTBEAT_S),
        "PREFECT_WORKER_QUERY_SECONDS": f"{spec.worker_poll_s:g}",
        "PREFECT_SERVER_SERVICES_SCHEDULER_LOOP_SECONDS": f"{spec.scheduler_loop_s:g}",
        "MLFLOW_TRACKING_URI": spec.mlflow_url, "GYRE_HOME": str(ROOT),
    })
    return env


def _revive(home: Path, state: dict, dead: list[str], say) -> dict:
    """Restart the processes of a running stack that died (a killed worker, a crashed server) with the
    commands they were started with; the rest keep running. Returns the updated state."""
    fields = {**state["spec"], "home": Path(state["spec"]["home"])}
    spec = StackSpec(**fields)
    launch = _Launcher(home, _stack_env(spec, home))
    for name in dead:
        say(f"restarting {name} (pid {state['processes'][name]['pid']} is gone) ...")
        proc = launch.start(name, state["processes"][name]["cmd"])
        if name == "prefect-server":
            _wait_http(f"{spec.api_url}/health", 120, proc, "the Prefect server", home / "logs" / f"{name}.log")
        elif name == "mlflow-server":
            _wait_http(f"{spec.mlflow_url}/health", 120, proc, "the MLflow server", home / "logs" / f"{name}.log")
    state["processes"].update(launch.procs)
    state["revived"] = state.get("revived", []) + [{"at": time.time(), "processes": dead}]
    _state_file(home).write_text(json.dumps(state, indent=1))
    return state


def _prepare_server(spec: StackSpec, say) -> None:
    """The pool and its queues, and the zombie-run automation (both idempotent)."""
    from gyre_ops.pools import ensure_pools

    say(f"creating work pool {spec.pool!r} and its queues ...")
    ensure_pools()
    say("creating the automation that marks silent flow runs Crashed ...")
    ensure_zombie_automation(spec.zombie_after_s)


def ensure_zombie_automation(after_s: int) -> None:
    """A flow run whose heartbeats stop for `after_s` (and that did not end) is marked Crashed."""
    from prefect.automations import Automation
    from prefect.client.schemas.objects import StateType
    from prefect.events.actions import ChangeFlowRunState
    from prefect.events.schemas.automations import EventTrigger, Posture
    from prefect.events.schemas.events import ResourceSpecification

    try:
        Automation.read(name=ZOMBIE_AUTOMATION)
        return
    except ValueError:
        pass
    ended = {f"prefect.flow-run.{s}" for s in ("Completed", "Failed", "Cancelled", "Crashed")}
    Automation(
        name=ZOMBIE_AUTOMATION,
        description="Gyre: mark a flow run Crashed when its heartbeats stop (a killed worker or host).",
        trigger=EventTrigger(
            after={"prefect.flow-run.heartbeat"}, expect={"prefect.flow-run.heartbeat", *ended},
            match=ResourceSpecification({"prefect.resource.id": ["prefect.flow-run.*"]}),
            for_each={"prefect.resource.id"}, posture=Posture.Proactive, threshold=1,
            within=timedelta(seconds=after_s)),
        actions=[ChangeFlowRunState(state=StateType.CRASHED,
                                    message=f"no heartbeat for {after_s} s: the process running it is gone")],
    ).create()


def down(home: Path | None = None, say=print) -> dict:
    """Stop every process `up` started, and their children; returns what was stopped."""
    home = Path(home or StackSpec().home).resolve()
    state = read_state(home)
    if state is None:
        say(f"no stack state in {home}: nothing to stop")
        return {}
    stopped = _stop(state["processes"])
    _state_file(home).unlink()
    for name, info in stopped.items():
        say(f"stopped {name} (pid {info['pid']}{', and ' + str(info['children']) + ' children' if info['children'] else ''})")
    return stopped


def _stop(procs: dict[str, dict], grace_s: float = 20.0) -> dict[str, dict]:
    """SIGTERM each process tree (children first seen now: flow runs a worker started in their own
    sessions included), wait, then SIGKILL what is left."""
    import psutil

    trees, out = {}, {}
    for name, info in procs.items():
        try:
            p = psutil.Process(info["pid"])
            trees[name] = [p] + p.children(recursive=True)
        except psutil.NoSuchProcess:
            trees[name] = []
        out[name] = {"pid": info["pid"], "children": max(0, len(trees[name]) - 1)}
    everyone = [p for tree in trees.values() for p in tree]
    for p in everyone:
        try:
            p.send_signal(signal.SIGTERM)
        except psutil.NoSuchProcess:
            pass
    _, left = psutil.wait_procs(everyone, timeout=grace_s)
    for p in left:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(left, timeout=5)
    return out
