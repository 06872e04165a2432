"""Streaming training: finished executions -> micro-steps in a shared queue -> training cells -> one update.

    q = MicroStepQueue(micro_step_executions=4, max_staleness=1)      # in the coordinator; thread-safe
    q.open_burst(s, expected_count=G)                  # at dispatch (or close_burst(s, n) later)
    q.add_sequences(ex_id, s, seqs)                    # each finished execution, in finish order
    ms = q.claim(cell, version=v)                      # a training cell holding weights v (= the burst)
    stats = train_micro_step(trainer, ms, max_tokens=4096, objective="decoupled", is_cap=2.0)
    q.complete(ms.id, cell)                            # once its gradient sits in the core's accumulator
    ...
    hand_over(satellite_trainer, core_trainer)         # a satellite's gradients, before the update
    if q.burst_done(v):
        finish_step(core_trainer, q.trained_executions(v))   # ÷ executions trained, then one update
        # (or finish_step_within_kl: the same, undone and redone at a lower rate while the policy moved too far)

Why streaming: a training cell need not wait for the whole burst; cells that join late (satellites) take
micro-steps from the same queue and still finish with the others.

The pieces and their rules:
- An item is one finished execution of burst (RL step) s: its id, a payload (its training sequences),
  a token count and the behaviour policy versions of its tokens. Versions are per token because a call
  rerouted across a weight update spans two; only the oldest one matters for staleness.
- Burst s is trained on weights v = s (every micro-step of one step sees the same weights), so an item's
  staleness is s − min(versions). An item staler than `max_staleness` is dropped as it is cut into a
  micro-step, and counted.
- Micro-steps are consecutive groups of at most `micro_step_executions` kept items of one burst in finish
  order: a group is cut when it is full; when the burst is sealed: all expected executions arrived
  (`open_burst` / `close_burst` with a count), or `close_burst(s)` without one; and in the burst's tail —
  fewer than `tail` of its expected executions still to arrive — when a training cell claims and no full
  group is ready: it takes what is there rather than idle. Otherwise a burst's last group would hold its
  longest executions, trained one after another once the tail has ended, on the step's critical path.
- `claim` only hands out micro-steps of the burst equal to the caller's weights version. A cell's
  claimed-but-incomplete micro-steps go back to the FRONT of the queue when it dies (`reclaim`); the
  core dying loses the accumulated gradient of the whole burst (`reset_burst`).
- "Complete" means the micro-step's gradient has reached the core's accumulator. A satellite that keeps
  gradients locally until `hand_over` completes its micro-steps then, so a satellite lost before it hands
  over has its computed micro-steps reclaimed too.

Why the update is identical to the one-batch `_train_step` on the same data (two-level averaging): the
loss is Σ_e (mean over e's trainable tokens) / N with N the executions trained. Each execution's tokens
carry weight 1/|e| already (`processor.batch.execution_sequences`), so a micro-step's loss uses that
per-execution normalisation only (normaliser 1). N is known only once the burst is sealed (stale drops,
discards), so the accumulated gradient — core's and satellites' summed — is multiplied by 1/N once, before
DeepSpeed's boundary, clipping and the optimizer (`Trainer.finish_accumulation`). The gradient is linear
in the loss, so Σ_micro-steps ∇(loss_ms) / N = ∇(Σ_e loss_e / N) whatever the grouping and the cells.
"""
from __future__ import annotations

import numbers
import threading
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True, frozen=True)
class StreamItem:
    """One finished execution, ready to train. `payload` is opaque here (its training sequences)."""

    execution_id: str
    burst: int
    payload: Any
    min_version: int      # oldest behaviour policy version among its tokens
    max_version: int
    tokens: int           # trainable tokens (a cost hint for schedulers; not used for the loss)
    count: int = 1        # executions it stands for in the normaliser (identical ones collapsed into it)


