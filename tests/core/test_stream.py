"""Streaming training: the micro-step queue's rules by hand, and streamed updates (one cell, core + satellite)
against the one-batch update and an independent plain-torch reference of two-level averaged PPO.

    .venv/bin/python -m pytest -q tests/core/test_stream.py
"""
import copy
import math
import random
import threading

import pytest
import torch

from gyre_core.elastic.stream import MicroStepQueue, finish_step, finish_step_within_kl, hand_over, train_micro_step
from gyre_core.processor.batch import TrainSequence, micro_batches
from gyre_core.trainer.trainer import Trainer

# ------------------------------------------------------------------ the queue's rules by hand


def test_cutting_staleness_claims_and_reclaims_by_hand():
    q = MicroStepQueue(micro_step_executions=2, max_staleness=1)
    q.open_burst(2, expected_count=6)
    assert q.add("e0", 2, "p0", [2, 2])
    assert q.add("e1", 2, "p1", [1, 2])            # staleness 1: kept
    assert not q.add("e2", 2, "p2", [2, 0, 1])     # a token from version 0: staleness 2 > 1, dropped
    assert q.add("e3", 2, "p3", 2)
    assert q.add("e4", 2, "p4", [2])
    assert q.claim(0, version=1) is None           # weights v1 train only burst 1
    assert not q.burst_done(2)
    q.add("e5", 2, "p5", [2])                      # the 6th arrival seals the burst: last group of one
    assert q.left_out(2) == {"e2": "stale: 2 > max_staleness 1"}
    assert q.trained_executions(2) == 5
    a, b, c = q.claim(0, 2), q.claim(1, 2), q.claim(1, 2)
    assert (a.execution_ids, b.execution_ids, c.execution_ids) == (["e0", "e1"], ["e3", "e4"], ["e5"])
    assert a.payloads == ["p0", "p1"] and a.burst == 2
    assert q.claim(0, 2) is None
    assert q.reclaim(1) == [b, c]                  # cell 1 died: back to the front, in order
    assert q.complete(b.id, 1) is False            # its late answer no longer counts
    assert q.complete(a.id, 0) is True
    assert q.claim(0, 2) is b and q.claim(0, 2) is c
    assert q.complete(b.id, 0) and not q.burst_done(2)
    assert q.complete(c.id, 0) and q.burst_done(2)
    k = q.counters()
    assert (k.added, k.dropped_stale, k.cut, k.claimed, k.completed, k.reclaimed) == (6, 1, 3, 5, 3, 2)
    assert q.dropped_stale == 1 and q.reclaimed == 2


def test_sealing_discards_resets_and_release():
    q = MicroStepQueue(micro_step_executions=4, max_staleness=0, tail=3)
    q.add("a", 0, 1, 0)
    q.discard("x", 0, "evaluator failed")
    q.add("b", 0, 2, 0)
    with pytest.raises(RuntimeError, match="not sealed"):
        q.trained_executions(0)
    assert q.claim(0, 0) is None                   # a, b kept; how many are to come is not known yet
    with pytest.raises(ValueError, match="more than"):
        q.close_burst(0, expected_count=2)         # three already arrived
    q.close_burst(0, expected_count=6)
    assert q.claim(0, 0) is None                   # 3 still to come: not fewer than tail = 3, wait for 4
    q.add("c", 0, 3, 0)                            # 2 to come: the tail, so a cell that asks takes a, b, c
    head = q.claim(0, 0)
    assert head.execution_ids == ["a", "b", "c"] and q.claim(1, 0) is None   # nothing more to cut
    q.add("d", 0, 4, 0)
    q.add("e", 0, 5, 0)                            # 6th arrival: sealed, the last group is d, e
    ms = q.claim(5, 0)
    assert ms.execution_ids == ["d", "e"] and q.trained_executions(0) == 5
    with pytest.raises(ValueError, match="sealed"):
        q.add("late", 0, 4, 0)
    assert q.complete(head.id, 0) and not q.burst_done(0)
    assert q.complete(ms.id, 5) and q.burst_done(0)
    assert q.reset_burst(0) == 2                   # the core died before the update: redo the burst
    assert not q.burst_done(0) and q.claim(6, 0) is head and q.claim(6, 0) is ms
    q.complete(head.id, 6)
    q.complete(ms.id, 6)
    q.add("d", 1, 5, 0)                            # burst 1 from weights v0: staleness 1 > 0
    q.close_burst(1)                               # sealed now: nothing to train
    assert q.burst_done(1) and q.trained_executions(1) == 0 and q.dropped_stale == 1
    assert q.claim(0, 2) is None                   # weights v2: bursts 0 and 1 are let go
    assert q.burst_done(0) and q.burst_done(1)
    with pytest.raises(ValueError, match="released"):
        q.add("e", 0, 6, 0)


