"""How a real cell's decoding slows as its batch fills, and as contexts grow: the simulator's `decode_slowdown`.

    python -m bench.decode_load [MODEL_DIR ...]     # prints JSON (default: a smoke-sized model and SmolLM2)

A batched engine computes one forward per token for all its live calls; a fuller batch makes that forward
slower. For each engine (the cell's in-process engine, and its vLLM server when `.venv-vllm/` is
installed), on one thread, `n` calls decode at once for n in `LOADS`; the time of one decode step is
measured as (wall of T2 tokens − wall of T1 tokens) / (T2 − T1), which cancels the prefill. Figures:
- `step_s[n]` and `ratio[n]` = step_s[n] / step_s[1];
- `beta`: the least-squares slope of ratio − 1 over n − 1 through the origin — the model
  `step(n) = step(1) · (1 + β·(n − 1))` the simulator and the emulated device use (`Workload.decode_slowdown`),
  with `beta_max_rel_err` its worst relative error over the loads measured;
- `context_slowdown_per_1k`: one call's step at a long prompt over a short one, − 1, per 1,000 tokens of
  context (reported; the simulator folds the mean context into `call_s`).
"""
from __future__ import annotations

import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from gyre_core.engine.interface import GenRequest

LOADS = (1, 2, 4, 8, 16)
T1, T2 = 8, 40
SHORT, LONG = 32, 384


def _prompts(vocab: int, n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, vocab - 1) for _ in range(length)] for _ in range(n)]


def _step_s(generate, vocab: int, n: int, length: int, repeats: int = 3) -> float:
    """Seconds of one decode step with `n` calls at once (median over repeats), prefill cancelled."""
    out = []
    for r in range(repeats):
        walls = []
        for tokens in (T1, T2):
            prompts = _prompts(vocab, n, length, seed=1000 * r + tokens + n)
            t0 = time.perf_counter()
            generate([GenRequest(f"r{r}-t{tokens}-n{n}-{i}", p, tokens, 1.0) for i, p in enumerate(prompts)])
            walls.append(time.perf_counter() - t0)
        out.append((walls[1] - walls[0]) / (T2 - T1))
    return statistics.median(out)


def fit(step_s: dict[int, float]) -> dict:
    """β through the origin, and how well 1 + β·(n − 1) fits each measured ratio."""
    base = step_s[1]
    ratio = {n: s / base for n, s in step_s.items()}
    num = sum((ratio[n] - 1) * (n - 1) for n in ratio)
    den = sum((n - 1) ** 2 for n in ratio)
    beta = max(num / den, 0.0) if den else 0.0
    err = max(abs(1 + beta * (n - 1) - ratio[n]) / ratio[n] for n in ratio)
    return {"step_s": {str(n): s for n, s in step_s.items()}, "ratio": {str(n): r for n, r in ratio.items()},
            "beta": beta, "beta_max_rel_err": err}


def measure(generate, vocab: int, loads=LOADS) -> dict:
    generate([GenRequest("warm", _prompts(vocab, 1, 8, 0)[0], 4, 1.0)])
    out = fit({n: _step_s(generate, vocab, n, SHORT) for n in loads})
    long = _step_s(generate, vocab, 1, LONG)
    out["context_slowdown_per_1k"] = (long / out["step_s"]["1"] - 1) / ((LONG - SHORT) / 1000)
    return out


def local_engine(model_dir: str, loads=LOADS) -> dict:
    from gyre_core.engine.local import LocalEngine
    from gyre_core.model import load_policy

    torch.set_num_threads(1)
    model, tok = load_policy(model_dir)
    vocab = model.config.vocab_size
    engine = LocalEngine(model, [vocab + 7], seed=0, max_batch=max(loads))    # a stop id never sampled
    return measure(engine.generate, vocab, loads)


def vllm_engine(model_dir: str, dtype: str = "float32") -> dict | str:
    from gyre_core.engine.vllm import ServerSpec, VLLMEngine, VLLMError, VLLMServer
    from gyre_core.model import load_policy

    _, tok = load_policy(model_dir)
    vocab = len(tok)
    try:
        server = VLLMServer(ServerSpec(model_dir=model_dir, dtype=dtype, max_model_len=1024, threads=1)).start()
    except VLLMError as e:
        return f"skipped: {e}"
    engine = VLLMEngine(server, [0], seed=0, concurrency=max(LOADS), owns_server=True)
    engine.stop_ids, engine.ignore_eos = [], True       # every call runs to its max_new_tokens
    try:
        return measure(engine.generate, vocab)
    finally:
        engine.close()


def smoke_sized(tmp: Path) -> str:
    """A model of the smoke preset's size (what the bench's real cells run), saved as a policy directory."""
    from bench.engine import _corpus
    from gyre_core.model import build_tiny_model, save_policy, train_tokenizer

    tok = train_tokenizer(_corpus(random.Random(0)), 320)
    model = build_tiny_model(tok, hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, ffn_size=128,
                             max_positions=1024, seed=0)
    save_policy(model, tok, tmp / "smoke")
    return str(tmp / "smoke")


def bench_decode_load(model_dirs: list[str] | None = None, vllm: bool = True) -> dict:
    import tempfile

    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        dirs = model_dirs or [smoke_sized(Path(tmp)), "data/models/SmolLM2-135M-Instruct"]
        for d in dirs:
            if not Path(d).is_dir():
                out[Path(d).name] = f"skipped: no {d}"
                continue
            name = Path(d).name
            out[name] = {"local": local_engine(d)}
            if vllm:
                out[name]["vllm"] = vllm_engine(d)
    return out


if __name__ == "__main__":
    print(json.dumps(bench_decode_load(sys.argv[1:] or None), indent=1))
