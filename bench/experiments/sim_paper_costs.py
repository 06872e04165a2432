"""The paper profiles with and without the costs the simulator models for the baselines: a cell's decoding
slowing as its batch fills (`decode_slowdown`) and rolling-out cells pausing to load each version
(`weight_sync_s`). How much of the paper's speedups do they explain?

    .venv/bin/python bench/experiments/sim_paper_costs.py       # a table; under a minute

Each row keeps a full cell's call time at the profile's (the paper's engines ran full batches), so the
slowdown only makes thinned-out cells faster, as in a real engine. `async` is at its best split of the
sweep, at half the cells (an even split), and at its worst (what a split chosen without a sweep can
cost). "explained" is the share of the paper's speedup over async (in log terms) that the row's
cost-aware speedup over async's best split reaches.
"""
from __future__ import annotations

import dataclasses
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from gyre_core.elastic.comparison import compare  # noqa: E402
from gyre_core.elastic.profiles import full_cell_call, get_profile  # noqa: E402
from gyre_core.elastic.sim import slowdown  # noqa: E402


def variants(name: str) -> dict[str, tuple]:
    """Each row's (workload, fleet) for the profile `name`: without the added costs, with each, with both."""
    p = get_profile(name)
    w = p.workload
    full = w.call_s * slowdown(w, p.capacity)
    rows = {"neither": (0.0, 0.0), "decode slowdown": (w.decode_slowdown, 0.0),
            "weight sync": (0.0, w.weight_sync_s), "both (the profile)": (w.decode_slowdown, w.weight_sync_s)}
    return {label: (full_cell_call(dataclasses.replace(w, decode_slowdown=b, weight_sync_s=s), full, p.capacity), p)
            for label, (b, s) in rows.items()}


def main() -> None:
    print("| profile | costs | colocated | async best (split) | async worst (split) | elastic | cost-aware "
          "| elastic vs colocated | cost-aware vs async best / half / worst | paper vs colocated / async | explained |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name in ("paper-122b", "paper-2.4t"):
        for label, (w, p) in variants(name).items():
            d = compare(w, p.k, p.capacity, p.max_staleness, "best", p.micro_step_executions)
            s = {k: v["step_s"] / 3600 for k, v in d["policies"].items()}
            sweep = d["async_sweep"]
            worst = max(sweep, key=sweep.get)                  # (keys: the split as a string)
            paper_col, paper_async = (sum(p.paper[k]) / 2 for k in ("speedup_vs_colocated", "speedup_vs_async"))
            got = s["async"] / s["cost-aware"]
            print(f"| {name} | {label} | {s['colocated']:.2f} h | {s['async']:.2f} h ({d['async_split']}) | "
                  f"{sweep[worst] / 3600:.2f} h ({worst}) | {s['elastic']:.2f} h | {s['cost-aware']:.2f} h | "
                  f"{s['colocated'] / s['elastic']:.2f}× | {got:.2f}× / {sweep[str(p.k // 2)] / 3600 / s['cost-aware']:.2f}× / "
                  f"{sweep[worst] / 3600 / s['cost-aware']:.2f}× | "
                  f"{paper_col:.2f}× / {paper_async:.2f}× | {math.log(got) / math.log(paper_async):.0%} |")


if __name__ == "__main__":
    main()
