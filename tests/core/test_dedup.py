"""Dedup of identical executions: the DuckDB query, weighted advantages, and a training update that is
exactly that of the batch with every duplicate present.

    .venv/bin/python -m pytest tests/core/test_dedup.py -q -p no:cacheprovider
"""
from __future__ import annotations

import copy
import math
import random
from collections import defaultdict

import pytest
import torch

from gyre_core.lake import Lake, calls_table, connect, executions_table
from gyre_core.lake.dedup import dedup_executions, dedup_groups
from gyre_core.processor.batch import build_batch, group_advantages
from gyre_core.processor.credit import CreditConfig
from gyre_core.processor.sampling import SamplingConfig, tree_batch
from gyre_core.records import CallRecord, ExecutionRecord


def _rec(eid, task="task-a", *, run="run1", step=3, obs=4, tail=(13, 14), lp=-0.125, ver=1, reward=1.0,
         status="done", fork_of="", fork_call=0, extra_calls=()):
    """Two append-only calls: [1, 2, 3] -> [10, 11, 12]; then + [obs, 5] -> tail (log-prob `lp` first).
    Log-probs are float32-representable, so what the lake stores equals what is written."""
    c0 = CallRecord(eid, 0, 0, "main", [1, 2, 3], [10, 11, 12], [-0.5, -0.25, -1.5], [0, 0, ver])
    c1 = CallRecord(eid, 1, 0, "main", [1, 2, 3, 10, 11, 12, obs, 5], list(tail), [lp, -0.75][:len(tail)],
                    [ver] * len(tail), parent_call=0, prefix_len=6)
    calls = [c0, c1] + [copy.deepcopy(c) for c in extra_calls]
    for c in calls:
        c.execution_id = eid
    return ExecutionRecord(run, step, eid, task, 11, "train", "grid", status=status, reward=reward,
                           success=reward == 1.0, partial=reward, turns=len(calls), policy_version=0,
                           fork_of=fork_of, fork_call=fork_call, calls=calls)


def _fork(eid, parent, tail, **kw):
    """A continuation of `parent` forked after its 2 calls: one more call in the same context."""
    last = parent.calls[1]
    prompt = last.prompt_ids + last.completion_ids + [6]
    c2 = CallRecord(eid, 2, 0, "main", prompt, list(tail), [-0.25] * len(tail), [1] * len(tail),
                    parent_call=1, prefix_len=len(prompt) - 1)
    return _rec(eid, parent.task_id, fork_of=parent.execution_id, fork_call=2, extra_calls=[c2],
                reward=kw.pop("reward", parent.reward), **kw)


def _write(root, recs, run="run1", part="step=3"):
    Lake(root).write_part(run, part, {"executions": executions_table(recs), "calls": calls_table(recs)})


def _groups(root, step, run="run1"):
    con = connect(root, run_id=run)
    try:
        groups = {g["execution_id"]: g["members"] for g in dedup_groups(con, step).to_pylist()}
        kept = {r["execution_id"]: r["multiplicity"] for r in dedup_executions(con, step).to_pylist()}
    finally:
        con.close()
    # the keys alone and the join back agree on which executions are kept and for how many
    assert kept == {k: len(m) for k, m in groups.items()}
    return groups


# ----------------------------------------------------------------------------------------------
# the DuckDB query


