"""In-process batched decoding over a HF causal LM, with a persistent KV cache per live context.

In an agent loop each turn's prompt is the previous prompt + completion + a short observation, so the
expensive part is re-reading the context. The engine keeps, per `key`, the K/V of every token it has
already processed and prefills only the new tokens: all requests of a call are stacked into one
left-padded cache, their deltas are prefilled in one forward (padding in the middle is masked out
through the 2-D attention mask; explicit position ids count only real tokens), then all sequences decode
together. Afterwards each row's K/V (without pads) is stored back under its key.

    engine = LocalEngine(model, stop_token_ids(model, tok), seed=0)
    [res] = engine.generate([GenRequest("exec-1/ctx-0", prompt_ids, max_new_tokens=4)])
    # next turn: the same key, prompt = prompt + res.completion_ids + observation ids
    engine.release("exec-1/ctx-0")             # when the context is finished

Works for HF decoder-only models whose layers are all full attention (Qwen2/Qwen3, Llama, ...).
"""
from __future__ import annotations

import inspect
import time
from collections import OrderedDict
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, DynamicLayer

from ..records import common_prefix
from .interface import GenRequest, GenResult, mix_seed, validate_requests


@dataclass(slots=True)
class _Context:
    ids: list[int]            # tokens whose K/V are held
    kv: torch.Tensor          # [layers, 2, kv_heads, len(ids), head_dim]


@dataclass(slots=True)
class _Row:
    """One request's place in a batch."""
    req: GenRequest
    reuse: int                # cached tokens reused (the prompt's first `reuse` tokens)
    kv: torch.Tensor | None   # their K/V, [layers, 2, kv_heads, reuse, head_dim]
    delta: list[int]          # prompt tokens to prefill


