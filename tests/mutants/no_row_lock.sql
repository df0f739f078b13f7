-- Mutant: no row lock in the claim.
-- Bug: the pending and retrying CTEs of the claim lost their FOR UPDATE OF j SKIP LOCKED
-- ("the UPDATE below locks the rows anyway"). Two claimers that read the same due rows both
-- update them: the second UPDATE waits for the first, re-checks only j.id = p.id, and takes
-- the job again (attempts + 2, two lease tokens). Limited accounts are still serialised by
-- the account lock, so only jobs of unlimited accounts are handed out twice. Needs two claims
-- at the same moment: crash-points (replacement workers, bursts of claims) shows it most.
-- expect: duplicate_unexplained, concurrent_delivery
-- scenario: crash-points
-- seeds: 3

-- name: claim
-- Step 2 of a claim, a separate statement in the same transaction. Under READ COMMITTED it
-- takes a fresh snapshot *after* step 1 got the account locks, so the active count below sees
-- every PROCESSING row committed by whoever held those locks before us. Done as one statement
-- with the locks, the count would use the snapshot from before the lock wait and over-admit.
WITH
-- Free slots of each account we locked: its limit minus the jobs it has in flight.
active AS (
    SELECT a.id AS account_id, a.concurrency_limit - count(j.id) AS free
    FROM accounts AS a
    LEFT JOIN jobs AS j ON j.account_id = a.id AND j.status = 'PROCESSING'
    WHERE a.id = ANY(%(locked_accounts)s::text[])
    GROUP BY a.id, a.concurrency_limit
),
-- Limited accounts we may not claim for: locked by another claimer, or full.
closed AS (
    SELECT a.id
    FROM accounts AS a
    WHERE a.concurrency_limit IS NOT NULL
      AND a.id NOT IN (SELECT account_id FROM active WHERE free > 0)
),
-- Due PENDING rows, from the pending partial index in (run_at, id) order; SKIP LOCKED passes
-- over rows other claimers hold, so claimers never wait on each other.
pending AS (
    SELECT j.id, j.account_id, j.run_at AS due_at
    FROM jobs AS j
    WHERE j.status = 'PENDING' AND j.run_at <= skiplock_now()
      AND j.account_id NOT IN (SELECT id FROM closed)
    ORDER BY j.run_at, j.id
    LIMIT %(batch)s
    -- MUTANT: no FOR UPDATE OF j SKIP LOCKED
),
-- Due RETRYING rows, from the retrying partial index in (next_attempt_at, id) order, same rules.
retrying AS (
    SELECT j.id, j.account_id, j.next_attempt_at AS due_at
    FROM jobs AS j
    WHERE j.status = 'RETRYING' AND j.next_attempt_at <= skiplock_now()
      AND j.account_id NOT IN (SELECT id FROM closed)
    ORDER BY j.next_attempt_at, j.id
    LIMIT %(batch)s
    -- MUTANT: no FOR UPDATE OF j SKIP LOCKED
),
-- Each account's candidates ranked oldest due first, so a limited account gets its free slots.
ranked AS (
    SELECT c.id, c.account_id, c.due_at,
        row_number() OVER (PARTITION BY c.account_id ORDER BY c.due_at, c.id) AS n
    FROM (SELECT * FROM pending UNION ALL SELECT * FROM retrying) AS c
),
-- Cut to the free slots of each limited account, then to the batch, oldest due first.
picked AS (
    SELECT r.id
    FROM ranked AS r
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
        j.lease_token, j.locked_until, j.locked_by
),
-- One attempts row per execution, so every delivery stays observable.
logged AS (
    INSERT INTO job_attempts (lease_token, job_id, attempt, worker, started_at)
    SELECT lease_token, id, attempts, locked_by, skiplock_now() FROM claimed
)
SELECT * FROM claimed;
