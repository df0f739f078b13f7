-- The reference queue's statements, one named block each. A line "-- name: BLOCK" starts a
-- block; it runs until the next such line. Placeholders are psycopg named parameters.
-- Every statement runs with search_path set to the queue's schema, and reads the time from
-- skiplock_now() so that tests can pin the clock instead of sleeping.
-- See queue_impl/sqlfile.py for what each block must take and return.

-- name: schema
-- Run as one script (no placeholders), under an advisory lock, so it is idempotent and safe
-- from many processes at once.
CREATE OR REPLACE FUNCTION skiplock_now() RETURNS timestamptz
LANGUAGE sql STABLE
-- statement_timestamp(), not now(): a transaction held open across an HTTP call (the
-- long-transaction variant) must still see time move between its statements.
AS $$
    SELECT COALESCE(
        NULLIF(current_setting('skiplock.now', true), '')::timestamptz,
        statement_timestamp()
    )
$$;

-- The base of a lease deadline (claim, renew): the time the row is actually taken, not the
-- start of the statement, which under pg-for-update may have waited on locks first and would
-- hand out a lease already partly spent. The pinned clock still wins, for tests.
CREATE OR REPLACE FUNCTION skiplock_lease_base() RETURNS timestamptz
LANGUAGE sql VOLATILE
AS $$
    SELECT COALESCE(
        NULLIF(current_setting('skiplock.now', true), '')::timestamptz,
        clock_timestamp()
    )
$$;

CREATE TABLE IF NOT EXISTS accounts (
    id text PRIMARY KEY,
    -- NULL: unlimited, and claims for the account take no account lock.
    concurrency_limit integer CHECK (concurrency_limit > 0)
);

CREATE TABLE IF NOT EXISTS jobs (
    id uuid PRIMARY KEY,
    account_id text NOT NULL REFERENCES accounts (id),
    -- Enqueue refuses other schemes first; this is the second line of defence.
    target_url text NOT NULL CONSTRAINT jobs_target_url_http CHECK (target_url ~* '^https?://'),
    payload jsonb NOT NULL,
    status text NOT NULL DEFAULT 'PENDING'
        CHECK (status IN ('PENDING', 'PROCESSING', 'RETRYING', 'COMPLETED', 'FAILED')),
    run_at timestamptz NOT NULL DEFAULT skiplock_now(),
    next_attempt_at timestamptz,
    attempts integer NOT NULL DEFAULT 0 CHECK (attempts >= 0),
    max_attempts integer NOT NULL DEFAULT 3 CHECK (max_attempts > 0),
    locked_until timestamptz,
    -- A fresh token per claim: a result write must carry it, so a worker whose lease passed
    -- to someone else is fenced instead of overwriting the new holder's state.
    lease_token uuid,
    -- The lease token whose worker confirmed it had the claim in hand (the `receive` block,
    -- before its first call): an expired lease whose token is not this one was never
    -- delivered (its claim's result was lost with the connection, or its worker died before
    -- reading it), so recovery gives its attempt back instead of counting it.
    received_token uuid,
    -- Whether the job's account has a concurrency limit, kept by the triggers below (set on
    -- insert, changed with the account's limit): the claim reaches unlimited accounts' due
    -- jobs through their own partial indexes, never passing over a limited account's backlog.
    limited boolean NOT NULL DEFAULT false,
    locked_by text,
    last_error text,
    created_at timestamptz NOT NULL DEFAULT skiplock_now(),
    finished_at timestamptz
);

-- A schema created before the URL check existed gets it too (NOT VALID: rows already there
-- are left alone; every new or changed row is checked).
DO $$
BEGIN
    IF NOT EXISTS (
        SELECT 1 FROM pg_constraint
        WHERE conrelid = 'jobs'::regclass AND conname = 'jobs_target_url_http'
    ) THEN
        ALTER TABLE jobs ADD CONSTRAINT jobs_target_url_http
            CHECK (target_url ~* '^https?://') NOT VALID;
    END IF;