def test_dedup_by_hand(tmp_path):
    root = str(tmp_path / "lake")
    p = _rec("p1")
    recs = [
        _rec("a1"), _rec("a2"), _rec("a3"),        # identical: one set of 3
        _rec("a4", tail=(13, 15)),                 # one completion token differs
        _rec("a5", ver=2),                         # same tokens, other policy versions
        _rec("a6", reward=0.5),                    # same tokens, other reward
        _rec("a7", lp=-0.0625),                    # same tokens, other behaviour log-prob
        _rec("a8", obs=7),                         # an injected (observation) token differs
        _rec("a9", status="timeout"),              # same tokens, other status
        _rec("b1", "task-b"), _rec("b2", "task-b"),   # a1's content in another task: a set of its own
        p, _rec("p2"),                             # p1 was forked from: never collapsed (p2 is a1's twin)
        _fork("q1", p, (30, 31)), _fork("q2", p, (30, 31)), _fork("q3", p, (30, 32)),
        _rec("x1", status="failed", reward=0.0), _rec("x2", status="failed", reward=0.0),
    ]
    _write(root, recs)
    _write(root, [_rec("a0", step=4), _rec("a1", step=4)], part="step=4")   # another step: not mixed in
    assert _groups(root, 3) == {
        "a1": ["a1", "a2", "a3", "p2"], "a4": ["a4"], "a5": ["a5"], "a6": ["a6"], "a7": ["a7"],
        "a8": ["a8"], "a9": ["a9"], "b1": ["b1", "b2"], "p1": ["p1"], "q1": ["q1", "q2"], "q3": ["q3"],
        "x1": ["x1", "x2"]}
    assert _groups(root, 4) == {"a0": ["a0", "a1"]}


def test_a_fork_parent_is_never_collapsed_even_into_a_smaller_id(tmp_path):
    root = str(tmp_path / "lake")
    parent = _rec("z9")
    # a0 has z9's content and the smaller id: merging them would drop z9, whose calls the forks share
    _write(root, [_rec("a0"), parent, _fork("f1", parent, (30,)), _fork("f2", parent, (30,))])
    assert _groups(root, 3) == {"a0": ["a0"], "z9": ["z9"], "f1": ["f1", "f2"]}


def test_no_duplicates_keeps_every_row_with_multiplicity_one(tmp_path):
    root = str(tmp_path / "lake")
    recs = [_rec("e1"), _rec("e2", tail=(13, 16)), _rec("e3", "task-b", tail=(20,)), _rec("e4", obs=9)]
    _write(root, recs)
    con = connect(root, run_id="run1")
    kept = dedup_executions(con, 3)
    con.close()
    assert kept.column("execution_id").to_pylist() == ["e1", "e2", "e3", "e4"]
    assert kept.column("multiplicity").to_pylist() == [1, 1, 1, 1]
    # every `executions` column comes back unchanged, plus the multiplicity
    assert kept.drop(["multiplicity"]).to_pylist() == Lake(root).read("executions", "run1").to_pylist()


def _random_content(rng: random.Random) -> list[tuple]:
    """1-3 append-only calls in context 0, then maybe a compaction context: (context, role, new prompt
    tokens, completion, log-probs, versions) per call. Small alphabets, so chance collisions happen too."""
    calls = []
    for i in range(rng.randint(1, 3)):
        comp = [rng.randint(10, 12) for _ in range(rng.randint(1, 3))]
        new = [1, 2] + [rng.randint(3, 5) for _ in range(rng.randint(1, 3))] if i == 0 else [rng.randint(3, 5), 6]
        calls.append((0, "main", new, comp, [rng.choice([-0.5, -0.25]) for _ in comp], [1] * len(comp)))
    if rng.random() < 0.3:
        calls.append((1, "main-summary", [1, 9], [rng.randint(10, 12)], [-1.0], [1]))
    return calls


def _mutate(calls: list[tuple], rng: random.Random) -> list[tuple]:
    """One change: a completion token, a log-prob or a version of one call."""
    calls = [list(c) for c in calls]
    k, field = rng.randrange(len(calls)), rng.choice([3, 4, 5])
    vals = list(calls[k][field])
    j = rng.randrange(len(vals))
    vals[j] = {3: rng.choice([x for x in (10, 11, 12) if x != vals[j]]), 4: vals[j] * 2, 5: vals[j] + 1}[field]
    calls[k][field] = vals
    return [tuple(c) for c in calls]


def _record(eid, task, step, content, reward, status="done", fork_of="", fork_call=0):
    """Prompts built from the content: a call extends the previous call of its context, if any."""
    calls, last = [], {}
    for i, (ctx, role, new, comp, lp, ver) in enumerate(content):
        parent = last.get(ctx, -1)
        head = calls[parent].prompt_ids + calls[parent].completion_ids if parent >= 0 else []
        calls.append(CallRecord(eid, i, ctx, role, head + list(new), list(comp), list(lp), list(ver),
                                parent_call=parent, prefix_len=len(head)))
        last[ctx] = i
    return ExecutionRecord("run1", step, eid, task, 0, "train", "grid", status=status, reward=reward,
                           fork_of=fork_of, fork_call=fork_call, calls=calls)


