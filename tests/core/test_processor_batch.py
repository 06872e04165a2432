import math

import pytest
import torch

from gyre_core.processor.batch import (RecordMismatch, build_batch, execution_sequences, group_advantages,
                                       reward_of)
from gyre_core.records import CallRecord, ExecutionRecord
from gyre_core.trainer.losses import collate, ppo_clip_loss, token_logprobs


def _call(i, ctx, prompt, completion, lp, parent=-1, prefix=0):
    return CallRecord("e", i, ctx, "main", prompt, completion, lp, [3] * len(completion), "stop", parent, prefix)


def _exec(eid, calls, task="t"):
    r = ExecutionRecord("run", 0, eid, task, 1, "train", "env", calls=calls)
    for c in r.calls:
        c.execution_id = eid
    return r


def test_rewards_and_group_advantages_by_hand():
    assert reward_of(True, 0.3, 0.1) == 1.0
    assert reward_of(False, 0.5, 0.1) == pytest.approx(0.05)
    rewards = {"a": 1.0, "b": 0.0, "c": 0.0, "d": 0.5, "x": 0.2}
    adv = group_advantages(rewards, {"g1": ["a", "b", "c", "d"], "g2": ["x"]}, "none")
    # mean of g1 = 1.5/4 = 0.375
    assert adv == pytest.approx({"a": 0.625, "b": -0.375, "c": -0.375, "d": 0.125, "x": 0.0})
    std = math.sqrt((0.625**2 + 2 * 0.375**2 + 0.125**2) / 4)
    adv_s = group_advantages(rewards, {"g1": ["a", "b", "c", "d"], "g2": ["x"]}, "std")
    assert adv_s["a"] == pytest.approx(0.625 / (std + 1e-6))
    assert adv_s["x"] == 0.0
    # a floor on the std: a group where all failed (partials 0.1, 0.3 → rewards 0.01, 0.03; std 0.01) gets
    # ±0.01/0.1 = ±0.1 instead of ±1; a group whose std is above the floor is divided as before
    fails = {"p": reward_of(False, 0.1, 0.1), "q": reward_of(False, 0.3, 0.1)}
    groups = {"f": ["p", "q"], "g1": ["a", "b", "c", "d"]}
    both = {**fails, **rewards}
    assert group_advantages(both, groups, "std")["q"] == pytest.approx(0.01 / (0.01 + 1e-6))
    floored = group_advantages(both, groups, "std", std_floor=0.1)
    assert floored["p"] == pytest.approx(-0.1) and floored["q"] == pytest.approx(0.1)
    assert floored["a"] == pytest.approx(0.625 / (std + 1e-6))          # std 0.38 > 0.1: unchanged


def test_sequences_mask_only_generated_tokens_and_weight_two_levels():
    # context 0: two calls, append-only; context 1 (compaction): one call
    c0 = _call(0, 0, [1, 2, 3], [10, 11], [-0.1, -0.2])
    c1 = _call(1, 0, [1, 2, 3, 10, 11, 4, 5], [12], [-0.3], parent=0, prefix=5)
    c2 = _call(2, 1, [1, 6], [13, 14], [-0.4, -0.5])
    rec = _exec("e", [c0, c1, c2])
    seqs = execution_sequences(rec, advantage=0.5)
    assert [s.input_ids for s in seqs] == [[1, 2, 3, 10, 11, 4, 5, 12], [1, 6, 13, 14]]
    w = 1 / 5     # five generated tokens in the execution
    assert seqs[0].weights == [0, 0, 0, w, w, 0, 0, w]
    assert seqs[0].old_logprobs == [0, 0, 0, -0.1, -0.2, 0, 0, -0.3]
    assert seqs[0].advantages == [0, 0, 0, 0.5, 0.5, 0, 0, 0.5]
    assert seqs[1].weights == [0, 0, w, w]
    assert seqs[0].score_from == [-1, 0, 1, 2, 3, 4, 5, 6]
    # a second execution with one token: each execution weighs 1 in the normaliser
    other = _exec("f", [_call(0, 0, [1], [9], [-1.0])])
    batch = build_batch([rec, other], {"e": 0.5, "f": -0.5})
    assert batch.normaliser == 2.0
    assert sum(sum(s.weights) for s in batch.sequences) == pytest.approx(2.0)


