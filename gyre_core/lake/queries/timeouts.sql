-- Executions that reached a limit: status timeout (wall clock), turn_limit or token_limit, and what they left.
-- `partial` is the credit for the work left behind, `reward` the execution's score, `scored_reward` /
-- `advantage` / `excluded` what training made of it (`scores`; NULL without a scores part), and
-- `last_finish` the finish reason of its last stored call.
WITH last_call AS (
    SELECT run_id, step, execution_id, arg_max(finish_reason, call_index) AS last_finish
    FROM calls
    GROUP BY run_id, step, execution_id
)
SELECT e.run_id, e.step, e.split, e.task_id, e.execution_id, e.status,
       e.turns, e.n_calls AS calls, e.tokens_generated, round(e.t_end - e.t_start, 3) AS wall_s,
       e.partial, e.reward, s.reward AS scored_reward, s.advantage, s.excluded, l.last_finish
FROM executions e
LEFT JOIN scores s USING (run_id, step, execution_id)
LEFT JOIN last_call l USING (run_id, step, execution_id)
WHERE e.status IN ('timeout', 'turn_limit', 'token_limit')
ORDER BY e.run_id, e.step, e.execution_id
