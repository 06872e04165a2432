"""Prefix trees over exact token ids: all model calls of a task's executions merged into one radix tree.

    tree, rejects = build_tree(records_of_one_task)       # rejects: execution_id -> why (nothing built)
    trees, rejects = build_forest(records)                # one tree per task_id
    for leaf in tree.leaves:                               # ends of contexts; duplicates merged
        ids, gen, logprob, version = tree.path_values(*leaf.occurrences[0])

Data layout (numpy, no object per token):
- A token buffer holds every call's *new* tokens (`prompt[prefix_len:] + completion`, what the lake stores)
  once, call after call: `tok` (int32), `gen` (True inside a completion: policy-generated; False: injected
  by the harness or environment), `logprob` (float64 behaviour log-prob, 0 where injected) and `version`
  (int32 policy version, -1 where injected).
- Nodes are spans of that buffer: `node_start`, `node_len`, `node_parent`, `node_depth` (depth of the
  node's first token from the root). Node 0 is the empty root. Node tokens are the copy of whichever call
  inserted them first; a token position in the tree is identified by (node, offset).
- Calls (global id = `call_off[e] + call_index`) keep `call_parent` (global id or -1), `call_prefix`,
  `call_seg_start`/`call_seg_len` (their span of the buffer) and `call_end` (the node their path ends at).
  A call's own root-to-end path is rebuilt from its chain of segments (`path_values`), so every leaf
  carries its own log-probs and versions even where another execution reached the same tokens.
- Leaves are the ends of calls that no other call of the same execution extends (the last call of an
  append-only context, a retry, a compaction context, a sub-agent). Contexts ending at the same node (exact
  duplicate paths) are one `Leaf` with `occurrences` [(execution index, call index), ...]: multiplicity.
Tokens are merged on (token id, provenance): a generated token never shares a position with the same id
injected by the environment, so every tree position has one provenance and one trainability.

How it is built fast: a call's prompt extends its parent call's prompt + completion, so its new tokens
attach at depth `prefix_len` on the parent's path, found by walking up from the parent's end node. Token
spans are compared (numpy) only where paths may coincide: a segment attaching at a point that already
has children (the shared system/task prompt of every context, identical early turns, retries that
re-generate the same tokens). The one cost proportional to prompt length is checking each prompt against
its parent (`validate_execution`), done with Python list equality (pointer-identity fast path).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from ..records import ROLES, ExecutionRecord
from .batch import RecordMismatch


@dataclass(slots=True)
class Leaf:
    node: int                                   # the node the path ends at (its last token is the node's last)
    depth: int                                  # tokens on the root-to-leaf path
    occurrences: list[tuple[int, int]] = field(default_factory=list)   # (execution index, call index)

    @property
    def multiplicity(self) -> int:
        return len(self.occurrences)


def _first_diff(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    x = np.asarray(a[:n], dtype=np.int64) != np.asarray(b[:n], dtype=np.int64)
    return int(x.argmax()) if x.any() else n


def validate_execution(rec: ExecutionRecord) -> None:
    """Raise `RecordMismatch` (execution id, call, first differing position) unless every call's prompt
    starts with `prefix_len` tokens of its parent call's prompt + completion."""
    eid, calls = rec.execution_id, rec.calls
    for i, c in enumerate(calls):
        where = f"execution {eid}: call {c.call_index}"
        if c.call_index != i:
            raise RecordMismatch(f"{where}: call_index is not its position {i}")
        if not len(c.completion_ids) == len(c.logprobs) == len(c.versions):
            raise RecordMismatch(f"{where}: completion_ids, logprobs and versions differ in length")
        p, n = c.parent_call, c.prefix_len
        if p < 0:
            if n != 0:
                raise RecordMismatch(f"{where}: prefix_len {n} without a parent call")
            continue
        if p >= i:
            raise RecordMismatch(f"{where}: parent call {p} does not precede it")
        par = calls[p]
        pp, pc, pr = par.prompt_ids, par.completion_ids, c.prompt_ids
        if not 0 <= n <= min(len(pr), len(pp) + len(pc)):
            raise RecordMismatch(f"{where}: prefix_len {n} outside its prompt ({len(pr)}) or its parent call "
                                 f"{p} ({len(pp) + len(pc)} tokens)")
        if pr is pp:
            continue
        a = min(n, len(pp))
        if (pr[:a] != (pp if a == len(pp) else pp[:a])) or (n > a and pr[a:n] != pc[:n - a]):
            pos = _first_diff(pr[:n], (pp + pc)[:n])
            raise RecordMismatch(f"{where}: prompt differs from parent call {p}'s prompt+completion "
                                 f"at token {pos}")


