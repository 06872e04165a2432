"""Supervised phases: the warm start (behaviour cloning on the environment expert's demonstrations) and
the supervised-only control (the RL phase's wall time spent on more behaviour cloning instead).

    warm_start(run_dir)      # demonstrations → supervised steps → policy version 0
    control(run_dir)         # from the warm start, cloning for as long as RL took; evaluate it with
                             # `evaluate(run_dir, "control")`
"""
from __future__ import annotations

import math
import random
import time

from ..config import DEMO_SEED_OFFSET, ConfigError
from ..run import CONTROL_DEMOS_PART, DEMOS_PART, RunDir, publish_marker
from ..seeds import supervised_stream
from ..ui import phase
from .run_objects import policy_bundle, training_model, read_records, replayed_records, run_policy, write_records


def warm_start(run_dir: str) -> str:
    run = RunDir.open(run_dir)
    if (m := run.done("warm_start")) is not None:
        return m["path"]
    from ..model import save_policy
    from ..trainer.publish import publish_weights

    cfg, t0 = run.cfg, time.time()
    ws = cfg.warmstart
    seeds = [cfg.env.train_seed_start + DEMO_SEED_OFFSET + i for i in range(ws.episodes)]  # apart from RL seeds
    if cfg.run.replay:        # the stored run's demonstrations: the same warm start without the expert's rollouts
        records = replayed_records(run, DEMOS_PART)
    else:
        records = demonstrations(run, seeds, "demo", "warm start: demonstrations")
    write_records(run, DEMOS_PART, records)
    over = _longer_than_a_call(records, cfg.harness.max_new_tokens, ws.longer_than_a_call)
    good = [r for r in records if r.success]
    model, tok = training_model(cfg, run.policy0)
    trainer, losses, n_seq = behaviour_cloning(run, model, tok, good, "warm start: supervised steps", n_steps=ws.steps)
    save_policy(trainer.model, tok, str(run.warm))
    uri = publish_weights(trainer.state_dict(), run.weights_uri(0))
    return run.mark("warm_start", {"path": str(run.warm), "weights": uri, "demos": len(records),
                                   "demo_success": len(good) / max(len(records), 1),
                                   "sequences": n_seq, "sft_steps": len(losses),
                                   "loss_first": losses[0] if losses else None,
                                   "loss_last": losses[-1] if losses else None, "demo_calls_cut": over,
                                   "wall_s": time.time() - t0})["path"]


def _longer_than_a_call(records: list, max_new_tokens: int, how: str) -> int:
    """How many demonstrated calls are longer than the policy may generate in one call: the warm start would
    teach actions every rollout cuts at `harness.max_new_tokens`. `warmstart.longer_than_a_call`: `error`
    stops the run here, before any training, naming the limit that fits; `warn` says so and goes on."""
    lengths = [len(c.completion_ids) for r in records for c in r.calls]
    over = sum(n > max_new_tokens for n in lengths)
    if not over:
        return 0
    what = (f"{over} of {len(lengths)} demonstrated actions are longer than harness.max_new_tokens="
            f"{max_new_tokens} (up to {max(lengths)} tokens, the stop token included): the policy can only "
            "produce them cut")
    if how == "error":
        raise ConfigError(f"harness.max_new_tokens: {what}; set harness.max_new_tokens={max(lengths)} or more "
                          "(a changed config is a new run: --set run.name=NAME), or warmstart.longer_than_a_call"
                          "=warn to train on them anyway")
    import sys

    print(f"gyre: {what}; raise harness.max_new_tokens", file=sys.stderr)
    return over


def demonstrations(run: RunDir, seeds: list[int], kind: str, label: str) -> list:
    """One expert execution per seed (the expert is deterministic)."""
    from ..harness.loop import ExecutionSpec
    from ..harness.policies import ExpertPolicy

    specs = [ExecutionSpec(run.run_id, -1, f"{run.run_id}/{kind}/{i}", f"seed{s}", s, kind)
             for i, s in enumerate(seeds)]
    with phase(label, len(specs)) as tick:
        b = policy_bundle(run)
        expert = ExpertPolicy(b.tokenizer, b.stop_id, run.cfg.warmstart.expert_epsilon, run.cfg.run.seed)
        return run_policy(run, specs, expert, lambda r: tick())


def supervised_lr(ws, step: int, n_steps: int | None) -> float:
    """Learning rate of supervised step `step` (0-based): cosine from `ws.lr` to `ws.lr_final` over
    `n_steps`; constant `ws.lr` without a final rate; `ws.lr_final` for budgeted (control) training."""
    if ws.lr_final is None:
        return ws.lr
    if n_steps is None:
        return ws.lr_final
    frac = min(step / max(n_steps - 1, 1), 1.0)
    return ws.lr_final + 0.5 * (ws.lr - ws.lr_final) * (1 + math.cos(math.pi * frac))