def test_concurrent_producers_and_cells_train_every_execution_once():
    q = MicroStepQueue(micro_step_executions=4, max_staleness=1)
    n = 203
    q.open_burst(7, n)
    seen: list[str] = []
    lock = threading.Lock()

    def produce(k):
        for i in range(k, n, 4):
            q.add(f"e{i}", 7, i, [7 if i % 5 else 6])

    def cell(c):
        while not q.burst_done(7):
            ms = q.claim(c, 7)
            if ms is None:
                continue
            with lock:
                seen.extend(ms.execution_ids)
            assert q.complete(ms.id, c)

    threads = [threading.Thread(target=produce, args=(k,)) for k in range(4)]
    threads += [threading.Thread(target=cell, args=(c,)) for c in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert sorted(seen) == sorted(f"e{i}" for i in range(n))
    assert q.counters().cut == math.ceil(n / 4) and q.trained_executions(7) == n


# ------------------------------------------------------------------ streamed updates against the reference

VOCAB, BURST, CLIP_LOW, CLIP_HIGH, LR = 40, 3, 0.2, 0.28, 1e-3


def _model():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return Qwen2ForCausalLM(cfg).eval()    # float32: DeepSpeed reduces float64 gradients on neither stage


def _executions(seed: int, n: int) -> list[tuple[str, list[TrainSequence]]]:
    """Executions of 1-3 contexts; weights 1/(trainable tokens of the execution), one advantage each.
    Execution 2 has a token from a call rerouted across versions 1 → 2 (stale for burst 3), execution 5
    has no trainable token."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        seqs = []
        adv = rng.choice([-1.0, -0.25, 0.5, 1.0])
        for k in range(rng.randint(1, 3)):
            L = rng.randint(5, 12)
            train = [j >= 2 and rng.random() < 0.6 and i != 5 for j in range(L)]
            seqs.append(TrainSequence(
                f"e{i}", k, [rng.randrange(3, VOCAB) for _ in range(L)], [j - 1 for j in range(L)],
                [rng.uniform(-4.5, -2.5) if t else 0.0 for t in train], [adv if t else 0.0 for t in train],
                [1.0 if t else 0.0 for t in train],
                [(1 if i == 2 and j == L - 1 else rng.choice([2, 3])) if t else -1 for j, t in enumerate(train)]))
        n_train = sum(w != 0.0 for s in seqs for w in s.weights)
        for s in seqs:
            s.weights = [w / max(n_train, 1) for w in s.weights]
        out.append((f"e{i}", seqs))
    return out


def _reference(model, executions, kept):
    """Plain torch, written out: per execution the mean PPO-clip term over its trainable tokens, then the
    mean over kept executions; one backward. Returns (model with .grad, gradient norm)."""
    ref = copy.deepcopy(model)
    per_ex = []
    for ex_id, seqs in executions:
        if ex_id not in kept:
            continue
        terms = []
        for s in seqs:
            lp = torch.log_softmax(ref(input_ids=torch.tensor([s.input_ids])).logits[0], dim=-1)
            for j in range(1, len(s.input_ids)):
                if s.weights[j] == 0.0:
                    continue
                r = torch.exp(lp[j - 1, s.input_ids[j]] - s.old_logprobs[j])
                a = s.advantages[j]
                terms.append(-torch.minimum(r * a, r.clamp(1 - CLIP_LOW, 1 + CLIP_HIGH) * a))
        per_ex.append(torch.stack(terms).mean())
    torch.stack(per_ex).mean().backward()
    norm = math.sqrt(sum(p.grad.pow(2).sum().item() for p in ref.parameters()))
    return ref, norm


def _stream(executions, cells, max_tokens=40):
    """Fill a queue in finish order; cells take micro-steps round robin. Returns the queue."""
    q = MicroStepQueue(micro_step_executions=2, max_staleness=1)
    q.open_burst(BURST, len(executions))
    for ex_id, seqs in executions:
        q.add_sequences(ex_id, BURST, seqs)
    k = 0
    while (ms := q.claim(k % len(cells), BURST)) is not None:
        train_micro_step(cells[k % len(cells)], ms, max_tokens=max_tokens, objective="ppo", clip_low=CLIP_LOW,
                         clip_high=CLIP_HIGH)
        assert q.complete(ms.id, k % len(cells))
        k += 1
    assert q.burst_done(BURST) and k == 4           # 8 kept executions in micro-steps of 2
    return q


def _assert_same(trainer, ref, atol=1e-6, grads=None):
    """Parameters equal to `ref`'s. With `grads` (the reference gradients), elements whose gradient is at
    rounding level (|g| < 1e-7) only need to agree within two learning rates: Adam's first step normalises
    g into about ±lr whatever its size, so for those the summation order decides the sign."""
    for (name, p), q in zip(trainer.model.named_parameters(), ref.parameters()):
        p = p.detach().cpu()     # the trainer's model is on the GPU where there is one; the reference is not
        if grads is None:
            assert torch.allclose(p, q, rtol=0, atol=atol), name
            continue
        tiny = grads[name].abs() < 1e-7
        assert torch.allclose(p[~tiny], q[~tiny], rtol=0, atol=atol), name
        assert ((p[tiny] - q[tiny]).abs() <= 2 * LR).all(), name


@pytest.mark.parametrize("stage", [0, 1])
def test_streamed_update_equals_one_batch_and_the_torch_reference(stage):
    model = _model()
    executions = _executions(seed=4, n=10)
    kept = {f"e{i}" for i in range(10)} - {"e2", "e5"}
    ref, ref_norm = _reference(model, executions, kept)
    ref_grads = [p.grad.clone() for p in ref.parameters()]
    # where a gradient is at rounding level, another summation order (a GPU's) may flip Adam's first step
    grads = {name: g for (name, _), g in zip(ref.named_parameters(), ref_grads)}
    clip = ref_norm / 3                              # clipping active: 1/N must come before it
    torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
    torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.0, betas=(0.9, 0.99)).step()

    pre_clip: dict[int, float] = {}

    def trainer():
        t = Trainer(copy.deepcopy(model), lr=LR, zero_stage=stage, grad_clip=clip)
        if stage == 0:   # ZeRO 0 reports no norm: read the gradient DeepSpeed is about to clip
            clip_fn = t.engine.clip_fp32_gradients

            def spy():
                pre_clip[id(t)] = math.sqrt(sum(p.grad.double().pow(2).sum().item() for p in t.model.parameters()))
                clip_fn()
            t.engine.clip_fp32_gradients = spy
        return t

    # (a) streamed, core + satellite on the same weights; the satellite hands its gradients over
    core, sat = trainer(), trainer()
    q = _stream(executions, [core, sat])
    assert q.dropped_stale == 1 and q.left_out(BURST) == {"e2": "stale: 2 > max_staleness 1",
                                                          "e5": "no trainable token"}
    n = q.trained_executions(BURST)
    assert n == len(kept) == 8
    hand_over(sat, core)
    assert all(g.abs().max() == 0 for g in sat.gradients().values())
    for (name, g), r in zip(core.gradients().items(), ref_grads):
        assert (g.cpu() / n - r).norm() <= 1e-5 * r.norm(), name     # Σ per-execution means ÷ N (float32 noise)
    norm_a = finish_step(core, n)
    _assert_same(core, ref, grads=grads)

    # (b) streamed, every micro-step on one trainer
    one = trainer()
    _stream(executions, [one])
    norm_b = finish_step(one, n)
    _assert_same(one, ref, grads=grads)

    # (c) the one-batch step of `_train_step`: normaliser N, the last chunk at the boundary
    batch = trainer()
    seqs = [s for ex_id, ss in executions if ex_id in kept for s in ss]
    chunks = micro_batches(seqs, 40)
    for k, chunk in enumerate(chunks):
        batch.micro_step(chunk, float(n), objective="ppo", clip_low=CLIP_LOW, clip_high=CLIP_HIGH,
                         last=k == len(chunks) - 1)
    for g, r in zip(batch.gradients().values(), ref_grads):   # read after the boundary's reduction
        assert (g.cpu() - r).norm() <= 1e-5 * r.norm()
    norm_c = batch.optimizer_step()
    _assert_same(batch, ref, grads=grads)
    # the norm the clipping saw: after ÷ N (the update itself hides the scale: clipping and Adam undo it)
    if stage == 0:
        norm_a, norm_b, norm_c = pre_clip[id(core)], pre_clip[id(one)], pre_clip[id(batch)]
    for norm in (norm_a, norm_b, norm_c):
        assert norm == pytest.approx(ref_norm, rel=1e-5)


def _updated_reference(seed: int):
    """The model, 10 executions (e2 stale, e5 untrainable), and the plain-torch reference after its update
    without clipping, with the gradients it took (by parameter name)."""
    model = _model()
    executions = _executions(seed=seed, n=10)
    ref, _ = _reference(model, executions, {f"e{i}" for i in range(10)} - {"e2", "e5"})
    grads = {n: p.grad.clone() for n, p in ref.named_parameters()}
    torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e9)
    torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.0, betas=(0.9, 0.99)).step()
    return model, executions, ref, grads


def test_packed_streaming_with_a_late_satellite_and_a_lost_one():
    """Tree-packed micro-steps; a satellite that joins after the core's first micro-step; another that dies
    holding one, which the core retrains from the front of the queue."""
    model, executions, ref, grads = _updated_reference(seed=9)
    core, sat, doomed = (Trainer(copy.deepcopy(model), lr=LR, zero_stage=1, grad_clip=1e9) for _ in range(3))
    q = MicroStepQueue(micro_step_executions=2, max_staleness=1)
    for ex_id, seqs in executions:
        q.add_sequences(ex_id, BURST, seqs)
    q.close_burst(BURST)
    kw = dict(max_tokens=64, packed=True, objective="ppo", clip_low=CLIP_LOW, clip_high=CLIP_HIGH)
    first = q.claim(0, BURST)
    train_micro_step(core, first, **kw)
    q.complete(first.id, 0)
    lost = q.claim(2, BURST)
    train_micro_step(doomed, lost, **kw)           # computed, never handed over: the cell dies
    assert q.reclaim(2) == [lost]
    order = []
    for cell, tr in ((1, sat), (0, core), (1, sat)):
        ms = q.claim(cell, BURST)
        order.append(ms.id)
        train_micro_step(tr, ms, **kw)
        q.complete(ms.id, cell)
    assert order[0] == lost.id and q.burst_done(BURST)
    hand_over(sat, core)
    finish_step(core, q.trained_executions(BURST))
    _assert_same(core, ref, grads=grads)


def test_what_cannot_be_streamed_exactly_is_refused():
    model = _model()
    seqs = [s for _, ss in _executions(seed=1, n=3) for s in ss]
    closed = Trainer(copy.deepcopy(model), lr=LR, zero_stage=1)
    closed.micro_step(seqs, 1.0, last=True)                # reduced at the boundary already
    with pytest.raises(RuntimeError, match="finish_accumulation"):
        closed.add_gradients(closed.gradients())
    with pytest.raises(RuntimeError, match="last=True"):
        closed.finish_accumulation(0.5)
    stage2 = Trainer(copy.deepcopy(model), lr=LR, zero_stage=2)
    stage2.micro_step(seqs, 1.0, last=False)               # ZeRO 2 moved it out of param.grad already
    with pytest.raises(NotImplementedError, match="stage 0 or 1"):
        stage2.gradients()


def test_the_kl_guard_redoes_the_streamed_update_at_the_step_loops_rate(tmp_path):
    """`rl.max_kl` on the elastic core: an update that moved the policy too far is undone from the step's
    checkpoint and redone from the same gradient at half the rate; the kept update equals a plain streamed
    update at that rate (what the step loop's backtracking makes), and its KL — against the weights the step
    trained from, here also the behaviour policy — is the one reported."""
    model = _model()
    executions = _executions(seed=4, n=10)
    with torch.no_grad():       # on-policy behaviour log-probs: the KL then measures the update alone
        for _, seqs in executions:
            for sq in seqs:
                lp = torch.log_softmax(model(input_ids=torch.tensor([sq.input_ids])).logits[0], dim=-1)
                sq.old_logprobs = [lp[j - 1, t].item() if w else 0.0
                                   for j, (t, w) in enumerate(zip(sq.input_ids, sq.weights))]
    probe = [s for _, ss in executions[::4] for s in ss]

    def streamed(lr):
        t = Trainer(copy.deepcopy(model), lr=lr, zero_stage=1, grad_clip=1e9)
        q = _stream(executions, [t])
        return t, q.trained_executions(BURST)

    def guarded(max_kl, backtracks=3):
        t, n = streamed(LR)
        t.save(str(tmp_path), "step", {})      # the step's checkpoint, loaded back into the same trainer
        stats = finish_step_within_kl(t, n, probe, max_kl=max_kl, backtracks=backtracks, lr=LR,
                                      restore=lambda: t.load(str(tmp_path), "step"), max_tokens=40,
                                      clip_low=CLIP_LOW, clip_high=CLIP_HIGH)
        return t, stats

    def kl_of(t):
        shift = [t.policy_shift([s], clip_low=CLIP_LOW, clip_high=CLIP_HIGH) for s in probe]
        return sum(x["kl"] for x in shift) / sum(x["tokens"] for x in shift)

    plain = {}
    for b in range(4):                 # the plain streamed update at lr, lr/2, lr/4, lr/8, and its KL
        t, n = streamed(LR * 0.5 ** b)
        finish_step(t, n)
        plain[b] = (t, kl_of(t))
    assert plain[0][1] > plain[1][1] > plain[2][1] > plain[3][1] > 0      # a smaller step moves the policy less

    t, stats = guarded(max_kl=1.0)                                        # within the bound: kept at once
    assert stats["kl_backtracks"] == 0 and stats["lr"] == LR
    assert stats["kl"] == pytest.approx(plain[0][1], rel=1e-4)
    _assert_same(t, plain[0][0].model, atol=1e-6)

    bound = (plain[1][1] + plain[2][1]) / 2                               # met at lr/4: two halvings
    t, stats = guarded(max_kl=bound)
    assert stats["kl_backtracks"] == 2 and stats["lr"] == LR / 4 and stats["kl"] <= bound
    assert stats["kl"] == pytest.approx(plain[2][1], rel=1e-4)
    _assert_same(t, plain[2][0].model, atol=1e-6)
    assert all(g["lr"] == LR for g in t.optimizer.param_groups)         # the configured rate again

    t, stats = guarded(max_kl=1e-30, backtracks=3)                        # never met: the last try is kept
    assert stats["kl_backtracks"] == 3 and stats["kl"] > 1e-30
    _assert_same(t, plain[3][0].model, atol=1e-6)


def test_share_out_balances_padded_tokens_longest_first():
    from gyre_core.trainer.replicas import share_out

    # by hand, longest first to the least loaded: 9 → d0; 7 → d1; 5 → d2; 4 → d2 (loads 9, 7, 9);
    # 3 → d1 (9, 10, 9); 1 → d0 (a tie with d2 goes to the lower device)
    assert share_out([4, 9, 1, 7, 3, 5], 3) == [[1, 2], [3, 4], [0, 5]]
    assert share_out([2, 2], 3) == [[0], [1], []]          # fewer chunks than devices: the last idles
    assert share_out([], 2) == [[], []]


@pytest.mark.parametrize("packed,parallel", [(False, False), (True, True)])
def test_a_cell_trains_over_several_devices_as_on_one(packed, parallel):
    """A cell's trainer with two gradient replicas (`DeviceReplicas`; CPU stands in for its other GPUs):
    each micro-step's chunks are shared out over the three devices, and the streamed update equals the
    plain-torch reference. After the update the replicas take the new weights: the next burst's gradient
    equals a one-device trainer's at those weights."""
    from gyre_core.trainer.replicas import DeviceReplicas

    model, executions, ref, grads = _updated_reference(seed=4)
    kept = {f"e{i}" for i in range(10)} - {"e2", "e5"}

    core = Trainer(copy.deepcopy(model), lr=LR, zero_stage=1, grad_clip=1e9)
    replicas = DeviceReplicas(core, ["cpu", "cpu"], parallel=parallel)
    deterministic = torch.are_deterministic_algorithms_enabled()
    hooked = sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in core.model.modules())
    assert hooked > 0     # DeepSpeed's engine hooks the trainer's model; its plain copies carry none of them
    assert all(not m._forward_pre_hooks and not m._forward_hooks for c in replicas.copies for m in c.modules())
    kw = dict(max_tokens=24, packed=packed, objective="ppo", clip_low=CLIP_LOW, clip_high=CLIP_HIGH)

    def burst(trainer, reps, version):
        q = MicroStepQueue(micro_step_executions=4, max_staleness=1)
        q.open_burst(BURST, len(executions))
        for ex_id, seqs in executions:
            q.add_sequences(ex_id, BURST, seqs)
        tokens = 0.0
        while (ms := q.claim(0, BURST)) is not None:
            if reps is not None:
                reps.follow(version)
            tokens += train_micro_step(trainer, ms, replicas=reps, **kw)["tokens"]
            q.complete(ms.id, 0)
        return q.trained_executions(BURST), tokens

    n, tokens = burst(core, replicas, version=0)
    assert all(k > 0 for k in replicas.chunks_by_device), replicas.chunks_by_device   # every device trained some
    assert tokens == sum(w != 0.0 for ex, ss in executions if ex in kept for s in ss for w in s.weights)
    assert all(p.grad is None for m in replicas.copies for p in m.parameters())   # handed to the core
    for (name, g), r in zip(core.gradients().items(), grads.values()):
        assert (g / n - r).norm() <= 1e-5 * r.norm(), name
    finish_step(core, n)
    _assert_same(core, ref, grads=grads)

    # the next burst, at the updated weights: the replicas follow version 1
    one = Trainer(copy.deepcopy(core.model), lr=LR, zero_stage=1, grad_clip=1e9)
    burst(core, replicas, version=1)
    burst(one, None, version=1)
    for (name, g), r in zip(core.gradients().items(), one.gradients().values()):
        assert (g - r).norm() <= 1e-5 * r.norm(), name
    # the deterministic-kernel scope, entered from several threads at once, gave the process its own back
    assert torch.are_deterministic_algorithms_enabled() == deterministic
    replicas.close()


def test_a_real_cell_with_several_devices_publishes_the_one_device_update(tmp_path, monkeypatch):
    """`RealDevice` (a real cell's backend) on a host where it sees other devices besides its model's:
    its trainer builds replicas over them, says so in its label, and the version it publishes after a
    burst equals that of a cell that trains on one device (CPU stands in for the other GPUs)."""
    from gyre_core.elastic import devices
    from gyre_core.model import build_tiny_model, save_policy, train_tokenizer
    from gyre_core.trainer.publish import load_weights, version_uri

    tok = train_tokenizer(["forward left right stop " * 20], 300)
    save_policy(build_tiny_model(tok, 32, 2, 4, 2, 48, 64, seed=3), tok, tmp_path / "policy")
    train = dict(lr=LR, zero_stage=1, grad_clip=1e9, micro_batch_tokens=24, packed=True, temperature=1.0,
                 clip_low=CLIP_LOW, clip_high=CLIP_HIGH, is_cap=2.0, negative_scale=1.0)
    executions = _executions(seed=6, n=8)

    def cell(name, others):
        monkeypatch.setattr(devices, "other_devices", lambda device: others)
        dev = devices.RealDevice(0, str(tmp_path / "policy"), str(tmp_path / name), train, seed=0)
        dev.cell_is_core = True
        q = MicroStepQueue(micro_step_executions=4, max_staleness=1)
        for ex_id, seqs in executions:
            q.add_sequences(ex_id, 0, seqs)
        q.close_burst(0)
        while (ms := q.claim(0, 0)) is not None:
            dev.micro(ms)
            q.complete(ms.id, 0)
        dev.optim(0, q.trained_executions(0))
        return dev, load_weights(version_uri(str(tmp_path / name), 1))

    wide, w_wide = cell("wide", ["cpu"])
    one, w_one = cell("one", [])
    n = torch.get_num_threads()       # a CPU cell of devices_per_cell > 1 keeps one device and says so
    assert wide.label == "real/cpu (trains data-parallel on 2 GPUs)"
    assert one.label == ("real/cpu" if n == 1 else f"real/cpu (one device, {n} threads)")
    assert wide.replicas.chunks_by_device[1] > 0 and one.replicas is None
    start = load_weights(str(tmp_path / "policy" / "model.safetensors"))   # tied: no lm_head.weight there
    moved = max((w_one[k] - start[k]).abs().max() for k in start)
    assert moved > LR / 2                          # the update did something
    for k in w_one:
        assert torch.allclose(w_wide[k], w_one[k], rtol=0, atol=1e-6), k