class TrajectoryTree:
    """The prefix tree of one task's executions (see the module docstring for the layout)."""

    def __init__(self, task_id: str, execution_ids: list[str]):
        self.task_id = task_id
        self.execution_ids = execution_ids
        self.leaves: list[Leaf] = []

    # -- sizes -------------------------------------------------------------------------------------
    @property
    def n_nodes(self) -> int:
        return len(self.node_len)

    @property
    def n_unique(self) -> int:
        """Distinct token positions in the tree (what packing all of it would forward)."""
        return int(self.node_len.sum())

    @property
    def n_flat(self) -> int:
        """Σ over leaf occurrences of their path lengths (what training every context flat would forward)."""
        return sum(lf.depth * lf.multiplicity for lf in self.leaves)

    @property
    def n_stored(self) -> int:
        return len(self.tok)

    def node_end(self, node: int) -> int:
        return int(self.node_depth[node] + self.node_len[node])

    # -- paths -------------------------------------------------------------------------------------
    def path_nodes(self, node: int) -> np.ndarray:
        """Node ids from the root's first child down to `node` (the root itself excluded)."""
        out = []
        parent = self.node_parent
        while node > 0:
            out.append(node)
            node = int(parent[node])
        return np.asarray(out[::-1], dtype=np.int64)

    def path_tokens(self, node: int) -> np.ndarray:
        """The tree's token ids from the root to the end of `node`."""
        nodes = self.path_nodes(node)
        parts = [self.tok[self.node_start[k]:self.node_start[k] + self.node_len[k]] for k in nodes]
        return np.concatenate(parts) if parts else np.zeros(0, np.int32)

    def call_id(self, exec_idx: int, call_index: int) -> int:
        return int(self.call_off[exec_idx] + call_index)

    def call_pieces(self, exec_idx: int, call_index: int, length: int | None = None) -> list[tuple[int, int]]:
        """Buffer spans (start, n) that make up the call's prompt + completion, cut to `length` tokens."""
        x = self.call_id(exec_idx, call_index)
        limit = np.iinfo(np.int64).max if length is None else int(length)
        pieces = []
        while x >= 0 and limit > 0:
            d0 = int(self.call_prefix[x])
            take = min(int(self.call_seg_len[x]), limit - d0)
            if take > 0:
                pieces.append((int(self.call_seg_start[x]), take))
            limit = min(limit, d0)
            x = int(self.call_parent[x])
        return pieces[::-1]

    def path_values(self, exec_idx: int, call_index: int, length: int | None = None):
        """(token ids, generated, behaviour log-prob, version) of one call's own path, as arrays."""
        pieces = self.call_pieces(exec_idx, call_index, length)
        if not pieces:
            return (np.zeros(0, np.int32), np.zeros(0, bool), np.zeros(0, np.float64), np.zeros(0, np.int32))
        return tuple(np.concatenate([a[s:s + n] for s, n in pieces])
                     for a in (self.tok, self.gen, self.logprob, self.version))

    def role_of(self, exec_idx: int, call_index: int) -> str:
        return self.role_names[int(self.call_role[self.call_id(exec_idx, call_index)])]

    def context_of(self, exec_idx: int, call_index: int) -> int:
        return int(self.call_context[self.call_id(exec_idx, call_index)])

    def leaf_generated(self, leaf: Leaf) -> np.ndarray:
        """Prefix sums of generated tokens along the leaf's path: cum[d] = generated tokens in [0, d)."""
        nodes = self.path_nodes(leaf.node)
        g = np.concatenate([self.gen[self.node_start[k]:self.node_start[k] + self.node_len[k]] for k in nodes]) \
            if len(nodes) else np.zeros(0, bool)
        return np.concatenate([[0], np.cumsum(g, dtype=np.int64)])

    def gen_on_path(self, nodes: np.ndarray, part: np.ndarray) -> np.ndarray:
        """Provenance (True: generated) of the tokens of a path given as nodes and tokens taken from each."""
        if not len(nodes):
            return np.zeros(0, bool)
        return np.concatenate([self.gen[self.node_start[k]:self.node_start[k] + n] for k, n in zip(nodes, part)])

    def topological(self) -> np.ndarray:
        """Node ids, every parent before its children (a child starts deeper than its parent)."""
        return np.argsort(self.node_depth, kind="stable")

    def node_source(self) -> tuple[np.ndarray, np.ndarray]:
        """(execution index, call index) of the call whose copy of each node's tokens the tree keeps."""
        g = np.searchsorted(self.call_seg_start, self.node_start, side="right") - 1
        g = np.clip(g, 0, max(len(self.call_seg_start) - 1, 0))
        e = np.searchsorted(self.call_off, g, side="right") - 1
        return e, g - self.call_off[e]


