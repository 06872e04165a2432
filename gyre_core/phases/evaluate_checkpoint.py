"""A checkpoint on the preset's held-out seeds: what the `evaluate` flow and `gyre evaluate` run.

    cfg = load_config("quick")
    result = evaluate_checkpoint(cfg, "data/runs/quick-s0", label="quick")     # or an HF dir, or
    result = evaluate_checkpoint(cfg, "runs:/<mlflow run id>/policy", label="quick")

A checkpoint is one of
  * a Gyre run directory (`data/runs/<run_id>`, or just the run id under `run.out_root`): its newest
    published policy version (the weights of `weights/v<N>.safetensors` on the run's initial model), or
    the version N it names as `<run dir>@v<N>` (`data/runs/default@v20`: the policy after 20 RL steps;
    `@v0` is the warm start) — a run's learning curve on the held-out seeds, version by version;
  * an HF model directory, as `gyre_core.model.save_policy` writes it;
  * an MLflow artifact URI, `runs:/<mlflow run id>/<path>` or `models:/<name>/<version>`, downloaded from
    `tracking.uri` to a temporary directory that holds (or has one folder that holds) such an HF directory.
Anything else stops with a `CheckpointError` naming it, before any episode runs.

The evaluation is `phases.held_out.held_out`, a run's own loop, so its figures compare with a run's
before/after ones: the config's held-out seeds (`env.eval_seed_start` + i for i < `eval.episodes`), the
same sampling stream, the sampled policy at `rollout.temperature` and the greedy one on the first
`eval.greedy_episodes` seeds. The preset decides the environment, harness and seeds, whatever the
checkpoint was trained with. Its executions go to the lake as run `eval-<label>`, part `eval=<label>` (a second evaluation under the same label replaces
them), and the result to a new MLflow run in `tracking.experiment` tagged `gyre.kind=evaluate`.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from ..config import ConfigError, GyreConfig, apply_threads
from ..run import CheckpointError, RunDir, checkpoint_eval_names

MLFLOW_SCHEMES = ("runs:/", "models:/", "mlflow-artifacts:/")
EXTERNAL_VERSION = -1      # policy_version of a checkpoint that is not a version of a run in this lake
_LABEL = re.compile(r"^[A-Za-z0-9_.+-]+$")
_AT_VERSION = re.compile(r"^(.+)@v(\d+)$")       # <run dir>@v<N>: one published version of a run


@dataclass(slots=True)
class Checkpoint:
    source: str             # what the caller gave
    kind: str               # "run", "hf" or "mlflow"
    path: Path              # the run directory, or the HF model directory
    version: int            # the run's newest published version; EXTERNAL_VERSION for an HF directory


def check_label(label: str) -> str:
    if not isinstance(label, str) or not _LABEL.match(label):
        raise ConfigError(f"label: {label!r} must be letters, digits and . _ + - (it names the lake run eval-<label>)")
    return label


def is_mlflow_uri(checkpoint: str) -> bool:
    return checkpoint.startswith(MLFLOW_SCHEMES)


def resolve_local(checkpoint: str, cfg: GyreConfig) -> Checkpoint:
    """A run directory (or run id under `run.out_root`) or an HF model directory, by what it holds."""
    name, version = checkpoint, None
    if (m := _AT_VERSION.match(checkpoint)) and not Path(checkpoint).expanduser().exists():
        name, version = m.group(1), int(m.group(2))
    path = Path(name).expanduser()
    if not path.exists() and not any(c in name for c in "/\\") and (Path(cfg.run.out_root) / name).is_dir():
        path = Path(cfg.run.out_root) / name                # a bare run id
    if not path.exists():
        raise CheckpointError(f"checkpoint {checkpoint!r}: no such file or directory (give a run directory, "
                              f"an HF model directory, or an MLflow URI such as runs:/<id>/policy)")
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {checkpoint!r}: not a directory")
    if (path / "config.yaml").is_file() and (path / "markers").is_dir():
        return _run_checkpoint(checkpoint, path, version)
    if version is not None:
        raise CheckpointError(f"checkpoint {checkpoint!r}: @v{version} names a version of a Gyre run directory, "
                              f"and {name!r} is not one")
    if (path / "config.json").is_file():
        return Checkpoint(checkpoint, "hf", path, EXTERNAL_VERSION)
    raise CheckpointError(f"checkpoint {checkpoint!r}: neither a Gyre run directory (config.yaml, markers/) "
                          f"nor an HF model directory (config.json)")


def _run_checkpoint(checkpoint: str, path: Path, version: int | None = None) -> Checkpoint:
    """The run at `path`: its newest published version, or `version` (which must be published)."""
    try:
        run = RunDir.open(path)
    except Exception as exc:  # noqa: BLE001 - a config.yaml this Gyre cannot read
        raise CheckpointError(f"checkpoint {checkpoint!r}: unreadable run config "
                              f"({type(exc).__name__}: {exc})") from None
    if run.done("warm_start") is None:
        raise CheckpointError(f"checkpoint {checkpoint!r}: run '{run.run_id}' has no published policy yet "
                              f"(its warm start has not finished)")
    newest = run.latest_version()
    if version is not None and version > newest:
        raise CheckpointError(f"checkpoint {checkpoint!r}: run '{run.run_id}' has published versions 0 – {newest}, "
                              f"not {version}")
    return Checkpoint(checkpoint, "run", path, newest if version is None else version)


def download(checkpoint: str, cfg: GyreConfig, into: str) -> Checkpoint:
    """Download an MLflow artifact URI into `into`; the HF model directory found there."""
    uri = cfg.tracking.uri
    if uri.startswith("sqlite:///") and not Path(uri[len("sqlite:///"):]).is_file():
        raise CheckpointError(f"checkpoint {checkpoint!r}: no MLflow store at {uri} (set tracking.uri)")
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    import mlflow.artifacts

    try:
        local = mlflow.artifacts.download_artifacts(artifact_uri=checkpoint, dst_path=into, tracking_uri=uri,
                                                    registry_uri=uri)
    except Exception as exc:  # noqa: BLE001 - MLflow's errors: no such run, model or artifact path
        msg = " ".join(str(exc).split())[:300]
        raise CheckpointError(f"checkpoint {checkpoint!r}: cannot download it from {uri} "
                              f"({type(exc).__name__}: {msg})") from None
    found = _hf_dir_in(Path(local))
    if found is None:
        raise CheckpointError(f"checkpoint {checkpoint!r}: the download holds no HF model directory (config.json "
                              f"with weights and a tokenizer)")
    return Checkpoint(checkpoint, "mlflow", found, EXTERNAL_VERSION)


def _hf_dir_in(path: Path) -> Path | None:
    """`path` itself, or the one directory up to two levels below it with a config.json (a flavour's `model/`)."""
    if (path / "config.json").is_file():
        return path
    found = sorted({p.parent for pattern in ("*/config.json", "*/*/config.json") for p in path.glob(pattern)})
    return found[0] if len(found) == 1 else None


def _load(ck: Checkpoint, device: str = "cpu"):
    """(model, tokenizer, weights): a run's initial model and its newest published weights, or the HF dir
    and None."""
    from ..model import PolicyLoadError, load_policy
    from ..trainer.publish import load_weights

    run = RunDir.open(ck.path) if ck.kind == "run" else None
    try:
        model, tok = load_policy(str(run.policy0 if run else ck.path), device=device)
    except PolicyLoadError as exc:
        raise CheckpointError(f"checkpoint {ck.source!r}: {exc}") from None
    if run is None:
        return model, tok, None
    uri = run.weights_uri(ck.version)
    try:
        return model, tok, load_weights(uri)
    except Exception as exc:  # noqa: BLE001
        raise CheckpointError(f"checkpoint {ck.source!r}: published weights {uri} are unreadable "
                              f"({type(exc).__name__}: {exc})") from None


def _seeds_hash(seeds: list[int]) -> str:
    return hashlib.sha256(",".join(map(str, seeds)).encode()).hexdigest()[:16]


def evaluate_checkpoint(cfg: GyreConfig, checkpoint: str, label: str = "checkpoint") -> dict:
    """Resolve, load and evaluate `checkpoint` on the held-out seeds; write the lake part and the MLflow run."""
    from ..envs import configured_env
    from ..lake import Lake

    check_label(label)
    apply_threads(cfg)
    configured_env(cfg.env)
    Lake.from_config(cfg.lake).check_writable()
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="gyre-checkpoint-") as tmp:
        ck = download(checkpoint, cfg, tmp) if is_mlflow_uri(checkpoint) else resolve_local(checkpoint, cfg)
        # with vLLM decoding, the model loaded here only checks the server's weights: on the CPU
        model, tok, weights = _load(ck, "cpu" if cfg.engine.kind == "vllm" else cfg.model.device)
        result = _evaluate(cfg, ck, model, tok, weights, label)
    result["warnings"] = _mismatch(cfg, ck)
    result["wall_s"] = time.time() - t0
    result["mlflow_run_id"] = log_evaluation(cfg, result)
    return result


