"""A step's training data from its finished executions: the one path that the step loop (`phases.rl_step`, a
whole step at once) and the elastic phase (`phases.rl_on_cells`, a task's group as soon as it is complete)
both train through.

    kept_as = duplicates(records)                                    # identical executions of a task
    adv, mult = score_executions(rows, kept_as, cfg.rl)              # group-relative, duplicates collapsed
    batch = training_batch(records, adv, rewards, mult, cfg, seed)   # TreeBatch (tree mode) or TrainBatch
    batch, adv, mult, kept_as = records_batch(records, cfg, seed)    # the three above, on records in memory
    items = group_items(group, cfg, seed)                            # the elastic phase: one task's group

Every stage works task by task: a task's executions are deduplicated, scored, built into one tree, pruned,
credited and sampled (each execution from a random stream of its own) without looking at another task.
So the sequences and token weights of a step processed whole equal those of its tasks processed one at a
time, and the normalisers add up: the streamed update equals the step loop's
(`tests/core/test_step_batch.py`). The exception is `processor.token_budget`, a step-wide budget: the
elastic phase gives each task an equal share of it.
"""
from __future__ import annotations

from collections import Counter
from typing import Iterable, Mapping

import numpy as np

from ..records import STATUS_FAILED, ExecutionRecord
from .batch import build_batch, group_advantages


def duplicates(records: Iterable[ExecutionRecord]) -> dict[str, str]:
    """execution id -> the identical execution of its task trained in its place (itself when kept): the rule
    of the lake's content-hash dedup (`gyre_core.lake.dedup`, which the step loop runs in DuckDB), on
    records in memory. Compared exactly (log-probs as the lake stores them, float32) rather than by hash."""
    records = list(records)
    parents = {r.fork_of for r in records if r.fork_call > 0}
    sets: dict[tuple, list[str]] = {}
    for r in records:
        calls = tuple((c.call_index, c.context_index, c.role, c.parent_call, c.prefix_len, len(c.prompt_ids),
                       tuple(c.delta()), tuple(c.completion_ids),
                       np.asarray(c.logprobs, dtype=np.float32).tobytes(), tuple(c.versions))
                      for c in r.calls[r.fork_call:])
        key = (r.task_id, calls, r.fork_of, r.fork_call, len(r.calls), r.tokens_generated, r.status, r.reward,
               r.execution_id if r.execution_id in parents else None)
        sets.setdefault(key, []).append(r.execution_id)
    return {m: min(members) for members in sets.values() for m in members}


def score_executions(rows: Iterable[tuple[str, str, str, float]], kept_as: Mapping[str, str], rl
                     ) -> tuple[dict[str, float], Counter, dict[str, str]]:
    """Group-relative advantages of (execution id, task id, status, reward) rows; a failed execution gets
    none. Identical executions (`kept_as`) count once each in their group's statistics through the kept one's
    multiplicity, and share its advantage. Returns (advantages, multiplicity of each kept execution, kept_as
    of every scored one)."""
    rows = [r for r in rows if r[2] != STATUS_FAILED]
    rewards = {i: reward for i, _, _, reward in rows}
    kept = {i: kept_as.get(i, i) for i in rewards}
    mult = Counter(kept.values())
    groups: dict[str, list[str]] = {}
    for i, task, _, _ in rows:
        if kept[i] == i:
            groups.setdefault(task, []).append(i)
    kept_adv = group_advantages({i: rewards[i] for i in mult}, groups, rl.advantage_norm, dict(mult),
                                std_floor=rl.advantage_std_floor)
    return {i: kept_adv[k] for i, k in kept.items()}, mult, kept


def poisoned(records: Iterable[ExecutionRecord], vocab_size: int | None = None) -> dict[str, str]:
    """execution id -> why its record cannot be trained on: a behaviour log-prob that is not finite or is
    above 0 (a probability over 1), or a token id outside [0, vocab_size). One such token would make the
    update's loss NaN, or stop the trainer at an embedding lookup, on every retry."""
    out = {}
    for r in records:
        for i, c in enumerate(r.calls):
            lp = np.asarray(c.logprobs, dtype=np.float64)
            if lp.size and not np.isfinite(lp).all():
                out[r.execution_id] = f"poisoned record: call {i} has a non-finite behaviour log-prob"
            elif lp.size and lp.max() > 1e-3:
                out[r.execution_id] = f"poisoned record: call {i} has a log-prob above 0 ({lp.max():.3g})"
            else:
                ids = np.asarray(c.prompt_ids + c.completion_ids, dtype=np.int64)
                if ids.size and (ids.min() < 0 or (vocab_size is not None and ids.max() >= vocab_size)):
                    bad = int(ids.min()) if ids.min() < 0 else int(ids.max())
                    out[r.execution_id] = (f"poisoned record: call {i} has token id {bad}, outside the "
                                           f"vocabulary [0, {vocab_size})")
            if r.execution_id in out:
                break
    return out


