"""A discrete-event model of K cells running one role policy on bursts of long-tailed executions.

    gyre sim --profile paper-122b                       # colocated vs async (best split) vs elastic
    gyre sim --profile laptop --json --png data/sim/

    from gyre_core.elastic.sim import simulate
    r = simulate(workload, k=8, capacity=16, policy="elastic")     # SimResult: r.step_s, r.busy_frac, ...
    # the three policies side by side, and the table `gyre sim` prints: `gyre_core.elastic.comparison`

Why it exists: to size a fleet before renting it, and to predict what the emulated runtime
(`gyre_core.elastic.runtime`) measures — the runtime applies the same rules in real time, and the
benchmark compares the two step times. The rules, exactly as modelled:

1. Cells. K cells, core (0) first, then satellites; the training cells are always cells[0:t], with t from
   `controller.decide(policy, Counters(k, capacity, d, f, estimates), t_before, now)` (the estimates only for
   `cost-aware`: calls so far of each unfinished execution, the histogram of calls per execution over the
   run's bursts, the trainable burst's queued and expected training; and its plan, `plan_reserve` on the
   workload's distribution with other draws), where t_before counts the cells currently meant to train.
   It is re-evaluated after every event (dispatch, execution finished, micro-step done, optimizer step
   done, switch done); every Decision that changes t is kept. All cells start in rollout, so a policy
   that trains from t = 0 pays one rollout→train switch first.
2. Bursts. Burst s (0..steps−1) is `executions_per_step` executions with `workload.calls(s)` calls. It is
   dispatched all at once (d += N) once burst s−1 is dispatched and the published version v ≥ s − S
   (S = max_staleness; 0 for colocated). v starts at 0 and counts optimizer steps.
3. Executions. A rollout cell hosts up to `capacity` executions; an execution stays bound to its cell
   while it runs, its slot held through its environment turns. Queued executions (FIFO) take a free slot
   on the least-loaded rollout cell (ties: lowest index). An execution makes n calls, each `call_s` · f of
   device time followed by an environment turn of `env_s`; after the last turn it finishes (f += 1) and
   frees its slot. f is its cell's decode slowdown at the cell's load (`slowdown`: with b executions
   bound, each other one in a call for its share of a turn adds β = `decode_slowdown` to a token's time),
   re-evaluated whenever an execution binds to or leaves the cell; work done so far is kept. When a cell
   leaves rollout, its executions go back to the FRONT of the queue in their order, keeping their
   progress: a call in flight resumes on the next cell with only its remaining device time (the runtime
   keeps the partial tokens); one in an environment turn keeps that turn's clock running (the
   environment needs no device) and starts its next call once the turn is over and it has a slot; one in
   its last turn just finishes, as it needs no slot any more.
4. Switches. A cell is unavailable for `switch_to_train_s` (rollout→train) or `switch_to_rollout_s`
   (train→rollout). A rollout cell leaves at once; a training cell finishes the micro-step or optimizer
   step it is computing first. A cell mid-switch completes it, then the rules are applied again.
5. Streaming training. Finished executions of burst s enter a buffer in finish order; consecutive groups
   of `micro_step_executions` form micro-steps (the last, smaller group once the whole burst finished);
   in the burst's tail — fewer than `micro_step_executions` × K of its executions left to finish — an idle
   training cell of the trainable burst takes the buffer as a short group rather than wait.
   An idle training cell (lowest index first) claims a micro-step of burst s only when v == s; it takes
   sum(workload.train_s(calls)) there. When all of burst s's micro-steps are done the core, once it is in
   train and idle, runs the optimizer step and publish (`optimizer_s + publish_s`); then v = s + 1.
5b. Weights. When a version is published, every cell in rollout pauses for `weight_sync_s` (loading it):
   calls in flight stop and resume after, and no call starts there meanwhile. A cell switching to rollout
   pays its load inside `switch_to_rollout_s`.
6. Accounting. Busy: a rollout cell with ≥ 1 call in flight, or a train cell computing a micro-step or an
   optimizer step. wall runs from 0 to the last publish; step_s = wall / steps; busy fractions are busy
   cell-seconds / (K × wall) (`timeline.busy_fractions`).
7. Dead cells are out of scope: K stays fixed.

Not modelled (each would make elastic look less good than here): re-prefilling a moved execution's
context on its new cell (a move is free), a call's cost growing with its context (`bench/decode_load.py`
measures it; the mean context is in `call_s`), the batch's exact composition (the slowdown counts the
others in flight by their average share of a turn), and variance in call and turn lengths — every call
at a given load takes the same time, so executions that start together stay in step and a cell idles
while all of them are in their turns (the runtime's thread jitter spreads them, so it measures a
somewhat higher rollout busy fraction for the same step time).

How: between two events of its cell an execution bound to it needs no event at all — its progress at any
time follows from when its calls started and the cell's speed — so each execution costs one event (its
finish), re-planned when it moves or its cell's load changes, and its calls' busy intervals are rebuilt
with numpy at the end. Paper-scale runs take well under a second per policy (cost-aware's plan adds
2K − 1 shorter runs).
"""
from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass, field, replace

