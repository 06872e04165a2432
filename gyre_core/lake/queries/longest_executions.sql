-- Longest executions: the 20 with the longest wall time (ties broken by tokens generated), with calls and status.
-- wall_s = t_end - t_start; model_s = the summed duration of its stored model calls; tokens_rank ranks
-- tokens_generated among all executions in view (1 = most). A fork's shared calls are stored (and counted
-- in prompt_tokens / model_s) with the execution it was forked from; `calls` is its full n_calls.
WITH c AS (
    SELECT run_id, step, execution_id,
           sum(prompt_len) AS prompt_tokens,
           max(prompt_len) AS longest_prompt,
           sum(t_end - t_start) AS model_s
    FROM calls
    GROUP BY run_id, step, execution_id
),
ranked AS (
    SELECT *, t_end - t_start AS wall_s, rank() OVER (ORDER BY tokens_generated DESC) AS tokens_rank
    FROM executions
)
SELECT r.run_id, r.step, r.split, r.task_id, r.execution_id, r.status,
       round(r.wall_s, 3) AS wall_s, round(c.model_s, 3) AS model_s,
       r.n_calls AS calls, r.turns, r.tokens_generated, r.tokens_rank,
       coalesce(c.prompt_tokens, 0) AS prompt_tokens, c.longest_prompt, r.reward
FROM ranked r LEFT JOIN c USING (run_id, step, execution_id)
ORDER BY r.wall_s DESC NULLS LAST, r.tokens_generated DESC, r.run_id, r.step, r.execution_id
LIMIT 20
