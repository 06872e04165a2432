"""One training path: a step's executions processed whole (the step loop) and task by task as each group
completes (the elastic phase) give the same sequences, weights and normaliser, and the same update — trees,
loop pruning, J_max role-priority sampling, dedup by multiplicity, tree credit and tree packing included.
The in-memory dedup the elastic phase runs agrees with the lake's DuckDB dedup the step loop runs.

    .venv/bin/python -m pytest -q tests/core/test_step_batch.py
"""
import copy
import random

import pytest
import torch

from gyre_core.config import HarnessConfig, load_config
from gyre_core.elastic.stream import MicroStepQueue, finish_step, hand_over, train_micro_step
from gyre_core.envs.scripted import ScriptedEnv
from gyre_core.harness.conversation import ChatFormat
from gyre_core.harness.loop import ExecutionSpec, fork_tree, run_executions
from gyre_core.harness.policies import ExpertPolicy
from gyre_core.model import IM_END, train_tokenizer
from gyre_core.processor.batch import assign_reward
from gyre_core.processor.step_batch import duplicates, group_items, records_batch
from gyre_core.trainer.packing import pack_branches
from gyre_core.trainer.trainer import Trainer

TASKS, G, SEED, LR = 3, 8, 11, 1e-3


@pytest.fixture(scope="module")
def step():
    """One step of real harness records: 3 tasks × 8 executions as fork trees (k 2, depth 2) of an expert that
    errs half the time, on a corridor with a context small enough to compact; plus two planted duplicates
    (an execution copied under another id, as a deterministic policy makes them)."""
    env = ScriptedEnv(length=5)
    tok = train_tokenizer(list(env.corpus(20, 0)) + [env.instructions()], vocab_size=300)
    stop = tok.convert_tokens_to_ids(IM_END)

    class Erring(ExpertPolicy):
        rng = random.Random(3)

        def choose(self, e):
            return self.rng.choice(["forward", "back", "wait"]) if self.rng.random() < 0.5 else super().choose(e)

    rng = random.Random(0)
    specs = []
    for b in range(TASKS):
        group = [ExecutionSpec("r", 0, f"r/t{b}/g{g}", f"task{b}", 100 + b, "train") for g in range(G)]
        fork_tree(group, 2, 2, (1, 3), rng)
        specs += group
    recs = run_executions(specs, Erring(tok, stop), HarnessConfig(max_turns=14, context_tokens=260),
                          lambda: ScriptedEnv(length=5), ChatFormat(tok), {stop: IM_END}, concurrency=64)
    parents = {r.fork_of for r in recs}
    for src in [r for r in recs if r.execution_id not in parents and r.status != "failed"][:2]:
        twin = copy.deepcopy(src)
        twin.execution_id = src.execution_id + "-twin"
        for c in twin.calls:
            c.execution_id = twin.execution_id
        recs.append(twin)
    for r in recs:
        assign_reward(r, 0.1)
    return tok, recs


def _cfg(**extra):
    over = {"processor.j_max": 2, "processor.credit": "tree", "processor.prune_repeats": 2, **extra}
    return load_config("smoke", [f"{k}={v}" for k, v in over.items()])


def _whole(cfg, recs):
    """The step loop's path: the step's executions processed at once."""
    return records_batch(recs, cfg, SEED)[0]


def _by_group(cfg, recs):
    """The elastic path: each task's group on its own, in the order its executions finished (shuffled)."""
    groups: dict[str, list] = {}
    for r in random.Random(5).sample(recs, len(recs)):
        groups.setdefault(r.task_id, []).append(r)
    return [it for g in groups.values() for it in group_items(g, cfg, SEED)]


def _key(sq):
    return (sq.execution_id, sq.call_index, tuple(sq.input_ids), tuple(sq.weights), tuple(sq.advantages),
            tuple(sq.old_logprobs), tuple(sq.versions))


