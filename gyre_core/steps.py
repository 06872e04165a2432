"""Every step of the RL loop, as plain functions over a run directory (the flow composes them).

    run = prepare(cfg)                       # model + tokenizer, checked before any rollout
    warm_start(run); evaluate(run, "before")
    for step in range(cfg.rl.steps):
        rollout(run, step); score(run, step); process(run, step); train(run, step); publish(run, step)
    evaluate(run, "after"); summary = summarize(run)

Steps take and return paths or small JSON-able dicts, never tensors, and are idempotent: each checks
its completion marker and returns what it produced before (see `gyre_core.run`).
"""
from __future__ import annotations

import math
import random
import time
from pathlib import Path

import pyarrow as pa

from .config import DEMO_SEED_OFFSET, ConfigError, GyreConfig, apply_threads
from .run import CheckpointError, RunDir
from .ui import phase

# ----------------------------------------------------------------------------------------------
# shared objects (cached per process)


def _env_factory(run: RunDir, rollout: bool = False):
    """Makes the run's environments; RL rollouts (`rollout=True`) get `env.latency_s` added per step."""
    from .envs import LatencyEnv, load_env

    cfg = run.cfg.env
    if rollout and cfg.latency_s > 0:
        return lambda: LatencyEnv(load_env(cfg.target, **cfg.kwargs), cfg.latency_s)
    return lambda: load_env(cfg.target, **cfg.kwargs)


def _policy_dir(run: RunDir) -> Path:
    return run.warm if run.done("warm_start") else run.policy0


def _policy(run: RunDir):
    """(engine, tokenizer, chat format, stop-token texts), loaded once per process."""
    from .engine import LocalEngine
    from .harness.conversation import ChatFormat
    from .model import load_policy, stop_token_ids

    def make():
        model, tok = load_policy(str(run.policy0), device=run.cfg.model.device)
        stops = stop_token_ids(model, tok)
        engine = LocalEngine(model, stops, version=-1, seed=run.cfg.run.seed)
        return engine, tok, ChatFormat(tok), {i: tok.decode([i]) for i in stops}

    return run.cached("policy", make)


def _tokenizer(run: RunDir):
    return _policy(run)[1]


def _stop_id(run: RunDir) -> int:
    """The stop token scripted policies end their answers with (the tokenizer's eos)."""
    tok, stops = _policy(run)[1], _policy(run)[3]
    return tok.eos_token_id if tok.eos_token_id in stops else min(stops)


def _engine_at(run: RunDir, version: int):
    from .trainer.publish import load_weights

    eng = _policy(run)[0]
    if eng.version != version:
        uri = run.weights_uri("control" if version == CONTROL_VERSION else version)
        eng.set_weights(load_weights(uri), version)
    return eng


def _lake(run: RunDir):
    from .lake import Lake

    return run.cached("lake", lambda: Lake.from_config(run.cfg.lake))


def _run_policy(run: RunDir, specs, policy, on_finish=None, rollout: bool = False):
    from .harness.loop import run_executions

    _, _, fmt, stop_texts = _policy(run)
    return run_executions(specs, policy, run.cfg.harness, _env_factory(run, rollout), fmt, stop_texts,
                          run.cfg.rollout.concurrency, on_finish)


def _write_records(run: RunDir, part: str, records) -> None:
    from .lake.schema import calls_table, executions_table

    _lake(run).write_part(run.run_id, part, {"executions": executions_table(records),
                                             "calls": calls_table(records)})


def _read_records(run: RunDir, part: str, skip: set[str] | frozenset[str] = frozenset()):
    """The part's execution records, less those in `skip` (whose calls are then never rebuilt)."""
    from .lake.schema import read_executions

    lake = _lake(run)
    ex, calls = lake.read("executions", run.run_id, part), lake.read("calls", run.run_id, part)
    if skip:
        import pyarrow.compute as pc

        drop = pa.array(sorted(skip), pa.string())
        ex = ex.filter(pc.invert(pc.is_in(ex["execution_id"], value_set=drop)))
        calls = calls.filter(pc.invert(pc.is_in(calls["execution_id"], value_set=drop)))
    return read_executions(ex, calls)


# ----------------------------------------------------------------------------------------------
# prepare: the model and tokenizer, checked before anything runs


def prepare(cfg: GyreConfig) -> str:
    """Create the run directory and its initial policy.

    Everything that would stop a run later is checked here, before any rollout: the lake root, the
    environment target, `model.path`, and on resume every checkpoint the run will read.
    """
    from .envs import load_env, supports
    from .lake import Lake
    from .model import PolicyLoadError, build_tiny_model, load_policy, save_policy, train_tokenizer

    apply_threads(cfg)
    try:
        env = load_env(cfg.env.target, **cfg.env.kwargs)
    except Exception as exc:
        raise ConfigError(f"env.target: {exc}") from None
    model = tok = None
    if cfg.model.path:
        try:
            model, tok = load_policy(cfg.model.path)
        except PolicyLoadError as exc:
            raise ConfigError(f"model.path: {exc}") from None
    lake = Lake.from_config(cfg.lake)
    lake.check_writable()
    run = RunDir.create(cfg)
    if cfg.run.replay:
        check_replayable(lake, cfg)
    left = lake.cleanup(run.run_id)            # what a crashed attempt of this run left in the lake
    if any(left.values()):
        import sys

        print(f"gyre lake: cleaned up after an earlier attempt of run {run.run_id}: {left}", file=sys.stderr)
    if run.done("prepare"):
        check_resumable(run)
        return str(run.path)
    if model is None:
        texts = list(env.corpus(cfg.model.tokenizer_corpus_episodes, cfg.run.seed)) if supports(env, "corpus") else []
        texts.append(env.instructions())
        tok = train_tokenizer(texts, cfg.model.vocab_size)
        m = cfg.model
        model = build_tiny_model(tok, hidden_size=m.hidden_size, num_layers=m.num_layers, num_heads=m.num_heads,
                                 num_kv_heads=m.num_kv_heads, ffn_size=m.ffn_size, max_positions=m.max_positions,
                                 seed=cfg.run.seed)
    save_policy(model, tok, str(run.policy0))
    run.mark("prepare", {"params": sum(p.numel() for p in model.parameters()), "vocab": len(tok)})
    return str(run.path)