def _random_records(seed: int, step: int) -> list[ExecutionRecord]:
    """Tasks whose executions copy a few templates (planted duplicates), mutated copies, and forks."""
    rng = random.Random(seed)
    recs = []
    for t in range(5):
        task = f"t{t}"
        templates = [(_random_content(rng), rng.choice([0.0, 0.5, 1.0])) for _ in range(3)]
        made = []
        for g in range(rng.randint(5, 12)):
            content, reward = rng.choice(templates)
            if rng.random() < 0.25:
                content = _mutate(content, rng)
            if rng.random() < 0.1:
                reward = 0.25
            status = "failed" if rng.random() < 0.05 else "done"
            made.append((_record(f"s{step}/{task}/g{g:02d}", task, step, content, reward, status), content))
        # forks: continuations after an execution's first call, several with the same tail
        parent, pcontent = rng.choice(made)
        tails = [[rng.randint(10, 11)] for _ in range(2)]
        for f in range(rng.randint(1, 4)):
            tail = rng.choice(tails)
            content = pcontent[:1] + [(0, "main", [7], tail, [-0.5] * len(tail), [1] * len(tail))]
            made.append((_record(f"s{step}/{task}/f{f}", task, step, content, parent.reward,
                                 fork_of=parent.execution_id, fork_call=1), content))
        recs += [r for r, _ in made]
    return recs


def _reference_dedup(recs: list[ExecutionRecord]) -> dict[str, list[str]]:
    """Pure Python: group by every call's full token lists, log-probs and versions (the fork's shared
    calls included), fork point, status, reward and task; a fork parent stays alone."""
    parents = {(r.run_id, r.step, r.fork_of) for r in recs if r.fork_call > 0}
    sets: dict[tuple, list[str]] = defaultdict(list)
    for r in recs:
        calls = tuple((c.call_index, c.context_index, c.role, c.parent_call, c.prefix_len, tuple(c.prompt_ids),
                       tuple(c.completion_ids), tuple(c.logprobs), tuple(c.versions)) for c in r.calls)
        alone = r.execution_id if (r.run_id, r.step, r.execution_id) in parents else None
        sets[(r.run_id, r.step, r.task_id, calls, r.fork_of, r.fork_call, r.status, r.reward, alone)].append(
            r.execution_id)
    return {min(ids): sorted(ids) for ids in sets.values()}


def test_duckdb_dedup_matches_a_pure_python_reference_on_a_random_lake(tmp_path):
    root = str(tmp_path / "lake")
    by_step = {}
    for step in (0, 1, 2):
        recs = _random_records(100 + step, step)
        _write(root, recs, part=f"step={step}")
        by_step[step] = recs
    for step, recs in by_step.items():
        ref = _reference_dedup(recs)
        assert _groups(root, step) == ref
        # not a trivial lake: many planted duplicates, some mutated copies kept apart, forks merged
        assert sum(len(m) - 1 for m in ref.values()) >= 10
        assert len(ref) >= 10
        assert any(len(m) > 1 and "/f" in m[0] for m in ref.values())


# ----------------------------------------------------------------------------------------------
# advantages


