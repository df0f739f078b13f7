-- Mutant: recovery that counts the attempt of a claim nobody received.
-- Bug: an expired lease whose worker never confirmed receiving it (the claim committed as its
-- connection was terminated, so the worker saw an error and never the leases) is recovered
-- as if it had run: its attempt stays counted, and it is dead-lettered at max_attempts. A
-- job scripted 503, 503, 200 with max_attempts 3 whose claim is lost so once is
-- dead-lettered after two deliveries (state_mismatch, lost). This was the reference's own
-- behaviour before receipts.
-- expect: state_mismatch, lost
-- scenario: db-faults

-- name: recover_unreceived
WITH
-- Expired, never-received leases, oldest deadline first; SKIP LOCKED as in `recover`.
expired AS (
    SELECT j.id, j.lease_token
    FROM jobs AS j
    WHERE j.status = 'PROCESSING' AND j.locked_until < skiplock_now()
      AND j.received_token IS DISTINCT FROM j.lease_token
    ORDER BY j.locked_until
    LIMIT %(limit)s
    FOR UPDATE OF j SKIP LOCKED
),
-- Retry now, or dead-letter at max_attempts, as for a lease that ran.
given_back AS (
    UPDATE jobs AS j
    -- MUTANT: the attempt is kept (no attempts - 1), so it dead-letters at max_attempts.
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
-- Close the claim's attempts row as expired.
attempt_end AS (
    UPDATE job_attempts AS a
    SET finished_at = skiplock_now(), outcome = 'lease_expired'
    FROM given_back AS g
    WHERE a.lease_token = g.lease_token
)
SELECT count(*) AS recovered FROM given_back;
