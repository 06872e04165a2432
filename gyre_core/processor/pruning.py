"""Loop pruning: cut a path once the agent repeats the same (action, observation) cycle too often.

    cuts = prune_loops(tree, PruneConfig(max_repeats=2, max_period=8))   # {leaf_id: Cut}
    cut = find_cycle(step_hashes, max_repeats=2, max_period=8)          # on any list of step hashes

A step is an action (a maximal run of generated tokens) and the observation after it (the following run
of injected tokens); the preamble before the first action belongs to no step. Steps are hashed
(blake2b of their token ids). When a block of ℓ ≤ `max_period` consecutive steps occurs more than
`max_repeats` times in a row, the path is cut before the first action of the (max_repeats+1)-th
occurrence: the first `max_repeats` repetitions are kept, everything after is neither forwarded nor
trained. Cuts are per leaf (leaves are exact token paths, so they do not depend on the execution).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from .tree import TrajectoryTree


@dataclass(slots=True)
class PruneConfig:
    max_repeats: int = 2      # repetitions of a cycle kept
    max_period: int = 8       # longest cycle (in steps) looked for


@dataclass(slots=True)
class Cut:
    depth: int                # tokens kept: [0, depth)
    step: int                 # index of the first dropped step
    period: int               # cycle length in steps
    repeats: int              # repetitions of the cycle in a row (> max_repeats)
    pruned_tokens: int
    pruned_generated: int
    reason: str


def path_steps(gen: np.ndarray) -> list[tuple[int, int, int]]:
    """(action start, action end = observation start, observation end) of each step of a path."""
    g = np.asarray(gen, dtype=np.int8)
    edges = np.flatnonzero(np.diff(np.concatenate([[0], g, [0]])))   # run starts/ends of generated tokens
    starts, ends = edges[0::2], edges[1::2]
    nxt = np.concatenate([starts[1:], [len(g)]])
    return list(zip(starts.tolist(), ends.tolist(), nxt.tolist()))


def step_hashes(tok: np.ndarray, steps: list[tuple[int, int, int]]) -> list[bytes]:
    out = []
    t = np.asarray(tok, dtype=np.int64)
    for a, o, z in steps:
        h = hashlib.blake2b(digest_size=16)
        h.update(t[a:o].tobytes())
        h.update(b"|")
        h.update(t[o:z].tobytes())
        out.append(h.digest())
    return out


def find_cycle(hashes: list, max_repeats: int, max_period: int) -> tuple[int, int, int] | None:
    """(first dropped step, period, repetitions in a row) of the earliest cycle repeated more than
    `max_repeats` times, or None. run[ℓ] counts consecutive steps equal to the step ℓ before."""
    n = len(hashes)
    run = [0] * (max_period + 1)
    for i in range(1, n):
        for lag in range(1, min(max_period, i) + 1):
            run[lag] = run[lag] + 1 if hashes[i] == hashes[i - lag] else 0
            if run[lag] >= max_repeats * lag:
                total = run[lag]
                j = i + 1
                while j < n and hashes[j] == hashes[j - lag]:
                    total += 1
                    j += 1
                return i - lag + 1, lag, (total + lag) // lag
    return None


def prune_loops(tree: TrajectoryTree, cfg: PruneConfig | None = None) -> dict[int, Cut]:
    """Cuts for the leaves of `tree` whose paths loop (leaf index -> Cut)."""
    cfg = cfg or PruneConfig()
    if cfg.max_repeats < 1 or cfg.max_period < 1:
        raise ValueError("max_repeats and max_period must be ≥ 1")
    cuts: dict[int, Cut] = {}
    for i, lf in enumerate(tree.leaves):
        nodes = tree.path_nodes(lf.node)
        if not len(nodes):
            continue
        tok = np.concatenate([tree.tok[tree.node_start[k]:tree.node_start[k] + tree.node_len[k]] for k in nodes])
        gen = np.concatenate([tree.gen[tree.node_start[k]:tree.node_start[k] + tree.node_len[k]] for k in nodes])
        steps = path_steps(gen)
        found = find_cycle(step_hashes(tok, steps), cfg.max_repeats, cfg.max_period)
        if found is None:
            continue
        j, period, repeats = found
        depth = steps[j][0]
        cuts[i] = Cut(depth, j, period, repeats, lf.depth - depth, int(gen[depth:].sum()),
                      f"loop: a cycle of {period} step(s) repeated {repeats} times in a row from step "
                      f"{j - cfg.max_repeats * period}; kept {cfg.max_repeats}, cut at step {j} (depth {depth})")
    return cuts
