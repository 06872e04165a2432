-- Per-step summary: executions, success, reward, tokens and time of every step of every run.
-- Steps are RL steps (>= 0), -1 demonstrations, -2 evaluations. Several parts share -2 (eval-before, eval-after,
-- eval-control): `split` tells the modes apart and `eval_version`, the policy version evaluated (before = 0,
-- control = -3), the parts; it is NULL for RL steps, whose executions span versions. `limits` counts
-- executions that stopped at a turn or token limit (`timeouts`: the wall clock).
WITH ex AS (
    SELECT run_id, step, split, CASE WHEN step < 0 THEN policy_version END AS eval_version,
           count(*) AS executions,
           count(*) FILTER (WHERE success) AS successes,
           count(*) FILTER (WHERE status = 'failed') AS failed,
           count(*) FILTER (WHERE status = 'timeout') AS timeouts,
           count(*) FILTER (WHERE status IN ('turn_limit', 'token_limit')) AS limits,
           avg(reward) AS mean_reward,
           avg(partial) AS mean_partial,
           sum(tokens_generated) AS tokens_generated,
           max(t_end) - min(t_start) AS wall_s
    FROM executions
    GROUP BY ALL
),
ca AS (
    SELECT c.run_id, c.step, e.split, CASE WHEN e.step < 0 THEN e.policy_version END AS eval_version,
           count(*) AS calls,
           sum(c.prompt_len) AS prompt_tokens,
           max(c.prompt_len) AS longest_prompt,
           avg(c.t_end - c.t_start) AS mean_call_s
    FROM calls c JOIN executions e USING (run_id, step, execution_id)
    GROUP BY ALL
)
SELECT ex.run_id, ex.step, ex.split, ex.eval_version, ex.executions, ex.successes,
       round(ex.successes / ex.executions, 4) AS success_rate,
       ex.failed, ex.timeouts, ex.limits,
       round(ex.mean_reward, 4) AS mean_reward, round(ex.mean_partial, 4) AS mean_partial,
       coalesce(ca.calls, 0) AS calls, ex.tokens_generated, coalesce(ca.prompt_tokens, 0) AS prompt_tokens,
       ca.longest_prompt, round(ca.mean_call_s, 4) AS mean_call_s, round(ex.wall_s, 3) AS wall_s
FROM ex LEFT JOIN ca ON ca.run_id = ex.run_id AND ca.step = ex.step AND ca.split = ex.split
                     AND ca.eval_version IS NOT DISTINCT FROM ex.eval_version
ORDER BY ex.run_id, ex.step, ex.split, ex.eval_version