@dataclass(slots=True, frozen=True)
class MicroStep:
    """Consecutive kept executions of one burst; the unit a training cell claims."""

    id: int
    burst: int
    items: tuple[StreamItem, ...]

    @property
    def payloads(self) -> list[Any]:
        return [it.payload for it in self.items]

    @property
    def execution_ids(self) -> list[str]:
        return [it.execution_id for it in self.items]

    @property
    def n_executions(self) -> int:
        """What its executions count in the step's normaliser (a collapsed duplicate's kept twin: its multiplicity)."""
        return sum(it.count for it in self.items)

    @property
    def tokens(self) -> int:
        return sum(it.tokens for it in self.items)


@dataclass(slots=True)
class StreamCounters:
    """Cumulative counts over the queue's life (a reclaimed micro-step is claimed again: claimed counts both)."""

    added: int = 0
    discarded: int = 0       # arrived but not trainable (no trainable token, evaluator failure, ...)
    dropped_stale: int = 0
    cut: int = 0             # micro-steps formed
    claimed: int = 0
    completed: int = 0
    reclaimed: int = 0       # back to the queue from a dead cell
    redone: int = 0          # claimed or completed, then put back by reset_burst


@dataclass(slots=True)
class _Burst:
    expected: int | None = None
    arrived: int = 0                                          # added + discarded + dropped
    sealed: bool = False
    pending: list[StreamItem] = field(default_factory=list)   # kept, not yet cut
    steps: dict[int, MicroStep] = field(default_factory=dict)
    ready: deque = field(default_factory=deque)               # micro-step ids, front first
    claims: dict[int, int] = field(default_factory=dict)      # micro-step id -> cell
    done: set = field(default_factory=set)
    left_out: dict[str, str] = field(default_factory=dict)    # execution id -> why it is not trained

    @property
    def finished(self) -> bool:
        return self.sealed and not self.pending and len(self.done) == len(self.steps)