def check_replayable(lake, cfg: GyreConfig) -> None:
    """A replay needs the source run's demonstrations and one committed `step=N` part per RL step."""
    src = cfg.run.replay
    if src == cfg.run_id():
        raise ConfigError(f"run.replay: a run cannot replay itself ('{src}'); leave run.name unset or change it")
    parts = lake.parts(src)
    if not parts:
        raise ConfigError(f"run.replay: no run '{src}' in the lake at {cfg.lake.root} (runs: {', '.join(lake.runs()) or 'none'})")
    missing = [f"step={s}" for s in range(cfg.rl.steps) if f"step={s}" not in parts]
    if "demos" not in parts or missing:
        have = [p for p in parts if p.startswith("step=") or p == "demos"]
        raise ConfigError(f"run.replay: run '{src}' lacks {', '.join((['demos'] if 'demos' not in parts else []) + missing)} "
                          f"for rl.steps={cfg.rl.steps} (it has {', '.join(have) or 'nothing'}); lower rl.steps")


def check_resumable(run: RunDir) -> None:
    """Load what a resumed run will read (policy dirs, published weights, the newest DeepSpeed
    checkpoint) so a corrupt file stops the run here with its path, not in the middle of a step."""
    from .model import load_policy
    from .trainer.publish import load_weights

    load_policy(str(run.policy0))
    if run.done("warm_start") is None:
        return
    load_policy(str(run.warm))
    v = latest_version(run)
    for uri in {run.weights_uri(0), run.weights_uri(v)}:
        try:
            load_weights(uri)
        except Exception as exc:
            raise CheckpointError(f"published weights {uri} are unreadable ({type(exc).__name__}: {exc}); "
                                  f"delete the run directory to start over") from None
    # the checkpoint the next train step loads: v, or v+1 when its train step finished but publish did not
    newest = v + 1 if run.done(f"train_{v:04d}") is not None else v
    if newest == 0:
        return
    tag_dir = run.ckpt / f"v{newest}"
    need = ["mp_rank_*_model_states.pt"] + (["*optim_states.pt"] if run.cfg.trainer.zero_stage >= 1 else [])
    for pattern in need:
        if not any(tag_dir.glob(pattern)):
            raise CheckpointError(f"checkpoint {tag_dir} is missing or incomplete (no {pattern}); "
                                  f"delete the run directory to start over")


# ----------------------------------------------------------------------------------------------
# warm start: supervised training on the environment expert's demonstrations


def warm_start(run_dir: str) -> str:
    run = RunDir.open(run_dir)
    if (m := run.done("warm_start")) is not None:
        return m["path"]
    from .model import load_policy, save_policy
    from .trainer.publish import publish_weights

    cfg, t0 = run.cfg, time.time()
    ws = cfg.warmstart
    seeds = [cfg.env.train_seed_start + DEMO_SEED_OFFSET + i for i in range(ws.episodes)]  # apart from RL seeds
    if cfg.run.replay:        # the stored run's demonstrations: the same warm start without the expert's rollouts
        records = _replayed(run, "demos")
    else:
        records = _demonstrations(run, seeds, "demo", "warm start: demonstrations")
    _write_records(run, "demos", records)
    good = [r for r in records if r.success]
    model, tok = load_policy(str(run.policy0), device=cfg.model.device)
    trainer, losses, n_seq = _supervised(run, model, tok, good, "warm start: supervised steps", n_steps=ws.steps)
    save_policy(trainer.model, tok, str(run.warm))
    uri = publish_weights(trainer.state_dict(), run.weights_uri(0))
    return run.mark("warm_start", {"path": str(run.warm), "weights": uri, "demos": len(records),
                                   "demo_success": len(good) / max(len(records), 1),
                                   "sequences": n_seq, "sft_steps": len(losses),
                                   "loss_first": losses[0] if losses else None,
                                   "loss_last": losses[-1] if losses else None, "wall_s": time.time() - t0})["path"]


def _replayed(run: RunDir, part: str) -> list:
    """A part of the replayed run, as this run's records (same executions, this run's id)."""
    records = _lake(run).read_records(run.cfg.run.replay, part)
    for r in records:
        r.run_id = run.run_id
    return records


def _demonstrations(run: RunDir, seeds: list[int], kind: str, label: str) -> list:
    """One expert execution per seed (the expert is deterministic)."""
    from .harness.loop import ExecutionSpec
    from .harness.policies import ExpertPolicy

    specs = [ExecutionSpec(run.run_id, -1, f"{run.run_id}/{kind}/{i}", f"seed{s}", s, kind)
             for i, s in enumerate(seeds)]
    with phase(label, len(specs)) as tick:
        expert = ExpertPolicy(_tokenizer(run), _stop_id(run), run.cfg.warmstart.expert_epsilon, run.cfg.run.seed)
        return _run_policy(run, specs, expert, lambda r: tick())


def supervised_lr(ws, step: int, n_steps: int | None) -> float:
    """Learning rate of supervised step `step` (0-based): cosine from `ws.lr` to `ws.lr_final` over
    `n_steps`; constant `ws.lr` without a final rate; `ws.lr_final` for budgeted (control) training."""
    if ws.lr_final is None:
        return ws.lr
    if n_steps is None:
        return ws.lr_final
    frac = min(step / max(n_steps - 1, 1), 1.0)
    return ws.lr_final + 0.5 * (ws.lr - ws.lr_final) * (1 + math.cos(math.pi * frac))