def test_the_in_memory_dedup_is_the_lakes(step, tmp_path):
    from gyre_core.lake import Lake, connect
    from gyre_core.lake.dedup import dedup_groups
    from gyre_core.lake.schema import calls_table, executions_table

    _, recs = step
    Lake(str(tmp_path)).write_part("r", "step=0", {"executions": executions_table(recs), "calls": calls_table(recs)})
    con = connect(str(tmp_path), run_id="r")
    lake = {m: g["execution_id"] for g in dedup_groups(con, 0).to_pylist() for m in g["members"]}
    mine = duplicates(recs)
    assert mine == lake
    collapsed = {i: k for i, k in mine.items() if i != k}
    assert len(collapsed) >= 2 and all(i.endswith("-twin") or k.endswith("-twin") for i, k in collapsed.items())


@pytest.mark.parametrize("mode", ["tree", "flat"])
def test_processing_task_by_task_gives_the_step_loops_sequences(step, mode):
    _, recs = step
    cfg = _cfg(**{"processor.mode": mode})
    whole = _whole(cfg, recs)
    items = _by_group(cfg, recs)
    assert sorted(map(_key, whole.sequences)) == sorted(_key(sq) for _, seqs, _, _, _ in items if seqs for sq in seqs)
    assert sum(count for _, _, _, count, _ in items) == whole.n_executions
    for i, seqs, versions, count, why in items:
        assert (seqs is None) == (count == 0) == bool(why), (i, why)
        if seqs:
            assert sum(w for sq in seqs for w in sq.weights) == pytest.approx(count)    # weights sum to the multiplicity
            assert versions == [v for sq in seqs for v, w in zip(sq.versions, sq.weights) if w]
    assert {why for *_, why in items if why.startswith("identical to")}      # duplicates collapsed
    if mode == "tree":       # the features that make processing a step whole differ from flat ones took part
        assert whole.tokens_unique < whole.tokens_flat                        # shared prefixes
        assert any("j_max" in c.reason for c in whole.candidates)             # J_max cut some leaves
        assert any(c.role == "main-summary" for c in whole.candidates if c.selected)   # compaction's contexts
        assert len({a for sq in whole.sequences for a, w in zip(sq.advantages, sq.weights) if w}) > TASKS * 2  # tree credit


def _model(vocab: int):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=vocab, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, pad_token_id=0)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return Qwen2ForCausalLM(cfg).eval()


def test_the_streamed_update_equals_the_step_loops(step):
    """The step loop's update (tree-packed chunks of the whole batch ÷ its normaliser) against the elastic
    phase's (each group's items through the micro-step queue, packed, on a core and a satellite, ÷ the
    counts)."""
    tok, recs = step
    cfg = _cfg()
    model = _model(len(tok))
    kw = dict(objective="ppo", clip_low=0.2, clip_high=0.28)

    whole = _whole(cfg, recs)
    loop = Trainer(copy.deepcopy(model), lr=LR, zero_stage=1, grad_clip=1e9)
    chunks = pack_branches(whole.sequences, max_tokens=512)
    assert len(chunks) > 1
    for k, chunk in enumerate(chunks):
        loop.micro_step([chunk], whole.normaliser, last=k == len(chunks) - 1, **kw)
    grads = {n: g.clone().cpu() for n, g in loop.gradients().items()}
    loop.optimizer_step()

    q = MicroStepQueue(micro_step_executions=5, max_staleness=1)     # (the scripted policy is version −1)
    items = _by_group(cfg, recs)
    q.open_burst(0, len(items))
    for i, seqs, versions, count, why in items:
        if seqs:
            q.add(i, 0, seqs, versions, count=count)
        else:
            q.discard(i, 0, why)
    core, sat = (Trainer(copy.deepcopy(model), lr=LR, zero_stage=1, grad_clip=1e9) for _ in range(2))
    k = 0
    while (ms := q.claim(k % 2, 0)) is not None:
        train_micro_step((core, sat)[k % 2], ms, max_tokens=512, packed=True, **kw)
        assert q.complete(ms.id, k % 2)
        k += 1
    assert k > 2 and q.burst_done(0) and q.trained_executions(0) == whole.n_executions
    hand_over(sat, core)
    finish_step(core, q.trained_executions(0))

    compared = 0
    for (name, p), (_, r) in zip(core.model.named_parameters(), loop.model.named_parameters()):
        g = grads[name]
        sure = g.abs() >= 1e-7 * whole.normaliser     # where the gradient is at rounding level, Adam's first step
        assert torch.allclose(p.detach()[sure], r.detach()[sure], rtol=0, atol=1e-6), name   # may flip its sign
        assert ((p.detach() - r.detach()).abs() <= 2 * LR + 1e-7).all(), name
        compared += int(sure.sum())
    assert compared > 1000


