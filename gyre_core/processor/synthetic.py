"""Synthetic long, branching agent executions: valid TITO records for benchmarks and tests.

    from gyre_core.processor.synthetic import synthetic_executions
    recs = synthetic_executions(16, 700_000, turns=400, compaction=65_536, sub_agents=2, group_size=8)

No model is involved: token ids are drawn at random, but the structure is what a real harness writes.
- All executions share one system prompt; the executions of a group (`group_size` consecutive ones, one
  `task_id`) share a task prompt, so their first contexts share a prefix.
- A turn appends an observation (injected) and a completion (generated; ends with the stop token,
  `vocab - 1`) to the context; every call's prompt extends its parent call's prompt + completion
  (`prefix_len` = the parent's length): append-only.
- `compaction` (a context budget in tokens): a context that would overflow is replaced by a new one with
  role `main-summary` (or `sub-agent-summary`) that starts from system + task + an injected summary.
- `sub_agents`: about that many sub-agent runs per execution, each a context of its own (role
  `sub-agent`, system prompt + a sub-task), whose result comes back to the main agent as an observation.
- `branching=(p, K)`: at each main turn, with probability p, K-1 retries fork from that call: a new
  context whose first call re-generates the call's completion (parent = the call, `prefix_len` = its
  prompt length, shorter than the parent's length) and runs 1-3 turns more.
- `group_fork=q`: with probability q an execution (not the first of its group) starts as a copy of an
  earlier member's first context up to a random turn (a fork from a saved environment state), so
  executions of a group share generated turns and the tree has real branch points between rewards.
- `tokens_per_exec` counts the tokens the lake stores (new prompt tokens + completions over all calls);
  `turns` sets the size of a turn (tokens_per_exec / turns, a quarter of it generated).
Every call holds its full prompt (as `CallRecord` does), so memory grows with the context budget:
about 16 × 700K tokens with a 64K budget is ~2 GB of Python lists.
"""
from __future__ import annotations

import numpy as np

from ..records import CallRecord, ExecutionRecord


class _Gen:
    """Random token pieces and behaviour values for one execution."""

    def __init__(self, rng: np.random.Generator, vocab: int, version: int):
        self.rng, self.vocab, self.version = rng, vocab, version

    def ids(self, n: int) -> list[int]:
        return self.rng.integers(0, self.vocab - 1, size=max(int(n), 0)).tolist()

    def length(self, mean: float) -> int:
        return max(1, int(self.rng.integers(max(1, int(mean * 0.5)), int(mean * 1.5) + 2)))

    def completion(self, mean: float) -> tuple[list[int], list[float], list[int]]:
        n = self.length(mean)
        ids = self.ids(n - 1) + [self.vocab - 1]
        lps = (-self.rng.exponential(1.0, size=n)).tolist()
        # a call rerouted mid-generation spans two policy versions
        cut = n if self.rng.random() > 0.05 else int(self.rng.integers(0, n))
        return ids, lps, [self.version] * cut + [self.version + 1] * (n - cut)


class _Builder:
    """Writes one execution's calls; every prompt extends its parent as the records declare."""

    def __init__(self, rec: ExecutionRecord, gen: _Gen):
        self.rec, self.gen = rec, gen
        self.n_stored = 0
        self.n_contexts = 0

    def call(self, ctx: int, role: str, prompt: list[int], parent: int, prefix_len: int,
             completion: tuple[list[int], list[float], list[int]]) -> CallRecord:
        ids, lps, vers = completion
        c = CallRecord(self.rec.execution_id, len(self.rec.calls), ctx, role, prompt, ids, lps, vers, "stop",
                       parent, prefix_len)
        self.rec.calls.append(c)
        self.n_stored += len(prompt) - prefix_len + len(ids)
        return c

    def new_context(self) -> int:
        self.n_contexts += 1
        return self.n_contexts - 1


def _run_context(b: _Builder, role: str, head: list[int], budget: int | None, turn_obs: float, turn_gen: float,
                 n_turns: int, summary_role: str, summary_head, stop_at: int) -> None:
    """A (sub-)agent loop of `n_turns` turns from `head`, compacting into `summary_role` contexts."""
    ctx, gen = b.new_context(), b.gen
    last = b.call(ctx, role, head, -1, 0, gen.completion(turn_gen))
    for _ in range(n_turns - 1):
        if b.n_stored >= stop_at:
            return
        obs = gen.ids(gen.length(turn_obs))
        base = last.prompt_ids + last.completion_ids
        if budget is not None and len(base) + len(obs) + 2 * turn_gen > budget:
            ctx, role = b.new_context(), summary_role
            last = b.call(ctx, role, summary_head() + obs, -1, 0, gen.completion(turn_gen))
            continue
        last = b.call(ctx, role, base + obs, last.call_index, len(base), gen.completion(turn_gen))