END
$$;

-- A schema created before receipts existed gets the column too (looked up first: ALTER TABLE
-- would take an exclusive lock on every setup, behind every claim in flight).
DO $$
BEGIN
    IF NOT EXISTS (
        SELECT 1 FROM pg_attribute
        WHERE attrelid = 'jobs'::regclass AND attname = 'received_token' AND NOT attisdropped
    ) THEN
        ALTER TABLE jobs ADD COLUMN received_token uuid;
    END IF;
END
$$;

-- The seed's three partial indexes: each claim CTE and the recovery scan reads only its own.
CREATE INDEX IF NOT EXISTS jobs_pending ON jobs (run_at, id) WHERE status = 'PENDING';
CREATE INDEX IF NOT EXISTS jobs_retrying ON jobs (next_attempt_at, id) WHERE status = 'RETRYING';
CREATE INDEX IF NOT EXISTS jobs_processing_lease ON jobs (locked_until)
    WHERE status = 'PROCESSING';
-- The per-account active count in the claim reads only the jobs in flight.
CREATE INDEX IF NOT EXISTS jobs_processing_account ON jobs (account_id)
    WHERE status = 'PROCESSING';
-- Each account's due work in claim order: "does this limited account have due work?" (claim
-- step 1) is one probe per account, and the claim (step 2) takes each account's share from
-- its own stretch of these indexes, so a full account's backlog is never walked row by row.
CREATE INDEX IF NOT EXISTS jobs_pending_by_account ON jobs (account_id, run_at, id)
    WHERE status = 'PENDING';
CREATE INDEX IF NOT EXISTS jobs_retrying_by_account ON jobs (account_id, next_attempt_at, id)
    WHERE status = 'RETRYING';
-- Replaced by jobs_pending_by_account (which adds the id, the claim's tie-break).
DROP INDEX IF EXISTS jobs_pending_account;

-- A schema created before the flag existed gets it, set from each job's account (this script
-- runs under the setup lock; the triggers below keep it from here on).
DO $$
BEGIN
    IF NOT EXISTS (
        SELECT 1 FROM pg_attribute
        WHERE attrelid = 'jobs'::regclass AND attname = 'limited' AND NOT attisdropped
    ) THEN
        ALTER TABLE jobs ADD COLUMN limited boolean NOT NULL DEFAULT false;
        UPDATE jobs AS j SET limited = true
        FROM accounts AS a
        WHERE a.id = j.account_id AND a.concurrency_limit IS NOT NULL;
    END IF;
END
$$;

-- Unlimited accounts' due work in claim order: the claim's locked scan for them reads only
-- these, so a limited account's backlog (the seeds' noisy neighbour) is never walked.
CREATE INDEX IF NOT EXISTS jobs_pending_unlimited ON jobs (run_at, id)
    WHERE status = 'PENDING' AND NOT limited;
CREATE INDEX IF NOT EXISTS jobs_retrying_unlimited ON jobs (next_attempt_at, id)
    WHERE status = 'RETRYING' AND NOT limited;

-- The flag of a new job, from its account as committed now, whoever inserts it. An enqueue
-- holds the limits lock shared and a change of limits takes it exclusive, so the two cannot
-- interleave: a change waits for the enqueues in flight (and then marks their jobs), and an
-- enqueue that comes after it reads the new limit. (A plain read could miss an account a
-- concurrent change has just created limited, and flag its job unlimited.) PL/pgSQL runs each
-- statement on a fresh snapshot, so the read follows the lock. A job whose account does not
-- exist yet is unlimited: the enqueue creates it so.
CREATE OR REPLACE FUNCTION skiplock_job_limited() RETURNS trigger
LANGUAGE plpgsql
AS $$
BEGIN
    PERFORM pg_advisory_xact_lock_shared(hashtext(TG_TABLE_SCHEMA), 1);
    NEW.limited := COALESCE(
        (SELECT a.concurrency_limit IS NOT NULL FROM accounts AS a WHERE a.id = NEW.account_id),
        false);
    RETURN NEW;
