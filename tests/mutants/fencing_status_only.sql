-- Mutant: fencing by status only.
-- Bug: finish applies a result to any job that is still PROCESSING, without comparing its
-- lease token: a worker paused past its lease, whose job was recovered and claimed again by
-- another worker, writes its stale result while the new holder's call is still in flight
-- (the job is PROCESSING again, under the new lease). Once the new holder has written, the
-- status check refuses the stale result, so only a write aimed inside that window shows it.
-- expect: stale_write
-- scenario: pause-workers

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
-- "Still PROCESSING" is written as a CASE, here and below, so that no partial index matches
-- it: each row is then found by its id. Written plainly, when the statistics said few jobs
-- were in flight (as right after a backlog is loaded and analyzed) the planner walked the
-- whole jobs_processing_account index once per result: 20.7 ms for 10 results at 2,000 in
-- flight, against 4.1 ms by id.
held_rows AS MATERIALIZED (
    SELECT j.id
    FROM jobs AS j
    JOIN results AS x ON x.job_id = j.id  -- MUTANT: no lease token comparison
    WHERE CASE j.status WHEN 'PROCESSING' THEN true END
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
            WHEN r.outcome = 'permanent' OR j.attempts >= j.max_attempts THEN 'FAILED'
            ELSE 'RETRYING'
        END,
        next_attempt_at = CASE
            WHEN r.outcome = 'transient' AND j.attempts < j.max_attempts
                THEN skiplock_now() + r.retry_delay
        END,
        last_error = CASE WHEN r.outcome = 'success' THEN j.last_error ELSE r.error END,
        finished_at = CASE
            WHEN r.outcome = 'transient' AND j.attempts < j.max_attempts THEN NULL
            ELSE skiplock_now()
        END,
        locked_until = NULL,
        lease_token = NULL
    FROM results AS r
    JOIN held_rows AS l ON l.id = r.job_id
    WHERE j.id = r.job_id  -- MUTANT: no lease token comparison
      AND CASE j.status WHEN 'PROCESSING' THEN true END
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
