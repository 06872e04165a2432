"""What every rollout engine offers the harness, the router and evaluation (`local` and `vllm` alike).

    engine.generate([GenRequest(key, prompt_ids, max_new_tokens, temperature)]) -> [GenResult]
    engine.release(key)                       # a context is finished (cache hint; may do nothing)
    engine.reseed(seed)                       # restart the sampling stream
    engine.load_published(uri, version)       # policy `version` from its published safetensors file
    engine.version, engine.stop_ids, engine.stats

Token ids in, token ids and per-token behaviour log-probs out: an engine never re-tokenises text.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(slots=True)
class GenRequest:
    key: str                  # one live context; the same key on the next turn may reuse its cache
    prompt_ids: list[int]     # the FULL prompt (usually previous prompt + completion + a few new tokens)
    max_new_tokens: int
    temperature: float = 1.0  # 0 = greedy


@dataclass(slots=True)
class GenResult:
    completion_ids: list[int]  # includes the stop token when it stopped on one
    logprobs: list[float]      # behaviour log-prob of each token under softmax(logits / T) (T=1 for greedy)
    finish_reason: str         # "stop" | "length"
    entropy: float = 0.0       # entropy (nats) of the first token's distribution (0 when the engine cannot say)


class Engine(Protocol):
    version: int
    stop_ids: list[int]
    stats: dict

    def generate(self, requests: list[GenRequest]) -> list[GenResult]: ...
    def release(self, key: str) -> None: ...
    def reseed(self, seed: int) -> None: ...
    def load_published(self, uri: str, version: int) -> None: ...


def validate_requests(requests: list[GenRequest]) -> None:
    keys = [r.key for r in requests]
    if len(set(keys)) != len(keys):
        raise ValueError("generate: the same key appears twice in one call")
    for r in requests:
        if not r.prompt_ids:
            raise ValueError(f"generate: empty prompt for key {r.key!r}")
        if r.max_new_tokens < 1:
            raise ValueError(f"generate: max_new_tokens must be >= 1 (key {r.key!r})")
        if r.temperature < 0:
            raise ValueError(f"generate: negative temperature (key {r.key!r})")


def mix_seed(seed: int, call: int, index: int) -> int:
    """A 63-bit seed from (seed, call counter, index): reproducible across runs."""
    x = (seed * 0x9E3779B97F4A7C15 + call * 0xBF58476D1CE4E5B9 + index * 0x94D049BB133111EB) % (1 << 64)
    x ^= x >> 31
    return x % (1 << 63)


def probe_ids(vocab_size: int, n: int = 48, seed: int = 0) -> list[int]:
    """A fixed token sequence whose log-probs the trainer and an engine must agree on after a reload."""
    import random

    rng = random.Random(seed)
    return [rng.randrange(vocab_size) for _ in range(n)]


def check_served(engine, reference, ids: list[int], tol: float) -> dict:
    """An engine's log-probs of `ids` (its `probe_logprobs`, which an engine serving elsewhere offers) against a reference model's (`model_logprobs`): {"max": max |Δ|,
    "mean": mean |Δ|, "ok": mean ≤ tol}. The mean is what is judged: in half precision the max over a
    random probe is dominated by one unlikely token."""
    got, want = engine.probe_logprobs(ids), model_logprobs(reference, ids)
    diffs = [abs(a - b) for a, b in zip(got, want)]
    mean = sum(diffs) / max(len(diffs), 1)
    return {"max": max(diffs, default=0.0), "mean": mean, "ok": mean <= tol}


def model_logprobs(model, ids: list[int]) -> list[float]:
    """log π(ids[i] | ids[:i]) for i = 1..n−1 under an HF causal LM, one plain forward (fp32 softmax)."""
    import torch

    dev = next(model.parameters()).device
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids], device=dev)).logits[0, :-1].float()
        lp = torch.log_softmax(logits, dim=-1)
        return lp.gather(1, torch.tensor(ids[1:], device=dev)[:, None]).squeeze(1).tolist()