END
$$;

-- A change of an account's limit between none and some, or a limited account created: take
-- the limits lock exclusive (waiting for the enqueues in flight), then mark the account's
-- unfinished jobs to match, on a snapshot taken after the wait.
CREATE OR REPLACE FUNCTION skiplock_account_limited() RETURNS trigger
LANGUAGE plpgsql
AS $$
BEGIN
    PERFORM pg_advisory_xact_lock(hashtext(TG_TABLE_SCHEMA), 1);
    IF TG_OP = 'UPDATE' THEN
        -- One statement per unfinished status, each found through its own partial index.
        UPDATE jobs SET limited = NEW.concurrency_limit IS NOT NULL
        WHERE account_id = NEW.id AND status = 'PENDING'
          AND limited IS DISTINCT FROM (NEW.concurrency_limit IS NOT NULL);
        UPDATE jobs SET limited = NEW.concurrency_limit IS NOT NULL
        WHERE account_id = NEW.id AND status = 'RETRYING'
          AND limited IS DISTINCT FROM (NEW.concurrency_limit IS NOT NULL);
        UPDATE jobs SET limited = NEW.concurrency_limit IS NOT NULL
        WHERE account_id = NEW.id AND status = 'PROCESSING'
          AND limited IS DISTINCT FROM (NEW.concurrency_limit IS NOT NULL);
    END IF;
    RETURN NEW;
END
$$;

-- Created only where missing: CREATE TRIGGER locks the table against every write, and setup
-- runs again whenever a worker starts, in the middle of a run.
DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_trigger
                   WHERE tgrelid = 'jobs'::regclass AND tgname = 'jobs_limited') THEN
        CREATE TRIGGER jobs_limited BEFORE INSERT ON jobs
            FOR EACH ROW EXECUTE FUNCTION skiplock_job_limited();
    END IF;
    -- Before the row is written, so a limited account's creation waits for the enqueues in
    -- flight (one of which may be creating it unlimited: the insert then becomes an update).
    IF NOT EXISTS (SELECT 1 FROM pg_trigger
                   WHERE tgrelid = 'accounts'::regclass AND tgname = 'accounts_limited_created')
    THEN
        CREATE TRIGGER accounts_limited_created BEFORE INSERT ON accounts
            FOR EACH ROW WHEN (NEW.concurrency_limit IS NOT NULL)
            EXECUTE FUNCTION skiplock_account_limited();
    END IF;
    IF NOT EXISTS (SELECT 1 FROM pg_trigger
                   WHERE tgrelid = 'accounts'::regclass AND tgname = 'accounts_limited_changed')
    THEN
        CREATE TRIGGER accounts_limited_changed AFTER UPDATE OF concurrency_limit ON accounts
            FOR EACH ROW
            WHEN ((OLD.concurrency_limit IS NULL) IS DISTINCT FROM (NEW.concurrency_limit IS NULL))
            EXECUTE FUNCTION skiplock_account_limited();
    END IF;
END
$$;

-- One row per execution (per claim), keyed by its lease token: start, end, outcome, worker.
CREATE TABLE IF NOT EXISTS job_attempts (
    lease_token uuid PRIMARY KEY,
    job_id uuid NOT NULL REFERENCES jobs (id) ON DELETE CASCADE,
    attempt integer NOT NULL,
    worker text NOT NULL,
    started_at timestamptz NOT NULL,
    finished_at timestamptz,
    -- unreceived: its lease expired before its worker confirmed it had the claim in hand;
    -- nothing was delivered, and the attempt was given back.
    outcome text CONSTRAINT job_attempts_outcome_check CHECK (
        outcome IN ('success', 'transient', 'permanent', 'lease_expired', 'released',
                    'unreceived')
    ),
    http_status integer,
    error text
);

