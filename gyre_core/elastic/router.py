"""The router between harness executions and rollout cells.

    router = Router(capacity=8, send=coordinator.send, clock=time.monotonic)
    router.open(0); router.open(1)
    completion = router.call("exec-7", CallRequest(key, prompt, 8))   # blocks; survives role switches
    router.forget(key)                                              # its context is done: free the K/V
    router.release("exec-7")                                        # the execution finished

An execution is bound to one rollout cell while it runs (its KV cache lives there); a cell holds at
most `capacity` executions and the rest wait in FIFO order. `close(cell)` stops new calls to a cell
leaving rollout and cancels the calls in flight there; a dead cell is closed the same way. A
cancelled call comes back with the tokens generated so far; the router keeps them, binds the
execution to another rollout cell and asks it for the rest, so the execution never notices — except
in the record: each token carries the policy version that produced it, and a rerouted call can span
two versions.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from .messages import CallRequest, Gen, Release, ToCell

HISTORY = 4096        # ended executions whose calls and pace the cost-aware policy's estimates use (the latest)


class RouterAborted(RuntimeError):
    """The run ended (or failed) while an execution was waiting on a call."""


@dataclass(slots=True)
class Completion:
    ids: list[int]
    logprobs: list[float]
    versions: list[int]          # per token
    finish_reason: str
    reroutes: int = 0            # times this call moved to another cell


@dataclass(slots=True)
class _Call:
    call_id: int
    execution_id: str
    req: CallRequest
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    reroutes: int = 0
    cell: int | None = None
    result: Completion | None = None
    done: threading.Event = field(default_factory=threading.Event)

    def remaining(self) -> CallRequest:
        r = self.req
        return CallRequest(r.key, r.prompt_ids + self.ids, r.max_new_tokens - len(self.ids), r.temperature, r.token_s)


@dataclass(slots=True)
class _Cell:
    open: bool = False
    bound: set[str] = field(default_factory=set)       # executions living on this cell
    inflight: dict[int, _Call] = field(default_factory=dict)


class Router:
    def __init__(self, capacity: int, send: Callable[[int, ToCell], None],
                 on_busy: Callable[[int, bool], None] | None = None):
        self.capacity, self._send, self._on_busy = capacity, send, on_busy
        self._lock = threading.Lock()
        self._cells: dict[int, _Cell] = {}
        self._binding: dict[str, int] = {}
        self._waiting: deque[_Call] = deque()
        self._next_id = 0
        self._aborted: str | None = None
        self._key_cell: dict[str, int] = {}   # context key -> the cell that last served it (holds its K/V)
        self.reroutes = 0
        self.call_s: list[float] = []     # each answered call's latency as its execution saw it
        # what an execution's progress looks like, for the cost-aware policy's estimates
        self._calls_done: dict[str, int] = {}     # live execution -> calls answered so far
        self._first_call: dict[str, float] = {}   # ... and when its first call was made
        self.finished_calls: deque[int] = deque(maxlen=HISTORY)      # calls of each execution that ended (the
        self.finished_period_s: deque[float] = deque(maxlen=HISTORY)  # latest) and its seconds per call and turn

    # -- the harness side ------------------------------------------------------------------------
    def call(self, execution_id: str, req: CallRequest) -> Completion:
        t0 = time.monotonic()
        with self._lock:
            if self._aborted:
                raise RouterAborted(self._aborted)
            self._first_call.setdefault(execution_id, t0)
            self._next_id += 1
            c = _Call(self._next_id, execution_id, req)
            self._waiting.append(c)
            self._pump()
        c.done.wait()
        if c.result is None:
            raise RouterAborted(self._aborted or "aborted")
        self.call_s.append(time.monotonic() - t0)   # wait for a slot included: what the execution sees
        with self._lock:
            if execution_id in self._first_call:      # (not a call that ended after its execution was released)
                self._calls_done[execution_id] = self._calls_done.get(execution_id, 0) + 1
        return c.result

    def progress(self) -> tuple[list[int], list[int], list[float]]:
        """Calls so far of each live execution; calls and seconds per call of each that ended."""
        with self._lock:
            return list(self._calls_done.values()), list(self.finished_calls), list(self.finished_period_s)

    def abort(self, why: str) -> None:
        """The run is over: every call still waiting or in flight raises `RouterAborted(why)` in its
        execution's thread, and so does every later call (no thread stays blocked on a dead run)."""
        with self._lock:
            self._aborted = why
            pending = list(self._waiting) + [c for st in self._cells.values() for c in st.inflight.values()]
            self._waiting.clear()
            for st in self._cells.values():
                st.inflight.clear()
                st.open = False
        for c in pending:
            c.done.set()

    def forget(self, key: str) -> None:
        """The harness is done with context `key` (its execution ended, or it compacted into a new one):
        the cell that served it last drops its K/V cache, if it still rolls out (a switch to training
        drops every cache anyway). Without this a rollout cell would keep every context it ever served."""
        with self._lock:
            cell = self._key_cell.pop(key, None)
            if cell is not None and self._cells[cell].open:
                self._send(cell, Release(key))

    def release(self, execution_id: str) -> None:
        """The execution finished: free its slot."""
        with self._lock:
            n, t0 = self._calls_done.pop(execution_id, 0), self._first_call.pop(execution_id, None)
            if n and t0 is not None:
                self.finished_calls.append(n)
                self.finished_period_s.append((time.monotonic() - t0) / n)
            cell = self._binding.pop(execution_id, None)
            if cell is not None:
                self._cells[cell].bound.discard(execution_id)
            self._pump()

    # -- the controller side ---------------------------------------------------------------------
    def open(self, cell: int) -> None:
        """Start routing calls to `cell` (it is in the rollout role)."""
        with self._lock:
            self._cells.setdefault(cell, _Cell()).open = True
            self._pump()

    def close(self, cell: int) -> list[int]:
        """Stop routing to `cell`: unbind its executions; returns the calls in flight there (the cell
        answers each with its partial tokens, reason "cancelled", or `cell_lost` is called)."""
        with self._lock:
            st = self._cells.setdefault(cell, _Cell())
            st.open = False
            for ex in st.bound:
                self._binding.pop(ex, None)
            st.bound.clear()
            return list(st.inflight)

    def cell_lost(self, cell: int) -> int:
        """A dead cell: every call in flight there is retried elsewhere with the tokens it had."""
        with self._lock:
            st = self._cells.setdefault(cell, _Cell())
            st.open = False
            for ex in st.bound:
                self._binding.pop(ex, None)
            st.bound.clear()
            lost = list(st.inflight.values())
            st.inflight.clear()
            for c in reversed(lost):
                c.cell, c.reroutes = None, c.reroutes + 1
                self._waiting.appendleft(c)
            self.reroutes += len(lost)
            if lost and self._on_busy:
                self._on_busy(cell, False)
            self._pump()
            return len(lost)

    def on_done(self, cell: int, call_id: int, ids: list[int], logprobs: list[float], versions: list[int],
                reason: str) -> None:
        """A cell answered a call (finished, or cancelled with what it had made)."""
        with self._lock:
            st = self._cells[cell]
            c = st.inflight.pop(call_id, None)
            if c is None:    # already retried after the cell was declared lost
                return
            if not st.inflight and self._on_busy:
                self._on_busy(cell, False)
            c.ids += ids
            c.logprobs += logprobs
            c.versions += versions
            c.cell = None
            if reason == "cancelled" and len(c.ids) < c.req.max_new_tokens:
                c.reroutes += 1
                self.reroutes += 1
                self._binding.pop(c.execution_id, None)
                st.bound.discard(c.execution_id)
                self._waiting.appendleft(c)   # first in line: it was already running
            else:
                c.result = Completion(c.ids, c.logprobs, c.versions,
                                      "length" if reason == "cancelled" else reason, c.reroutes)
                c.done.set()
            self._pump()

    def inflight(self, cell: int) -> int:
        with self._lock:
            return len(self._cells.get(cell, _Cell()).inflight)

    def bound(self, cell: int) -> int:
        with self._lock:
            return len(self._cells.get(cell, _Cell()).bound)

    # -- internals (lock held) -------------------------------------------------------------------
    def _place(self, execution_id: str) -> int | None:
        cell = self._binding.get(execution_id)
        if cell is not None and self._cells[cell].open:
            return cell
        free = [(len(st.bound), i) for i, st in self._cells.items() if st.open and len(st.bound) < self.capacity]
        if not free:
            return None
        cell = min(free)[1]
        self._binding[execution_id] = cell
        self._cells[cell].bound.add(execution_id)
        return cell

    def _pump(self) -> None:
        """Send every waiting call that has a place, in order (a call whose execution cannot be
        placed does not block calls of executions already bound to an open cell)."""
        still: deque[_Call] = deque()
        while self._waiting:
            c = self._waiting.popleft()
            cell = self._place(c.execution_id)
            if cell is None:
                still.append(c)
                continue
            st = self._cells[cell]
            if not st.inflight and self._on_busy:
                self._on_busy(cell, True)
            st.inflight[c.call_id] = c
            c.cell = cell
            self._key_cell[c.req.key] = cell
            self._send(cell, Gen(c.call_id, c.remaining()))
        self._waiting = still