def test_progress_credit_adds_each_turns_own_progress_by_hand():
    # three calls over two contexts; the env's progress when each was made: 0.2, 0.5, 0.4; final partial 0.6
    c0 = _call(0, 0, [1, 2, 3], [10, 11], [-0.1, -0.2])
    c1 = _call(1, 0, [1, 2, 3, 10, 11, 4, 5], [12], [-0.3], parent=0, prefix=5)
    c2 = _call(2, 1, [1, 6], [13, 14], [-0.4, -0.5])
    for c, p in zip((c0, c1, c2), (0.2, 0.5, 0.4)):
        c.progress = p
    rec = _exec("e", [c0, c1, c2])
    rec.partial = 0.6
    # call 0 moved 0.5 - 0.2 = +0.3, call 1 0.4 - 0.5 = -0.1, call 2 (the last) 0.6 - 0.4 = +0.2
    seqs = execution_sequences(rec, advantage=0.5, progress_credit=2.0)
    assert seqs[0].advantages == pytest.approx([0, 0, 0, 1.1, 1.1, 0, 0, 0.3])
    assert seqs[1].advantages == pytest.approx([0, 0, 0.9, 0.9])
    assert [s.weights for s in seqs] == [s.weights for s in execution_sequences(rec, advantage=0.5)]
    # off by default; a call without a recorded progress (an env without the hook) moves nothing
    assert execution_sequences(rec, advantage=0.5)[1].advantages == [0, 0, 0.5, 0.5]
    c1.progress = None
    seqs = build_batch([rec], {"e": 0.5}, progress_credit=2.0).sequences
    assert seqs[0].advantages == pytest.approx([0, 0, 0, 0.5, 0.5, 0, 0, 0.5])   # calls 0 and 1: no pair
    assert seqs[1].advantages == pytest.approx([0, 0, 0.9, 0.9])


def test_record_that_does_not_extend_its_context_is_rejected():
    c0 = _call(0, 0, [1, 2, 3], [10], [-0.1])
    c1 = _call(1, 0, [1, 2, 7, 10, 4], [12], [-0.3], parent=0, prefix=4)
    rec = _exec("bad", [c0, c1])
    with pytest.raises(RecordMismatch, match="execution bad: call 0 differs from its context at token 2"):
        execution_sequences(rec, 1.0)
    batch = build_batch([rec, _exec("ok", [_call(0, 0, [1], [2], [-1.0])])], {"bad": 1.0, "ok": 1.0})
    assert "bad" in batch.excluded and batch.n_executions == 1


def test_ppo_clip_loss_by_hand():
    # one sequence [5, 6, 7]: tokens 6 and 7 trainable, scored from positions 0 and 1
    from gyre_core.processor.batch import TrainSequence
    seq = TrainSequence("e", 0, [5, 6, 7], [-1, 0, 1], [0.0, math.log(0.5), math.log(0.5)],
                        [0.0, 1.0, -2.0], [0.0, 0.25, 0.75])
    c = collate([seq], pad_id=0)
    V = 8
    logits = torch.zeros(1, 3, V, dtype=torch.float64)
    # position 0: p(6) = 0.8 ; position 1: p(7) = 0.3 (rest uniform)
    def set_prob(pos, tok, p):
        rest = (1 - p) / (V - 1)
        logits[0, pos] = math.log(rest)
        logits[0, pos, tok] = math.log(p)
    set_prob(0, 6, 0.8)
    set_prob(1, 7, 0.3)
    logp, ent = token_logprobs(logits, c)
    assert logp.tolist() == pytest.approx([math.log(0.8), math.log(0.3)])
    loss, stats = ppo_clip_loss(logp, c, clip_low=0.2, clip_high=0.28, normaliser=2.0)
    # token 6: r = 1.6, A=+1 → min(1.6, 1.28) = 1.28 ; token 7: r = 0.6, A=-2 → min(-1.2, 0.8·-2=-1.6) = -1.6
    expected = -(0.25 * 1.28 + 0.75 * -1.6) / 2.0
    assert loss.item() == pytest.approx(expected)
    assert stats["clip_frac"] == 2.0
    assert stats["logprob_mismatch"] == pytest.approx(abs(math.log(1.6)) + abs(math.log(0.6)))
