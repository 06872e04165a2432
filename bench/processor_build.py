"""Tree building at the paper's rollout size, and what bounded dedup sampling leaves to train.

    python -m bench.processor_build            # prints JSON figures

- `build_*_700k`: 16 executions × ~700K stored tokens each (≥ 1.1e7, from `synthetic_executions` with
  compaction at a 64K context, sub-agents, retries and group forks) merged into prefix trees by
  `build_forest` (validation included). Time is the best of `repeats` untraced runs; peak memory is
  tracemalloc's peak over one more run (numpy reports its buffers to tracemalloc), i.e. what the build
  allocates on top of the records it is given. The generator's records are not counted (and not timed).
- `jmax_*`: on a branching workload, the tokens the selected paths would make the packed trainer
  forward (|U|, shared prefixes once per task tree) and the attention key pairs Σ_{i∈U}(depth_i + 1), for
  J_max = 1, 5 and uncapped (`None`); a trainer's time per token turns these into `jmax_time_ratio`.
"""
from __future__ import annotations

import gc
import json
import resource
import time
import tracemalloc

from gyre_core.processor.batch import group_advantages
from gyre_core.processor.sampling import SamplingConfig, tree_batch
from gyre_core.processor.synthetic import synthetic_executions
from gyre_core.processor.tree import build_forest


def _build_figures(n_exec: int, tokens_per_exec: int, repeats: int, seed: int) -> dict:
    recs = synthetic_executions(n_exec, tokens_per_exec, turns=400, branching=(0.05, 2), compaction=65_536,
                                sub_agents=2, group_size=8, group_fork=0.3, seed=seed)
    stored = sum(len(c.prompt_ids) - c.prefix_len + len(c.completion_ids) for r in recs for c in r.calls)
    best = float("inf")
    trees = None
    for _ in range(repeats):
        trees = None
        gc.collect()
        t0 = time.perf_counter()
        trees, rejects = build_forest(recs)
        best = min(best, time.perf_counter() - t0)
        assert not rejects
    unique = sum(t.n_unique for t in trees)
    flat = sum(t.n_flat for t in trees)
    nodes = sum(t.n_nodes for t in trees)
    leaves = sum(len(t.leaves) for t in trees)
    trees = None
    gc.collect()
    tracemalloc.start()
    build_forest(recs)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return {
        "build_tokens_700k": stored, "build_s_700k": round(best, 3), "build_peak_mb_700k": round(peak / 2**20, 1),
        "build_unique_tokens_700k": unique, "build_flat_tokens_700k": flat, "build_nodes_700k": nodes,
        "build_leaves_700k": leaves, "build_calls_700k": sum(len(r.calls) for r in recs),
        "build_tok_per_s_700k": round(stored / best),
        "process_max_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    }


def _jmax_figures(seed: int) -> dict:
    recs = synthetic_executions(16, 60_000, turns=120, branching=(0.15, 3), compaction=16_384, sub_agents=2,
                                group_size=8, group_fork=0.6, seed=seed)
    rewards = {r.execution_id: r.reward for r in recs}
    groups: dict[str, list[str]] = {}
    for r in recs:
        groups.setdefault(r.task_id, []).append(r.execution_id)
    adv = group_advantages(rewards, groups, "none")
    out: dict = {"jmax_workload": "16 executions × 60K stored tokens, 2 tasks, retries (p=0.15, K=3), "
                                  "group forks 0.6, 16K compaction, sub-agents"}
    base = None
    for j in (None, 5, 1):
        tb = tree_batch(recs, adv, rewards, sampling=SamplingConfig(j_max=j, seed=seed))
        name = "uncapped" if j is None else str(j)
        out[f"jmax_{name}_paths"] = len(tb.sequences)
        out[f"jmax_{name}_tokens_unique"] = tb.tokens_unique
        out[f"jmax_{name}_tokens_flat"] = tb.tokens_flat
        out[f"jmax_{name}_key_pairs_unique"] = tb.key_pairs_unique
        out[f"jmax_{name}_trained_tokens"] = sum(1 for s in tb.sequences for w in s.weights if w)
        if j is None:
            base = tb
            out["jmax_tree_unique_tokens"] = sum(t.n_unique for t in tb.trees)
        else:
            out[f"jmax_{name}_token_ratio"] = round(tb.tokens_unique / base.tokens_unique, 4)
            out[f"jmax_{name}_key_pair_ratio"] = round(tb.key_pairs_unique / base.key_pairs_unique, 4)
    return out


def bench_build(n_exec: int = 16, tokens_per_exec: int = 700_000, repeats: int = 2, seed: int = 0) -> dict:
    out = _build_figures(n_exec, tokens_per_exec, repeats, seed)
    out.update(_jmax_figures(seed))
    return out


def main() -> None:
    print(json.dumps(bench_build(), indent=2))


if __name__ == "__main__":
    main()
