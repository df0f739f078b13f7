"""Model-based test: every operation goes to the real queue (PostgreSQL, pinned clock) and to
the in-memory model, and after every step their states must agree and the queue's invariants
hold: no job leased twice, attempts <= max_attempts, account limits respected. Time is a rule
("advance the clock"), never a sleep."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

import psycopg
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from psycopg import sql

from skiplock.queue_impl.interface import (
    Account,
    AttemptResult,
    JobState,
    JobStatus,
    Lease,
    NewJob,
    Outcome,
    WriteResult,
)
from skiplock.queue_impl.memory import InMemoryQueue
from skiplock.queue_impl.pg import PgQueue

pytestmark = pytest.mark.stateful

T0 = datetime(2030, 6, 1, 8, 0, tzinfo=UTC)
LIMITS: dict[str, int | None] = {"solo": 1, "pair": 2, "open": None}
LEASE = timedelta(seconds=30)
# An odd multiplier: ids are distinct but not in creation order, so id tie-breaks still vary.
_ID_STEP = 0x9E3779B97F4A7C15F39CC0605CEDC835


def job_id(n: int) -> uuid.UUID:
    """The n-th job id of an example: the same choices must give the same ids, or claims that
    break ties by id differ between runs and Hypothesis sees a nondeterministic machine."""
    return uuid.UUID(int=(n * _ID_STEP) % (1 << 128))


@dataclass(frozen=True)
class Pair:
    """The same claim as each side saw it (tokens differ, the job and attempt do not)."""

    pg: Lease
    model: Lease


def comparable(state: JobState) -> tuple[object, ...]:
    return (
        state.job_id,
        state.account_id,
        state.status,
        state.attempts,
        state.max_attempts,
        state.last_error,
        state.locked_until,
        state.next_attempt_at,
    )


class QueueAgreement(RuleBasedStateMachine):
    dsn: str = ""
    schema: str = ""

    def __init__(self) -> None:
        super().__init__()
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            conn.execute(
                sql.SQL("TRUNCATE {}.jobs, {}.accounts, {}.job_attempts, {}.fenced_writes").format(
                    *[sql.Identifier(self.schema)] * 4
                )
            )
        self.now = T0
        self.pg = PgQueue(self.dsn, schema=self.schema)
        self.pg.pin_clock(T0)
        self.model = InMemoryQueue(clock=lambda: T0)
        accounts = [Account(id=a, concurrency_limit=n) for a, n in LIMITS.items()]
        self.pg.upsert_accounts(accounts)
        self.model.upsert_accounts(accounts)
        self.limits = dict(LIMITS)
        # The most jobs each limited account may have in flight now: its limit, or more while
        # the jobs it had in flight when its limit was lowered are still out.
        self.ceilings = {a: n for a, n in LIMITS.items() if n is not None}
        self.ids = 0
        self.held: list[Pair] = []  # leases not yet written back by their worker
        self.spent: list[Pair] = []  # leases written back or given up: any reuse is stale

    def teardown(self) -> None:
        self.pg.close()

    # -- rules ---------------------------------------------------------------------------

    @rule(
        account=st.sampled_from(sorted(LIMITS)),
        count=st.integers(min_value=1, max_value=3),
        delay=st.one_of(st.none(), st.integers(min_value=0, max_value=40)),
        max_attempts=st.integers(min_value=1, max_value=3),
    )
    def enqueue(self, account: str, count: int, delay: int | None, max_attempts: int) -> None:
        run_at = None if delay is None else self.now + timedelta(seconds=delay)
        self.ids += count
        jobs = [
            NewJob(
                id=job_id(self.ids - i),
                account_id=account,
                target_url="http://127.0.0.1:9/deliver",
                payload={"i": i},
                max_attempts=max_attempts,
                run_at=run_at,
            )
            for i in range(count)
        ]
        self.pg.enqueue(jobs)
        self.model.enqueue(jobs)

    @rule(account=st.sampled_from(sorted(LIMITS)),
          limit=st.one_of(st.none(), st.integers(min_value=1, max_value=3)))
    def set_limit(self, account: str, limit: int | None) -> None:
        """A limit changed (or removed, or set) with jobs queued and in flight: the claim
        reaches an account's jobs by whether it is limited, so every job must follow it."""
        self.pg.upsert_accounts([Account(id=account, concurrency_limit=limit)])
        self.model.upsert_accounts([Account(id=account, concurrency_limit=limit)])
        self.limits[account] = limit
        if limit is None:
            self.ceilings.pop(account, None)
        else:
            self.ceilings[account] = max(limit, self._in_flight().get(account, 0))

    def _in_flight(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for state in self.pg.snapshot():
            if state.status is JobStatus.PROCESSING:
                counts[state.account_id] = counts.get(state.account_id, 0) + 1
        return counts

    @rule(worker=st.sampled_from(["w1", "w2", "w3"]), batch=st.integers(1, 4))
    def claim(self, worker: str, batch: int) -> None:
        before = {s.job_id: s.status for s in self.pg.snapshot()}
        got_pg = self.pg.claim(worker, batch, LEASE)
        got_model = self.model.claim(worker, batch, LEASE)
        by_job = {lease.job_id: lease for lease in got_model}
        assert {lease.job_id for lease in got_pg} == set(by_job)
        for lease in got_pg:
            # No job leased twice: whatever was claimed was not held by anyone.
            assert before[lease.job_id] in (JobStatus.PENDING, JobStatus.RETRYING)
            assert lease.attempt == by_job[lease.job_id].attempt
            self.held.append(Pair(pg=lease, model=by_job[lease.job_id]))

    def _write(self, index: int, outcome: Outcome, delay: int, *, stale: bool) -> None:
        pool = self.spent if stale else self.held
        pair = pool[index % len(pool)]
        if not stale:
            self.held.remove(pair)
            self.spent.append(pair)
        results = [
            AttemptResult(
                lease=lease,
                outcome=outcome,
                http_status={"success": 200, "transient": 503, "permanent": 400}[outcome.value],
                error=None if outcome is Outcome.SUCCESS else f"{outcome.value} {delay}",
                retry_delay=timedelta(seconds=delay),
            )
            for lease in (pair.pg, pair.model)
        ]
        written_pg = self.pg.finish([results[0]])
        written_model = self.model.finish([results[1]])
        assert written_pg == written_model
        if stale:
            assert written_pg == [WriteResult.FENCED]

    @precondition(lambda self: self.held)
    @rule(index=st.integers(0, 50))
    def complete(self, index: int) -> None:
        self._write(index, Outcome.SUCCESS, 0, stale=False)

    @precondition(lambda self: self.held)
    @rule(index=st.integers(0, 50), delay=st.integers(0, 30))
    def fail_transient(self, index: int, delay: int) -> None:
        self._write(index, Outcome.TRANSIENT, delay, stale=False)

    @precondition(lambda self: self.held)
    @rule(index=st.integers(0, 50))
    def fail_permanent(self, index: int) -> None:
        self._write(index, Outcome.PERMANENT, 0, stale=False)

    @precondition(lambda self: self.spent)
    @rule(index=st.integers(0, 50))
    def stale_write(self, index: int) -> None:
        self._write(index, Outcome.SUCCESS, 0, stale=True)

    @precondition(lambda self: self.held)
    @rule(index=st.integers(0, 50))
    def release(self, index: int) -> None:
        pair = self.held.pop(index % len(self.held))
        self.spent.append(pair)
        assert self.pg.release([pair.pg]) == self.model.release([pair.model])

    @precondition(lambda self: self.held or self.spent)
    @rule(index=st.integers(0, 50), stale=st.booleans())
    def receive(self, index: int, stale: bool) -> None:
        """The worker confirms a claim in hand (again, or after its lease passed on, too):
        until it does, an expired lease is given back with its attempt."""
        pool = self.spent if stale and self.spent else self.held or self.spent
        pair = pool[index % len(pool)]
        assert self.pg.receive([pair.pg]) == self.model.receive([pair.model])

    @precondition(lambda self: self.held)
    @rule(index=st.integers(0, 50))
    def renew(self, index: int) -> None:
        pair = self.held[index % len(self.held)]
        [pg] = self.pg.renew([pair.pg], LEASE)
        [model] = self.model.renew([pair.model], LEASE)
        assert (pg is None) == (model is None)
        if pg is not None and model is not None:
            assert pg.locked_until == model.locked_until
            self.held[self.held.index(pair)] = Pair(pg=pg, model=model)

    @rule(seconds=st.integers(min_value=1, max_value=45))
    def advance(self, seconds: int) -> None:
        self.now += timedelta(seconds=seconds)
        self.pg.pin_clock(self.now)
        self.model.advance(seconds)

    @rule()
    def recover(self) -> None:
        assert self.pg.recover() == self.model.recover()

    # -- invariants ----------------------------------------------------------------------

    @invariant()
    def states_agree_and_hold(self) -> None:
        pg = self.pg.snapshot()
        model = self.model.snapshot()
        assert [comparable(s) for s in pg] == [comparable(s) for s in model]
        in_flight: dict[str, int] = {}
        for state in pg:
            assert 0 <= state.attempts <= state.max_attempts
            if state.status is JobStatus.PROCESSING:
                in_flight[state.account_id] = in_flight.get(state.account_id, 0) + 1
                assert state.locked_until is not None
        for account, ceiling in self.ceilings.items():
            count = in_flight.get(account, 0)
            assert count <= ceiling
            self.ceilings[account] = max(self.limits[account] or 0, count)
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            mismatched = conn.execute(
                sql.SQL(
                    "SELECT count(*) FROM {}.jobs AS j JOIN {}.accounts AS a "
                    "ON a.id = j.account_id WHERE j.status <> 'COMPLETED' "
                    "AND j.status <> 'FAILED' "
                    "AND j.limited <> (a.concurrency_limit IS NOT NULL)"
                ).format(sql.Identifier(self.schema), sql.Identifier(self.schema))
            ).fetchone()
        assert mismatched == (0,), "a job's limited flag disagrees with its account"


@pytest.fixture
def prepared_schema(pg_dsn: str, fresh_schema: str) -> Iterator[str]:
    queue = PgQueue(pg_dsn, schema=fresh_schema)
    queue.setup()
    queue.close()
    yield fresh_schema


def test_pg_queue_agrees_with_the_model(pg_dsn: str, prepared_schema: str) -> None:
    QueueAgreement.dsn = pg_dsn
    QueueAgreement.schema = prepared_schema
    run_state_machine_as_test(
        QueueAgreement,
        settings=settings(
            max_examples=50,
            stateful_step_count=40,
            deadline=None,
            database=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        ),
    )
