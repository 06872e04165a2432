"""Prefix trees from TITO records: hand-made call lists, and a brute-force per-token trie as reference."""
import numpy as np
import pytest

from gyre_core.processor.batch import RecordMismatch
from gyre_core.processor.synthetic import synthetic_executions
from gyre_core.processor.tree import build_forest, build_tree, validate_execution
from gyre_core.records import CallRecord, ExecutionRecord

SYS, TASK = [1, 2], [3, 4]


def _call(i, ctx, prompt, completion, parent=-1, prefix=0, role="main", lp=None, ver=7):
    lp = lp if lp is not None else [-0.5 - 0.01 * k for k in range(len(completion))]
    return CallRecord("x", i, ctx, role, list(prompt), list(completion), list(lp), [ver] * len(completion),
                      "stop", parent, prefix)


def _exec(eid, calls, task="t"):
    r = ExecutionRecord("run", 0, eid, task, 1, "train", "env", calls=calls)
    for c in r.calls:
        c.execution_id = eid
    return r


def _shape(tree):
    """{node tokens: parent's tokens} as tuples of (token, generated) — the tree, without ids."""
    out = {}
    for n in range(1, tree.n_nodes):
        s, k = tree.node_start[n], tree.node_len[n]
        me = tuple(zip(tree.tok[s:s + k].tolist(), tree.gen[s:s + k].tolist()))
        p = tree.node_parent[n]
        ps, pk = tree.node_start[p], tree.node_len[p]
        par = tuple(zip(tree.tok[ps:ps + pk].tolist(), tree.gen[ps:ps + pk].tolist()))
        assert me not in out
        out[me] = par
    return out


def _i(*toks):   # injected
    return tuple((t, False) for t in toks)


def _g(*toks):   # generated
    return tuple((t, True) for t in toks)


def _group():
    """Three executions of one task, by hand (see the expected tree in the test)."""
    a = _exec("a", [
        _call(0, 0, SYS + TASK + [5], [10, 11]),
        _call(1, 0, SYS + TASK + [5, 10, 11, 6], [12], parent=0, prefix=7),
        # a retry forked from call 1: same prompt, a new completion; prefix_len 8 < parent's length 9
        _call(2, 1, SYS + TASK + [5, 10, 11, 6], [15], parent=1, prefix=8),
        # compaction: a new context from system + task + summary
        _call(3, 2, SYS + TASK + [8, 9], [14], role="main-summary"),
        # two identical sub-agent contexts (system prompt + sub-task): one leaf, multiplicity 2
        _call(4, 3, SYS + [20, 21], [22], role="sub-agent"),
        _call(5, 4, SYS + [20, 21], [22], role="sub-agent", lp=[-0.9]),
    ])
    b = _exec("b", [_call(0, 0, SYS + TASK + [7], [13], lp=[-0.25])])
    c = _exec("c", [_call(0, 0, SYS + TASK + [7], [13], lp=[-0.75], ver=8)])     # same tokens as b
    return [a, b, c]


