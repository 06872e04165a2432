"""Tree attention for packed sequences, plugged into any HF causal LM through transformers' public hooks.

    from gyre_core.trainer.tree_attention import TreeMask, enable_tree_attention
    enable_tree_attention(model)                  # "gyre_tree": FlexAttention on CUDA, span-sparse on CPU
    model(input_ids=ids, attention_mask=torch.ones_like(ids), position_ids=depth[None],
          gyre_tree=TreeMask(parent, subtree_end))

A packed tree is one row in DFS pre-order; token q may attend to kv iff `kv <= q < subtree_end[kv]`.
Restarting position ids alone would be read by transformers as separate packed sequences (cutting
siblings off their shared ancestors), so the structure travels as the `gyre_tree` keyword, which HF
models forward untouched to the attention function. The registered implementations:

- `gyre_tree_sparse` (CPU): the row is cut into blocks of consecutive tokens (chains, or a few short
  spans merged); a block [a, b) needs only the keys anc(a) + [a, b), because any ancestor of a later
  token that precedes a is an ancestor of a. Each block gathers those keys and runs sdpa, so the work is
  about sum_i (depth_i + 1) key pairs, not N^2; plain torch ops, so gradients flow.
- `gyre_tree_dense`: an explicit N x N boolean mask from the interval rule through transformers' own
  sdpa -- the independent reference in tests and the "wasteful" comparison in the bench.
- `gyre_tree_flex` (GPU): compiled FlexAttention with a block mask built from the same rule, the row
  padded to one of a few lengths (`flex_length`) so that each length compiles once.
- `gyre_tree`: flex when the tensors are on CUDA (and heads have ≥ 16 dimensions), sparse otherwise.

Without a `gyre_tree` keyword every one of them is exactly transformers' sdpa (same mask function), so
a model switched to them still runs plain padded batches and generation unchanged.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

NAMES = {"auto": "gyre_tree", "sparse": "gyre_tree_sparse", "dense": "gyre_tree_dense", "flex": "gyre_tree_flex"}
MIN_BLOCK = 32      # short spans are merged into blocks of at least this many queries (fewer kernel calls)
MAX_BLOCK = 512     # long chains are cut so a block's mask and scores stay small


@dataclass(eq=False)
class TreeMask:
    """The tree structure of one packed row; plans derived from it are cached across layers."""

    parent: torch.Tensor        # [N] long, -1 at a root
    subtree_end: torch.Tensor   # [N] long, exclusive
    depth: torch.Tensor | None = None   # [N] (the position ids); only for key_pairs()
    _blocks: list | None = field(default=None, repr=False)
    _cache: dict = field(default_factory=dict, repr=False)

    @property
    def n(self) -> int:
        return int(self.parent.numel())

    def dense(self, device) -> torch.Tensor:
        """[N, N] bool: q attends kv iff kv <= q < subtree_end[kv]."""
        key = ("dense", str(device))
        if key not in self._cache:
            idx = torch.arange(self.n, device=device)
            se = self.subtree_end.to(device)
            self._cache[key] = (idx[None, :] <= idx[:, None]) & (idx[:, None] < se[None, :])
        return self._cache[key]

    def blocks(self, device) -> list[tuple[int, int, torch.Tensor | None, torch.Tensor | None]]:
        """(a, b, key indices or None for the block itself, mask or None for plain causal) per query block."""
        key = ("blocks", str(device))
        if key not in self._cache:
            self._cache[key] = [(a, b, None if k is None else k.to(device), None if m is None else m.to(device))
                                for a, b, k, m in _plan_blocks(self.parent.numpy(), self.subtree_end.numpy())]
        return self._cache[key]

    def key_pairs(self) -> tuple[int, int]:
        """(key pairs the sparse path computes, key pairs the tree needs = sum_i (depth_i + 1))."""
        done = sum((b - a) * (b - a if k is None else int(k.numel())) for a, b, k, _ in self.blocks("cpu"))
        if self.depth is not None:
            return done, int((self.depth + 1).sum())
        par, depth = self.parent.tolist(), [0] * self.n
        for i, p in enumerate(par):             # parents precede children in pre-order
            depth[i] = depth[p] + 1 if p >= 0 else 0
        return done, sum(depth) + self.n

    def block_mask(self, device, length: int | None = None):
        """Flex's block mask over `length` (≥ n, default n) positions: padding positions (query or key)
        attend nothing and are attended by nothing."""
        length = length or self.n
        key = ("flex", str(device), length)
        if key not in self._cache:
            from torch.nn.attention.flex_attention import create_block_mask

            # padded with 0 to whole blocks of `length`: a padded kv has se = 0, so no q attends it; a padded
            # q is ≥ n ≥ every real se, so it attends nothing
            se = F.pad(self.subtree_end.to(device), (0, length - self.n + (-length % 128)))

            def tree_mod(b, h, q, kv):
                return (kv <= q) & (q < se[kv])

            self._cache[key] = create_block_mask(tree_mod, None, None, length, length, device=device,
                                                 _compile=torch.device(device).type == "cuda")
        return self._cache[key]


def _plan_blocks(parent: np.ndarray, subtree_end: np.ndarray):
    N = len(parent)
    brk = parent != np.arange(N) - 1
    brk[:1] = True
    starts = np.flatnonzero(brk).tolist() + [N]                # chain (span) starts
    pieces = []
    for s, e in zip(starts[:-1], starts[1:]):
        pieces.extend((p, min(p + MAX_BLOCK, e)) for p in range(s, e, MAX_BLOCK))
    blocks, cur = [], None
    for s, e in pieces:
        if cur is not None and s - cur[0] < MIN_BLOCK and e - cur[0] <= MAX_BLOCK:
            cur = (cur[0], e)
        else:
            if cur is not None:
                blocks.append(cur)
            cur = (s, e)
    if cur is not None:
        blocks.append(cur)
    out = []
    for a, b in blocks:
        anc = np.flatnonzero(subtree_end[:a] > a)
        own = np.arange(a, b)
        chain = bool(np.all(parent[a + 1:b] == own[:-1]))
        if chain and (anc.size == 0 and (a == 0 or parent[a] == -1)):
            out.append((a, b, None, None))           # a whole tree's first chain: plain causal
            continue
        keys = np.concatenate([anc, own])
        if chain:
            r, c = np.arange(b - a)[:, None], np.arange(len(keys))[None, :]
            mask = c - anc.size <= r           # all ancestors, causal within the chain
        else:
            mask = (keys[None, :] <= own[:, None]) & (own[:, None] < subtree_end[keys][None, :])
        out.append((a, b, torch.from_numpy(keys), torch.from_numpy(mask)))
    return out


def _sparse(query, key, value, tree: TreeMask, scaling, dropout):
    gqa = query.shape[1] != key.shape[1]
    outs = []
    for a, b, keys, mask in tree.blocks(query.device):
        q = query[:, :, a:b]
        if keys is None:
            k, v = key[:, :, a:b], value[:, :, a:b]
        else:
            k, v = key.index_select(2, keys), value.index_select(2, keys)
        outs.append(F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout,
                                                   is_causal=mask is None, scale=scaling, enable_gqa=gqa))
    return torch.cat(outs, dim=2)


FLEX_MIN_HEAD_DIM = 16          # flex's GPU kernel refuses smaller heads
_COMPILED_FLEX: dict[tuple[int, str], object] = {}   # (length, device): one compiled kernel each, no recompiles


def flex_length(n: int) -> int:
    """The length a packed row is padded to for the compiled flex kernel: 128-token blocks, a power of two
    of them. The kernel is compiled for static shapes, once per length (on torch 2.11 inductor's flex
    template finds no kernel for dynamic, unequal query/key lengths), so a run compiles a handful of
    kernels; the padded blocks are empty in the block mask, which flex skips."""
    blocks = max(1, -(-n // 128))
    return 128 * (1 << (blocks - 1).bit_length())


def _flex(query, key, value, tree: TreeMask, scaling):
    from torch.nn.attention.flex_attention import flex_attention

    if query.shape[-1] < FLEX_MIN_HEAD_DIM:
        raise NotImplementedError(f"flex tree attention needs a head dimension of at least {FLEX_MIN_HEAD_DIM}, "
                                  f"got {query.shape[-1]}; use tree attention 'sparse' (what 'auto' picks)")
    n = query.shape[2]
    length = flex_length(n)
    fn = flex_attention
    if query.device.type == "cuda":             # uncompiled flex materialises scores; it is a test path only
        key = (length, str(query.device))
        if key not in _COMPILED_FLEX:
            _COMPILED_FLEX[key] = torch.compile(flex_attention, dynamic=False)
        fn = _COMPILED_FLEX[key]
    pad = (0, 0, 0, length - n)
    out = fn(F.pad(query, pad), F.pad(key, pad), F.pad(value, pad), block_mask=tree.block_mask(query.device, length),
             scale=scaling, enable_gqa=query.shape[1] != key.shape[1])
    return out[:, :, :n]


def _make(kind: str):
    def tree_attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0,
                               scaling: float | None = None, gyre_tree: TreeMask | None = None, **kwargs):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        if gyre_tree is None:                   # a plain batch: exactly transformers' sdpa
            return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                          scaling=scaling, **kwargs)
        if query.shape[0] != 1 or query.shape[2] != gyre_tree.n:
            raise ValueError(f"a packed tree is one row of {gyre_tree.n} tokens, got query {tuple(query.shape)}")
        if kwargs.get("sliding_window") is not None or kwargs.get("softcap") is not None:
            raise NotImplementedError("tree attention supports neither sliding windows nor logit soft-capping")
        if kind == "auto":
            how = "flex" if query.device.type == "cuda" and query.shape[-1] >= FLEX_MIN_HEAD_DIM else "sparse"
        else:
            how = kind
        if how == "dense":
            mask = gyre_tree.dense(query.device)[None, None]
            return sdpa_attention_forward(module, query, key, value, mask, dropout=dropout, scaling=scaling,
                                          is_causal=False)
        if how == "flex":
            if dropout:
                raise NotImplementedError("flex tree attention does not apply attention dropout")
            out = _flex(query, key, value, gyre_tree, scaling)
        else:
            out = _sparse(query, key, value, gyre_tree, scaling, dropout)
        return out.transpose(1, 2).contiguous(), None

    tree_attention_forward.__name__ = f"{NAMES[kind]}_forward"
    return tree_attention_forward


def register() -> None:
    """Register the four implementations with transformers (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    for kind, name in NAMES.items():
        if name not in AttentionInterface._global_mapping:
            AttentionInterface.register(name, _make(kind))
            AttentionMaskInterface.register(name, sdpa_mask)


def enable_tree_attention(model, kind: str = "auto") -> str:
    """Switch `model` to a tree implementation; returns the one it had. Plain batches behave as sdpa."""
    register()
    before = model.config._attn_implementation
    if before != NAMES[kind]:
        model.set_attn_implementation(NAMES[kind])
    return before


register()
