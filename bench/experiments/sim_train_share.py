"""Elastic vs async vs colocated in the simulator as training's share of the work grows, and as the fleet's
slots per cell and the staleness bound change.

    .venv/bin/python bench/experiments/sim_train_share.py           # two tables; a few seconds

The fleet and workload are the elastic bench's emulated K = 8 ones (`bench.elastic.WORKLOAD`: 64
executions a step, calls lognormal median 10 σ 0.9 capped at 40) at round device costs (a call 0.03 s, an
environment turn 0.06 s), 16 steps, `max_staleness` 1; only the training cost per trained call changes.
Each row prints the three step times, async's best split, elastic's speedups, and the share of device
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
    base = dataclasses.replace(WORKLOAD, call_s=0.03, env_s=0.06, optimizer_s=0.05, steps=16)
    print("| train s / call | training share | colocated | async (split) | elastic | vs colocated | vs async |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for t in TRAIN_S_PER_CALL:
        w = dataclasses.replace(base, train_s_per_call=t)
        share = t / (t + w.call_s)          # per trained call: training's device seconds over all of them
        d = compare(w, K_EMULATED, CAPACITY_EMULATED, 1, "best", MICRO_EMULATED)
        s = {p: d["policies"][p]["step_s"] for p in ("colocated", "async", "elastic")}
        print(f"| {t} | {share:.0%} | {s['colocated']:.2f} s | {s['async']:.2f} s ({d['async_split']}) | "
              f"{s['elastic']:.2f} s | {d['speedup_vs_colocated']:.2f}× | {d['speedup_vs_async']:.2f}× |")
    w = dataclasses.replace(base, train_s_per_call=0.004)
    print("\n| slots per cell | max_staleness | colocated | async (split) | async, worst split | elastic | floor "
          "| vs colocated | vs async |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for cap in CAPACITIES:
        for st in STALENESS:
            d = compare(w, K_EMULATED, cap, st, "best", MICRO_EMULATED)
            s = {p: d["policies"][p]["step_s"] for p in ("colocated", "async", "elastic")}
            worst = max(d["async_sweep"], key=d["async_sweep"].get)
            floor = step_s_floor(w, K_EMULATED, cap, st)
            print(f"| {cap} | {st} | {s['colocated']:.2f} s | {s['async']:.2f} s ({d['async_split']}) | "
                  f"{d['async_sweep'][worst]:.2f} s ({worst}) | {s['elastic']:.2f} s | {floor:.2f} s | "
                  f"{d['speedup_vs_colocated']:.2f}× | {d['speedup_vs_async']:.2f}× |")


if __name__ == "__main__":
    main()
