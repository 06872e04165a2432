"""Exact tree packing: selected branches -> packed sequences in which every needed token is computed once.

    trees = pack_branches(branches, max_tokens=8192)     # branches: list[TrainSequence], root-to-leaf paths
    for k, t in enumerate(trees):
        trainer.micro_step([t], normaliser, objective="ppo", last=k == len(trees) - 1)
    packing_stats(branches, trees)   # tokens_flat, tokens_unique, tokens_computed, ...

Branches are merged into a radix trie on exact token ids (one node per shared span, not per token). Only
U is kept: the tokens that carry loss in some branch plus their ancestors, so a branch's tail after its
last weighted token is dropped. The trie is laid out in DFS pre-order: position id = depth, `parent[i]`
is i's parent (-1 at a root) and `subtree_end[i]` ends i's subtree, so token q may attend to kv iff
`kv <= q < subtree_end[kv]` (its ancestors and itself).

Every (token, branch) pair with a non-zero weight becomes one scored entry, scored from the logits at
`parent[i]` -- not at i-1: after a fork the previous packed token is a sibling's last token. Entries are
kept per branch (duplicates of a token are fine) because PPO-clip is not linear in the advantage, so the
packed loss is exactly the per-branch loss with the same per-(token, branch) weights.

A forest larger than `max_tokens` is cut in pre-order into pieces; a piece starting at token t also
recomputes t's ancestors (the only ones any later token of the piece can need: an ancestor of x >= t
that precedes t contains t in its subtree). `n_owned` counts a piece's own tokens, the rest is
recomputation, reported as tokens_computed - tokens_unique.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(slots=True)
class PackedTree:
    """One packed sequence: a forest in DFS pre-order, plus the scored entries of every branch through it."""

    input_ids: torch.Tensor      # [N] long
    position_ids: torch.Tensor   # [N] depth of each token in its tree
    parent: torch.Tensor         # [N] packed index of the parent, -1 at a root
    subtree_end: torch.Tensor    # [N] exclusive end of each token's subtree
    src: torch.Tensor            # [M] position whose logits score the entry (= parent of `token`)
    token: torch.Tensor          # [M] packed index of the scored token
    tgt: torch.Tensor            # [M] its token id
    old_logprobs: torch.Tensor   # [M] float64, the branch's behaviour log-prob
    advantages: torch.Tensor     # [M] float64
    weights: torch.Tensor        # [M] float64
    branch: torch.Tensor         # [M] index of the branch in pack_branches' input
    n_owned: int                 # tokens first computed here; the other N - n_owned are recomputed ancestors

    @property
    def n_tokens(self) -> int:
        return int(self.input_ids.numel())


class _Trie:
    """Radix trie over spans of the branches' own token arrays (no copy of the tokens)."""

    def __init__(self, arrays: list[np.ndarray]):
        self.arrays = arrays
        self.src = [-1]        # node -> branch whose array holds its tokens
        self.start = [0]       # node -> offset of its first token in that array
        self.length = [0]      # node 0 is the virtual root (no tokens)
        self.depth = [0]       # node -> depth of its first token
        self.children: list[dict[int, int]] = [{}]

    def _new(self, b: int, start: int, length: int, depth: int) -> int:
        self.src.append(b); self.start.append(start); self.length.append(length); self.depth.append(depth)
        self.children.append({})
        return len(self.src) - 1

    def tokens(self, n: int) -> np.ndarray:
        s = self.start[n]
        return self.arrays[self.src[n]][s:s + self.length[n]]

    def insert(self, b: int) -> None:
        a = self.arrays[b]
        node, pos, L = 0, 0, len(a)
        while pos < L:
            child = self.children[node].get(int(a[pos]))
            if child is None:
                self.children[node][int(a[pos])] = self._new(b, pos, L - pos, pos)
                return
            n = min(self.length[child], L - pos)
            diff = np.flatnonzero(a[pos:pos + n] != self.tokens(child)[:n])
            m = int(diff[0]) if diff.size else n
            if m == self.length[child]:
                node, pos = child, pos + m
                continue
            if pos + m == L:            # the branch ends inside this node
                return
            # split child at m: `mid` takes its first m tokens, child keeps the rest below it
            mid = self._new(self.src[child], self.start[child], m, self.depth[child])
            self.children[node][int(a[pos])] = mid
            self.start[child] += m; self.length[child] -= m; self.depth[child] += m
            self.children[mid][int(self.tokens(child)[0])] = child
            self.children[mid][int(a[pos + m])] = self._new(b, pos + m, L - pos - m, pos + m)
            return

    def layout(self):
        """DFS pre-order offsets of every node and the per-token arrays of the whole forest."""
        n_nodes = len(self.src)
        offset = np.zeros(n_nodes, dtype=np.int64)
        end = np.zeros(n_nodes, dtype=np.int64)      # subtree end of each node
        order: list[int] = []
        cursor = 0
        stack = [(0, False)]
        while stack:
            node, done = stack.pop()
            if done:
                end[node] = cursor
                continue
            offset[node] = cursor
            cursor += self.length[node]
            order.append(node)
            stack.append((node, True))
            stack.extend((c, False) for c in reversed(list(self.children[node].values())))
        parent_node = np.full(n_nodes, -1, dtype=np.int64)
        for node in range(n_nodes):
            for c in self.children[node].values():
                parent_node[c] = node
        order = [n for n in order if self.length[n] > 0]
        lengths = np.array([self.length[n] for n in order], dtype=np.int64)
        ids = np.concatenate([self.tokens(n) for n in order]) if order else np.zeros(0, dtype=np.int64)
        first = offset[order]
        within = np.arange(len(ids)) - np.repeat(first, lengths)
        depth = np.repeat(np.array([self.depth[n] for n in order], dtype=np.int64), lengths) + within
        parent = np.arange(len(ids), dtype=np.int64) - 1
        pn = parent_node[order]
        first_parent = np.where(pn > 0, offset[np.maximum(pn, 0)] + np.array(
            [self.length[p] for p in pn.clip(min=0)], dtype=np.int64) - 1, -1)
        parent[first] = first_parent
        subtree_end = np.repeat(end[order], lengths)
        return offset, ids, depth, parent, subtree_end

    def path_indices(self, b: int, offset: np.ndarray) -> np.ndarray:
        """Packed index of each token of branch b (its kept prefix)."""
        a = self.arrays[b]
        node, pos, L = 0, 0, len(a)
        parts = []
        while pos < L:
            child = self.children[node][int(a[pos])]
            take = min(self.length[child], L - pos)
            parts.append(np.arange(offset[child], offset[child] + take, dtype=np.int64))
            node, pos = child, pos + take
        return np.concatenate(parts)