def test_weighted_group_advantages_by_hand():
    rewards = {"a": 1.0, "b": 0.0, "c": 0.5, "x": 0.2}
    groups = {"g": ["a", "b", "c"], "h": ["x"]}
    mult = {"a": 3, "c": 2, "x": 4}             # b: 1 (the default)
    # mean = (3·1 + 1·0 + 2·0.5) / 6 = 2/3
    adv = group_advantages(rewards, groups, "none", mult)
    assert adv == pytest.approx({"a": 1 / 3, "b": -2 / 3, "c": -1 / 6, "x": 0.0})
    # var = (3·(1/3)² + 1·(2/3)² + 2·(1/6)²) / 6 = (12 + 16 + 2) / 36 / 6 = 5/36
    std = math.sqrt(5) / 6
    adv_s = group_advantages(rewards, groups, "std", mult)
    assert adv_s == pytest.approx({"a": (1 / 3) / (std + 1e-6), "b": (-2 / 3) / (std + 1e-6),
                                   "c": (-1 / 6) / (std + 1e-6), "x": 0.0})
    # the same as the group with every duplicate written out
    full = {"a": 1.0, "a'": 1.0, "a''": 1.0, "b": 0.0, "c": 0.5, "c'": 0.5}
    ref = group_advantages(full, {"g": list(full)}, "std")
    assert {k: adv_s[k] for k in "abc"} == pytest.approx({k: ref[k] for k in "abc"})
    # no multiplicity: the plain mean
    assert group_advantages(rewards, groups, "none") == pytest.approx({"a": 0.5, "b": -0.5, "c": 0.0, "x": 0.0})
    with pytest.raises(ValueError, match="≥ 1"):
        group_advantages(rewards, groups, "none", {"a": 0})


# ----------------------------------------------------------------------------------------------
# training: the deduplicated batch gives the full batch's update


def _train_records(seed: int) -> tuple[list[ExecutionRecord], dict[str, str]]:
    """Two tasks of executions with two contexts each; some are exact copies. Returns the records and
    each one's kept twin (the first of its copies)."""
    rng = random.Random(seed)
    recs, kept_as = [], {}
    for t in range(2):
        uniques = []
        for u in range(3):
            p0 = [1] + [rng.randint(3, 200) for _ in range(4)]
            c0 = [rng.randint(3, 200) for _ in range(3)]
            p1 = p0 + c0 + [rng.randint(3, 200) for _ in range(2)]
            c1 = [rng.randint(3, 200) for _ in range(2)]
            p2 = [2] + [rng.randint(3, 200) for _ in range(3)]
            c2 = [rng.randint(3, 200) for _ in range(2)]
            lp = [rng.uniform(-3.0, -0.3) for _ in range(7)]
            calls = [CallRecord("", 0, 0, "main", p0, c0, lp[:3], [0] * 3),
                     CallRecord("", 1, 0, "main", p1, c1, lp[3:5], [0] * 2, parent_call=0, prefix_len=len(p0) + 3),
                     CallRecord("", 2, 1, "main-summary", p2, c2, lp[5:], [0] * 2)]
            uniques.append((calls, rng.choice([0.0, 0.4, 1.0])))
        for g, u in enumerate([0, 0, 0, 1, 2, 2]):      # multiplicities 3, 1, 2
            calls, reward = uniques[u]
            eid = f"t{t}/g{g}"
            rec = ExecutionRecord("run1", 0, eid, f"t{t}", t, "train", "grid", reward=reward,
                                  calls=[CallRecord(eid, c.call_index, c.context_index, c.role, c.prompt_ids,
                                                    c.completion_ids, c.logprobs, c.versions,
                                                    parent_call=c.parent_call, prefix_len=c.prefix_len)
                                         for c in calls])
            recs.append(rec)
            kept_as[eid] = f"t{t}/g{[0, 0, 0, 3, 4, 4][g]}"
    return recs, kept_as


@pytest.fixture(scope="module")
def model():
    from gyre_core.model import build_tiny_model, train_tokenizer

    tok = train_tokenizer(["go left go right pick up the red ball"] * 20, vocab_size=280)
    return build_tiny_model(tok, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, ffn_size=64,
                            max_positions=64, seed=0)


def _loss_and_grads(model, batch):
    from gyre_core.trainer.trainer import Trainer

    trainer = Trainer(copy.deepcopy(model), lr=1e-3, zero_stage=1, grad_clip=1e9)
    st = trainer.micro_step(batch.sequences, batch.normaliser, objective="ppo", clip_low=0.2, clip_high=0.28,
                            last=False)
    return st["loss"], trainer.gradients()


