"""The coordinator: runs a workload on K cell agents under one role policy, and measures it.

    result = run_elastic(cfg.elastic, workload)      # starts K agents, runs, stops them
    result.step_s, result.busy_frac, result.switch_s

One process holds the router, the controller, the stream of finished executions and the executions'
harness threads; the cells are separate long-lived agent processes (`gyre_core.elastic.cells`) that
connect back to it. Every event (a call answered, an execution finished, a micro-step or an update
done, a role switch done, a cell lost) re-runs the same four rules:
1. dispatch every burst its staleness bound allows (`max_staleness`; colocated: 0);
2. ask the role policy how many cells train (a prefix: core first) and switch cells toward it —
   rollout → train closes the cell in the router (its calls are rerouted with their tokens so far),
   train → rollout waits for the micro-step boundary; only then do a new burst's executions start, so
   none binds to a cell that is leaving rollout (as in the simulator);
3. hand streamed micro-steps of the current version's burst to idle training cells;
4. when a burst's micro-steps are all done, the core applies the update and publishes the next version.
Satellites' gradients reach the core through the cells' own process groups (`elastic.grad_channel`
`collective`, real cells: one reduce over the prefix of cells that trained, at the update; see
`collective`), or as arrays each micro-step forwarded by this process (`arrays`; emulated cells have no
gradient; a collective run falls back to arrays for good after it loses a cell, and has the burst that
was accumulating trained again).
A cell whose connection drops, or that is silent for `cell_timeout_s`, is declared dead: its calls
are retried elsewhere, its micro-steps reclaimed, and the run goes on with K − 1 cells.

How the agents start is a *launcher*'s job (`elastic.launch`): `ProcessLauncher` (the default) starts each
as a child process of this one; `gyre_ops.cell_runs.PrefectCellLauncher` starts each as a flow run of the
`cell-agent` deployment that a cell worker of the work pool picks up (one worker per device set). Either
way the agent runs the same plain command and dials back to `elastic.coordinator_host`.
"""
from __future__ import annotations

import os
import queue
import secrets
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Protocol
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client, Listener

from ..config import ConfigError, ElasticConfig
from .cells import emulated_token  # noqa: F401  (re-exported for tests)
from .controller import ROLLOUT, TRAIN, Counters, Decision, decide, make_policy
from .router import Router
from .stream import MicroStepQueue
from .timeline import BusySpan, RoleSpan, busy_fractions
from .work import TOKENS_PER_CALL, EmulatedWork, ExecutionLog, HarnessWork  # noqa: F401
from .workload import Workload

def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


@dataclass(slots=True)
class _CellState:
    index: int
    conn: object
    proc: "CellHandle | None"
    role: str = ROLLOUT              # rollout | train | switching | dead
    target: str = ROLLOUT
    busy: bool = False               # computing a micro-step or an update
    last_seen: float = 0.0
    switch_t0: float = 0.0
    span_t0: float = 0.0
    busy_t0: float = 0.0
    outbox: queue.Queue = field(default_factory=queue.Queue)   # what its writer thread sends, in order


