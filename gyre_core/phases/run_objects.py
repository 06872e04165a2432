"""What every phase of a run shares, loaded once per process and cached on the run directory.

    bundle = policy_bundle(run)          # engine, tokenizer, chat format, stop tokens of the run's model
    engine = engine_at(run, version)     # the engine holding published policy `version`
    records = run_policy(run, specs, policy)            # executions through the harness
    write_records(run, part, records); read_records(run, part)   # the run's lake part
    trainer = trainer_at(run, version)   # the RL trainer holding `version` (resumed from its checkpoint)
    t = tracker(run)                     # the run's one MLflow run

Consecutive Prefect tasks run in one process, so a model, an engine or a trainer loaded by one phase is
there for the next; a fresh process (a resumed run, a retried task) loads them from the run directory.
"""
from __future__ import annotations

import random
import threading
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from ..config import GyreConfig
from ..envs.protocol import supports
from ..run import BASE_VERSION, CONTROL_VERSION, RunDir, ckpt_tag

_ENGINE_LOCK = threading.RLock()


@dataclass(slots=True)
class PolicyBundle:
    """The run's initial model as the harness uses it: the engine that decodes it (made on first use, of
    the config's `engine.kind`), its tokenizer, the chat format that renders turns, the texts of its stop
    tokens, and the model itself (the local engine decodes with it; for vLLM it is the reference a reload
    is checked against)."""

    model: Any
    tokenizer: Any
    chat: Any
    stop_texts: dict[int, str]
    make_engine: Any
    _engine: Any = None

    @property
    def engine(self):
        with _ENGINE_LOCK:                    # made once, whichever thread asks first
            if self._engine is None:
                self._engine = self.make_engine()
        return self._engine

    @property
    def stop_id(self) -> int:
        """The stop token scripted policies end their answers with (the tokenizer's eos)."""
        eos = self.tokenizer.eos_token_id
        return eos if eos in self.stop_texts else min(self.stop_texts)

    @classmethod
    def of(cls, model, tok, seed: int, version: int, engine_cfg=None, model_dir: str | None = None) -> "PolicyBundle":
        """A bundle around a loaded model (from `model_dir`): its engine holds `version` and samples from
        `seed`'s stream. `engine_cfg` (`EngineConfig`; None: local) picks the engine."""
        from ..harness.conversation import ChatFormat
        from ..model import stop_token_ids

        stops = stop_token_ids(model, tok)
        if engine_cfg is None or engine_cfg.kind == "local":
            def make():
                from ..engine import LocalEngine
                return LocalEngine(model, stops, version=version, seed=seed)
        else:
            def make():
                return vllm_engine(engine_cfg, model_dir, stops, seed, version)
        return cls(model, tok, ChatFormat(tok), {i: tok.decode([i]) for i in stops}, make)


def vllm_engine(engine_cfg, model_dir: str, stops: list[int], seed: int, version: int):
    """A vLLM server on `model_dir` and the engine that owns it (`close()` stops the server)."""
    from ..engine.vllm import ServerSpec, VLLMEngine, VLLMServer

    server = VLLMServer(ServerSpec.from_config(engine_cfg, model_dir, seed)).start()
    return VLLMEngine(server, stops, version=version, seed=seed, concurrency=engine_cfg.concurrency, owns_server=True)


def policy_bundle(run: RunDir) -> PolicyBundle:
    """The run's `PolicyBundle`, loaded once per process (from `policy0`; `engine_at` sets weights)."""
    from ..model import load_policy

    def make():
        # with vLLM decoding, this copy only checks reloads: on the CPU, leaving the GPU to vLLM and the trainer
        device = "cpu" if run.cfg.engine.kind == "vllm" else run.cfg.model.device
        model, tok = load_policy(str(run.policy0), device=device)
        return PolicyBundle.of(model, tok, run.cfg.run.seed, version=-1, engine_cfg=run.cfg.engine,
                               model_dir=str(run.policy0))

    return run.cached("policy", make)


