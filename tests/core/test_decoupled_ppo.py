"""Decoupled PPO (clip π/π_prox, weight by min(π_prox/μ, c)) against values and gradients by hand, against
PPO-clip when μ = π_prox, through the DeepSpeed micro-step, and on packed trees.

    .venv/bin/python -m pytest -q tests/core/test_decoupled_ppo.py
"""
import copy
import math
import random

import pytest
import torch

from bench.processor_packing import exact_float64
from gyre_core.processor.batch import TrainSequence
from gyre_core.trainer.trainer import Trainer
from gyre_core.trainer.losses import Collated, collate, decoupled_ppo_loss, ppo_clip_loss, token_logprobs
from gyre_core.trainer.packing import pack_branches
from gyre_core.trainer.tree_attention import enable_tree_attention

f64 = torch.float64


def _collated(old, adv, w) -> Collated:
    z = torch.zeros(len(old), dtype=torch.long)
    return Collated(z[None], z[None], z, z, z, torch.tensor(old, dtype=f64).log(), torch.tensor(adv, dtype=f64),
                    torch.tensor(w, dtype=f64))


def test_loss_gradient_and_stats_by_hand():
    # token:        a      b      c      d
    pi = [0.60, 0.30, 0.45, 0.22]
    prox = [0.50, 0.50, 0.30, 0.25]
    mu = [0.40, 0.20, 0.60, 0.05]
    adv = [1.0, -2.0, 0.5, -1.0]
    w = [0.5, 0.25, 0.25, 1.0]
    c = _collated(mu, adv, w)
    logp = torch.tensor(pi, dtype=f64).log().requires_grad_()
    prox_lp = torch.tensor(prox, dtype=f64).log()
    loss, st = decoupled_ppo_loss(logp, c, 0.2, 0.28, 2.0, is_cap=2.0, prox_logprobs=prox_lp)
    # a: r = 1.2 (inside [0.8, 1.28]), ρ = 0.5/0.4 = 1.25           -> 0.5 · 1.25 · 1.2 · 1       =  0.75
    # b: r = 0.6 < 0.8 with A < 0: clipped to 0.8, ρ = 2.5 → cap 2   -> 0.25 · 2 · 0.8 · (−2)     = −0.8
    # c: r = 1.5 > 1.28 with A > 0: clipped to 1.28, ρ = 0.5         -> 0.25 · 0.5 · 1.28 · 0.5   =  0.08
    # d: r = 0.88 (inside), A < 0, ρ = 5 → cap 2                      -> 1 · 2 · 0.88 · (−1)       = −1.76
    assert loss.item() == pytest.approx(-(0.75 - 0.8 + 0.08 - 1.76) / 2.0, rel=1e-12)
    loss.backward()
    # ∂/∂logp of −w ρ r A / norm is −w ρ A r / norm where unclipped; a clipped term is constant
    expect = [-0.5 * 1.25 * 1.0 * 1.2 / 2, 0.0, 0.0, -1.0 * 2.0 * -1.0 * 0.88 / 2]
    assert logp.grad.tolist() == pytest.approx(expect, rel=1e-12, abs=1e-15)
    assert st["clip_frac"] == 2.0                          # b, c
    assert st["is_weight"] == pytest.approx(1.25 + 2 + 0.5 + 2, rel=1e-12)
    assert st["is_truncated"] == 2.0                       # b, d
    log_r = [math.log(p / m) for p, m in zip(pi, mu)]      # the mismatch stats stay against μ
    assert st["logprob_mismatch"] == pytest.approx(sum(abs(x) for x in log_r), rel=1e-12)
    assert st["approx_kl"] == pytest.approx(sum(math.exp(x) - 1 - x for x in log_r), rel=1e-12)