def _mismatch(cfg: GyreConfig, ck: Checkpoint) -> list[str]:
    """A run trained on another environment or harness than the preset evaluates it on: say so. Where the
    run drew its training tasks (`env.train_seed_start`) is not the environment and is not compared."""
    if ck.kind != "run":
        return []
    trained = RunDir.open(ck.path).cfg

    def setting(c: GyreConfig, name: str) -> dict:
        return getattr(c, name).model_dump(mode="json", exclude={"train_seed_start"} if name == "env" else None)

    return [f"run '{trained.run_id()}' was trained with {name} {setting(trained, name)}; evaluated with "
            f"{setting(cfg, name)}" for name in ("env", "harness") if setting(trained, name) != setting(cfg, name)]


def _evaluate(cfg: GyreConfig, ck: Checkpoint, model, tok, weights, label: str) -> dict:
    from ..evaluation import success_interval
    from ..lake import Lake, calls_table, executions_table
    from .held_out import eval_modes, held_out
    from .run_objects import PolicyBundle, run_specs

    model_dir = str(RunDir.open(ck.path).policy0 if ck.kind == "run" else ck.path)
    bundle = PolicyBundle.of(model, tok, cfg.run.seed, version=EXTERNAL_VERSION, engine_cfg=cfg.engine,
                             model_dir=model_dir)
    engine = bundle.engine
    try:
        if weights is not None:      # a run: its initial model with the version's weights, as engine_at does
            if cfg.engine.kind == "vllm":    # loaded from the published file, checked as a run checks reloads
                from ..engine.vllm import VLLMError

                model.load_state_dict(weights, strict=False)
                try:
                    engine.load_checked(RunDir.open(ck.path).weights_uri(ck.version), ck.version, model, len(tok),
                                        cfg.engine.reload_check_tol)
                except VLLMError as exc:
                    raise CheckpointError(f"checkpoint {ck.source!r}: {exc}") from None
            else:
                engine.set_weights(weights, ck.version)
        run_id, part = checkpoint_eval_names(label)
        records, summaries = held_out(cfg, label, eval_modes(cfg), run_id, ck.version, f"{run_id}/",
                                      lambda specs, policy, on_finish: run_specs(cfg, bundle, specs, policy, on_finish),
                                      engine=engine)
    finally:
        if hasattr(engine, "close"):         # a vLLM server started for this evaluation
            engine.close()
    out: dict = {"label": label, "checkpoint": ck.source, "kind": ck.kind, "resolved": str(ck.path),
                 "policy_version": ck.version, "preset": cfg.preset, **summaries}
    tables = {"executions": executions_table(records), "calls": calls_table(records)}
    Lake.from_config(cfg.lake).write_part(run_id, part, tables)
    s = out["sampled"]
    ci = success_interval(sum(s["successes"]), s["episodes"])
    out.update(episodes=s["episodes"], success=ci.rate, ci95_low=ci.ci95_low, ci95_high=ci.ci95_high,
               partial=s["partial"], mean_turns=s["mean_turns"], seeds_hash=_seeds_hash(s["seeds"]),
               lake={"root": cfg.lake.root, "run_id": run_id, "part": part})
    return out


