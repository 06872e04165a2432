"""The warm start's learning-rate schedule, and the trainer applying a changed rate."""
import copy
import math

import pytest
import torch

from gyre_core.config import WarmStartConfig
from gyre_core.model import build_tiny_model, train_tokenizer
from gyre_core.processor.batch import TrainSequence
from gyre_core.phases.supervised import supervised_lr
from gyre_core.trainer.trainer import Trainer



def _seqs(n: int) -> list[TrainSequence]:
    """Sequences with every token after the first two trainable (weights 1/len)."""
    out = []
    for i in range(n):
        ids = [5 + (7 * i + 3 * j) % 200 for j in range(8)]
        w = [0.0, 0.0] + [1.0 / 8] * 6
        out.append(TrainSequence(f"e{i}", 0, ids, [j - 1 for j in range(8)], [0.0] * 8, [0.0] * 8, w))
    return out


def test_cosine_schedule_by_hand():
    ws = WarmStartConfig(lr=3e-3, lr_final=1e-4, steps=5)
    got = [supervised_lr(ws, k, 5) for k in range(5)]
    # cos(pi * k/4) for k = 0..4: 1, √2/2, 0, −√2/2, −1
    want = [1e-4 + 0.5 * 2.9e-3 * (1 + c) for c in (1.0, math.sqrt(0.5), 0.0, -math.sqrt(0.5), -1.0)]
    assert got == pytest.approx(want, rel=1e-12)
    assert got[0] == pytest.approx(3e-3) and got[-1] == pytest.approx(1e-4)
    assert supervised_lr(ws, 10, None) == 1e-4        # the budgeted control continues at the final rate
    const = WarmStartConfig(lr=2e-3)
    assert [supervised_lr(const, k, 5) for k in range(5)] == [2e-3] * 5
    assert supervised_lr(const, 3, None) == 2e-3


def test_set_lr_reaches_the_optimizer():
    tok = train_tokenizer(["go left go right pick up the red ball"] * 20, vocab_size=280)
    model = build_tiny_model(tok, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, ffn_size=64,
                             max_positions=64, seed=0)
    before = copy.deepcopy(model.state_dict())
    trainer = Trainer(model, lr=1e-3, grad_clip=1e9)
    trainer.set_lr(0.0)           # AdamW without weight decay at rate 0 leaves every weight as it was
    trainer.micro_step(_seqs(3), 3.0, objective="nll", last=True)
    trainer.optimizer_step()
    for name, p in trainer.model.state_dict().items():
        assert torch.equal(p, before[name]), name
    trainer.set_lr(1e-3)          # and at a positive rate the next step moves them
    trainer.micro_step(_seqs(3), 3.0, objective="nll", last=True)
    trainer.optimizer_step()
    assert any(not torch.equal(p, before[n]) for n, p in trainer.model.state_dict().items())