def test_one_epoch_gradient_is_the_truncated_weight_times_the_policy_gradient():
    # π_prox = π.detach(): r = 1 in value, so nothing is clipped; ρ = min(π/μ, 1.5) with π/μ = 1.25, 3, 0.5, 2
    pi = [0.5, 0.6, 0.1, 0.4]
    mu = [0.4, 0.2, 0.2, 0.2]
    adv = [1.0, -1.0, -0.5, 2.0]
    w = [1.0, 0.5, 0.5, 0.25]
    c = _collated(mu, adv, w)
    logp = torch.tensor(pi, dtype=f64).log().requires_grad_()
    loss, st = decoupled_ppo_loss(logp, c, 0.2, 0.28, 4.0, is_cap=1.5)
    rho = [1.25, 1.5, 0.5, 1.5]
    assert loss.item() == pytest.approx(-sum(wi * r * a for wi, r, a in zip(w, rho, adv)) / 4.0, rel=1e-12)
    loss.backward()
    assert logp.grad.tolist() == pytest.approx([-wi * r * a / 4.0 for wi, r, a in zip(w, rho, adv)], rel=1e-12)
    assert (st["clip_frac"], st["is_truncated"]) == (0.0, 2.0)


@pytest.mark.parametrize("explicit_prox", [False, True])
def test_with_mu_equal_to_prox_it_is_ppo_clip(explicit_prox):
    g = torch.Generator().manual_seed(0)
    n = 40
    mu = -torch.rand(n, generator=g, dtype=f64) * 3 - 0.1
    adv = torch.randn(n, generator=g, dtype=f64)
    w = torch.rand(n, generator=g, dtype=f64)
    # explicit π_prox = μ with π away from it (clipping active on both sides); default: π_prox = π = μ
    pi = mu + 0.4 * torch.randn(n, generator=g, dtype=f64) if explicit_prox else mu.clone()
    z = torch.zeros(n, dtype=torch.long)
    c = Collated(z[None], z[None], z, z, z, mu, adv, w)
    a, b = pi.clone().requires_grad_(), pi.clone().requires_grad_()
    l_dec, st_dec = decoupled_ppo_loss(a, c, 0.2, 0.28, 3.0, is_cap=2.0, prox_logprobs=mu if explicit_prox else None,
                                       negative_scale=0.5)
    l_ppo, st_ppo = ppo_clip_loss(b, c, 0.2, 0.28, 3.0, negative_scale=0.5)
    l_dec.backward()
    l_ppo.backward()
    assert l_dec.item() == pytest.approx(l_ppo.item(), rel=1e-12)
    assert torch.allclose(a.grad, b.grad, rtol=1e-12, atol=1e-15)
    assert st_dec["clip_frac"] == st_ppo["clip_frac"] and (st_dec["clip_frac"] > 0) == explicit_prox
    assert st_dec["is_weight"] == pytest.approx(n) and st_dec["is_truncated"] == 0.0


def test_bad_arguments_are_refused():
    c = _collated([0.5], [1.0], [1.0])
    logp = torch.tensor([0.5], dtype=f64).log()
    with pytest.raises(ValueError, match="shape"):
        decoupled_ppo_loss(logp, c, 0.2, 0.2, 1.0, is_cap=2.0, prox_logprobs=torch.zeros(2, dtype=f64))
    with pytest.raises(ValueError, match="positive"):
        decoupled_ppo_loss(logp, c, 0.2, 0.2, 1.0, is_cap=0.0)


# ------------------------------------------------------------------ through the trainer, and on trees

def _model(vocab=40, dtype=torch.float32):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=vocab, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(1)
    m = Qwen2ForCausalLM(cfg).to(dtype).eval()
    return exact_float64(m) if dtype == f64 else m


def _seqs(n, seed, vocab=40):
    rng = random.Random(seed)
    out = []
    for i in range(n):
        L = rng.randint(5, 12)
        w = [1.0 / L if j >= 2 and rng.random() < 0.6 else 0.0 for j in range(L)]
        out.append(TrainSequence(f"e{i}", 0, [rng.randrange(3, vocab) for _ in range(L)], [j - 1 for j in range(L)],
                                 [rng.uniform(-4.6, -3.0) if x else 0.0 for x in w],
                                 [rng.choice([-1.0, 0.5]) if x else 0.0 for x in w], w))
    return out


