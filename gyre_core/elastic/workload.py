"""The workload both the emulated runtime and the simulator run: bursts of long-tailed executions.

    w = Workload.from_dict({"executions_per_step": 32, "calls_median": 12, ...})
    w.calls(step=0)          # model calls of each execution of burst 0 (deterministic per seed, step)

An execution alternates a model call (`call_s` of device time on a rollout cell, alone there) and an
environment turn (`env_s`: tool or sandbox latency, no device). A cell decodes its calls as one batch, and
a bigger batch is slower per token: each other call in flight on the cell adds `decode_slowdown` (β,
measured on real cells by `bench/decode_load.py`) to a token's time. Each published version pauses the
rollout cells for `weight_sync_s` while they load it (a separate rollout engine receiving the trainer's
weights). How many calls an execution makes is lognormal (median `calls_median`, shape `calls_sigma`) and capped at `max_calls` — the timeout: an execution that
reaches the cap is cut off there, as a real harness's wall-clock limit cuts it. Training one
execution costs `train_s_per_call` per call on one cell (its tokens grow with its calls); a step
ends with the core's optimizer step (`optimizer_s`) and a weight publish (`publish_s`). Times are
seconds of the device the workload was calibrated on; `trace` replaces the lognormal by resampling
measured call counts (from a lake).
"""
from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass, field, fields

from ..seeds import stream


@dataclass(slots=True, frozen=True)
class Workload:
    name: str = "custom"
    executions_per_step: int = 64      # one burst: tasks × G
    steps: int = 4
    calls_median: float = 12.0
    calls_sigma: float = 0.8
    max_calls: int = 60                # the timeout cap, in calls
    call_s: float = 0.05               # device seconds per model call
    env_s: float = 0.02                # environment latency per call
    train_s_per_call: float = 0.004    # device seconds to train one call's tokens on one cell
    optimizer_s: float = 0.05
    publish_s: float = 0.05
    switch_to_train_s: float = 0.05
    switch_to_rollout_s: float = 0.05
    decode_slowdown: float = 0.0       # β: a call's tokens take 1 + β·(other calls in flight on its cell) longer
    weight_sync_s: float = 0.0         # a rollout cell's pause to load each published version
    seed: int = 0
    trace: tuple[int, ...] = field(default=())   # measured calls per execution, resampled when given

    @classmethod
    def from_dict(cls, d: dict) -> "Workload":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"workload: unknown keys {unknown} (allowed: {sorted(known)})")
        d = dict(d)
        if "trace" in d:
            d["trace"] = tuple(int(x) for x in d["trace"])
        return cls(**d)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["trace"] = list(self.trace)
        return d

    def calls(self, step: int) -> list[int]:
        """Model calls of each execution of burst `step`, ≥ 1 and ≤ `max_calls`."""
        rng = random.Random(stream(self.seed, step))
        out = []
        for _ in range(self.executions_per_step):
            if self.trace:
                n = rng.choice(self.trace)
            else:
                n = round(math.exp(math.log(self.calls_median) + self.calls_sigma * rng.gauss(0.0, 1.0)))
            out.append(max(1, min(int(n), self.max_calls)))
        return out

    def execution_s(self, n_calls: int) -> float:
        """Wall time of an execution of `n_calls` calls when nothing waits for a device."""
        return n_calls * (self.call_s + self.env_s)

    def train_s(self, n_calls: int) -> float:
        return n_calls * self.train_s_per_call

    def scaled(self, factor: float) -> "Workload":
        """The same workload with every duration multiplied by `factor` (emulation at a faster clock)."""
        d = self.to_dict()
        for k in ("call_s", "env_s", "train_s_per_call", "optimizer_s", "publish_s",
                  "switch_to_train_s", "switch_to_rollout_s", "weight_sync_s"):
            d[k] *= factor
        return Workload.from_dict(d)