def training_batch(records: list[ExecutionRecord], advantages: Mapping[str, float], rewards: Mapping[str, float],
                   multiplicity: Mapping[str, int], cfg, seed: int, token_budget: int | None = None,
                   vocab_size: int | None = None):
    """The trained sequences of `records` (collapsed duplicates left out; the kept ones with their
    multiplicity): a `sampling.TreeBatch` in tree mode (trees, pruning, J_max role-priority sampling, credit),
    else a `batch.TrainBatch` of flat sequences. `token_budget` overrides the config's. A poisoned record
    (`poisoned`; token ids checked against `vocab_size` when given) is excluded with its reason."""
    bad = poisoned(records, vocab_size)
    if bad:
        records = [r for r in records if r.execution_id not in bad]
    pc = cfg.processor
    if pc.mode != "tree":
        batch = build_batch(records, dict(advantages), dict(multiplicity), cfg.rl.progress_credit)
    else:
        from .credit import CreditConfig
        from .pruning import PruneConfig
        from .sampling import SamplingConfig, tree_batch

        batch = tree_batch(records, advantages, rewards, multiplicity=multiplicity,
                           sampling=SamplingConfig(j_max=pc.j_max, token_budget=token_budget or pc.token_budget,
                                                   weighting=pc.weighting, role_order=tuple(pc.role_order),
                                                   seed=seed),
                           credit=CreditConfig(mode=pc.credit, shrink_k=pc.shrink_k),
                           prune=PruneConfig(pc.prune_repeats, pc.prune_period) if pc.prune_repeats else None)
    batch.excluded.update(bad)
    if hasattr(batch, "exclusion_stage"):
        batch.exclusion_stage.update(dict.fromkeys(bad, "poisoned"))
    return batch


def records_batch(records: list[ExecutionRecord], cfg, seed: int, token_budget: int | None = None,
                  vocab_size: int | None = None):
    """Records in memory (rewards assigned) through dedup (`processor.dedup`), scoring and `training_batch`:
    (the batch, advantages, multiplicities of the kept executions, kept_as of every scored one)."""
    kept_as = duplicates(records) if cfg.processor.dedup else {}
    adv, mult, kept = score_executions(((r.execution_id, r.task_id, r.status, r.reward) for r in records),
                                       kept_as, cfg.rl)
    trained = [r for r in records if r.execution_id in adv and kept[r.execution_id] == r.execution_id]
    batch = training_batch(trained, {r.execution_id: adv[r.execution_id] for r in trained},
                           {r.execution_id: r.reward for r in trained}, mult, cfg, seed, token_budget, vocab_size)
    return batch, adv, mult, kept


def group_items(group: list[ExecutionRecord], cfg, seed: int,
                vocab_size: int | None = None) -> list[tuple[str, object, list[int], int, str]]:
    """One task's complete group, processed as the step loop processes a step (rewards already assigned):
    per execution (id, its sequences or None, the behaviour versions of its trained tokens, the executions
    it stands for in the normaliser, why it is not trained — "" when it is)."""
    pc = cfg.processor
    share = max(pc.token_budget // cfg.rollout.tasks_per_step, 1) if pc.token_budget else None
    batch, adv, mult, kept = records_batch(group, cfg, seed, share, vocab_size)
    seqs: dict[str, list] = {}
    for sq in batch.sequences:            # a record that does not line up is excluded by the batch
        seqs.setdefault(sq.execution_id, []).append(sq)
    items = []
    for r in group:
        i = r.execution_id
        mine = seqs.get(i, [])
        versions = [v for sq in mine for v, w in zip(sq.versions, sq.weights) if w != 0.0]
        if versions:
            items.append((i, mine, versions, mult[i], ""))
            continue
        why = (r.error or r.status if i not in adv else
               f"identical to {kept[i]}" if kept[i] != i else batch.excluded.get(i, "no trainable token"))
        items.append((i, None, [], 0, why))
    return items


__all__ = ["duplicates", "score_executions", "training_batch", "records_batch", "group_items"]