def _supervised(run: RunDir, model, tok, records, label: str, n_steps: int | None = None,
                budget_s: float | None = None, seed_offset: int = 0, on_step=None):
    """Behaviour cloning on successful expert executions: batches of `warmstart.batch_size` sequences
    sampled with replacement across steps, a per-token mean over each batch. Stops after `n_steps`
    optimizer steps, or at the first step boundary once `budget_s` seconds have passed. The rate
    follows `supervised_lr`; `on_step(steps_done, trainer)` is called after every step."""
    from .processor.batch import build_batch, micro_batches
    from .trainer.engine import Trainer

    cfg, ws, t0 = run.cfg, run.cfg.warmstart, time.time()
    batch = build_batch(records, {r.execution_id: 1.0 for r in records})
    for s in batch.sequences:   # supervised: every generated token weighs 1
        s.weights = [1.0 if w else 0.0 for w in s.weights]
    trainer = Trainer(model, lr=supervised_lr(ws, 0, n_steps), zero_stage=cfg.trainer.zero_stage,
                      grad_clip=cfg.rl.grad_clip, pad_id=tok.pad_token_id or 0)
    rng = random.Random(cfg.run.seed + seed_offset)
    losses: list[float] = []

    def more() -> bool:
        return len(losses) < n_steps if n_steps is not None else time.time() - t0 < budget_s

    with phase(label + ("" if n_steps is not None else " (seconds of budget)"),
               n_steps if n_steps is not None else int(budget_s)) as tick:
        while batch.sequences and more():
            trainer.set_lr(supervised_lr(ws, len(losses), n_steps))
            chunk = rng.sample(batch.sequences, min(ws.batch_size, len(batch.sequences)))
            n_tok = sum(s.n_trainable for s in chunk)
            parts = micro_batches(chunk, cfg.rl.micro_batch_tokens)
            loss = sum(trainer.micro_step(p, float(n_tok), objective="nll", last=k == len(parts) - 1)["loss"]
                       for k, p in enumerate(parts))
            trainer.optimizer_step()
            losses.append(loss)
            tick(**({} if n_steps is not None else {"completed": time.time() - t0}), loss=loss)
            if on_step is not None:
                on_step(len(losses), trainer)
    return trainer, losses, len(batch.sequences)


# ----------------------------------------------------------------------------------------------
# the supervised-only control: the RL phase's wall time spent on more behaviour cloning instead


CONTROL_VERSION = -3   # policy_version recorded for the control's evaluation (not on the RL lineage)


def rl_wall_s(run: RunDir) -> float:
    """Seconds the RL steps took (rollout, score, process, train, publish; all steps, across resumes)."""
    if (m := run.done("elastic")) is not None:
        return m["rl_wall_s"]
    total = 0.0
    for v in range(1, latest_version(run) + 1):
        m = run.done(f"publish_{v:04d}")["metrics"]
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
    from .model import load_policy, save_policy
    from .trainer.publish import publish_weights

    cfg, t0 = run.cfg, time.time()
    budget = rl_wall_s(run) if budget_s is None else budget_s
    ro = cfg.rollout
    fresh = []
    if cfg.eval.control_rl_tasks:
        seeds = [cfg.env.train_seed_start + i for i in range(latest_version(run) * ro.tasks_per_step)]
        fresh = _demonstrations(run, seeds, "control-demo", "control: demonstrations on the RL tasks")
        _write_records(run, "control-demos", fresh)
    good = [r for r in _read_records(run, "demos") + fresh if r.success]
    model, tok = load_policy(str(run.warm), device=cfg.model.device)
    left = budget - (time.time() - t0)
    trainer, losses, n_seq = _supervised(run, model, tok, good, "control: supervised steps",
                                         budget_s=max(left, 0.0), seed_offset=1)
    save_policy(trainer.model, tok, str(run.control))
    uri = publish_weights(trainer.state_dict(), run.weights_uri("control"))
    return run.mark("control", {"path": str(run.control), "weights": uri, "budget_s": budget,
                                "wall_s": time.time() - t0, "demos": len(fresh), "sequences": n_seq,
                                "sft_steps": len(losses), "loss_last": losses[-1] if losses else None})


# ----------------------------------------------------------------------------------------------
# evaluation on held-out seeds (same seeds before and after: paired)


def evaluate(run_dir: str, label: str, version: int | None = None) -> dict:
    """Sampled policy (and greedy, random beside it) on the held-out seeds; recomputed if the version moved.

    "before" is the warm-started policy (v0), "control" the supervised-only control, anything else the
    newest RL version."""
    run = RunDir.open(run_dir)
    if version is None:
        version = {"before": 0, "control": CONTROL_VERSION}.get(label, None)
        version = latest_version(run) if version is None else version
    if (m := run.done(f"eval_{label}")) is not None and m["version"] == version:
        return m
    from .evaluation import summarize
    from .harness.loop import ExecutionSpec
    from .harness.policies import EnginePolicy, RandomPolicy

    cfg, t0 = run.cfg, time.time()
    all_seeds = [cfg.env.eval_seed_start + i for i in range(cfg.eval.episodes)]
    modes = [("sampled", cfg.rollout.temperature, cfg.eval.episodes)]
    if cfg.eval.greedy_episodes and label != "control":   # the control is compared sampled, as RL is
        modes.append(("greedy", 0.0, min(cfg.eval.greedy_episodes, cfg.eval.episodes)))
    if cfg.eval.random_baseline and label == "before":
        modes.append(("random", None, cfg.eval.episodes))
    out: dict = {"label": label, "version": version}
    all_records = []
    for mode, temp, n in modes:
        seeds = all_seeds[:n]
        specs = [ExecutionSpec(run.run_id, -2, f"{run.run_id}/eval-{label}-{mode}/{i}", f"seed{s}", s,
                               f"eval-{mode}", version) for i, s in enumerate(seeds)]
        if mode == "random":
            policy = RandomPolicy(_tokenizer(run), _stop_id(run), cfg.run.seed)
        else:
            eng = _engine_at(run, version)
            eng.reseed(cfg.run.seed * 1_000_003 + EVAL_STREAM)   # same sampling stream before and after
            policy = EnginePolicy(eng, temp)
        with phase(f"evaluate {label}: {mode}", len(specs)) as tick:
            recs = _run_policy(run, specs, policy, lambda r: tick())
        all_records += recs
        res = summarize(label, mode, seeds, [r.success for r in recs], [r.partial for r in recs],
                        [r.turns for r in recs])
        out[mode] = res.to_dict()
    _write_records(run, f"eval-{label}", all_records)
    out["wall_s"] = time.time() - t0
    return run.mark(f"eval_{label}", out)


