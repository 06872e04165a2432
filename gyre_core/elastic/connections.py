"""The coordinator's connections to its cell agents: start them, carry their messages, stop them.

    connections = CellConnections(cfg.elastic, ProcessLauncher(), events, on_done=...)
    connections.start(work.cell_args(), real=False, grad_groups=False)   # returns once every cell said hello
    connections.send(cell, Micro(ms_id, work))   # never blocks; what a cell sends lands on `events`
    connections.stop(alive)                      # `Stop` to each, wait for the agents to exit

How the agents start is a *launcher*'s job (`elastic.launch`): `ProcessLauncher` (the default) starts each
as a child process of this one; `gyre_ops.cell_runs.PrefectCellLauncher` starts each as a flow run of the
`cell-agent` deployment that a cell worker of the work pool picks up (one worker per device set). Either
way the agent runs the same plain command (`python -m gyre_core.elastic.agent`) and dials back to
`elastic.coordinator_host` with the run's key.

Each cell has a reader thread and a writer thread. The reader hands call answers (`Done`) straight to
the router, whose executions wait on them, and puts every message on the coordinator's event queue as
(cell, message); a dropped or unreadable connection, or an agent stuck in one piece of work for longer
than `elastic.stuck_timeout_s`, arrives there as `CellLost`. The writer sends the cell's outbox in order,
so the coordinator never blocks on a cell that stops reading.
"""
from __future__ import annotations

import os
import queue
import secrets
import socket
import struct
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge
from typing import Callable, Protocol

from ..config import ConfigError, ElasticConfig
from .messages import Beat, CellLost, Done, Hello, Stop, ToCell

_HANDSHAKE_S = 30   # a dialer that has not proved the key and said hello by then is dropped

# each cell's trainer is its own process group: a coordinator's torch.distributed settings are not the cells'
_RENDEZVOUS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")


class CellHandle(Protocol):
    """A started cell agent as its launcher sees it (a `subprocess.Popen` is one)."""

    def poll(self) -> int | None: ...                       # None while it runs, else its exit status

    def kill(self) -> None: ...

    def wait(self, timeout: float | None = None) -> int: ...   # raises subprocess.TimeoutExpired


class Launcher(Protocol):
    """Starts cell agents (`elastic.launch`): `ProcessLauncher`, `gyre_ops.cell_runs.PrefectCellLauncher`."""

    name: str                                                # the run's `launch` figure

    def launch(self, cell: int, args: list[str], env: dict[str, str]) -> CellHandle: ...

    def describe(self, cell: int, handle) -> str: ...       # why a started agent is gone

    def waiting(self, pending: dict[int, object]) -> str: ...   # why these have not connected ("": no idea)

    def close(self) -> None: ...                             # the run is over


class ProcessLauncher:
    """Cell agents as child processes of the coordinator, on this host: `python -m gyre_core.elastic.agent
    ARGS` with the key and the cell's devices in its environment."""

    name = "process"

    def launch(self, cell: int, args: list[str], env: dict[str, str]) -> subprocess.Popen:
        # the agents' chatter goes to stderr: a coordinator's stdout may be a JSON answer
        full = {k: v for k, v in os.environ.items() if k not in _RENDEZVOUS} | env
        return subprocess.Popen([sys.executable, "-m", "gyre_core.elastic.agent", *args], env=full, stdout=2)

    def describe(self, cell: int, handle) -> str:
        return f"cell {cell} exited with status {handle.poll()}"

    def waiting(self, pending: dict[int, object]) -> str:
        return ""

    def close(self) -> None:
        pass


@dataclass(slots=True)
class _Link:
    index: int
    conn: Connection
    proc: CellHandle | None
    last_seen: float = 0.0           # when anything last came from the cell
    closed: bool = False             # lost or stopped: nothing more is queued for it
    outbox: queue.Queue = field(default_factory=queue.Queue)   # what its writer thread sends, in order


