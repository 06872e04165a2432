"""Token log-probs and the policy losses. Pure torch; no engine, no DeepSpeed.

Every loss is a weighted sum over tokens divided by a normaliser fixed when the step's batch closed,
so splitting a batch into micro-steps (or packing it differently) leaves the gradient unchanged.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from .packing import PackedTree


@dataclass(slots=True)
class Collated:
    input_ids: torch.Tensor      # [B, T]
    attention_mask: torch.Tensor  # [B, T]
    row: torch.Tensor            # [N] scored tokens: batch row
    src: torch.Tensor            # [N] position whose logits score it
    tgt: torch.Tensor            # [N] the token id
    old_logprobs: torch.Tensor   # [N]
    advantages: torch.Tensor     # [N]
    weights: torch.Tensor        # [N]
    position_ids: torch.Tensor | None = None   # [1, T] depth in the tree (packed trees only)
    tree: object | None = None   # tree_attention.TreeMask of the packed row (packed trees only)

    def to(self, device) -> "Collated":
        """The same batch with its tensors on `device` (the model's); the tree's index arrays stay on the
        host: it builds and caches its masks per device itself."""
        device = torch.device(device)
        if self.input_ids.device == device:
            return self
        kw = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return Collated(**{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in kw.items()})

    def model_inputs(self) -> dict:
        """Keyword arguments for the HF model: packed trees add depths and the tree for the attention."""
        kw = {"input_ids": self.input_ids, "attention_mask": self.attention_mask, "use_cache": False}
        if self.tree is not None:
            kw.update(position_ids=self.position_ids, gyre_tree=self.tree)
        return kw


def collate(seqs, pad_id: int) -> Collated:
    """Right-pad sequences and list every token that carries weight with where it is scored from.

    `seqs` may instead be a list of `packing.PackedTree`: they are concatenated into one row (a forest:
    every tree keeps its own roots), scored from each token's parent.
    """
    if seqs and isinstance(seqs[0], PackedTree):
        return collate_packed(seqs)
    T = max(len(s.input_ids) for s in seqs)
    ids = torch.full((len(seqs), T), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), T), dtype=torch.long)
    row, src, tgt, old, adv, w = [], [], [], [], [], []
    for b, s in enumerate(seqs):
        n = len(s.input_ids)
        ids[b, :n] = torch.tensor(s.input_ids)
        mask[b, :n] = 1
        for j in range(n):
            if s.weights[j] != 0.0 and s.score_from[j] >= 0:
                row.append(b); src.append(s.score_from[j]); tgt.append(s.input_ids[j])
                old.append(s.old_logprobs[j]); adv.append(s.advantages[j]); w.append(s.weights[j])
    f64 = torch.float64
    return Collated(ids, mask, torch.tensor(row, dtype=torch.long), torch.tensor(src, dtype=torch.long),
                    torch.tensor(tgt, dtype=torch.long), torch.tensor(old, dtype=f64),
                    torch.tensor(adv, dtype=f64), torch.tensor(w, dtype=f64))


def collate_packed(trees) -> Collated:
    """One row holding the packed trees side by side; indices shift by each tree's offset."""
    from .tree_attention import TreeMask

    offs, off = [], 0
    for t in trees:
        offs.append(off)
        off += t.n_tokens
    cat = torch.cat
    parent = cat([torch.where(t.parent >= 0, t.parent + o, -1) for t, o in zip(trees, offs)])
    subtree_end = cat([t.subtree_end + o for t, o in zip(trees, offs)])
    ids = cat([t.input_ids for t in trees])[None]
    depth = cat([t.position_ids for t in trees])
    src = cat([t.src + o for t, o in zip(trees, offs)])
    # an all-ones 2-D mask: transformers then builds no N x N mask (and does not read the restarting
    # position ids as separate packed sequences); the tree itself goes to the attention function
    return Collated(ids, torch.ones_like(ids), torch.zeros_like(src), src, cat([t.tgt for t in trees]),
                    cat([t.old_logprobs for t in trees]), cat([t.advantages for t in trees]),
                    cat([t.weights for t in trees]), position_ids=depth[None],
                    tree=TreeMask(parent, subtree_end, depth))


def scored_logits(forward, c: Collated) -> torch.Tensor:
    """The logits [N, V] that score each entry of `c`, from one forward of `forward` (a model, or DeepSpeed's
    engine around it) that runs the LM head only at the positions that score something (`logits_to_keep`):
    with a large vocabulary the head over every position costs a fifth of the FLOPs and most of the memory."""
    keep, where = torch.unique(c.src, return_inverse=True)
    out = forward(**c.model_inputs(), logits_to_keep=keep)
    return out.logits[c.row, where]


def token_logprobs(logits: torch.Tensor, c: Collated, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of each scored token under softmax(logits/T) at its scoring position, and the entropy there.
    `logits`: the model's [B, T, V], or [N, V] already at the scoring positions (`scored_logits`)."""
    picked = logits[c.row, c.src] if logits.dim() == 3 else logits   # [N, V]
    if picked.dtype != torch.float64:    # half/bf16 logits are upcast; a float64 model stays exact
        picked = picked.float()
    picked = picked / temperature
    logp_all = torch.log_softmax(picked, dim=-1)
    logp = logp_all.gather(-1, c.tgt[:, None]).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


def ppo_clip_loss(logp: torch.Tensor, c: Collated, clip_low: float, clip_high: float, normaliser: float,
                  negative_scale: float = 1.0):
    """−Σ_t w_t · min(r_t A_t, clip(r_t, 1−ε_l, 1+ε_h) A_t) / normaliser, with r_t = exp(logp − μ).

    `negative_scale` multiplies negative advantages (1: plain PPO; 0: learn only from executions
    that beat their group, which keeps a small policy from pushing mass onto invalid outputs)."""
    logp = logp.to(c.weights.dtype)
    ratio = torch.exp(logp - c.old_logprobs)
    adv = c.advantages if negative_scale == 1.0 else torch.where(c.advantages < 0, c.advantages * negative_scale,
                                                                 c.advantages)
    surr = torch.minimum(ratio * adv, ratio.clamp(1 - clip_low, 1 + clip_high) * adv)
    loss = -(c.weights * surr).sum() / normaliser
    with torch.no_grad():
        clipped = ((ratio < 1 - clip_low) & (adv < 0)) | ((ratio > 1 + clip_high) & (adv > 0))
        log_r = logp - c.old_logprobs
        stats = {
            "clip_frac": clipped.double().sum().item(),
            "approx_kl": ((ratio - 1) - log_r).sum().item(),   # k3 estimator of KL(μ‖π), summed
            "logprob_mismatch": log_r.abs().sum().item(),
        }
    return loss, stats


def nll_loss(logp: torch.Tensor, c: Collated, normaliser: float):
    """Supervised warm start: −Σ_t w_t log π(t) / normaliser."""
    loss = -(c.weights * logp.to(c.weights.dtype)).sum() / normaliser
    return loss, {}


def decoupled_ppo_loss(logp: torch.Tensor, c: Collated, clip_low: float, clip_high: float, normaliser: float, *,
                       is_cap: float, prox_logprobs: torch.Tensor | None = None, negative_scale: float = 1.0):
    """Decoupled PPO: −Σ_t w_t · ρ_t · min(r_t A_t, clip(r_t, 1−ε_l, 1+ε_h) A_t) / normaliser.

    r_t = π/π_prox clips against the proximal policy π_prox (the weights at the start of this step) instead
    of the behaviour policy μ, and ρ_t = min(π_prox/μ, is_cap) — a constant, no gradient — corrects for μ
    being older than π_prox (stale executions, a call rerouted across a weight update). Clipping against
    μ would clip a stale token before the step has moved the policy at all; ρ reweights it instead, and
    the cap bounds the variance a token with π_prox ≫ μ would add.

    `prox_logprobs` ([N], aligned with `c`'s scored entries) is only needed when a step runs several
    epochs; by default π_prox = π.detach(), exact for the first (or only) epoch: r = 1 in value with the
    gradient of π. Entries of a packed tree carry their own branch's μ, A and w, so trees need nothing
    more. Stats are sums over entries like `ppo_clip_loss`'s (divide by the token count for means):
    `is_weight` sums ρ, `is_truncated` counts ρ capped (π_prox/μ > is_cap).
    """
    if not is_cap > 0:
        raise ValueError(f"is_cap must be positive, got {is_cap}")
    logp = logp.to(c.weights.dtype)
    prox = logp.detach() if prox_logprobs is None else prox_logprobs.detach().to(logp)
    if prox.shape != logp.shape:
        raise ValueError(f"prox_logprobs has shape {tuple(prox.shape)}; the batch scores {tuple(logp.shape)} entries")
    with torch.no_grad():
        raw_is = torch.exp(prox - c.old_logprobs)
        is_w = raw_is.clamp(max=is_cap)
    ratio = torch.exp(logp - prox)
    adv = c.advantages if negative_scale == 1.0 else torch.where(c.advantages < 0, c.advantages * negative_scale,
                                                                 c.advantages)
    surr = torch.minimum(ratio * adv, ratio.clamp(1 - clip_low, 1 + clip_high) * adv)
    loss = -(c.weights * is_w * surr).sum() / normaliser
    with torch.no_grad():
        clipped = ((ratio < 1 - clip_low) & (adv < 0)) | ((ratio > 1 + clip_high) & (adv > 0))
        log_r = logp - c.old_logprobs      # against μ: comparable with ppo_clip_loss's stats
        stats = {
            "clip_frac": clipped.double().sum().item(),
            "approx_kl": ((log_r.exp() - 1) - log_r).sum().item(),
            "logprob_mismatch": log_r.abs().sum().item(),
            "is_weight": is_w.sum().item(),
            "is_truncated": (raw_is > is_cap).double().sum().item(),
        }
    return loss, stats
