"""The role policies side by side on one workload and fleet, as `gyre sim` reports them.

    from gyre_core.elastic.comparison import compare, compare_results, format_comparison
    compare(workload, k=8, capacity=16)          # a dict: per-policy figures, elastic's speedups, the async split
    print(format_comparison(compare_results(workload, 8, 16), "my fleet"))

Each policy is one run of the discrete-event model (`gyre_core.elastic.sim`); async is taken at its best
static split unless one is given.
"""
from __future__ import annotations

from dataclasses import dataclass

from .sim import POLICIES, SimResult, simulate, step_s_floor
from .workload import Workload


@dataclass(slots=True)
class Comparison:
    """The policies side by side on one workload and fleet."""

    results: dict[str, SimResult]
    async_split: int | None
    async_sweep: dict[int, float]    # split -> step_s (one entry unless the split was swept)
    workload: Workload
    k: int
    capacity: int
    max_staleness: int
    micro_step_executions: int

    @property
    def step_s_floor(self) -> float:
        return step_s_floor(self.workload, self.k, self.capacity, self.max_staleness)

    @property
    def max_speedup_vs_async(self) -> float | None:
        """What any policy could gain over the async split at most: its step time over the floor."""
        a = self.results.get("async")
        return a.step_s / self.step_s_floor if a else None

    def speedup(self, of: str, over: str) -> float | None:
        a, b = self.results.get(of), self.results.get(over)
        return b.step_s / a.step_s if a and b and a.step_s > 0 else None

    def to_dict(self) -> dict:
        return {"policies": {n: r.to_dict() for n, r in self.results.items()},
                "speedup_vs_colocated": self.speedup("elastic", "colocated"),
                "speedup_vs_async": self.speedup("elastic", "async"),
                "cost_aware_vs_colocated": self.speedup("cost-aware", "colocated"),
                "cost_aware_vs_async": self.speedup("cost-aware", "async"),
                "cost_aware_vs_elastic": self.speedup("cost-aware", "elastic"),
                "cost_aware_vs_floor": (self.results["cost-aware"].step_s / self.step_s_floor
                                        if "cost-aware" in self.results else None),   # (≥ 1: over the floor)
                "adaptive_baseline_vs_async": self.speedup("adaptive", "async"),
                "cost_aware_vs_adaptive": self.speedup("cost-aware", "adaptive"),
                "async_split": self.async_split, "async_sweep": {str(s): v for s, v in self.async_sweep.items()},
                "step_s_floor": self.step_s_floor,
                "max_speedup_vs_async": self.max_speedup_vs_async,
                "fleet": {"k": self.k, "capacity": self.capacity, "max_staleness": self.max_staleness,
                          "micro_step_executions": self.micro_step_executions},
                "workload": self.workload.to_dict()}


def compare_results(workload: Workload, k: int, capacity: int, max_staleness: int = 1,
                    async_split: int | str = "best", micro_step_executions: int = 4,
                    policies: tuple[str, ...] = POLICIES) -> Comparison:
    """Simulate each policy; for async, `best` sweeps every split 1..K−1 and keeps the fastest (with
    K = 1 there is no async split, and async is left out)."""
    results: dict[str, SimResult] = {}
    sweep: dict[int, float] = {}
    split = None
    for name in policies:
        if name == "adaptive":      # verl's switch on async's (best) split: the baseline as its users would run it
            if k >= 2:
                results[name] = simulate(workload, k, capacity, name, split or 1, max_staleness, micro_step_executions)
            continue
        if name != "async":
            results[name] = simulate(workload, k, capacity, name, 1, max_staleness, micro_step_executions)
            continue
        if k < 2:
            continue
        splits = range(1, k) if async_split == "best" else [int(async_split)]
        runs = {s: simulate(workload, k, capacity, "async", s, max_staleness, micro_step_executions) for s in splits}
        sweep = {s: r.step_s for s, r in runs.items()}
        split = min(runs, key=lambda s: (runs[s].step_s, s))
        results["async"] = runs[split]
    return Comparison(results, split, sweep, workload, k, capacity, max_staleness, micro_step_executions)


