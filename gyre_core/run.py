"""A run's directory, its completion markers, and the objects its steps share within one process.

    data/runs/<run_id>/
        config.yaml            resolved config (the run is reopened from it)
        policy0/               the initial HF model dir (tiny model + tokenizer, or a copy of model.path)
        warm/                  HF dir after the warm start
        weights/v<N>.safetensors   published policy versions (or trainer.publish_root)
        ckpt/<tag>/            DeepSpeed checkpoints (weights, optimizer, RNG, data cursor)
        batches/step-<N>.pt    processed training batches
        markers/<name>.json    completion markers: a step is done iff its marker exists

Every step is idempotent: it looks at its marker first and returns what it produced before. Models,
engines and trainers are cached per process so consecutive Prefect tasks do not reload them.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import yaml

from .config import ConfigError, GyreConfig

_CACHE: dict[tuple[str, str], object] = {}


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
        path = Path(cfg.run.out_root) / cfg.run_id()
        cfg_file = path / "config.yaml"
        new = cfg.model_dump(mode="json")
        if cfg_file.exists():
            old = yaml.safe_load(cfg_file.read_text())
            if _without_steps(old) != _without_steps(new):
                raise ConfigError(f"run.name: run '{cfg.run_id()}' exists with a different config; "
                                  f"choose another run.name or delete {path}")
        path.mkdir(parents=True, exist_ok=True)
        for sub in ("markers", "weights", "ckpt", "batches"):
            (path / sub).mkdir(exist_ok=True)
        _atomic_write(cfg_file, yaml.safe_dump(new, sort_keys=False))
        return cls(path, cfg)

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

    def weights_uri(self, version: int | str) -> str:
        """Published weights of RL policy `version` (an int), or of a named side policy ("control")."""
        root = self.cfg.trainer.publish_root or str(self.path / "weights")
        name = f"v{version}" if isinstance(version, int) else version
        return f"{root.rstrip('/')}/{name}.safetensors"

    def batch_path(self, step: int) -> Path:
        return self.path / "batches" / f"step-{step:04d}.pt"

    # -- per-process cache -------------------------------------------------------------------
    def cached(self, key: str, make):
        k = (str(self.path.resolve()), key)
        if k not in _CACHE:
            _CACHE[k] = make()
        return _CACHE[k]

    def drop_cached(self, key: str) -> None:
        _CACHE.pop((str(self.path.resolve()), key), None)


def _without_steps(cfg: dict) -> dict:
    """Config fields that may change on resume (the number of RL steps) are not compared."""
    c = json.loads(json.dumps(cfg))
    c.get("rl", {}).pop("steps", None)
    c.pop("preset", None)
    return c


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + f".tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)
