"""The coordinator: runs a workload on K cell agents under one role policy, and measures it.

    result = run_elastic(cfg.elastic, workload)      # starts K agents, runs, stops them
    result.step_s, result.busy_frac, result.switch_s

One process holds the router, the controller, the stream of finished executions and the executions'
harness threads; the cells are separate long-lived agent processes (`gyre_core.elastic.agent`) that
connect back to it (`connections`: starting them, carrying their messages, stopping them). Every event
(a call answered, an execution finished, a micro-step or an update done, a role switch done, a cell
lost) re-runs the same four rules:
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
How the agents start is a launcher's job (`elastic.launch`; see `connections`).
"""
from __future__ import annotations

import queue
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field

from ..config import ElasticConfig
from .connections import CellConnections, Launcher, ProcessLauncher, check_fleet
from .controller import ROLLOUT, TRAIN, CallDistribution, Counters, Decision, Estimates, decide, make_policy
from .messages import (BecomeCore, Beat, CellLost, Done, ExecutionFinished, Grads, Micro, MicroDone, Optim,
                       OptimDone, OptimFailed, Reduce, Role, RoleDone, RunError, ToCell, UseArrays, Weights)
from .router import Router
from .stream import MicroStepQueue
from .timeline import BusySpan, RoleSpan, busy_fractions
from .work import EmulatedWork, ExecutionLog, Work
from .workload import Workload


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


@dataclass(slots=True)
class _CellState:
    """A cell as the rules see it (`CellConnections` holds its connection and its process)."""

    index: int
    role: str = ROLLOUT              # rollout | train | switching | dead
    target: str = ROLLOUT
    busy: bool = False               # computing a micro-step or an update
    micro_n: int = 0                 # executions in the micro-step it computes (groups may be short)
    switch_t0: float = 0.0
    span_t0: float = 0.0
    busy_t0: float = 0.0


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
    micro_executions: list[int] = field(default_factory=list)   # executions each micro-step trained
    optim_s: list[float] = field(default_factory=list)
    reduce_s: list[float] = field(default_factory=list)   # the core's wait in each update's reduce (collective)
    grad_channel: str = "arrays"  # how satellites' gradients reached the core (at the end of the run)
    relayed_bytes: int = 0        # gradient bytes the coordinator forwarded (the arrays channel)
    train_stats: dict = field(default_factory=dict)
    micro_by_cell: dict = field(default_factory=dict)
    launch: str = "process"       # how the agents started (elastic.launch)
    start_s: float = 0.0          # from launching the agents until every one had connected
    cell_devices: dict = field(default_factory=dict)   # cell -> what it computes on ("emulated", "real/cuda:0")
    plans: list = field(default_factory=list)   # cost-aware: (version, training reserve, static) as each landed

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
                "micro_executions": sum(self.micro_executions),
                "optim_s_mean": _mean(self.optim_s), "reduce_s_mean": _mean(self.reduce_s),
                "grad_channel": self.grad_channel, "relayed_bytes": self.relayed_bytes,
                "micro_steps_by_cell": {str(k): v for k, v in sorted(self.micro_by_cell.items())},
                "launch": self.launch, "start_s": self.start_s,
                "cell_devices": {str(k): v for k, v in sorted(self.cell_devices.items())},
                "plans": [list(p) for p in self.plans]}


