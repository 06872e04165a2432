"""Batched KV-reusing engine vs HF `generate` one prompt at a time, on a multi-turn agent workload.

    python -m bench.engine            # prints JSON figures
    gyre bench engine --json          # the same, through the CLI

Workload: `n_prompts` contexts of a tiny Qwen2 model, `n_turns` turns each; a turn generates
`max_new_tokens` greedily and then appends a grid-world observation of ~25 tokens (token ids are
appended, never re-tokenised). Both sides see exactly the same prompts; only generated tokens count
towards tok/s.
"""
from __future__ import annotations

import json
import random
import time

import torch

from gyre_core.engine.local import GenRequest, LocalEngine
from gyre_core.model import build_tiny_model, stop_token_ids, train_tokenizer

MOVES = ("up", "down", "left", "right")
SYSTEM = "You are an agent in a grid world. Reply with one move: up, down, left or right."


COLORS = ("red", "green", "blue", "purple", "yellow", "grey")
OBJECTS = ("key", "ball", "box", "door")


def _observation(rng: random.Random) -> str:
    walls = " ".join(f"{rng.randrange(9)},{rng.randrange(9)}" for _ in range(2))
    return (f"pos {rng.randrange(9)} {rng.randrange(9)} goal {rng.choice(COLORS)} {rng.choice(OBJECTS)} "
            f"at {rng.randrange(9)} {rng.randrange(9)} walls {walls} last {rng.choice(MOVES)}")


def _corpus(rng: random.Random, n: int = 2000) -> list[str]:
    """Chat-framed episodes, so role names and markup get merges of their own."""
    turn = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n{}<|im_end|>\n"
    return [f"<|im_start|>system\n{SYSTEM}<|im_end|>\n" + "".join(
        turn.format(_observation(rng), rng.choice(MOVES)) for _ in range(4)) for _ in range(n // 4)]


def _unit_gain(model, seed: int) -> None:
    """Redraw the weights at unit gain. At HF's init (std 0.02) greedy decoding just repeats the last token
    whatever the context, which would make `greedy_match` vacuous; the work done is the same either way."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                std = 0.25 if "embed" in name else p.shape[1] ** -0.5
                p.copy_(torch.randn(p.shape, generator=g) * std)


def _hf_greedy(model, prompt: list[int], max_new_tokens: int, stops: list[int], pad_id: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                         do_sample=False, eos_token_id=stops, pad_token_id=pad_id)
    return out[0, len(prompt):].tolist()


def bench_engine(n_prompts: int = 64, n_turns: int = 8, max_new_tokens: int = 4, vocab_size: int = 384,
                 attn_implementation: str | None = None, seed: int = 0) -> dict:
    """Time the batched engine and HF generate on the same multi-turn prompts; returns the figures."""
    rng = random.Random(seed)
    tok = train_tokenizer(_corpus(rng), vocab_size)
    kwargs = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
    model = build_tiny_model(tok, hidden_size=128, num_layers=3, num_heads=4, num_kv_heads=2, ffn_size=384,
                             max_positions=4096, seed=seed, **kwargs)
    _unit_gain(model, seed)
    stops = stop_token_ids(model, tok)
    pad_id = tok.pad_token_id
    im_end = tok.convert_tokens_to_ids("<|im_end|>")

    def first_prompt() -> list[int]:
        text = tok.apply_chat_template([{"role": "system", "content": SYSTEM},
                                        {"role": "user", "content": _observation(rng)}],
                                       tokenize=False, add_generation_prompt=True)
        return tok.encode(text)

    def next_turn(completion: list[int]) -> list[int]:
        close = [] if completion and completion[-1] == im_end else [im_end]
        text = f"\n<|im_start|>user\n{_observation(rng)}<|im_end|>\n<|im_start|>assistant\n"
        return close + tok.encode(text)

    with torch.inference_mode():
        # Warm both paths up (first-call allocations, lazy imports) on throwaway state.
        LocalEngine(model, stops).generate([GenRequest("warm", first_prompt(), max_new_tokens, 0.0)])
        _hf_greedy(model, first_prompt(), max_new_tokens, stops, pad_id)

        engine = LocalEngine(model, stops, seed=seed, max_batch=max(n_prompts, 1))
        prompts = [first_prompt() for _ in range(n_prompts)]
        turns: list[tuple[list[list[int]], list[list[int]]]] = []  # (prompts, engine completions) per turn
        t_engine = 0.0
        for _ in range(n_turns):
            reqs = [GenRequest(f"ctx{i}", p, max_new_tokens, 0.0) for i, p in enumerate(prompts)]
            t0 = time.perf_counter()
            results = engine.generate(reqs)
            t_engine += time.perf_counter() - t0
            completions = [r.completion_ids for r in results]
            turns.append((prompts, completions))
            prompts = [p + c + next_turn(c) for p, c in zip(prompts, completions)]

        t_hf, hf_tokens, matches, hf_prompt_tokens = 0.0, 0, 0, 0
        for turn_prompts, completions in turns:
            for p, c in zip(turn_prompts, completions):
                t0 = time.perf_counter()
                h = _hf_greedy(model, p, max_new_tokens, stops, pad_id)
                t_hf += time.perf_counter() - t0
                hf_tokens += len(h)
                hf_prompt_tokens += len(p)
                matches += h == c

    engine_tokens = engine.stats["generated_tokens"]
    n_calls = n_prompts * n_turns
    batched_tok_s = engine_tokens / t_engine
    hf_tok_s = hf_tokens / t_hf
    return {
        "n_prompts": n_prompts, "n_turns": n_turns, "max_new_tokens": max_new_tokens,
        "attn_implementation": model.config._attn_implementation, "torch_threads": torch.get_num_threads(),
        "vocab_size": len(tok),
        "final_context_tokens_mean": round(sum(map(len, turns[-1][0])) / n_prompts, 1),
        "batched_seconds": round(t_engine, 4), "hf_generate_seconds": round(t_hf, 4),
        "batched_tok_s": round(batched_tok_s, 1), "hf_generate_tok_s": round(hf_tok_s, 1),
        "ratio": round(batched_tok_s / hf_tok_s, 2),
        "greedy_match": 1 if matches == n_calls else round(matches / n_calls, 4),
        "prompt_tokens_prefilled": engine.stats["prompt_tokens_prefilled"],
        "prompt_tokens_reused": engine.stats["prompt_tokens_reused"],
        "prompt_tokens_hf": hf_prompt_tokens,
        "generated_tokens": engine_tokens,
    }


def main() -> None:
    print(json.dumps(bench_engine(), indent=2))


if __name__ == "__main__":
    main()