-- A schema created before receipts existed accepts their outcome too (NOT VALID: the rows
-- already there are left alone).
DO $$
BEGIN
    IF NOT EXISTS (
        SELECT 1 FROM pg_constraint
        WHERE conrelid = 'job_attempts'::regclass AND conname = 'job_attempts_outcome_check'
          AND position('unreceived' in pg_get_constraintdef(oid)) > 0
    ) THEN
        ALTER TABLE job_attempts DROP CONSTRAINT IF EXISTS job_attempts_outcome_check;
        ALTER TABLE job_attempts ADD CONSTRAINT job_attempts_outcome_check CHECK (
            outcome IN ('success', 'transient', 'permanent', 'lease_expired', 'released',
                        'unreceived')
        ) NOT VALID;
    END IF;
END
$$;
CREATE INDEX IF NOT EXISTS job_attempts_job ON job_attempts (job_id, attempt);

-- Every write refused because the caller no longer held the lease.
CREATE TABLE IF NOT EXISTS fenced_writes (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    job_id uuid NOT NULL,
    attempt integer NOT NULL,
    lease_token uuid,
    worker text NOT NULL,
    operation text NOT NULL CHECK (operation IN ('finish', 'renew', 'release')),
    outcome text,
    at timestamptz NOT NULL
);
CREATE INDEX IF NOT EXISTS fenced_writes_job ON fenced_writes (job_id);

-- name: setup_lock
-- Serialises schema creation across processes; released when the transaction ends.
SELECT pg_advisory_xact_lock(hashtext(%(lock_key)s));

-- name: upsert_accounts
INSERT INTO accounts (id, concurrency_limit)
SELECT a.id, a.concurrency_limit
FROM unnest(%(account_ids)s::text[], %(limits)s::integer[]) AS a (id, concurrency_limit)
ON CONFLICT (id) DO UPDATE SET concurrency_limit = EXCLUDED.concurrency_limit;