def behaviour_cloning(run: RunDir, model, tok, records, label: str, n_steps: int | None = None,
                      budget_s: float | None = None, seed_offset: int = 0, on_step=None):
    """Behaviour cloning on successful expert executions: batches of `warmstart.batch_size` sequences
    sampled with replacement across steps, a per-token mean over each batch. Stops after `n_steps`
    optimizer steps, or at the first step boundary once `budget_s` seconds have passed. The rate
    follows `supervised_lr`; `on_step(steps_done, trainer)` is called after every step."""
    from ..processor.batch import build_batch
    from ..trainer.packing import micro_steps
    from ..trainer.trainer import Trainer

    cfg, ws, t0 = run.cfg, run.cfg.warmstart, time.time()
    batch = build_batch(records, {r.execution_id: 1.0 for r in records})
    for s in batch.sequences:   # supervised: every generated token weighs 1
        s.weights = [1.0 if w else 0.0 for w in s.weights]
    trainer = Trainer(model, lr=supervised_lr(ws, 0, n_steps), zero_stage=cfg.trainer.zero_stage,
                      grad_clip=cfg.rl.grad_clip, pad_id=tok.pad_token_id or 0,
                      gradient_checkpointing=cfg.trainer.gradient_checkpointing)
    rng = random.Random(supervised_stream(cfg.run.seed, seed_offset))
    losses: list[float] = []

    def more() -> bool:
        return len(losses) < n_steps if n_steps is not None else time.time() - t0 < budget_s

    with phase(label + ("" if n_steps is not None else " (seconds of budget)"),
               n_steps if n_steps is not None else int(budget_s)) as tick:
        while batch.sequences and more():
            trainer.set_lr(supervised_lr(ws, len(losses), n_steps))
            chunk = rng.sample(batch.sequences, min(ws.batch_size, len(batch.sequences)))
            n_tok = sum(s.n_trainable for s in chunk)
            parts = micro_steps(chunk, cfg.rl.micro_batch_tokens, packed=ws.packed)
            loss = sum(trainer.micro_step(p, float(n_tok), objective="nll", last=k == len(parts) - 1)["loss"]
                       for k, p in enumerate(parts))
            trainer.optimizer_step()
            losses.append(loss)
            tick(**({} if n_steps is not None else {"completed": time.time() - t0}), loss=loss)
            if on_step is not None:
                on_step(len(losses), trainer)
    return trainer, losses, len(batch.sequences)


def rl_wall_s(run: RunDir) -> float:
    """Seconds the RL steps took (rollout, score, process, train, publish; all steps, across resumes)."""
    if (m := run.done("elastic")) is not None:
        return m["rl_wall_s"]
    total = 0.0
    for v in range(1, run.latest_version() + 1):
        m = run.done(publish_marker(v))["metrics"]
        total += sum(m.get(f"time/{k}_s", 0.0) for k in ("rollout", "score", "process", "train", "publish"))
    return total


def control(run_dir: str, budget_s: float | None = None) -> dict:
    """From the warm start, continue supervised training for exactly the RL phase's wall time
    (or `budget_s` seconds, for ablations).

    It trains on the warm start's demonstrations; with `eval.control_rl_tasks` also on one expert
    execution of every RL training seed (the tasks RL saw, labelled instead of rewarded), collected inside
    its budget as rollouts count against RL's. Evaluate it with `evaluate(run, "control")`.
    """
    run = RunDir.open(run_dir)
    if (m := run.done("control")) is not None:
        return m
    from ..model import save_policy
    from ..trainer.publish import publish_weights

    cfg, t0 = run.cfg, time.time()
    budget = rl_wall_s(run) if budget_s is None else budget_s
    ro = cfg.rollout
    fresh = []
    if cfg.eval.control_rl_tasks:
        seeds = [cfg.env.train_seed_start + i for i in range(run.latest_version() * ro.tasks_per_step)]
        fresh = demonstrations(run, seeds, "control-demo", "control: demonstrations on the RL tasks")
        write_records(run, CONTROL_DEMOS_PART, fresh)
    good = [r for r in read_records(run, DEMOS_PART) + fresh if r.success]
    model, tok = training_model(cfg, run.warm)
    left = budget - (time.time() - t0)
    trainer, losses, n_seq = behaviour_cloning(run, model, tok, good, "control: supervised steps",
                                               budget_s=max(left, 0.0), seed_offset=1)
    save_policy(trainer.model, tok, str(run.control))
    uri = publish_weights(trainer.state_dict(), run.weights_uri("control"))
    return run.mark("control", {"path": str(run.control), "weights": uri, "budget_s": budget,
                                "wall_s": time.time() - t0, "demos": len(fresh), "sequences": n_seq,
                                "sft_steps": len(losses), "loss_last": losses[-1] if losses else None})
