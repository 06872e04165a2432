"""LocalEngine against independent references: HF `generate` (greedy) and a fresh cache-free forward.

    .venv/bin/python -m pytest tests/core/test_engine.py -q
"""
from __future__ import annotations

import random

import pytest
import torch

from gyre_core.engine import GenRequest, GenResult, LocalEngine
from gyre_core.model import build_tiny_model, stop_token_ids, train_tokenizer

CORPUS = [f"<|im_start|>user\npos {i % 7} {(i * 3) % 5} goal blue key at {i % 4} {i % 6}<|im_end|>\n"
          f"<|im_start|>assistant\n{('up', 'down', 'left', 'right')[i % 4]}<|im_end|>\n" for i in range(300)]


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer(CORPUS, vocab_size=320)


def tiny(tok, seed: int):
    """A tiny model with weights redrawn at unit gain. At HF's init (std 0.02) the next-token distribution
    is nearly uniform and greedy decoding repeats the last token whatever the context, which would make a
    greedy comparison vacuous; here outputs depend on the whole context."""
    model = build_tiny_model(tok, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, ffn_size=128,
                             max_positions=1024, seed=seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                std = 0.25 if "embed" in name else p.shape[1] ** -0.5
                p.copy_(torch.randn(p.shape, generator=g) * std)
    return model


@pytest.fixture(scope="module")
def model(tok):
    return tiny(tok, seed=0)


@pytest.fixture(scope="module")
def stops(model, tok):
    return stop_token_ids(model, tok)


def rand_ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(n)]  # ids 0-2 are the special tokens


def hf_greedy(model, prompt: list[int], n: int, stops: list[int]) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                             eos_token_id=stops, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def full_forward_logprobs(model, prompt: list[int], completion: list[int], temperature: float) -> list[float]:
    """Reference: one cache-free forward over prompt + completion."""
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + completion])).logits[0].float()
    logp = torch.log_softmax(logits / (temperature or 1.0), dim=-1)
    return [logp[len(prompt) - 1 + j, t].item() for j, t in enumerate(completion)]


# One batch; batches of 2 rows with 5-column prefill pieces; batches split by padded tokens.
@pytest.mark.parametrize("max_batch,max_batch_tokens,prefill_chunk",
                         [(128, 1 << 18, 512), (2, 1 << 18, 5), (8, 150, 512)])
def test_greedy_matches_hf_generate_over_turns(model, tok, stops, max_batch, max_batch_tokens, prefill_chunk):
    rng = random.Random(1)
    engine = LocalEngine(model, stops, max_batch=max_batch, max_batch_tokens=max_batch_tokens,
                         prefill_chunk=prefill_chunk)
    prompts = [rand_ids(rng, n, len(tok)) for n in (3, 17, 40, 9, 61)]
    expected_reuse = 0
    for turn in range(3):
        before = dict(engine.stats)
        reqs = [GenRequest(f"k{i}", p, max_new_tokens=3 + i, temperature=0.0) for i, p in enumerate(prompts)]
        results = engine.generate(reqs)
        for p, req, res in zip(prompts, reqs, results):
            assert res.completion_ids == hf_greedy(model, p, req.max_new_tokens, stops)
            assert res.finish_reason == ("stop" if res.completion_ids[-1] in stops else "length")
        # Every token processed last turn (prompt + completion minus its last token) was reused.
        assert engine.stats["prompt_tokens_reused"] - before["prompt_tokens_reused"] == expected_reuse
        assert engine.stats["prompt_tokens_prefilled"] - before["prompt_tokens_prefilled"] == \
            sum(map(len, prompts)) - expected_reuse
        expected_reuse = sum(len(p) + len(r.completion_ids) - 1 for p, r in zip(prompts, results))
        prompts = [p + r.completion_ids + rand_ids(rng, rng.randrange(1, 30), len(tok))
                   for p, r in zip(prompts, results)]
    assert engine.stats["calls"] == 3
    assert (engine.stats["batches"] > 3) == (max_batch_tokens < 1 << 18 or max_batch < 5)
    assert engine.stats["generated_tokens"] == sum(3 + i for i in range(5)) * 3