def engine_at(run: RunDir, version: int):
    """The bundle's engine holding published policy `version` (`CONTROL_VERSION`: the control's). A vLLM
    engine's reload is checked against the published weights' own log-probs (`check_reload`)."""
    bundle = policy_bundle(run)
    eng = bundle.engine
    if eng.version != version and version == BASE_VERSION:
        raise RuntimeError("the initial model is evaluated on a fresh engine only (before any version is loaded)")
    if eng.version != version:
        uri = run.weights_uri("control" if version == CONTROL_VERSION else version)
        if run.cfg.engine.kind == "local":
            eng.load_published(uri, version)
        else:
            check_reload(run, bundle, uri, version)
    return eng


def check_reload(run: RunDir, bundle: PolicyBundle, uri: str, version: int) -> dict:
    """Load `version` into the bundle's vLLM engine, checked against the trainer's log-probs for it (the
    trainer held in this process when it holds that version, else the published weights in the bundle's
    float32 copy); the check goes to `reload_checks(run)[version]`. A failed check stops the run, and a
    retried task reloads and checks again (a reload that silently kept old weights, e.g. a tied head,
    never rolls out)."""
    from ..trainer.publish import load_weights

    held = run.peek_cached("trainer")
    if held is not None and held[1] == version:
        model = held[0].model                 # the trainer that published this version, as it holds it
    else:                                     # the bundle's copy (vLLM decodes, so it only serves as a reference)
        model = bundle.model
        model.load_state_dict(load_weights(uri), strict=False)
    check = bundle.engine.load_checked(uri, version, model, len(bundle.tokenizer), run.cfg.engine.reload_check_tol)
    reload_checks(run)[version] = check
    return check


def reload_checks(run: RunDir) -> dict[int, dict]:
    """This process's reload checks by version (`check_reload`)."""
    return run.cached("reload_checks", dict)


def drop_engine(run: RunDir) -> None:
    """Stop the bundle's engine if it runs a server (before the elastic cells start theirs on the same
    devices); the next use starts it again."""
    bundle = run.peek_cached("policy")
    if bundle is not None and bundle._engine is not None and hasattr(bundle._engine, "close"):
        bundle._engine.close()
        bundle._engine = None


def env_factory(cfg: GyreConfig, rollout: bool = False):
    """Makes the config's environments; RL rollouts (`rollout=True`) get `env.latency_s` added per step."""
    from ..envs import LatencyEnv, load_env

    env = cfg.env
    if rollout and env.latency_s > 0:
        return lambda: LatencyEnv(load_env(env.target, **env.kwargs), env.latency_s)
    return lambda: load_env(env.target, **env.kwargs)


def run_specs(cfg: GyreConfig, bundle: PolicyBundle, specs, policy, on_finish=None, rollout: bool = False) -> list:
    """Run `specs` through the harness with `policy` on the config's environments; the finished records. With
    `harness.command` the model's executions run that external harness through the recording proxy
    (`harness.external`), and so do the expert's demonstrations where the environment can answer the
    program's requests (`expert_reply`: the proxy serves the expert as the model); other scripted policies
    (the random floor) use Gyre's own harness."""
    from ..harness.loop import run_executions
    from ..harness.policies import EnginePolicy, ExpertPolicy

    if cfg.harness.command and (isinstance(policy, EnginePolicy) or (
            isinstance(policy, ExpertPolicy) and supports(env_factory(cfg)(), "expert_reply"))):
        from ..harness.external import run_external
        from ..proxy.pool import CellPool, ExpertPool

        if isinstance(policy, EnginePolicy):
            pool, temperature = CellPool([policy.engine], cfg.proxy.chunk_tokens), policy.temperature
        else:       # the expert as the agent program's model: its demonstrations in the program's own tokens
            pool, temperature = ExpertPool(bundle.tokenizer, bundle.stop_id, policy.epsilon, policy.seed), None
        return run_external(cfg, bundle.chat, bundle.stop_texts, pool, temperature, specs,
                            env_factory(cfg, rollout), on_finish, model_name=served_model_name(cfg))

    return run_executions(specs, policy, cfg.harness, env_factory(cfg, rollout), bundle.chat, bundle.stop_texts,
                          cfg.rollout.concurrency, on_finish)


def served_model_name(cfg: GyreConfig) -> str:
    """The model name the proxy serves (`GET /v1/models`): the model directory's name, or `gyre-tiny`."""
    from pathlib import Path

    return Path(cfg.model.path).name if cfg.model.path else "gyre-tiny"


