"""Runs inside the vLLM server's worker (vLLM's venv, not Gyre's): loaded with
`--worker-extension-cls gyre_vllm_extension.WeightLoader`, called through the server's `/collective_rpc`.

Imports only what vLLM's venv has (torch, safetensors). Gyre's side is `gyre_core/engine/vllm.py`.
"""
from __future__ import annotations


class WeightLoader:
    """Mixed into vLLM's worker: load a published policy version in place, tied output head included."""

    def gyre_load_weights(self, path: str) -> dict:
        """Reload every weight from the safetensors file `path` (HF names), then re-tie the output head.

        vLLM's in-place reload materialises fresh parameters, so a head tied to the embedding would keep
        pointing at the old tensor (and on CPU at its packed copy): the tie is restored and the head's
        post-load processing rerun."""
        from safetensors.torch import load_file

        state = load_file(path)
        self.reload_weights(weights_iterator=iter(state.items()), is_checkpoint_format=True)
        model = self.model_runner.get_model()
        return {"tensors": len(state), "retied": _retie_head(model)}


def _retie_head(model) -> bool:
    config = getattr(model, "config", None)
    head = getattr(model, "lm_head", None)
    inner = getattr(model, "model", None)
    embed = getattr(inner, "embed_tokens", None)
    if not (config is not None and getattr(config, "tie_word_embeddings", False) and head is not None
            and embed is not None):
        return False
    head.weight = embed.weight
    method = getattr(head, "quant_method", None)
    if method is not None and hasattr(method, "process_weights_after_loading"):
        method.process_weights_after_loading(head)
    return True