def _scored(seq, b: int) -> np.ndarray:
    """Indices j of branch b that carry loss; a branch must be a plain root-to-leaf path."""
    w = np.asarray(seq.weights, dtype=np.float64)
    sf = np.asarray(seq.score_from, dtype=np.int64)
    if not (len(seq.input_ids) == len(w) == len(sf) == len(seq.old_logprobs) == len(seq.advantages)):
        raise ValueError(f"branch {b}: per-token lists differ in length from input_ids")
    js = np.flatnonzero((w != 0.0) & (sf >= 0))
    if js.size and not np.array_equal(sf[js], js - 1):
        raise ValueError(f"branch {b}: pack_branches expects root-to-leaf paths (score_from[j] == j - 1)")
    return js


def pack_branches(branches, max_tokens: int | None = None) -> list[PackedTree]:
    """Merge branches (TrainSequence root-to-leaf paths) into packed DFS pre-order sequences.

    Each returned PackedTree has at most `max_tokens` tokens (None: one sequence for everything).
    Raises ValueError when a single root-to-token path needs more than `max_tokens` tokens.
    """
    scored = [_scored(s, b) for b, s in enumerate(branches)]
    keep = [b for b, js in enumerate(scored) if js.size]
    arrays = [np.zeros(0, dtype=np.int64)] * len(branches)
    for b in keep:
        arrays[b] = np.asarray(branches[b].input_ids[:int(scored[b][-1]) + 1], dtype=np.int64)
    if not keep:
        return []
    trie = _Trie(arrays)
    for b in keep:
        trie.insert(b)
    offset, ids, depth, parent, subtree_end = trie.layout()

    # scored entries, in branch order
    e_src, e_tok, e_tgt, e_old, e_adv, e_w, e_b = [], [], [], [], [], [], []
    for b in keep:
        js, s = scored[b], branches[b]
        idx = trie.path_indices(b, offset)
        e_src.append(idx[js - 1]); e_tok.append(idx[js]); e_tgt.append(arrays[b][js])
        e_old.append(np.asarray(s.old_logprobs, dtype=np.float64)[js])
        e_adv.append(np.asarray(s.advantages, dtype=np.float64)[js])
        e_w.append(np.asarray(s.weights, dtype=np.float64)[js])
        e_b.append(np.full(js.size, b, dtype=np.int64))
    entries = [np.concatenate(x) for x in (e_src, e_tok, e_tgt, e_old, e_adv, e_w, e_b)]

    N = len(ids)
    cuts = _cut_points(depth, N, max_tokens)
    out = []
    for a, b in zip(cuts[:-1], cuts[1:]):
        anc = np.flatnonzero(subtree_end[:a] > a)            # ancestors of token a (see module doc)
        sel = np.concatenate([anc, np.arange(a, b, dtype=np.int64)])
        out.append(_piece(sel, b - a, ids, depth, parent, subtree_end, entries, a, b))
    return out


