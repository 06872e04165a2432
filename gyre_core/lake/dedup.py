"""Content-hash deduplication of executions, in DuckDB: identical executions of a task become one row
with a `multiplicity`, so group-relative advantages and the loss still count every execution.

    from gyre_core.lake import connect
    from gyre_core.lake.dedup import dedup_executions
    kept = dedup_executions(connect("data/lake", run_id="run1"), step=3)   # pyarrow Table + multiplicity

Two executions are duplicates when they belong to the same (run, step, task) and carry the same token
content: every call's role, context, parent, prefix length, prompt length, new prompt ids, completion
ids, behaviour log-probs and policy versions (`execution_content.content_hash`), the same fork point, the
same call and token counts, and the same status and reward. So one of them, trained with its
multiplicity as weight, gives exactly the loss and gradient of all of them (the log-probs are in the
key for that: the PPO ratio reads them; they are equal for equal tokens unless the engine is
nondeterministic). An execution that another execution was forked from is never collapsed (neither
away nor into): the fork's shared calls are stored with it. The kept execution of a set is the one
with the smallest id.

The query runs keys first (a GROUP BY over hashes and counts only, no token lists), then joins the kept
execution ids back to `executions` for the full rows; `dedup_groups` is the keys alone, with the ids
each kept execution stands for. The content hash is DuckDB's 64-bit `hash` over the call rows, combined
with the counts and reward in the key: for two different executions to be merged, they would need
equal counts, rewards and a 64-bit hash collision.
"""
from __future__ import annotations

import duckdb
import pyarrow as pa

# A view over `calls` and `executions` (created by `gyre_core.lake.sql.connect`): one row per execution.
EXECUTION_CONTENT_VIEW = """
CREATE VIEW execution_content AS
WITH call_hashes AS (
    SELECT run_id, step, execution_id,
           hash(list(hash(call_index, context_index, role, parent_call, prefix_len, prompt_len,
                          new_prompt_ids, payload_uri, completion_ids, logprobs, versions)
                     ORDER BY call_index)) AS calls_hash
    FROM calls
    GROUP BY run_id, step, execution_id
),
fork_parents AS (
    SELECT DISTINCT run_id, step, fork_of AS execution_id FROM executions WHERE fork_call > 0
)
SELECT e.run_id, e.step, e.task_id, e.execution_id,
       coalesce(h.calls_hash, 0::UBIGINT) AS content_hash,
       e.fork_of, e.fork_call, e.n_calls, e.tokens_generated, e.status, e.reward,
       p.execution_id IS NOT NULL AS is_fork_parent
FROM executions e
LEFT JOIN call_hashes h USING (run_id, step, execution_id)
LEFT JOIN fork_parents p USING (run_id, step, execution_id)
"""

# Keys first: which execution of each duplicate set is kept, and how many it stands for.
DEDUP_KEYS = """
SELECT run_id, step, task_id, min(execution_id) AS execution_id, count(*)::INTEGER AS multiplicity,
       list(execution_id ORDER BY execution_id) AS members
FROM execution_content
WHERE {where}
GROUP BY run_id, step, task_id, content_hash, fork_of, fork_call, n_calls, tokens_generated, status, reward,
         CASE WHEN is_fork_parent THEN execution_id END
"""

# ... then the join back to the full rows.
DEDUP = """
WITH keys AS ({keys})
SELECT e.*, k.multiplicity
FROM keys k JOIN executions e USING (run_id, step, execution_id)
ORDER BY e.run_id, e.step, e.execution_id
"""


def dedup_sql(step: int | None = None) -> tuple[str, list]:
    """The dedup query (and its parameters) over the views of `connect()`, for one step or all."""
    where, params = ("step = ?", [int(step)]) if step is not None else ("true", [])
    return DEDUP.format(keys=DEDUP_KEYS.format(where=where)), params


def dedup_groups(con: duckdb.DuckDBPyConnection, step: int | None = None) -> pa.Table:
    """The keys alone: one row per duplicate set (a unique execution is a set of one) with the kept
    `execution_id`, its `multiplicity` and `members` (every id it stands for, itself first)."""
    where, params = ("step = ?", [int(step)]) if step is not None else ("true", [])
    return con.sql(DEDUP_KEYS.format(where=where) + "ORDER BY run_id, step, execution_id",
                   params=params).to_arrow_table()


def dedup_executions(con: duckdb.DuckDBPyConnection, step: int | None = None) -> pa.Table:
    """Deduplicated executions (all `executions` columns plus `multiplicity`), ordered by id."""
    sql, params = dedup_sql(step)
    return con.sql(sql, params=params).to_arrow_table()
