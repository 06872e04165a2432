"""Arrow schemas of the lake's tables and the conversions to and from `gyre_core.records`.

    from gyre_core.lake.schema import executions_table, calls_table, read_executions
    tables = {"executions": executions_table(records), "calls": calls_table(records)}
    again = read_executions(tables["executions"], tables["calls"])   # == records

A call's prompt is stored as (parent_call, prefix_len, new_prompt_ids) and rebuilt on read with
`records.rebuild_prompts`, so storage stays linear in the length of an execution. Log-probs are stored
as float32: values that are not float32-representable come back rounded to float32 (the engine's
log-probs are float32 to begin with). Everything else round-trips exactly.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Any, Iterable, Mapping

import pyarrow as pa

from gyre_core.records import SCHEMA_VERSION, CallRecord, ExecutionRecord, rebuild_prompts

METADATA_KEY = b"gyre.schema_version"
_META = {METADATA_KEY: str(SCHEMA_VERSION).encode()}

_IDS = pa.list_(pa.int32())

EXECUTIONS = pa.schema(
    [
        ("run_id", pa.string()),
        ("step", pa.int64()),
        ("execution_id", pa.string()),
        ("task_id", pa.string()),
        ("seed", pa.int64()),
        ("split", pa.string()),
        ("env", pa.string()),
        ("status", pa.string()),
        ("error", pa.string()),
        ("reward", pa.float64()),
        ("success", pa.bool_()),
        ("partial", pa.float64()),
        ("turns", pa.int32()),
        ("invalid_actions", pa.int32()),
        ("compactions", pa.int32()),
        ("policy_version", pa.int32()),
        ("t_start", pa.float64()),
        ("t_end", pa.float64()),
        ("n_calls", pa.int32()),
        ("tokens_generated", pa.int64()),
        ("fork_of", pa.string()),          # a forked continuation: the execution it was copied from
        ("fork_call", pa.int32()),         # calls [0, fork_call) are shared with it (stored there once)
        ("evaluator_s", pa.float64()),     # since version 6: the evaluator's wall seconds
    ],
    metadata=_META,
)

CALLS = pa.schema(
    [
        ("run_id", pa.string()),
        ("step", pa.int64()),
        ("execution_id", pa.string()),
        ("call_index", pa.int32()),
        ("context_index", pa.int32()),
        ("role", pa.string()),
        ("parent_call", pa.int32()),
        ("prefix_len", pa.int32()),
        ("prompt_len", pa.int32()),
        ("new_prompt_ids", _IDS),          # CallRecord.delta()
        ("completion_ids", _IDS),
        ("logprobs", pa.list_(pa.float32())),
        ("versions", _IDS),
        ("finish_reason", pa.string()),
        ("t_start", pa.float64()),
        ("t_end", pa.float64()),
        ("tool_call_ids", pa.list_(pa.string())),   # since version 2
        ("payload_uri", pa.string()),               # since version 2: new_prompt_ids stored as an object
        ("progress", pa.float64()),                 # since version 3: the env's progress() before the call
        ("tool_parse", pa.string()),                # since version 4: "", none, ok, malformed
        ("tool_spans", pa.list_(pa.list_(pa.int32()))),  # since version 4: [first, end) tokens per tool call
        ("rerender_drift", pa.bool_()),             # since version 5: proxy calls; NULL where not measured
    ],
    metadata=_META,
)

# What the trainer saw: one row per trained sequence (a sampled root-to-leaf path).
TRAIN_TOKENS = pa.schema(
    [
        ("run_id", pa.string()),
        ("step", pa.int64()),
        ("execution_id", pa.string()),
        ("call_index", pa.int32()),        # the leaf call of the trained path
        ("advantage", pa.float64()),
        ("n_tokens", pa.int64()),
        ("n_trainable", pa.int64()),
        ("weight", pa.float64()),
    ],
    metadata=_META,
)

# Rewards and group-relative advantages of one step's executions, and why any was excluded.
SCORES = pa.schema(
    [
        ("run_id", pa.string()),
        ("step", pa.int64()),
        ("execution_id", pa.string()),
        ("task_id", pa.string()),
        ("reward", pa.float64()),
        ("advantage", pa.float64()),
        ("excluded", pa.bool_()),
        ("reason", pa.string()),
        ("multiplicity", pa.int32()),      # dedup: executions the row stands for (0: collapsed into kept_as)
        ("kept_as", pa.string()),          # dedup: the identical execution trained for it (its own id if kept)
    ],
    metadata=_META,
)

# --- the tree processor's decisions (gyre_core.processor.tree / sampling / credit / pruning) ---------------

# One row per prefix-tree node of a task (node 0 is the empty root). Tokens of a node are a span of the
# source call's prompt + completion starting at depth `depth_start` (so the call's tokens at depths
# [depth_start, depth_start + length) are this node). Credit: value = mean reward of the leaf
# occurrences below (n_leaves of them), step_advantage = the tree term given to the node's tokens.
TREE_NODES = pa.schema(
    [
        ("run_id", pa.string()),
        ("step", pa.int64()),
        ("task_id", pa.string()),
        ("node_id", pa.int32()),
        ("parent_id", pa.int32()),
        ("depth_start", pa.int64()),
        ("length", pa.int64()),
        ("n_generated", pa.int64()),
        ("source_execution_id", pa.string()),
        ("source_call_index", pa.int32()),
        ("n_leaves", pa.int64()),
        ("value", pa.float64()),
        ("step_advantage", pa.float64()),
    ],
    metadata=_META,
)

# One row per leaf (an end of context; exact duplicates merged with a multiplicity), and loop pruning.
TREE_LEAVES = pa.schema(
    [
        ("run_id", pa.string()),
        ("step", pa.int64()),
        ("task_id", pa.string()),
        ("leaf_id", pa.int32()),
        ("node_id", pa.int32()),
        ("depth", pa.int64()),
        ("role", pa.string()),
        ("context_index", pa.int32()),
        ("multiplicity", pa.int32()),
        ("execution_ids", pa.list_(pa.string())),
        ("call_indexes", _IDS),
        ("n_generated", pa.int64()),
        ("prune_depth", pa.int64()),       # == depth when not pruned
        ("prune_reason", pa.string()),
    ],
    metadata=_META,
)

# Every (execution, leaf) candidate of the sampler: selected or not, and why.
TREE_PATHS = pa.schema(
    [
        ("run_id", pa.string()),
        ("step", pa.int64()),
        ("task_id", pa.string()),
        ("execution_id", pa.string()),
        ("leaf_id", pa.int32()),
        ("call_index", pa.int32()),       # the execution's call that ends at the leaf
        ("role", pa.string()),
        ("selected", pa.bool_()),
        ("rank", pa.int32()),             # order of selection within the execution (-1: not selected)
        ("depth", pa.int64()),            # path length trained (after loop pruning)
        ("covered_before", pa.int64()),   # depth already covered by the execution's earlier paths
        ("new_tokens", pa.int64()),       # packed tokens it added (below the nearest selected ancestor)
        ("uncovered_generated", pa.int64()),
        ("probability", pa.float64()),    # draw probability when selected
        ("n_weighted", pa.int64()),
        ("token_weight", pa.float64()),
        ("advantage", pa.float64()),      # the execution-level term
        ("reason", pa.string()),
    ],
    metadata=_META,
)

# Per selected path, runs of tokens with the same node, provenance, weight and advantage: what each
# token of the trained sequence got and why (trained / context / covered / pruned).
TRAIN_SEGMENTS = pa.schema(
    [
        ("run_id", pa.string()),
        ("step", pa.int64()),
        ("execution_id", pa.string()),
        ("call_index", pa.int32()),
        ("rank", pa.int32()),
        ("node_id", pa.int32()),
        ("depth_start", pa.int64()),
        ("depth_end", pa.int64()),
        ("generated", pa.bool_()),
        ("weight", pa.float64()),
        ("advantage", pa.float64()),
        ("status", pa.string()),
    ],
    metadata=_META,
)

# Executions left out of a step's training, the stage that left them out, and why.
EXCLUSIONS = pa.schema(
    [
        ("run_id", pa.string()),
        ("step", pa.int64()),
        ("execution_id", pa.string()),
        ("stage", pa.string()),
        ("reason", pa.string()),
    ],
    metadata=_META,
)

SCHEMAS: dict[str, pa.Schema] = {
    "executions": EXECUTIONS,
    "calls": CALLS,
    "train_tokens": TRAIN_TOKENS,
    "scores": SCORES,
    "tree_nodes": TREE_NODES,
    "tree_leaves": TREE_LEAVES,
    "tree_paths": TREE_PATHS,
    "train_segments": TRAIN_SEGMENTS,
    "exclusions": EXCLUSIONS,
}

# Columns added after version 1, with the version that added them: files of an older version lack them
# (they read as NULL); any other missing column is a schema mismatch.
ADDED_IN: dict[str, dict[str, int]] = {
    "calls": {"tool_call_ids": 2, "payload_uri": 2, "progress": 3, "tool_parse": 4, "tool_spans": 4,
              "rerender_drift": 5},
    "scores": {"multiplicity": 2, "kept_as": 2},
    "executions": {"evaluator_s": 6},
}

_EXEC_FIELDS = [f.name for f in EXECUTIONS if f.name not in ("n_calls", "tokens_generated")]


def executions_table(records: list[ExecutionRecord]) -> pa.Table:
    """One row per execution (its scores and counters; the calls go to `calls_table`)."""
    cols: dict[str, list[Any]] = {name: [getattr(r, name) for r in records] for name in _EXEC_FIELDS}
    cols["n_calls"] = [len(r.calls) for r in records]
    cols["tokens_generated"] = [r.tokens_generated for r in records]
    return pa.Table.from_pydict(cols, schema=EXECUTIONS)


def calls_table(records: list[ExecutionRecord]) -> pa.Table:
    """One row per model call, its prompt stored as (parent_call, prefix_len, new_prompt_ids)."""
    # a fork's first `fork_call` calls are its parent's, stored once with the parent
    rows = [(r, c) for r in records for c in r.calls[r.fork_call:]]
    for r, c in rows:
        _check_call(r, c)
    cols = {
        "run_id": [r.run_id for r, _ in rows],
        "step": [r.step for r, _ in rows],
        "execution_id": [r.execution_id for r, _ in rows],
        "call_index": [c.call_index for _, c in rows],
        "context_index": [c.context_index for _, c in rows],
        "role": [c.role for _, c in rows],
        "parent_call": [c.parent_call for _, c in rows],
        "prefix_len": [c.prefix_len for _, c in rows],
        "prompt_len": [len(c.prompt_ids) for _, c in rows],
        "new_prompt_ids": [c.delta() for _, c in rows],
        "completion_ids": [c.completion_ids for _, c in rows],
        "logprobs": [c.logprobs for _, c in rows],
        "versions": [c.versions for _, c in rows],
        "finish_reason": [c.finish_reason for _, c in rows],
        "t_start": [c.t_start for _, c in rows],
        "t_end": [c.t_end for _, c in rows],
        "tool_call_ids": [c.tool_call_ids for _, c in rows],
        "payload_uri": [None] * len(rows),       # set by Lake.write_part for a prompt too large to inline
        "progress": [c.progress for _, c in rows],
        "tool_parse": [c.tool_parse for _, c in rows],
        "tool_spans": [c.tool_spans for _, c in rows],
        "rerender_drift": [c.rerender_drift for _, c in rows],
    }
    return pa.Table.from_pydict(cols, schema=CALLS)


def _check_call(r: ExecutionRecord, c: CallRecord) -> None:
    # Fail at write time, not months later when the prompt cannot be rebuilt.
    where = f"execution {r.execution_id!r} call {c.call_index}"
    if c.execution_id != r.execution_id:
        raise ValueError(f"{where}: belongs to execution {c.execution_id!r}")
    if not (len(c.completion_ids) == len(c.logprobs) == len(c.versions)):
        raise ValueError(f"{where}: completion_ids, logprobs and versions differ in length")
    if c.parent_call < 0 and c.prefix_len != 0:
        raise ValueError(f"{where}: prefix_len {c.prefix_len} without a parent call")
    if not 0 <= c.prefix_len <= len(c.prompt_ids):
        raise ValueError(f"{where}: prefix_len {c.prefix_len} outside the prompt")
    if c.parent_call >= c.call_index:
        raise ValueError(f"{where}: parent call {c.parent_call} does not precede it")


def train_tokens_table(rows: Iterable[Mapping[str, Any]]) -> pa.Table:
    """The trainer's rows (dicts with TRAIN_TOKENS' columns) as a table."""
    return pa.Table.from_pylist(list(rows), schema=TRAIN_TOKENS)


def read_executions(executions: pa.Table, calls: pa.Table | None = None) -> list[ExecutionRecord]:
    """Rebuild ExecutionRecords (with full CallRecords when `calls` is given) from lake tables.

    Calls are matched on (run_id, step, execution_id); an execution's call_index must run 0..n-1.
    Without `calls` the records come back with empty `calls`.
    """
    by_exec: dict[tuple[str, int, str], list[dict[str, Any]]] = defaultdict(list)
    if calls is not None:
        for row in calls.to_pylist():
            by_exec[(row["run_id"], row["step"], row["execution_id"])].append(row)
    rows = executions.to_pylist()
    forked = {(r["run_id"], r["step"], r["execution_id"]): (r["fork_of"], r["fork_call"]) for r in rows}
    full: dict[tuple[str, int, str], list[dict[str, Any]]] = {}

    def all_calls(key) -> list[dict[str, Any]]:
        """An execution's call rows, a fork's shared ones taken (recursively) from what it was forked from."""
        if key not in full:
            own = sorted(by_exec.get(key, []), key=lambda r: r["call_index"])
            fork_of, fork_call = forked.get(key, ("", 0))
            if fork_call:
                pkey = (key[0], key[1], fork_of)
                if pkey not in forked and calls is not None:
                    raise ValueError(f"execution {key[2]!r}: forked from {fork_of!r}, which is not in this read")
                parent = all_calls(pkey)
                if [r["call_index"] for r in parent[:fork_call]] != list(range(fork_call)) and calls is not None:
                    raise ValueError(f"execution {key[2]!r}: forked from {fork_of!r}, whose first "
                                     f"{fork_call} calls are not in this read")
                own = [dict(r, execution_id=key[2]) for r in parent[:fork_call]] + own
            full[key] = own
        return full[key]

    out = []
    for row in rows:
        # a column newer than the file reads as NULL: the record's default stands
        rec = ExecutionRecord(**{name: row[name] for name in _EXEC_FIELDS
                                 if row.get(name) is not None or name not in ADDED_IN["executions"]})
        rec.calls = _rebuild_calls(rec.execution_id, list(all_calls((row["run_id"], row["step"], row["execution_id"]))))
        out.append(rec)
    return out


def _rebuild_calls(execution_id: str, rows: list[dict[str, Any]]) -> list[CallRecord]:
    rows.sort(key=lambda r: r["call_index"])
    if [r["call_index"] for r in rows] != list(range(len(rows))):
        raise ValueError(f"execution {execution_id!r}: call_index is not 0..{len(rows) - 1}")
    prompts = rebuild_prompts(
        [(r["parent_call"], r["prefix_len"], r["new_prompt_ids"], r["completion_ids"]) for r in rows]
    )
    calls = []
    for r, prompt in zip(rows, prompts):
        if len(prompt) != r["prompt_len"]:
            raise ValueError(f"execution {execution_id!r} call {r['call_index']}: prompt rebuilt to "
                             f"{len(prompt)} tokens, stored prompt_len is {r['prompt_len']}")
        calls.append(CallRecord(
            execution_id=execution_id, call_index=r["call_index"], context_index=r["context_index"],
            role=r["role"], prompt_ids=prompt, completion_ids=r["completion_ids"],
            logprobs=r["logprobs"], versions=r["versions"], finish_reason=r["finish_reason"],
            parent_call=r["parent_call"], prefix_len=r["prefix_len"],
            t_start=r["t_start"], t_end=r["t_end"], tool_call_ids=r.get("tool_call_ids") or [],
            progress=r.get("progress"), tool_parse=r.get("tool_parse") or "", tool_spans=r.get("tool_spans") or [],
            rerender_drift=r.get("rerender_drift"),
        ))
    return calls


def duckdb_type(t: pa.DataType) -> str:
    """DuckDB's name for an Arrow type of these schemas (for empty views)."""
    if pa.types.is_list(t):
        return duckdb_type(t.value_type) + "[]"
    names = {pa.string(): "VARCHAR", pa.int64(): "BIGINT", pa.int32(): "INTEGER",
             pa.float64(): "DOUBLE", pa.float32(): "FLOAT", pa.bool_(): "BOOLEAN"}
    return names[t]
