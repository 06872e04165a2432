"""Bounded dedup sampling, credit and loop pruning: by hand, and against brute-force references."""
import json
from collections import Counter, defaultdict

import pytest

from gyre_core.processor.batch import build_batch, group_advantages
from gyre_core.processor.credit import CreditConfig, node_values, tree_credit
from gyre_core.processor.pruning import PruneConfig, find_cycle, prune_loops
from gyre_core.processor.sampling import SamplingConfig, batch_tables, candidates, select, tree_batch
from gyre_core.processor.synthetic import synthetic_executions
from gyre_core.processor.tree import build_tree
from gyre_core.records import CallRecord, ExecutionRecord


def _call(i, ctx, prompt, completion, parent=-1, prefix=0, role="main", lp=None):
    lp = lp if lp is not None else [-0.5] * len(completion)
    return CallRecord("x", i, ctx, role, list(prompt), list(completion), list(lp), [3] * len(completion),
                      "stop", parent, prefix)


def _exec(eid, calls, task="t", reward=0.0):
    r = ExecutionRecord("run", 0, eid, task, 1, "train", "env", calls=calls, reward=reward)
    for c in r.calls:
        c.execution_id = eid
    return r


def _scores(recs):
    rewards = {r.execution_id: r.reward for r in recs}
    groups = defaultdict(list)
    for r in recs:
        groups[r.task_id].append(r.execution_id)
    return rewards, group_advantages(rewards, groups, "none")


def _branching(seed=0, n=6):
    return synthetic_executions(n, 8000, turns=30, branching=(0.3, 3), compaction=2000, sub_agents=2,
                                group_size=3, group_fork=0.8, vocab=60, seed=seed)


# ----------------------------------------------------------------------------------------------
# grpo on chain-only executions == today's flat batch, number for number


@pytest.mark.parametrize("weighting", ["loss_once", "per_branch"])
def test_grpo_on_chains_reproduces_the_flat_batch_exactly(weighting):
    recs = synthetic_executions(6, 12000, turns=40, compaction=2500, sub_agents=2, group_size=3, seed=5)
    c0 = _call(0, 0, [1, 2, 3], [10, 11], lp=[-0.1, -0.2])     # test_processor_batch's hand example
    c1 = _call(1, 0, [1, 2, 3, 10, 11, 4, 5], [12], parent=0, prefix=5, lp=[-0.3])
    c2 = _call(2, 1, [1, 6], [13, 14], lp=[-0.4, -0.5])
    recs.append(_exec("hand", [c0, c1, c2], task="h", reward=1.0))
    recs[2].status, recs[2].error = "failed", "score: boom"
    rewards, adv = _scores(recs)
    del adv[recs[2].execution_id]
    flat = build_batch(recs, adv)
    tb = tree_batch(recs, adv, rewards, sampling=SamplingConfig(j_max=None, weighting=weighting))
    a = {(s.execution_id, s.call_index): s for s in flat.sequences}
    b = {(s.execution_id, s.call_index): s for s in tb.sequences}
    assert set(a) == set(b) and len(b) == len(tb.sequences)
    for k in a:
        assert a[k] == b[k]       # input_ids, score_from, old_logprobs, advantages, weights, versions
    assert (tb.normaliser, tb.n_executions) == (flat.normaliser, flat.n_executions) == (6.0, 6)
    assert tb.excluded == flat.excluded == {recs[2].execution_id: "score: boom"}


# ----------------------------------------------------------------------------------------------
# J_max, role priority, budget


def _roles_exec():
    sys_ = [1, 2]
    return _exec("e", [
        _call(0, 0, sys_ + [3], [10, 11, 12]),                                        # main, 3 generated
        _call(1, 1, sys_ + [4], [13, 14], role="main-summary"),
        _call(2, 2, sys_ + [5], [15, 16, 17, 18, 19, 20], role="sub-agent"),          # the most tokens
        _call(3, 3, sys_ + [6], [21], role="sub-agent-summary"),
    ], reward=1.0)


