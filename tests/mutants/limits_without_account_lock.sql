-- Mutant: limits counted without the account lock.
-- Bug: claim_lock_accounts returns the limited accounts with due work but does not lock them
-- (FOR NO KEY UPDATE OF a SKIP LOCKED dropped, "it is only a read"). Two claimers then count
-- the same account's jobs in flight at the same time, each sees the same free slots, and
-- together they admit more than the limit. A race: noisy-neighbour as shipped (3 workers)
-- catches it on seeds 1 and 3, not on 2 and 4; with workers = 6 on every seed tried.
-- expect: limit_exceeded
-- scenario: noisy-neighbour
-- seeds: 3

-- name: claim_lock_accounts
-- Step 1 of a claim (seed 1, section 9): lock the limited accounts that have due work and a
-- free slot, at most one per job of the batch (a claim cannot use more, and locking them all
-- would leave a concurrent claimer none), the account with the oldest due work first so that
-- every account gets its turn. SKIP LOCKED: an account another claimer is deciding for is
-- left to it this round, and the next ones in line are locked instead.
-- NO KEY UPDATE, not UPDATE: claimers still exclude each other, but the KEY SHARE lock that the
-- jobs -> accounts foreign key takes on every enqueue does not wait behind a claim.
WITH
-- Due RETRYING work per account, read once from the retrying partial index (a small backlog).
retrying AS (
    SELECT j.account_id, min(j.next_attempt_at) AS due_at
    FROM jobs AS j
    WHERE j.status = 'RETRYING' AND j.next_attempt_at <= skiplock_now()
    GROUP BY j.account_id
)
SELECT a.id
FROM accounts AS a
LEFT JOIN retrying AS r ON r.account_id = a.id
-- The account's oldest due PENDING job: one probe of the per-account pending index.
CROSS JOIN LATERAL (
    SELECT min(j.run_at) AS due_at
    FROM jobs AS j
    WHERE j.status = 'PENDING' AND j.account_id = a.id AND j.run_at <= skiplock_now()
) AS p
WHERE a.concurrency_limit IS NOT NULL
  AND (p.due_at IS NOT NULL OR r.due_at IS NOT NULL)
  -- Full by this snapshot: only a hint, so full accounts do not use up the cap (the claim
  -- statement recounts under the lock; an account missed here is taken next round).
  AND (SELECT count(*) FROM jobs AS j WHERE j.status = 'PROCESSING' AND j.account_id = a.id)
      < a.concurrency_limit
ORDER BY LEAST(p.due_at, r.due_at), a.id COLLATE "C"
-- MUTANT: no FOR NO KEY UPDATE OF a SKIP LOCKED: the accounts are read, not locked
LIMIT %(batch)s;
