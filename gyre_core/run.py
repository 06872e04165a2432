"""A run's directory, its completion markers, the names of what it writes, and a per-process cache.

    data/runs/<run_id>/
        config.yaml            resolved config (the run is reopened from it)
        policy0/               the initial HF model dir (tiny model + tokenizer, or a copy of model.path)
        warm/                  HF dir after the warm start
        weights/v<N>.safetensors   published policy versions (or trainer.publish_root)
        ckpt/<tag>/            DeepSpeed checkpoints (weights, optimizer, RNG, data cursor)
        batches/step-<N>.pt    processed training batches
        markers/<name>.json    completion markers: a step is done iff its marker exists

Every step is idempotent: it looks at its marker first and returns what it produced before. Models,
engines and trainers are cached per process so consecutive Prefect tasks do not reload them
(`gyre_core.phases.run_objects`). The names of per-step markers, lake parts and checkpoint tags are made
here (a step's part in `gyre_core.lake.store`, which parses it); a phase done once marks its own name.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import yaml

from .config import ConfigError, GyreConfig
from .lake.store import STEP_PART_PREFIX, step_part  # noqa: F401  (a step's part: the lake parses it)

_CACHE: dict[tuple[str, str], object] = {}

CONTROL_VERSION = -3   # policy_version recorded for the supervised-only control (not on the RL lineage)
BASE_VERSION = -1      # the initial model, before the warm start (what a fresh engine holds)


# -- names: every marker and lake part a run writes ---------------------------------------------------
def step_marker(phase: str, step: int) -> str:
    """`rollout_0003`: the marker of one phase (rollout, score, process, train) of RL step `step`."""
    return f"{phase}_{step:04d}"


def publish_marker(version: int) -> str:
    """`publish_0004`: policy version `version` is published (by RL step `version` − 1)."""
    return f"publish_{version:04d}"


def ckpt_tag(version: int) -> str:
    """The DeepSpeed checkpoint tag (`ckpt/<tag>/`) of policy version `version`."""
    return f"v{version}"


def eval_marker(label: str) -> str:
    return f"eval_{label}"


def score_part(step: int) -> str:
    return f"score={int(step)}"


def process_part(step: int) -> str:
    return f"process={int(step)}"


def eval_part(label: str) -> str:
    """The lake part of a run's own evaluation `label` (before, after, control)."""
    return f"eval-{label}"


def checkpoint_eval_names(label: str) -> tuple[str, str]:
    """(lake run id, part) of a checkpoint's evaluation under `label` (`gyre evaluate --label`)."""
    return f"eval-{label}", f"eval={label}"


DEMOS_PART = "demos"                    # the warm start's demonstrations
CONTROL_DEMOS_PART = "control-demos"    # the control's expert runs of the RL tasks (eval.control_rl_tasks)


class CheckpointError(RuntimeError):
    """A run's checkpoint or published weights cannot be read. The message names the file."""