def test_tree_by_hand_shared_prompt_compaction_subagent_fork_duplicates():
    tree, rejects = build_tree(_group())
    assert rejects == {}
    assert tree.execution_ids == ["a", "b", "c"]
    assert _shape(tree) == {
        _i(1, 2): (),                             # the system prompt: shared by every context
        _i(3, 4): _i(1, 2),                       # the task prompt: shared by the group's main contexts
        _i(5) + _g(10, 11): _i(3, 4),             # a's first turn
        _i(6): _i(5) + _g(10, 11),                # a's second observation: the retry forks after it
        _g(12): _i(6),
        _g(15): _i(6),
        _i(8, 9) + _g(14): _i(3, 4),              # compaction context
        _i(7) + _g(13): _i(3, 4),                 # b and c
        _i(20, 21) + _g(22): _i(1, 2),            # sub-agent
    }
    assert tree.n_unique == 2 + 2 + 3 + 1 + 1 + 1 + 3 + 2 + 3
    leaves = {tuple(tree.path_tokens(lf.node).tolist()): lf for lf in tree.leaves}
    assert set(leaves) == {(1, 2, 3, 4, 5, 10, 11, 6, 12), (1, 2, 3, 4, 5, 10, 11, 6, 15), (1, 2, 3, 4, 8, 9, 14),
                           (1, 2, 20, 21, 22), (1, 2, 3, 4, 7, 13)}
    assert leaves[(1, 2, 3, 4, 7, 13)].occurrences == [(1, 0), (2, 0)]        # b and c: multiplicity 2
    assert leaves[(1, 2, 20, 21, 22)].occurrences == [(0, 4), (0, 5)]         # a's two sub-agent contexts
    assert leaves[(1, 2, 3, 4, 5, 10, 11, 6, 15)].occurrences == [(0, 2)]
    assert tree.role_of(0, 4) == "sub-agent" and tree.role_of(0, 3) == "main-summary"
    assert tree.n_flat == 9 + 9 + 7 + 5 * 2 + 6 * 2
    # each occurrence keeps its own behaviour values along its own path
    ids, gen, lp, ver = tree.path_values(2, 0)
    assert ids.tolist() == [1, 2, 3, 4, 7, 13] and gen.tolist() == [0, 0, 0, 0, 0, 1]
    assert lp.tolist() == [0, 0, 0, 0, 0, -0.75] and ver.tolist() == [-1] * 5 + [8]
    assert tree.path_values(1, 0)[2].tolist()[-1] == -0.25
    ids, gen, lp, ver = tree.path_values(0, 2)
    assert ids.tolist() == [1, 2, 3, 4, 5, 10, 11, 6, 15]
    assert lp.tolist() == [0, 0, 0, 0, 0, -0.5, -0.51, 0, -0.5] and gen.sum() == 3
    assert tree.path_values(0, 5)[2].tolist() == [0, 0, 0, 0, -0.9]


def test_a_generated_token_never_merges_with_the_same_injected_token():
    a = _exec("a", [_call(0, 0, SYS + [5], [10, 11])])
    b = _exec("b", [_call(0, 0, SYS + [5, 10], [11])])      # 10 injected here, generated in a
    tree, _ = build_tree([a, b])
    assert _shape(tree) == {_i(1, 2, 5): (), _g(10, 11): _i(1, 2, 5), _i(10) + _g(11): _i(1, 2, 5)}


def test_mismatching_prompt_is_rejected_with_execution_and_position_and_the_rest_is_built():
    bad = _exec("bad", [
        _call(0, 0, [1, 2, 3], [10]),
        _call(1, 0, [1, 2, 7, 10, 4], [12], parent=0, prefix=4),      # token 2 should be 3
    ])
    bad_completion = _exec("bad2", [
        _call(0, 0, [1, 2, 3], [10, 11]),
        _call(1, 0, [1, 2, 3, 10, 99, 4], [12], parent=0, prefix=5),   # token 4 should be 11 (completion)
    ])
    too_long = _exec("bad3", [_call(0, 0, [1], [2]), _call(1, 0, [1, 2, 3, 4], [5], parent=0, prefix=3)])
    ok = _exec("ok", [_call(0, 0, [1, 2, 3], [10])])
    tree, rejects = build_tree([bad, ok, bad_completion, too_long])
    assert rejects["bad"] == "execution bad: call 1: prompt differs from parent call 0's prompt+completion at token 2"
    assert rejects["bad2"].startswith("execution bad2: call 1:") and rejects["bad2"].endswith("at token 4")
    assert "execution bad3: call 1: prefix_len 3" in rejects["bad3"]
    assert tree.execution_ids == ["ok"] and tree.n_stored == 4
    assert [tree.path_tokens(lf.node).tolist() for lf in tree.leaves] == [[1, 2, 3, 10]]
    with pytest.raises(RecordMismatch, match="execution bad: call 1: .* at token 2"):
        validate_execution(bad)


