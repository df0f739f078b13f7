-- Mutant: finish that never dead-letters a transient failure.
-- Bug: the status CASE fails only permanent errors; a transient failure on the last attempt
-- goes back to RETRYING, so an always-503 job is delivered again and again past max_attempts.
-- Those jobs never end, so the gate waits out its whole drain (about 50 s); the extra
-- deliveries come during the load, so the test waits 8 s of drain, not 40.
-- expect: attempts_exceeded
-- scenario: exhaust-attempts
-- set: drain_timeout=8

-- name: finish
WITH
-- The results, one row each, numbered in the caller's order (ord).
results AS (
    SELECT *
    FROM unnest(
        %(ords)s::integer[], %(job_ids)s::uuid[], %(lease_tokens)s::uuid[],
        %(attempts)s::integer[], %(workers)s::text[], %(outcomes)s::text[],
        %(http_statuses)s::integer[], %(errors)s::text[], %(retry_delays)s::interval[],
        %(finished_ats)s::timestamptz[]
    ) AS r (ord, job_id, lease_token, attempt, worker, outcome, http_status, error,
        retry_delay, finished_at)
),
-- Lock the rows this call still holds, in id order, before changing any: every writer then
-- takes its locks in one order, so overlapping batches in opposite orders queue instead of
-- deadlocking (and losing a valid batch). Rows no longer held are not locked; they are fenced.
held_rows AS MATERIALIZED (
    SELECT j.id
    FROM jobs AS j
    JOIN results AS x ON x.job_id = j.id AND x.lease_token = j.lease_token
    WHERE j.status = 'PROCESSING'
    ORDER BY j.id
    FOR UPDATE OF j
),
-- Apply each result only where its token still holds the lease (still PROCESSING, same
-- token). The row lock re-checks that against the latest row version, so a concurrent
-- recovery or claim wins or loses cleanly. Transient failures past max_attempts
-- become dead letters, keeping the last error.
applied AS (
    UPDATE jobs AS j
    SET status = CASE
            WHEN r.outcome = 'success' THEN 'COMPLETED'
            WHEN r.outcome = 'permanent' THEN 'FAILED'  -- MUTANT: no max_attempts test
            ELSE 'RETRYING'
        END,
        next_attempt_at = CASE
            WHEN r.outcome = 'transient'
                THEN skiplock_now() + r.retry_delay
        END,
        last_error = CASE WHEN r.outcome = 'success' THEN j.last_error ELSE r.error END,
        finished_at = CASE
            WHEN r.outcome = 'transient' THEN NULL
            ELSE skiplock_now()
        END,
        locked_until = NULL,
        lease_token = NULL
    FROM results AS r
    JOIN held_rows AS l ON l.id = r.job_id
    WHERE j.id = r.job_id AND j.lease_token = r.lease_token AND j.status = 'PROCESSING'
    RETURNING r.ord, r.lease_token
),
-- Close each applied attempt's row with its outcome.
attempt_end AS (
    UPDATE job_attempts AS a
    SET finished_at = COALESCE(r.finished_at, skiplock_now()), outcome = r.outcome,
        http_status = r.http_status, error = r.error
    FROM applied AS p
    JOIN results AS r ON r.ord = p.ord
    WHERE a.lease_token = p.lease_token
),
-- Every result refused because its lease had passed on is recorded: stale-write evidence.
fenced AS (
    INSERT INTO fenced_writes (job_id, attempt, lease_token, worker, operation, outcome, at)
    SELECT r.job_id, r.attempt, r.lease_token, r.worker, 'finish', r.outcome, skiplock_now()
    FROM results AS r
    WHERE r.ord NOT IN (SELECT ord FROM applied)
)
SELECT ord FROM applied;