def compare(workload: Workload, k: int, capacity: int, max_staleness: int = 1, async_split: int | str = "best",
            micro_step_executions: int = 4) -> dict:
    """`compare_results(...).to_dict()`: per-policy figures, elastic's and cost-aware's speedups, the async
    split."""
    return compare_results(workload, k, capacity, max_staleness, async_split, micro_step_executions).to_dict()


# -- reporting (gyre sim) ---------------------------------------------------------------------------------
def fmt_s(seconds: float) -> str:
    """A duration in the unit a person reads it in."""
    if seconds >= 2 * 3600:
        return f"{seconds / 3600:.2f} h"
    if seconds >= 120:
        return f"{seconds / 60:.1f} min"
    return f"{seconds:.2f} s"


def format_comparison(c: Comparison, title: str, paper: dict | None = None) -> str:
    """The side-by-side table `gyre sim` prints."""
    w = c.workload
    lines = [f"gyre sim — {title}: K={c.k} cells × {c.capacity} slots, {w.executions_per_step} executions a burst, "
             f"{w.steps} steps, max_staleness {c.max_staleness}, micro-steps of {c.micro_step_executions}",
             f"{'policy':<12}{'step':>11}{'busy':>8}{'rollout':>9}{'train':>8}{'switches':>10}{'moved':>8}"]
    for name, r in c.results.items():
        label = f"{name}({r.async_train_cells})" if name in ("async", "adaptive") else name
        lines.append(f"{label:<12}{fmt_s(r.step_s):>11}{r.busy_frac:>8.3f}{r.busy_frac_rollout:>9.3f}"
                     f"{r.busy_frac_train:>8.3f}{r.switches:>10d}{r.moved_executions:>8d}")
    lines.append("(busy: fraction of cell-seconds with device work, overall and in each role; "
                 "moved: executions moved off a cell leaving rollout)")
    for policy in ("elastic", "cost-aware"):
        sc, sa = c.speedup(policy, "colocated"), c.speedup(policy, "async")
        if sc is not None or sa is not None:
            parts = [f"{v:.2f}× vs {n}" for v, n in ((sc, "colocated"), (sa, "async")) if v is not None]
            lines.append(f"{policy} speedup: " + ", ".join(parts))
    floor = c.step_s_floor
    lines.append(f"floor under any policy (work over K cells, or the staleness-gated critical path): "
                 f"{fmt_s(floor)} a step" + (f"; elastic at {c.results['elastic'].step_s / floor:.2f}× it"
                                             if "elastic" in c.results else ""))
    if c.max_speedup_vs_async is not None:
        lines.append(f"  → no policy can beat async by more than {c.max_speedup_vs_async:.2f}× "
                     "on this fleet and workload")
    if len(c.async_sweep) > 1:
        lines.append("async splits (train cells → step): " +
                     ", ".join(f"{s}→{fmt_s(v)}" for s, v in c.async_sweep.items()) + f"; best {c.async_split}")
    if paper:
        rng = lambda lo_hi: f"{lo_hi[0]:.2f}×" if lo_hi[0] == lo_hi[1] else f"{lo_hi[0]:.2f}–{lo_hi[1]:.2f}×"  # noqa: E731
        lines.append(f"the paper reports: {rng(paper['speedup_vs_colocated'])} vs colocated, "
                     f"{rng(paper['speedup_vs_async'])} vs async")
    return "\n".join(lines)


def write_timelines(c: Comparison, target: str, label: str) -> dict[str, str]:
    """One PNG per policy. `target` ending in .png names the file (with several policies, `-<policy>` is
    added before the suffix); otherwise it is a directory and files are `<label>-<policy>.png`."""
    from .timeline import plot_timeline

    out = {}
    for name, r in c.results.items():
        if target.endswith(".png"):
            path = target if len(c.results) == 1 else f"{target[:-4]}-{name}.png"
        else:
            path = f"{target.rstrip('/')}/{label}-{name}.png"
        split = f", {r.async_train_cells} train cell(s)" if name == "async" else ""
        title = f"{label} · {name}{split} · step {fmt_s(r.step_s)} · busy {r.busy_frac:.2f}"
        out[name] = plot_timeline(path, r.role_spans, r.busy_spans, r.switch_marks, title, r.decisions, r.load)
    return out
