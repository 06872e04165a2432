"""Prepare a run: its directory and initial policy, with everything that would stop it later checked first.

    run_dir = prepare(cfg)      # a new run, or the same run reopened (then checked for resuming)
"""
from __future__ import annotations

import re
import sys
import time

from ..config import ConfigError, GyreConfig, apply_threads, gyre_home
from ..run import (DEMOS_PART, STEP_PART_PREFIX, CheckpointError, RunDir, ckpt_tag, eval_part, process_part,
                   publish_marker, score_part, step_marker, step_part)


def preflight(cfg: GyreConfig):
    """What would stop the run at its first task, checked in a moment and without writing anything: the
    environment loads with its kwargs, a run of this name holds the same config, the lake takes writes, an
    elastic fleet fits this host. `gyre train` calls it before Prefect starts; `prepare` again (a run
    started from a deployment). Raises `ConfigError` naming the field; returns (env, lake)."""
    from ..envs import configured_env, has_random_action
    from ..lake import Lake

    env = configured_env(cfg.env)
    if cfg.eval.random_baseline and not has_random_action(env):
        raise ConfigError(f"eval.random_baseline: environment {cfg.env.target!r} lists no actions and has no "
                          "random_action hook, so it has no random floor; set eval.random_baseline=false")
    if cfg.harness.command:
        from ..harness.external import resolve_command

        resolve_command(cfg.harness.command)
    RunDir.check_reusable(cfg)
    if cfg.elastic.enabled:
        from ..elastic.connections import check_fleet

        check_fleet(cfg.elastic)
    lake = Lake.from_config(cfg.lake)
    lake.check_writable(home=str(gyre_home()))
    return env, lake


def prepare(cfg: GyreConfig) -> str:
    """Create the run directory and its initial policy.

    Everything that would stop a run later is checked here, before any rollout: the lake root, the
    environment target, `model.path`, and on resume every checkpoint the run will read.
    """
    from ..envs import supports
    from ..model import PolicyLoadError, build_tiny_model, load_policy, save_policy, train_tokenizer

    apply_threads(cfg)
    env, lake = preflight(cfg)
    model = tok = None
    if cfg.model.path:
        fetch_if_missing(cfg)
        try:
            model, tok = load_policy(cfg.model.path)
        except PolicyLoadError as exc:
            raise ConfigError(f"model.path: {exc}") from None
    run = RunDir.create(cfg)
    if cfg.run.replay:
        check_replayable(lake, cfg)
    left = lake.cleanup(run.run_id)            # what a crashed attempt of this run left in the lake
    if any(left.values()):
        print(f"gyre lake: cleaned up after an earlier attempt of run {run.run_id}: {left}", file=sys.stderr)
    if run.done("prepare"):
        reconcile_markers(run, lake)
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


def fetch_if_missing(cfg: GyreConfig) -> None:
    """`model.fetch`: download the named checkpoint into `model.path` the first time (the directory is kept)."""
    from pathlib import Path

    from ..model_import import ModelImportError, fetch_model

    m = cfg.model
    if m.fetch and not Path(m.path).exists():
        import sys

        print(f"gyre: fetching {m.fetch} into {m.path} (once)", file=sys.stderr)
        try:
            fetch_model(m.fetch, m.path)
        except ModelImportError as exc:
            raise ConfigError(f"model.fetch: {exc}") from None


def check_replayable(lake, cfg: GyreConfig) -> None:
    """A replay needs the source run's demonstrations and one committed `step=N` part per RL step."""
    src = cfg.run.replay
    if src == cfg.run_id():
        raise ConfigError(f"run.replay: a run cannot replay itself ('{src}'); leave run.name unset or change it")
    parts = lake.parts(src)
    if not parts:
        raise ConfigError(f"run.replay: no run '{src}' in the lake at {cfg.lake.root} (runs: {', '.join(lake.runs()) or 'none'})")
    missing = [step_part(s) for s in range(cfg.rl.steps) if step_part(s) not in parts]
    if DEMOS_PART not in parts or missing:
        have = [p for p in parts if p.startswith(STEP_PART_PREFIX) or p == DEMOS_PART]
        raise ConfigError(f"run.replay: run '{src}' lacks {', '.join(([DEMOS_PART] if DEMOS_PART not in parts else []) + missing)} "
                          f"for rl.steps={cfg.rl.steps} (it has {', '.join(have) or 'nothing'}); lower rl.steps")


