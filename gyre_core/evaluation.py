"""Paired evaluation statistics: before and after RL on the same held-out seeds.

With per-seed outcomes b_i (before) and a_i (after), the paired difference d_i = a_i − b_i has mean
d̄ and standard error s_d/√n; the 95% interval is d̄ ± 1.96·s_d/√n (normal approximation, n ≥ 100).
Pairing removes the between-seed variance that two independent samples would carry.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

Z95 = 1.959963984540054


@dataclass(slots=True)
class EvalResult:
    label: str
    policy: str            # "sampled", "greedy" or "random"
    episodes: int
    success: float
    partial: float
    mean_turns: float
    seeds: list[int]
    successes: list[int]   # per seed, in `seeds` order
    partials: list[float]

    def to_dict(self) -> dict:
        return asdict(self)


def summarize(label: str, policy: str, seeds: list[int], successes: list[bool], partials: list[float],
              turns: list[int]) -> EvalResult:
    n = len(seeds)
    return EvalResult(label, policy, n, sum(successes) / n, sum(partials) / n, sum(turns) / n, list(seeds),
                      [int(s) for s in successes], list(partials))


@dataclass(slots=True)
class PairedDiff:
    n: int
    mean: float
    se: float
    ci95_low: float
    ci95_high: float

    def as_summary(self) -> dict:
        """The run summary's form: {"diff", "ci95_low", "ci95_high"}."""
        return {"diff": self.mean, "ci95_low": self.ci95_low, "ci95_high": self.ci95_high}


def paired_difference(before: list[float], after: list[float]) -> PairedDiff:
    """Mean of after−before per seed with its 95% interval (sample std, n−1)."""
    if len(before) != len(after) or not before:
        raise ValueError("paired difference needs two equally long, non-empty lists")
    n = len(before)
    d = [a - b for a, b in zip(after, before)]
    mean = sum(d) / n
    var = sum((x - mean) ** 2 for x in d) / (n - 1) if n > 1 else 0.0
    se = math.sqrt(var / n)
    return PairedDiff(n, mean, se, mean - Z95 * se, mean + Z95 * se)


def paired(before: EvalResult, after: EvalResult, metric: str = "success") -> PairedDiff:
    """after − before per seed, of success (0/1) or of the partial-progress score (`metric="partial"`: the
    finer measure where successes are rare, as on `long`)."""
    if before.seeds != after.seeds:
        raise ValueError("before and after were evaluated on different seeds; a paired difference needs the same")
    if metric not in ("success", "partial"):
        raise ValueError(f"paired: metric is 'success' or 'partial', not {metric!r}")
    key = "successes" if metric == "success" else "partials"
    return paired_difference([float(x) for x in getattr(before, key)], [float(x) for x in getattr(after, key)])


@dataclass(slots=True)
class Proportion:
    k: int
    n: int
    rate: float
    ci95_low: float
    ci95_high: float


def success_interval(k: int, n: int) -> Proportion:
    """k successes in n episodes with the 95% Wilson score interval (unlike p̂ ± 1.96·√(p̂(1−p̂)/n) it
    stays inside [0, 1] and is not empty at 0 or n successes)."""
    if n <= 0 or not 0 <= k <= n:
        raise ValueError(f"success_interval: need 0 ≤ k ≤ n and n > 0, got k={k}, n={n}")
    p, z2 = k / n, Z95 * Z95
    centre = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = Z95 / (1 + z2 / n) * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n))
    return Proportion(k, n, p, max(0.0, centre - half), min(1.0, centre + half))
