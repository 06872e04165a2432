"""Elastic vs async vs colocated in the simulator as training's share of the work grows, and as the fleet's
slots per cell and the staleness bound change.

    .venv/bin/python bench/experiments/sim_train_share.py           # two tables; a few seconds

The fleet and workload are the elastic bench's emulated K = 8 ones (`bench.elastic.WORKLOAD`: 64
executions a step, calls lognormal median 10 σ 0.9 capped at 40) at round device costs (a call 0.03 s, an
environment turn 0.06 s), 16 steps, `max_staleness` 1; only the training cost per trained call changes.
Each row prints the step times (the waterlevel `elastic` and the `cost-aware` policy beside colocated and
async), async's best split, the speedups, and the share of device
work that is training (train_s over train_s + call_s, per call). The second table keeps the training cost
at 0.004 s a call and varies the slots per cell (8: one burst fills the fleet) and `max_staleness`, with
the floor under any policy (`sim.step_s_floor`) and async at its worst split of the sweep (what a split
chosen without the sweep can cost).
"""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.elastic import CAPACITY_EMULATED, K_EMULATED, MICRO_EMULATED, WORKLOAD  # noqa: E402
from gyre_core.elastic.comparison import compare  # noqa: E402
from gyre_core.elastic.sim import step_s_floor  # noqa: E402

TRAIN_S_PER_CALL = (0.002, 0.004, 0.01, 0.02, 0.05, 0.1)
CAPACITIES, STALENESS = (8, 16, 32), (1, 2)


def main() -> None:
    vs_static = tables(print)
    print("\nmin_vs_best_static (the worst ratio to async's best split over both tables): " +
          ", ".join(f"{p} {min(v):.3f}" for p, v in vs_static.items()))


def min_vs_best_static() -> dict[str, float]:
    """The worst ratio of each policy's step time to async's best split over both tables' regimes."""
    return {p: min(v) for p, v in tables(lambda *_: None).items()}


def tables(out) -> dict[str, list[float]]:
    """Both tables, each line handed to `out`; returns each policy's ratios to the best static split."""
    print = out           # noqa: A001 - the tables go wherever the caller says
    base = dataclasses.replace(WORKLOAD, call_s=0.03, env_s=0.06, optimizer_s=0.05, steps=16)
    vs_static = {"elastic": [], "cost-aware": [], "adaptive": []}   # each policy over the best static split
    print("| train s / call | training share | colocated | async (split) | elastic | cost-aware | adaptive (verl-style) "
          "| elastic vs colocated / async | cost-aware vs colocated / async |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for t in TRAIN_S_PER_CALL:
        w = dataclasses.replace(base, train_s_per_call=t)
        share = t / (t + w.call_s)          # per trained call: training's device seconds over all of them
        d = compare(w, K_EMULATED, CAPACITY_EMULATED, 1, "best", MICRO_EMULATED)
        s = {p: d["policies"][p]["step_s"] for p in d["policies"]}
        for p in vs_static:
            vs_static[p].append(s["async"] / s[p])
        print(f"| {t} | {share:.0%} | {s['colocated']:.2f} s | {s['async']:.2f} s ({d['async_split']}) | "
              f"{s['elastic']:.2f} s | {s['cost-aware']:.2f} s | {s['adaptive']:.2f} s | {d['speedup_vs_colocated']:.2f}× / "
              f"{d['speedup_vs_async']:.2f}× | {d['cost_aware_vs_colocated']:.2f}× / {d['cost_aware_vs_async']:.2f}× |")
    w = dataclasses.replace(base, train_s_per_call=0.004)
    print("\n| slots per cell | max_staleness | colocated | async (split) | async, worst split | elastic | cost-aware "
          "| floor | elastic vs async | cost-aware vs async |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for cap in CAPACITIES:
        for st in STALENESS:
            d = compare(w, K_EMULATED, cap, st, "best", MICRO_EMULATED)
            s = {p: d["policies"][p]["step_s"] for p in d["policies"]}
            for p in vs_static:
                vs_static[p].append(s["async"] / s[p])
            worst = max(d["async_sweep"], key=d["async_sweep"].get)
            floor = step_s_floor(w, K_EMULATED, cap, st)
            print(f"| {cap} | {st} | {s['colocated']:.2f} s | {s['async']:.2f} s ({d['async_split']}) | "
                  f"{d['async_sweep'][worst]:.2f} s ({worst}) | {s['elastic']:.2f} s | {s['cost-aware']:.2f} s | "
                  f"{floor:.2f} s | {d['speedup_vs_async']:.2f}× | {d['cost_aware_vs_async']:.2f}× |")
    return vs_static


if __name__ == "__main__":
    main()