class CellConnections:
    def __init__(self, cfg: ElasticConfig, launcher: Launcher, events: queue.Queue,
                 on_done: Callable[[int, Done], None]) -> None:
        """`events`: the coordinator's queue, which gets (cell, message) for everything the cells say;
        `on_done(cell, done)`: a call's answer, from the cell's reader thread (it must not block)."""
        self.cfg, self.launcher, self.events, self.on_done = cfg, launcher, events, on_done
        self._links: dict[int, _Link] = {}
        self._procs: list[CellHandle] = []
        self._store = None               # the gradient groups' rendezvous (collective), held for the run
        self.devices: dict[int, str] = {}   # cell -> what it computes on ("emulated", "real/cuda:0")
        self.start_s = 0.0               # from launching the agents until every one had connected

    # -- starting -------------------------------------------------------------------------------
    def start(self, cell_args: list[str], *, real: bool, grad_groups: bool) -> list[int]:
        """Launch `elastic.cells` agents with `cell_args` (real cells get their GPUs; `grad_groups`: they
        build the collective's process groups first) and wait until every one has said hello; then start
        each cell's reader and writer. Returns the cells. On a failure the agents already started are
        killed and the launcher closed before it raises."""
        t_launch = time.monotonic()
        key = secrets.token_hex(16)
        # all may dial at once; the address is one every cell can reach (127.0.0.1 on one host)
        host = self.cfg.coordinator_host
        server = socket.create_server((host, 0), backlog=max(self.cfg.cells, 16),
                                      family=socket.AF_INET6 if ":" in host else socket.AF_INET)
        try:
            self._launch((host, server.getsockname()[1]), key, cell_args, real, grad_groups)
            self._accept(server, key.encode())
        except BaseException:
            for link in self._links.values():
                link.conn.close()
            for p in self._procs:
                if p.poll() is None:
                    p.kill()
            self.launcher.close()
            self._close_store()
            raise
        finally:
            server.close()
        self.start_s = time.monotonic() - t_launch
        for link in self._links.values():
            threading.Thread(target=self._reader, args=(link,), daemon=True).start()
            threading.Thread(target=self._writer, args=(link,), daemon=True).start()
        return sorted(self._links)

    def _launch(self, address, key: str, cell_args: list[str], real: bool, grad_groups: bool) -> None:
        cfg = self.cfg
        host, port = address
        env = {"GYRE_CELL_KEY": key, "OMP_NUM_THREADS": str(cfg.devices_per_cell)}
        group_args: list[str] = []
        if grad_groups:
            from .collective import host_store

            wait_s = max(cfg.start_timeout_s, cfg.cell_timeout_s)
            self._store = host_store(cfg.coordinator_host, wait_s)
            group_args = ["--grad-store", self._store.address, "--world", str(cfg.cells),
                          "--group-timeout", str(wait_s)]
        gpus = _gpu_slices(cfg) if real and self.launcher.name == "process" else None
        for i in range(cfg.cells):
            if gpus is not None:   # cell i owns its own devices_per_cell GPUs (a cell worker brings its own)
                env = dict(env, CUDA_VISIBLE_DEVICES=gpus[i])
            args = ["--cell", str(i), "--coordinator", f"{host}:{port}", "--threads", str(cfg.devices_per_cell),
                    *cell_args, *group_args]
            self._procs.append(self.launcher.launch(i, args, env))

    def _accept(self, server: socket.socket, key: bytes) -> None:
        """Take every agent's connection and hello within `elastic.start_timeout_s`.

        Each connection proves it holds the run's key (multiprocessing's challenge, both ways) and says
        `Hello` on a thread of its own, within `_HANDSHAKE_S`: a stray dialer (a port scan, a connection
        that sends nothing or garbage, a wrong key) is dropped without holding up the agents or the
        deadline. The acceptor polls, so giving up never depends on one more connection arriving."""
        procs, want = self._procs, self.cfg.cells
        arrived: queue.Queue = queue.Queue()
        stop = threading.Event()

        def handshake(sock: socket.socket) -> None:
            sock.settimeout(None)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", _HANDSHAKE_S, 0))
            conn = Connection(sock.detach())
            try:
                deliver_challenge(conn, key)
                answer_challenge(conn, key)
                hello = conn.recv()
                if not (isinstance(hello, Hello) and 0 <= hello.cell < want) or stop.is_set():
                    raise ValueError("not a cell's hello")
                with socket.socket(fileno=os.dup(conn.fileno())) as same:   # no timeout once it is a cell
                    same.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", 0, 0))
            except Exception:     # noqa: BLE001 — whatever a stray sent, it is not one of ours
                conn.close()
                return
            arrived.put((conn, hello))

        def accept() -> None:
            server.settimeout(0.2)     # polls, so that `stop` is seen (select() fails past descriptor 1023)
            while not stop.is_set():
                try:
                    sock, _ = server.accept()
                except OSError:        # nobody dialled within 0.2 s, or the dialer left before it was taken
                    continue
                threading.Thread(target=handshake, args=(sock,), daemon=True).start()
        acceptor = threading.Thread(target=accept, daemon=True)
        acceptor.start()
        deadline = time.monotonic() + self.cfg.start_timeout_s
        try:
            while len(self._links) < want:
                try:
                    conn, hello = arrived.get(timeout=0.2)
                except queue.Empty:
                    failed = [i for i, p in enumerate(procs) if i not in self._links and p.poll() is not None]
                    if failed or time.monotonic() > deadline:
                        pending = {i: p for i, p in enumerate(procs) if i not in self._links}
                        raise RuntimeError("gyre elastic: cell agents failed to start: " + (
                            ", ".join(self.launcher.describe(i, procs[i]) for i in failed) if failed else
                            f"only {len(self._links)} of {want} cells connected within "
                            f"{self.cfg.start_timeout_s:g} s (elastic.start_timeout_s)"
                            + self.launcher.waiting(pending)))
                    continue
                if hello.cell in self._links:      # a second hello for one cell: keep the first
                    conn.close()
                    continue
                self._links[hello.cell] = _Link(hello.cell, conn, procs[hello.cell], last_seen=time.monotonic())
                self.devices[hello.cell] = hello.device
        finally:
            # stopped before the server closes: a thread still in accept() must not take the next server
            # that reuses the descriptor (a retry in this process)
            stop.set()
            acceptor.join()

    # -- while the run goes on ------------------------------------------------------------------
    def send(self, cell: int, msg: ToCell) -> None:
        """Queue `msg` for the cell's writer thread: never blocks, so a cell that stops reading (wedged,
        or its socket buffer full of a large gradient) cannot stall the main loop or the router's lock."""
        link = self._links[cell]
        if not link.closed:
            link.outbox.put(msg)

    def _writer(self, link: _Link) -> None:
        while (msg := link.outbox.get()) is not None:
            try:
                link.conn.send(msg)
            except (OSError, EOFError, ValueError):     # ValueError: the connection was closed here
                self.events.put((link.index, CellLost("connection lost on send")))
                return

    def _reader(self, link: _Link) -> None:
        while True:
            try:
                msg = link.conn.recv()
            except (EOFError, OSError):
                self.events.put((link.index, CellLost("connection closed")))
                return
            except Exception as e:    # an unreadable message: the cell cannot be trusted any more
                self.events.put((link.index, CellLost(f"unreadable message ({type(e).__name__}: {e})")))
                return
            link.last_seen = time.monotonic()    # any message is a sign of life, however busy the main loop is
            if isinstance(msg, Beat) and msg.busy_s > self.cfg.stuck_timeout_s:
                # the agent's heartbeat thread lives, but its main loop has been inside one piece of work
                # for too long (a hung kernel or collective): as good as dead
                self.events.put((link.index, CellLost(f"its agent has been busy in one piece of work for "
                                                      f"{msg.busy_s:.0f} s (elastic.stuck_timeout_s)")))
                continue
            if isinstance(msg, Done):  # answers go straight to the router (executions are waiting on them)
                self.on_done(link.index, msg)
            self.events.put((link.index, msg))

    def restart_silence_clocks(self) -> None:
        """The silence clock starts with the run, not at each cell's hello."""
        now = time.monotonic()
        for link in self._links.values():
            link.last_seen = now

    def silent_s(self, cell: int) -> float:
        """Seconds since anything came from `cell`."""
        return time.monotonic() - self._links[cell].last_seen

    def kill(self, cell: int) -> None:
        """SIGKILL the cell's agent (tests: a cell lost mid-run); its reader reports the loss."""
        proc = self._links[cell].proc
        if proc is not None:
            proc.kill()

    def drop(self, cell: int) -> None:
        """A cell declared lost: nothing more is sent to it, and its agent, if it still runs (silent or stuck,
        but alive), is killed so that it cannot act on anything any more."""
        link = self._links[cell]
        link.closed = True
        if link.proc is not None and link.proc.poll() is None:
            link.proc.kill()
        link.outbox.put(None)         # its writer stops

    # -- stopping -------------------------------------------------------------------------------
    def stop(self, alive: list[int]) -> None:
        """`Stop` to the `alive` cells, wait for every agent to exit (kill it after 10 s), close the launcher."""
        for i in alive:
            self.send(i, Stop())
            self._links[i].outbox.put(None)
        for link in self._links.values():
            if link.proc is not None:
                try:
                    link.proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    link.proc.kill()
        self.launcher.close()
        self._close_store()

    def _close_store(self) -> None:
        if self._store is not None:
            self._store.close()
            self._store = None


