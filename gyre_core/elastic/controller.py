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
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

ROLLOUT, TRAIN = "rollout", "train"


@dataclass(slots=True, frozen=True)
class Counters:
    """What the controller sees at one moment."""

    k: int                # cells alive
    capacity: int         # executions one rollout cell holds at once
    dispatched: int       # d: executions handed to the router so far (cumulative)
    finished: int         # f: executions that have ended (cumulative)

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


def make_policy(name: str, async_train_cells: int = 1) -> RolePolicy:
    if name == "colocated":
        return Colocated()
    if name == "async":
        return Async(async_train_cells)
    if name == "elastic":
        return Waterlevel()
    raise ValueError(f"elastic.policy: unknown policy {name!r} (colocated, async, elastic)")


def roles(k: int, t: int) -> list[str]:
    """Each cell's role when the first `t` train."""
    return [TRAIN if i < t else ROLLOUT for i in range(k)]


def decide(policy: RolePolicy, c: Counters, train_before: int, now: float) -> Decision:
    t = max(0, min(policy.train_cells(c), c.k))
    return Decision(now, policy.name, c.dispatched, c.finished, c.capacity, (c.k - t) * c.capacity,
                    train_before, t)
