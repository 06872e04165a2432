"""`gyre bench processor --json`: the trajectory processor's figures in one invocation.

    gyre bench processor --json            # ~6-8 minutes on a 2-core CPU
    python -m bench.processor --quick      # fewer repetitions, smaller build

- exactness (`grad_max_rel_err_fp64/fp32`, `loss_abs_err_fp64`): packed vs per-branch training of random
  forests with the same token weights (bench/processor_packing.py);
- packing on **real branching trajectories of the default environment**: BabyAI GoToLocal run through
  the real harness with forks on (`fork_k` continuations of one root per task from saved environment
  states), the policy an ε-expert (the environment's bot, a uniform-random action with probability ε)
  so episodes are long enough to branch; the processor's trees and bounded dedup sampling pick the
  paths; the same production Trainer trains them flattened and packed, side by side;
- `jmax_time_ratio_{1,5}`: packed train-step time with J_max = 1 and 5 over uncapped, on the synthetic
  generator's long branching executions (retries, sub-agents, compaction);
- `build_*_700k`: building trees for 16 executions × ~700K tokens (bench/processor_build.py).
"""
from __future__ import annotations

import json
import random
import statistics
import time

import torch

from bench.processor_build import bench_build
from bench.processor_packing import MODEL_DIMS, _train_pass, bench_packing, ideal_speedup, tiny_model
from gyre_core.processor.batch import group_advantages, micro_batches, reward_of
from gyre_core.processor.sampling import SamplingConfig, tree_batch
from gyre_core.trainer.packing import pack_branches, packing_stats


def babyai_branching(tasks: int = 3, G: int = 8, K: int = 2, depth: int = 3, fork_turns=(2, 4), eps: float = 0.5,
                     level: str = "BabyAI-GoToLocal-v0", max_turns: int = 48, context_tokens: int = 2048,
                     seed: int = 0):
    """Real TITO records from the default environment with forks on."""
    from gyre_core.config import HarnessConfig
    from gyre_core.envs import load_env
    from gyre_core.harness.conversation import ChatFormat
    from gyre_core.harness.loop import ExecutionSpec, fork_tree, run_executions
    from gyre_core.harness.policies import ExpertPolicy
    from gyre_core.model import IM_END, train_tokenizer

    make_env = lambda: load_env("gyre_core.envs.babyai:BabyAIEnv", level=level)  # noqa: E731
    env = make_env()
    tok = train_tokenizer(list(env.corpus(200, seed)) + [env.instructions()], MODEL_DIMS["vocab_size"])
    stop = tok.convert_tokens_to_ids(IM_END)

    class EpsExpert(ExpertPolicy):
        rng = random.Random(seed)

        def choose(self, e):
            return self.rng.choice(e.actions[:3]) if self.rng.random() < eps else super().choose(e)

    rng = random.Random(seed)
    specs = []
    for b in range(tasks):
        group = [ExecutionSpec("bench", 0, f"t{b}/g{g}", f"seed{b}", 10_000 + b, "train") for g in range(G)]
        fork_tree(group, K, depth, fork_turns, rng)
        specs += group
    recs = run_executions(specs, EpsExpert(tok, stop), HarnessConfig(max_turns=max_turns, context_tokens=context_tokens),
                          make_env, ChatFormat(tok), {stop: IM_END}, concurrency=64)
    config = dict(level=level, tasks=tasks, G=G, fork_k=K, fork_depth=depth, fork_turns=list(fork_turns), eps=eps,
                  max_turns=max_turns, context_tokens=context_tokens)
    return recs, config


def _selection(recs, j_max, seed=0):
    rewards = {r.execution_id: reward_of(r.success, r.partial, 0.1) for r in recs}
    groups: dict[str, list[str]] = {}
    for r in recs:
        groups.setdefault(r.task_id, []).append(r.execution_id)
    adv = group_advantages(rewards, groups, "none")
    return tree_batch(recs, adv, rewards, sampling=SamplingConfig(j_max=j_max, seed=seed))


def _time(trainer, parts, norm, repeats):
    _train_pass(trainer, parts[:1], norm)
    return statistics.median(_train_pass(trainer, parts, norm) for _ in range(repeats))