-- name: enqueue
WITH
-- The batch as rows: one statement and one round trip for the whole batch.
batch AS (
    SELECT *
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

-- name: notify
-- Sent in the enqueue transaction: listeners wake only once the jobs are visible.
SELECT pg_notify(%(channel)s, '');

-- name: claim_lock_accounts
-- Step 1 of a claim (seed 1, section 9): lock the limited accounts that have due work and a
-- free slot, at most one per job of the batch (a claim cannot use more, and locking them all
-- would leave a concurrent claimer none), the account with the oldest due work first so that
-- every account gets its turn. SKIP LOCKED: an account another claimer is deciding for is
-- left to it this round, and the next ones in line are locked instead.
-- NO KEY UPDATE, not UPDATE: claimers still exclude each other, but the KEY SHARE lock that the
-- jobs -> accounts foreign key takes on every enqueue does not wait behind a claim.
-- The ids are also left in a transaction-local setting (`skiplock.locked_accounts`) for step
-- 2 to read, so a claim can send both statements and its COMMIT in one round trip instead of
-- waiting for this answer first.
WITH
-- The accounts this claim takes, locked.
locked AS MATERIALIZED (
    SELECT a.id
    FROM accounts AS a
    -- The account's oldest due PENDING job: one probe of the per-account pending index.
    CROSS JOIN LATERAL (
        SELECT min(j.run_at) AS due_at
        FROM jobs AS j
        WHERE j.status = 'PENDING' AND j.account_id = a.id AND j.run_at <= skiplock_now()
    ) AS p
    -- Its oldest due RETRYING job, one probe of the per-account retrying index likewise. (Read
    -- as one GROUP BY over every due retry, a backlog of 50k retries cost 50k buffers a claim.)
    CROSS JOIN LATERAL (
        SELECT min(j.next_attempt_at) AS due_at
        FROM jobs AS j
        WHERE j.status = 'RETRYING' AND j.account_id = a.id AND j.next_attempt_at <= skiplock_now()
    ) AS r
    WHERE a.concurrency_limit IS NOT NULL
      AND (p.due_at IS NOT NULL OR r.due_at IS NOT NULL)
      -- Full by this snapshot: only a hint, so full accounts do not use up the cap (the claim
      -- statement recounts under the lock; an account missed here is taken next round).
      AND (SELECT count(*) FROM jobs AS j WHERE j.status = 'PROCESSING' AND j.account_id = a.id)
          < a.concurrency_limit
    ORDER BY LEAST(p.due_at, r.due_at), a.id COLLATE "C"
    LIMIT %(batch)s
    FOR NO KEY UPDATE OF a SKIP LOCKED
)
SELECT l.id,
    set_config('skiplock.locked_accounts', (SELECT array_agg(id)::text FROM locked), true)
        AS handed_over
FROM locked AS l;

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
    -- Passed in, or (NULL) handed over by step 1 in the transaction's settings.
    WHERE a.id = ANY(COALESCE(
        %(locked_accounts)s::text[],
        NULLIF(current_setting('skiplock.locked_accounts', true), '')::text[],
        '{}'))
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
-- Unlimited accounts' due rows, oldest first, from their own partial indexes
-- (jobs_pending_unlimited, jobs_retrying_unlimited): a locked scan from the head that passes
-- over rows other claimers hold. No limited account's job is in those indexes, so however
-- long a full account's backlog, this reads only rows it may take. A batch of each: the
-- oldest of both are cut to a batch below, and the rest are unlocked at COMMIT.
unlimited_pending AS (
    SELECT j.id, j.account_id, j.run_at AS due_at
    FROM jobs AS j
    WHERE j.status = 'PENDING' AND NOT j.limited AND j.run_at <= skiplock_now()
    ORDER BY j.run_at, j.id
    LIMIT %(batch)s
    FOR UPDATE OF j SKIP LOCKED
),
-- Their due RETRYING rows likewise, from jobs_retrying_unlimited.
unlimited_retrying AS (
    SELECT j.id, j.account_id, j.next_attempt_at AS due_at
    FROM jobs AS j
    WHERE j.status = 'RETRYING' AND NOT j.limited AND j.next_attempt_at <= skiplock_now()
    ORDER BY j.next_attempt_at, j.id
    LIMIT %(batch)s
    FOR UPDATE OF j SKIP LOCKED
),
-- Each account's candidates ranked oldest due first, so a limited account gets its free slots.
ranked AS (
    SELECT c.id, c.account_id, c.due_at,
        row_number() OVER (PARTITION BY c.account_id ORDER BY c.due_at, c.id) AS n
    FROM (SELECT * FROM pending UNION ALL SELECT * FROM retrying
          UNION ALL SELECT * FROM unlimited_pending
          UNION ALL SELECT * FROM unlimited_retrying) AS c
),
-- Cut to the free slots of each limited account, then to the batch, oldest due first.
picked AS (
    SELECT r.id, r.due_at
    FROM ranked AS r
    LEFT JOIN active AS a ON a.account_id = r.account_id
    WHERE a.account_id IS NULL OR r.n <= a.free
    ORDER BY r.due_at, r.id
    LIMIT %(batch)s
),
-- Take the leases: attempts + 1, a deadline, and a fresh token that fences every earlier holder.
-- The rows are found by id through an array: joined to `picked`, whose size a plan made once
-- for every batch cannot know, the planner hashed it against a scan of the whole table.
claimed AS (
    UPDATE jobs AS j
    SET status = 'PROCESSING',
        attempts = j.attempts + 1,
        locked_until = skiplock_lease_base() + %(lease)s::interval,
        lease_token = gen_random_uuid(),
        locked_by = %(worker_id)s
    WHERE j.id = ANY(ARRAY(SELECT id FROM picked))
    RETURNING j.id, j.account_id, j.target_url, j.payload, j.attempts, j.max_attempts,
        j.lease_token, j.locked_until, j.locked_by
),
-- One attempts row per execution, so every delivery stays observable.
logged AS (
    INSERT INTO job_attempts (lease_token, job_id, attempt, worker, started_at)
    SELECT lease_token, id, attempts, locked_by, skiplock_now() FROM claimed
)
-- Oldest due first, as they were picked (an UPDATE returns rows in no particular order).
SELECT c.* FROM claimed AS c JOIN picked AS p ON p.id = c.id ORDER BY p.due_at, c.id;

-- name: claim_lock_accounts_wait
-- The pg-for-update variant's step 1: the same accounts as claim_lock_accounts, but it waits
-- for locked ones, and so locks them in id order (one order for every claimer: no deadlock).
WITH
-- The same choice of accounts as claim_lock_accounts, made from this statement's snapshot.
chosen AS (
    SELECT a.id
FROM accounts AS a
-- The account's oldest due PENDING job: one probe of the per-account pending index.
CROSS JOIN LATERAL (
    SELECT min(j.run_at) AS due_at
    FROM jobs AS j
    WHERE j.status = 'PENDING' AND j.account_id = a.id AND j.run_at <= skiplock_now()
) AS p
-- Its oldest due RETRYING job: one probe of the per-account retrying index.
CROSS JOIN LATERAL (
    SELECT min(j.next_attempt_at) AS due_at
    FROM jobs AS j
    WHERE j.status = 'RETRYING' AND j.account_id = a.id AND j.next_attempt_at <= skiplock_now()
) AS r
WHERE a.concurrency_limit IS NOT NULL
  AND (p.due_at IS NOT NULL OR r.due_at IS NOT NULL)
  -- Full by this snapshot: only a hint, so full accounts do not use up the cap (the claim
  -- statement recounts under the lock; an account missed here is taken next round).
  AND (SELECT count(*) FROM jobs AS j WHERE j.status = 'PROCESSING' AND j.account_id = a.id)
      < a.concurrency_limit
ORDER BY LEAST(p.due_at, r.due_at), a.id COLLATE "C"
LIMIT %(batch)s
)
SELECT a.id
FROM accounts AS a
WHERE a.id IN (SELECT id FROM chosen)
ORDER BY a.id
FOR NO KEY UPDATE OF a;

-- name: claim_wait
-- The pg-for-update variant's step 2: the reference claim with FOR UPDATE and no SKIP LOCKED.
-- Correct, but every claimer queues behind the one holding the oldest rows.
WITH
-- Free slots of each account we locked.
active AS (
    SELECT a.id AS account_id, a.concurrency_limit - count(j.id) AS free
    FROM accounts AS a
    LEFT JOIN jobs AS j ON j.account_id = a.id AND j.status = 'PROCESSING'
    WHERE a.id = ANY(%(locked_accounts)s::text[])
    GROUP BY a.id, a.concurrency_limit
),
-- Limited accounts that are full.
closed AS (
    SELECT a.id
    FROM accounts AS a
    WHERE a.concurrency_limit IS NOT NULL
      AND a.id NOT IN (SELECT account_id FROM active WHERE free > 0)
),
-- Due PENDING rows; FOR UPDATE waits for rows another claimer holds, then re-checks them.
pending AS (
    SELECT j.id, j.account_id, j.run_at AS due_at
    FROM jobs AS j
    WHERE j.status = 'PENDING' AND j.run_at <= skiplock_now()
      AND j.account_id NOT IN (SELECT id FROM closed)
    ORDER BY j.run_at, j.id
    LIMIT %(batch)s
    FOR UPDATE OF j
),
-- Due RETRYING rows, waiting likewise.
retrying AS (
    SELECT j.id, j.account_id, j.next_attempt_at AS due_at
    FROM jobs AS j
    WHERE j.status = 'RETRYING' AND j.next_attempt_at <= skiplock_now()
      AND j.account_id NOT IN (SELECT id FROM closed)
    ORDER BY j.next_attempt_at, j.id
    LIMIT %(batch)s
    FOR UPDATE OF j
),
-- Each account's candidates ranked oldest due first.
ranked AS (
    SELECT c.id, c.account_id, c.due_at,
        row_number() OVER (PARTITION BY c.account_id ORDER BY c.due_at, c.id) AS n
    FROM (SELECT * FROM pending UNION ALL SELECT * FROM retrying) AS c
),
-- Cut to free slots and to the batch.
picked AS (
    SELECT r.id
    FROM ranked AS r
    LEFT JOIN active AS a ON a.account_id = r.account_id
    WHERE a.account_id IS NULL OR r.n <= a.free
    ORDER BY r.due_at, r.id
    LIMIT %(batch)s
),
-- Take the leases.
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
-- One attempts row per execution.
logged AS (
    INSERT INTO job_attempts (lease_token, job_id, attempt, worker, started_at)
    SELECT lease_token, id, attempts, locked_by, skiplock_now() FROM claimed
)
SELECT * FROM claimed;

-- name: naive_select_due
-- The pg-naive variant's first step (seed 1, section 2): read due ids with no row lock.
-- Nothing stops another worker from reading the same ids before we update them.
SELECT j.id
FROM jobs AS j
WHERE (j.status = 'PENDING' AND j.run_at <= skiplock_now())
   OR (j.status = 'RETRYING' AND j.next_attempt_at <= skiplock_now())
ORDER BY COALESCE(j.next_attempt_at, j.run_at), j.id
LIMIT %(batch)s;

-- name: naive_take
-- The pg-naive variant's second step: update what was read, without re-checking the status,
-- so a job another worker took (or even finished) in between is taken again.
WITH
-- Take the leases of whatever ids the first step saw.
claimed AS (
    UPDATE jobs AS j
    SET status = 'PROCESSING',
        attempts = j.attempts + 1,
        locked_until = skiplock_lease_base() + %(lease)s::interval,
        lease_token = gen_random_uuid(),
        locked_by = %(worker_id)s
    WHERE j.id = ANY(%(job_ids)s::uuid[])
    RETURNING j.id, j.account_id, j.target_url, j.payload, j.attempts, j.max_attempts,
        j.lease_token, j.locked_until, j.locked_by
),
-- One attempts row per execution, as in the reference.
logged AS (
    INSERT INTO job_attempts (lease_token, job_id, attempt, worker, started_at)
    SELECT lease_token, id, attempts, locked_by, skiplock_now() FROM claimed
)
SELECT * FROM claimed;

-- name: receive
-- Sent by the worker once it has read a claim's leases and before its first call: a claim
-- can commit while its connection dies (the worker sees an error, never the leases), and
-- only a lease marked here can have been delivered. Recovery counts the attempt of an expired
-- lease only if it was marked (recover_unreceived gives the others back).
WITH
-- The leases in hand, numbered in the caller's order.
held AS (
    SELECT *
    FROM unnest(
        %(ords)s::integer[], %(job_ids)s::uuid[], %(lease_tokens)s::uuid[],
        %(attempts)s::integer[], %(workers)s::text[]
    ) AS h (ord, job_id, lease_token, attempt, worker)
),
-- Lock the rows this call still holds, in id order, before changing any, as every writer
-- does: recovery (FOR UPDATE SKIP LOCKED) then either sees the mark or has already taken the
-- lease, which the token check below refuses.
held_rows AS MATERIALIZED (
    SELECT j.id
    FROM jobs AS j
    JOIN held AS x ON x.job_id = j.id AND x.lease_token = j.lease_token
    WHERE CASE j.status WHEN 'PROCESSING' THEN true END
    ORDER BY j.id
    FOR UPDATE OF j
),
-- Mark only leases still held (same token, still PROCESSING); a lease already taken back is
-- not marked, and its worker must not call. Marking twice (a resend after a lost answer)
-- changes nothing. Not recorded as fenced: nothing was written over anyone.
received AS (
    UPDATE jobs AS j
    SET received_token = j.lease_token
    FROM held AS h
    JOIN held_rows AS l ON l.id = h.job_id
    WHERE j.id = h.job_id AND j.lease_token = h.lease_token
      AND CASE j.status WHEN 'PROCESSING' THEN true END
    RETURNING h.ord
)
SELECT ord FROM received;

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
    JOIN results AS x ON x.job_id = j.id AND x.lease_token = j.lease_token
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
    WHERE j.id = r.job_id AND j.lease_token = r.lease_token
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
    WHERE CASE j.status WHEN 'PROCESSING' THEN true END
    ORDER BY j.id
    FOR UPDATE OF j
),
-- Extend only leases still held (same token, still PROCESSING).
extended AS (
    UPDATE jobs AS j
    SET locked_until = skiplock_lease_base() + %(extend)s::interval
    FROM held AS h
    JOIN held_rows AS l ON l.id = h.job_id
    WHERE j.id = h.job_id AND j.lease_token = h.lease_token
      AND CASE j.status WHEN 'PROCESSING' THEN true END
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
    WHERE CASE j.status WHEN 'PROCESSING' THEN true END
    ORDER BY j.id
    FOR UPDATE OF j
),
-- Back to due now, the attempt not counted: PENDING if it never ran, else RETRYING.
released AS (
    UPDATE jobs AS j
    SET status = CASE WHEN j.attempts - 1 = 0 THEN 'PENDING' ELSE 'RETRYING' END,
        next_attempt_at = CASE WHEN j.attempts - 1 = 0 THEN NULL ELSE skiplock_now() END,
        attempts = j.attempts - 1,
        locked_until = NULL,
        lease_token = NULL
    FROM held AS h
    JOIN held_rows AS l ON l.id = h.job_id
    WHERE j.id = h.job_id AND j.lease_token = h.lease_token
      AND CASE j.status WHEN 'PROCESSING' THEN true END
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

-- name: recover_unreceived
-- Run just before `recover`, in its transaction and at the same instant: expired leases whose
-- worker never confirmed having them (`receive`) were never delivered, so they use up no
-- attempt. Without this, a claim committed as its connection died (the worker never saw it)
-- cost the job an attempt, and a job could be dead-lettered short of its deliveries.
WITH
-- Expired, never-received leases, oldest deadline first; SKIP LOCKED as in `recover` (a row
-- locked by a receipt in flight is left to it).
expired AS (
    SELECT j.id, j.lease_token
    FROM jobs AS j
    WHERE j.status = 'PROCESSING' AND j.locked_until < skiplock_now()
      AND j.received_token IS DISTINCT FROM j.lease_token
    ORDER BY j.locked_until
    LIMIT %(limit)s
    FOR UPDATE OF j SKIP LOCKED
),
-- Back to due now with the attempt given back, as a release does: PENDING if it never ran,
-- else RETRYING; clearing the token fences the claim's lost holder.
given_back AS (
    UPDATE jobs AS j
    SET status = CASE WHEN j.attempts - 1 = 0 THEN 'PENDING' ELSE 'RETRYING' END,
        next_attempt_at = CASE WHEN j.attempts - 1 = 0 THEN NULL ELSE skiplock_now() END,
        attempts = j.attempts - 1,
        locked_until = NULL,
        lease_token = NULL
    FROM expired AS e
    WHERE j.id = e.id
    RETURNING j.id, e.lease_token
),
-- Close the claim's attempts row as unreceived: it never executed, and did not count.
attempt_end AS (
    UPDATE job_attempts AS a
    SET finished_at = skiplock_now(), outcome = 'unreceived'
    FROM given_back AS g
    WHERE a.lease_token = g.lease_token
)
SELECT count(*) AS recovered FROM given_back;

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

-- name: snapshot
SELECT id, account_id, status, attempts, max_attempts, last_error, locked_until,
    next_attempt_at, run_at, locked_by, created_at, finished_at
FROM jobs
ORDER BY id;

-- name: list_attempts
SELECT lease_token, job_id, attempt, worker, started_at, finished_at, outcome, http_status,
    error
FROM job_attempts
ORDER BY job_id, attempt, started_at;

-- name: list_fenced
SELECT job_id, attempt, lease_token, worker, operation, outcome, at
FROM fenced_writes
ORDER BY id;
