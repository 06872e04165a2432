"""The policy model: a locally trained byte-level BPE tokenizer, a tiny Qwen2 model, and HF-dir save/load.

The tiny model and a real Qwen checkpoint go through the same code path: both are HF causal LMs with a
Qwen-style chat template (`<|im_start|>{role}\\n{content}<|im_end|>\\n`) and stop on `<|im_end|>`.

    tok = train_tokenizer(texts, vocab_size=384)
    model = build_tiny_model(tok, hidden_size=128, num_layers=3, num_heads=4, num_kv_heads=2,
                             ffn_size=384, max_positions=4096, seed=0)
    save_policy(model, tok, "runs/x/policy/v0")
    model, tok = load_policy("runs/x/policy/v0")     # any HF causal-LM directory
"""
from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path

import torch

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (PAD_TOKEN, IM_START, IM_END)

# Qwen's template without its default system prompt: role header, content, end marker, newline.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

QWEN2_PRETOKENIZE_REGEX = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"""
                           r""" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")

# Attention for the tiny model. Measured with bench/engine.py on CPU (hidden 128, 64 contexts, ~100-400
# tokens): sdpa and eager are within noise of each other (sdpa ~5-10% faster, it skips eager's GQA
# repeat_kv copy), and sdpa is also what `from_pretrained` picks by default, so a saved and reloaded
# policy runs the same kernels.
TINY_ATTN_IMPLEMENTATION = "sdpa"


# Any one of these makes a loadable tokenizer (fast, BPE vocab+merges, sentencepiece).
TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "tokenizer.model")


class PolicyLoadError(ValueError):
    """A policy directory is missing, incomplete or unreadable. The message names the path."""


def train_tokenizer(texts: Iterable[str], vocab_size: int):
    """Train a byte-level BPE tokenizer on `texts`; returns a `transformers.PreTrainedTokenizerFast`.

    The 256 byte symbols and the three special tokens are always in the vocabulary, so any (NFC-normalised)
    text round-trips; `vocab_size` must leave room for them. Same pipeline as Qwen2's tokenizer.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(alphabet) + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size {vocab_size} < {len(alphabet) + len(SPECIAL_TOKENS)} "
                         "(256 byte symbols + 3 special tokens)")
    # Exactly the pipeline transformers' Qwen2Tokenizer builds, so that AutoTokenizer (which forces that
    # class for model_type "qwen2") and a plain tokenizer.json reader tokenise identically.
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=alphabet, show_progress=False)
    tok.train_from_iterator(texts, trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD_TOKEN, eos_token=IM_END,
                                 unk_token=PAD_TOKEN,
                                 additional_special_tokens=[IM_START], model_max_length=1 << 30)
    hf.chat_template = CHAT_TEMPLATE
    return hf


def build_tiny_model(tokenizer, hidden_size: int, num_layers: int, num_heads: int, num_kv_heads: int,
                     ffn_size: int, max_positions: int, seed: int,
                     attn_implementation: str = TINY_ATTN_IMPLEMENTATION):
    """A randomly initialised float32 Qwen2ForCausalLM with tied embeddings, sized for `tokenizer`."""
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    eos_id = tokenizer.convert_tokens_to_ids(IM_END)
    pad_id = tokenizer.pad_token_id
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=ffn_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_positions, tie_word_embeddings=True,
        bos_token_id=None, eos_token_id=eos_id, pad_token_id=pad_id,
    )
    config._attn_implementation = attn_implementation
    # Seed a private RNG stream so building a model never disturbs the caller's global RNG.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config).to(torch.float32)
    model.generation_config = GenerationConfig(eos_token_id=eos_id, pad_token_id=pad_id, bos_token_id=None)
    model.eval()
    return model


def save_policy(model, tokenizer, path: str | os.PathLike) -> None:
    """Write an ordinary HF model directory (config, generation config, safetensors, tokenizer)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)


