"""A worker stalled inside its claim transaction must not send on leases that ran out.

The claim's lease starts at its UPDATE (`skiplock_lease_base()`), not at its COMMIT. A commit
that stalls (a stalled synchronous standby, a backend frozen `idle in transaction`) keeps the
account locked, then hands the worker leases that expired meanwhile, which another worker
recovers and redelivers. Had the stalled worker sent its calls on waking, the target would
see the same job twice at once and the account above its limit.

A deferred constraint trigger on the test schema reproduces the stall without touching the
queue: the stalled worker's first claim sleeps at COMMIT for the lease + 6 s. Real worker
processes, the reference queue and the echo target; the target's own record, the stalled
worker's log and the checker (from the recorded history alone) must all agree that nothing
was sent on an expired lease.
"""

from __future__ import annotations

import itertools
import time
import uuid
from collections import defaultdict
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

import psycopg
import pytest
from psycopg import sql

from skiplock.chaos.target import TargetProcess
from skiplock.queue_impl.config import DispatcherConfig
from skiplock.queue_impl.events import LEASE_TOO_SHORT
from skiplock.queue_impl.interface import Account, JobStatus, NewJob
from skiplock.queue_impl.pg import PgQueue
from skiplock.queue_impl.plugins import BackendSpec
from skiplock.reports.checker import check_run
from skiplock.reports.history import (
    DELIVERY_LOG,
    WORKER_LOG,
    WORKERS_DIR,
    Behaviour,
    JobScript,
    Step,
    read_log,
)
from skiplock.reports.synthetic import RunBuilder
from skiplock.scenarios.run.workers import WorkerPool

pytestmark = [pytest.mark.chaos, pytest.mark.integration]

T = TypeVar("T")

LEASE = 3.0
# The healthy worker's process starts once the stall is seen, and must be running before the
# stalled leases run out: past the lease, the stall leaves it that long to start. A worker's
# start (a fresh interpreter and its imports) took over 4 s on a busy two-core machine.
STALL = LEASE + 6.0
ACCOUNT = "acct"
LIMIT = 2
JOBS = 3  # the stalled claim takes LIMIT of them; the rest wait behind the locked account
STALLED = "stalled-0"  # the only worker of a pool named "stalled"
CONFIG = DispatcherConfig(
    batch=5,
    lease_seconds=LEASE,
    http_timeout_seconds=1.0,
    write_margin_seconds=1.0,
    poll_seconds=0.1,
    recovery_interval_seconds=0.2,
    retry_base_seconds=0.1,
    retry_cap_seconds=0.5,
    retry_jitter=0.0,
)
# Held long enough that a call sent on an expired lease would still be open at the target
# when the healthy worker redelivers; answered inside the HTTP timeout.
SLOW = JobScript(name="slow", first=Step(behaviour=Behaviour.SLOW, seconds=0.7))

# Once (the flag flips in the stalled transaction and commits with it), the first claim by
# STALLED sleeps at COMMIT: its UPDATE, and so its leases' clock, ran long before.
_STALL_DDL = """
CREATE TABLE {schema}.claim_stall (seconds float8 NOT NULL, done boolean NOT NULL DEFAULT false);
CREATE FUNCTION {schema}.stall_claim_commit() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    pause float8;
BEGIN
    UPDATE {schema}.claim_stall SET done = true WHERE NOT done RETURNING seconds INTO pause;
    IF FOUND THEN
        PERFORM pg_sleep(pause);
    END IF;
    RETURN NULL;
END
$$;
CREATE CONSTRAINT TRIGGER stall_claim_commit AFTER UPDATE ON {schema}.jobs
    DEFERRABLE INITIALLY DEFERRED FOR EACH ROW
    WHEN (NEW.status = 'PROCESSING' AND OLD.status <> 'PROCESSING' AND NEW.locked_by = {worker})
    EXECUTE FUNCTION {schema}.stall_claim_commit();
"""

# The stalled commit: the backend sleeping in the trigger, holding the flag row.
_STALLED_NOW = """
SELECT count(*) AS n
FROM pg_stat_activity AS a
JOIN pg_locks AS l ON l.pid = a.pid
JOIN pg_class AS c ON c.oid = l.relation
JOIN pg_namespace AS s ON s.oid = c.relnamespace
WHERE a.wait_event = 'PgSleep' AND s.nspname = %s AND c.relname = 'claim_stall'
"""


