"""Every random stream of a run, derived from `run.seed` here (figures are reproducible because of it).

Each consumer of randomness seeds its own generator from one of these functions, never from a shared
generator whose draws depend on what ran before:

    rollout_stream(seed, step)     RL step `step`'s sampling and fork choices        seed · 1 000 003 + step
    eval_stream(seed)              every held-out evaluation (paired before/after)  seed · 1 000 003 + 999 983
    cell_stream(seed, cell)        an elastic cell's engine                         seed · 1 000 003 + cell
    sampling_seed(seed, step)      the processor's path sampling of a step          seed · 7919 + step
    supervised_stream(seed, k)     behaviour cloning's batch draws (k: 0 the warm start, 1 the control)
                                                                                    seed + k
    stream(seed, k)                the general form, for the environments' own draws (BabyAI's tokenizer
                                   corpus, the emulated workload's call counts)

Streams of different purposes can hold the same number (cell c's engine and rollout step c; run seed 1's
warm start and run seed 0's control): they feed independent generators, so this costs nothing but is not
a separation to rely on. Changing any formula here changes every figure measured with it.
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


def supervised_stream(seed: int, k: int) -> int:
    return seed + k
