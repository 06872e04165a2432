-- Per-step summary: executions, success, reward, tokens and time of every step of every run.
-- Steps are RL steps (>= 0), -1 demonstrations, -2 evaluations (several parts share -2; `split` tells them apart).
WITH ex AS (
    SELECT run_id, step, split,
           count(*) AS executions,
           count(*) FILTER (WHERE success) AS successes,
           count(*) FILTER (WHERE status = 'failed') AS failed,
           count(*) FILTER (WHERE status = 'timeout') AS timeouts,
           avg(reward) AS mean_reward,
           avg(partial) AS mean_partial,
           sum(tokens_generated) AS tokens_generated,
           max(t_end) - min(t_start) AS wall_s
    FROM executions
    GROUP BY run_id, step, split
),
ca AS (
    SELECT c.run_id, c.step, e.split,
           count(*) AS calls,
           sum(c.prompt_len) AS prompt_tokens,
           max(c.prompt_len) AS longest_prompt,
           avg(c.t_end - c.t_start) AS mean_call_s
    FROM calls c JOIN executions e USING (run_id, step, execution_id)
    GROUP BY c.run_id, c.step, e.split
)
SELECT ex.run_id, ex.step, ex.split, ex.executions, ex.successes,
       round(ex.successes / ex.executions, 4) AS success_rate,
       ex.failed, ex.timeouts,
       round(ex.mean_reward, 4) AS mean_reward, round(ex.mean_partial, 4) AS mean_partial,
       coalesce(ca.calls, 0) AS calls, ex.tokens_generated, coalesce(ca.prompt_tokens, 0) AS prompt_tokens,
       ca.longest_prompt, round(ca.mean_call_s, 4) AS mean_call_s, round(ex.wall_s, 3) AS wall_s
FROM ex LEFT JOIN ca USING (run_id, step, split)
ORDER BY ex.run_id, ex.step, ex.split