class MicroStepQueue:
    """The buffer of finished executions and the shared queue of micro-steps (one lock guards all)."""

    def __init__(self, micro_step_executions: int, max_staleness: int, tail: int = 0):
        """`tail`: a claim cuts a short group once fewer than this many of the burst's expected executions
        are still to arrive (0: never; the coordinator uses a group per cell)."""
        if micro_step_executions < 1 or max_staleness < 0 or tail < 0:
            raise ValueError("micro_step_executions must be ≥ 1, max_staleness and tail ≥ 0")
        self.micro_step_executions = micro_step_executions
        self.max_staleness = max_staleness
        self.tail = tail
        self._lock = threading.Lock()
        self._bursts: dict[int, _Burst] = {}
        self._released: set[int] = set()       # finished bursts whose payloads were let go
        self._next_id = 0
        self._c = StreamCounters()

    # -- filling -----------------------------------------------------------------------------------
    def open_burst(self, s: int, expected_count: int | None = None) -> None:
        """Burst s starts; `expected_count` executions will arrive (seal when they have)."""
        with self._lock:
            b = self._burst(s)
            if expected_count is not None:
                self._expect(s, b, expected_count)

    def close_burst(self, s: int, expected_count: int | None = None) -> None:
        """No more executions of burst s beyond `expected_count` (None: none beyond those arrived)."""
        with self._lock:
            b = self._burst(s)
            self._expect(s, b, b.arrived if expected_count is None else expected_count)

    def add(self, execution_id: str, burst: int, payload: Any, versions: int | Iterable[int], *,
            tokens: int = 0, count: int = 1) -> bool:
        """A finished execution of `burst`; `versions` are its tokens' behaviour versions (or their min);
        `count`: the executions it stands for in the normaliser.

        Returns False when it is too stale to train (dropped and counted)."""
        vs = [int(versions)] if isinstance(versions, numbers.Integral) else [int(v) for v in versions]
        if not vs:
            raise ValueError(f"execution {execution_id}: no behaviour versions")
        if count < 1:
            raise ValueError(f"execution {execution_id}: count {count} (an execution not trained is discarded)")
        item = StreamItem(execution_id, burst, payload, min(vs), max(vs), tokens, count)
        with self._lock:
            b = self._open(burst, execution_id)
            b.arrived += 1
            self._c.added += 1
            staleness = burst - item.min_version      # burst s trains on weights v = s
            if staleness > self.max_staleness:
                b.left_out[execution_id] = f"stale: {staleness} > max_staleness {self.max_staleness}"
                self._c.dropped_stale += 1
            else:
                b.pending.append(item)
                while len(b.pending) >= self.micro_step_executions:
                    self._cut(b, self.micro_step_executions)
            self._maybe_seal(b)
            return staleness <= self.max_staleness

    def add_sequences(self, execution_id: str, burst: int, seqs, count: int = 1) -> bool:
        """`add` for an execution's `TrainSequence`s: versions and tokens from its trainable tokens.
        An execution with no trainable token is discarded (build_batch does not count it either)."""
        vs = [v for sq in seqs for v, w in zip(sq.versions, sq.weights) if w != 0.0]
        if not vs:
            self.discard(execution_id, burst, "no trainable token")
            return False
        return self.add(execution_id, burst, list(seqs), vs, tokens=len(vs), count=count)

    def discard(self, execution_id: str, burst: int, reason: str) -> None:
        """An execution of `burst` that arrives but is not trained (it still counts toward expected)."""
        with self._lock:
            b = self._open(burst, execution_id)
            b.arrived += 1
            b.left_out[execution_id] = reason
            self._c.discarded += 1
            self._maybe_seal(b)

    # -- training cells ----------------------------------------------------------------------------
    def claim(self, cell: int, version: int) -> MicroStep | None:
        """The next micro-step of burst `version` (the weights the cell holds), or None for now. In the
        burst's tail (`tail`) with no full group ready, the kept executions not yet cut go as a short group."""
        with self._lock:
            self._release_before(version)
            b = self._bursts.get(version)
            if b is not None and not b.ready and b.pending and b.expected is not None \
                    and b.expected - b.arrived < self.tail:
                self._cut(b, len(b.pending))
            if b is None or not b.ready:
                return None
            ms_id = b.ready.popleft()
            b.claims[ms_id] = cell
            self._c.claimed += 1
            return b.steps[ms_id]

    def complete(self, micro_step_id: int, cell: int) -> bool:
        """`cell`'s micro-step is in the core's accumulator. False (nothing recorded) when the claim no
        longer holds — reclaimed or reset meanwhile: that gradient must be thrown away."""
        with self._lock:
            for b in self._bursts.values():
                if b.claims.get(micro_step_id) == cell:
                    del b.claims[micro_step_id]
                    b.done.add(micro_step_id)
                    self._c.completed += 1
                    return True
            return False

    def reclaim(self, cell: int) -> list[MicroStep]:
        """A dead cell's claimed-but-incomplete micro-steps, put back at the front of their queue."""
        with self._lock:
            back: list[MicroStep] = []
            for b in self._bursts.values():
                mine = sorted(i for i, c in b.claims.items() if c == cell)
                for i in mine:
                    del b.claims[i]
                b.ready.extendleft(reversed(mine))
                back += [b.steps[i] for i in mine]
            self._c.reclaimed += len(back)
            return back

    def reset_burst(self, s: int) -> int:
        """The core (and its accumulated gradient) is lost: every micro-step of burst s goes back to the
        queue in order, claims and completions forgotten; every cell drops what it accumulated for s
        (`Trainer.zero_gradients`). Returns how many had been claimed or completed."""
        with self._lock:
            b = self._bursts.get(s)
            if b is None:
                return 0
            redo = len(b.claims) + len(b.done)
            b.claims.clear()
            b.done.clear()
            b.ready = deque(sorted(b.steps))
            self._c.redone += redo
            return redo

    # -- state -------------------------------------------------------------------------------------
    def burst_done(self, s: int) -> bool:
        """Burst s is sealed and every micro-step of it completed (none at all counts)."""
        with self._lock:
            if s in self._released:
                return True
            b = self._bursts.get(s)
            return b is not None and b.finished

    def trained_executions(self, s: int) -> int:
        """Executions of burst s that are trained: the across-executions normaliser, final once sealed."""
        with self._lock:
            b = self._bursts.get(s)
            if b is None or not b.sealed:
                raise RuntimeError(f"burst {s} is not sealed: its trained executions are not known yet")
            return sum(ms.n_executions for ms in b.steps.values())

    def untrained(self, s: int) -> int:
        """Executions of burst s still to be trained: expected (or arrived), less those in completed
        micro-steps and those left out (an estimate of the training left, for the cost-aware policy)."""
        with self._lock:
            b = self._bursts.get(s)
            if b is None:
                return 0
            trained = sum(len(b.steps[i].items) for i in b.done)
            return max(0, (b.expected if b.expected is not None else b.arrived) - trained - len(b.left_out))

    def left_out(self, s: int) -> dict[str, str]:
        """Executions of burst s that arrived but are not trained, and why (stale, discarded)."""
        with self._lock:
            b = self._bursts.get(s)
            return dict(b.left_out) if b is not None else {}

    def payloads(self, s: int) -> list[Any]:
        """The payloads of burst s's micro-steps, in the order they were cut (while it is not released)."""
        with self._lock:
            b = self._bursts.get(s)
            return [p for i in sorted(b.steps) for p in b.steps[i].payloads] if b is not None else []

    def release_burst(self, s: int) -> None:
        """Let go of a finished burst's payloads (its update is applied); `claim` does it implicitly."""
        with self._lock:
            b = self._bursts.get(s)
            if b is not None:
                if not b.finished:
                    raise RuntimeError(f"burst {s} is not finished")
                del self._bursts[s]
                self._released.add(s)

    def counters(self) -> StreamCounters:
        with self._lock:
            c = self._c
            return StreamCounters(c.added, c.discarded, c.dropped_stale, c.cut, c.claimed, c.completed,
                                  c.reclaimed, c.redone)

    @property
    def claimed(self) -> int:
        return self._c.claimed

    @property
    def completed(self) -> int:
        return self._c.completed

    @property
    def reclaimed(self) -> int:
        return self._c.reclaimed

    @property
    def dropped_stale(self) -> int:
        return self._c.dropped_stale

    # -- internals (lock held) ---------------------------------------------------------------------
    def _burst(self, s: int) -> _Burst:
        if s in self._released:
            raise ValueError(f"burst {s} is finished and released")
        return self._bursts.setdefault(s, _Burst())

    def _open(self, s: int, execution_id: str) -> _Burst:
        b = self._burst(s)
        if b.sealed:
            raise ValueError(f"execution {execution_id}: burst {s} is sealed ({b.arrived} arrived)")
        return b

    def _expect(self, s: int, b: _Burst, n: int) -> None:
        if b.sealed:
            if n != b.expected:
                raise ValueError(f"burst {s} is sealed with {b.expected} executions, not {n}")
            return
        if n < b.arrived:
            raise ValueError(f"burst {s}: {b.arrived} executions arrived, more than the {n} expected")
        b.expected = n
        self._maybe_seal(b)

    def _maybe_seal(self, b: _Burst) -> None:
        if not b.sealed and b.expected is not None and b.arrived >= b.expected:
            if b.pending:
                self._cut(b, len(b.pending))
            b.sealed = True

    def _cut(self, b: _Burst, n: int) -> None:
        items, b.pending = tuple(b.pending[:n]), b.pending[n:]
        ms = MicroStep(self._next_id, items[0].burst, items)
        self._next_id += 1
        b.steps[ms.id] = ms
        b.ready.append(ms.id)
        self._c.cut += 1

    def _release_before(self, version: int) -> None:
        for s in [s for s, b in self._bursts.items() if s < version and b.finished]:
            del self._bursts[s]
            self._released.add(s)