EVAL_STREAM = 999_983   # sampling stream of evaluations; rollout step n uses stream n


def latest_version(run: RunDir) -> int:
    """Newest published policy version: 0 is the warm start, v is the result of RL step v−1."""
    v = 0
    while run.done(f"publish_{v + 1:04d}") is not None:
        v += 1
    return v


# ----------------------------------------------------------------------------------------------
# one RL step


def rollout(run_dir: str, step: int) -> str:
    """B tasks × G executions with the current policy version; records land in the lake.
    A replay (`run.replay`) takes the stored run's executions of this step instead."""
    run = RunDir.open(run_dir)
    part = f"step={step}"
    if (m := run.done(f"rollout_{step:04d}")) is not None:
        return m["part"]
    cfg, t0 = run.cfg, time.time()
    records = _replayed(run, part) if cfg.run.replay else _roll_out(run, step)
    from .processor.batch import reward_of

    for r in records:
        r.reward = reward_of(r.success, r.partial, cfg.rl.partial_reward) if r.status != "failed" else 0.0
    _write_records(run, part, records)
    n = len(records)
    stats = {
        "part": part, "executions": n, "failed": sum(r.status == "failed" for r in records),
        "success": sum(r.success for r in records) / n, "partial": sum(r.partial for r in records) / n,
        "turns": sum(r.turns for r in records) / n, "compactions": sum(r.compactions for r in records),
        "invalid_actions": sum(r.invalid_actions for r in records),
        "tokens_generated": sum(r.tokens_generated for r in records), "rollout_s": time.time() - t0,
    }
    return run.mark(f"rollout_{step:04d}", stats)["part"]


def _roll_out(run: RunDir, step: int) -> list:
    """The step's executions, generated by policy version `step` (the tasks depend on step and seed only)."""
    from .harness.loop import ExecutionSpec, fork_tree
    from .harness.policies import EnginePolicy

    cfg = run.cfg
    ro = cfg.rollout
    eng = _engine_at(run, step)      # version n rolls out step n (on-policy)
    eng.reseed(cfg.run.seed * 1_000_003 + step)
    specs = []
    rng = random.Random(cfg.run.seed * 1_000_003 + step)
    for b in range(ro.tasks_per_step):
        seed = cfg.env.train_seed_start + step * ro.tasks_per_step + b
        group = [ExecutionSpec(run.run_id, step, f"{run.run_id}/s{step}/t{b}/g{g}", f"seed{seed}", seed, "train", step)
                 for g in range(ro.group_size)]
        if ro.fork_k > 1:   # branching rollouts: trees of forks from saved environment states
            fork_tree(group, ro.fork_k, ro.fork_depth, ro.fork_turns, rng,
                      ro.fork_entropy if ro.fork_at == "entropy" else None)
        specs += group
    with phase(f"step {step}: rollout", len(specs)) as tick:
        return _run_policy(run, specs, EnginePolicy(eng, ro.temperature), lambda r: tick(), rollout=True)


def score(run_dir: str, step: int) -> dict:
    """Group-relative advantages from the rewards rollout derived from what the executions left behind.

    With `processor.dedup`, identical executions of a task are collapsed into the one with the smallest
    id (`gyre_core.lake.dedup`): it is trained with a multiplicity, the group statistics count every
    execution, and each duplicate's row names the execution it was collapsed into (`kept_as`)."""
    run = RunDir.open(run_dir)
    if (m := run.done(f"score_{step:04d}")) is not None:
        return m
    from collections import Counter

    from .processor.batch import group_advantages

    t0 = time.time()
    ex = _lake(run).read("executions", run.run_id, f"step={step}").to_pylist()
    ok = [e for e in ex if e["status"] != "failed"]
    rewards = {e["execution_id"]: e["reward"] for e in ok}   # set once, in rollout (reward_of)
    found = _kept_as(run, step) if run.cfg.processor.dedup else {}
    kept_as = {i: found.get(i, i) for i in rewards}   # status is in the key: a kept twin is not failed
    mult = Counter(kept_as.values())
    groups: dict[str, list[str]] = {}
    for e in ok:
        if kept_as[e["execution_id"]] == e["execution_id"]:
            groups.setdefault(e["task_id"], []).append(e["execution_id"])
    kept_adv = group_advantages({i: rewards[i] for i in mult}, groups, run.cfg.rl.advantage_norm, dict(mult),
                                std_floor=run.cfg.rl.advantage_std_floor)
    adv = {i: kept_adv[k] for i, k in kept_as.items()}      # a duplicate gets its kept twin's advantage
    from .lake.schema import SCORES

    table = pa.Table.from_pylist([{
        "run_id": run.run_id, "step": step, "execution_id": e["execution_id"], "task_id": e["task_id"],
        "reward": rewards.get(e["execution_id"]), "advantage": adv.get(e["execution_id"]),
        "excluded": e["execution_id"] not in adv,
        "reason": "" if e["execution_id"] in adv else (e["error"] or e["status"]),
        "multiplicity": mult.get(e["execution_id"], 0) if e["execution_id"] in adv else 1,
        "kept_as": kept_as.get(e["execution_id"], e["execution_id"])} for e in ex], schema=SCORES)
    _lake(run).write_part(run.run_id, f"score={step}", {"scores": table})
    rs = list(rewards.values()) or [0.0]
    mean = sum(rs) / len(rs)
    std = (sum((r - mean) ** 2 for r in rs) / len(rs)) ** 0.5
    return run.mark(f"score_{step:04d}", {"reward_mean": mean, "reward_std": std, "excluded": len(ex) - len(ok),
                                          "collapsed": len(kept_as) - len(mult), "score_s": time.time() - t0})