class _Builder:
    """Radix insertion over the call DAG (nodes are Python lists while building, numpy after)."""

    def __init__(self, key: np.ndarray):
        self.key = key
        self.start, self.len, self.parent, self.depth = [0], [0], [-1], [0]
        self.children: list[dict[int, int]] = [{}]

    def _new(self, start: int, n: int, parent: int) -> int:
        self.start.append(start)
        self.len.append(n)
        self.parent.append(parent)
        self.depth.append(self.depth[parent] + self.len[parent])
        self.children.append({})
        self.children[parent][int(self.key[start])] = len(self.start) - 1
        return len(self.start) - 1

    def _split(self, node: int, k: int) -> int:
        """Cut `node` after k tokens; the head is a new node, `node` keeps the tail (and its id, so every
        stored reference to a path end stays valid). Returns the head."""
        s, p = self.start[node], self.parent[node]
        head = len(self.start)
        self.start.append(s)
        self.len.append(k)
        self.parent.append(p)
        self.depth.append(self.depth[node])
        self.children.append({int(self.key[s + k]): node})
        self.children[p][int(self.key[s])] = head
        self.start[node] += k
        self.len[node] -= k
        self.depth[node] += k
        self.parent[node] = head
        return head

    def _lcp(self, a: int, b: int, n: int) -> int:
        if n <= 8:
            key = self.key
            for i in range(n):
                if key[a + i] != key[b + i]:
                    return i
            return n
        x = self.key[a:a + n] != self.key[b:b + n]
        i = int(x.argmax())
        return i if x[i] else n

    def point(self, node: int, d: int) -> tuple[int, int]:
        """(node, offset) of depth d on the path ending at `node` (offset in 1..len, or root and 0)."""
        depth, parent = self.depth, self.parent
        while node != 0 and depth[node] >= d:
            node = parent[node]
        return node, d - depth[node]

    def insert(self, node: int, off: int, s: int, n: int) -> int:
        """Insert buffer span [s, s+n) below point (node, off); returns the node the span ends at."""
        pos = 0
        while pos < n:
            if off < self.len[node]:
                m = self._lcp(self.start[node] + off, s + pos, min(self.len[node] - off, n - pos))
                pos += m
                off += m
                if off < self.len[node] and pos < n:
                    node = self._split(node, off)
                    off = self.len[node]
                continue
            child = self.children[node].get(int(self.key[s + pos]))
            if child is None:
                node, off, pos = self._new(s + pos, n - pos, node), n - pos, n
            else:
                node, off = child, 0
        if 0 < off < self.len[node]:
            node = self._split(node, off)
        return node