# -- training a micro-step on a Trainer --------------------------------------------------------------
def train_micro_step(trainer, ms: MicroStep, *, max_tokens: int, packed: bool = False, replicas=None,
                     **loss_kw) -> dict[str, float]:
    """Forward + backward of one micro-step's executions on `trainer`; the gradient accumulates.

    Payloads are each execution's `TrainSequence`s, whose weights already average over the execution's
    trainable tokens; the normaliser is 1 here and 1/N comes once in `finish_step`. No chunk is `last`:
    the accumulation is closed by `finish_step`. `packed` trains tree-packed rows (`pack_branches`), else
    padded length-sorted chunks (`micro_batches`); `loss_kw` goes to `Trainer.micro_step` (objective,
    temperature, clip_low, clip_high, is_cap, ...). `replicas`: the trainer's `DeviceReplicas` (a cell of
    several devices), which share the chunks out over the cell's devices. Returns the summed stats of its
    chunks.
    """
    from ..trainer.packing import micro_steps

    chunks = micro_steps([sq for payload in ms.payloads for sq in payload], max_tokens, packed)
    totals: dict[str, float] = {"executions": float(ms.n_executions)}
    if replicas is not None:
        return {**replicas.micro_step(chunks, **loss_kw), **totals}
    for chunk in chunks:
        for key, v in trainer.micro_step(chunk, 1.0, last=False, **loss_kw).items():
            totals[key] = totals.get(key, 0.0) + v
    return totals


