-- Mutant: a renewal that does not extend the lease.
-- Bug: renew was meant never to shorten a lease, GREATEST(locked_until, now() + extend), and
-- was written with LEAST: it always keeps the old deadline, so a batch that runs past its
-- first lease is recovered and handed to another worker while its calls still run. The
-- recovered attempts use up max_attempts while the calls succeed, so jobs whose scripts
-- complete end FAILED (state_mismatch, in every run). Two 2xx for one job
-- (duplicate_unexplained) need the first call's answer and the redelivery's to both land,
-- which depends on timing: with workers that refill their slots, a loaded CI machine once
-- showed none in seed 1 (early_retry, limit_exceeded and state_mismatch instead).
-- expect: state_mismatch
-- scenario: long-calls

-- name: renew
WITH
-- The leases to extend, numbered in the caller's order.
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
-- Extend only leases still held (same token, still PROCESSING).
extended AS (
    UPDATE jobs AS j
    -- MUTANT: LEAST for GREATEST: the deadline never moves
    SET locked_until = LEAST(j.locked_until, skiplock_lease_base() + %(extend)s::interval)
    FROM held AS h
    JOIN held_rows AS l ON l.id = h.job_id
    WHERE j.id = h.job_id AND j.lease_token = h.lease_token AND j.status = 'PROCESSING'
    RETURNING h.ord, j.locked_until
),
-- A renewal for a lease already lost is a fenced caller too.
fenced AS (
    INSERT INTO fenced_writes (job_id, attempt, lease_token, worker, operation, at)
    SELECT h.job_id, h.attempt, h.lease_token, h.worker, 'renew', skiplock_now()
    FROM held AS h
    WHERE h.ord NOT IN (SELECT ord FROM extended)
)
SELECT ord, locked_until FROM extended;