@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
def test_logprobs_match_fresh_forward(model, tok, stops, temperature):
    rng = random.Random(2)
    engine = LocalEngine(model, stops, seed=3)
    prompts = [rand_ids(rng, n, len(tok)) for n in (5, 33, 12)]
    for _ in range(2):  # the second turn goes through the reused cache
        results = engine.generate([GenRequest(f"k{i}", p, 6, temperature) for i, p in enumerate(prompts)])
        for p, r in zip(prompts, results):
            assert len(r.logprobs) == len(r.completion_ids)
            ref = full_forward_logprobs(model, p, r.completion_ids, temperature)
            assert r.logprobs == pytest.approx(ref, abs=1e-4)
        prompts = [p + r.completion_ids + rand_ids(rng, 7, len(tok)) for p, r in zip(prompts, results)]


def test_prompt_that_does_not_extend_the_cache_is_recomputed(model, tok, stops):
    rng = random.Random(4)
    engine = LocalEngine(model, stops)
    base = rand_ids(rng, 30, len(tok))
    first = engine.generate([GenRequest("a", base, 4, 0.0), GenRequest("b", base, 4, 0.0),
                             GenRequest("c", base, 4, 0.0)])[0]
    cached = base + first.completion_ids[:-1]
    edited = list(cached) + rand_ids(rng, 5, len(tok))
    edited[10] = 3 if edited[10] != 3 else 4             # diverges at position 10
    shorter = base[:20]                                   # a strict prefix of what is cached
    unrelated = rand_ids(rng, 25, len(tok))
    unrelated[0] = 3 if base[0] != 3 else 4               # nothing in common
    before = engine.stats["prompt_tokens_reused"]
    res = engine.generate([GenRequest("a", edited, 5, 0.0), GenRequest("b", shorter, 5, 0.0),
                           GenRequest("c", unrelated, 5, 0.0)])
    for p, r in zip((edited, shorter, unrelated), res):
        assert r.completion_ids == hf_greedy(model, p, 5, stops)
    # Only the common prefix is reused (at most len(prompt) - 1: the last prompt token always runs).
    assert engine.stats["prompt_tokens_reused"] - before == 10 + 19 + 0


def test_sampling_is_reproducible_per_seed(model, tok, stops):
    rng = random.Random(5)
    prompts = [rand_ids(rng, n, len(tok)) for n in (8, 20, 3, 14)]

    def run(seed: int) -> list[list[GenResult]]:
        engine = LocalEngine(model, stops, seed=seed)
        out, ps = [], list(prompts)
        for _ in range(2):
            res = engine.generate([GenRequest(f"k{i}", p, 8, 1.0) for i, p in enumerate(ps)])
            out.append(res)
            ps = [p + r.completion_ids + [7, 8] for p, r in zip(ps, res)]
        return out

    a, b, c = run(0), run(0), run(1)
    assert a == b
    tokens = lambda runs: [r.completion_ids for res in runs for r in res]  # noqa: E731
    assert tokens(a) != tokens(c)
    assert tokens(a)[:4] != tokens(a)[4:]  # the call counter feeds the generator seed


def test_stop_token_ends_and_is_included(model, tok, stops):
    # Sample (same seed, same single-row call => same random stream) and make the first token of the
    # free run that did not occur before it the stop token.
    rng = random.Random(6)
    prompt = rand_ids(rng, 12, len(tok))
    free = LocalEngine(model, stops, seed=11).generate([GenRequest("x", prompt, 8, 1.0)])[0].completion_ids
    k = next(j for j in range(1, len(free)) if free[j] not in free[:j])
    engine = LocalEngine(model, [free[k]], seed=11)
    stopped = engine.generate([GenRequest("s", prompt, 8, 1.0)])[0]
    assert stopped.completion_ids == free[:k + 1] and stopped.finish_reason == "stop"
    capped = LocalEngine(model, stops, seed=11).generate([GenRequest("l", prompt, k, 1.0)])[0]
    assert capped.completion_ids == free[:k] and capped.finish_reason == "length"
    # The next turn after a stop reuses prompt + completion[:-1] and still matches HF.
    nxt = prompt + stopped.completion_ids + rand_ids(rng, 4, len(tok))
    again = engine.generate([GenRequest("s", nxt, 3, 0.0)])[0]
    assert again.completion_ids == hf_greedy(model, nxt, 3, [free[k]])
    assert engine.stats["prompt_tokens_reused"] == len(prompt) + k