def micro_steps(seqs, max_tokens: int, packed: bool) -> list[list]:
    """The one way a batch is cut into micro-steps, for the RL update, the cells and supervised steps alike:
    `packed`, tree-packed rows (every unique token computed once, a prefix shared across sequences — a
    system prompt, an earlier turn — included); else padded, length-sorted chunks. Each is a list for
    `Trainer.micro_step`, within `max_tokens`."""
    if packed:
        return [[t] for t in pack_branches(seqs, max_tokens=max_tokens)]
    from ..processor.batch import micro_batches

    return micro_batches(seqs, max_tokens)


def _cut_points(depth: np.ndarray, N: int, max_tokens: int | None) -> list[int]:
    """Pre-order cut points: a piece [a, b) costs depth[a] recomputed ancestors + (b - a) own tokens.

    The next cut is the shallowest token in the back half of what still fits (latest on ties), so pieces
    tend to start at a tree's root and recompute little.
    """
    if max_tokens is None or N <= max_tokens:
        return [0, N]
    cuts = [0]
    a = 0
    while a < N:
        room = max_tokens - int(depth[a])
        if room <= 0:
            raise ValueError(f"max_tokens={max_tokens} is smaller than a root-to-token path ({depth[a] + 1} tokens)")
        e = a + room
        if e >= N:
            cuts.append(N)
            break
        lo = a + max(1, room // 2)
        window = depth[lo:e + 1]
        # shallowest candidate, latest among ties; a cut at c must leave room for c's own ancestors
        k = len(window) - 1 - int(np.argmin(window[::-1]))
        a = lo + k
        cuts.append(a)
    return cuts


def _piece(sel, n_owned, ids, depth, parent, subtree_end, entries, a, b) -> PackedTree:
    """Renumber tokens `sel` (sorted: ancestors of a, then a..b-1) into one packed sequence."""
    new = np.full(len(ids), -1, dtype=np.int64)
    new[sel] = np.arange(len(sel), dtype=np.int64)
    par = parent[sel]
    par = np.where(par >= 0, new[np.maximum(par, 0)], -1)
    se = np.searchsorted(sel, subtree_end[sel], side="left")
    src, tok, tgt, old, adv, w, br = entries
    m = (tok >= a) & (tok < b)                                 # entries owned by this piece
    t = torch.from_numpy
    return PackedTree(
        input_ids=t(ids[sel].copy()), position_ids=t(depth[sel].copy()), parent=t(par), subtree_end=t(se),
        src=t(new[src[m]]), token=t(new[tok[m]]), tgt=t(tgt[m].copy()), old_logprobs=t(old[m].copy()),
        advantages=t(adv[m].copy()), weights=t(w[m].copy()), branch=t(br[m].copy()), n_owned=int(n_owned))


def packing_stats(branches, trees: list[PackedTree]) -> dict[str, float]:
    """Token counts of a packing: flat (sum of branch lengths), unique (|U|) and computed (with recomputation)."""
    flat = sum(len(s.input_ids) for s in branches)
    unique = sum(t.n_owned for t in trees)
    computed = sum(t.n_tokens for t in trees)
    return {"tokens_flat": float(flat), "tokens_unique": float(unique), "tokens_computed": float(computed),
            "token_ratio": flat / max(unique, 1), "recompute_ratio": computed / max(unique, 1)}