class RunDir:
    def __init__(self, path: Path | str, cfg: GyreConfig):
        self.path = Path(path)
        self.cfg = cfg

    # -- creation / reopening ---------------------------------------------------------------
    @classmethod
    def create(cls, cfg: GyreConfig) -> "RunDir":
        """Make (or reopen) the run directory for this config. A different config under the same run id is refused."""
        cls.check_reusable(cfg)
        path = cls.path_of(cfg)
        cfg_file = path / "config.yaml"
        new = cfg.model_dump(mode="json")
        path.mkdir(parents=True, exist_ok=True)
        for sub in ("markers", "weights", "ckpt", "batches"):
            (path / sub).mkdir(exist_ok=True)
        _atomic_write(cfg_file, yaml.safe_dump(new, sort_keys=False))
        return cls(path, cfg)

    @staticmethod
    def path_of(cfg: GyreConfig) -> Path:
        """Where the run of `cfg` lives: `run.out_root/<run id>`."""
        return Path(cfg.run.out_root) / cfg.run_id()

    @classmethod
    def check_reusable(cls, cfg: GyreConfig) -> None:
        """A run id names one config: refuse `cfg` when its run directory holds another (only the number of
        RL steps may change, to continue a run)."""
        path = cls.path_of(cfg)
        cfg_file = path / "config.yaml"
        if cfg_file.exists():
            old = yaml.safe_load(cfg_file.read_text())
            if _without_steps(old) != _without_steps(cfg.model_dump(mode="json")):
                raise ConfigError(f"run.name: run '{cfg.run_id()}' exists with a different config; choose "
                                  f"another name (--set run.name=NAME) or delete {path}")

    @classmethod
    def open(cls, path: Path | str) -> "RunDir":
        path = Path(path)
        cfg = GyreConfig.model_validate(yaml.safe_load((path / "config.yaml").read_text()))
        return cls(path, cfg)

    @property
    def run_id(self) -> str:
        return self.cfg.run_id()

    # -- markers ------------------------------------------------------------------------------
    def marker(self, name: str) -> Path:
        return self.path / "markers" / f"{name}.json"

    def done(self, name: str) -> dict | None:
        m = self.marker(name)
        return json.loads(m.read_text()) if m.exists() else None

    def mark(self, name: str, payload: dict) -> dict:
        payload = {**payload, "marked_at": time.time()}
        _atomic_write(self.marker(name), json.dumps(payload, indent=1, default=float))
        return payload

    def latest_version(self) -> int:
        """Newest published policy version: 0 is the warm start, v is the result of RL step v−1."""
        v = 0
        while self.done(publish_marker(v + 1)) is not None:
            v += 1
        return v

    # -- paths ----------------------------------------------------------------------------------
    @property
    def policy0(self) -> Path:
        return self.path / "policy0"

    @property
    def warm(self) -> Path:
        return self.path / "warm"

    @property
    def control(self) -> Path:
        return self.path / "control"

    @property
    def ckpt(self) -> Path:
        return self.path / "ckpt"

    @property
    def weights_root(self) -> str:
        """Where published versions go: `trainer.publish_root`, else the run's `weights/`."""
        return self.cfg.trainer.publish_root or str(self.path / "weights")

    def weights_uri(self, version: int | str) -> str:
        """Published weights of RL policy `version` (an int), or of a named side policy ("control")."""
        from .trainer.publish import version_uri    # (torch: not on the import path of the CLI's start)

        return version_uri(self.weights_root, version)

    def vocab_size(self) -> int | None:
        """Rows of the policy's embedding (its config.json): every token id a record holds must be below it.
        None before `prepare` saved the policy."""
        path = self.policy0 / "config.json"
        return int(json.loads(path.read_text())["vocab_size"]) if path.exists() else None

    def batch_path(self, step: int) -> Path:
        return self.path / "batches" / f"step-{step:04d}.pt"

    # -- per-process cache -------------------------------------------------------------------
    def cached(self, key: str, make):
        k = (str(self.path.resolve()), key)
        if k not in _CACHE:
            _CACHE[k] = make()
        return _CACHE[k]

    def peek_cached(self, key: str):
        """What `cached(key, ...)` holds in this process, or None (nothing is made)."""
        return _CACHE.get((str(self.path.resolve()), key))

    def drop_cached(self, key: str) -> None:
        _CACHE.pop((str(self.path.resolve()), key), None)


def _without_steps(cfg: dict) -> dict:
    """Config fields that may change on resume (the number of RL steps) are not compared; data paths are
    compared resolved (a run made when they were stored relative reads as the same run)."""
    from .config import DATA_PATHS, resolve_path

    c = json.loads(json.dumps(cfg))
    c.get("rl", {}).pop("steps", None)
    c.pop("preset", None)
    for section, key in DATA_PATHS:
        if isinstance(c.get(section, {}).get(key), str):
            c[section][key] = resolve_path(c[section][key])
    return c


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + f".tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)