@dataclass(slots=True)
class ElasticResult:
    policy: str
    mode: str
    k: int
    steps: int
    wall_s: float
    step_s: float
    busy: dict
    switch_s_rollout_to_train: float | None
    switch_s_train_to_rollout: float | None
    switches: int
    reroutes: int
    dead_cells: list[int]
    stale_dropped: int
    decisions: list[Decision]
    role_spans: list[RoleSpan]
    busy_spans: list[BusySpan]
    switch_marks: list[tuple[int, float, str, str]]
    executions: list[ExecutionLog]
    notes: list[str]
    load: list[tuple[float, int]] = field(default_factory=list)
    call_s: list[float] = field(default_factory=list)
    micro_s: list[float] = field(default_factory=list)
    optim_s: list[float] = field(default_factory=list)
    reduce_s: list[float] = field(default_factory=list)   # the core's wait in each update's reduce (collective)
    grad_channel: str = "arrays"  # how satellites' gradients reached the core (at the end of the run)
    relayed_bytes: int = 0        # gradient bytes the coordinator forwarded (the arrays channel)
    train_stats: dict = field(default_factory=dict)
    micro_by_cell: dict = field(default_factory=dict)
    launch: str = "process"       # how the agents started (elastic.launch)
    start_s: float = 0.0          # from launching the agents until every one had connected
    cell_devices: dict = field(default_factory=dict)   # cell -> what it computes on ("emulated", "real/cuda:0")

    def plot(self, path: str) -> str:
        """The role timeline of this run as a PNG (cells × time by role, switch ticks, w(t) below)."""
        from .timeline import plot_timeline

        return plot_timeline(path, self.role_spans, self.busy_spans, self.switch_marks,
                             f"{self.policy} ({self.mode}, K = {self.k})", self.decisions, self.load)

    def to_dict(self) -> dict:
        return {"policy": self.policy, "mode": self.mode, "k": self.k, "steps": self.steps,
                "wall_s": self.wall_s, "step_s": self.step_s, "busy_frac": self.busy.get("overall"),
                "busy": self.busy, "switch_s_rollout_to_train": self.switch_s_rollout_to_train,
                "switch_s_train_to_rollout": self.switch_s_train_to_rollout, "switches": self.switches,
                "reroutes": self.reroutes, "dead_cells": self.dead_cells, "stale_dropped": self.stale_dropped,
                "decisions": [d.to_dict() for d in self.decisions], "notes": self.notes,
                "calls": len(self.call_s), "call_s_mean": _mean(self.call_s),
                "micro_steps": len(self.micro_s), "micro_s_total": sum(self.micro_s),
                "optim_s_mean": _mean(self.optim_s), "reduce_s_mean": _mean(self.reduce_s),
                "grad_channel": self.grad_channel, "relayed_bytes": self.relayed_bytes,
                "micro_steps_by_cell": {str(k): v for k, v in sorted(self.micro_by_cell.items())},
                "launch": self.launch, "start_s": self.start_s,
                "cell_devices": {str(k): v for k, v in sorted(self.cell_devices.items())}}


# each cell's trainer is its own process group: a coordinator's torch.distributed settings are not the cells'
_RENDEZVOUS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")


class CellHandle(Protocol):
    """A started cell agent as its launcher sees it (a `subprocess.Popen` is one)."""

    def poll(self) -> int | None: ...                       # None while it runs, else its exit status

    def kill(self) -> None: ...

    def wait(self, timeout: float | None = None) -> int: ...   # raises subprocess.TimeoutExpired


class ProcessLauncher:
    """Cell agents as child processes of the coordinator, on this host: `python -m gyre_core.elastic.cells
    ARGS` with the key and the cell's devices in its environment."""

    name = "process"

    def launch(self, cell: int, args: list[str], env: dict[str, str]) -> subprocess.Popen:
        # the agents' chatter goes to stderr: a coordinator's stdout may be a JSON answer
        full = {k: v for k, v in os.environ.items() if k not in _RENDEZVOUS} | env
        return subprocess.Popen([sys.executable, "-m", "gyre_core.elastic.cells", *args], env=full, stdout=2)

    def describe(self, cell: int, handle) -> str:
        return f"cell {cell} exited with status {handle.poll()}"

    def waiting(self, pending: dict[int, object]) -> str:
        return ""

    def close(self) -> None:
        pass