def test_trainer_decoupled_micro_step_matches_plain_torch():
    model, seqs, cap, norm = _model(), _seqs(5, seed=2), 1.2, 5.0
    ref = copy.deepcopy(model)
    c = collate(seqs, pad_id=0)
    logp, _ = token_logprobs(ref(**c.model_inputs()).logits, c)
    logp = logp.double()
    rho = torch.exp(logp.detach() - c.old_logprobs).clamp(max=cap)   # written out: ρ w A ∇logp
    ref_loss = -(c.weights * rho * c.advantages * torch.exp(logp - logp.detach())).sum() / norm
    ref_loss.backward()
    torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.0, betas=(0.9, 0.99)).step()

    trainer = Trainer(copy.deepcopy(model), lr=1e-3, zero_stage=1, grad_clip=1e9)
    prox = trainer.logprobs(seqs)                                     # π_prox before the step: = π here
    assert torch.allclose(prox, logp.detach(), atol=1e-6)
    total: dict[str, float] = {}
    for k, chunk in enumerate([seqs[:2], seqs[2:]]):      # explicit π_prox, as a multi-epoch step would pass
        for key, v in trainer.micro_step(chunk, norm, objective="decoupled", is_cap=cap,
                                         prox_logprobs=trainer.logprobs(chunk), last=k == 1).items():
            total[key] = total.get(key, 0.0) + v
    trainer.optimizer_step()
    for (name, p), q in zip(trainer.model.named_parameters(), ref.parameters()):
        assert torch.allclose(p, q, atol=1e-6), name
    assert total["loss"] == pytest.approx(ref_loss.item(), rel=1e-5)
    assert total["is_weight"] == pytest.approx(rho.sum().item(), rel=1e-5)
    assert total["is_truncated"] == (torch.exp(logp.detach() - c.old_logprobs) > cap).sum().item() > 0
    assert total["tokens"] == c.tgt.numel()
    with pytest.raises(ValueError, match="'decoupled'"):
        trainer.micro_step(seqs, norm, objective="dppo")


def test_packed_trees_equal_per_branch_training():
    """Branches sharing prefixes with their own μ, A, w: packed, each (token, branch) entry is its own term."""
    rng = random.Random(5)
    base = [3, 7, 9, 11, 4, 8]
    branches = []
    for k in range(4):
        ids = base[:rng.randint(2, 6)] + [rng.randrange(3, 40) for _ in range(rng.randint(1, 6))]
        L = len(ids)
        branches.append(TrainSequence(f"b{k}", 0, ids, [j - 1 for j in range(L)],
                                      [-rng.uniform(2.5, 5.0) for _ in range(L)],
                                      [rng.choice([-1.0, 0.7]) for _ in range(L)],
                                      [0.0] + [rng.choice([0.0, 0.5, 1.0]) for _ in range(L - 1)]))
    model = _model(dtype=f64)
    flat, packed = copy.deepcopy(model), copy.deepcopy(model)
    enable_tree_attention(packed, "sparse")

    def loss_of(m, items):
        c = collate(items, 0)
        logp, _ = token_logprobs(m(**c.model_inputs()).logits, c)
        return decoupled_ppo_loss(logp, c, 0.2, 0.28, 2.0, is_cap=1.5)

    l_flat, st_flat = loss_of(flat, branches)
    trees = pack_branches(branches)
    assert trees[0].n_tokens < sum(len(b.input_ids) for b in branches)      # prefixes are shared
    l_pk, st_pk = loss_of(packed, trees)
    l_flat.backward()
    l_pk.backward()
    assert l_pk.item() == pytest.approx(l_flat.item(), abs=1e-12)
    assert st_pk["is_weight"] == pytest.approx(st_flat["is_weight"], rel=1e-12) and st_flat["is_truncated"] > 0
    for (name, p), q in zip(packed.named_parameters(), flat.parameters()):
        assert (p.grad - q.grad).norm() <= 1e-10 * q.grad.norm(), name