class LocalEngine:
    """Batched generation with per-key KV reuse. Not thread-safe: one `generate` at a time."""

    def __init__(self, model, stop_ids: list[int], *, version: int = 0, seed: int = 0, max_batch: int = 128,
                 max_batch_tokens: int = 1 << 18, prefill_chunk: int = 512,
                 max_cached_tokens: int | None = None):
        """`max_batch_tokens` bounds rows x padded length of one batch (the K/V buffer is that big);
        `prefill_chunk` bounds the columns of one prefill forward (attention-mask memory for long fresh
        prompts); `max_cached_tokens`, if set, evicts least recently used contexts beyond that many tokens."""
        if not stop_ids:
            raise ValueError("stop_ids is empty: generation could only end on max_new_tokens")
        layer_types = getattr(model.config.get_text_config(decoder=True), "layer_types", None) or ()
        if any(t != "full_attention" for t in layer_types):
            raise NotImplementedError(
                f"LocalEngine needs full-attention layers only, got {sorted(set(layer_types))}")
        self.model = model.eval()
        self.stop_ids = sorted(set(int(i) for i in stop_ids))
        self.version = version
        self.seed = seed
        self.max_batch = max_batch
        self.max_batch_tokens = max_batch_tokens
        self.prefill_chunk = prefill_chunk
        self.max_cached_tokens = max_cached_tokens
        self._contexts: OrderedDict[str, _Context] = OrderedDict()
        self._calls = 0   # sampling stream position: (seed, call, chunk) seeds each batch's generator
        params = inspect.signature(model.forward).parameters
        # transformers 5 renamed past_key_values -> cache (the old name is deprecated until 5.40).
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._has_logits_to_keep = "logits_to_keep" in params
        self._pad_id = int(getattr(model.config, "pad_token_id", None) or 0)
        self.stats = dict(calls=0, batches=0, prompt_tokens_prefilled=0, prompt_tokens_reused=0,
                          generated_tokens=0, seconds=0.0)

    # ---- public API -------------------------------------------------------------------------------
    def generate(self, requests: list[GenRequest]) -> list[GenResult]:
        """Generate for all requests together; results are in request order."""
        if not requests:
            return []
        validate_requests(requests)
        t0 = time.perf_counter()
        call = self._calls
        self._calls += 1
        self.stats["calls"] += 1
        results: list[GenResult | None] = [None] * len(requests)
        with torch.inference_mode():
            for c, idx in enumerate(self._chunks(requests)):
                gen = torch.Generator(device=self._device).manual_seed(mix_seed(self.seed, call, c))
                for i, res in zip(idx, self._generate_batch([requests[i] for i in idx], gen)):
                    results[i] = res
        self._evict()
        self.stats["seconds"] += time.perf_counter() - t0
        return results  # type: ignore[return-value]

    def reseed(self, seed: int) -> None:
        """Restart the sampling stream: the same requests after the same reseed sample the same tokens."""
        self.seed = seed
        self._calls = 0

    def release(self, key: str) -> None:
        """Drop a finished context's cache (unknown keys are ignored)."""
        self._contexts.pop(key, None)

    def set_weights(self, state_dict, version: int) -> None:
        """Load new weights (tied weights may be absent) and clear all caches: old K/V are stale.
        Keys are checked before anything is copied, so a bad state dict leaves the model as it was."""
        expected, given = set(self.model.state_dict()), set(state_dict)
        missing, unexpected = expected - given - _tied_names(self.model), given - expected
        if missing or unexpected:
            raise ValueError(
                f"set_weights: missing {sorted(missing)[:3]}, unexpected {sorted(unexpected)[:3]}")
        self.model.load_state_dict(state_dict, strict=False)
        self._contexts.clear()
        self.version = version

    def load_published(self, uri: str, version: int) -> None:
        """Policy `version` from its published safetensors file (`trainer.publish`)."""
        from ..trainer.publish import load_weights

        self.set_weights(load_weights(uri), version)

    @property
    def cached_tokens(self) -> int:
        return sum(len(c.ids) for c in self._contexts.values())

    # ---- one batch --------------------------------------------------------------------------------
    @property
    def _device(self) -> torch.device:
        return next(self.model.parameters()).device

    def _chunks(self, requests: list[GenRequest]) -> list[list[int]]:
        """Split into batches of at most `max_batch` rows and `max_batch_tokens` padded tokens (rows x
        longest prompt + max_new_tokens); when splitting, similar lengths go together (less padding)."""
        size = [len(r.prompt_ids) + r.max_new_tokens for r in requests]
        if len(requests) <= self.max_batch and len(requests) * max(size) <= self.max_batch_tokens:
            return [list(range(len(requests)))]
        chunks: list[list[int]] = [[]]
        for i in sorted(range(len(requests)), key=size.__getitem__):
            # Sorted ascending, so the newest row is the chunk's longest.
            if chunks[-1] and (len(chunks[-1]) >= self.max_batch
                               or (len(chunks[-1]) + 1) * size[i] > self.max_batch_tokens):
                chunks.append([])
            chunks[-1].append(i)
        return chunks

    def _plan(self, req: GenRequest) -> _Row:
        """How much of the key's cache is a prefix of the new prompt; the rest is prefilled."""
        # Popped, and stored again by _store: if the batch fails in between, the key simply recomputes.
        ctx = self._contexts.pop(req.key, None)
        reuse = 0
        if ctx is not None:
            # At least the last prompt token is always run: its logits give the first new token.
            reuse = min(common_prefix(ctx.ids, req.prompt_ids), len(req.prompt_ids) - 1)
        kv = ctx.kv[:, :, :, :reuse] if reuse else None
        return _Row(req, reuse, kv, req.prompt_ids[reuse:])

    def _generate_batch(self, requests: list[GenRequest], gen: torch.Generator) -> list[GenResult]:
        rows = [self._plan(r) for r in requests]
        dev = self._device
        B = len(rows)
        Lc = max(r.reuse for r in rows)
        D = max(len(r.delta) for r in rows)
        cache, big = self._build_cache(rows, Lc, Lc + D + max(r.req.max_new_tokens for r in rows) - 1)

        # Layout of row i: [pad | cached_i | pad | delta_i | generated...], every pad masked out.
        mask = torch.zeros(B, Lc + D, dtype=torch.long, device=dev)
        input_ids = torch.full((B, D), self._pad_id, dtype=torch.long, device=dev)
        positions = torch.zeros(B, D, dtype=torch.long, device=dev)
        for i, r in enumerate(rows):
            d = len(r.delta)
            mask[i, Lc - r.reuse:Lc] = 1
            mask[i, Lc + D - d:] = 1
            input_ids[i, D - d:] = torch.tensor(r.delta, dtype=torch.long)
            positions[i, D - d:] = torch.arange(r.reuse, r.reuse + d)
        logits = self._prefill(input_ids, positions, mask, cache, Lc)

        temps = torch.tensor([r.req.temperature for r in rows], dtype=torch.float32, device=dev)
        greedy = temps == 0
        scale = torch.where(greedy, torch.ones_like(temps), temps).unsqueeze(1)
        max_new = torch.tensor([r.req.max_new_tokens for r in rows], device=dev)
        stop = torch.tensor(self.stop_ids, device=dev)
        next_pos = torch.tensor([len(r.req.prompt_ids) for r in rows], device=dev)
        done = torch.zeros(B, dtype=torch.bool, device=dev)
        n_gen = torch.zeros(B, dtype=torch.long, device=dev)
        finish = torch.zeros(B, dtype=torch.bool, device=dev)  # stopped on a stop token
        toks, lps = [], []
        first_entropy = None
        for step in range(int(max_new.max())):
            logp = torch.log_softmax(logits.float() / scale, dim=-1)
            if first_entropy is None:
                first_entropy = torch.special.entr(logp.exp()).sum(-1).tolist()   # 0·log 0 = 0
            sampled = torch.multinomial(logp.exp(), 1, generator=gen).squeeze(1)
            tok = torch.where(greedy, logits.argmax(-1), sampled)
            toks.append(tok)
            lps.append(logp.gather(1, tok[:, None]).squeeze(1))
            live = ~done
            n_gen += live.long()
            hit_stop = live & torch.isin(tok, stop)
            finish |= hit_stop
            done |= hit_stop | (n_gen >= max_new)
            if bool(done.all()):
                break
            mask = torch.cat([mask, torch.ones(B, 1, dtype=mask.dtype, device=dev)], dim=1)
            logits = self._forward(tok[:, None], (next_pos + step)[:, None], mask, cache)

        tok_m = torch.stack(toks, 1).tolist()
        lp_m = torch.stack(lps, 1).tolist()
        n_list, fin_list = n_gen.tolist(), finish.tolist()
        results = [GenResult(tok_m[i][:n], lp_m[i][:n], "stop" if f else "length", first_entropy[i])
                   for i, (n, f) in enumerate(zip(n_list, fin_list))]
        self._store(rows, results, big, Lc, D)
        self.stats["batches"] += 1
        self.stats["prompt_tokens_prefilled"] += sum(len(r.delta) for r in rows)
        self.stats["prompt_tokens_reused"] += sum(r.reuse for r in rows)
        self.stats["generated_tokens"] += sum(n_list)
        return results

    def _prefill(self, input_ids, positions, mask, cache, Lc: int) -> torch.Tensor:
        """Prefill the deltas, `prefill_chunk` columns per forward; returns the last column's logits."""
        D = input_ids.shape[1]
        logits = None
        for s in range(0, D, self.prefill_chunk):
            e = min(D, s + self.prefill_chunk)
            logits = self._forward(input_ids[:, s:e], positions[:, s:e], mask[:, :Lc + e], cache)
        return logits

    def _forward(self, input_ids, positions, mask, cache) -> torch.Tensor:
        kwargs = {self._cache_kw: cache}
        if self._has_logits_to_keep:
            kwargs["logits_to_keep"] = 1
        out = self.model(input_ids=input_ids, attention_mask=mask, position_ids=positions, use_cache=True,
                         **kwargs)
        return out.logits[:, -1, :]

    # ---- cache plumbing (the only place that touches transformers' cache classes) -------------------
    def _build_cache(self, rows: list[_Row], Lc: int, capacity: int):
        """One buffer [layers, 2, B, kv_heads, capacity, head_dim] holding every row's cached K/V
        right-aligned at column Lc; the forwards write the delta and decoded tokens after it in place."""
        cfg = self.model.config.get_text_config(decoder=True)
        n_layers = cfg.num_hidden_layers
        heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        p = next(self.model.parameters())
        big = torch.empty(n_layers, 2, len(rows), heads, capacity, head_dim, dtype=p.dtype, device=p.device)
        for i, r in enumerate(rows):
            # Masked columns still get weight exactly 0, and 0 * garbage can be NaN: zero the pads.
            big[:, :, i, :, :Lc - r.reuse] = 0
            if r.reuse:
                big[:, :, i, :, Lc - r.reuse:Lc] = r.kv
        layers = [_BufferLayer(big[l, 0], big[l, 1], Lc) for l in range(n_layers)]
        return Cache(layers=layers), big

    def _store(self, rows: list[_Row], results: list[GenResult], big: torch.Tensor, Lc: int, D: int) -> None:
        """Keep each row's K/V of prompt + completion[:-1] (the last token was never fed back)."""
        for i, (r, res) in enumerate(zip(rows, results)):
            d, n = len(r.delta), len(res.completion_ids)
            parts = [big[:, :, i, :, Lc - r.reuse:Lc], big[:, :, i, :, Lc + D - d:Lc + D + n - 1]]
            kv = torch.cat(parts, dim=3)
            self._contexts[r.req.key] = _Context(list(r.req.prompt_ids) + res.completion_ids[:-1], kv)

    def _evict(self) -> None:
        if self.max_cached_tokens is None:
            return
        total = self.cached_tokens
        while total > self.max_cached_tokens and self._contexts:
            _, ctx = self._contexts.popitem(last=False)
            total -= len(ctx.ids)


