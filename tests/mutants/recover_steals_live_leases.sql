-- Mutant: recovery that steals live leases.
-- Bug: a "safety margin" added to the expiry test with the wrong sign: recovery takes every
-- lease that expires within the next 2 s (locked_until < now() + 2 s) instead of those
-- expired for a while, so a job whose call is still running is handed to another worker.
-- expect: duplicate_unexplained
-- scenario: long-calls

-- name: recover
WITH
-- Expired leases from the processing partial index, oldest deadline first. SKIP LOCKED lets
-- every worker run recovery at once, and never waits on a result write in flight (that row
-- is locked; if the write lands, the job is no longer ours to recover).
expired AS (
    SELECT j.id, j.lease_token
    FROM jobs AS j
    -- MUTANT: margin with the wrong sign: live leases count as expired
    WHERE j.status = 'PROCESSING' AND j.locked_until < skiplock_now() + interval '2 seconds'
    ORDER BY j.locked_until
    LIMIT %(limit)s
    FOR UPDATE OF j SKIP LOCKED
),
-- Retry now, or dead-letter at max_attempts; clearing the token fences the old holder.
moved AS (
    UPDATE jobs AS j
    SET status = CASE WHEN j.attempts >= j.max_attempts THEN 'FAILED' ELSE 'RETRYING' END,
        next_attempt_at = CASE WHEN j.attempts >= j.max_attempts THEN NULL
            ELSE skiplock_now() END,
        finished_at = CASE WHEN j.attempts >= j.max_attempts THEN skiplock_now() END,
        last_error = 'lease expired (attempt ' || j.attempts || ')',
        locked_until = NULL,
        lease_token = NULL
    FROM expired AS e
    WHERE j.id = e.id
    RETURNING j.id, e.lease_token
),
-- Close the expired execution's row as lease_expired (its real end is unknown).
attempt_end AS (
    UPDATE job_attempts AS a
    SET finished_at = skiplock_now(), outcome = 'lease_expired'
    FROM moved AS m
    WHERE a.lease_token = m.lease_token
)
SELECT count(*) AS recovered FROM moved;
