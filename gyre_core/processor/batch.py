"""From finished executions to a training batch: rewards, group-relative advantages, token weights.

    scores = score_executions(records, partial_weight=0.1)
    batch = build_batch(records, scores, advantage_norm="none")

Only tokens the policy generated carry loss; everything the harness or environment injected is
context. Each context of an execution is trained as one sequence: its last call's prompt + completion,
which (append-only) contains every earlier call of that context; the function checks that token for
token and rejects an execution whose records disagree. Loss is averaged over an execution's trainable
tokens, then over executions (two-level averaging), so a long or branching execution weighs no more.
"""
from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field

from ..records import CallRecord, ExecutionRecord


class RecordMismatch(ValueError):
    """A call's prompt does not extend its parent call as the records declare."""


@dataclass(slots=True)
class TrainSequence:
    """One sequence for the micro-step. Per-token lists are aligned with `input_ids`.

    Token j is scored by the logits at position `score_from[j]` (-1: not scored). For a plain sequence
    that is j-1; tree packing (the processor issue) points it at the token's parent instead.
    """

    execution_id: str
    call_index: int
    input_ids: list[int]
    score_from: list[int]
    old_logprobs: list[float]
    advantages: list[float]
    weights: list[float]
    versions: list[int] = field(default_factory=list)

    @property
    def n_trainable(self) -> int:
        return sum(1 for w in self.weights if w != 0.0)


@dataclass(slots=True)
class TrainBatch:
    sequences: list[TrainSequence]
    normaliser: float            # fixed when the batch closes: the number of executions averaged over
    n_executions: int
    excluded: dict[str, str]     # execution_id -> why it is not trained


def reward_of(success: bool, partial: float, partial_weight: float) -> float:
    """1 for success; otherwise a share of the partial-progress score (0 turns shaping off)."""
    return 1.0 if success else partial_weight * partial


def assign_reward(record: ExecutionRecord, partial_weight: float) -> float:
    """Set (and return) a finished execution's reward from what it left behind; a failed one gets 0
    (it is excluded from training; the reward only keeps the column defined)."""
    record.reward = reward_of(record.success, record.partial, partial_weight) if record.status != "failed" else 0.0
    return record.reward


def group_advantages(rewards: dict[str, float], groups: dict[str, list[str]], norm: str,
                     multiplicity: dict[str, int] | None = None, std_floor: float = 0.0) -> dict[str, float]:
    """A_i = r_i − mean(group) (÷ max(group std, `std_floor`) when norm == "std"; a constant group gets 0).

    `multiplicity` (default 1 each) says how many identical executions a member stands for: the mean
    and std are weighted by it, so they are those of the group with every duplicate present.
    """
    mult = multiplicity or {}
    adv: dict[str, float] = {}
    for members in groups.values():
        rs = [rewards[m] for m in members]
        ws = [mult.get(m, 1) for m in members]
        if any(w < 1 for w in ws):
            raise ValueError(f"multiplicities must be ≥ 1, got {dict(zip(members, ws))}")
        n = sum(ws)
        mean = sum(w * r for w, r in zip(ws, rs)) / n
        std = math.sqrt(sum(w * (r - mean) ** 2 for w, r in zip(ws, rs)) / n)
        for m, r in zip(members, rs):
            a = r - mean
            if norm == "std":
                a = a / max(std + 1e-6, std_floor) if std > 0 else 0.0
            adv[m] = a
    return adv


def context_sequences(rec: ExecutionRecord) -> list[tuple[list[int], list[tuple[int, CallRecord]]]]:
    """Each context's full token sequence and where each of its calls' completions starts in it."""
    by_ctx: dict[int, list[CallRecord]] = defaultdict(list)
    for c in rec.calls:
        by_ctx[c.context_index].append(c)
    out = []
    for calls in by_ctx.values():
        last = calls[-1]
        seq = last.prompt_ids + last.completion_ids
        spans = []
        for c in calls:
            head = c.prompt_ids + c.completion_ids
            if seq[:len(head)] != head:
                pos = next(i for i, (a, b) in enumerate(zip(seq, head)) if a != b) if any(
                    a != b for a, b in zip(seq, head)) else min(len(seq), len(head))
                raise RecordMismatch(f"execution {rec.execution_id}: call {c.call_index} differs from its "
                                     f"context at token {pos}")
            spans.append((len(c.prompt_ids), c))
        out.append((seq, spans))
    return out