def _kept_as(run: RunDir, step: int) -> dict[str, str]:
    """execution_id -> the identical execution of the step trained in its place (itself when kept),
    from the DuckDB content-hash dedup over the lake."""
    from .lake.dedup import dedup_groups
    from .lake.sql import connect

    con = connect(run.cfg.lake.root, run_id=run.run_id, storage_options=run.cfg.lake.storage_options or None)
    try:
        groups = dedup_groups(con, step).to_pylist()
    finally:
        con.close()
    return {m: g["execution_id"] for g in groups for m in g["members"]}


def process(run_dir: str, step: int) -> str:
    """Training sequences with per-token advantages and two-level weights, saved for the trainer.

    Executions that `score` collapsed into an identical one (multiplicity 0) are not read; the kept one
    is trained with its multiplicity as weight and counts that many times in the normaliser. In flat mode
    the update is exactly that of training every duplicate; in tree mode see `processor.sampling`."""
    run = RunDir.open(run_dir)
    if (m := run.done(f"process_{step:04d}")) is not None:
        return m["batch"]
    import torch

    from .lake.schema import train_tokens_table
    from .processor.batch import TrainBatch, build_batch

    t0 = time.time()
    pc = run.cfg.processor
    sc = [s for s in _lake(run).read("scores", run.run_id, f"score={step}").to_pylist() if not s["excluded"]]
    # a scores part written before dedup has no multiplicity: every execution stands for itself
    mult = {s["execution_id"]: 1 if s.get("multiplicity") is None else s["multiplicity"] for s in sc}
    collapsed = {i for i, m in mult.items() if m == 0}
    sc = [s for s in sc if s["execution_id"] not in collapsed]
    mult = {i: m for i, m in mult.items() if m > 0}
    records = _read_records(run, f"step={step}", skip=collapsed)
    adv = {s["execution_id"]: s["advantage"] for s in sc}
    tables, extra = {}, {}
    if pc.mode == "tree":
        from .processor.credit import CreditConfig
        from .processor.pruning import PruneConfig
        from .processor.sampling import SamplingConfig, batch_tables, tree_batch

        rewards = {s["execution_id"]: s["reward"] for s in sc}
        tb = tree_batch(records, adv, rewards, multiplicity=mult,
                        sampling=SamplingConfig(j_max=pc.j_max, token_budget=pc.token_budget, weighting=pc.weighting,
                                                role_order=tuple(pc.role_order), seed=run.cfg.run.seed * 7919 + step),
                        credit=CreditConfig(mode=pc.credit, shrink_k=pc.shrink_k),
                        prune=PruneConfig(pc.prune_repeats, pc.prune_period) if pc.prune_repeats else None)
        tables = batch_tables(run.run_id, step, tb, pc.weighting)
        batch = TrainBatch(tb.sequences, tb.normaliser, tb.n_executions, tb.excluded)
        extra = {"tokens_unique": tb.tokens_unique, "tokens_flat": tb.tokens_flat}
    else:
        batch = build_batch(records, adv, mult, run.cfg.rl.progress_credit)
    tables["train_tokens"] = train_tokens_table({
        "run_id": run.run_id, "step": step, "execution_id": s.execution_id, "call_index": s.call_index,
        "advantage": next((a for a, w in zip(s.advantages, s.weights) if w), 0.0),
        "n_tokens": len(s.input_ids), "n_trainable": s.n_trainable, "weight": sum(s.weights)}
        for s in batch.sequences)
    _lake(run).write_part(run.run_id, f"process={step}", tables)
    path = run.batch_path(step)
    tmp = path.with_suffix(".tmp")
    torch.save(batch, tmp)
    tmp.replace(path)
    return run.mark(f"process_{step:04d}", {
        "batch": str(path), "sequences": len(batch.sequences), "executions": batch.n_executions,
        "executions_unique": len({s.execution_id for s in batch.sequences}), "collapsed": len(collapsed),
        "excluded": len(batch.excluded), "tokens_trained": sum(s.n_trainable for s in batch.sequences),
        "tokens_total": sum(len(s.input_ids) for s in batch.sequences), "process_s": time.time() - t0,
        **extra})["batch"]


def _trainer(run: RunDir, version: int):
    """The RL trainer holding policy `version`, resumed from its checkpoint when not in memory."""
    from .model import load_policy
    from .trainer.engine import Trainer

    held = run.cached("trainer", lambda: None)
    if held is not None and held[1] == version:
        return held[0]
    cfg = run.cfg
    model, tok = load_policy(str(run.warm), device=cfg.model.device)
    trainer = Trainer(model, lr=cfg.rl.lr, zero_stage=cfg.trainer.zero_stage, grad_clip=cfg.rl.grad_clip,
                      optimizer=cfg.rl.optimizer,
                      pad_id=tok.pad_token_id or 0)
    if version > 0:
        state = trainer.load(str(run.ckpt), f"v{version}")
        _restore_rng(state.get("rng"))
    run.drop_cached("trainer")
    run.cached("trainer", lambda: (trainer, version))
    return trainer


