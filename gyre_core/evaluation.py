"""Paired evaluation statistics: before and after RL on the same held-out seeds.

With per-seed outcomes b_i (before) and a_i (after), the paired difference d_i = a_i − b_i has mean
d̄ and standard error s_d/√n; the 95% interval is d̄ ± 1.96·s_d/√n (normal approximation, n ≥ 100).
Pairing removes the between-seed variance that two independent samples would carry.

For success (0/1 per seed) the interval is Agresti and Min's (2005): the same Wald form after adding half
an episode to each of the four cells of the before × after table. With few discordant pairs — seeds that
only one of the two policies solved — the plain interval collapses: 3/100 successes before and after on the
same seeds give d_i = 0 everywhere and [+0, +0], as if the difference were known exactly. The adjusted one
stays about ±2 points wide there, and at hundreds of seeds it differs from the plain one by well under 0.1
points.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields

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

    @classmethod
    def of(cls, d: dict) -> "EvalResult":
        """From an evaluation marker's entry, which holds more figures beside these (agent statistics)."""
        return cls(**{f.name: d[f.name] for f in fields(cls)})


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


def paired_binary(before: list[int], after: list[int]) -> PairedDiff:
    """after − before per seed of 0/1 outcomes: the observed mean difference with Agresti–Min's 95% interval
    (module docstring). `se` is the adjusted one the interval uses."""
    if len(before) != len(after) or not before:
        raise ValueError("paired difference needs two equally long, non-empty lists")
    if any(x not in (0, 1) for x in (*before, *after)):
        raise ValueError("paired_binary: outcomes must be 0 or 1")
    n = len(before)
    gained = sum(1 for b, a in zip(before, after) if a > b)      # solved only after
    lost = sum(1 for b, a in zip(before, after) if b > a)        # solved only before
    m = n + 2                                                    # half an episode in each of the four cells
    p_gain, p_loss = (gained + 0.5) / m, (lost + 0.5) / m
    centre = p_gain - p_loss
    se = math.sqrt((p_gain + p_loss - centre ** 2) / m)
    return PairedDiff(n, (gained - lost) / n, se, centre - Z95 * se, centre + Z95 * se)


def paired(before: EvalResult, after: EvalResult, metric: str = "success") -> PairedDiff:
    """after − before per seed, of success (0/1, `paired_binary`) or of the partial-progress score
    (`metric="partial"`: the finer measure where successes are rare, as on `long`; `paired_difference`)."""
    if before.seeds != after.seeds:
        raise ValueError("before and after were evaluated on different seeds; a paired difference needs the same")
    if metric not in ("success", "partial"):
        raise ValueError(f"paired: metric is 'success' or 'partial', not {metric!r}")
    if metric == "success":
        return paired_binary(list(before.successes), list(after.successes))
    return paired_difference(list(before.partials), list(after.partials))


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