def packed_vs_flat(branches, norm, *, max_tokens=8192, repeats=3, seed=0) -> dict:
    """The production Trainer on the same branches, flattened (length-bucketed) and packed."""
    from gyre_core.trainer.trainer import Trainer

    trees = pack_branches(branches, max_tokens=max_tokens)
    out = {k: v for k, v in packing_stats(branches, trees).items() if k != "recompute_ratio"}
    out["ideal_speedup"], _ = ideal_speedup(branches, trees, MODEL_DIMS)
    trainer = Trainer(tiny_model(MODEL_DIMS, torch.float32, seed), lr=1e-4, zero_stage=1, grad_clip=1.0)
    out["time_flat_s"] = _time(trainer, micro_batches(branches, max_tokens), norm, repeats)
    out["time_packed_s"] = _time(trainer, [[t] for t in trees], norm, repeats)
    out["measured_speedup"] = out["time_flat_s"] / out["time_packed_s"]
    out["efficiency"] = out["measured_speedup"] / out["ideal_speedup"]
    # the flat path pads its length-bucketed micro-batches; one branch per micro-step has no padding
    # and is the fairer baseline for how much of the ideal saving packing really delivers
    out["time_flat_unpadded_s"] = _time(trainer, [[b] for b in branches], norm, repeats)
    out["measured_speedup_vs_unpadded"] = out["time_flat_unpadded_s"] / out["time_packed_s"]
    out["efficiency_vs_unpadded"] = out["measured_speedup_vs_unpadded"] / out["ideal_speedup"]
    return out


def jmax_time_ratios(seed=0, repeats=2) -> dict:
    from gyre_core.processor.synthetic import synthetic_executions
    from gyre_core.trainer.trainer import Trainer

    recs = synthetic_executions(16, 12_000, turns=60, branching=(0.15, 3), compaction=4096, sub_agents=2,
                                group_size=8, group_fork=0.6, vocab=MODEL_DIMS["vocab_size"], seed=seed)
    trainer = Trainer(tiny_model(MODEL_DIMS, torch.float32, seed), lr=1e-4, zero_stage=1, grad_clip=1.0)
    times, out = {}, {"jmax_workload": "synthetic: 16 executions × 12K tokens, retries p=0.15 K=3, group forks "
                                       "0.6, 4K compaction, 2 sub-agents"}
    for j in (None, 5, 1):
        tb = _selection(recs, j, seed)
        parts = [[t] for t in pack_branches(tb.sequences, max_tokens=8192)]
        times[j] = _time(trainer, parts, tb.normaliser, repeats)
        out[f"jmax_{j or 'uncapped'}_tokens_unique"] = tb.tokens_unique
    out["jmax_time_ratio_1"] = times[1] / times[None]
    out["jmax_time_ratio_5"] = times[5] / times[None]
    return out


def bench_processor(quick: bool = False, seed: int = 0) -> dict:
    reps = 1 if quick else 3
    t0 = time.time()
    exact = bench_packing(repeats=1, with_dense=False, with_unpadded=False, seed=seed)
    out = {k: exact[k] for k in ("grad_max_rel_err_fp64", "grad_max_rel_err_fp32", "loss_abs_err_fp64")}
    out["standin_workload"] = {k: exact[k] for k in ("token_ratio", "ideal_speedup", "measured_speedup", "efficiency")}
    recs, config = babyai_branching(seed=seed)
    tb = _selection(recs, None, seed)
    out["babyai_workload"] = {**config, "executions": len(recs), "forked": sum(bool(r.fork_of) for r in recs),
                              "mean_turns": sum(r.turns for r in recs) / len(recs), "paths": len(tb.sequences)}
    out.update(packed_vs_flat(tb.sequences, tb.normaliser, repeats=reps, seed=seed))
    out.update(jmax_time_ratios(seed, repeats=max(1, reps - 1)))
    build = bench_build(tokens_per_exec=100_000 if quick else 700_000, repeats=1 if quick else 2, seed=seed)
    out.update({k: v for k, v in build.items() if k.startswith("build_")})
    out["bench_s"] = time.time() - t0
    return out


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    print(json.dumps(bench_processor(args.quick), indent=1))


if __name__ == "__main__":
    main()