def _fill_buffer(records: list[ExecutionRecord]):
    """Concatenate every call's new tokens; returns the arrays and each call's segment start/length."""
    toks: list[int] = []
    lps: list[float] = []
    vers: list[int] = []
    seg_start, seg_len, gen_start = [], [], []
    at = 0
    for rec in records:
        for c in rec.calls:
            delta = len(c.prompt_ids) - c.prefix_len
            toks += c.prompt_ids[c.prefix_len:]
            toks += c.completion_ids
            lps += c.logprobs
            vers += c.versions
            seg_start.append(at)
            seg_len.append(delta + len(c.completion_ids))
            gen_start.append(at + delta)
            at += delta + len(c.completion_ids)
    tok = np.array(toks, dtype=np.int32)
    del toks
    gen = np.zeros(len(tok), dtype=bool)
    seg_start_a, seg_len_a, gen_start_a = (np.asarray(x, dtype=np.int64) for x in (seg_start, seg_len, gen_start))
    for a, z in zip(gen_start, (seg_start_a + seg_len_a).tolist()):
        gen[a:z] = True
    logprob = np.zeros(len(tok), dtype=np.float64)
    version = np.full(len(tok), -1, dtype=np.int32)
    logprob[gen] = np.asarray(lps, dtype=np.float64)
    version[gen] = np.asarray(vers, dtype=np.int32)
    return tok, gen, logprob, version, seg_start_a, seg_len_a


def build_tree(records: list[ExecutionRecord], task_id: str | None = None) -> tuple[TrajectoryTree, dict[str, str]]:
    """Merge the calls of `records` (one task's executions) into one tree.

    Executions whose records disagree with their declared parent prefixes are left out entirely and
    returned as {execution_id: reason}; the others are built.
    """
    ok, rejects = [], {}
    for rec in records:
        try:
            validate_execution(rec)
        except RecordMismatch as exc:
            rejects[rec.execution_id] = str(exc)
            continue
        ok.append(rec)
    tid = task_id if task_id is not None else (records[0].task_id if records else "")
    tree = TrajectoryTree(tid, [r.execution_id for r in ok])
    tok, gen, logprob, version, seg_start, seg_len = _fill_buffer(ok)
    key = tok.astype(np.int64)                 # merge on (token, provenance): key = 2·token + generated
    key <<= 1
    key |= gen
    b = _Builder(key)
    n_calls = [len(r.calls) for r in ok]
    call_off = np.concatenate([[0], np.cumsum(n_calls, dtype=np.int64)]).astype(np.int64)
    call_parent = np.full(int(call_off[-1]), -1, dtype=np.int64)
    call_prefix = np.zeros(int(call_off[-1]), dtype=np.int64)
    call_role = np.zeros(int(call_off[-1]), dtype=np.int8)
    call_context = np.zeros(int(call_off[-1]), dtype=np.int32)
    call_end = np.zeros(int(call_off[-1]), dtype=np.int64)
    role_names = list(ROLES)
    role_code = {r: i for i, r in enumerate(role_names)}
    for e, rec in enumerate(ok):
        base = int(call_off[e])
        for c in rec.calls:
            g = base + c.call_index
            if c.role not in role_code:
                role_code[c.role] = len(role_names)
                role_names.append(c.role)
            call_role[g], call_context[g], call_prefix[g] = role_code[c.role], c.context_index, c.prefix_len
            if c.parent_call >= 0:
                call_parent[g] = base + c.parent_call
                node, off = b.point(int(call_end[base + c.parent_call]), c.prefix_len)
            else:
                node, off = 0, 0
            call_end[g] = b.insert(node, off, int(seg_start[g]), int(seg_len[g]))
    tree.tok, tree.gen, tree.logprob, tree.version = tok, gen, logprob, version
    tree.node_start = np.asarray(b.start, dtype=np.int64)
    tree.node_len = np.asarray(b.len, dtype=np.int64)
    tree.node_parent = np.asarray(b.parent, dtype=np.int64)
    tree.node_depth = np.asarray(b.depth, dtype=np.int64)
    tree.children = b.children
    tree.call_off, tree.call_parent, tree.call_prefix = call_off, call_parent, call_prefix
    tree.call_seg_start, tree.call_seg_len, tree.call_end = seg_start, seg_len, call_end
    tree.call_role, tree.call_context, tree.role_names = call_role, call_context, role_names
    tree.leaves = _leaves(tree, n_calls)
    return tree, rejects


