"""The DeepSpeed micro-step against plain torch autograd on the same loss (an independent reference)."""
import copy
import math
import random

import pytest
import torch

from gyre_core.model import build_tiny_model, train_tokenizer
from gyre_core.processor.batch import TrainSequence
from gyre_core.trainer.trainer import Trainer
from gyre_core.trainer.losses import collate, ppo_clip_loss, token_logprobs


def _seqs(n, vocab, seed):
    rng = random.Random(seed)
    out = []
    for i in range(n):
        L = rng.randint(5, 12)
        ids = [rng.randrange(3, vocab) for _ in range(L)]
        w = [0.0] * L
        for j in range(2, L):
            if rng.random() < 0.5:
                w[j] = 1.0 / L
        out.append(TrainSequence(f"e{i}", 0, ids, [j - 1 for j in range(L)],
                                 [rng.uniform(-3, -0.5) if w[j] else 0.0 for j in range(L)],
                                 [rng.choice([-1.0, 0.5]) if w[j] else 0.0 for j in range(L)], w))
    return out


@pytest.fixture(scope="module")
def model():
    tok = train_tokenizer(["go left go right pick up the red ball"] * 20, vocab_size=280)
    m = build_tiny_model(tok, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, ffn_size=64,
                         max_positions=64, seed=0)
    return m


def test_split_micro_steps_match_torch_on_the_whole_batch(model):
    seqs = _seqs(6, 250, seed=1)
    norm = 6.0
    # reference: plain torch, one backward over the whole batch, then AdamW
    ref = copy.deepcopy(model).train()
    c = collate(seqs, pad_id=0)
    logits = ref(input_ids=c.input_ids, attention_mask=c.attention_mask).logits
    logp, _ = token_logprobs(logits, c)
    loss, _ = ppo_clip_loss(logp, c, 0.2, 0.28, norm)
    loss.backward()
    ref_norm = math.sqrt(sum(p.grad.double().pow(2).sum().item() for p in ref.parameters() if p.grad is not None))
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.0, betas=(0.9, 0.99))
    torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e9)
    opt.step()

    trainer = Trainer(copy.deepcopy(model), lr=1e-3, zero_stage=1, grad_clip=1e9)
    total = 0.0
    for k, chunk in enumerate([seqs[:1], seqs[1:4], seqs[4:]]):
        st = trainer.micro_step(chunk, norm, objective="ppo", last=k == 2)
        total += st["loss"]
    gnorm = trainer.optimizer_step()
    assert total == pytest.approx(loss.item(), rel=1e-5, abs=1e-7)
    assert gnorm == pytest.approx(ref_norm, rel=1e-4)
    for (n, p), q in zip(trainer.model.named_parameters(), ref.parameters()):
        assert torch.allclose(p.detach().cpu(), q, atol=1e-6), n    # the trainer's is on the GPU where there is one
    # the update's size against the behaviour log-probs, recomputed with the reference's new weights
    with torch.no_grad():
        new_logp, _ = token_logprobs(ref(input_ids=c.input_ids, attention_mask=c.attention_mask).logits, c)
    log_r = new_logp.double() - c.old_logprobs
    shift = trainer.policy_shift(seqs, clip_low=0.2, clip_high=0.28)
    assert shift["tokens"] == c.tgt.numel()
    assert shift["kl"] == pytest.approx(((log_r.exp() - 1) - log_r).sum().item(), rel=1e-4)
    assert shift["clipped"] == ((log_r.exp() < 0.8) | (log_r.exp() > 1.28)).sum().item()


def test_sgd_steps_by_minus_lr_times_the_clipped_gradient(model):
    """`optimizer="sgd"`: each weight moves by −lr × its gradient, scaled by clip / norm when the norm is over
    the clip — checked against a plain-torch backward of the same loss."""
    seqs = _seqs(5, 250, seed=3)
    ref = copy.deepcopy(model)
    c = collate(seqs, pad_id=0)
    logp, _ = token_logprobs(ref(input_ids=c.input_ids, attention_mask=c.attention_mask).logits, c)
    loss, _ = ppo_clip_loss(logp, c, 0.2, 0.28, 5.0)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in ref.named_parameters()}
    norm = math.sqrt(sum(g.double().pow(2).sum().item() for g in grads.values()))
    clip, lr = norm / 4, 0.5                       # the clip scales the gradient by 1/4
    trainer = Trainer(copy.deepcopy(model), lr=lr, zero_stage=1, grad_clip=clip, optimizer="sgd")
    trainer.micro_step(seqs, 5.0, objective="ppo", last=True)
    assert trainer.optimizer_step() == pytest.approx(norm, rel=1e-4)
    start = dict(model.named_parameters())
    for n, p in trainer.model.named_parameters():
        want = start[n].detach() - lr * grads[n] * (clip / norm)
        assert torch.allclose(p.detach().cpu(), want, atol=1e-6), n
    with pytest.raises(ValueError, match="'adamw' or 'sgd'"):
        Trainer(copy.deepcopy(model), lr=lr, optimizer="lion")


def test_optimizer_step_before_last_micro_step_is_refused(model):
    trainer = Trainer(copy.deepcopy(model), lr=1e-3)
    trainer.micro_step(_seqs(2, 250, seed=2), 2.0, objective="nll", last=False)
    with pytest.raises(RuntimeError, match="last=True"):
        trainer.optimizer_step()