def test_flat_dedup_batch_gives_exactly_the_full_batch_loss_and_gradient(model):
    recs, kept_as = _train_records(seed=7)
    rewards = {r.execution_id: r.reward for r in recs}
    groups = defaultdict(list)
    for r in recs:
        groups[r.task_id].append(r.execution_id)
    full_adv = group_advantages(rewards, groups, "std")
    full = build_batch(recs, full_adv)

    mult = {k: list(kept_as.values()).count(k) for k in set(kept_as.values())}
    assert sorted(mult.values()) == [1, 1, 2, 2, 3, 3]
    kept = [r for r in recs if r.execution_id in mult]
    kept_groups = {t: [i for i in ids if i in mult] for t, ids in groups.items()}
    adv = group_advantages({i: rewards[i] for i in mult}, kept_groups, "std", mult)
    assert adv == pytest.approx({i: full_adv[i] for i in mult}, abs=1e-12)
    dedup = build_batch(kept, adv, mult)
    assert (dedup.normaliser, dedup.n_executions) == (full.normaliser, full.n_executions) == (12.0, 12)
    assert len(dedup.sequences) == 2 * len(mult) < len(full.sequences) == 2 * len(recs)
    # a kept execution's weights sum to its multiplicity (each execution's sum to 1 in the full batch)
    sums = defaultdict(float)
    for s in dedup.sequences:
        sums[s.execution_id] += sum(s.weights)
    assert dict(sums) == pytest.approx({k: float(m) for k, m in mult.items()})

    loss_full, g_full = _loss_and_grads(model, full)
    loss_dedup, g_dedup = _loss_and_grads(model, dedup)
    assert loss_dedup == pytest.approx(loss_full, rel=1e-9)
    assert any(g.abs().sum() > 0 for g in g_full.values())
    for name, g in g_full.items():
        assert torch.allclose(g_dedup[name], g, rtol=1e-5, atol=1e-8), name
    # the multiplicity is what makes it exact: without it the update is another one
    loss_plain, _ = _loss_and_grads(model, build_batch(kept, adv))
    assert abs(loss_plain - loss_full) > 1e-4


def test_tree_dedup_batch_matches_the_full_batch_with_every_leaf_taken():
    """Tree mode, sampler taking every leaf: the kept execution's paths are its copies' paths, weights
    × multiplicity, with the same tree-credit advantages; the normaliser counts every execution."""
    recs, kept_as = _train_records(seed=11)
    rewards = {r.execution_id: r.reward for r in recs}
    groups = defaultdict(list)
    for r in recs:
        groups[r.task_id].append(r.execution_id)
    adv = group_advantages(rewards, groups, "none")
    mult = {k: list(kept_as.values()).count(k) for k in set(kept_as.values())}
    kept = [r for r in recs if r.execution_id in mult]
    cfg = dict(sampling=SamplingConfig(j_max=None), credit=CreditConfig("tree", shrink_k=1.0))
    full = tree_batch(recs, adv, rewards, **cfg)
    dedup = tree_batch(kept, {i: adv[i] for i in mult}, {i: rewards[i] for i in mult}, multiplicity=mult, **cfg)
    assert (dedup.normaliser, dedup.n_executions) == (full.normaliser, full.n_executions) == (12.0, 12)
    by_key = {(s.execution_id, s.call_index): s for s in full.sequences}
    assert len(dedup.sequences) == 2 * len(mult)
    for s in dedup.sequences:
        f = by_key[(s.execution_id, s.call_index)]
        assert s.input_ids == f.input_ids and s.old_logprobs == f.old_logprobs
        assert s.advantages == pytest.approx(f.advantages, abs=1e-12)   # tree credit counts the copies
        assert s.weights == pytest.approx([mult[s.execution_id] * w for w in f.weights])
    # tree credit really moved something here (the check above is not only the execution term)
    assert any(a != adv[s.execution_id] for s in dedup.sequences for a, w in zip(s.advantages, s.weights) if w)


# ----------------------------------------------------------------------------------------------
# the score and process steps on a tiny run (no model needed)