def synthetic_executions(n_exec: int, tokens_per_exec: int, *, turns: int = 200,
                         branching: tuple[float, int] = (0.0, 2), compaction: int | None = None,
                         sub_agents: int = 0, group_size: int = 8, vocab: int = 32000, seed: int = 0,
                         group_fork: float = 0.0, system_len: int = 400, task_len: int = 600,
                         run_id: str = "synthetic", step: int = 0) -> list[ExecutionRecord]:
    """`n_exec` executions of ~`tokens_per_exec` stored tokens each (see the module docstring)."""
    rng = np.random.default_rng(seed)
    system = rng.integers(0, vocab - 1, size=system_len).tolist()
    fork_p, fork_k = branching
    turn = tokens_per_exec / max(turns, 1)
    turn_gen, turn_obs = max(2.0, turn / 4), max(1.0, turn * 3 / 4)
    out: list[ExecutionRecord] = []
    task: list[int] = []
    for i in range(n_exec):
        g = i // group_size
        if i % group_size == 0:
            task = rng.integers(0, vocab - 1, size=task_len).tolist()
        rec = ExecutionRecord(run_id, step, f"{run_id}/{step}/{i}", f"task{g}", seed * 100_003 + i, "train",
                              "synthetic", policy_version=step)
        gen = _Gen(np.random.default_rng([seed, i]), vocab, step)
        b = _Builder(rec, gen)
        head = system + task
        donors = out[g * group_size:i]
        ctx = b.new_context()
        last = None
        if donors and gen.rng.random() < group_fork:
            last = _copy_first_context(b, donors[int(gen.rng.integers(0, len(donors)))], gen.rng)
        if last is None:
            last = b.call(ctx, "main", head + gen.ids(gen.length(turn_obs)), -1, 0, gen.completion(turn_gen))
        role = last.role
        n_sub = 0
        while b.n_stored < tokens_per_exec:
            if fork_p > 0 and gen.rng.random() < fork_p:
                for _ in range(max(fork_k, 2) - 1):
                    _retry(b, last, role, gen, turn_obs, turn_gen, compaction)
            if sub_agents and gen.rng.random() < sub_agents / max(turns, 1):
                n_sub += 1
                sub_head = lambda: system + gen.ids(gen.length(turn_obs))  # noqa: E731
                _run_context(b, "sub-agent", sub_head(), compaction, turn_obs, turn_gen,
                             int(gen.rng.integers(3, 12)), "sub-agent-summary", sub_head, tokens_per_exec)
            obs = gen.ids(gen.length(turn_obs))
            base = last.prompt_ids + last.completion_ids
            if compaction is not None and len(base) + len(obs) + 2 * turn_gen > compaction:
                ctx, role = b.new_context(), "main-summary"
                rec.compactions += 1
                summary = gen.ids(gen.length(turn_obs))
                last = b.call(ctx, role, head + summary + obs, -1, 0, gen.completion(turn_gen))
                continue
            last = b.call(last.context_index, role, base + obs, last.call_index, len(base),
                          gen.completion(turn_gen))
        rec.turns = len(rec.calls)
        rec.success = bool(gen.rng.random() < 0.3)
        rec.partial = float(gen.rng.random())
        rec.reward = 1.0 if rec.success else 0.1 * rec.partial
        out.append(rec)
    return out


def _retry(b: _Builder, at: CallRecord, role: str, gen: _Gen, turn_obs: float, turn_gen: float,
           budget: int | None) -> None:
    """A retry forked from `at`: re-generate its completion, then run 1-3 more turns (a dead end)."""
    ctx = b.new_context()
    last = b.call(ctx, role, at.prompt_ids, at.call_index, len(at.prompt_ids), gen.completion(turn_gen))
    for _ in range(int(gen.rng.integers(1, 4))):
        base = last.prompt_ids + last.completion_ids
        obs = gen.ids(gen.length(turn_obs))
        if budget is not None and len(base) + len(obs) + 2 * turn_gen > budget:
            return
        last = b.call(ctx, role, base + obs, last.call_index, len(base), gen.completion(turn_gen))


def _copy_first_context(b: _Builder, donor: ExecutionRecord, rng: np.random.Generator) -> CallRecord | None:
    """Copy the donor's first context up to a random turn (same tokens and behaviour values)."""
    first = [c for c in donor.calls if c.context_index == 0]
    if len(first) < 2:
        return None
    upto = int(rng.integers(1, len(first)))
    remap: dict[int, int] = {}
    last = None
    for c in first[:upto]:
        parent = remap[c.parent_call] if c.parent_call >= 0 else -1
        last = b.call(0, c.role, c.prompt_ids, parent, c.prefix_len,
                      (c.completion_ids, list(c.logprobs), list(c.versions)))
        remap[c.call_index] = last.call_index
    return last