import numpy as np

from .controller import ROLLOUT, TRAIN, CallDistribution, Counters, Decision, Estimates, decide, make_policy
from .timeline import BusySpan, RoleSpan, SwitchMark, busy_fractions
from .workload import Workload

SWITCHING = "switching"
POLICIES = ("colocated", "async", "elastic", "cost-aware", "adaptive")
_FINISH, _SWITCH, _MICRO, _OPTIM = range(4)


@dataclass(slots=True)
class _Exec:
    burst: int
    n: int                  # calls it makes
    call_rem: float         # device seconds left of its next (or interrupted) call
    ready_at: float         # when that call may start: the end of the environment turn before it
    done: int = 0           # calls completed
    cell: int = -1          # bound cell, −1 when queued or unbound
    bound_at: float = 0.0   # since when it runs at its cell's current speed (after any pause there)
    gen: int = 0            # bumped on every bind/unbind/re-timing: a stale finish event is ignored
    f: float = 1.0          # its cell's slowdown since bound_at: a call takes call_s · f


@dataclass(slots=True)
class _Cell:
    index: int
    role: str = ROLLOUT     # rollout | train | switching
    target: str = ROLLOUT
    to_role: str = ""       # while switching
    busy: bool = False      # computing a micro-step or the optimizer step
    micro_n: int = 0        # executions in the micro-step it computes
    bound: dict[int, None] = field(default_factory=dict)   # executions here, in bind order
    factor: float = 1.0     # decode slowdown at its current load (`slowdown`)
    paused_until: float = 0.0   # loading a published version: no call runs before this
    span_t0: float = 0.0
    busy_t0: float = 0.0
    switch_t0: float = 0.0


@dataclass(slots=True)
class _Burst:
    size: int
    buffer: list[int] = field(default_factory=list)         # finished executions' calls, not yet grouped
    pending: deque[tuple[float, int]] = field(default_factory=deque)   # formed micro-steps (seconds,
    finished: int = 0                                       # executions), unclaimed
    cut: int = 0                                            # micro-steps formed
    done: int = 0                                           # micro-steps computed
    trained: int = 0                                        # executions in them

    @property
    def complete(self) -> bool:
        return self.finished == self.size and not self.buffer and not self.pending and self.done == self.cut


