-- Duplicate executions per task by content hash: executions, distinct contents and how many dedup would collapse.
-- Per run, step and task (only tasks where some content repeats). Built on the `execution_content` view;
-- `kept` counts the groups that gyre_core.lake.dedup keeps (same content hash, fork point, call and token
-- counts, status and reward; an execution something was forked from is never merged), so
-- collapsible = executions - kept, and `largest_set` is the most executions one kept row stands for.
WITH dedup_groups AS (
    SELECT run_id, step, task_id, count(*) AS n
    FROM execution_content
    GROUP BY run_id, step, task_id, content_hash, fork_of, fork_call, n_calls, tokens_generated, status, reward,
             CASE WHEN is_fork_parent THEN execution_id END
),
kept AS (
    SELECT run_id, step, task_id, sum(n)::BIGINT AS executions, count(*) AS kept, max(n) AS largest_set
    FROM dedup_groups
    GROUP BY run_id, step, task_id
),
contents AS (
    SELECT run_id, step, task_id, count(DISTINCT content_hash) AS distinct_contents
    FROM execution_content
    GROUP BY run_id, step, task_id
)
SELECT run_id, step, task_id, k.executions, c.distinct_contents, k.kept,
       k.executions - k.kept AS collapsible, k.largest_set
FROM kept k JOIN contents c USING (run_id, step, task_id)
WHERE k.executions > c.distinct_contents
ORDER BY run_id, step, task_id
