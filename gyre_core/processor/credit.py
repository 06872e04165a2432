"""Credit assignment on a trajectory tree: per-token advantages along a selected root-to-leaf path.

    cfg = CreditConfig(mode="tree", shrink_k=2.0)
    tc = tree_credit(tree, rewards, cfg)                     # node values and step terms (None for grpo)
    adv = path_advantages(tree, nodes, part, exec_adv, tc, cfg)   # one float per token of the path

Modes:
- `grpo`: every token of an execution's paths gets the execution's group-relative advantage (the number
  `batch.group_advantages` gives, passed in as `exec_adv`), exactly as the flat `batch.py` path does.
- `tree`: node value V(n) = mean reward over the leaf occurrences below n (each duplicate context counts,
  i.e. multiplicity-weighted); a node's tokens get exec_adv + tree_coef · (V'(n) − V(parent)) with
  V'(n) = (c·V(n) + k·V(parent)) / (c + k), c = occurrences below n, k = `shrink_k` (0: no shrinkage).
  So the tree term is c/(c+k) · (V(n) − V(parent)): thin nodes are pulled toward their parent, and below
  the last branch point V(n) = V(parent) and the term is 0, which is why the execution-level term stays.
  Radix nodes split at call ends as well as at forks; a node with one child and no leaf of its own has
  the child's value, so only real branch points (and context ends inside another path) move the value.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import numpy as np

from .tree import TrajectoryTree

MODES = ("grpo", "tree")


@dataclass(slots=True)
class CreditConfig:
    mode: str = "grpo"        # "grpo" or "tree"
    shrink_k: float = 0.0     # pseudo-count pulling a node's value toward its parent's (0: none)
    tree_coef: float = 1.0    # scale of the tree term added to the execution-level advantage

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"credit mode {self.mode!r}: expected one of {MODES}")
        if self.shrink_k < 0:
            raise ValueError("shrink_k must be ≥ 0")


@dataclass(slots=True)
class TreeCredit:
    value: np.ndarray   # V per node (nan where no scored occurrence is below)
    count: np.ndarray   # scored leaf occurrences below each node
    step: np.ndarray    # the tree term c/(c+k)·(V − V_parent) per node (0 at the root and where undefined)


def node_values(tree: TrajectoryTree, rewards: Mapping[str, float],
                multiplicity: Mapping[str, int] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(V, count) per node: the mean reward of the leaf occurrences below it and how many there are.
    An execution standing for `multiplicity[id]` identical ones (default 1) counts that many times."""
    mult = multiplicity or {}
    total = np.zeros(tree.n_nodes, dtype=np.float64)
    count = np.zeros(tree.n_nodes, dtype=np.int64)
    for lf in tree.leaves:
        for e, _ in lf.occurrences:
            eid = tree.execution_ids[e]
            r = rewards.get(eid)
            if r is not None:
                m = mult.get(eid, 1)
                total[lf.node] += m * r
                count[lf.node] += m
    parent = tree.node_parent
    for n in tree.topological()[::-1].tolist():    # children before parents
        if n > 0:
            total[parent[n]] += total[n]
            count[parent[n]] += count[n]
    with np.errstate(invalid="ignore", divide="ignore"):
        value = np.where(count > 0, total / np.maximum(count, 1), np.nan)
    return value, count


def tree_credit(tree: TrajectoryTree, rewards: Mapping[str, float], cfg: CreditConfig,
                multiplicity: Mapping[str, int] | None = None) -> TreeCredit | None:
    """Node values and step terms for `tree` mode; None for `grpo` (nothing to compute)."""
    if cfg.mode == "grpo":
        return None
    value, count = node_values(tree, rewards, multiplicity)
    vp = value[np.maximum(tree.node_parent, 0)]
    c = count.astype(np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        step = c / (c + cfg.shrink_k) * (value - vp)
    step[0] = 0.0
    step[~np.isfinite(step)] = 0.0
    return TreeCredit(value, count, step)


def path_advantages(nodes: np.ndarray, part: np.ndarray, exec_adv: float, credit: TreeCredit | None,
                    cfg: CreditConfig) -> np.ndarray:
    """One advantage per token of a path given as its nodes (root excluded) and tokens taken from each."""
    n = int(part.sum())
    if credit is None:
        return np.full(n, float(exec_adv), dtype=np.float64)
    return float(exec_adv) + cfg.tree_coef * np.repeat(credit.step[nodes], part)