@dataclass(slots=True)
class SimResult:
    """What one simulated run cost, and its timeline."""

    policy: str
    k: int
    capacity: int
    steps: int
    async_train_cells: int | None
    max_staleness: int
    wall_s: float
    step_s: float
    busy: dict                       # timeline.busy_fractions
    switches_to_train: int
    switches_to_rollout: int
    switch_s_mean: float | None      # mean duration of completed switches
    moved_executions: int            # executions moved off a cell that left rollout
    resumed_calls: int               # of those, calls cut mid-generation and resumed elsewhere
    step_ends: list[float]           # when each version was published
    load: list[tuple[float, int]]    # (t, unfinished w) after every dispatch and finish
    decisions: list[Decision]
    role_spans: list[RoleSpan]
    busy_spans: list[BusySpan]
    switch_marks: list[SwitchMark]

    @property
    def busy_frac(self) -> float:
        return self.busy["overall"]

    @property
    def busy_frac_rollout(self) -> float:
        return self.busy["rollout"]

    @property
    def busy_frac_train(self) -> float:
        return self.busy["train"]

    @property
    def switches(self) -> int:
        return self.switches_to_train + self.switches_to_rollout

    def to_dict(self, detail: bool = False) -> dict:
        """Figures as JSON-ready values; `detail` adds the decisions and step ends (spans stay out)."""
        out = {"policy": self.policy, "k": self.k, "capacity": self.capacity, "steps": self.steps,
               "async_train_cells": self.async_train_cells, "max_staleness": self.max_staleness,
               "wall_s": self.wall_s, "step_s": self.step_s, "busy_frac": self.busy_frac,
               "busy_frac_rollout": self.busy_frac_rollout, "busy_frac_train": self.busy_frac_train,
               "share_rollout": self.busy["share_rollout"], "share_train": self.busy["share_train"],
               "share_switching": self.busy["share_switching"],
               "role_s": {r: self.busy[f"role_s_{r}"] for r in (ROLLOUT, TRAIN, SWITCHING)},
               "switches": self.switches, "switches_to_train": self.switches_to_train,
               "switches_to_rollout": self.switches_to_rollout, "switch_s_mean": self.switch_s_mean,
               "moved_executions": self.moved_executions, "resumed_calls": self.resumed_calls,
               "role_changes": len(self.decisions)}
        if detail:
            out["step_ends"] = list(self.step_ends)
            out["decisions"] = [d.to_dict() for d in self.decisions]
        return out