def test_role_priority_and_j_max():
    rec = _roles_exec()
    tree, _ = build_tree([rec])

    def roles(j_max, order=None):
        cfg = SamplingConfig(j_max=j_max, **({"role_order": order} if order else {}))
        cands = candidates([tree], [{}], None, cfg.role_order)
        select([tree], cands, cfg)
        return [c.role for c in sorted((c for c in cands[(0, 0)] if c.selected), key=lambda c: c.rank)]

    assert roles(1) == ["main"]
    assert roles(2) == ["main", "main-summary"]
    assert roles(None) == ["main", "main-summary", "sub-agent", "sub-agent-summary"]
    assert roles(2, ("sub-agent-summary", "sub-agent", "main-summary", "main")) == ["sub-agent-summary", "sub-agent"]
    # J_max on a branching workload: never more than J_max paths per execution
    recs = _branching()
    rewards, adv = _scores(recs)
    for j in (1, 2, 5):
        tb = tree_batch(recs, adv, rewards, sampling=SamplingConfig(j_max=j))
        per = Counter(s.execution_id for s in tb.sequences)
        assert max(per.values()) <= j and len(per) == len(recs)
        if j == 1:
            assert set(per.values()) == {1}
    unselected = [c for c in tb.candidates if not c.selected and c.reason.startswith("j_max = 5")]
    assert unselected and all(Counter(s.execution_id for s in tb.sequences)[c.execution_id] == 5 for c in unselected)


def test_draw_probability_is_proportional_to_uncovered_generated_tokens():
    # two main leaves sharing a first turn of 2 generated tokens; tails of 6 and 2 generated tokens
    rec = _exec("e", [
        _call(0, 0, [1, 2], [10, 11]),
        _call(1, 0, [1, 2, 10, 11, 3], [20, 21, 22, 23, 24, 25], parent=0, prefix=4),
        _call(2, 1, [1, 2, 10, 11, 4], [30, 31], parent=0, prefix=4),
    ])
    tree, _ = build_tree([rec])
    first = Counter()
    for seed in range(400):
        cfg = SamplingConfig(j_max=1, seed=seed)
        cands = candidates([tree], [{}], None, cfg.role_order)
        select([tree], cands, cfg)
        (c,) = [c for c in cands[(0, 0)] if c.selected]
        assert c.probability == pytest.approx(8 / 12 if c.call_index == 1 else 4 / 12)
        first[c.call_index] += 1
    assert abs(first[1] / 400 - 2 / 3) < 0.08
    # after the first path, the other leaf has only its tail uncovered
    cfg = SamplingConfig(j_max=2, seed=0)
    cands = candidates([tree], [{}], None, cfg.role_order)
    select([tree], cands, cfg)
    second = max(cands[(0, 0)], key=lambda c: c.rank)
    assert second.rank == 1 and second.covered_before == 4 and second.uncovered == (6 if second.call_index == 1 else 2)
    assert second.new_tokens == 1 + second.uncovered      # its observation token + its tail


def _unique_positions(seqs_by_tree):
    """Brute force |U|: distinct prefixes of (token, generated) over the trained sequences of each task."""
    total = 0
    for seqs in seqs_by_tree.values():
        seen = set()
        for s in seqs:
            h = 0
            for t, lp, v in zip(s.input_ids, s.old_logprobs, s.versions):
                h = hash((h, t, v >= 0))      # generated tokens carry a version ≥ 0
                seen.add(h)
        total += len(seen)
    return total


@pytest.mark.parametrize("budget", [3000, 9000, 20000])
def test_token_budget_bounds_the_packed_tokens(budget):
    recs = _branching(seed=2)
    rewards, adv = _scores(recs)
    tb = tree_batch(recs, adv, rewards, sampling=SamplingConfig(j_max=None, token_budget=budget))
    task = {r.execution_id: r.task_id for r in recs}
    by_tree = defaultdict(list)
    for s in tb.sequences:
        by_tree[task[s.execution_id]].append(s)
    assert tb.tokens_unique == _unique_positions(by_tree) <= budget
    assert sum(c.new_tokens for c in tb.candidates if c.selected) == tb.tokens_unique
    uncapped = tree_batch(recs, adv, rewards, sampling=SamplingConfig(j_max=None))
    assert uncapped.tokens_unique > budget      # the budget binds
    got = {s.execution_id for s in tb.sequences}
    if budget >= 9000:     # round-robin: every execution gets a first path before any gets a second
        assert got == {r.execution_id for r in recs}
    for c in tb.candidates:   # an execution left without a path: nothing of it fit
        if c.execution_id not in got:
            assert "token budget" in c.reason
    assert any("token budget" in c.reason for c in tb.candidates if not c.selected)