def _check_policy_dir(path: Path) -> None:
    if not path.exists():
        raise PolicyLoadError(f"policy {path}: no such directory")
    if not path.is_dir():
        raise PolicyLoadError(f"policy {path}: not a directory")
    config = path / "config.json"
    if not config.is_file():
        raise PolicyLoadError(f"policy {path}: missing config.json")
    try:
        json.loads(config.read_text())
    except (OSError, ValueError) as e:
        raise PolicyLoadError(f"policy {path}: unreadable config.json ({e})") from None
    if not any((path / f).is_file() for f in TOKENIZER_FILES):
        raise PolicyLoadError(f"policy {path}: no tokenizer files ({', '.join(TOKENIZER_FILES)})")
    weights = list(path.glob("*.safetensors")) + list(path.glob("*.bin"))
    if not weights:
        raise PolicyLoadError(f"policy {path}: no weights (*.safetensors or *.bin)")
    for f in path.glob("*.safetensors"):
        try:  # Open every tensor: a truncated file can still have a readable header.
            from safetensors import safe_open
            with safe_open(str(f), framework="pt") as st:
                for name in st.keys():
                    st.get_slice(name)
        except Exception as e:  # noqa: BLE001 - any failure here means the weights are unusable
            raise PolicyLoadError(f"policy {path}: unreadable weights {f.name} ({_one_line(e)})") from None


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:300]


def resolve_device(name: str = "auto") -> torch.device:
    """`model.device`: "auto" is the first visible GPU when torch sees one, else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise PolicyLoadError(f"model.device={name}: torch sees no GPU here (torch {torch.__version__}, "
                              f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); "
                              "use model.device=auto or cpu")
    return torch.device(name)


def load_policy(path: str | os.PathLike, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    """Load (model, tokenizer) from any HF causal-LM directory onto `device` (see `resolve_device`);
    raises PolicyLoadError if it is unusable."""
    from transformers import AutoModelForCausalLM

    path = Path(path)
    _check_policy_dir(path)
    try:
        model, info = AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, local_files_only=True, output_loading_info=True)
    except Exception as e:  # noqa: BLE001
        raise PolicyLoadError(f"policy {path}: cannot load model ({_one_line(e)})") from None
    missing = set(info.get("missing_keys", ())) - _tied_keys(model)
    if missing:
        raise PolicyLoadError(
            f"policy {path}: weights missing {len(missing)} tensors, e.g. {sorted(missing)[0]}")
    try:
        tokenizer = _load_tokenizer(path)
    except Exception as e:  # noqa: BLE001
        raise PolicyLoadError(f"policy {path}: cannot load tokenizer ({_one_line(e)})") from None
    rows = model.get_input_embeddings().weight.shape[0]
    if len(tokenizer) > rows:
        raise PolicyLoadError(
            f"policy {path}: tokenizer has {len(tokenizer)} tokens, the model embeds {rows}")
    model.eval()
    return model.to(resolve_device(device)), tokenizer


def _load_tokenizer(path: Path):
    """AutoTokenizer, except that a directory declaring a generic tokenizer.json backend gets exactly that.

    transformers 5 maps model_type "qwen2" to Qwen2Tokenizer, which rebuilds the pre-tokenizer in code;
    a tokenizer that says it is a plain `TokenizersBackend` is loaded from its tokenizer.json as written.
    """
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    declared = None
    cfg = path / "tokenizer_config.json"
    if cfg.is_file():
        declared = json.loads(cfg.read_text()).get("tokenizer_class")
    if declared in ("TokenizersBackend", "PreTrainedTokenizerFast") and (path / "tokenizer.json").is_file():
        return PreTrainedTokenizerFast.from_pretrained(path, local_files_only=True)
    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def _tied_keys(model) -> set[str]:
    """Parameter names that are tied to another parameter (absent from a checkpoint by design)."""
    tied = getattr(model, "_tied_weights_keys", None) or ()
    keys = set(tied.keys()) if isinstance(tied, dict) else set(tied)
    if getattr(model.config, "tie_word_embeddings", False):
        keys.add("lm_head.weight")
    return keys


def stop_token_ids(model, tokenizer) -> list[int]:
    """Stop ids: generation-config eos ∪ tokenizer.eos_token_id ∪ `<|im_end|>` if in the vocabulary."""
    ids: set[int] = set()
    gen = getattr(model, "generation_config", None)
    eos = getattr(gen, "eos_token_id", None) if gen is not None else None
    if isinstance(eos, int):
        ids.add(eos)
    elif eos is not None:
        ids.update(int(i) for i in eos)
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    im_end = tokenizer.convert_tokens_to_ids(IM_END)
    if isinstance(im_end, int) and im_end != tokenizer.unk_token_id and im_end is not None:
        ids.add(im_end)
    return sorted(ids)