class _Sim:
    """One run: the state, the event loop, and the rules applied after each event."""

    def __init__(self, w: Workload, k: int, capacity: int, policy: str, async_train_cells: int,
                 max_staleness: int, micro: int, plan: tuple[int, bool] | None = None,
                 knows_lengths: bool = False) -> None:
        _check_args(w, k, capacity, policy, async_train_cells, max_staleness, micro)
        self.w, self.k, self.cap, self.micro = w, k, capacity, micro
        self.knows_lengths = knows_lengths
        self.policy_name = policy
        self.policy = make_policy(policy, async_train_cells)
        if policy == "cost-aware":     # its plan: given, or made as the runtime makes it
            self.policy.reserve, self.policy.static = (plan if plan is not None else
                                                       plan_reserve(w, k, capacity, max_staleness, micro))
        self.split = async_train_cells if policy in ("async", "adaptive") else None
        self.staleness = 0 if policy == "colocated" else max_staleness
        self.cells = [_Cell(i) for i in range(k)]
        self.execs: list[_Exec] = []
        self.queue: deque[int] = deque()
        self.bursts: list[_Burst] = []
        self.heap: list[tuple] = []
        self.seq = 0
        self.now = 0.0
        self.version = self.next_burst = self.dispatched = self.finished = 0
        self.updating = False
        self.decisions: list[Decision] = []
        self.role_spans: list[RoleSpan] = []
        self.train_spans: list[BusySpan] = []
        self.marks: list[SwitchMark] = []
        self.switch_s: list[float] = []
        self.segments: list[tuple[int, float, float, float, int, float, float, float]] = []
        self.moved = self.resumed = 0
        self.step_ends: list[float] = []
        self.load: list[tuple[float, int]] = []
        self.unfinished: set[int] = set()
        # the cost-aware policy's measured distribution of calls per execution: the histogram of the run's
        # bursts (which execution makes how many calls stays unknown to it)
        self.calls_dist = (CallDistribution(c for s in range(w.steps) for c in w.calls(s))
                           if policy == "cost-aware" else None)

    # -- the loop --------------------------------------------------------------------------------------
    def run(self) -> SimResult:
        self._rules()
        handlers = {_FINISH: self._on_finish, _SWITCH: self._on_switch, _MICRO: self._on_micro,
                    _OPTIM: self._on_optim}
        while self.version < self.w.steps:
            if not self.heap:
                raise RuntimeError(f"sim: stalled at t={self.now:.3f}s (version {self.version}, dispatched "
                                   f"{self.dispatched}, finished {self.finished}): no event left")
            t, _, kind, a, b = heapq.heappop(self.heap)
            if kind == _FINISH and b != self.execs[a].gen:
                continue                  # re-planned since: nothing happens now
            self.now = t
            handlers[kind](a, b)
            self._rules()
        return self._result(self.now)

    def _push(self, t: float, kind: int, a: int, b: int = 0) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, kind, a, b))

    def _rules(self) -> None:
        self._dispatch()
        self._roles()
        self._pump()
        self._feed()
        self._update()

    # -- rule 2: bursts --------------------------------------------------------------------------------
    def _dispatch(self) -> None:
        w = self.w
        while self.next_burst < w.steps and self.version >= self.next_burst - self.staleness:
            s = self.next_burst
            calls = w.calls(s)
            self.bursts.append(_Burst(len(calls)))
            for n in calls:
                self.queue.append(len(self.execs))
                self.unfinished.add(len(self.execs))
                self.execs.append(_Exec(s, n, w.call_s, self.now))
            self.dispatched += len(calls)
            self.next_burst += 1
            self.load.append((self.now, self.dispatched - self.finished))

    # -- rules 1 and 4: roles and switches -------------------------------------------------------------
    def _roles(self) -> None:
        want = sum(c.target == TRAIN for c in self.cells)
        d = decide(self.policy, Counters(self.k, self.cap, self.dispatched, self.finished, self._estimates(),
                                         *self._buffer()), want, self.now)
        if d.train_after != want:
            self.decisions.append(d)
        for c in self.cells:
            c.target = TRAIN if c.index < d.train_after else ROLLOUT
        for c in self.cells:
            if c.role == c.target or c.role == SWITCHING or c.busy:
                continue          # mid-switch: finish it first; training: leave at the micro-step boundary
            self._start_switch(c)

    def _estimates(self) -> Estimates | None:
        """What a cost-aware controller could know now: each unfinished execution's calls so far (not how
        many it will make: those come from the workload's distribution, as a runtime measures it from the
        executions that finished), and the trainable burst's queued and expected training."""
        if self.calls_dist is None:
            return None
        w = self.w
        done = {i: self._calls_done(self.execs[i]) for i in self.unfinished}
        train = sum(w.train_s(d + self.calls_dist.expected(d)) for i, d in done.items()
                    if self.execs[i].burst == self.version)
        if self.version < len(self.bursts):
            b = self.bursts[self.version]
            train += sum(t for t, _ in b.pending) + sum(w.train_s(n) for n in b.buffer) + w.optimizer_s + w.publish_s
        bound = [self.execs[i].f for i in self.unfinished if self.execs[i].cell >= 0]
        period = w.call_s * (sum(bound) / len(bound) if bound else 1.0) + w.env_s     # at today's loads
        return Estimates.of(list(done.values()), self.calls_dist, period, train)

    def _buffer(self) -> tuple[int, int, int, int]:
        """(version, the trainable burst's finished executions not yet claimed, its executions not yet
        trained, executions a burst): what `adaptive` reads."""
        if self.version >= len(self.bursts):
            return self.version, 0, 0, self.w.executions_per_step
        b = self.bursts[self.version]
        ready = len(b.buffer) + sum(n for _, n in b.pending)
        return self.version, ready, b.size - b.trained, self.w.executions_per_step

    def _calls_done(self, ex: _Exec) -> int:
        """Calls `ex` has completed by now (observable: its calls so far)."""
        if ex.cell < 0:
            return ex.done
        s0 = max(ex.bound_at, ex.ready_at)
        first_end = s0 + ex.call_rem * ex.f
        if self.now < first_end:
            return ex.done
        p = self.w.call_s * ex.f + self.w.env_s
        return min(ex.n, ex.done + 1 + (int((self.now - first_end) // p) if p > 0 else 0))

    def _start_switch(self, c: _Cell) -> None:
        w = self.w
        if c.role == ROLLOUT:
            self._leave_rollout(c)
        cost = w.switch_to_train_s if c.target == TRAIN else w.switch_to_rollout_s
        self.marks.append((c.index, self.now, c.role, c.target))
        self._set_role(c, SWITCHING)
        c.to_role, c.switch_t0 = c.target, self.now
        self._push(self.now + cost, _SWITCH, c.index)

    def _on_switch(self, cell: int, _: int) -> None:
        c = self.cells[cell]
        self.switch_s.append(self.now - c.switch_t0)
        self._set_role(c, c.to_role)

    def _set_role(self, c: _Cell, role: str) -> None:
        if self.now > c.span_t0:
            self.role_spans.append(RoleSpan(c.index, c.span_t0, self.now, c.role))
        c.role, c.span_t0 = role, self.now

    # -- rule 3: executions on rollout cells -----------------------------------------------------------
    def _pump(self) -> None:
        if not self.queue:
            return
        if self.knows_lengths:     # the oracle: older bursts first, within one most calls left first
            self.queue = deque(sorted(self.queue, key=lambda i: (self.execs[i].burst,
                                                                 self.execs[i].done - self.execs[i].n)))
        free = [c for c in self.cells if c.role == ROLLOUT and len(c.bound) < self.cap]
        touched = set()
        while self.queue and free:
            c = min(free, key=lambda c: (len(c.bound), c.index))
            self._bind(self.queue.popleft(), c)
            touched.add(c.index)
            if len(c.bound) >= self.cap:
                free.remove(c)
        for j in touched:
            self._retime(self.cells[j])

    def _bind(self, i: int, c: _Cell) -> None:
        ex = self.execs[i]
        ex.cell, ex.bound_at = c.index, max(self.now, c.paused_until)
        c.bound[i] = None
        self._schedule(i)

    def _schedule(self, i: int) -> None:
        """(Re)plan `i`'s finish on its cell at the cell's current speed; an earlier plan goes stale."""
        w, ex = self.w, self.execs[i]
        ex.f, ex.gen = self.cells[ex.cell].factor, ex.gen + 1
        if ex.done >= ex.n:              # in its last environment turn
            end = ex.ready_at
        else:
            start = max(ex.bound_at, ex.ready_at)
            end = start + ex.call_rem * ex.f + w.env_s + (ex.n - ex.done - 1) * (w.call_s * ex.f + w.env_s)
        self._push(end, _FINISH, i, ex.gen)

    def _retime(self, c: _Cell, pause_s: float = 0.0) -> None:
        """The cell's load changed (or it pauses `pause_s` to load weights): bring its executions' progress
        up to now at the old speed, then plan the rest at the new one."""
        new = slowdown(self.w, len(c.bound))
        if new == c.factor and pause_s <= 0:
            return
        if pause_s > 0:
            c.paused_until = self.now + pause_s
        for i in c.bound:
            ex = self.execs[i]
            self._advance(ex, self.now)
            ex.bound_at = max(self.now, c.paused_until)
        c.factor = new
        for i in c.bound:
            self._schedule(i)

    def _leave_rollout(self, c: _Cell) -> None:
        c.paused_until = 0.0             # coming back, its switch loads the newest weights
        front = []
        for i in c.bound:
            ex = self.execs[i]
            in_call = self._advance(ex, self.now)
            ex.cell, ex.gen = -1, ex.gen + 1
            self.moved += 1
            self.resumed += in_call
            if ex.done >= ex.n:          # in its last environment turn: no slot needed any more
                self._push(ex.ready_at, _FINISH, i, ex.gen)
            else:
                front.append(i)
        c.bound.clear()
        self.queue.extendleft(reversed(front))

    def _advance(self, ex: _Exec, t: float) -> bool:
        """Bring `ex`'s progress on its cell up to time t and record its calls there; True when a call
        was in flight at t. `call_rem` counts seconds at slowdown 1 (a call's share still to decode)."""
        w, f = self.w, ex.f
        call, p = w.call_s * f, w.call_s * f + w.env_s
        s0 = max(ex.bound_at, ex.ready_at)
        if t <= s0 or ex.done >= ex.n:
            return False
        first_end = s0 + ex.call_rem * f
        if t < first_end:
            self.segments.append((ex.cell, s0, t - s0, 0.0, 0, t, call, p))
            ex.call_rem, ex.ready_at = (first_end - t) / f, t
            return True
        left = ex.n - ex.done
        j = min(int((t - first_end) // p), left - 1) if p > 0 else left - 1
        ex.done += 1 + j
        turn = first_end + j * p            # the environment turn after the last completed call
        in_call = ex.done < ex.n and t > turn + w.env_s
        self.segments.append((ex.cell, s0, ex.call_rem * f, first_end + w.env_s, j + in_call, t, call, p))
        if ex.done >= ex.n or not in_call:
            ex.call_rem, ex.ready_at = (0.0 if ex.done >= ex.n else w.call_s), turn + w.env_s
        else:
            ex.call_rem, ex.ready_at = max(0.0, w.call_s - (t - turn - w.env_s) / f), t
        return in_call

    def _on_finish(self, i: int, gen: int) -> None:
        ex = self.execs[i]
        if gen != ex.gen:
            return
        if ex.cell >= 0:
            w, c = self.w, self.cells[ex.cell]
            if ex.done < ex.n:
                s0, call = max(ex.bound_at, ex.ready_at), w.call_s * ex.f
                self.segments.append((ex.cell, s0, ex.call_rem * ex.f, s0 + ex.call_rem * ex.f + w.env_s,
                                      ex.n - ex.done - 1, self.now, call, call + w.env_s))
            del c.bound[i]
            ex.cell = -1
            self._retime(c)
        ex.done = ex.n
        self.unfinished.discard(i)
        self.finished += 1
        self.load.append((self.now, self.dispatched - self.finished))
        self._stream_add(ex)

    # -- rule 5: streaming training --------------------------------------------------------------------
    def _stream_add(self, ex: _Exec) -> None:
        b = self.bursts[ex.burst]
        b.finished += 1
        b.buffer.append(ex.n)
        if len(b.buffer) >= self.micro or b.finished == b.size:
            self._cut(b)

    def _cut(self, b: _Burst) -> None:
        b.pending.append((sum(self.w.train_s(n) for n in b.buffer), len(b.buffer)))
        b.cut += 1
        b.buffer.clear()

    def _feed(self) -> None:
        if self.version >= len(self.bursts):
            return
        b = self.bursts[self.version]
        for c in self.cells:
            if c.role == TRAIN and c.target == TRAIN and not c.busy:
                # in the burst's tail (fewer left to finish than a group per cell) an idle training cell
                # takes a short group rather than wait
                if not b.pending and b.buffer and b.size - b.finished < self.micro * self.k:
                    self._cut(b)
                if not b.pending:
                    return
                seconds, n = b.pending.popleft()
                c.busy, c.busy_t0, c.micro_n = True, self.now, n
                self._push(self.now + seconds, _MICRO, c.index)

    def _on_micro(self, cell: int, _: int) -> None:
        c = self.cells[cell]
        self.train_spans.append(BusySpan(cell, c.busy_t0, self.now, TRAIN))
        c.busy = False
        b = self.bursts[self.version]
        b.done += 1
        b.trained += c.micro_n

    def _update(self) -> None:
        if self.updating or self.version >= len(self.bursts):
            return
        b = self.bursts[self.version]
        core = self.cells[0]
        if not b.complete or core.role != TRAIN or core.busy:
            return
        self.updating, core.busy, core.busy_t0 = True, True, self.now
        self._push(self.now + self.w.optimizer_s + self.w.publish_s, _OPTIM, 0)

    def _on_optim(self, cell: int, _: int) -> None:
        c = self.cells[cell]
        self.train_spans.append(BusySpan(cell, c.busy_t0, self.now, TRAIN))
        c.busy = self.updating = False
        self.version += 1
        self.step_ends.append(self.now)
        if self.w.weight_sync_s > 0:       # every rollout cell loads the new version, its calls paused
            for r in self.cells:
                if r.role == ROLLOUT:
                    self._retime(r, self.w.weight_sync_s)

    # -- rule 6: the result ----------------------------------------------------------------------------
    def _result(self, wall: float) -> SimResult:
        for c in self.cells:
            self._set_role(c, c.role)       # close the open spans at the last publish
        busy_spans = _rollout_busy(self.segments, self.k) + self.train_spans
        fr = busy_fractions(self.role_spans, busy_spans, self.k, wall) if wall > 0 else _zero_busy()
        to_train = sum(1 for m in self.marks if m[3] == TRAIN)
        return SimResult(
            policy=self.policy_name, k=self.k, capacity=self.cap, steps=self.w.steps,
            async_train_cells=self.split, max_staleness=self.staleness, wall_s=wall,
            step_s=wall / self.w.steps, busy=fr, switches_to_train=to_train,
            switches_to_rollout=len(self.marks) - to_train,
            switch_s_mean=sum(self.switch_s) / len(self.switch_s) if self.switch_s else None,
            moved_executions=self.moved, resumed_calls=self.resumed, step_ends=self.step_ends, load=self.load,
            decisions=self.decisions, role_spans=sorted(self.role_spans, key=lambda s: (s.cell, s.t0)),
            busy_spans=busy_spans, switch_marks=self.marks)


def slowdown(w: Workload, bound: int) -> float:
    """How much longer a call takes on a cell holding `bound` executions than alone: per token,
    1 + β·(other calls in flight) (β = `decode_slowdown`), with each of the others in flight for its share of
    a turn, call_s·f / (call_s·f + env_s) — solved for f."""
    beta, a, e = w.decode_slowdown, w.call_s, w.env_s
    if beta <= 0 or bound <= 1 or a <= 0:
        return 1.0
    k = beta * (bound - 1)
    b = e - a - k * a                    # a·f² + (e − a − k·a)·f − e = 0
    return (-b + math.sqrt(b * b + 4 * a * e)) / (2 * a)


def _zero_busy() -> dict:
    roles = ("rollout", "train", "switching", "dead")
    out = {"overall": 0.0, "rollout": 0.0, "train": 0.0}
    out.update({f"share_{r}": 0.0 for r in roles})
    out.update({f"busy_s_{r}": 0.0 for r in ("rollout", "train")})
    out.update({f"role_s_{r}": 0.0 for r in roles})
    return out


def _rollout_busy(segments, k: int) -> list[BusySpan]:
    """Each cell's calls-in-flight time as merged spans, from the recorded segments: a segment
    (cell, s0, first_len, a1, n_more, t_end, call, period) is the call [s0, s0 + first_len) then n_more
    calls starting at a1, a1 + period, ..., each `call` long, all cut at t_end."""
    if not segments:
        return []
    cell, s0, first, a1, n_more, t_end, call, period = (np.asarray(x) for x in zip(*segments))
    n_more = n_more.astype(np.int64)
    idx = np.repeat(np.arange(len(n_more)), n_more)
    offset = np.arange(idx.size) - np.repeat(np.cumsum(n_more) - n_more, n_more)
    more = a1[idx] + offset * period[idx]
    starts = np.concatenate([s0, more])
    ends = np.concatenate([np.minimum(s0 + first, t_end), np.minimum(more + call[idx], t_end[idx])])
    cells = np.concatenate([cell, cell[idx]]).astype(np.int64)
    keep = ends > starts
    starts, ends, cells = starts[keep], ends[keep], cells[keep]
    out: list[BusySpan] = []
    for c in range(k):
        m = cells == c
        if not m.any():
            continue
        order = np.argsort(starts[m], kind="stable")
        a, z = starts[m][order], ends[m][order]
        reach = np.maximum.accumulate(z)
        new = np.ones(a.size, dtype=bool)
        new[1:] = a[1:] > reach[:-1]          # a gap before this call: a new busy span starts
        first_i = np.flatnonzero(new)
        last_i = np.append(first_i[1:] - 1, a.size - 1)
        out.extend(BusySpan(c, float(a[i]), float(reach[j]), ROLLOUT) for i, j in zip(first_i, last_i))
    return out


def _check_args(w: Workload, k: int, capacity: int, policy: str, split: int, staleness: int, micro: int) -> None:
    if policy not in POLICIES:
        raise ValueError(f"sim: unknown policy {policy!r} (allowed: {', '.join(POLICIES)})")
    if k < 1 or capacity < 1 or micro < 1:
        raise ValueError(f"sim: need k ≥ 1, capacity ≥ 1, micro_step_executions ≥ 1 (got {k}, {capacity}, {micro})")
    if w.steps < 1 or w.executions_per_step < 1:
        raise ValueError("sim: the workload needs steps ≥ 1 and executions_per_step ≥ 1")
    if staleness < 0:
        raise ValueError(f"sim: max_staleness must be ≥ 0, got {staleness}")
    if policy in ("async", "adaptive") and not 1 <= split <= k - 1:
        raise ValueError(f"sim: {policy} needs 1 ≤ async_train_cells ≤ k − 1 = {k - 1}, got {split}")
    if min(w.call_s, w.env_s, w.train_s_per_call, w.optimizer_s, w.publish_s, w.switch_to_train_s,
           w.switch_to_rollout_s, w.weight_sync_s, w.decode_slowdown) < 0:
        raise ValueError("sim: workload durations must be ≥ 0")


def step_s_floor(workload: Workload, k: int, capacity: int, max_staleness: int) -> float:
    """A floor under any role policy's step time on this fleet: the larger of two bounds.

    - Work: each execution holds a rollout slot for its calls and environment turns, n·(call_s·f_b + env_s)
      on a cell holding b, so a burst needs ≥ Σ n · min over b ≤ capacity of (call_s·f_b + env_s) / b rollout
      cell-seconds (f_b: the decode slowdown at b — for β below about 1 a full cell is the best yield),
      plus Σ train_s(n) training cell-seconds and the update (optimizer step and publish); K cells give K
      cell-seconds a second.
    - Critical path, version by version (T_s: when version s is published, T_0 = 0). Burst s is dispatched
      at D_s = T_{s−S} (S = `max_staleness`; 0 for s ≤ S); its longest execution ends no sooner than
      D_s + n_max·(call_s + env_s) (alone on a cell, at full speed). Its micro-steps train only on weights
      s, so none starts before T_s: the micro-step holding the longest execution ends no sooner than
      max(that end, T_s) + train_s(n_max), and the burst's training — Σ train_s(n) on at most K cells —
      no sooner than T_s + Σ train_s(n) / K. The update follows: T_{s+1} is the later of the two plus the
      optimizer step and publish.
    Switches, partly filled cells, queueing and slowdown only add. (An execution moved off a cell mid-turn
    holds no slot until its next call, so a policy that moves executions could in principle shave some of
    the env part of the work bound; the waterlevel moves one only where another cell has a free slot.)"""
    w = workload
    steps = max(w.steps, 1)
    update = w.optimizer_s + w.publish_s
    work = 0.0
    published = [0.0]               # T_s
    # rollout cell-seconds per call at the best load: a fuller cell is slower per call but (for β below
    # about 1) does more calls a second; whatever β, no load does better than the best of 1..capacity
    cell_s_per_call = min((w.call_s * slowdown(w, b) + w.env_s) / b for b in range(1, capacity + 1))
    for s in range(w.steps):
        calls = w.calls(s)
        train = sum(w.train_s(n) for n in calls)
        work += sum(calls) * cell_s_per_call + train + update
        n_max = max(calls)
        dispatched = published[s - max_staleness] if s > max_staleness else 0.0
        longest = dispatched + n_max * (w.call_s + w.env_s)
        published.append(max(max(longest, published[s]) + w.train_s(n_max), published[s] + train / k) + update)
    return max(work / k, published[-1]) / steps


def simulate(workload: Workload, k: int, capacity: int, policy: str, async_train_cells: int = 1,
             max_staleness: int = 1, micro_step_executions: int = 4,
             plan: tuple[int, bool] | None = None, knows_lengths: bool = False) -> SimResult:
    """Run `workload` on K cells of `capacity` slots under `policy` (one of `POLICIES`); `plan`: the
    cost-aware policy's (reserve, static) (None: planned by `plan_reserve`). `knows_lengths`: for analysis,
    not something a runtime can have — queued executions take free slots by burst and, within one, most
    calls left first (rule 3's FIFO otherwise), as if each one's length were known when it is dispatched
    (longest first is a heuristic, not the best schedule)."""
    return _Sim(workload, k, capacity, policy, async_train_cells, max_staleness, micro_step_executions,
                plan, knows_lengths).run()


PLAN_STEPS = 16


def plan_reserve(w: Workload, k: int, capacity: int, max_staleness: int, micro: int) -> tuple[int, bool]:
    """The cost-aware policy's plan (reserve, static): of its critical-path rule with a training reserve
    r in 0..K−1, and of the static splits 1..K−1, the one that runs `w` fastest (simulated for its first
    `PLAN_STEPS` steps; ties: the dynamic rule, then the smaller r). `w` is what the run measured — in the
    runtime, the calls per execution, a turn's and a trained call's seconds, the update and the switches."""
    short = replace(w, steps=min(w.steps, PLAN_STEPS), seed=w.seed + 1)   # the distribution, not the draws
    candidates = [(r, False) for r in range(k)] + [(r, True) for r in range(1, k)]
    best_plan, best = (0, False), math.inf
    for plan in candidates:
        step = _Sim(short, k, capacity, "cost-aware", 1, max_staleness, micro, plan).run().step_s
        if step < best * (1 - 1e-9):
            best_plan, best = plan, step
    return best_plan