def _per_position_weights(tb, recs):
    """Brute force: per execution and tree position (a prefix hash), the weights it got on each path."""
    out = defaultdict(lambda: defaultdict(list))
    for s in tb.sequences:
        h = 0
        for t, w, v in zip(s.input_ids, s.weights, s.versions):
            h = hash((h, t, v >= 0))
            if v >= 0:
                out[s.execution_id][h].append(w)
    return out


@pytest.mark.parametrize("j_max", [2, None])
def test_loss_once_weights_a_shared_token_once_and_per_branch_on_every_branch(j_max):
    recs = _branching(seed=3)
    rewards, adv = _scores(recs)
    once = tree_batch(recs, adv, rewards, sampling=SamplingConfig(j_max=j_max, weighting="loss_once"))
    per = tree_batch(recs, adv, rewards, sampling=SamplingConfig(j_max=j_max, weighting="per_branch"))
    assert [(s.execution_id, s.call_index) for s in once.sequences] == \
           [(s.execution_id, s.call_index) for s in per.sequences]        # same selection, same seed
    shared = 0
    for eid, pos in _per_position_weights(once, recs).items():
        n = len(pos)                                         # distinct generated positions it covers
        for ws in pos.values():
            assert sorted(ws)[-1] == pytest.approx(1 / n) and sum(1 for w in ws if w) == 1
            shared += len(ws) > 1
    assert shared > 0                                        # the workload has shared generated prefixes
    for eid, pos in _per_position_weights(per, recs).items():
        n = sum(len(ws) for ws in pos.values())              # generated tokens summed over its branches
        for ws in pos.values():
            assert all(w == pytest.approx(1 / n) for w in ws)
    for tb in (once, per):
        sums = defaultdict(float)
        for s in tb.sequences:
            sums[s.execution_id] += sum(s.weights)
        assert all(v == pytest.approx(1.0) for v in sums.values()) and tb.normaliser == len(recs)
        for s in tb.sequences:
            assert all(a == adv[s.execution_id] if w else a == 0.0 for a, w in zip(s.advantages, s.weights))


# ----------------------------------------------------------------------------------------------
# credit by hand


def _credit_group():
    P = [1, 2, 3, 4]      # system + task + first observation, injected
    a = _exec("a", [_call(0, 0, P, [5, 6]), _call(1, 0, P + [5, 6, 8], [10], parent=0, prefix=6)], reward=1.0)
    b = _exec("b", [_call(0, 0, P, [5, 6]), _call(1, 0, P + [5, 6, 8], [11], parent=0, prefix=6)], reward=0.0)
    c = _exec("c", [_call(0, 0, P, [7])], reward=0.2)
    d = _exec("d", [_call(0, 0, P, [7])], reward=0.6)                   # c's duplicate
    return [a, b, c, d]