def log_evaluation(cfg: GyreConfig, result: dict) -> str:
    """A new MLflow run in the config's experiment: the figures as metrics, the config as params, the
    checkpoint and seeds as tags, the whole result as `evaluation.json`. Returns its id."""
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    from mlflow.entities import Metric, Param
    from mlflow.tracking import MlflowClient

    from ..tracking import flatten

    uri = cfg.tracking.uri
    if uri.startswith("sqlite:///"):
        Path(uri[len("sqlite:///"):]).parent.mkdir(parents=True, exist_ok=True)
    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name(cfg.tracking.experiment)
    if exp is None:           # made where a training run would make it
        artifacts = (Path(cfg.run.out_root).parent / "mlflow" / "artifacts").resolve().as_uri()
        exp_id = client.create_experiment(cfg.tracking.experiment, artifact_location=artifacts)
    else:
        exp_id = exp.experiment_id
    tags = {"gyre.kind": "evaluate", "gyre.checkpoint": result["checkpoint"], "gyre.checkpoint_kind": result["kind"],
            "gyre.eval_label": result["label"], "gyre.seeds_hash": result["seeds_hash"], "gyre.preset": cfg.preset,
            "gyre.lake_root": cfg.lake.root, "gyre.lake_run_id": result["lake"]["run_id"]}
    if result["policy_version"] != EXTERNAL_VERSION:
        tags["gyre.policy_version"] = str(result["policy_version"])
    run_id = client.create_run(exp_id, run_name=f"eval-{result['label']}", tags=tags).info.run_id
    now = int(time.time() * 1000)
    figures = {"eval/success": result["success"], "eval/success_ci95_low": result["ci95_low"],
               "eval/success_ci95_high": result["ci95_high"], "eval/partial": result["partial"],
               "eval/mean_turns": result["mean_turns"], "eval/episodes": result["episodes"],
               "eval/wall_s": result["wall_s"]}
    if "greedy" in result:
        figures.update({"eval/greedy_success": result["greedy"]["success"],
                        "eval/greedy_partial": result["greedy"]["partial"]})
    params = [Param(k, str(v)[:6000]) for k, v in flatten(cfg.model_dump(mode="json")).items()]
    client.log_batch(run_id, metrics=[Metric(k, float(v), now, 0) for k, v in figures.items()])
    for i in range(0, len(params), 100):
        client.log_batch(run_id, params=params[i:i + 100])
    with tempfile.TemporaryDirectory(prefix="gyre-eval-") as d:
        (Path(d) / "evaluation.json").write_text(json.dumps(result, indent=1))
        client.log_artifact(run_id, str(Path(d) / "evaluation.json"))
    client.set_terminated(run_id)
    return run_id


def format_result(result: dict) -> str:
    """A few lines for the terminal."""
    version = f", policy v{result['policy_version']}" if result["policy_version"] != EXTERNAL_VERSION else ""
    lines = [f"{result['checkpoint']} ({result['kind']}{version})",
             f"  sampled  success {result['success']:.3f}  95% CI [{result['ci95_low']:.3f}, {result['ci95_high']:.3f}]"
             f"  partial {result['partial']:.3f}  over {result['episodes']} held-out episodes"
             f" (seeds {result['seeds_hash']})"]
    if "greedy" in result:
        g = result["greedy"]
        lines.append(f"  greedy   success {g['success']:.3f}  partial {g['partial']:.3f}"
                     f"  over {g['episodes']} episodes")
    lines.append(f"  lake: run {result['lake']['run_id']}, part {result['lake']['part']}   "
                 f"MLflow run {result.get('mlflow_run_id')}")
    lines += [f"  warning: {w}" for w in result.get("warnings", [])]
    return "\n".join(lines)