def test_negative_scale_weighs_only_negative_advantages_by_hand():
    # three scored tokens, logits chosen so the ratios are 1.1, 0.7 and 1.5 against μ
    logp = torch.log(torch.tensor([0.55, 0.35, 0.3], dtype=torch.float64))
    old = torch.log(torch.tensor([0.5, 0.5, 0.2], dtype=torch.float64))
    adv = torch.tensor([1.0, -2.0, -0.5], dtype=torch.float64)
    w = torch.tensor([0.5, 0.25, 0.25], dtype=torch.float64)
    z = torch.zeros(3, dtype=torch.long)
    from gyre_core.trainer.losses import Collated

    c = Collated(z[None], z[None], z, z, z, old, adv, w)
    # token 1: min(1.1·1, 1.1·1) = 1.1. token 2 (A=−2·s): min(0.7·A, clip(0.7)=0.8·A) = 0.8·A for A<0.
    # token 3 (A=−0.5·s): min(1.5·A, 1.28·A) = 1.5·A for A<0.
    for s in (1.0, 0.25, 0.0):
        expect = -(0.5 * 1.1 + 0.25 * 0.8 * (-2.0 * s) + 0.25 * 1.5 * (-0.5 * s)) / 2.0
        loss, stats = ppo_clip_loss(logp, c, 0.2, 0.28, 2.0, negative_scale=s)
        assert loss.item() == pytest.approx(expect, rel=1e-12)
        assert stats["clip_frac"] == (1.0 if s > 0 else 0.0)   # token 2 is clipped only while its A < 0


def test_a_collated_batch_moves_whole_to_the_models_device_and_its_tree_stays_on_the_host():
    from gyre_core.trainer.packing import pack_branches

    seqs = _seqs(3, 250, seed=5)
    c = collate(seqs, pad_id=0)
    assert c.to("cpu") is c
    m = c.to("meta")
    tensors = [f for f in ("input_ids", "attention_mask", "row", "src", "tgt", "old_logprobs", "advantages", "weights")]
    assert all(getattr(m, f).device.type == "meta" and getattr(m, f).shape == getattr(c, f).shape for f in tensors)
    assert all(getattr(m, f).dtype == getattr(c, f).dtype for f in tensors)
    packed = collate(pack_branches(seqs), pad_id=0)
    pm = packed.to("meta")
    assert pm.position_ids.device.type == "meta" and pm.tree is packed.tree and pm.tree.parent.device.type == "cpu"


def test_the_entropy_bonus_adds_minus_coef_times_the_weighted_entropy_to_the_loss(model):
    seqs, norm, coef, temp = _seqs(4, 250, seed=7), 3.0, 0.05, 0.8
    # reference, plain torch: the clipped PPO loss minus coef · Σ_t w_t H_t / norm, H from the softmax itself
    ref = copy.deepcopy(model)
    c = collate(seqs, pad_id=0)
    logits = ref(input_ids=c.input_ids, attention_mask=c.attention_mask).logits[c.row, c.src].float() / temp
    p = torch.softmax(logits, -1)
    entropy = -(p * torch.log(p)).sum(-1)
    logp = torch.log(p.gather(-1, c.tgt[:, None]).squeeze(-1))
    ppo, _ = ppo_clip_loss(logp, c, 0.2, 0.28, norm)
    bonus = (c.weights * entropy.double()).sum() / norm
    (ppo - coef * bonus).backward()
    trainers = {k: Trainer(copy.deepcopy(model), lr=1e-3) for k in (0.0, coef)}
    stats = {k: t.micro_step(seqs, norm, objective="ppo", temperature=temp, entropy_coef=k, last=False)
             for k, t in trainers.items()}
    assert stats[coef]["loss"] == pytest.approx(ppo.item() - coef * bonus.item(), rel=1e-5)
    assert stats[0.0]["loss"] == pytest.approx(ppo.item(), rel=1e-5)
    got = trainers[coef].gradients()
    for name, q in ref.named_parameters():
        assert torch.allclose(got[name].cpu(), q.grad, rtol=1e-4, atol=1e-7), name
    # and the bonus changed the gradient (the check above is not satisfied by the plain PPO gradient)
    plain = trainers[0.0].gradients()
    assert any(not torch.allclose(plain[n], got[n], rtol=1e-3, atol=1e-6) for n in got)


def test_gradient_checkpointing_gives_the_same_update_and_log_probs(model):
    """`trainer.gradient_checkpointing`: activations are recomputed in the backward pass, and nothing else
    changes — the same loss, gradient norm and weights after the step, and (dropout off) the same log-probs."""
    seqs = _seqs(5, 250, seed=3)
    plain = Trainer(copy.deepcopy(model), lr=1e-3, zero_stage=0, grad_clip=1.0)
    ckpt = Trainer(copy.deepcopy(model), lr=1e-3, zero_stage=0, grad_clip=1.0, gradient_checkpointing=True)
    assert ckpt.model.is_activation_checkpointing and not plain.model.is_activation_checkpointing
    assert torch.allclose(ckpt.logprobs(seqs), plain.logprobs(seqs), atol=1e-7)
    calls = {id(t): 0 for t in (plain, ckpt)}
    for t in (plain, ckpt):   # recomputation enters the MLP again in the backward (a pre-hook: it stops early)
        t.model.model.layers[0].mlp.register_forward_pre_hook(lambda *a, k=id(t): calls.__setitem__(k, calls[k] + 1))
    out = [t.micro_step(seqs, 5.0, objective="ppo", last=True) for t in (plain, ckpt)]
    assert calls[id(plain)] == 1 and calls[id(ckpt)] == 2
    norms = [t.optimizer_step() for t in (plain, ckpt)]
    assert out[0]["loss"] == pytest.approx(out[1]["loss"], rel=1e-6) and norms[0] == pytest.approx(norms[1], rel=1e-5)
    for (n, p), q in zip(plain.model.named_parameters(), ckpt.model.parameters()):
        assert torch.allclose(p, q, atol=1e-7), n
