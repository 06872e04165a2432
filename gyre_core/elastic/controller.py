"""Who rolls out and who trains: the three role policies as pure functions of the run's counters.

    policy = make_policy(cfg.elastic)
    t = policy.train_cells(Counters(k=8, capacity=8, dispatched=64, finished=20))   # -> 2

Cells are ordered core first, then satellites; the training cells are always the first `t` of them.
With dispatched d and finished f, the unfinished executions are w = d − f:
- `colocated`: t = 0 while anything is unfinished, else t = K (everyone rolls out, then everyone trains);
- `async`:     t = the configured split, always;
- `elastic`:   the waterlevel — the largest t with (K − t) · capacity ≥ w: a cell leaves rollout only
               while the cells that stay can still hold every unfinished execution, and comes back as
               soon as a new burst raises w above what the others hold.
- `cost-aware`: estimates, not counts (`Estimates`: each unfinished execution's expected and 90th-percentile
               seconds left from its calls so far and the measured distribution of calls; the trainable
               burst's training work left). While that training fits in the cell-seconds the waterlevel
               leaves free before the rollout ends (K · R − the executions' slot-seconds ÷ capacity, R the
               longest-first makespan of the tail estimates), it is the waterlevel; when it does not —
               training is the critical path, as when a new burst would send every cell back to rollout —
               it takes the t ≥ the waterlevel's that minimises max(R(t), training ÷ t); never fewer than
               its planned reserve, or exactly a static split when the plan says one is fastest
               (`sim.plan_reserve`, made on the run's measurements).
- `adaptive`:  a baseline after verl's rollout switch: `async`'s split, its training cells lent to rollout
               at a step boundary while the buffer of trainable executions is short (`AdaptiveSwitch`).
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Protocol

ROLLOUT, TRAIN = "rollout", "train"


@dataclass(slots=True, frozen=True)
class Estimates:
    """What the cost-aware policy weighs: estimates, not counts."""

    remaining_s: tuple[float, ...]   # each unfinished execution's expected seconds left, holding a slot
    train_s: float                   # cell-seconds of training the trainable burst still needs (its queued
    #                                  micro-steps, its unfinished executions' expected share, the update)
    remaining_tail_s: tuple[float, ...] = ()   # a high quantile of each one's seconds left (for makespans)

    @classmethod
    def of(cls, calls_done: list[int], calls: "CallDistribution", period_s: float, train_s: float) -> "Estimates":
        """From each unfinished execution's calls so far, the distribution of calls per execution and the
        seconds a call and its environment turn take."""
        return cls(tuple(calls.expected(d) * period_s for d in calls_done), train_s,
                   tuple(calls.quantile(d) * period_s for d in calls_done))


class CallDistribution:
    """Calls left given calls so far — the mean and a high quantile — under a measured distribution of calls
    per execution (a sample of finished executions' call counts)."""

    def __init__(self, sample, q: float = 0.9) -> None:
        import numpy as np

        self.sample = np.sort(np.asarray(list(sample), dtype=np.int64))
        self.q = q
        self._cache: dict = {}

    def __len__(self) -> int:
        return int(self.sample.size)

    def expected(self, done: int) -> float:
        return self._left(done, None)

    def quantile(self, done: int) -> float:
        return self._left(done, self.q)

    def _left(self, done: int, q: float | None) -> float:
        key = (done, q)
        if key not in self._cache:
            import numpy as np

            more = self.sample[self.sample > done]
            if not more.size:          # longer than any measured: at least one more call
                self._cache[key] = 1.0
            else:
                self._cache[key] = float((more.mean() if q is None else np.quantile(more, q)) - done)
        return self._cache[key]


@dataclass(slots=True, frozen=True)
class Counters:
    """What the controller sees at one moment."""

    k: int                # cells alive
    capacity: int         # executions one rollout cell holds at once
    dispatched: int       # d: executions handed to the router so far (cumulative)
    finished: int         # f: executions that have ended (cumulative)
    estimates: Estimates | None = None    # for `cost-aware` (without them it is the waterlevel)
    version: int = 0      # published versions so far (= the burst being trained)
    ready: int = 0        # that burst's executions finished and not yet taken by a training cell
    untrained: int = 0    # that burst's executions not yet trained (finished or not); 0: none to train
    burst_size: int = 0   # executions of a burst (0: not given — `adaptive` is then plain `async`)

    @property
    def unfinished(self) -> int:
        return self.dispatched - self.finished


@dataclass(slots=True)
class Decision:
    """One controller decision, with the inputs it was taken on (logged, and drawn on the timeline)."""

    t: float              # seconds since the run started
    policy: str
    dispatched: int
    finished: int
    capacity: int         # per rollout cell
    rollout_capacity: int  # capacity of the cells left in rollout after the decision
    train_before: int
    train_after: int

    def to_dict(self) -> dict:
        return {f: getattr(self, f) for f in self.__slots__}


class RolePolicy(Protocol):
    name: str

    def train_cells(self, c: Counters) -> int:
        """How many cells (a prefix of the order) should be in the train role now."""
        ...


class Colocated:
    name = "colocated"

    def train_cells(self, c: Counters) -> int:
        return c.k if c.unfinished == 0 else 0


@dataclass(slots=True)
class Async:
    train: int
    name: str = "async"

    def train_cells(self, c: Counters) -> int:
        if c.k == 1:   # a fleet shrunk to one cell (the config refuses K = 1 up front): take turns
            return Colocated().train_cells(c)
        return min(self.train, c.k - 1)


class Waterlevel:
    name = "elastic"

    def train_cells(self, c: Counters) -> int:
        if c.capacity <= 0:
            return 0
        # largest t with (k − t) · capacity ≥ w  ⇔  t ≤ k − ceil(w / capacity)
        need = -(-max(c.unfinished, 0) // c.capacity)
        return max(0, c.k - need)


@dataclass(slots=True)
class CostAware:
    """The critical-path rule above, never with fewer than `reserve` cells training. The reserve is planned
    from the run's own measurements (`sim.plan_reserve`: the simulator, fed the measured workload, runs this
    policy at each reserve 0..K−1 and keeps the fastest): where training needs several cells to keep up,
    lending them to every new burst costs more than it gains, and the best static split's training cells
    are the floor to lend above."""

    reserve: int = 0
    static: bool = False     # planned: hold exactly `reserve` cells training (a static split is fastest)
    name: str = "cost-aware"

    def train_cells(self, c: Counters) -> int:
        e = c.estimates
        if self.static and self.reserve > 0:
            return Async(self.reserve).train_cells(c)
        if e is None or c.capacity <= 0:
            return Waterlevel().train_cells(c)
        return max(self._critical_path(c, e), min(self.reserve, c.k - 1))

    @staticmethod
    def _critical_path(c: Counters, e: Estimates) -> int:
        remaining = sorted(e.remaining_s, reverse=True)
        tail = sorted(e.remaining_tail_s or e.remaining_s, reverse=True)

        def rollout_s(t):              # until the last unfinished execution ends, on the slots t leaves
            return makespan(tail, (c.k - t) * c.capacity)

        level = Waterlevel().train_cells(c)
        # the cell-seconds the waterlevel leaves free for training while the rollout runs: the fleet's, less
        # what the executions' slots take (a cell holds `capacity` of them)
        free = c.k * rollout_s(level) - sum(remaining) / c.capacity
        if e.train_s <= free:                      # training fits beside the rollout: the waterlevel
            return level
        best_t, best = level, math.inf
        for t in range(max(level, 1), c.k + 1):   # training is the critical path: cells stay in it while that
            cost = max(rollout_s(t), e.train_s / t)   # shortens the step
            if cost < best * (1 - 1e-9):
                best_t, best = t, cost
        return best_t


def makespan(remaining: list[float], slots: int) -> float:
    """When the last of the `remaining` durations (longest first) ends on `slots` parallel slots, each taking
    the next one as it frees (longest-first list scheduling)."""
    if not remaining:
        return 0.0
    if slots <= 0:
        return math.inf
    if len(remaining) <= slots:
        return remaining[0]
    ends = list(remaining[:slots])
    heapq.heapify(ends)
    for r in remaining[slots:]:
        heapq.heappush(ends, heapq.heappop(ends) + r)
    return max(ends)


@dataclass(slots=True)
class AdaptiveSwitch:
    """A baseline after verl's separate-async trainer with its rollout switch (`enable_switch`, described from
    its documentation and pull request, not its code): a fixed split of `train` trainer cells, as `async`;
    at a step boundary, when the replay buffer (finished, untrained executions of the burst to train) is
    short, the trainer cells are lent to rollout, and reclaimed once it holds `threshold` × a burst; the
    threshold adapts to how starved the trainer is — raised (×1.25) when reclaimed trainer cells ran out of
    executions to train before the burst was done, lowered (×0.9) after a step they did not."""

    train: int
    threshold: float = 0.5
    lent: bool = False
    starved: bool = False
    version: int = -1
    name: str = "adaptive"

    def train_cells(self, c: Counters) -> int:
        if c.k == 1:
            return Colocated().train_cells(c)
        t = min(self.train, c.k - 1)
        if c.burst_size <= 0:
            return t
        if c.version != self.version:             # a step boundary: adapt, and lend if the buffer is short
            if self.version >= 0 and not self.lent:
                self.threshold = min(1.0, self.threshold * 1.25) if self.starved else max(0.05, self.threshold * 0.9)
            self.version, self.starved = c.version, False
            self.lent = c.ready < self.threshold * c.burst_size
        if self.lent and (c.ready >= self.threshold * c.burst_size or c.ready >= c.untrained > 0):
            self.lent = False                       # reclaimed: enough to train (or all there is)
        elif not self.lent and c.ready == 0 and c.untrained > 0:
            self.starved = True                     # training cells waiting for executions
        return 0 if self.lent else t


def make_policy(name: str, async_train_cells: int = 1) -> RolePolicy:
    if name == "colocated":
        return Colocated()
    if name == "async":
        return Async(async_train_cells)
    if name == "elastic":
        return Waterlevel()
    if name == "cost-aware":
        return CostAware()
    if name == "adaptive":
        return AdaptiveSwitch(async_train_cells)
    raise ValueError(f"elastic.policy: unknown policy {name!r} (colocated, async, elastic, cost-aware, adaptive)")


def roles(k: int, t: int) -> list[str]:
    """Each cell's role when the first `t` train."""
    return [TRAIN if i < t else ROLLOUT for i in range(k)]


def decide(policy: RolePolicy, c: Counters, train_before: int, now: float) -> Decision:
    t = max(0, min(policy.train_cells(c), c.k))
    return Decision(now, policy.name, c.dispatched, c.finished, c.capacity, (c.k - t) * c.capacity,
                    train_before, t)
