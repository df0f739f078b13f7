-- Mutant: an enqueue that drops the jobs of one kind of account.
-- Bug: enqueue skips jobs of suspended accounts with a join on concurrency_limit > 0, and
-- forgets that NULL means unlimited: every job of an unlimited account is acknowledged and
-- never inserted.
-- expect: lost
-- scenario: noisy-neighbour

-- name: enqueue
WITH
-- The batch as rows: one statement and one round trip for the whole batch.
batch AS (
    SELECT *
    FROM unnest(
        %(job_ids)s::uuid[], %(account_ids)s::text[], %(target_urls)s::text[],
        %(payloads)s::jsonb[], %(run_ats)s::timestamptz[], %(max_attempts)s::integer[]
    ) AS b (id, account_id, target_url, payload, run_at, max_attempts)
),
-- Accounts the batch names that do not exist yet are created unlimited, so the foreign key
-- holds; existing accounts (and their limits) are left alone.
new_accounts AS (
    INSERT INTO accounts (id)
    SELECT DISTINCT account_id FROM batch
    ON CONFLICT (id) DO NOTHING
),
-- A missing run_at means due now, by the queue's clock.
inserted AS (
    INSERT INTO jobs (id, account_id, target_url, payload, status, run_at, max_attempts)
    SELECT id, account_id, target_url, payload, 'PENDING', COALESCE(run_at, skiplock_now()),
        max_attempts
    FROM batch
    -- MUTANT: NULL (unlimited) > 0 is not true: unlimited accounts' jobs dropped
    WHERE EXISTS (
        SELECT 1 FROM accounts AS a
        WHERE a.id = batch.account_id AND a.concurrency_limit > 0
    )
    RETURNING id
)
SELECT count(*) AS enqueued FROM inserted;