class Coordinator:
    def __init__(self, ecfg: ElasticConfig, work: Work | Workload, *, kill_cell_at: tuple[int, float] | None = None,
                 policy=None, on_version=None, on_role=None, launcher: Launcher | None = None):
        """`work`: any `Work` (`EmulatedWork`, `gyre_core.phases.rl_on_cells.HarnessWork`; a `Workload` is
        emulated); it starts at burst `work.first_step` (a resumed run: weights of that version are
        published). `on_version(v, stats)` is called as each version is published, with the summed
        statistics of the micro-steps that made it; `on_role(cell, role, reason)` once per cell with its
        starting role (reason {"placed": True}) and after every finished switch (reason: the controller's
        decision), from the main loop: it must not block (`gyre_ops.cells.RoleRecorder` queues to Prefect).
        `launcher` starts the agents (default `connections.ProcessLauncher`)."""
        self.on_version = on_version
        self.on_role = on_role
        self.cfg = ecfg
        self.work = EmulatedWork(work) if isinstance(work, Workload) else work
        self.policy = policy or make_policy(ecfg.policy, ecfg.async_train_cells)
        self.staleness = 0 if ecfg.policy == "colocated" else ecfg.max_staleness
        self.events: queue.Queue = queue.Queue()   # (cell or -1, message): the main loop's input
        self.connections = CellConnections(ecfg, launcher or ProcessLauncher(), self.events, self._on_done)
        self.cells: dict[int, _CellState] = {}
        self.order: list[int] = []            # alive cells, core first
        self.router = Router(ecfg.capacity, self.connections.send, self._on_rollout_busy)
        self.stream = MicroStepQueue(ecfg.micro_step_executions, self.staleness,
                                     tail=ecfg.micro_step_executions * ecfg.cells)
        self.first = self.work.first_step     # a resumed run: versions before it are published
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
        self.dead: list[int] = []
        self.load: list[tuple[float, int]] = []   # (t, unfinished executions) at every dispatch and finish
        self.micro_s: list[float] = []             # device seconds of each micro-step, as the cell measured
        self.micro_items: list[int] = []           # ... and the executions it trained
        self._calls_dist: CallDistribution | None = None   # the cost-aware policy's, rebuilt as executions end
        self._calls_dist_at = -1
        self._planned_for = -1                     # the version the cost-aware plan was last made at
        self._plan_proc = None                     # its planner process (the newest; stopped at the end)
        self._plan_lock = threading.Lock()
        self._ended = False                        # set at shutdown: a plan landing later is not applied
        self.plans: list[tuple[int, int, bool]] = []   # (version, reserve, static) as each plan landed
        self.optim_s: list[float] = []             # ... of each update (optimizer step and publish)
        self.reduce_s: list[float] = []            # ... of the core's part of each update's reduce
        self.trained_in: dict[int, set[int]] = {}  # version → cells whose micro-steps for it counted
        # satellites' gradients: through the cells' process groups, or as arrays through this process
        self.channel = "collective" if (ecfg.grad_channel == "collective" and ecfg.cells > 1
                                        and self.work.mode == "real") else "arrays"
        self.relayed_bytes = 0                     # satellites' gradient arrays forwarded to the core
        self.train_stats: dict[int, dict] = {}    # version trained from → summed micro-step statistics
        self.micro_by_cell: dict[int, int] = {}   # micro-steps each cell computed (and that counted)
        self.kill_cell_at = kill_cell_at     # tests: (cell, seconds) SIGKILLs a cell mid-run
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

    def _send(self, cell: int, msg: ToCell) -> None:
        self.connections.send(cell, msg)

    def _on_done(self, cell: int, d: Done) -> None:   # a cell's reader thread: the router has a call waiting
        self.router.on_done(cell, d.call_id, d.ids, d.logprobs, d.versions, d.reason)

    # -- the run ---------------------------------------------------------------------------------
    def run(self) -> ElasticResult:
        started = self.connections.start(self.work.cell_args(), real=self.work.mode == "real",
                                         grad_groups=self.channel == "collective")
        self.cells = {i: _CellState(i) for i in started}
        self.order = list(started)
        self.t0 = time.monotonic()
        self.connections.restart_silence_clocks()
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
                self.events.put((-1, RunError(self._landing_error)))
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
            self.events.put((-1, RunError(f"an execution failed outside the harness: {type(e).__name__}: {e}")))

    def _report(self, burst: int, items: list) -> None:
        """An execution ended (harness thread): count it; stream what is ready to train."""
        self.events.put((-1, ExecutionFinished(burst, items)))

    def _roles(self) -> None:
        k = len(self.order)
        want = sum(1 for i in self.order if self.cells[i].target == TRAIN)
        d = decide(self.policy, Counters(k, self.cfg.capacity, self.dispatched, self.finished, self._estimates()),
                   want, self.now())
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
            self._send(i, Role(c.target, cost))

    MEASURED_BEFORE_ESTIMATES = 8      # executions ended before the cost-aware policy trusts its estimates

    def _estimates(self) -> Estimates | None:
        """The cost-aware policy's estimates from what this run measured: each live execution's calls so far,
        the calls per execution and seconds per call of those that ended, the seconds a micro-step and an
        update took. None (the waterlevel decides) until enough was measured, and for the other policies."""
        if self.policy.name != "cost-aware" or not self.micro_s:
            return None
        live, ended, period = self.router.progress()
        if len(ended) < self.MEASURED_BEFORE_ESTIMATES:
            return None
        if self._calls_dist is None or self._calls_dist_at != self.finished:    # rebuilt as executions end
            self._calls_dist, self._calls_dist_at = CallDistribution(ended), self.finished
        unstarted = max(0, self.dispatched - self.finished - len(live))
        per_execution = sum(self.micro_s) / max(sum(self.micro_items), 1)
        update = statistics.fmean(self.optim_s) if self.optim_s else 0.0
        train = self.stream.untrained(self.version) * per_execution + update
        pace = statistics.median(period)
        if self._planned_for != self.version and self.optim_s:
            self._plan(ended, pace, per_execution / max(statistics.fmean(ended), 1.0), update)
        return Estimates.of(live + [0] * unstarted, self._calls_dist, pace, train)

    def _plan(self, calls: list[int], period_s: float, train_per_call_s: float, update_s: float) -> None:
        """Re-plan the cost-aware policy's training reserve once a version (`sim.plan_reserve`), in a process
        of its own at low priority (`elastic.plan`: its simulations never hold this loop's interpreter lock):
        the simulator run on what this run measured — the calls per execution that ended (resampled), a call
        with its turn, a trained call, the update, the switches — for the steps still to run. The plan
        applies when it lands; a plan that fails leaves the last one in place, with a note."""
        import json
        import subprocess

        self._planned_for = version = self.version
        steps_left = self.work.steps - version
        if steps_left < 1:
            return
        to_train, to_rollout = (statistics.fmean(self.switch_s[r]) if self.switch_s[r] else 0.0
                                for r in (TRAIN, ROLLOUT))
        w = Workload(name="measured", executions_per_step=self.work.burst_size(version), steps=steps_left,
                     max_calls=max(calls), call_s=period_s, env_s=0.0, train_s_per_call=train_per_call_s,
                     optimizer_s=update_s, publish_s=0.0, switch_to_train_s=to_train,
                     switch_to_rollout_s=to_rollout, seed=version, trace=tuple(calls))
        ask = json.dumps({"workload": w.to_dict(), "k": len(self.order), "capacity": self.cfg.capacity,
                          "max_staleness": self.staleness, "micro": self.cfg.micro_step_executions})

        self._stop_planner()              # a newer version's plan supersedes one still running
        try:
            proc = subprocess.Popen([sys.executable, "-m", "gyre_core.elastic.plan"], stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        except OSError as e:
            self.notes.append(f"cost-aware plan at v{version} not started: {e}")
            return
        self._plan_proc = proc

        def plan() -> None:
            try:
                out, err = proc.communicate(ask)
                if proc.returncode < 0:       # superseded, or stopped at the run's end
                    return
                if proc.returncode != 0:
                    raise RuntimeError(err.strip()[-300:])
                reserve, static = json.loads(out)
            except Exception as e:            # noqa: BLE001 - the last plan stays; the run goes on
                self.notes.append(f"cost-aware plan at v{version} failed: {e}")
                return
            with self._plan_lock:
                if self._ended or (self.plans and self.plans[-1][0] >= version):
                    return                    # the run is over, or a newer plan already landed
                self.policy.reserve, self.policy.static = reserve, static
                self.plans.append((version, reserve, static))
        th = threading.Thread(target=plan, name=f"gyre-plan-v{version}", daemon=True)
        th.start()
        self.threads.append(th)

    def _stop_planner(self) -> None:
        if self._plan_proc is not None and self._plan_proc.poll() is None:
            self._plan_proc.kill()

    def _feed(self) -> None:
        for i in self.order:
            c = self.cells[i]
            if c.role != TRAIN or c.target != TRAIN or c.busy:
                continue
            ms = self.stream.claim(i, self.version)
            if ms is None:
                return
            c.busy, c.busy_t0, c.micro_n = True, self.now(), len(ms.items)
            self._send(i, Micro(ms.id, self.work.micro_work(ms)))

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
                self._send(c, Reduce(self.version, t))
        self._send(core.index, Optim(self.version, self.work.optim_work(self.version, n,
                                                                        self.stream.payloads(self.version)), t))

    def _handle(self, cell: int, msg) -> None:
        """One event: a cell's message, or (cell −1) an execution finished or a harness thread failed."""
        if cell >= 0 and self.cells[cell].role == "dead":
            return           # a cell declared dead that still talks: its work was reclaimed already
        match msg:
            case RunError(message):   # stop, rather than wait for an execution that never ends
                raise RuntimeError(f"gyre elastic: {message}")
            case ExecutionFinished(burst, items):
                self.finished += 1
                self.load.append((self.now(), self.dispatched - self.finished))
                for ex_id, payload, versions, count, why in items:
                    if versions:
                        self.stream.add(ex_id, burst, payload, versions, count=count)
                    else:
                        self.stream.discard(ex_id, burst, why or "nothing trainable (failed, or no generated token)")
            case RoleDone(role, _):
                c = self.cells[cell]
                self.switch_s[role].append(self.now() - c.switch_t0)
                self._set_role(c, role)
                if self.on_role is not None:
                    self.on_role(cell, role, {**(self.decisions[-1].to_dict() if self.decisions else {}),
                                              "switch_s": round(self.switch_s[role][-1], 4)})
                if role == ROLLOUT:
                    self.router.open(cell)
            case MicroDone(ms_id, seconds, grads, stats):
                c = self.cells[cell]
                # only a micro-step still held by this cell counts (one reclaimed or reset is trained again)
                if self.stream.complete(ms_id, cell):
                    if grads is not None and cell != self.order[0]:
                        self._send(self.order[0], Grads(grads))   # a satellite's gradient, to the core
                        self.relayed_bytes += sum(g.nbytes for g in grads.values())
                    self.micro_s.append(seconds)
                    self.micro_items.append(c.micro_n)
                    self.micro_by_cell[cell] = self.micro_by_cell.get(cell, 0) + 1
                    self.trained_in.setdefault(self.version, set()).add(cell)
                    sums = self.train_stats.setdefault(self.version, {})   # micro-steps train the current version
                    for key, v in stats.items():
                        sums[key] = sums.get(key, 0.0) + v
                self.busy_spans.append(BusySpan(cell, c.busy_t0, self.now(), TRAIN))
                c.busy = False
            case OptimDone(version, seconds, reduce_s, stats):
                if stats:                           # the KL guard's figures join the step's training stats
                    self.train_stats.setdefault(version - 1, {}).update(stats)
                c = self.cells[cell]
                self.busy_spans.append(BusySpan(cell, c.busy_t0, self.now(), TRAIN))
                c.busy = self.updating = False
                self.version = version
                self.optim_s.append(seconds)
                if reduce_s is not None:
                    self.reduce_s.append(reduce_s)
                for i in self.order:
                    if i != cell:
                        self._send(i, Weights(self.version))
                self._land(self.version)           # after the others heard, off this loop
            case OptimFailed(_, why):     # the reduce did not complete (a cell of the prefix died)
                c = self.cells[cell]
                self.busy_spans.append(BusySpan(cell, c.busy_t0, self.now(), TRAIN))
                c.busy = self.updating = False
                self._fall_back(why)
                redo = self.stream.reset_burst(self.version)
                self.notes.append(f"the update to v{self.version + 1} was not applied ({why}): "
                                  f"{redo} micro-step(s) of step {self.version} trained again")
            case CellLost(why):
                self._lose(cell, why)
            case Beat() | Done():         # a sign of life / an answer the router has: the rules run again
                pass

    def _fall_back(self, why: str) -> bool:
        """Collective → arrays for the rest of the run; every cell drops the gradient it holds. Returns
        whether it switched (the caller has the accumulating burst trained again)."""
        if self.channel != "collective":
            return False
        self.channel = "arrays"
        for i in self.order:
            self._send(i, UseArrays())
        self.notes.append(f"gradients go through the coordinator as arrays from now on ({why})")
        return True

    def _check_silence(self) -> None:
        limit = self.cfg.cell_timeout_s
        for i in list(self.order):
            if self.connections.silent_s(i) > limit:
                self._lose(i, f"silent for more than {limit:g} s")

    def _maybe_kill(self) -> None:
        if self.kill_cell_at and self.now() >= self.kill_cell_at[1]:
            victim = self.kill_cell_at[0]
            self.kill_cell_at = None
            self.connections.kill(victim)

    def _lose(self, cell: int, why: str) -> None:
        c = self.cells[cell]
        if c.role == "dead":
            return
        was_core = self.order and self.order[0] == cell
        if c.busy:
            self.busy_spans.append(BusySpan(cell, c.busy_t0, self.now(), c.role))
        self._set_role(c, "dead")
        c.target, c.busy = "dead", False
        self.connections.drop(cell)   # nothing more goes to it; silent but alive, it is killed
        self.order.remove(cell)
        self.dead.append(cell)
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
            self._send(self.order[0], BecomeCore())
            note += (f"; cell {self.order[0]} is the new core ({redo} micro-step(s) of step {self.version} redone, "
                     f"its optimizer restarted from the published v{self.version})")
        self.notes.append(note)
        print(f"gyre elastic: {note}", file=sys.stderr, flush=True)
        if not self.order:
            raise RuntimeError(f"gyre elastic: every cell is lost (last: cell {cell}, {why})")

    def _shutdown(self) -> None:
        self.router.abort("the elastic run ended")   # executions still waiting on a call get an error
        with self._plan_lock:
            self._ended = True
        self._stop_planner()
        for c in self.cells.values():
            if c.role != "dead":
                self._set_role(c, c.role)   # close the open span
        self.connections.stop(self.order)
        for th in self.threads:
            th.join(timeout=1)

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
            micro_executions=self.micro_items,
            optim_s=self.optim_s, reduce_s=self.reduce_s, grad_channel=self.channel,
            relayed_bytes=self.relayed_bytes, train_stats=self.train_stats, micro_by_cell=self.micro_by_cell,
            launch=self.connections.launcher.name, start_s=self.connections.start_s,
            cell_devices=dict(self.connections.devices), plans=list(self.plans))


def run_elastic(ecfg: ElasticConfig, work: Work | Workload, **kw) -> ElasticResult:
    """Start `ecfg.cells` agents, run `work` (a `Workload` or `EmulatedWork`: emulated; a
    `phases.rl_on_cells.HarnessWork`: real) under `ecfg.policy`, stop them, return the measurements."""
    check_fleet(ecfg)
    return Coordinator(ecfg, work, **kw).run()