def train(run_dir: str, step: int) -> str:
    """One policy update from version `step` to `step + 1`; saves a full checkpoint."""
    run = RunDir.open(run_dir)
    if (m := run.done(f"train_{step:04d}")) is not None:
        return m["checkpoint"]
    import torch

    t0 = time.time()
    batch = torch.load(process(run_dir, step), weights_only=False)
    try:
        return _train_step(run, step, batch, t0)
    except BaseException:
        run.drop_cached("trainer")   # half-accumulated gradients or a half-applied update: reload on retry
        raise


def _train_step(run: RunDir, step: int, batch, t0: float) -> str:
    from .processor.batch import micro_batches

    cfg, rl = run.cfg, run.cfg.rl
    seqs = batch.sequences
    if cfg.processor.mode == "tree":   # every unique token forwarded and back-propagated once
        from .trainer.packing import pack_branches, packing_stats

        chunks = [[t] for t in pack_branches(seqs, max_tokens=rl.micro_batch_tokens)]
        packing = packing_stats(seqs, [c[0] for c in chunks])
    else:
        chunks = micro_batches(seqs, rl.micro_batch_tokens)
        packing = {}
    backtracks = 0
    while True:
        trainer, lr = _trainer(run, step), rl.lr * 0.5 ** backtracks
        trainer.set_lr(lr)
        totals, first_epoch, grad_norm = _update(run, step, trainer, chunks, batch.normaliser)
        shift = _policy_shift(run, trainer, chunks)
        kl = shift["kl"] / max(shift["tokens"], 1.0)
        if rl.max_kl is None or kl <= rl.max_kl or backtracks == rl.kl_backtracks:
            break
        backtracks += 1                  # too far from the behaviour policy: undo (back to version `step`), redo
        run.drop_cached("trainer")
    trainer.set_lr(rl.lr)                # the checkpoint carries the configured rate, not this step's
    n = max(totals.get("tokens", 0.0), 1.0)
    n0 = max(first_epoch.get("tokens", 0.0), 1.0)
    tag = f"v{step + 1}"
    trainer.save(str(run.ckpt), tag, {"version": step + 1, "step": step, "rng": _rng_state()})
    run.drop_cached("trainer")
    run.cached("trainer", lambda: (trainer, step + 1))
    return run.mark(f"train_{step:04d}", {
        "checkpoint": str(run.ckpt / tag), "loss": totals.get("loss", 0.0),
        "clip_frac": shift["clipped"] / max(shift["tokens"], 1.0), "kl": kl,
        "clip_frac_in_update": totals.get("clip_frac", 0.0) / n,
        "entropy": totals.get("entropy", 0.0) / n,
        "logprob_mismatch": first_epoch.get("logprob_mismatch", 0.0) / n0,
        "tokens_trained": first_epoch.get("tokens", 0.0), "grad_norm": grad_norm,
        "kl_backtracks": backtracks, "lr": lr,
        "staleness": 0, "train_s": time.time() - t0,
        **{f"packing_{k}": v for k, v in packing.items()}})["checkpoint"]


def _update(run: RunDir, step: int, trainer, chunks, normaliser: float):
    """`rl.epochs` passes of PPO over the step's micro-batches, one optimizer step per pass; returns the
    loss statistics summed over all passes and over the first, and the last gradient norm."""
    cfg, rl = run.cfg, run.cfg.rl
    totals: dict[str, float] = {}
    first_epoch: dict[str, float] = {}
    grad_norm = 0.0
    with phase(f"step {step}: train", rl.epochs * len(chunks)) as tick:
        for epoch in range(rl.epochs):
            for k, chunk in enumerate(chunks):
                st = trainer.micro_step(chunk, normaliser, objective="ppo", temperature=cfg.rollout.temperature,
                                        clip_low=rl.clip_low, clip_high=rl.clip_high,
                                        negative_scale=rl.negative_scale, entropy_coef=rl.entropy_coef,
                                        last=k == len(chunks) - 1)
                for key, v in st.items():
                    totals[key] = totals.get(key, 0.0) + v
                    if epoch == 0:
                        first_epoch[key] = first_epoch.get(key, 0.0) + v
                tick()
            if chunks:
                grad_norm = trainer.optimizer_step()
    return totals, first_epoch, grad_norm


def _policy_shift(run: RunDir, trainer, chunks) -> dict[str, float]:
    """The update's size: KL and clipped tokens of the new policy against the behaviour one, summed over
    every 4th micro-batch (a forward over all of them was 22–24% of a `default` train step)."""
    rl = run.cfg.rl
    shift = {"kl": 0.0, "clipped": 0.0, "tokens": 0.0}
    for chunk in chunks[::4]:
        for key, v in trainer.policy_shift(chunk, temperature=run.cfg.rollout.temperature, clip_low=rl.clip_low,
                                           clip_high=rl.clip_high).items():
            shift[key] += v
    return shift


def publish(run_dir: str, step: int) -> str:
    """Write policy version step+1 as safetensors (fsspec) and log the step's metrics to MLflow."""
    run = RunDir.open(run_dir)
    if (m := run.done(f"publish_{step + 1:04d}")) is not None:
        return m["uri"]
    from .trainer.publish import publish_weights

    t0 = time.time()
    train(run_dir, step)
    trainer = _trainer(run, step + 1)
    uri = publish_weights(trainer.state_dict(), run.weights_uri(step + 1))
    metrics = step_metrics(run, step)
    metrics["time/publish_s"] = time.time() - t0
    tracker(run).log_metrics(metrics, step)
    return run.mark(f"publish_{step + 1:04d}", {"uri": uri, "metrics": metrics})["uri"]


