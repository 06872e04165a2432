"""Tokenizer, tiny model, policy save/load.

    .venv/bin/python -m pytest tests/core/test_model.py -q
"""
from __future__ import annotations

import re

import pytest
import torch

from gyre_core.model import (PolicyLoadError, build_tiny_model, load_policy, save_policy, stop_token_ids,
                             train_tokenizer)

CORPUS = [f"pos {i % 7} {(i * 3) % 5} goal red ball at {i % 4} {i % 6} walls {i % 3},{i % 8} last up\nleft"
          for i in range(300)]


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer(CORPUS, vocab_size=300)


@pytest.fixture(scope="module")
def model(tok):
    return build_tiny_model(tok, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, ffn_size=64,
                            max_positions=256, seed=0)


def test_chat_template_renders_qwen_format(tok):
    msgs = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "pos 1 2"},
            {"role": "assistant", "content": "left"}]
    expected = ("<|im_start|>system\nBe brief.<|im_end|>\n"
                "<|im_start|>user\npos 1 2<|im_end|>\n"
                "<|im_start|>assistant\nleft<|im_end|>\n")
    assert tok.apply_chat_template(msgs, tokenize=False) == expected
    assert tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == \
        expected + "<|im_start|>assistant\n"


def test_tokenizer_specials_and_round_trip(tok):
    ids = {t: tok.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")}
    assert len(set(ids.values())) == 3
    assert tok.pad_token_id == ids["<|endoftext|>"] and tok.eos_token_id == ids["<|im_end|>"]
    # Special tokens inside text are single ids; any bytes (even unseen ones) round-trip.
    assert tok.encode("<|im_start|>user\n")[0] == ids["<|im_start|>"]
    text = "pos 3 4 goal ~ünseen 日本\t  x<|im_end|>"
    assert tok.decode(tok.encode(text)) == text
    # BPE learned merges from the corpus: frequent words take fewer tokens than bytes.
    assert len(tok.encode("goal red ball")) < len("goal red ball".encode())


def test_tokenizer_rejects_too_small_vocab():
    with pytest.raises(ValueError, match="vocab_size"):
        train_tokenizer(CORPUS, vocab_size=100)


def test_tiny_model_config(tok, model):
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # tied
    assert model.config.vocab_size == len(tok)
    assert model.generation_config.eos_token_id == im_end
    assert model.generation_config.pad_token_id == tok.pad_token_id
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert stop_token_ids(model, tok) == [im_end]
    again = build_tiny_model(tok, 32, 2, 4, 2, 64, 256, seed=0)
    other = build_tiny_model(tok, 32, 2, 4, 2, 64, 256, seed=1)
    w = model.model.layers[0].self_attn.q_proj.weight
    assert torch.equal(w, again.model.layers[0].self_attn.q_proj.weight)
    assert not torch.equal(w, other.model.layers[0].self_attn.q_proj.weight)


def test_building_does_not_touch_global_rng(tok):
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_tiny_model(tok, 32, 1, 4, 2, 64, 256, seed=7)
    assert torch.equal(torch.rand(3), expected)


def test_stop_token_ids_union(tok, model):
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    m = build_tiny_model(tok, 32, 1, 4, 2, 64, 256, seed=0)
    m.generation_config.eos_token_id = [5, 9]
    assert stop_token_ids(m, tok) == sorted({5, 9, im_end})


def test_save_load_round_trip(tok, model, tmp_path):
    save_policy(model, tok, tmp_path / "v0")
    model2, tok2 = load_policy(tmp_path / "v0")
    text = tok.apply_chat_template([{"role": "user", "content": "pos 1 2 goal red ball"}],
                                   tokenize=False, add_generation_prompt=True)
    ids = tok.encode(text)
    assert tok2.encode(text) == ids
    assert tok2.apply_chat_template([{"role": "user", "content": "pos 1 2 goal red ball"}],
                                    tokenize=False, add_generation_prompt=True) == text
    assert stop_token_ids(model2, tok2) == stop_token_ids(model, tok)
    x = torch.tensor([ids])
    with torch.inference_mode():
        assert torch.equal(model(x).logits, model2(x).logits)


def test_load_missing_dir(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(PolicyLoadError, match=re.escape(str(missing))) as e:
        load_policy(missing)
    assert isinstance(e.value, ValueError) and "\n" not in str(e.value)


def test_load_missing_config(tok, model, tmp_path):
    save_policy(model, tok, tmp_path / "p")
    (tmp_path / "p" / "config.json").unlink()
    with pytest.raises(PolicyLoadError, match="config.json") as e:
        load_policy(tmp_path / "p")
    assert str(tmp_path / "p") in str(e.value)


def test_load_truncated_weights(tok, model, tmp_path):
    save_policy(model, tok, tmp_path / "p")
    weights = tmp_path / "p" / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(PolicyLoadError, match="weights") as e:
        load_policy(tmp_path / "p")
    assert str(tmp_path / "p") in str(e.value) and "\n" not in str(e.value)


def test_load_without_tokenizer_files(tok, model, tmp_path):
    save_policy(model, tok, tmp_path / "p")
    (tmp_path / "p" / "tokenizer.json").unlink()
    with pytest.raises(PolicyLoadError, match="tokenizer"):
        load_policy(tmp_path / "p")


def test_model_device_auto_is_the_gpu_only_when_torch_sees_one(monkeypatch):
    from gyre_core.model import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu") == resolve_device("cpu")
    with pytest.raises(PolicyLoadError, match="model.device=cuda: torch sees no GPU"):
        resolve_device("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device("auto") == torch.device("cuda")
