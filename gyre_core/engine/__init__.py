"""Rollout engines. `local`: in-process batched decoding with a per-context KV cache (CPU default)."""
from gyre_core.engine.local import GenRequest, GenResult, LocalEngine

__all__ = ["GenRequest", "GenResult", "LocalEngine"]
