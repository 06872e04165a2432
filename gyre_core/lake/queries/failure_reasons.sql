-- Failure reasons: per run, step and split, how many executions ended in each status other than done, and why.
-- `error` is the harness's reason (NULL when it left none); `share` is of all executions of that run, step
-- and split; `example` is one execution to look at. Why a scored execution was left out of training is in
-- `scores.reason` and `exclusions`.
WITH totals AS (
    SELECT run_id, step, split, count(*) AS all_executions
    FROM executions
    GROUP BY run_id, step, split
)
SELECT e.run_id, e.step, e.split, e.status, nullif(e.error, '') AS error,
       count(*) AS executions,
       count(DISTINCT e.task_id) AS tasks,
       round(count(*) / any_value(t.all_executions), 4) AS share,
       min(e.execution_id) AS example
FROM executions e JOIN totals t USING (run_id, step, split)
WHERE e.status IS DISTINCT FROM 'done'
GROUP BY e.run_id, e.step, e.split, e.status, nullif(e.error, '')
ORDER BY e.run_id, e.step, e.split, executions DESC, e.status, error NULLS FIRST