def _run(tmp_path, name, *overrides):
    from gyre_core.config import load_config
    from gyre_core.run import RunDir

    cfg = load_config("smoke", [f"run.out_root={tmp_path}/runs", f"lake.root={tmp_path}/lake", f"run.name={name}",
                                "rl.advantage_norm=none", *overrides])
    return RunDir.create(cfg)


def _step_records(run_id):
    return [_rec("a1", run=run_id, step=0), _rec("a2", run=run_id, step=0), _rec("a3", run=run_id, step=0),
            _rec("a4", run=run_id, step=0, tail=(15, 16), reward=0.0),
            _rec("b1", "task-b", run=run_id, step=0, reward=0.5), _rec("b2", "task-b", run=run_id, step=0, reward=0.5),
            _rec("b3", "task-b", run=run_id, step=0, tail=(17,), reward=0.0),
            _rec("b4", "task-b", run=run_id, step=0, status="failed", reward=0.0)]


@pytest.mark.parametrize("mode", ["flat", "tree"])
def test_score_and_process_steps_collapse_duplicates(tmp_path, mode):
    from gyre_core import phases

    out = {}
    for dedup in (True, False):
        run = _run(tmp_path, f"r-{mode}-{dedup}", f"processor.mode={mode}", f"processor.dedup={str(dedup).lower()}")
        _write(run.cfg.lake.root, _step_records(run.run_id), run=run.run_id, part="step=0")
        mark = phases.score(str(run.path), 0)
        rows = {r["execution_id"]: r for r in Lake(run.cfg.lake.root).read("scores", run.run_id).to_pylist()}
        path = phases.process(str(run.path), 0)
        out[dedup] = (mark, rows, run.done("process_0000"), torch.load(path, weights_only=False))

    mark, rows, pmark, batch = out[True]
    # task-a: (3·1 + 0)/4 = 0.75; task-b: (2·0.5 + 0)/3 = 1/3 (b4 failed: not in the group)
    expect = {"a1": (3, "a1", 0.25), "a2": (0, "a1", 0.25), "a3": (0, "a1", 0.25), "a4": (1, "a4", -0.75),
              "b1": (2, "b1", 1 / 6), "b2": (0, "b1", 1 / 6), "b3": (1, "b3", -1 / 3)}
    for eid, (m, into, a) in expect.items():
        r = rows[eid]
        assert (r["multiplicity"], r["kept_as"], r["excluded"]) == (m, into, False), eid
        assert r["advantage"] == pytest.approx(a), eid
    assert (rows["b4"]["multiplicity"], rows["b4"]["kept_as"], rows["b4"]["excluded"]) == (1, "b4", True)
    assert mark["collapsed"] == 3 and mark["excluded"] == 1
    assert (pmark["collapsed"], pmark["executions_unique"], pmark["executions"], pmark["excluded"]) == (3, 4, 7, 1)
    assert batch.normaliser == 7.0
    assert {s.execution_id for s in batch.sequences} == {"a1", "a4", "b1", "b3"}
    sums = defaultdict(float)
    for s in batch.sequences:
        sums[s.execution_id] += sum(s.weights)
    assert dict(sums) == pytest.approx({"a1": 3.0, "a4": 1.0, "b1": 2.0, "b3": 1.0})

    # dedup off: the same advantages and normaliser, every execution trained on its own
    mark0, rows0, pmark0, batch0 = out[False]
    assert mark0["collapsed"] == 0 and pmark0["collapsed"] == 0 and pmark0["executions_unique"] == 7
    assert all(r["multiplicity"] == 1 and r["kept_as"] == e for e, r in rows0.items())
    assert {e: r["advantage"] for e, r in rows0.items() if e != "b4"} == pytest.approx(
        {e: a for e, (_, _, a) in expect.items()})
    assert batch0.normaliser == 7.0
    # the per-step metrics carry the number collapsed (to MLflow and the summary)
    run = _run(tmp_path, f"r-{mode}-True", f"processor.mode={mode}", "processor.dedup=true")
    assert phases.rl_step.step_metrics(run, 0)["dedup/collapsed"] == 3