def _gpu_slices(ecfg: ElasticConfig) -> list[str] | None:
    """CUDA_VISIBLE_DEVICES for each real cell (consecutive slices of the visible GPUs, wrapping round
    when `elastic.devices` declares more than there are: cells then share GPUs); None on CPU."""
    try:
        import torch

        if not torch.cuda.is_available():
            return None
    except ImportError:
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [x for x in visible.split(",") if x] if visible else [str(i) for i in range(torch.cuda.device_count())]
    n = ecfg.devices_per_cell
    if not ids:
        return None
    return [",".join(dict.fromkeys(ids[(i * n + j) % len(ids)] for j in range(n))) for i in range(ecfg.cells)]


def available_devices(ecfg: ElasticConfig) -> tuple[int, str]:
    """(how many devices real cells can own, what they are): `elastic.devices`, else the GPUs torch
    sees (CUDA_VISIBLE_DEVICES applies), else this machine's CPU cores."""
    if ecfg.devices is not None:
        return ecfg.devices, "devices (elastic.devices)"
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.device_count(), "GPUs"
    except ImportError:
        pass
    return os.cpu_count() or 1, "CPU cores"


def check_fleet(ecfg: ElasticConfig) -> None:
    """Refuse, before anything starts, a real fleet that needs more devices than this host has (cells
    launched through Prefect run on the cell workers' device sets: the launcher checks those)."""
    if ecfg.mode != "real" or ecfg.launch != "process":
        return
    have, what = available_devices(ecfg)
    need = ecfg.cells * ecfg.devices_per_cell
    if need > have:
        raise ConfigError(f"elastic.cells: {ecfg.cells} real cells × {ecfg.devices_per_cell} device(s) each need "
                          f"{need} {what}, but {have} are available; use fewer cells, or elastic.mode=emulated")