class _BufferLayer(DynamicLayer):
    """A DynamicLayer over a preallocated [B, heads, capacity, head_dim] buffer: `update` writes in place
    where DynamicLayer concatenates (a full copy of the cache per decode step). Subclassed only because
    transformers' Cache accepts nothing but CacheLayerMixin instances."""

    def __init__(self, k_buf: torch.Tensor, v_buf: torch.Tensor, length: int):
        super().__init__()
        self.k_buf, self.v_buf, self.length = k_buf, v_buf, length
        self.device, self.is_initialized = k_buf.device, True
        self.keys, self.values = k_buf[:, :, :length], v_buf[:, :, :length]

    def update(self, key_states, value_states, *args, **kwargs):
        end = self.length + key_states.shape[-2]
        self.k_buf[:, :, self.length:end] = key_states
        self.v_buf[:, :, self.length:end] = value_states
        self.length = end
        self.keys, self.values = self.k_buf[:, :, :end], self.v_buf[:, :, :end]
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length


def _tied_names(model) -> set[str]:
    tied = getattr(model, "_tied_weights_keys", None) or ()
    names = set(tied.keys()) if isinstance(tied, dict) else set(tied)
    if getattr(model.config, "tie_word_embeddings", False):
        names.add("lm_head.weight")
    return names