def step_metrics(run: RunDir, step: int) -> dict[str, float]:
    s = f"{step:04d}"
    ro, sc, pr, tr = (run.done(f"{k}_{s}") or {} for k in ("rollout", "score", "process", "train"))
    return {
        "reward/mean": sc.get("reward_mean", 0.0), "reward/std": sc.get("reward_std", 0.0),
        "rollout/success": ro.get("success", 0.0), "rollout/partial": ro.get("partial", 0.0),
        "rollout/turns": ro.get("turns", 0.0), "rollout/failed": ro.get("failed", 0),
        "rollout/compactions": ro.get("compactions", 0), "rollout/invalid_actions": ro.get("invalid_actions", 0),
        "tokens/generated": ro.get("tokens_generated", 0), "tokens/trained": pr.get("tokens_trained", 0),
        "dedup/collapsed": sc.get("collapsed", 0),
        "train/loss": tr.get("loss", 0.0), "train/kl": tr.get("kl", 0.0), "train/clip_frac": tr.get("clip_frac", 0.0),
        "train/clip_frac_in_update": tr.get("clip_frac_in_update", 0.0),
        "train/entropy": tr.get("entropy", 0.0), "train/logprob_mismatch": tr.get("logprob_mismatch", 0.0),
        "train/grad_norm": tr.get("grad_norm", 0.0), "train/staleness": tr.get("staleness", 0),
        "train/kl_backtracks": tr.get("kl_backtracks", 0), "train/lr": tr.get("lr", run.cfg.rl.lr),
        "tokens/packed_computed": tr.get("packing_tokens_computed", 0), "tokens/flat": tr.get("packing_tokens_flat", 0),
        "time/rollout_s": ro.get("rollout_s", 0.0), "time/score_s": sc.get("score_s", 0.0),
        "time/process_s": pr.get("process_s", 0.0), "time/train_s": tr.get("train_s", 0.0),
    }


# ----------------------------------------------------------------------------------------------
# the RL phase on cell agents (elastic.enabled): the same steps, streamed across K cells


def elastic_rl(run_dir: str, on_role=None, launcher=None) -> dict:
    """All RL steps at once on `elastic.cells` cell agents under `elastic.policy` (see `gyre_core.elastic`).
    `on_role(cell, role, reason)` hears each cell's starting role and every finished switch (the Prefect
    task passes `gyre_ops.cells.RoleRecorder`, which records them as queue moves). `launcher` starts the
    agents: None starts them as local processes; `elastic.launch=prefect` needs the Prefect task's
    `gyre_ops.cell_runs.PrefectCellLauncher`.

    Rollout, scoring and training overlap here, so there are no per-phase markers. As each version v is
    published, step v−1 is finished: its executions land in the lake as the step-by-step loop writes them,
    MLflow gets its metrics, and it gets its `publish_` marker (`_elastic_step_done`). A crash therefore
    loses only the steps in flight: rerunning resumes at the newest published version — the cells load
    its weights, the bursts continue from its step (same tasks and seeds), and the core's optimizer starts
    afresh from those weights (Adam's moments are not published; the summary's `resumed_from` says where).
    At the end MLflow gets the role timeline, the busy fractions and the controller's decisions (of the
    last invocation)."""
    run = RunDir.open(run_dir)
    if (m := run.done("elastic")) is not None:
        return m
    import json

    from .elastic.runtime import run_elastic
    from .elastic.work import HarnessWork

    cfg = run.cfg
    if run.done("warm_start") is None:
        raise CheckpointError("elastic_rl: the warm start is not done; run warm_start first")
    if cfg.elastic.launch == "prefect" and launcher is None:
        raise ConfigError("elastic.launch=prefect: cell agents start as Prefect flow runs, which only the train "
                          "flow's elastic-rl task creates (`gyre train`, or the `train` deployment)")
    start = latest_version(run)                 # steps before it finished in an earlier invocation
    work = HarnessWork(run_dir, cfg.rl.steps, first_step=start)
    t = tracker(run)
    last = [time.time()]
    with phase(f"elastic RL: {cfg.rl.steps} steps on {cfg.elastic.cells} {cfg.elastic.mode} cells "
               f"({cfg.elastic.policy})" + (f", resuming at step {start}" if start else ""), cfg.rl.steps) as tick:
        for _ in range(start):
            tick()

        def published(version: int, stats: dict) -> None:
            now = time.time()
            _elastic_step_done(run, t, version - 1, work.take_records(version - 1), stats, now - last[0])
            last[0] = now
            tick()

        res = (run_elastic(cfg.elastic, work, on_version=published, on_role=on_role, launcher=launcher)
               if start < cfg.rl.steps else None)
    summary = {k: v for k, v in res.to_dict().items() if k != "decisions"} if res else {}
    summary["resumed_from"] = start
    if res is not None:
        summary["switch_marks"] = [[cell, round(t_, 3), src, dst] for cell, t_, src, dst in res.switch_marks]
        t.log_metrics({f"elastic/busy_{k}": v for k, v in res.busy.items() if v is not None}
                      | {"elastic/step_s": res.step_s, "elastic/switches": res.switches,
                         "elastic/reroutes": res.reroutes, "elastic/stale_dropped": res.stale_dropped,
                         "elastic/start_s": res.start_s}, 0)
        out = run.path / "elastic"
        out.mkdir(exist_ok=True)
        res.plot(str(out / "role_timeline.png"))
        (out / "decisions.json").write_text(json.dumps([d.to_dict() for d in res.decisions], indent=1))
        (out / "summary.json").write_text(json.dumps(summary, indent=1))
        for f in ("role_timeline.png", "decisions.json", "summary.json"):
            t.log_artifact(out / f, "elastic")
    # the phase's wall time across invocations: each step's (from the previous publish, or from this
    # invocation's start: agents' start-up included), and the writes after the last
    steps_s = sum(run.done(f"publish_{v:04d}")["metrics"]["time/elastic_step_s"] for v in range(1, cfg.rl.steps + 1))
    summary["rl_wall_s"] = steps_s + (time.time() - last[0])
    return run.mark("elastic", summary)