def test_tree_credit_values_by_hand():
    recs = _credit_group()
    tree, _ = build_tree(recs)
    rewards, adv = _scores(recs)
    assert adv == pytest.approx({"a": 0.55, "b": -0.45, "c": -0.25, "d": 0.15})    # mean 0.45
    V, n = node_values(tree, rewards)
    by = {tuple(tree.path_tokens(k).tolist()): k for k in range(1, tree.n_nodes)}
    P, AB, C, A, B = (by[(1, 2, 3, 4)], by[(1, 2, 3, 4, 5, 6)], by[(1, 2, 3, 4, 7)],
                      by[(1, 2, 3, 4, 5, 6, 8, 10)], by[(1, 2, 3, 4, 5, 6, 8, 11)])
    OBS = by[(1, 2, 3, 4, 5, 6, 8)]
    assert [V[k] for k in (0, P, AB, OBS, C, A, B)] == pytest.approx([0.45, 0.45, 0.5, 0.5, 0.4, 1.0, 0.0])
    assert [n[k] for k in (0, P, AB, OBS, C, A, B)] == [4, 4, 2, 2, 2, 1, 1]
    tc = tree_credit(tree, rewards, CreditConfig("tree"))
    assert [tc.step[k] for k in (P, AB, OBS, C, A, B)] == pytest.approx([0, 0.05, 0, -0.05, 0.5, -0.5])
    # shrinkage k=1: the term becomes n/(n+1)·(V − V_parent)
    tk = tree_credit(tree, rewards, CreditConfig("tree", shrink_k=1.0))
    assert [tk.step[k] for k in (P, AB, OBS, C, A, B)] == \
        pytest.approx([0, 2 / 3 * 0.05, 0, -2 / 3 * 0.05, 0.25, -0.25])
    assert tree_credit(tree, rewards, CreditConfig("grpo")) is None

    tb = tree_batch(recs, adv, rewards, sampling=SamplingConfig(j_max=None), credit=CreditConfig("tree"))
    seq = {s.execution_id: s for s in tb.sequences}
    assert seq["a"].input_ids == [1, 2, 3, 4, 5, 6, 8, 10]
    assert seq["a"].advantages == pytest.approx([0, 0, 0, 0, 0.55 + 0.05, 0.55 + 0.05, 0, 0.55 + 0.5])
    assert seq["b"].advantages == pytest.approx([0, 0, 0, 0, -0.45 + 0.05, -0.45 + 0.05, 0, -0.45 - 0.5])
    assert seq["c"].advantages == pytest.approx([0, 0, 0, 0, -0.25 - 0.05])
    assert seq["d"].advantages == pytest.approx([0, 0, 0, 0, 0.15 - 0.05])
    grpo = tree_batch(recs, adv, rewards, sampling=SamplingConfig(j_max=None))
    assert {s.execution_id: max(s.advantages, key=abs) for s in grpo.sequences} == pytest.approx(adv)


def test_tree_credit_below_the_last_fork_is_the_group_term_alone():
    recs = synthetic_executions(3, 3000, turns=10, group_size=3, seed=1)        # chains from a shared prompt
    rewards, adv = _scores(recs)
    t = tree_batch(recs, adv, rewards, sampling=SamplingConfig(j_max=None), credit=CreditConfig("tree"))
    mean = sum(rewards.values()) / 3
    for s, r in zip(t.sequences, recs):
        assert s.execution_id == r.execution_id
        first = len(r.calls[0].prompt_ids) + len(r.calls[0].completion_ids)
        # the only branch point is the shared task prompt, where the executions part at their first
        # observation: that first node carries V(node) − V(parent) = r − mean on top of the group term
        # (the literal definition counts the group divergence twice); every later token the group term alone
        a = adv[r.execution_id]
        assert a == pytest.approx(rewards[r.execution_id] - mean)
        head = [x for x, w in zip(s.advantages[:first], s.weights[:first]) if w]
        tail = [x for x, w in zip(s.advantages[first:], s.weights[first:]) if w]
        assert head and head == pytest.approx([2 * a] * len(head))
        assert tail and set(tail) == {a}


# ----------------------------------------------------------------------------------------------
# loop pruning


def test_find_cycle_by_hand():
    A, B, C = "A", "B", "C"
    assert find_cycle([A, A, A], 2, 4) == (2, 1, 3)
    assert find_cycle([A, B, A, B, A, B, C], 2, 4) == (4, 2, 3)
    assert find_cycle([C, A, B, A, B, A, B, A, B], 2, 4) == (5, 2, 4)
    assert find_cycle([A, B, A, B, A, B], 3, 4) is None
    assert find_cycle([A, B, C, A, B, C, A, B, C], 2, 2) is None         # period 3 > max_period
    assert find_cycle([A, B, C, A, B, C, A, B, C], 2, 3) == (6, 3, 3)
    assert find_cycle([A, B, C], 1, 4) is None


def _loop_exec():
    # steps: (action, observation) = (10, 5) (11, 6) (10, 5) (11, 6) (10, 5) (11, 6) (12, 7)
    acts = [([10], [5]), ([11], [6])] * 3 + [([12], [7])]
    calls, prompt = [], [1, 2, 3]
    for i, (act, obs) in enumerate(acts):
        calls.append(_call(i, 0, prompt, act, parent=i - 1, prefix=len(prompt) - 1 if i else 0))
        prompt = prompt + act + obs
    return _exec("loop", calls, reward=1.0)