def progress_steps(rec: ExecutionRecord) -> dict[int, float]:
    """call_index -> how much the call's action moved the episode's progress: the env's `progress()` at
    the next call (after the last call: the execution's final partial score) minus at this one. Calls
    without a recorded progress (an env without the hook) move nothing."""
    calls = sorted(rec.calls, key=lambda c: c.call_index)
    out = {}
    for c, nxt in zip(calls, calls[1:] + [None]):
        after = rec.partial if nxt is None else nxt.progress
        out[c.call_index] = 0.0 if c.progress is None or after is None else after - c.progress
    return out


def execution_sequences(rec: ExecutionRecord, advantage: float, progress_credit: float = 0.0) -> list[TrainSequence]:
    """Sequences of one execution with per-token weight 1/(its trainable tokens): the inner average.

    Every generated token of a call gets the execution's `advantage`, plus `progress_credit` × the
    progress that call's action made (`progress_steps`): a per-turn term from the environment's own
    measure of progress, so a turn that got closer to the goal is credited in a failed execution too,
    and one that lost ground is blamed in a successful one."""
    ctxs = context_sequences(rec)
    moved = progress_steps(rec) if progress_credit else {}
    n_train = sum(len(c.completion_ids) for _, spans in ctxs for _, c in spans)
    if n_train == 0:
        return []
    w = 1.0 / n_train
    seqs = []
    for seq, spans in ctxs:
        n = len(seq)
        old, weights, versions, adv = [0.0] * n, [0.0] * n, [-1] * n, [0.0] * n
        for start, c in spans:
            a = advantage + progress_credit * moved.get(c.call_index, 0.0)
            for k, tok in enumerate(c.completion_ids):
                old[start + k] = c.logprobs[k]
                weights[start + k] = w
                versions[start + k] = c.versions[k]
                adv[start + k] = a
        seqs.append(TrainSequence(
            execution_id=rec.execution_id, call_index=spans[-1][1].call_index, input_ids=seq,
            score_from=[j - 1 for j in range(n)], old_logprobs=old,
            advantages=adv, weights=weights, versions=versions))
    return seqs


def build_batch(records: list[ExecutionRecord], advantages: dict[str, float],
                multiplicity: dict[str, int] | None = None, progress_credit: float = 0.0) -> TrainBatch:
    """All trainable executions' sequences; the normaliser is the number of executions kept.

    `multiplicity` (default 1 each) is how many identical executions a record stands for (see
    `gyre_core.lake.dedup`): its token weights are multiplied by it and it counts that many times in
    the normaliser and `n_executions`, so the loss and gradient are exactly those of the batch with
    every duplicate present, each trained on its own. `progress_credit`: see `execution_sequences`.
    """
    mult = multiplicity or {}
    seqs: list[TrainSequence] = []
    excluded: dict[str, str] = {}
    kept = 0
    for rec in records:
        if rec.execution_id not in advantages:
            excluded[rec.execution_id] = rec.error or rec.status
            continue
        try:
            ex_seqs = execution_sequences(rec, advantages[rec.execution_id], progress_credit)
        except RecordMismatch as exc:
            excluded[rec.execution_id] = str(exc)
            continue
        if ex_seqs:
            m = mult.get(rec.execution_id, 1)
            if m < 1:
                raise ValueError(f"execution {rec.execution_id}: multiplicity {m} (a collapsed duplicate "
                                 f"is not trained: leave it out of `records`)")
            if m != 1:
                for s in ex_seqs:
                    s.weights = [w * m for w in s.weights]
            kept += m
            seqs.extend(ex_seqs)
    return TrainBatch(seqs, float(max(kept, 1)), kept, excluded)


def micro_batches(seqs: list[TrainSequence], max_tokens: int) -> list[list[TrainSequence]]:
    """Split into micro-batches of similar length whose padded size (rows × longest) stays ≤ max_tokens.

    Sorting by length keeps padding small; a sequence longer than max_tokens gets a batch of its own.
    The loss is a weighted sum over a fixed normaliser, so the split never changes the update.
    """
    order = sorted(seqs, key=lambda s: len(s.input_ids))
    out: list[list[TrainSequence]] = []
    cur: list[TrainSequence] = []
    for s in order:
        longest = max(len(s.input_ids), len(cur[-1].input_ids) if cur else 0)
        if cur and longest * (len(cur) + 1) > max_tokens:
            out.append(cur)
            cur = []
        cur.append(s)
    if cur:
        out.append(cur)
    return out