def _leaves(tree: TrajectoryTree, n_calls: list[int]) -> list[Leaf]:
    """Per execution, the calls whose end node is no strict ancestor of another of its calls' ends."""
    parent = tree.node_parent
    by_node: dict[int, Leaf] = {}
    for e, n in enumerate(n_calls):
        base = int(tree.call_off[e])
        ends = tree.call_end[base:base + n]
        above: set[int] = set()
        for end in ends.tolist():
            x = int(parent[end])
            while x > 0 and x not in above:
                above.add(x)
                x = int(parent[x])
        for ci, end in enumerate(ends.tolist()):
            if end == 0 or end in above:
                continue
            leaf = by_node.get(end)
            if leaf is None:
                leaf = by_node[end] = Leaf(end, tree.node_end(end))
            leaf.occurrences.append((e, ci))
    return list(by_node.values())


def build_forest(records: list[ExecutionRecord]) -> tuple[list[TrajectoryTree], dict[str, str]]:
    """One tree per task_id (in order of first appearance), its executions in the order of their ids (a tree
    is the same however its records arrive), and all rejects."""
    groups: dict[str, list[ExecutionRecord]] = {}
    for r in sorted(records, key=lambda r: r.execution_id):
        groups.setdefault(r.task_id, []).append(r)
    first = {}
    for r in records:
        first.setdefault(r.task_id, len(first))
    groups = dict(sorted(groups.items(), key=lambda kv: first[kv[0]]))
    trees, rejects = [], {}
    for tid, recs in groups.items():
        t, rej = build_tree(recs, tid)
        trees.append(t)
        rejects.update(rej)
    return trees, rejects


# ----------------------------------------------------------------------------------------------
# lake tables


def tree_nodes_table(run_id: str, step: int, tree: TrajectoryTree, values=None, step_adv=None,
                     counts=None) -> pa.Table:
    """One row per node (the root included): span, where its tokens come from, and its credit values."""
    from ..lake.schema import TREE_NODES

    n = tree.n_nodes
    src_e, src_c = tree.node_source()
    gen_cum = np.concatenate([[0], np.cumsum(tree.gen, dtype=np.int64)])
    n_gen = gen_cum[tree.node_start + tree.node_len] - gen_cum[tree.node_start]
    nan = [None] * n
    cols = {
        "run_id": [run_id] * n, "step": [step] * n, "task_id": [tree.task_id] * n,
        "node_id": np.arange(n, dtype=np.int32), "parent_id": tree.node_parent.astype(np.int32),
        "depth_start": tree.node_depth, "length": tree.node_len, "n_generated": n_gen,
        "source_execution_id": [tree.execution_ids[e] if len(tree.execution_ids) else "" for e in src_e.tolist()],
        "source_call_index": src_c.astype(np.int32),
        "n_leaves": counts.astype(np.int64) if counts is not None else nan,
        "value": values.astype(np.float64) if values is not None else nan,
        "step_advantage": step_adv.astype(np.float64) if step_adv is not None else nan,
    }
    return pa.Table.from_pydict(cols, schema=TREE_NODES)


def tree_leaves_table(run_id: str, step: int, tree: TrajectoryTree, cuts=None) -> pa.Table:
    """One row per leaf: its node, depth, multiplicity and the contexts it stands for; `cuts` (from
    `pruning.prune_loops`) adds where loop pruning cut the path and why."""
    from ..lake.schema import TREE_LEAVES

    rows = []
    for i, lf in enumerate(tree.leaves):
        e0, c0 = lf.occurrences[0]
        cut = cuts.get(i) if cuts else None
        rows.append({
            "run_id": run_id, "step": step, "task_id": tree.task_id, "leaf_id": i, "node_id": lf.node,
            "depth": lf.depth, "role": tree.role_of(e0, c0), "context_index": tree.context_of(e0, c0),
            "multiplicity": lf.multiplicity,
            "execution_ids": [tree.execution_ids[e] for e, _ in lf.occurrences],
            "call_indexes": [c for _, c in lf.occurrences],
            "n_generated": int(tree.leaf_generated(lf)[-1]),
            "prune_depth": cut.depth if cut else lf.depth, "prune_reason": cut.reason if cut else "",
        })
    return pa.Table.from_pylist(rows, schema=TREE_LEAVES)
