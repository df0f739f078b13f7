-- Mutant: a claim that slows down as the backlog grows.
-- Bug: each claim costs time in proportion to the due jobs waiting (here a sleep; in the wild,
-- a claim that sorts or counts every due row, or a missing partial index). Nothing is lost,
-- duplicated or delivered twice: the safety checks all pass. But the jobs of an account with
-- nothing to wait for (no limit, no backlog of its own) take seconds to be delivered instead
-- of a tenth of one, which the scenario's latency objective sees. The slow claim also holds
-- the limited accounts' locks while it sleeps, so other claimers pass those accounts over
-- and take later jobs of others: on some seeds starvation shows too.
-- expect: objective_missed
-- scenario: noisy-neighbour
-- set: drain_timeout=10

-- name: claim
-- Step 2 of a claim, a separate statement in the same transaction. Under READ COMMITTED it
-- takes a fresh snapshot *after* step 1 got the account locks, so the active count below sees
-- every PROCESSING row committed by whoever held those locks before us. Done as one statement
-- with the locks, the count would use the snapshot from before the lock wait and over-admit.
-- Each account's due rows are read from its own stretch of the per-account indexes, at most
-- its share of them: the work is one probe per account plus the rows taken, however long the
-- backlog of a full account (a single walk of the global due index would filter that whole
-- backlog out row by row on every claim, the seeds' noisy neighbour).
WITH
-- Free slots of each account we locked: its limit minus the jobs it has in flight.
active AS (
    SELECT a.id AS account_id, a.concurrency_limit - count(j.id) AS free
    FROM accounts AS a
    LEFT JOIN jobs AS j ON j.account_id = a.id AND j.status = 'PROCESSING'
    WHERE a.id = ANY(%(locked_accounts)s::text[])
    GROUP BY a.id, a.concurrency_limit
),
-- What each limited account we locked may take: its free slots (full ones, and those another
-- claimer locked, take nothing). Its job rows may all be locked here: no other claimer can
-- take them while we hold the account.
quota AS (
    SELECT account_id, LEAST(free, %(batch)s) AS take FROM active WHERE free > 0
),
-- Due PENDING rows of each of those accounts, oldest first, from jobs_pending_by_account.
pending AS (
    SELECT p.*
    FROM quota AS q
    CROSS JOIN LATERAL (
        SELECT j.id, j.account_id, j.run_at AS due_at
        FROM jobs AS j
        -- account_id = q.account_id AND run_at <= now, written as two row comparisons: only
        -- an index that leads with (account_id, run_at) can search on them, so the planner
        -- cannot trade this account's stretch of jobs_pending_by_account for a walk of the
        -- global jobs_pending that filters other accounts' rows out (with a parameter for the
        -- account it cannot tell how many that walk would pass over).
        WHERE j.status = 'PENDING'
          AND (j.account_id, j.run_at) >= (q.account_id, '-infinity'::timestamptz)
          AND (j.account_id, j.run_at) <= (q.account_id, skiplock_now())
        ORDER BY j.account_id, j.run_at, j.id
        LIMIT q.take
        FOR UPDATE OF j SKIP LOCKED
    ) AS p
),
-- Due RETRYING rows of those accounts, from jobs_retrying_by_account, same rules.
retrying AS (
    SELECT r.*
    FROM quota AS q
    CROSS JOIN LATERAL (
        SELECT j.id, j.account_id, j.next_attempt_at AS due_at
        FROM jobs AS j
        WHERE j.status = 'RETRYING'
          AND (j.account_id, j.next_attempt_at) >= (q.account_id, '-infinity'::timestamptz)
          AND (j.account_id, j.next_attempt_at) <= (q.account_id, skiplock_now())
        ORDER BY j.account_id, j.next_attempt_at, j.id
        LIMIT q.take
        FOR UPDATE OF j SKIP LOCKED
    ) AS r
),
-- Unlimited accounts: candidates read without locking (locking every candidate would hold
-- them all until COMMIT, and a concurrent claimer would skip them and find nothing): the
-- oldest four batches of their due jobs. Room for the rows concurrent claimers hold: a fifth
-- claimer at the same instant may come back short, never one of the first four.
-- First from the head of the global due indexes: the oldest 8 batches of every account's
-- due PENDING jobs and of its due RETRYING jobs, read in index order.
head AS (
    (SELECT j.id, j.account_id, j.run_at AS due_at, true AS pending
     FROM jobs AS j
     WHERE j.status = 'PENDING' AND j.run_at <= skiplock_now()
     ORDER BY j.run_at, j.id
     LIMIT 8 * %(batch)s)
    UNION ALL
    (SELECT j.id, j.account_id, j.next_attempt_at AS due_at, false AS pending
     FROM jobs AS j
     WHERE j.status = 'RETRYING' AND j.next_attempt_at <= skiplock_now()
     ORDER BY j.next_attempt_at, j.id
     LIMIT 8 * %(batch)s)
),
-- How far the head is the whole truth: a part cut off at its limit says nothing of the jobs
-- due after its last row, so the head is exact up to the earliest such last row (by due time,
-- then id, the claim's order: most jobs of one enqueue share one due time). No row: neither
-- part was cut, and the head holds every due job.
horizon AS (
    SELECT h.due_at, h.id
    FROM (SELECT due_at, id, pending,
                 count(*) OVER (PARTITION BY pending) AS rows_read,
                 row_number() OVER (PARTITION BY pending ORDER BY due_at DESC, id DESC) AS back
          FROM head) AS h
    WHERE h.rows_read = 8 * %(batch)s AND h.back = 1
    ORDER BY h.due_at, h.id
    LIMIT 1
),
-- The unlimited accounts' jobs in the head, up to the horizon: exactly their oldest.
head_candidates AS (
    SELECT h.id, h.due_at
    FROM head AS h
    JOIN accounts AS a ON a.id = h.account_id
    WHERE a.concurrency_limit IS NULL
      AND (NOT EXISTS (SELECT FROM horizon)
           OR (h.due_at, h.id) <= (SELECT z.due_at, z.id FROM horizon AS z))
    ORDER BY h.due_at, h.id
    LIMIT 4 * %(batch)s
),
-- Short of four batches with jobs past the horizon (the head filled with limited accounts'
-- backlogs, the seeds' noisy neighbour): each unlimited account's oldest four batches from
-- its own stretch of the per-account indexes, then the oldest four batches of all of them.
-- Not read otherwise: the work would grow with the number of accounts (1,000 unlimited
-- accounts cost 4,251 buffers a claim this way).
unlimited_candidates AS (
    SELECT * FROM head_candidates
    WHERE NOT EXISTS (SELECT FROM horizon)
       OR (SELECT count(*) FROM head_candidates) = 4 * %(batch)s
    UNION ALL
    (SELECT c.id, c.due_at
     FROM accounts AS a
     CROSS JOIN LATERAL (
         (SELECT j.id, j.run_at AS due_at
          FROM jobs AS j
          WHERE j.status = 'PENDING'
            AND (j.account_id, j.run_at) >= (a.id, '-infinity'::timestamptz)
            AND (j.account_id, j.run_at) <= (a.id, skiplock_now())
          ORDER BY j.account_id, j.run_at, j.id
          LIMIT 4 * %(batch)s)
         UNION ALL
         (SELECT j.id, j.next_attempt_at AS due_at
          FROM jobs AS j
          WHERE j.status = 'RETRYING'
            AND (j.account_id, j.next_attempt_at) >= (a.id, '-infinity'::timestamptz)
            AND (j.account_id, j.next_attempt_at) <= (a.id, skiplock_now())
          ORDER BY j.account_id, j.next_attempt_at, j.id
          LIMIT 4 * %(batch)s)
     ) AS c
     WHERE a.concurrency_limit IS NULL
       AND EXISTS (SELECT FROM horizon)
       AND (SELECT count(*) FROM head_candidates) < 4 * %(batch)s
     ORDER BY c.due_at, c.id
     LIMIT 4 * %(batch)s)
),
-- ... then at most a batch of them locked, oldest first. SKIP LOCKED passes over rows other
-- claimers hold, and the due check is made again on the row as locked (a row another claimer
-- took and committed meanwhile no longer qualifies). It is one CASE, which no index matches,
-- so the planner fetches the few candidates by id rather than scan every due job again.
unlimited AS (
    SELECT j.id, j.account_id, c.due_at
    FROM unlimited_candidates AS c
    JOIN jobs AS j ON j.id = c.id
    WHERE CASE j.status WHEN 'PENDING' THEN j.run_at WHEN 'RETRYING' THEN j.next_attempt_at END
          <= skiplock_now()
    ORDER BY c.due_at, c.id
    LIMIT %(batch)s
    FOR UPDATE OF j SKIP LOCKED
),
-- Each account's candidates ranked oldest due first, so a limited account gets its free slots.
ranked AS (
    SELECT c.id, c.account_id, c.due_at,
        row_number() OVER (PARTITION BY c.account_id ORDER BY c.due_at, c.id) AS n
    FROM (SELECT * FROM pending UNION ALL SELECT * FROM retrying
          UNION ALL SELECT * FROM unlimited) AS c
),
-- MUTANT: a claim whose cost grows with the backlog, as one that sorted every due row would
-- MUTANT: (a sleep of a second per 100 due jobs, at most 1.5 s, so it shows at this size).
stall AS (
    SELECT pg_sleep(LEAST(count(*) / 100.0, 1.5)) AS slept
    FROM jobs AS j
    WHERE j.status = 'PENDING' AND j.run_at <= skiplock_now()
),
-- Cut to the free slots of each limited account, then to the batch, oldest due first.
picked AS (
    SELECT r.id, r.due_at
    FROM ranked AS r
    CROSS JOIN stall  -- MUTANT
    LEFT JOIN active AS a ON a.account_id = r.account_id
    WHERE a.account_id IS NULL OR r.n <= a.free
    ORDER BY r.due_at, r.id
    LIMIT %(batch)s
),
-- Take the leases: attempts + 1, a deadline, and a fresh token that fences every earlier holder.
claimed AS (
    UPDATE jobs AS j
    SET status = 'PROCESSING',
        attempts = j.attempts + 1,
        locked_until = skiplock_lease_base() + %(lease)s::interval,
        lease_token = gen_random_uuid(),
        locked_by = %(worker_id)s
    FROM picked AS p
    WHERE j.id = p.id
    RETURNING j.id, j.account_id, j.target_url, j.payload, j.attempts, j.max_attempts,
        j.lease_token, j.locked_until, j.locked_by, p.due_at
),
-- One attempts row per execution, so every delivery stays observable.
logged AS (
    INSERT INTO job_attempts (lease_token, job_id, attempt, worker, started_at)
    SELECT lease_token, id, attempts, locked_by, skiplock_now() FROM claimed
)
-- Oldest due first, as they were picked (an UPDATE returns rows in no particular order).
SELECT * FROM claimed ORDER BY due_at, id;
