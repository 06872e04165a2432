"""How far the role policies sit above the floor on the elastic bench's rollout-heavy workload, and how much of
that gap is not knowing which executions will be long.

    .venv/bin/python bench/experiments/sim_floor_gap.py          # one table; about a minute

The fleet and workload are the elastic bench's emulated K = 8 ones (`bench.elastic.WORKLOAD`: 64 executions
a step for 64 slots, calls lognormal median 10 σ 0.9 capped at 40) at round device costs (a call 0.03 s, an
environment turn 0.05 s, 0.004 s of training per call: rollout-heavy), `max_staleness` 1, for the bench's
4 steps and for 16. Each policy runs twice: as a runtime can (queued executions take free slots first in,
first out) and with an oracle that knows every execution's length when it is dispatched and starts the
longest first (`simulate(..., knows_lengths=True)`). The floor (`sim.step_s_floor`) assumes more still:
each burst's longest execution alone on a cell from its dispatch. Its ratio to async's best split is the
most any policy could beat that split by.
"""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.elastic import CAPACITY_EMULATED, K_EMULATED, MICRO_EMULATED, WORKLOAD  # noqa: E402
from gyre_core.elastic.sim import simulate, step_s_floor  # noqa: E402

POLICIES = ("elastic", "cost-aware")


def gap(steps: int, decode_slowdown: float = 0.034) -> dict:
    """Step times (s) of async's best split and of each policy, as a runtime and as the oracle, and the floor."""
    w = dataclasses.replace(WORKLOAD, call_s=0.03, env_s=0.05, optimizer_s=0.05, train_s_per_call=0.004,
                            decode_slowdown=decode_slowdown, steps=steps)
    k, cap, micro = K_EMULATED, CAPACITY_EMULATED, MICRO_EMULATED
    out = {"steps": steps, "floor": step_s_floor(w, k, cap, 1)}
    for oracle in (False, True):
        tag = "oracle" if oracle else "online"
        out[f"async/{tag}"] = min(simulate(w, k, cap, "async", split, 1, micro, knows_lengths=oracle).step_s
                                  for split in range(1, k))
        for p in POLICIES:
            out[f"{p}/{tag}"] = simulate(w, k, cap, p, 1, 1, micro, knows_lengths=oracle).step_s
    return out


def main() -> None:
    print("| steps | floor | most over async's best split | async best: online / oracle | "
          + " | ".join(f"{p}: online / oracle" for p in POLICIES) + " | elastic vs async, online |")
    print("|---:|---:|---:|---:|" + "---:|" * len(POLICIES) + "---:|")
    for steps in (4, 16):
        g = gap(steps)
        fl = g["floor"]
        cells = [f"{g[f'{p}/online'] / fl:.3f}× / {g[f'{p}/oracle'] / fl:.3f}×" for p in ("async", *POLICIES)]
        print(f"| {steps} | {fl:.3f} s | {g['async/online'] / fl:.3f}× | " + " | ".join(cells)
              + f" | {g['async/online'] / g['elastic/online']:.3f}× |")
    print("\n(each policy's step time as a multiple of the floor)")


if __name__ == "__main__":
    main()