def test_pruning_cuts_a_hand_made_loop_and_the_sampler_trains_only_the_kept_part():
    rec = _loop_exec()
    tree, rejects = build_tree([rec])
    assert rejects == {}
    (leaf,) = tree.leaves
    assert tree.path_tokens(leaf.node).tolist() == [1, 2, 3, 10, 5, 11, 6, 10, 5, 11, 6, 10, 5, 11, 6, 12]
    cuts = prune_loops(tree, PruneConfig(max_repeats=2, max_period=4))
    cut = cuts[0]
    # the cycle (10,5)(11,6) is kept twice; the cut is before the third 10 at depth 11
    assert (cut.depth, cut.step, cut.period, cut.repeats) == (11, 4, 2, 3)
    assert (cut.pruned_tokens, cut.pruned_generated) == (5, 3)
    assert prune_loops(tree, PruneConfig(max_repeats=3, max_period=4)) == {}
    _, adv = _scores([rec])
    tb = tree_batch([rec], adv, sampling=SamplingConfig(j_max=None), prune=PruneConfig(2, 4))
    (s,) = tb.sequences
    assert s.input_ids == [1, 2, 3, 10, 5, 11, 6, 10, 5, 11, 6]
    assert [w for w in s.weights] == [0, 0, 0, 0.25, 0, 0.25, 0, 0.25, 0, 0.25, 0]
    seg = batch_tables("r", 0, tb)["train_segments"].to_pylist()
    assert seg[-1]["status"] == "pruned" and (seg[-1]["depth_start"], seg[-1]["depth_end"]) == (11, 16)
    leaves = batch_tables("r", 0, tb)["tree_leaves"].to_pylist()
    assert leaves[0]["prune_depth"] == 11 and "repeated 3 times" in leaves[0]["prune_reason"]


# ----------------------------------------------------------------------------------------------
# lake tables


def test_decisions_as_lake_tables_answer_why_in_sql(tmp_path):
    from gyre_core.lake import Lake
    from gyre_core.lake.schema import SCHEMAS
    from gyre_core.lake.sql import run_sql

    recs = _credit_group() + [_exec("bad", [_call(0, 0, [1], [2]), _call(1, 0, [9, 2], [3], parent=0, prefix=2)])]
    recs.append(_exec("gone", [_call(0, 0, [1], [2])]))
    rewards, adv = _scores(recs)
    del adv["gone"]
    tb = tree_batch(recs, adv, rewards, sampling=SamplingConfig(j_max=1), credit=CreditConfig("tree", 1.0))
    tables = batch_tables("run1", 3, tb)
    for name, t in tables.items():
        assert t.schema.equals(SCHEMAS[name], check_metadata=False)
    ex = {r["execution_id"]: r for r in tables["exclusions"].to_pylist()}
    assert ex["bad"]["stage"] == "tree" and "execution bad: call 1" in ex["bad"]["reason"]
    assert ex["gone"]["stage"] == "score"
    root = str(tmp_path / "lake")
    Lake(root).write_part("run1", "process=3", tables)
    q = ("SELECT execution_id, sum(depth_end - depth_start) AS n FROM train_segments "
         "WHERE status = 'trained' GROUP BY 1 ORDER BY 1")
    assert json.loads(run_sql(root, q, fmt="json")) == [
        {"execution_id": e, "n": n} for e, n in (("a", 3), ("b", 3), ("c", 1), ("d", 1))]
    v = json.loads(run_sql(root, "SELECT value, n_leaves FROM tree_nodes WHERE parent_id = 0 AND node_id > 0",
                           fmt="json"))
    assert len(v) == 1 and v[0]["n_leaves"] == 4 and v[0]["value"] == pytest.approx(0.45)
    why = json.loads(run_sql(root, "SELECT reason FROM tree_paths WHERE execution_id = 'c'", fmt="json"))
    assert why[0]["reason"].startswith("role main (priority 0), drawn with p=1")
