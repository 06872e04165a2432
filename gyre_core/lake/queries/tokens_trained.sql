-- Tokens trained per execution: trained sequences, their tokens and trainable tokens, with reward and advantage.
-- From `train_tokens` (one row per sequence: a sampled root-to-leaf path; `tokens` were forwarded, `trainable`
-- bore loss, `weighted` = sum(n_trainable * weight) is what the sampler's weights made of them), joined with the
-- execution's reward, advantage and exclusion from `scores` (NULL where its step has no scores part).
WITH t AS (
    SELECT run_id, step, execution_id,
           count(*) AS sequences,
           sum(n_tokens) AS tokens,
           sum(n_trainable) AS trainable,
           sum(n_trainable * weight) AS weighted
    FROM train_tokens
    GROUP BY run_id, step, execution_id
)
SELECT t.run_id, t.step, e.task_id, t.execution_id, e.status, e.tokens_generated,
       t.sequences, t.tokens, t.trainable, round(t.weighted, 4) AS weighted,
       s.reward, s.advantage, s.excluded
FROM t
LEFT JOIN executions e USING (run_id, step, execution_id)
LEFT JOIN scores s USING (run_id, step, execution_id)
ORDER BY t.run_id, t.step, t.execution_id