def promised_parts(run: RunDir) -> dict[str, str]:
    """marker -> the lake part it says was written, for every completion marker of the run that names one."""
    out = {}
    for f in sorted((run.path / "markers").glob("*.json")):
        name = f.stem
        if m := re.fullmatch(r"(rollout|score|process)_(\d+)", name):
            out[name] = {"rollout": step_part, "score": score_part, "process": process_part}[m[1]](int(m[2]))
        elif name.startswith("eval_"):
            out[name] = eval_part(name[len("eval_"):])
        elif name == "warm_start":
            out[name] = DEMOS_PART
    if run.done("elastic") is not None:                # the elastic phase writes a part per step it ran
        out.update({f"elastic step {s}": step_part(s) for s in range(run.cfg.rl.steps)
                    if run.done(publish_marker(s + 1)) is not None})
    return out


def reconcile_markers(run: RunDir, lake) -> list[str]:
    """On resume, the completion markers and the lake must agree. A marker whose lake part is not committed
    (its manifest was damaged or lost and the part set aside by `Lake.cleanup`, or the part deleted) is
    withdrawn — moved to `markers/withdrawn/`, never deleted — so that its phase runs again and writes the
    part anew:

    - a score, process or evaluation part: recomputed from what it was computed from (the same rows, the
      same version and seeds);
    - a step's rollout part, before the step trained: the step's rollout, score and process markers all go,
      and the step is redone as if it had crashed;
    - a step's rollout part after the step trained: rolled out again only where that reproduces it token
      for token (`engine.kind=local`: the same version, seeds and deterministic kernels); on another engine
      it would be a new sample, not what was trained, so it is said and left out, like the warm start's
      demonstrations and an elastic step (rewriting those would mean training again).

    What was set aside is under the lake's `_quarantine/`. Returns what was said."""
    committed = set(lake.parts(run.run_id))
    promised = promised_parts(run)
    said, withdraw = [], []
    for marker, part in promised.items():
        if part in committed:
            continue
        rollout = re.fullmatch(r"rollout_(\d+)", marker)
        trained = rollout is not None and run.done(step_marker("train", int(rollout[1]))) is not None
        if (marker == "warm_start" or marker.startswith("elastic step")
                or (trained and run.cfg.engine.kind != "local")):
            said.append(f"gyre: run {run.run_id}: lake part {part} (of {marker.replace('_', ' ')}) is missing; it "
                        "cannot be rewritten as it was without training again, so the run goes on without it "
                        "(what was set aside is under the lake's _quarantine/)")
            continue
        step_markers = ([step_marker(k, int(rollout[1])) for k in ("rollout", "score", "process")]
                        if rollout is not None and not trained else [marker])
        withdraw += [m for m in step_markers if run.done(m) is not None and m not in withdraw]
        said.append(f"gyre: run {run.run_id}: lake part {part} is missing though {marker} was done; "
                    f"{', '.join(step_markers)} run again")
    stamp = time.strftime("%Y%m%dT%H%M%S")
    for marker in withdraw:
        away = run.path / "markers" / "withdrawn" / f"{marker}-{stamp}.json"
        away.parent.mkdir(exist_ok=True)
        run.marker(marker).replace(away)
    for line in said:
        print(line, file=sys.stderr)
    return said


def check_resumable(run: RunDir) -> None:
    """Load what a resumed run will read (policy dirs, published weights, the newest DeepSpeed
    checkpoint) so a corrupt file stops the run here with its path, not in the middle of a step."""
    from ..model import load_policy
    from ..trainer.publish import load_weights

    load_policy(str(run.policy0))
    if run.done("warm_start") is None:
        return
    load_policy(str(run.warm))
    v = run.latest_version()
    for uri in {run.weights_uri(0), run.weights_uri(v)}:
        try:
            load_weights(uri)
        except Exception as exc:
            raise CheckpointError(f"published weights {uri} are unreadable ({type(exc).__name__}: {exc}); "
                                  f"delete the run directory to start over") from None
    # the checkpoint the next train step loads: v, or v+1 when its train step finished but publish did not
    newest = v + 1 if run.done(step_marker("train", v)) is not None else v
    if newest == 0:
        return
    tag_dir = run.ckpt / ckpt_tag(newest)
    need = ["mp_rank_*_model_states.pt"] + (["*optim_states.pt"] if run.cfg.trainer.zero_stage >= 1 else [])
    for pattern in need:
        if not any(tag_dir.glob(pattern)):
            raise CheckpointError(f"checkpoint {tag_dir} is missing or incomplete (no {pattern}); "
                                  f"delete the run directory to start over")