def hand_over(satellite, core) -> None:
    """A satellite's accumulated gradients into the core's accumulator; the satellite starts clean.

    Both must have computed on the same weights (the burst's version). Across processes, ship
    `satellite.gradients()` (a name -> tensor dict) and call `core.add_gradients` on the other side."""
    core.add_gradients(satellite.gradients())
    satellite.zero_gradients()


def finish_step_within_kl(trainer, n_executions: int, probe, *, max_kl: float, backtracks: int, lr: float, restore,
                          max_tokens: int, temperature: float = 1.0, **shift_kw) -> dict[str, float]:
    """`finish_step` under the step loop's KL guard (`rl.max_kl`): after the update, the k3 estimate of
    KL(π_before ‖ π_after) per token over `probe` (sequences of the step; measured against the weights the
    step trained from, not the behaviour log-probs, which stale tokens would put past the bound whatever the
    rate); past `max_kl` the update is undone — `restore()` puts the trainer back at the step's checkpoint
    (weights and optimizer state) — and redone from the same summed gradient at half the rate, up to
    `backtracks` times (the last try is kept). The gradient at the step's weights does not depend on the
    rate, so a redo equals the step loop's (which recomputes it from the checkpoint). `shift_kw` goes to
    `Trainer.policy_shift`. Returns {kl, kl_backtracks, lr, grad_norm}; the trainer's rate is `lr` again."""
    from ..processor.batch import micro_batches

    chunks = micro_batches(probe, max_tokens)
    before = [trainer.logprobs(chunk, temperature=temperature) for chunk in chunks]
    grads = trainer.gradients()
    for b in range(backtracks + 1):
        if b:
            restore()
            trainer.zero_gradients()
            trainer.add_gradients(grads)
        trainer.set_lr(lr * 0.5 ** b)
        norm = finish_step(trainer, n_executions)
        shift = {"kl": 0.0, "tokens": 0.0}
        for chunk, ref in zip(chunks, before):
            for key, v in trainer.policy_shift(chunk, temperature=temperature, reference=ref, **shift_kw).items():
                shift[key] = shift.get(key, 0.0) + v
        kl = shift["kl"] / max(shift["tokens"], 1.0)
        if kl <= max_kl:
            break
    trainer.set_lr(lr)
    return {"kl": kl, "kl_backtracks": float(b), "lr": lr * 0.5 ** b, "grad_norm": norm}


def finish_step(trainer, n_executions: int) -> float:
    """The step's update on the core: the summed gradient ÷ `n_executions` (trained, from
    `MicroStepQueue.trained_executions`), then clipping and the optimizer. Returns the gradient norm.
    Nothing trained: no update."""
    if n_executions <= 0:
        trainer.zero_gradients()
        return 0.0
    return trainer.finish_accumulation(scale=1.0 / n_executions)
