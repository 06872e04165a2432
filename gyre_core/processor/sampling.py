"""Bounded dedup sampling: which root-to-leaf paths of the trees are trained, with which token weights.

    batch = tree_batch(records, advantages, rewards, sampling=SamplingConfig(j_max=5),
                       credit=CreditConfig(mode="tree"), prune=PruneConfig())
    batch.sequences     # list[TrainSequence]: one per selected (execution, leaf), full root-to-leaf path
    batch.normaliser    # the number of executions averaged over (two-level averaging)
    tables = batch_tables(run_id, step, batch)    # tree_nodes, tree_leaves, tree_paths, train_segments, exclusions

Per execution (leaves it has an occurrence at), repeated up to `j_max` times:
1. the highest-priority role (`role_order`) that still has a leaf with uncovered generated tokens
   (and, under a token budget, a leaf that still fits) is chosen;
2. a leaf of that role is drawn with probability ∝ its uncovered generated tokens (each execution draws
   from a random stream of its own, seeded by the step's seed and its id within the run);
3. its root-to-leaf path is marked covered for the execution (so a shared prefix counts once).
Executions take turns (round j gives every execution its j-th path, in a random order), so a step-wide
`token_budget` cannot be spent by a few executions. The budget counts packed tokens: a path costs only
its tokens below the nearest already-selected ancestor in the task's tree (any execution's); costs only
shrink as more is selected, so a cached cost is an upper bound and is recomputed only when it does not
fit (lazy greedy). A path that does not fit is skipped; the execution may still take one that fits.

Token weights (generated tokens only; injected tokens are context):
- `loss_once`: a generated token is weighted on the first selected path of its execution through it
  and 0 on later ones; the execution's weights are 1 / (its distinct covered generated tokens).
- `per_branch`: weighted on every selected path through it (× the number of the execution's contexts
  that end at the leaf); 1 / (the sum of those counts): the same as training each branch separately.
Either way an execution's weights sum to 1 and `normaliser` = executions with a weighted token.
Advantages come from `credit.path_advantages`; as in `batch.py` a token with weight 0 gets advantage 0.

Deduplicated executions (`multiplicity`, see `gyre_core.lake.dedup`): a kept execution that stands for m
identical ones is in the trees once; its weights sum to m, it counts m times in `normaliser` and in tree
credit (node values and counts), as if all m were there. The m duplicates would have the same candidate
leaves, so when the sampler takes every leaf (no `j_max` or budget cut) this is exactly the batch with
the duplicates present; when it cuts, the m independent draws become one draw weighted m: the same
expectation, a higher variance. Leaf multiplicities in `tree_leaves` count the kept executions' contexts.
Covered sets are unions of root paths, so "covered" is stored as a per-node count of covered leading
tokens, and a leaf's covered part is a prefix of its path, found from its deepest covered node.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Mapping

import numpy as np
import pyarrow as pa

from ..records import ROLES, ExecutionRecord
from .batch import TrainSequence
from .credit import CreditConfig, TreeCredit, path_advantages, tree_credit
from .pruning import Cut, PruneConfig, prune_loops
from .tree import TrajectoryTree, build_forest, tree_leaves_table, tree_nodes_table

WEIGHTINGS = ("loss_once", "per_branch")


@dataclass(slots=True)
class SamplingConfig:
    j_max: int | None = 5                     # paths per execution (None: until every token is covered)
    token_budget: int | None = None           # packed tokens per step over all trees (None: no limit)
    weighting: str = "loss_once"              # or "per_branch"
    role_order: tuple[str, ...] = ROLES       # highest priority first; other roles come after, in order seen
    seed: int = 0

    def __post_init__(self):
        if self.weighting not in WEIGHTINGS:
            raise ValueError(f"weighting {self.weighting!r}: expected one of {WEIGHTINGS}")
        if self.j_max is not None and self.j_max < 1:
            raise ValueError("j_max must be ≥ 1 (or None)")


@dataclass(slots=True)
class Candidate:
    """One (execution, leaf) pair the sampler can choose, and what happened to it."""

    tree: int
    exec_idx: int
    execution_id: str
    leaf: int
    call_index: int                 # the execution's (first) call ending at the leaf
    role: str
    priority: int
    mult: int                       # the execution's contexts ending at this leaf
    length: int                     # path tokens trained (after loop pruning)
    nodes: np.ndarray               # path nodes (root excluded) holding tokens [0, length)
    part: np.ndarray                # tokens taken from each of them
    dstart: np.ndarray              # depth of each node's first token
    cum: np.ndarray                 # cum[d] = generated tokens in [0, d) on the path
    cut: Cut | None = None
    cost_ub: int = -1               # cached packed cost (an upper bound once stale)
    selected: bool = False
    rank: int = -1
    covered_before: int = 0
    new_tokens: int = 0
    uncovered: int = 0
    probability: float = 0.0
    reason: str = ""


@dataclass
class TreeBatch:
    sequences: list[TrainSequence]
    normaliser: float
    n_executions: int
    excluded: dict[str, str]                      # execution_id -> why it is not trained
    exclusion_stage: dict[str, str]               # execution_id -> "score" / "tree"
    trees: list[TrajectoryTree]
    candidates: list[Candidate]                   # every (execution, leaf): selected or not, and why
    credits: list[TreeCredit | None]
    cuts: list[dict[int, Cut]]
    tokens_unique: int                            # |U|: tokens the selected paths cover, shared once per tree
    tokens_flat: int                              # Σ selected path lengths
    key_pairs_unique: int                         # Σ over U of (depth + 1): attention work when packed
    key_pairs_flat: int
    advantages: dict[str, float] = field(default_factory=dict)
    multiplicity: dict[str, int] = field(default_factory=dict)   # execution_id -> executions it stands for


def _covered_depth(c: Candidate, cov: np.ndarray) -> int:
    v = cov[c.nodes]
    nz = np.flatnonzero(v)
    if not len(nz):
        return 0
    i = nz[-1]
    return int(c.dstart[i] + min(int(v[i]), int(c.part[i])))


def _mark(c: Candidate, cov: np.ndarray) -> None:
    cov[c.nodes] = np.maximum(cov[c.nodes], c.part)


def candidates(trees: list[TrajectoryTree], cuts: list[dict[int, Cut]], keep: set[str] | None,
               role_order: tuple[str, ...]) -> dict[tuple[int, int], list[Candidate]]:
    """The (execution, leaf) pairs of every tree, grouped by (tree, execution index)."""
    prio = {r: i for i, r in enumerate(role_order)}
    out: dict[tuple[int, int], list[Candidate]] = {}
    for t, tree in enumerate(trees):
        for e, eid in enumerate(tree.execution_ids):
            if keep is None or eid in keep:
                out[(t, e)] = []
        for li, lf in enumerate(tree.leaves):
            cut = cuts[t].get(li) if cuts else None
            length = cut.depth if cut else lf.depth
            nodes = tree.path_nodes(lf.node)
            dstart = tree.node_depth[nodes]
            inside = dstart < length
            nodes, dstart = nodes[inside], dstart[inside]
            part = np.minimum(tree.node_len[nodes], length - dstart)
            cum = tree.leaf_generated(lf)[:length + 1]
            per_exec: dict[int, list[int]] = {}
            for e, ci in lf.occurrences:
                per_exec.setdefault(e, []).append(ci)
            for e, cis in per_exec.items():
                if (t, e) not in out:
                    continue
                role = tree.role_of(e, cis[0])
                if role not in prio:
                    prio[role] = len(prio)
                out[(t, e)].append(Candidate(t, e, tree.execution_ids[e], li, cis[0], role, prio[role], len(cis),
                                             length, nodes, part, dstart, cum, cut))
    return out


def select(trees: list[TrajectoryTree], cands: dict[tuple[int, int], list[Candidate]],
           cfg: SamplingConfig, keys: Mapping[str, str] | None = None) -> list[np.ndarray]:
    """Run the sampler over all executions; fills in the candidates' outcome. Returns, per tree, the
    covered-token count per node of the union U of all selected paths. `keys`: each execution's name for
    its random stream (default its id; `tree_batch` passes the id within its run, so a run's draws do not
    depend on the run's name)."""
    keys = keys or {}
    rng = np.random.default_rng(cfg.seed)      # the order executions take their turns in (matters under a budget)
    draws = {k: np.random.default_rng(execution_seed(cfg.seed, keys.get(eid, eid)))
             for k in cands for eid in (trees[k[0]].execution_ids[k[1]],)}
    union = [np.zeros(t.n_nodes, dtype=np.int64) for t in trees]
    cov = {k: np.zeros(trees[k[0]].n_nodes, dtype=np.int64) for k in cands}
    remaining = cfg.token_budget
    taken = {k: 0 for k in cands}
    live = [k for k in cands]
    while live:
        still = []
        for i in rng.permutation(len(live)).tolist():
            k = live[i]
            if cfg.j_max is not None and taken[k] >= cfg.j_max:
                continue
            pick = _draw(cands[k], cov[k], union[k[0]], remaining, draws[k])
            if pick is None:
                continue
            c, d, unc, p = pick
            cost = c.length - _covered_depth(c, union[k[0]])
            c.selected, c.rank, c.covered_before, c.new_tokens, c.uncovered, c.probability = \
                True, taken[k], d, cost, unc, p
            c.reason = (f"role {c.role} (priority {c.priority}), drawn with p={p:.3g} "
                        f"∝ {unc} uncovered generated tokens")
            _mark(c, cov[k])
            _mark(c, union[k[0]])
            if remaining is not None:
                remaining -= cost
            taken[k] += 1
            still.append(k)
        live = still
    for k, cs in cands.items():
        for c in cs:
            if c.selected:
                continue
            d = _covered_depth(c, cov[k])
            c.covered_before = d
            c.uncovered = int(c.cum[c.length] - c.cum[d])
            if c.uncovered == 0:
                c.reason = "no uncovered generated tokens (covered by the execution's selected paths)"
            elif cfg.j_max is not None and taken[k] >= cfg.j_max:
                c.reason = f"j_max = {cfg.j_max} paths already taken by the execution"
            elif not c.reason:
                c.reason = "token budget exhausted"
    return union


def local_id(execution_id: str) -> str:
    """An execution's id within its run: Gyre names executions `<run id>/...`, and a replay keeps the stored
    run's ids under its own run id, so the first component is dropped whatever it is."""
    return execution_id.split("/", 1)[-1]


def execution_seed(seed: int, execution_id: str) -> int:
    """The seed of an execution's own draws: what it selects depends on nothing else (without a budget), so
    a step's tasks can be processed one at a time (`processor.step_batch`). `execution_id`: its id within
    the run (two runs of the same config and seed, under other names, draw alike)."""
    return int.from_bytes(hashlib.sha256(f"{seed}/{execution_id}".encode()).digest()[:8], "little")


def _draw(cs: list[Candidate], cov: np.ndarray, union: np.ndarray, remaining: int | None,
          rng: np.random.Generator):
    """The next leaf of one execution: (candidate, covered depth, uncovered generated, probability)."""
    pool = []
    for c in cs:
        if c.selected:
            continue
        d = _covered_depth(c, cov)
        unc = int(c.cum[c.length] - c.cum[d])
        if unc <= 0:
            continue
        if remaining is not None and (c.cost_ub < 0 or c.cost_ub > remaining):
            c.cost_ub = c.length - _covered_depth(c, union)     # lazy: recompute only when it may not fit
            if c.cost_ub > remaining:
                c.reason = f"does not fit the token budget ({c.cost_ub} new tokens > {remaining} left)"
                continue
        pool.append((c, d, unc))
    if not pool:
        return None
    best = min(c.priority for c, _, _ in pool)
    pool = [x for x in pool if x[0].priority == best]
    w = np.asarray([u for _, _, u in pool], dtype=np.float64)
    i = int(rng.choice(len(pool), p=w / w.sum())) if len(pool) > 1 else 0
    c, d, unc = pool[i]
    c.reason = ""
    return c, d, unc, float(w[i] / w.sum())


def _weights(c: Candidate, gen: np.ndarray, w_exec: float, weighting: str) -> np.ndarray:
    w = np.zeros(c.length, dtype=np.float64)
    if weighting == "loss_once":
        w[c.covered_before:] = np.where(gen[c.covered_before:], w_exec, 0.0)
    else:
        w[:] = np.where(gen, w_exec * c.mult, 0.0)
    return w


def _counted(c: Candidate, weighting: str) -> int:
    if weighting == "loss_once":
        return int(c.cum[c.length] - c.cum[c.covered_before])
    return c.mult * int(c.cum[c.length])


def emit(trees: list[TrajectoryTree], cands: dict[tuple[int, int], list[Candidate]], advantages: Mapping[str, float],
         credits: list[TreeCredit | None], credit_cfg: CreditConfig, weighting: str,
         multiplicity: Mapping[str, int] | None = None) -> tuple[list[TrainSequence], int]:
    """The selected paths as TrainSequences (selection order per execution); and the executions kept,
    each counted with its multiplicity (default 1; its weights sum to it)."""
    mult = multiplicity or {}
    seqs: list[TrainSequence] = []
    kept = 0
    for (t, e), cs in cands.items():
        sel = sorted((c for c in cs if c.selected), key=lambda c: c.rank)
        counted = sum(_counted(c, weighting) for c in sel)
        if counted == 0:
            continue
        tree = trees[t]
        m = mult.get(tree.execution_ids[e], 1)
        kept += m
        w_exec = m / counted
        a_exec = advantages[tree.execution_ids[e]]
        for c in sel:
            ids, gen, lp, ver = tree.path_values(e, c.call_index, c.length)
            w = _weights(c, gen, w_exec, weighting)
            adv = path_advantages(c.nodes, c.part, a_exec, credits[t], credit_cfg)
            n = c.length
            seqs.append(TrainSequence(
                execution_id=c.execution_id, call_index=c.call_index, input_ids=ids.tolist(),
                score_from=list(range(-1, n - 1)), old_logprobs=np.where(gen, lp, 0.0).tolist(),
                advantages=np.where(w != 0.0, adv, 0.0).tolist(), weights=w.tolist(),
                versions=np.where(gen, ver, -1).tolist()))
    return seqs, kept


def packed_work(trees: list[TrajectoryTree], union: list[np.ndarray]) -> tuple[int, int]:
    """(|U|, Σ_{i∈U} (depth_i + 1)): tokens and attention key pairs of packing the selected paths."""
    tokens = pairs = 0
    for tree, u in zip(trees, union):
        c = u.astype(np.int64)
        d0 = tree.node_depth
        tokens += int(c.sum())
        pairs += int((c * (d0 + 1) + c * (c - 1) // 2).sum())   # Σ_{t<c} (d0 + t + 1)
    return tokens, pairs


def tree_batch(records: list[ExecutionRecord], advantages: Mapping[str, float],
               rewards: Mapping[str, float] | None = None, *, sampling: SamplingConfig | None = None,
               credit: CreditConfig | None = None, prune: PruneConfig | None = None,
               multiplicity: Mapping[str, int] | None = None) -> TreeBatch:
    """Trees, loop pruning, credit and bounded dedup sampling for one step's executions.

    `advantages` holds the executions to train (as `batch.build_batch`); `rewards` are needed for
    `tree` credit. Executions without an advantage, and those whose records are rejected, are excluded.
    `multiplicity` (default 1 each): how many identical executions a record stands for (module docstring).
    """
    mult = dict(multiplicity or {})
    if any(m < 1 for m in mult.values()):
        raise ValueError("multiplicities must be ≥ 1 (a collapsed duplicate is not trained: leave it out)")
    sampling, credit = sampling or SamplingConfig(), credit or CreditConfig()
    excluded, stage = {}, {}
    keep = []
    for r in records:
        if r.execution_id not in advantages:
            excluded[r.execution_id], stage[r.execution_id] = r.error or r.status, "score"
        else:
            keep.append(r)
    trees, rejects = build_forest(keep)
    for eid, why in rejects.items():
        excluded[eid], stage[eid] = why, "tree"
    if credit.mode == "tree" and rewards is None:
        raise ValueError("tree credit needs the executions' rewards")
    credits = [tree_credit(t, rewards or {}, credit, mult) for t in trees]
    cuts = [prune_loops(t, prune) if prune is not None else {} for t in trees]
    cands = candidates(trees, cuts, None, sampling.role_order)
    union = select(trees, cands, sampling, {r.execution_id: local_id(r.execution_id) for r in keep})
    seqs, kept = emit(trees, cands, advantages, credits, credit, sampling.weighting, mult)
    flat = [c for cs in cands.values() for c in cs]
    sel = [c for c in flat if c.selected]
    tok_u, pairs_u = packed_work(trees, union)
    return TreeBatch(
        sequences=seqs, normaliser=float(max(kept, 1)), n_executions=kept, excluded=excluded,
        exclusion_stage=stage, trees=trees, candidates=flat, credits=credits, cuts=cuts,
        tokens_unique=tok_u, tokens_flat=sum(c.length for c in sel),
        key_pairs_unique=pairs_u, key_pairs_flat=sum(c.length * (c.length + 1) // 2 for c in sel),
        advantages=dict(advantages), multiplicity=mult)


# ----------------------------------------------------------------------------------------------
# lake tables: everything the processor decided


def tree_paths_table(run_id: str, step: int, batch: TreeBatch, weighting: str = "loss_once") -> pa.Table:
    from ..lake.schema import TREE_PATHS

    counted: dict[str, int] = {}
    for c in batch.candidates:
        if c.selected:
            counted[c.execution_id] = counted.get(c.execution_id, 0) + _counted(c, weighting)
    rows = []
    for c in batch.candidates:
        n_w = _counted(c, weighting) // (c.mult if weighting == "per_branch" else 1) if c.selected else 0
        tw = (c.mult if weighting == "per_branch" else 1) * batch.multiplicity.get(c.execution_id, 1) \
            / counted[c.execution_id] if c.selected and counted.get(c.execution_id) else 0.0
        rows.append({
            "run_id": run_id, "step": step, "task_id": batch.trees[c.tree].task_id,
            "execution_id": c.execution_id, "leaf_id": c.leaf, "call_index": c.call_index, "role": c.role,
            "selected": c.selected, "rank": c.rank, "depth": c.length, "covered_before": c.covered_before,
            "new_tokens": c.new_tokens, "uncovered_generated": c.uncovered, "probability": c.probability,
            "n_weighted": n_w, "token_weight": tw, "advantage": batch.advantages.get(c.execution_id, 0.0),
            "reason": c.reason})
    return pa.Table.from_pylist(rows, schema=TREE_PATHS)


def train_segments_table(run_id: str, step: int, batch: TreeBatch) -> pa.Table:
    """Runs of equal (node, provenance, weight, advantage) along each trained sequence, with a status."""
    from ..lake.schema import TRAIN_SEGMENTS

    cols: dict[str, list] = {f.name: [] for f in TRAIN_SEGMENTS}
    sel = {(c.execution_id, c.call_index): c for c in batch.candidates if c.selected}
    for s in batch.sequences:
        c = sel[(s.execution_id, s.call_index)]
        node = np.repeat(c.nodes, c.part)
        gen = batch.trees[c.tree].gen_on_path(c.nodes, c.part)
        w = np.asarray(s.weights)
        adv = np.asarray(s.advantages)
        change = np.flatnonzero((node[1:] != node[:-1]) | (gen[1:] != gen[:-1]) | (w[1:] != w[:-1])
                                | (adv[1:] != adv[:-1])) + 1
        starts = np.concatenate([[0], change]).astype(np.int64)
        ends = np.concatenate([change, [c.length]]).astype(np.int64)
        status = np.where(~gen[starts], "context", np.where(w[starts] != 0, "trained", "covered"))
        n = len(starts)
        cols["depth_start"] += starts.tolist()
        cols["depth_end"] += ends.tolist()
        cols["node_id"] += node[starts].tolist()
        cols["generated"] += gen[starts].tolist()
        cols["weight"] += w[starts].tolist()
        cols["advantage"] += adv[starts].tolist()
        cols["status"] += status.tolist()
        leaf_depth = batch.trees[c.tree].leaves[c.leaf].depth
        if c.length < leaf_depth:     # loop pruning cut the path: the rest is neither forwarded nor trained
            n += 1
            for k, v in (("depth_start", c.length), ("depth_end", leaf_depth), ("node_id", -1),
                         ("generated", False), ("weight", 0.0), ("advantage", 0.0), ("status", "pruned")):
                cols[k].append(v)
        cols["run_id"] += [run_id] * n
        cols["step"] += [step] * n
        cols["execution_id"] += [c.execution_id] * n
        cols["call_index"] += [c.call_index] * n
        cols["rank"] += [c.rank] * n
    return pa.Table.from_pydict(cols, schema=TRAIN_SEGMENTS)


def exclusions_table(run_id: str, step: int, batch: TreeBatch) -> pa.Table:
    from ..lake.schema import EXCLUSIONS

    rows = [{"run_id": run_id, "step": step, "execution_id": eid, "stage": batch.exclusion_stage.get(eid, ""),
             "reason": why} for eid, why in batch.excluded.items()]
    return pa.Table.from_pylist(rows, schema=EXCLUSIONS)


def batch_tables(run_id: str, step: int, batch: TreeBatch, weighting: str = "loss_once") -> dict[str, pa.Table]:
    """All of the processor's decisions for one step, by lake table name."""
    nodes = [tree_nodes_table(run_id, step, t, cr.value if cr else None, cr.step if cr else None,
                              cr.count if cr else None) for t, cr in zip(batch.trees, batch.credits)]
    leaves = [tree_leaves_table(run_id, step, t, cuts) for t, cuts in zip(batch.trees, batch.cuts)]
    from ..lake.schema import TREE_LEAVES, TREE_NODES
    return {
        "tree_nodes": pa.concat_tables(nodes) if nodes else TREE_NODES.empty_table(),
        "tree_leaves": pa.concat_tables(leaves) if leaves else TREE_LEAVES.empty_table(),
        "tree_paths": tree_paths_table(run_id, step, batch, weighting),
        "train_segments": train_segments_table(run_id, step, batch),
        "exclusions": exclusions_table(run_id, step, batch),
    }
