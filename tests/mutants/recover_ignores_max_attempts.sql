-- Mutant: recovery that ignores max_attempts.
-- Bug: recovery always moves an expired lease back to RETRYING, due now, even when the
-- expired attempt was the job's last one, so a job killed on its last attempt is claimed
-- and delivered once more than max_attempts allows. It shows only when a fault hits the last
-- attempt of a job that fails anyway, which mixed and kill-workers leave to luck (seeds were
-- missed). exhaust-attempts aims a kill_worker there (`aim = "last_attempt"`: a worker in
-- the middle of an always_hang job's third attempt), so every seed meets it.
-- expect: attempts_exceeded
-- scenario: exhaust-attempts

-- name: recover
WITH
-- Expired leases from the processing partial index, oldest deadline first. SKIP LOCKED lets
-- every worker run recovery at once, and never waits on a result write in flight (that row
-- is locked; if the write lands, the job is no longer ours to recover).
expired AS (
    SELECT j.id, j.lease_token
    FROM jobs AS j
    WHERE j.status = 'PROCESSING' AND j.locked_until < skiplock_now()
    ORDER BY j.locked_until
    LIMIT %(limit)s
    FOR UPDATE OF j SKIP LOCKED
),
-- Retry now, or dead-letter at max_attempts; clearing the token fences the old holder.
moved AS (
    UPDATE jobs AS j
    -- MUTANT: always RETRYING, whatever attempts and max_attempts say
    SET status = 'RETRYING',
        next_attempt_at = skiplock_now(),
        finished_at = NULL,
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