def run_policy(run: RunDir, specs, policy, on_finish=None, rollout: bool = False) -> list:
    """`run_specs` with the run's config and policy bundle."""
    return run_specs(run.cfg, policy_bundle(run), specs, policy, on_finish, rollout)


# -- the run's records in the lake ------------------------------------------------------------------


def run_lake(run: RunDir):
    from ..lake import Lake

    return run.cached("lake", lambda: Lake.from_config(run.cfg.lake))


def write_records(run: RunDir, part: str, records) -> None:
    from ..lake.schema import calls_table, executions_table

    run_lake(run).write_part(run.run_id, part, {"executions": executions_table(records),
                                                "calls": calls_table(records)})


def read_records(run: RunDir, part: str, skip: set[str] | frozenset[str] = frozenset()) -> list:
    """The part's execution records, less those in `skip` (whose calls are then never rebuilt)."""
    from ..lake.schema import read_executions

    lake = run_lake(run)
    ex, calls = lake.read("executions", run.run_id, part), lake.read("calls", run.run_id, part)
    if skip:
        import pyarrow.compute as pc

        drop = pa.array(sorted(skip), pa.string())
        ex = ex.filter(pc.invert(pc.is_in(ex["execution_id"], value_set=drop)))
        calls = calls.filter(pc.invert(pc.is_in(calls["execution_id"], value_set=drop)))
    return read_executions(ex, calls)


def replayed_records(run: RunDir, part: str) -> list:
    """A part of the replayed run (`run.replay`), as this run's records (same executions, this run's id)."""
    records = run_lake(run).read_records(run.cfg.run.replay, part)
    for r in records:
        r.run_id = run.run_id
    return records


# -- the trainer and the tracker ----------------------------------------------------------------------


def training_model(cfg: GyreConfig, path):
    """(model, tokenizer) from a policy directory as the trainer holds it: in `trainer.dtype`."""
    import torch

    from ..model import load_policy

    return load_policy(str(path), dtype=getattr(torch, cfg.trainer.dtype), device=cfg.model.device)


def trainer_at(run: RunDir, version: int):
    """The RL trainer holding policy `version`, resumed from its checkpoint when not in memory."""
    from ..trainer.trainer import Trainer

    held = run.cached("trainer", lambda: None)
    if held is not None and held[1] == version:
        return held[0]
    cfg = run.cfg
    model, tok = training_model(cfg, run.warm)
    trainer = Trainer(model, lr=cfg.rl.lr, zero_stage=cfg.trainer.zero_stage, grad_clip=cfg.rl.grad_clip,
                      optimizer=cfg.rl.optimizer, pad_id=tok.pad_token_id or 0,
                      gradient_checkpointing=cfg.trainer.gradient_checkpointing)
    if version > 0:
        state = trainer.load(str(run.ckpt), ckpt_tag(version))
        restore_rng(state.get("rng"))
    hold_trainer(run, trainer, version)
    return trainer


def hold_trainer(run: RunDir, trainer, version: int) -> None:
    """Keep `trainer` (holding `version`) for the next phase in this process."""
    run.drop_cached("trainer")
    run.cached("trainer", lambda: (trainer, version))


def drop_trainer(run: RunDir) -> None:
    """Forget the held trainer: the next `trainer_at` reloads it from its checkpoint."""
    run.drop_cached("trainer")


def rng_state() -> dict:
    """The host RNG state a checkpoint carries (so a resumed run draws what the uninterrupted one would)."""
    import torch

    return {"python": random.getstate(), "torch": torch.get_rng_state()}


def restore_rng(state: dict | None) -> None:
    import torch

    if state:
        random.setstate(state["python"])
        torch.set_rng_state(state["torch"])


def tracker(run: RunDir):
    """The run's one MLflow run (created on first use, reopened by the id in the run directory), with
    the resolved config as params and the run directory, lake root and preset as tags."""
    from ..tracking import Tracker, flatten

    def make():
        t = Tracker(run.cfg.tracking.uri, run.cfg.tracking.experiment, run.path, run.run_id)
        t.log_params(flatten(run.cfg.model_dump(mode="json")))
        t.set_tags({"gyre.run_id": run.run_id, "gyre.run_dir": str(run.path), "gyre.lake_root": run.cfg.lake.root,
                    "gyre.preset": run.cfg.preset})
        return t

    return run.cached("tracker", make)