def wait_for(what: str, probe: Callable[[], T | None], limit: float = 30.0) -> T:
    """Poll `probe` until it returns something truthy (bounded)."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        value = probe()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def install_stall(dsn: str, schema: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        # DDL takes no bound parameters: the worker id goes in as a quoted literal.
        conn.execute(
            sql.SQL(_STALL_DDL).format(schema=sql.Identifier(schema), worker=sql.Literal(STALLED))
        )
        conn.execute(
            sql.SQL("INSERT INTO {}.claim_stall (seconds) VALUES (%s)").format(
                sql.Identifier(schema)
            ),
            [STALL],
        )


def commit_stalled(dsn: str, schema: str) -> bool:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(_STALLED_NOW, [schema]).fetchone()
    return row is not None and row[0] > 0


def overlapping(deliveries: list[dict[str, Any]]) -> list[str]:
    """Deliveries of one job in flight at the target at the same time."""
    by_job: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for d in deliveries:
        by_job[d["job_id"]].append(d)
    found = []
    for job, ds in by_job.items():
        ds.sort(key=lambda d: d["received"])
        for earlier, later in itertools.pairwise(ds):
            end = earlier["answered"]
            if end is None or later["received"] < end:
                found.append(
                    f"{job}: attempt {earlier['attempt']} from {earlier['worker']} still open "
                    f"when attempt {later['attempt']} from {later['worker']} arrived"
                )
    return found


def test_a_claim_committed_after_its_lease_ran_out_is_given_back_not_sent(
    pg_dsn: str, fresh_schema: str, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    queue = PgQueue(pg_dsn, schema=fresh_schema)
    queue.setup()
    queue.upsert_accounts([Account(id=ACCOUNT, concurrency_limit=LIMIT)])
    install_stall(pg_dsn, fresh_schema)
    spec = BackendSpec(name="pg", dsn=pg_dsn, schema=fresh_schema)
    history = RunBuilder(
        http_timeout_seconds=CONFIG.http_timeout_seconds,
        lease_seconds=CONFIG.lease_seconds,
        retry_base_seconds=CONFIG.retry_base_seconds,
        retry_cap_seconds=CONFIG.retry_cap_seconds,
        retry_jitter=CONFIG.retry_jitter,
        account_limits={ACCOUNT: LIMIT},
    )
    history.run_info["started"] = time.time()
    try:
        with TargetProcess(run_dir, grace_seconds=0.5) as target:
            config = replace(CONFIG, allow_targets=(f"127.0.0.1:{target.port}",))
            jobs = [
                NewJob(
                    id=uuid.uuid4(),
                    account_id=ACCOUNT,
                    target_url=target.deliver_url,
                    payload={"script": SLOW.to_json()},
                    max_attempts=3,
                )
                for _ in range(JOBS)
            ]
            enqueued = time.time()
            queue.enqueue(jobs)
            for job in jobs:
                history.enqueue(str(job.id), script=SLOW.to_json(), account=ACCOUNT, time=enqueued)

            events_dir = run_dir / WORKERS_DIR
            stalled = WorkerPool(spec, config, 1, events_dir, name_prefix="stalled")
            healthy = WorkerPool(spec, config, 1, events_dir, name_prefix="healthy")
            with stalled:
                # The stalled worker alone claims first; the healthy one starts while its
                # commit sleeps (and so finds the account locked).
                wait_for("the stalled claim", lambda: commit_stalled(pg_dsn, fresh_schema))
                with healthy:
                    wait_for(
                        "every job to complete",
                        lambda: all(s.status is JobStatus.COMPLETED for s in queue.snapshot()),
                    )
            stats = target.stats()
        states = queue.snapshot()
    finally:
        queue.close()
    history.run_info["finished"] = time.time()

    # The target's own record: one job never in flight twice, the account never above its
    # limit.
    deliveries = list(read_log(target.deliveries_path, DELIVERY_LOG))
    assert overlapping(deliveries) == []
    assert stats["max_in_flight"][ACCOUNT] <= LIMIT, stats
    assert max(d["account_in_flight"] for d in deliveries) <= LIMIT

    # The scenario happened: the healthy worker ran while the stalled commit slept.
    healthy_log = list(read_log(healthy.events_path("healthy-0"), WORKER_LOG))
    log = list(read_log(stalled.events_path(STALLED), WORKER_LOG))
    first_claim = next(e for e in log if e["kind"] == "claim")
    assert healthy_log[0]["kind"] == "start"
    assert healthy_log[0]["time"] < first_claim["time"] - CONFIG.lease_seconds

    # The stalled worker gave back the leases of its stalled claim and called nothing on them:
    # up to its next claim, its log says only that it released them. (If a release lands
    # before the healthy worker's recovery, the jobs are due again for the same attempt
    # numbers, and the stalled worker may take them in its next claim.)
    jobs_log = [e for e in log if e["job_id"]]
    stalled_claim, rest = jobs_log[:LIMIT], jobs_log[LIMIT:]
    assert [e["kind"] for e in stalled_claim] == ["claim"] * LIMIT
    then = list(itertools.takewhile(lambda e: e["kind"] != "claim", rest))
    assert [(e["kind"], e["job_id"], e["attempt"], e["data"].get("reason")) for e in then] == [
        ("release", e["job_id"], e["attempt"], LEASE_TOO_SHORT) for e in stalled_claim
    ]

    # And the checker, from the recorded history alone.
    history.deliveries = {}  # the target and the workers wrote their own logs in run_dir
    history.workers = {}
    for state in states:
        history.final(
            str(state.job_id),
            state.status.value,
            attempts=state.attempts,
            max_attempts=state.max_attempts,
            account=state.account_id,
            last_error=state.last_error,
        )
    history.run_info["final_jobs"] = len(states)
    verdict = check_run([history.write(run_dir)])
    assert verdict.valid is True, (verdict.counts, verdict.examples, verdict.unknown_reasons)