def _reference(records):
    """Brute force: a per-token trie over (token, generated) of every call's full prompt + completion;
    leaves are each execution's paths that are no strict prefix of another of its paths, dups merged."""
    trie: dict = {}
    n_positions = 0
    ends = []
    for e, r in enumerate(records):
        prov = {}     # a prompt token is generated where the parent's path had it generated
        for c in r.calls:
            head = prov[c.parent_call][:c.prefix_len] if c.parent_call >= 0 else []
            prov[c.call_index] = head + [False] * (len(c.prompt_ids) - c.prefix_len) + [True] * len(c.completion_ids)
            seq = list(zip(c.prompt_ids + c.completion_ids, prov[c.call_index]))
            node, h, hs = trie, 0, []
            for k in seq:
                if k not in node:
                    node[k] = {}
                    n_positions += 1
                node = node[k]
                hs.append(h)
                h = hash((h, k))
            ends.append((e, c.call_index, tuple(seq), h, hs))
    leaves: dict[tuple, list] = {}
    for e in range(len(records)):
        strict = {x for ee, _, _, _, hs in ends if ee == e for x in hs}
        for ee, ci, seq, h, _ in ends:
            if ee == e and seq and h not in strict:
                leaves.setdefault(seq, []).append((e, ci))
    return n_positions, leaves


@pytest.mark.parametrize("seed", [0, 1])
def test_synthetic_forest_matches_a_per_token_trie(seed):
    recs = synthetic_executions(6, 6000, turns=30, branching=(0.25, 3), compaction=1500, sub_agents=2,
                                group_size=3, group_fork=0.7, vocab=50, seed=seed)   # small vocab: collisions
    trees, rejects = build_forest(recs)
    assert rejects == {} and len(trees) == 2
    for tree in trees:
        mine = [r for r in recs if r.task_id == tree.task_id]
        n_positions, leaves = _reference(mine)
        assert tree.n_unique == n_positions
        got = {}
        for lf in tree.leaves:
            path = tree.path_tokens(lf.node).tolist()
            gen = tree.gen_on_path(tree.path_nodes(lf.node), tree.node_len[tree.path_nodes(lf.node)]).tolist()
            got[tuple(zip(path, gen))] = lf.occurrences
        assert got == leaves
        for n in range(tree.n_nodes):      # a radix tree: children start with distinct keys
            firsts = [(int(tree.tok[tree.node_start[k]]), bool(tree.gen[tree.node_start[k]]))
                      for k in np.flatnonzero(tree.node_parent == n)]
            assert len(firsts) == len(set(firsts))
        for e, r in enumerate(mine):       # every call's own path is its prompt + completion
            for c in r.calls:
                ids, gen, lp, ver = tree.path_values(e, c.call_index)
                assert ids.tolist() == c.prompt_ids + c.completion_ids
                assert lp[len(c.prompt_ids):].tolist() == c.logprobs
                assert ver[len(c.prompt_ids):].tolist() == c.versions


def test_synthetic_structure():
    recs = synthetic_executions(4, 30000, turns=60, branching=(0.2, 3), compaction=3000, sub_agents=3,
                                group_size=2, group_fork=1.0, seed=3)
    assert [r.task_id for r in recs] == ["task0", "task0", "task1", "task1"]
    roles = {c.role for r in recs for c in r.calls}
    assert roles == {"main", "main-summary", "sub-agent", "sub-agent-summary"}
    for r in recs:
        validate_execution(r)
        stored = sum(len(c.prompt_ids) - c.prefix_len + len(c.completion_ids) for c in r.calls)
        assert 30000 <= stored < 30000 * 1.5
        forks = [c for c in r.calls if c.parent_call >= 0 and c.prefix_len < len(
            r.calls[c.parent_call].prompt_ids) + len(r.calls[c.parent_call].completion_ids)]
        assert forks                                     # retries fork before the parent's end
        assert all(len(c.prompt_ids) + len(c.completion_ids) <= 3000 for c in r.calls)
    # group_fork=1: the second execution of each group starts with a copy of the first's first turns
    assert recs[1].calls[0].prompt_ids == recs[0].calls[0].prompt_ids
    assert recs[1].calls[0].completion_ids == recs[0].calls[0].completion_ids
