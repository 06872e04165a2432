"""The cost of deterministic CPU kernels in an RL update over packed trees, and what they buy.

    .venv/bin/python bench/deterministic_update.py data/runs/default-s0 --step 5

Loads a finished run's warm-start policy and one step's processed batch, packs it as training does, and
times the forward + backward of every packed tree twice as plain torch and twice inside the trainer's
`_reproducible` scope (deterministic kernels; alternating, three rounds); prints the faster of each pair
and whether the two gradients were bit-identical (`gyre_core/trainer/trainer.py`).
"""
from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gyre_core.model import load_policy  # noqa: E402
from gyre_core.trainer.trainer import _reproducible, ensure_tree_attention  # noqa: E402
from gyre_core.trainer.losses import collate, token_logprobs  # noqa: E402
from gyre_core.trainer.packing import pack_branches  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--step", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    batch = torch.load(args.run_dir / "batches" / f"step-{args.step:04d}.pt", weights_only=False)
    trees = pack_branches(batch.sequences, max_tokens=8192)
    model, _ = load_policy(str(args.run_dir / "warm"))
    model.eval()

    def gradient(deterministic: bool) -> tuple[float, dict[str, torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        for tree in trees:
            c = collate([tree], 0)
            ensure_tree_attention(model)
            with _reproducible(torch.device("cpu")) if deterministic else contextlib.nullcontext():
                logp, _ = token_logprobs(model(**c.model_inputs()).logits, c, 1.0)
                logp.sum().backward()
        return time.perf_counter() - t0, {n: p.grad.clone() for n, p in model.named_parameters()}

    print(f"{len(trees)} packed trees, {sum(t.n_tokens for t in trees)} tokens, {args.threads} threads")
    for _ in range(args.rounds):
        for deterministic in (False, True):
            (t1, a), (t2, b) = gradient(deterministic), gradient(deterministic)
            same = all(torch.equal(a[k], b[k]) for k in a)
            print(f"deterministic={deterministic!s:5}  {min(t1, t2):.2f} s  bit-identical twice: {same}")


if __name__ == "__main__":
    main()
