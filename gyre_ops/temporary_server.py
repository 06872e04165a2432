"""The temporary Prefect server a `gyre` command starts when no Prefect API is configured (a laptop).

    with prefect_api() as url:        # the configured API, else a temporary server for this command
        train(...)                    # flows talk to `url`; the server stops when the block ends

Prefect would start such a server itself, but as an ordinary child: Ctrl-C (SIGINT to the whole process
group) killed it before `gyre` could finish its flow run, which then retried the dead API for ~150 s; a
SIGKILL of `gyre` left it running for good; and a slow start failed with "Timed out while attempting to
connect to ephemeral Prefect API server" and no hint. Started here instead, the server

- runs in a session of its own, so signals meant for the command's process group do not reach it;
- dies with the command (Linux: the parent-death signal), even after a SIGKILL of the command;
- is given `PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS` (default here 60 s) to answer, is retried
  once on another port, and otherwise stops the command with one line saying what to do.

It is the server Prefect's own temporary one is (the API app, no UI, the services an ephemeral server
runs), on 127.0.0.1, with the database of `PREFECT_HOME` and its log in `PREFECT_HOME/temporary-server.log`.
"""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Callable, Iterator

from gyre_core.ports import free_port

DEFAULT_START_TIMEOUT_S = 60.0


class ServerStartError(RuntimeError):
    """The temporary server did not answer, twice. The message is one line saying what to do."""


def _parent_death_signal():
    """A function for the child to run before exec that asks Linux for SIGTERM when its parent dies
    (prctl PR_SET_PDEATHSIG); looked up here, in the parent, so the child only calls it. None elsewhere."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    prctl = ctypes.CDLL(None, use_errno=True).prctl

    def set_it() -> None:
        prctl(1, signal.SIGTERM)                                      # 1 = PR_SET_PDEATHSIG
    return set_it


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


class TemporaryServer:
    def __init__(self, home: Path, timeout_s: float) -> None:
        self.home, self.timeout_s = home, timeout_s
        self.log = home / "temporary-server.log"
        self.proc: subprocess.Popen | None = None
        self.url = ""

    def start(self) -> str:
        """Start the server and wait until it answers; one retry on a new port. Returns the API URL."""
        self.home.mkdir(parents=True, exist_ok=True)
        for _ in range(2):
            port = free_port()
            self.url = f"http://127.0.0.1:{port}/api"
            env = dict(os.environ, PREFECT_UI_ENABLED="0",
                       # what Prefect's own temporary server sets: no UI, the ephemeral set of services
                       PREFECT__SERVER_EPHEMERAL="1", PREFECT__SERVER_FINAL="1")
            with open(self.log, "ab") as log:
                self.proc = subprocess.Popen(
                    [sys.executable, "-m", "uvicorn", "--factory", "prefect.server.api.server:create_app",
                     "--host", "127.0.0.1", "--port", str(port), "--log-level", "error", "--lifespan", "on"],
                    env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                    start_new_session=True, preexec_fn=_parent_death_signal())
            deadline = time.monotonic() + self.timeout_s
            while time.monotonic() < deadline and self.proc.poll() is None:
                if _answers(self.url):
                    return self.url
                time.sleep(0.2)
            self.stop()
        raise ServerStartError(
            f"the temporary Prefect server did not answer within {self.timeout_s:g} s, twice (its log: {self.log}). "
            "Start one that stays up with `gyre up` (or `prefect server start`) and set PREFECT_API_URL to it, "
            "or allow a slow machine more time with PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS")

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None


def _drain_prefect_workers(timeout_s: float = 10.0) -> None:
    """Send the logs and events Prefect still holds for the server before it stops: otherwise its workers
    find no server at exit, print "Error logging to API" and retry for about a minute."""
    try:
        from prefect.events.worker import EventsWorker
        from prefect.logging.handlers import APILogWorker

        for worker in (APILogWorker, EventsWorker):
            worker.drain_all(timeout=timeout_s)
    except Exception:  # noqa: BLE001 - never keep the server from stopping
        pass


@contextlib.contextmanager
def prefect_api(say: Callable[[str], None] | None = None) -> Iterator[str]:
    """The Prefect API a command's flows use: the configured one (PREFECT_API_URL, or the active profile's),
    else a temporary server started here for the block (see the module's text). Imports Prefect."""
    from prefect.context import refresh_global_settings_context
    from prefect.settings import get_current_settings

    settings = get_current_settings()
    if settings.api.url:
        yield settings.api.url
        return
    timeout = float(os.environ.get("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS") or DEFAULT_START_TIMEOUT_S)
    server = TemporaryServer(Path(settings.home), timeout)
    try:
        url = server.start()
    except BaseException:           # Ctrl-C while it starts: the server started so far stops too
        server.stop()
        raise
    (say or (lambda line: print(line, file=sys.stderr)))(f"gyre: temporary Prefect server on {url} "
                                                         "(it stops with this command)")
    before = os.environ.get("PREFECT_API_URL")
    os.environ["PREFECT_API_URL"] = url          # for this process's flows and for the processes it starts
    refresh_global_settings_context()
    try:
        yield url
    finally:
        _drain_prefect_workers()
        server.stop()
        if before is None:
            os.environ.pop("PREFECT_API_URL", None)
        else:
            os.environ["PREFECT_API_URL"] = before
        refresh_global_settings_context()