@pytest.mark.fault("a poisoned trajectory reaches the processor", "an execution with a NaN or impossible log-prob "
                   "or a token id outside the vocabulary is excluded with its reason; the update stays finite")
@pytest.mark.parametrize("mode", ["tree", "flat"])
def test_poisoned_records_are_excluded_with_their_reason_and_the_update_stays_finite(step, mode):
    from gyre_core.processor.step_batch import training_batch

    tok, recs = step
    cfg = _cfg(**{"processor.mode": mode})
    vocab = len(tok)
    _, adv, mult, _ = records_batch(recs, cfg, SEED)
    parents = {r.fork_of for r in recs}
    twins = {r.execution_id.removesuffix("-twin") for r in recs if r.execution_id.endswith("-twin")}
    plain = [r for r in recs if mult.get(r.execution_id, 0) == 1 and r.execution_id not in parents | twins
             and len(r.calls) > (r.fork_call or 0) + 1]       # its last call its own, not one shared with a fork
    assert len(plain) >= 3
    poisoned = copy.deepcopy(recs)
    by_id = {r.execution_id: r for r in poisoned}
    nan, high, far = (by_id[r.execution_id] for r in plain[:3])
    nan.calls[-1].logprobs[0] = float("nan")
    high.calls[-1].logprobs[-1] = 0.5                            # a probability above 1
    far.calls[-1].completion_ids[0] = vocab + 7                  # what no embedding row holds
    rewards = {r.execution_id: r.reward for r in recs}
    kept_mult = {i: m for i, m in mult.items() if m > 0}
    batch = training_batch([r for r in poisoned if r.execution_id in kept_mult], adv, rewards, kept_mult, cfg, SEED,
                           vocab_size=vocab)
    assert {i: batch.excluded[i] for i in (nan.execution_id, high.execution_id, far.execution_id)} == {
        nan.execution_id: f"poisoned record: call {len(nan.calls) - 1} has a non-finite behaviour log-prob",
        high.execution_id: f"poisoned record: call {len(high.calls) - 1} has a log-prob above 0 (0.5)",
        far.execution_id: f"poisoned record: call {len(far.calls) - 1} has token id {vocab + 7}, outside the "
                          f"vocabulary [0, {vocab})"}
    # the rest trains exactly as it would without the three
    clean = training_batch([r for r in recs if r.execution_id in kept_mult and r.execution_id not in
                            {nan.execution_id, high.execution_id, far.execution_id}], adv, rewards, kept_mult, cfg,
                           SEED, vocab_size=vocab)
    assert sorted(map(_key, batch.sequences)) == sorted(map(_key, clean.sequences))
    assert not any(sq.execution_id in batch.excluded for sq in batch.sequences)
    trainer = Trainer(_model(vocab), lr=LR, zero_stage=1, grad_clip=1e9)
    trainer.micro_step(batch.sequences if mode == "flat" else pack_branches(batch.sequences, max_tokens=100_000),
                       batch.normaliser, last=True, objective="ppo", clip_low=0.2, clip_high=0.28)
    assert all(torch.isfinite(g).all() for g in trainer.gradients().values())