class Coordinator:
    def __init__(self, ecfg: ElasticConfig, work, *, kill_cell_at: tuple[int, float] | None = None,
                 policy=None, on_version=None, on_role=None, launcher=None):
        """`work`: an `EmulatedWork` or a `HarnessWork` (or a `Workload`, emulated); it starts at burst
        `work.first_step` (a resumed run: weights of that version are published). `on_version(v, stats)` is
        called as each version is published, with the summed statistics of the micro-steps that made it;
        `on_role(cell, role, reason)` once per cell with its
        starting role (reason {"placed": True}) and after every finished switch (reason: the controller's
        decision), from the main loop: it must not block (`gyre_ops.cells.RoleRecorder` queues to Prefect).
        `launcher` starts the agents (default `ProcessLauncher`; see the module's docstring)."""
        self.launcher = launcher or ProcessLauncher()
        self.on_version = on_version
        self.on_role = on_role
        self.cfg = ecfg
        self.work = EmulatedWork(work) if isinstance(work, Workload) else work
        self.policy = policy or make_policy(ecfg.policy, ecfg.async_train_cells)
        self.staleness = 0 if ecfg.policy == "colocated" else ecfg.max_staleness
        self.events: queue.Queue = queue.Queue()
        self.cells: dict[int, _CellState] = {}
        self.order: list[int] = []            # alive cells, core first
        self.router = Router(ecfg.capacity, self._send, self._on_rollout_busy)
        self.stream = MicroStepQueue(ecfg.micro_step_executions, self.staleness)
        self.first = getattr(self.work, "first_step", 0)   # a resumed run: versions before it are published
        self.version = self.next_burst = self.first
        self.dispatched = self.finished = 0
        self.updating = False
        self.t0 = 0.0
        self.decisions: list[Decision] = []
        self.role_spans: list[RoleSpan] = []
        self.busy_spans: list[BusySpan] = []
        self.marks: list[tuple[int, float, str, str]] = []
        self.switch_s: dict[str, list[float]] = {TRAIN: [], ROLLOUT: []}
        self.threads: list[threading.Thread] = []
        self.notes: list[str] = []
        self.cell_devices: dict[int, str] = {}
        self.dead: list[int] = []
        self.load: list[tuple[float, int]] = []   # (t, unfinished executions) at every dispatch and finish
        self.micro_s: list[float] = []             # device seconds of each micro-step, as the cell measured
        self.optim_s: list[float] = []             # ... of each update (optimizer step and publish)
        self.reduce_s: list[float] = []            # ... of the core's part of each update's reduce
        self.trained_in: dict[int, set[int]] = {}  # version → cells whose micro-steps for it counted
        # satellites' gradients: through the cells' process groups, or as arrays through this process
        self.channel = "collective" if (ecfg.grad_channel == "collective" and ecfg.cells > 1
                                        and self.work.mode == "real") else "arrays"
        self._store = None                         # the groups' rendezvous (collective), held for the run
        self.relayed_bytes = 0                     # satellites' gradient arrays forwarded to the core
        self.train_stats: dict[int, dict] = {}    # version trained from → summed micro-step statistics
        self.micro_by_cell: dict[int, int] = {}   # micro-steps each cell computed (and that counted)
        self.kill_cell_at = kill_cell_at     # tests: (cell, seconds) SIGKILLs a cell mid-run
        self._procs: list[CellHandle] = []
        self.start_s = 0.0
        self._landings: queue.Queue = queue.Queue()     # published versions for `on_version`, in order
        self._lander: threading.Thread | None = None
        self._landing_error: str | None = None

    # -- clock and records ---------------------------------------------------------------------
    def now(self) -> float:
        return time.monotonic() - self.t0

    def _set_role(self, c: _CellState, role: str) -> None:
        t = self.now()
        if t > c.span_t0:
            self.role_spans.append(RoleSpan(c.index, c.span_t0, t, c.role))
        c.role, c.span_t0 = role, t

    def _on_rollout_busy(self, cell: int, busy: bool) -> None:   # router callback (its lock held)
        c = self.cells.get(cell)
        if c is None:
            return
        if busy:
            c.busy_t0 = self.now()
        else:
            self.busy_spans.append(BusySpan(cell, c.busy_t0, self.now(), ROLLOUT))

    def _send(self, cell: int, msg: tuple) -> None:
        """Queue `msg` for the cell's writer thread: never blocks, so a cell that stops reading (wedged,
        or its socket buffer full of a large gradient) cannot stall the main loop or the router's lock."""
        c = self.cells[cell]
        if c.role != "dead":
            c.outbox.put(msg)

    def _writer(self, c: _CellState) -> None:
        while (msg := c.outbox.get()) is not None:
            try:
                c.conn.send(msg)
            except (OSError, EOFError, ValueError):     # ValueError: the connection was closed here
                self.events.put((c.index, ("dead", "connection lost on send")))
                return

    # -- cells -----------------------------------------------------------------------------------
    def _start_cells(self) -> None:
        t_launch = time.monotonic()
        key = secrets.token_hex(16)
        # all may dial at once; the address is one every cell can reach (127.0.0.1 on one host)
        listener = Listener((self.cfg.coordinator_host, 0), backlog=self.cfg.cells, authkey=key.encode())
        host, port = listener.address
        env = {"GYRE_CELL_KEY": key, "OMP_NUM_THREADS": str(self.cfg.devices_per_cell)}
        group_args: list[str] = []
        if self.channel == "collective":
            from .collective import host_store

            wait_s = max(self.cfg.start_timeout_s, self.cfg.cell_timeout_s)
            self._store = host_store(self.cfg.coordinator_host, wait_s)
            group_args = ["--grad-store", f"{host}:{self._store.port}", "--world", str(self.cfg.cells),
                          "--group-timeout", str(wait_s)]
        gpus = _gpu_slices(self.cfg) if self.work.mode == "real" and self.launcher.name == "process" else None
        procs = []
        for i in range(self.cfg.cells):
            if gpus is not None:   # cell i owns its own devices_per_cell GPUs (a cell worker brings its own)
                env = dict(env, CUDA_VISIBLE_DEVICES=gpus[i])
            args = ["--cell", str(i), "--coordinator", f"{host}:{port}", "--threads", str(self.cfg.devices_per_cell),
                    *self.work.cell_args(), *group_args]
            procs.append(self.launcher.launch(i, args, env))
            self._procs.append(procs[-1])
        arrived: queue.Queue = queue.Queue()
        stop = threading.Event()

        def accept() -> None:
            accepted = 0
            while accepted < self.cfg.cells:
                try:
                    conn = listener.accept()
                except AuthenticationError:      # a stray dialer with another key: not one of ours
                    continue
                except (OSError, EOFError) as e:
                    arrived.put((None, e))
                    return
                if stop.is_set():                # woken by `give_up` below: nobody waits any more
                    conn.close()
                    return
                try:
                    arrived.put((conn, conn.recv()))
                except (OSError, EOFError) as e:
                    arrived.put((None, e))
                    return
                accepted += 1
        acceptor = threading.Thread(target=accept, daemon=True)
        acceptor.start()

        def give_up(why: str) -> None:
            """Stop the acceptor before closing the listener: a thread still blocked in accept() would
            otherwise take the next listener that reuses the socket's descriptor (a retry in this process)."""
            stop.set()
            try:
                Client(listener.address, authkey=key.encode()).close()
            except (OSError, EOFError, AuthenticationError):
                pass
            acceptor.join(5)
            listener.close()            # the agents started are killed by `run`, which handles any failure here
            raise RuntimeError(f"gyre elastic: cell agents failed to start: {why}")

        deadline = time.monotonic() + self.cfg.start_timeout_s
        while len(self.cells) < self.cfg.cells:
            try:
                conn, hello = arrived.get(timeout=0.2)
            except queue.Empty:
                failed = [i for i, p in enumerate(procs) if i not in self.cells and p.poll() is not None]
                late = time.monotonic() > deadline
                if failed or late:
                    pending = {i: p for i, p in enumerate(procs) if i not in self.cells}
                    give_up(", ".join(self.launcher.describe(i, procs[i]) for i in failed) if failed else
                            f"only {len(self.cells)} of {self.cfg.cells} cells connected within "
                            f"{self.cfg.start_timeout_s:g} s (elastic.start_timeout_s)"
                            + self.launcher.waiting(pending))
                continue
            if conn is None:
                give_up(f"accepting a connection failed: {hello}")
            idx = hello[1]
            self.cells[idx] = _CellState(idx, conn, procs[idx], last_seen=time.monotonic())
            self.cell_devices[idx] = hello[3]          # ("hello", cell, pid, device label)
        listener.close()
        self.start_s = time.monotonic() - t_launch
        self.order = sorted(self.cells)
        for c in self.cells.values():
            threading.Thread(target=self._reader, args=(c,), daemon=True).start()
            threading.Thread(target=self._writer, args=(c,), daemon=True).start()

    def _reader(self, c: _CellState) -> None:
        while True:
            try:
                msg = c.conn.recv()
            except (EOFError, OSError):
                self.events.put((c.index, ("dead", "connection closed")))
                return
            except Exception as e:    # an unreadable message: the cell cannot be trusted any more
                self.events.put((c.index, ("dead", f"unreadable message ({type(e).__name__}: {e})")))
                return
            c.last_seen = time.monotonic()    # any message is a sign of life, however busy the main loop is
            if msg[0] == "beat" and len(msg) > 2 and msg[2] > self.cfg.stuck_timeout_s:
                # the agent's heartbeat thread lives, but its main loop has been inside one piece of work
                # for too long (a hung kernel or collective): as good as dead
                self.events.put((c.index, ("dead", f"its agent has been busy in one piece of work for "
                                                   f"{msg[2]:.0f} s (elastic.stuck_timeout_s)")))
            elif msg[0] == "done":     # answers go straight to the router (executions are waiting on them)
                self.router.on_done(c.index, *msg[1:])
                self.events.put((c.index, ("beat",)))
            else:
                self.events.put((c.index, msg))

    # -- the run ---------------------------------------------------------------------------------
    def run(self) -> ElasticResult:
        try:
            self._start_cells()
        except BaseException:
            for c in self.cells.values():
                c.conn.close()
            for p in self._procs:
                if p.poll() is None:
                    p.kill()
            self.launcher.close()
            raise
        self.t0 = time.monotonic()
        for c in self.cells.values():
            c.last_seen = self.t0     # the silence clock starts with the run, not at each cell's hello
        for i in self.order:
            self.router.open(i)
            if self.on_role is not None:
                self.on_role(i, self.cells[i].role, {"placed": True})
        try:
            while self.version < self.work.steps:
                self._rules()
                self._check_silence()
                self._maybe_kill()
                try:
                    cell, msg = self.events.get(timeout=0.1)
                except queue.Empty:
                    continue
                self._handle(cell, msg)
            self._drain_landings()            # the last version lands before the clock stops
        finally:
            wall = self.now()
            self._shutdown()
            self._drain_landings(quiet=True)  # after an error too: what was published lands (a resume starts there)
        return self._result(wall)

    # -- landing published versions (`on_version`) off the main loop -------------------------------
    def _land(self, version: int) -> None:
        """Hand a published version to `on_version` on the lander thread, in order: writing a step's lake
        part and metrics must not hold up the main loop, which feeds the cells their calls and micro-steps."""
        if self.on_version is None:
            return
        if self._lander is None:
            self._lander = threading.Thread(target=self._lander_loop, name="gyre-elastic-lander", daemon=True)
            self._lander.start()
        self._landings.put((version, self.train_stats.get(version - 1, {})))

    def _lander_loop(self) -> None:
        while (item := self._landings.get()) is not None:
            try:
                self.on_version(*item)
            except Exception as e:  # noqa: BLE001 — the main loop (or the drain) raises it
                self._landing_error = f"landing version {item[0]} failed: {type(e).__name__}: {e}"
                self.events.put((-1, ("error", self._landing_error)))
                return

    def _drain_landings(self, quiet: bool = False) -> None:
        """Wait until every published version has landed; raise a landing's failure unless `quiet`."""
        if self._lander is not None:
            self._landings.put(None)
            self._lander.join()
            self._lander = None
        if self._landing_error is not None and not quiet:
            raise RuntimeError(f"gyre elastic: {self._landing_error}")

    def _rules(self) -> None:
        jobs = self._dispatch()
        self._roles()        # before the new executions make their first calls: none binds to a leaving cell
        self._start(jobs)
        self._feed()
        self._update()

    def _dispatch(self) -> list:
        """Count in every burst the staleness bound allows; returns their executions, not yet started."""
        jobs: list = []
        while (s := self.next_burst) < self.work.steps and self.version >= s - self.staleness:
            self.next_burst += 1
            n = self.work.burst_size(s)
            self.stream.open_burst(s, n)
            self.dispatched += n
            self.load.append((self.now(), self.dispatched - self.finished))
            jobs += self.work.start_burst(s, self.router, self._report)
        return jobs

    def _start(self, jobs: list) -> None:
        for job in jobs:
            th = threading.Thread(target=self._guarded, args=(job,), daemon=True)
            th.start()
            self.threads.append(th)

    def _guarded(self, job) -> None:
        """An execution's thread: an exception stops the run with its message (it would otherwise wait
        forever for an execution that never reports)."""
        try:
            job()
        except Exception as e:   # noqa: BLE001 — reported to the main loop, which raises it
            self.events.put((-1, ("error", f"an execution failed outside the harness: {type(e).__name__}: {e}")))

    def _report(self, burst: int, items: list) -> None:
        """An execution ended (harness thread): count it; stream what is ready to train."""
        self.events.put((-1, ("finished", burst, items)))

    def _roles(self) -> None:
        k = len(self.order)
        want = sum(1 for i in self.order if self.cells[i].target == TRAIN)
        d = decide(self.policy, Counters(k, self.cfg.capacity, self.dispatched, self.finished), want, self.now())
        if d.train_after != want:
            self.decisions.append(d)
        for pos, i in enumerate(self.order):
            self.cells[i].target = TRAIN if pos < d.train_after else ROLLOUT
        for i in self.order:
            c = self.cells[i]
            if c.role == c.target or c.role == "switching" or c.busy:
                continue                    # a training cell leaves at its micro-step boundary
            if c.role == ROLLOUT:
                self.router.close(i)        # its calls come back cancelled and are rerouted
                cost = self.work.switch_to_train_s
            else:
                cost = self.work.switch_to_rollout_s
            self.marks.append((i, self.now(), c.role, c.target))
            c.switch_t0 = self.now()
            self._set_role(c, "switching")
            self._send(i, ("role", c.target, cost))

    def _feed(self) -> None:
        for i in self.order:
            c = self.cells[i]
            if c.role != TRAIN or c.target != TRAIN or c.busy:
                continue
            ms = self.stream.claim(i, self.version)
            if ms is None:
                return
            c.busy, c.busy_t0 = True, self.now()
            self._send(i, ("micro", ms.id, self.work.micro_work(ms)))

    def _update(self) -> None:
        if self.updating or not self.stream.burst_done(self.version):
            return
        core = self.cells[self.order[0]]
        if core.role != TRAIN or core.busy:
            return
        self.updating = core.busy = True
        core.busy_t0 = self.now()
        n = self.stream.trained_executions(self.version)
        t = 1                              # the prefix of the order whose gradients are summed
        if self.channel == "collective":   # (no cell lost yet: positions in the order are the group ranks)
            pos = {c: p for p, c in enumerate(self.order)}
            t = 1 + max((pos[c] for c in self.trained_in.get(self.version, ()) if c in pos), default=0)
            for c in self.order[1:t]:
                self._send(c, ("reduce", self.version, t))
        self._send(core.index, ("optim", self.version, self.work.optim_work(self.version, n), t))

    def _handle(self, cell: int, msg: tuple) -> None:
        kind = msg[0]
        if cell >= 0 and self.cells[cell].role == "dead":
            return           # a cell declared dead that still talks: its work was reclaimed already
        if kind == "error":  # a harness thread failed: stop, rather than wait for an execution that never ends
            raise RuntimeError(f"gyre elastic: {msg[1]}")
        if kind == "finished":
            _, burst, items = msg
            self.finished += 1
            self.load.append((self.now(), self.dispatched - self.finished))
            for ex_id, payload, versions in items:
                if versions:
                    self.stream.add(ex_id, burst, payload, versions)
                else:
                    self.stream.discard(ex_id, burst, "nothing trainable (failed, or no generated token)")
        elif kind == "role_done":
            c = self.cells[cell]
            if c.role == "dead":
                return
            self.switch_s[msg[1]].append(self.now() - c.switch_t0)
            self._set_role(c, msg[1])
            if self.on_role is not None:
                self.on_role(cell, msg[1], {**(self.decisions[-1].to_dict() if self.decisions else {}),
                                            "switch_s": round(self.switch_s[msg[1]][-1], 4)})
            if msg[1] == ROLLOUT:
                self.router.open(cell)
        elif kind == "micro_done":
            c = self.cells[cell]
            # only a micro-step still held by this cell counts (one reclaimed or reset is trained again)
            if self.stream.complete(msg[1], cell):
                if msg[3] is not None and cell != self.order[0]:
                    self._send(self.order[0], ("grads", msg[3]))   # a satellite's gradient, to the core
                    self.relayed_bytes += sum(g.nbytes for g in msg[3].values())
                self.micro_s.append(msg[2])
                self.micro_by_cell[cell] = self.micro_by_cell.get(cell, 0) + 1
                self.trained_in.setdefault(self.version, set()).add(cell)
                sums = self.train_stats.setdefault(self.version, {})   # micro-steps train the current version
                for key, v in msg[4].items():
                    sums[key] = sums.get(key, 0.0) + v
            self.busy_spans.append(BusySpan(cell, c.busy_t0, self.now(), TRAIN))
            c.busy = False
        elif kind == "optim_done":
            c = self.cells[cell]
            self.busy_spans.append(BusySpan(cell, c.busy_t0, self.now(), TRAIN))
            c.busy = self.updating = False
            self.version = msg[1]
            self.optim_s.append(msg[2])
            if len(msg) > 3 and msg[3] is not None:
                self.reduce_s.append(msg[3])
            for i in self.order:
                if i != cell:
                    self._send(i, ("weights", self.version))
            self._land(self.version)           # after the others heard, off this loop
        elif kind == "optim_failed":       # the reduce did not complete (a cell of the prefix died)
            c = self.cells[cell]
            self.busy_spans.append(BusySpan(cell, c.busy_t0, self.now(), TRAIN))
            c.busy = self.updating = False
            self._fall_back(msg[2])
            redo = self.stream.reset_burst(self.version)
            self.notes.append(f"the update to v{self.version + 1} was not applied ({msg[2]}): "
                              f"{redo} micro-step(s) of step {self.version} trained again")
        elif kind == "dead":
            self._lose(cell, msg[1])

    def _fall_back(self, why: str) -> bool:
        """Collective → arrays for the rest of the run; every cell drops the gradient it holds. Returns
        whether it switched (the caller has the accumulating burst trained again)."""
        if self.channel != "collective":
            return False
        self.channel = "arrays"
        for i in self.order:
            self._send(i, ("channel", "arrays"))
        self.notes.append(f"gradients go through the coordinator as arrays from now on ({why})")
        return True

    def _check_silence(self) -> None:
        limit = self.cfg.cell_timeout_s
        for i in list(self.order):
            c = self.cells[i]
            if time.monotonic() - c.last_seen > limit:
                self._lose(i, f"silent for more than {limit:g} s")

    def _maybe_kill(self) -> None:
        if self.kill_cell_at and self.now() >= self.kill_cell_at[1]:
            victim = self.cells[self.kill_cell_at[0]]
            self.kill_cell_at = None
            if victim.proc is not None:
                victim.proc.kill()

    def _lose(self, cell: int, why: str) -> None:
        c = self.cells[cell]
        if c.role == "dead":
            return
        was_core = self.order and self.order[0] == cell
        if c.busy:
            self.busy_spans.append(BusySpan(cell, c.busy_t0, self.now(), c.role))
        self._set_role(c, "dead")
        c.target, c.busy = "dead", False
        if c.proc is not None and c.proc.poll() is None:
            c.proc.kill()          # silent but alive: make sure it cannot act on anything any more
        self.order.remove(cell)
        self.dead.append(cell)
        c.outbox.put(None)         # its writer stops
        rerouted = self.router.cell_lost(cell)
        reclaimed = self.stream.reclaim(cell)
        note = (f"cell {cell} lost ({why}) at {self.now():.1f} s: {rerouted} call(s) retried elsewhere, "
                f"{len(reclaimed)} micro-step(s) reclaimed; continuing with {len(self.order)} cell(s)")
        # the groups include the lost cell: gradients go as arrays from now on, and those held by the
        # cells for the current step (the lost one's with them) are dropped and the burst trained again
        # (an update in flight completes, or fails and is redone, in `_handle`)
        fell_back = self._fall_back(f"cell {cell} lost")
        if fell_back and not was_core and not self.updating:
            note += f"; {self.stream.reset_burst(self.version)} micro-step(s) of step {self.version} redone"
        if was_core and self.order:
            # the update's accumulated gradients lived on the core: the burst is trained again on the
            # new core, which starts from the last published weights
            redo = self.stream.reset_burst(self.version)
            self.updating = False
            self._send(self.order[0], ("core",))
            note += (f"; cell {self.order[0]} is the new core ({redo} micro-step(s) of step {self.version} redone, "
                     f"its optimizer restarted from the published v{self.version})")
        self.notes.append(note)
        print(f"gyre elastic: {note}", file=sys.stderr, flush=True)
        if not self.order:
            raise RuntimeError(f"gyre elastic: every cell is lost (last: cell {cell}, {why})")

    def _shutdown(self) -> None:
        self.router.abort("the elastic run ended")   # executions still waiting on a call get an error
        for i in self.order:
            self._send(i, ("stop",))
            self.cells[i].outbox.put(None)
        for c in self.cells.values():
            if c.role != "dead":
                self._set_role(c, c.role)   # close the open span
            if c.proc is not None:
                try:
                    c.proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    c.proc.kill()
        for th in self.threads:
            th.join(timeout=1)
        self.launcher.close()

    def _result(self, wall: float) -> ElasticResult:
        k, n = self.cfg.cells, self.work.steps - self.first      # the steps this invocation ran
        return ElasticResult(
            policy=self.policy.name, mode=self.work.mode, k=k, steps=n, wall_s=wall, step_s=wall / max(n, 1),
            busy=busy_fractions(self.role_spans, self.busy_spans, k, wall),
            switch_s_rollout_to_train=_mean(self.switch_s[TRAIN]),
            switch_s_train_to_rollout=_mean(self.switch_s[ROLLOUT]),
            switches=len(self.marks), reroutes=self.router.reroutes, dead_cells=list(self.dead),
            stale_dropped=self.stream.dropped_stale, decisions=self.decisions, role_spans=self.role_spans,
            busy_spans=self.busy_spans, switch_marks=self.marks, executions=getattr(self.work, "logs", []),
            notes=self.notes, load=self.load, call_s=list(self.router.call_s), micro_s=self.micro_s,
            optim_s=self.optim_s, reduce_s=self.reduce_s, grad_channel=self.channel,
            relayed_bytes=self.relayed_bytes, train_stats=self.train_stats, micro_by_cell=self.micro_by_cell,
            launch=self.launcher.name, start_s=self.start_s, cell_devices=dict(self.cell_devices))


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


def run_elastic(ecfg: ElasticConfig, work, **kw) -> ElasticResult:
    """Start `ecfg.cells` agents, run `work` (a `Workload` or `EmulatedWork`: emulated; a `HarnessWork`:
    real) under `ecfg.policy`, stop them, return the measurements."""
    check_fleet(ecfg)
    return Coordinator(ecfg, work, **kw).run()
