-- Mutant: an enqueue that drops rows of a batch.
-- Bug: an "idempotent enqueue" that drops duplicate submissions inside a batch by content,
-- DISTINCT ON (account_id, target_url, payload): two different jobs with the same payload
-- in one batch are silently collapsed into one, and the whole batch is acknowledged (lost).
-- expect: lost
-- scenario: noisy-neighbour

-- name: enqueue
WITH
-- The batch as rows: one statement and one round trip for the whole batch.
batch AS (
    -- MUTANT: duplicate submissions dropped by content
    SELECT DISTINCT ON (account_id, target_url, payload) *
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
    RETURNING id
)
SELECT count(*) AS enqueued FROM inserted;
