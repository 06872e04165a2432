"""Every random stream of a run, derived from `run.seed` in one place.

A run's outcomes are reproducible because each consumer of randomness draws from its own stream, keyed
by what it is for, never from a shared generator whose draws depend on what ran before:

    stream(seed, k)              the k-th stream of a run: seed · 1 000 003 + k
    rollout_stream(seed, step)   RL step `step`'s sampling and fork choices (step n: stream n)
    eval_stream(seed)            held-out evaluation: the same stream before and after RL (paired)
    cell_stream(seed, cell)      an elastic cell's engine
    sampling_seed(seed, step)    the processor's bounded-dedup path sampling of a step

Task seeds (which environments a run sees) are ranges in the config (`env.train_seed_start`,
`env.eval_seed_start`, `DEMO_SEED_OFFSET`), not streams.
"""
from __future__ import annotations

STREAM_STRIDE = 1_000_003      # a prime: streams of neighbouring run seeds never coincide for k < stride
EVAL_STREAM = 999_983          # the evaluation's stream index: apart from any rollout step's


def stream(seed: int, k: int) -> int:
    return seed * STREAM_STRIDE + k


def rollout_stream(seed: int, step: int) -> int:
    return stream(seed, step)


def eval_stream(seed: int) -> int:
    return stream(seed, EVAL_STREAM)


def cell_stream(seed: int, cell: int) -> int:
    return stream(seed, cell)


def sampling_seed(seed: int, step: int) -> int:
    return seed * 7919 + step