def test_set_weights_and_release(model, tok, stops):
    rng = random.Random(7)
    prompt = rand_ids(rng, 15, len(tok))
    other, local = tiny(tok, seed=9), tiny(tok, seed=0)
    engine = LocalEngine(local, stops, version=1)
    engine.generate([GenRequest("k", prompt, 3, 0.0)])
    assert engine.cached_tokens == len(prompt) + 2
    weights = {k: v for k, v in other.state_dict().items() if k != "lm_head.weight"}  # tied, as on disk
    engine.set_weights(weights, version=2)
    assert engine.version == 2 and engine.cached_tokens == 0
    res = engine.generate([GenRequest("k", prompt, 4, 0.0)])[0]
    assert res.completion_ids == hf_greedy(other, prompt, 4, stops)
    assert engine.stats["prompt_tokens_reused"] == 0
    engine.release("k")
    engine.release("never-seen")
    assert engine.cached_tokens == 0
    bad = dict(weights, bogus=torch.zeros(1))
    bad["model.norm.weight"] = torch.zeros_like(bad["model.norm.weight"])
    with pytest.raises(ValueError, match="unexpected.*bogus"):
        engine.set_weights(bad, version=3)
    assert engine.version == 2 and torch.equal(local.model.norm.weight, other.model.norm.weight)


def test_lru_eviction_and_validation(model, tok, stops):
    engine = LocalEngine(model, stops, max_cached_tokens=25)
    engine.generate([GenRequest("a", list(range(3, 23)), 1, 0.0)])
    engine.generate([GenRequest("b", list(range(3, 13)), 1, 0.0)])
    assert engine.cached_tokens == 10  # "a" (20 tokens) was least recently used
    with pytest.raises(ValueError, match="twice"):
        engine.generate([GenRequest("a", [5], 1), GenRequest("a", [6], 1)])
    with pytest.raises(ValueError, match="empty"):
        engine.generate([GenRequest("a", [], 1)])


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_other_architectures_match_hf_generate(arch):
    """The engine only uses the generic HF interfaces: other full-attention causal LMs work too."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    common = dict(vocab_size=200, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, max_position_embeddings=512)
    if arch == "qwen3":  # q/k norms and a head_dim that is not hidden / heads
        cfg, cls = Qwen3Config(num_key_value_heads=2, head_dim=32, **common), Qwen3ForCausalLM
    else:
        cfg, cls = LlamaConfig(num_key_value_heads=1, **common), LlamaForCausalLM
    torch.manual_seed(0)
    model = cls(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, p.shape[1] ** -0.5)
    rng = random.Random(8)
    engine = LocalEngine(model, [1])
    prompts = [rand_ids(rng, n, 200) for n in (4, 25)]
    for _ in range(2):
        results = engine.generate([GenRequest(f"k{i}", p, 4, 0.0) for i, p in enumerate(prompts)])
        for p, r in zip(prompts, results):
            assert r.completion_ids == hf_greedy(model, p, 4, [1])
        prompts = [p + r.completion_ids + rand_ids(rng, 6, 200) for p, r in zip(prompts, results)]
    assert engine.stats["prompt_tokens_reused"] > 0


def test_first_token_entropy_is_that_of_the_sampling_distribution():
    """The engine's entropy equals −Σ p log p of softmax(logits/T) from a fresh full forward."""
    import torch

    from gyre_core.engine import GenRequest, LocalEngine
    from gyre_core.model import build_tiny_model, train_tokenizer

    tok = train_tokenizer(["left right forward pickup the red ball"] * 10, vocab_size=280)
    model = build_tiny_model(tok, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, ffn_size=64,
                             max_positions=64, seed=3)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(20)   # a peaked, context-dependent distribution
    eng = LocalEngine(model, [tok.eos_token_id or 0], seed=1)
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12]]
    outs = eng.generate([GenRequest(f"k{i}", p, 2, temperature=0.7) for i, p in enumerate(prompts)])
    for p, o in zip(prompts, outs):
        with torch.no_grad():
            logits = model(torch.tensor([p])).logits[0, -1].float() / 0.7
        logp = torch.log_softmax(logits, -1)
        assert o.entropy == pytest.approx(-(logp.exp() * logp).sum().item(), rel=1e-4, abs=1e-5)