def _elastic_step_done(run: RunDir, t, step: int, recs: list, ts: dict, step_s: float) -> None:
    """Land a finished elastic step: its executions in the lake, its metrics in MLflow, its `publish_`
    marker last (the marker is what a resumed run trusts)."""
    _write_records(run, f"step={step}", recs)
    n = max(len(recs), 1)
    metrics = {"rollout/executions": len(recs), "rollout/success": sum(r.success for r in recs) / n,
               "rollout/partial": sum(r.partial for r in recs) / n,
               "reward/mean": sum(r.reward for r in recs) / n,
               "rollout/failed": sum(r.status == "failed" for r in recs),
               "tokens/generated": sum(r.tokens_generated for r in recs),
               "time/elastic_step_s": step_s}
    tok = max(ts.get("tokens", 0.0), 1.0)      # `ts`: summed over the step's micro-steps, on every cell
    # the loss as the step loop reports it (micro-steps sum per-execution means; the update divides
    # by the executions trained); behaviour vs trained log-probs are not compared here: with
    # staleness they differ by design (decoupled PPO's IS weight covers that)
    metrics.update({"tokens/trained": ts.get("tokens", 0.0),
                    "train/loss": ts.get("loss", 0.0) / max(ts.get("executions", 0.0), 1.0),
                    "train/entropy": ts.get("entropy", 0.0) / tok,
                    "train/clip_frac_in_update": ts.get("clip_frac", 0.0) / tok,
                    "train/is_truncated": ts.get("is_truncated", 0.0) / tok})
    t.log_metrics(metrics, step)
    run.mark(f"publish_{step + 1:04d}", {"uri": run.weights_uri(step + 1), "metrics": metrics})


def tracker(run: RunDir):
    """The run's one MLflow run (created on first use, reopened by the id in the run directory), with
    the resolved config as params and the run directory, lake root and preset as tags."""
    from .tracking import Tracker, flatten

    def make():
        t = Tracker(run.cfg.tracking.uri, run.cfg.tracking.experiment, run.path, run.run_id)
        t.log_params(flatten(run.cfg.model_dump(mode="json")))
        t.set_tags({"gyre.run_id": run.run_id, "gyre.run_dir": str(run.path), "gyre.lake_root": run.cfg.lake.root,
                    "gyre.preset": run.cfg.preset})
        return t

    return run.cached("tracker", make)


def tag_run(run_dir: str, tags: dict[str, str], append: dict[str, str] | None = None) -> dict[str, str]:
    """Tag the run's MLflow run (e.g. with the orchestrator's ids, as plain strings) and mark it running.

    `append` adds each value to a comma-separated list tag instead (every invocation that worked on a
    resumed run stays findable). Also logs `config.yaml` now, so a run that crashes still has it.
    Returns the Gyre run id and where the MLflow run is: its id, experiment id, tracking URI, UI `url`
    and `hint` (see `tracking.run_link`)."""
    run = RunDir.open(run_dir)
    t = tracker(run)
    t.reopen()
    t.set_tags(tags)
    for k, v in (append or {}).items():
        t.append_tag(k, v)
    t.log_artifact(run.path / "config.yaml")
    return {"run_id": run.run_id, "mlflow_run_id": t.run_id, "experiment_id": t.experiment_id, "uri": t.uri,
            **t.link()}


POLICY_ARTIFACT = "policy"   # `runs:/<mlflow run id>/policy`: the newest policy as an HF model directory


def export_policy(run_dir: str) -> str:
    """Log the newest published policy version to the MLflow run as an HF model directory under
    `policy/`, so that `runs:/<mlflow run id>/policy` downloads a directory `model.load_policy` loads.
    Idempotent per (MLflow run, version); returns that URI."""
    run = RunDir.open(run_dir)
    t = tracker(run)
    v = latest_version(run)
    if (m := run.done("export_policy")) is not None and m["version"] == v and m["mlflow_run_id"] == t.run_id:
        return m["uri"]
    import tempfile

    from .model import _tied_keys, load_policy, save_policy
    from .trainer.publish import load_weights

    weights = load_weights(run.weights_uri(v))
    model, tok = load_policy(str(_policy_dir(run)), dtype=next(iter(weights.values())).dtype)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    if unexpected or set(missing) - _tied_keys(model):
        raise CheckpointError(f"published weights {run.weights_uri(v)} do not fit the model in {_policy_dir(run)}: "
                              f"missing {sorted(set(missing) - _tied_keys(model))[:3]}, unexpected {sorted(unexpected)[:3]}")
    with tempfile.TemporaryDirectory(prefix="gyre-policy-") as d:
        save_policy(model, tok, d)
        uri = t.log_dir(d, POLICY_ARTIFACT)
    t.set_tags({"gyre.policy_version": str(v), "gyre.policy_uri": uri})
    return run.mark("export_policy", {"version": v, "uri": uri, "mlflow_run_id": t.run_id,
                                      "weights": run.weights_uri(v)})["uri"]


def _rng_state() -> dict:
    import torch

    return {"python": random.getstate(), "torch": torch.get_rng_state()}


def _restore_rng(state: dict | None) -> None:
    import torch

    if state:
        random.setstate(state["python"])
        torch.set_rng_state(state["torch"])
