-- Mutant: release that keeps the attempt.
-- Bug: release puts the job back as due but forgets attempts - 1, so every lease given back
-- unexecuted (a graceful stop between claim and call) still uses up one of the job's
-- attempts, and a job released often enough is dead-lettered before its script could
-- complete (state_mismatch, lost).
-- expect: state_mismatch
-- scenario: exhaust-attempts

-- name: release
WITH
-- The leases given back unexecuted, numbered in the caller's order.
held AS (
    SELECT *
    FROM unnest(
        %(ords)s::integer[], %(job_ids)s::uuid[], %(lease_tokens)s::uuid[],
        %(attempts)s::integer[], %(workers)s::text[]
    ) AS h (ord, job_id, lease_token, attempt, worker)
),
-- Lock the rows this call still holds, in id order, before changing any: every writer then
-- takes its locks in one order, so overlapping batches in opposite orders queue instead of
-- deadlocking (and losing a valid batch). Rows no longer held are not locked; they are fenced.
held_rows AS MATERIALIZED (
    SELECT j.id
    FROM jobs AS j
    JOIN held AS x ON x.job_id = j.id AND x.lease_token = j.lease_token
    WHERE j.status = 'PROCESSING'
    ORDER BY j.id
    FOR UPDATE OF j
),
-- Back to due now, the attempt not counted: PENDING if it never ran, else RETRYING.
released AS (
    UPDATE jobs AS j
    SET status = CASE WHEN j.attempts - 1 = 0 THEN 'PENDING' ELSE 'RETRYING' END,
        next_attempt_at = CASE WHEN j.attempts - 1 = 0 THEN NULL ELSE skiplock_now() END,
        -- MUTANT: attempts = j.attempts - 1 forgotten
        locked_until = NULL,
        lease_token = NULL
    FROM held AS h
    JOIN held_rows AS l ON l.id = h.job_id
    WHERE j.id = h.job_id AND j.lease_token = h.lease_token AND j.status = 'PROCESSING'
    RETURNING h.ord, h.lease_token
),
-- Close the attempt's row as released (it never executed).
attempt_end AS (
    UPDATE job_attempts AS a
    SET finished_at = skiplock_now(), outcome = 'released'
    FROM released AS r
    WHERE a.lease_token = r.lease_token
),
-- A release for a lease already lost is recorded as fenced.
fenced AS (
    INSERT INTO fenced_writes (job_id, attempt, lease_token, worker, operation, at)
    SELECT h.job_id, h.attempt, h.lease_token, h.worker, 'release', skiplock_now()
    FROM held AS h
    WHERE h.ord NOT IN (SELECT ord FROM released)
)
SELECT ord FROM released;
