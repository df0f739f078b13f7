"""A queue whose recovery, claims or result writes never once worked is not judged valid.

The dispatcher records each call to the queue that raised as an `error` event (`op`,
`error`) and each recovery call that succeeded as a `recover` event, even when it moved
nothing. From those the checker says "unknown" when recovery failed and never ran, when
claims failed in every worker and none succeeded, or when no result write ever landed; a
few failures among successes, as under database faults, change nothing.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Mapping
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any, get_args

import pytest

from skiplock.queue_impl.config import DispatcherConfig
from skiplock.queue_impl.dispatcher import Dispatcher
from skiplock.queue_impl.interface import Lease
from skiplock.queue_impl.memory import InMemoryQueue
from skiplock.reports.checker import Verdict, check_run
from skiplock.reports.history import WORKER_LOG, LogFormat, WorkerEventKind
from skiplock.reports.synthetic import RunBuilder, write_log

SUCCEED: dict[str, Any] = {"name": "succeed", "first": {"behaviour": "ok"}, "times": None,
                           "then": {"behaviour": "ok"}}
DIVISION = "DivisionByZero: division by zero"


def check(builder: RunBuilder, tmp_path: Path) -> Verdict:
    return check_run([builder.write(tmp_path / "run")])


def clean_run(b: RunBuilder, jobs: int = 4) -> None:
    """Jobs that each succeed at once, spread over two workers."""
    for i in range(jobs):
        job = f"job-{i}"
        b.enqueue(job, script=SUCCEED, time=99.0)
        b.attempt(job, 1, claimed=100.0 + i, worker=f"worker-{i % 2}")
        b.final(job, "COMPLETED")


def recovery_failing(b: RunBuilder, *, calls: int = 7) -> None:
    for n in range(calls):
        for worker in ("worker-0", "worker-1"):
            b.event("error", worker, 100.5 + n, op="recover", error=DIVISION)


def test_the_error_kind_and_its_column_are_in_the_schema() -> None:
    assert "error" in get_args(WorkerEventKind)
    assert "op" in WORKER_LOG.names


def test_recovery_that_never_succeeded_is_unknown(tmp_path: Path) -> None:
    b = RunBuilder()
    clean_run(b)
    recovery_failing(b)
    verdict = check(b, tmp_path)
    assert verdict.valid == "unknown"
    assert verdict.exit_code == 3
    [reason] = verdict.unknown_reasons
    assert reason.startswith("recovery failed 14 times in 2 workers and never succeeded")
    assert "expired leases were ever recovered" in reason
    assert reason.endswith(f"worker-0 at 100.500 s: {DIVISION}")
    assert verdict.details["failed_calls"] == {"recover": 14}


def test_one_successful_recovery_call_anywhere_is_enough(tmp_path: Path) -> None:
    b = RunBuilder()
    clean_run(b)
    recovery_failing(b)
    # worker-1's recovery ran once, moving nothing: recovery is known to run.
    b.event("recover", "worker-1", 110.0, count=0)
    verdict = check(b, tmp_path)
    assert verdict.valid is True, verdict.unknown_reasons
    assert verdict.details["failed_calls"] == {"recover": 14}


def test_db_faults_like_history_with_errors_among_successes_stays_valid(
    tmp_path: Path,
) -> None:
    """Backends terminated twice: each call in flight fails once, then works again."""
    b = RunBuilder()
    b.fault("terminate_backends", 100.2, 100.3, target="postgres")
    b.fault("terminate_backends", 104.2, 104.3, target="postgres")
    lost = "OperationalError: terminating connection due to administrator command"
    for at in (100.25, 104.25):
        for worker in ("worker-0", "worker-1"):
            b.event("error", worker, at, op="recover", error=lost)
            b.event("error", worker, at + 0.01, op="claim", error=lost)
        b.event("error", "worker-0", at + 0.02, op="wait", error=lost)
        b.event("error", "worker-1", at + 0.02, op="renew", error=lost)
    for t in range(99, 110):
        for worker in ("worker-0", "worker-1"):
            b.event("recover", worker, float(t) + 0.9, count=0)
    clean_run(b)
    # A result write cut by the first fault: recorded as unknown (info) with its error
    # event, the lease expires and worker-1 delivers the job again.
    b.enqueue("cut", script=SUCCEED, time=99.0)
    b.attempt("cut", 1, claimed=100.1, worker="worker-0", write="info")
    b.event("error", "worker-0", 100.22, op="finish", error=lost)
    b.event("recover", "worker-1", 110.4, count=1)
    b.attempt("cut", 2, claimed=110.5, worker="worker-1")
    b.final("cut", "COMPLETED", attempts=2)
    verdict = check(b, tmp_path)
    assert verdict.valid is True, verdict.unknown_reasons
    assert verdict.counts["duplicate_explained"] == 1
    assert verdict.details["failed_calls"] == {"recover": 4, "claim": 4, "wait": 2,
                                               "renew": 2, "finish": 1}


def test_claims_that_failed_in_every_worker_and_never_succeeded_are_named(
    tmp_path: Path,
) -> None:
    b = RunBuilder(drained=False)
    broken = 'SyntaxError: syntax error at or near "SELEC"'
    for i in range(3):
        b.enqueue(f"job-{i}", script=SUCCEED, time=99.0)
        b.final(f"job-{i}", "PENDING", attempts=0)
    for worker in ("worker-0", "worker-1"):
        b.event("start", worker, 99.5, pid=1)
        b.event("recover", worker, 99.6, count=0)
        for n in range(5):
            b.event("error", worker, 100.0 + n, op="claim", error=broken)
    verdict = check(b, tmp_path)
    assert verdict.valid == "unknown"
    claims = [r for r in verdict.unknown_reasons if r.startswith("claims failed")]
    assert claims == [f"claims failed 10 times in 2 workers and never succeeded (the history "
                      f"cannot show that any job was claimed); first error, worker-0 at "
                      f"100.000 s: {broken}"]


def test_claims_failing_in_one_worker_only_are_not_a_reason(tmp_path: Path) -> None:
    b = RunBuilder()
    b.event("start", "worker-1", 99.5, pid=1)
    b.event("error", "worker-1", 100.0, op="claim", error="OperationalError: gone")
    b.event("stop", "worker-1", 100.1, reason="SIGTERM")
    clean_run(b, jobs=2)
    verdict = check(b, tmp_path)
    assert verdict.valid is True, verdict.unknown_reasons


def test_result_writes_that_never_landed_are_named(tmp_path: Path) -> None:
    b = RunBuilder()
    b.enqueue("job-0", script=SUCCEED, time=99.0)
    b.attempt("job-0", 1, claimed=100.0, write="info")
    b.event("error", "worker-0", 100.02, op="finish", error="UndefinedColumn: column x")
    b.final("job-0", "COMPLETED")
    verdict = check(b, tmp_path)
    assert any(r.startswith("result writes failed 1 time in 1 worker and never succeeded")
               for r in verdict.unknown_reasons), verdict.unknown_reasons
    assert verdict.valid == "unknown"


def test_a_violation_wins_over_recovery_that_never_ran(tmp_path: Path) -> None:
    b = RunBuilder()
    clean_run(b)
    recovery_failing(b)
    b.deliver("never-enqueued", attempt=1, received=101.0, answered=101.01)
    verdict = check(b, tmp_path)
    assert verdict.valid is False
    assert verdict.exit_code == 1
    assert verdict.counts["unexpected"] == 1
    assert any(r.startswith("recovery failed") for r in verdict.unknown_reasons)


def test_a_log_written_before_the_op_column_still_reads(tmp_path: Path) -> None:
    """Readers go by the header's names: a log without `op` (and with the zero-count
    `recover` events missing, as older workers wrote them) is judged as before."""
    b = RunBuilder()
    clean_run(b)
    run = b.write(tmp_path / "run")
    old = LogFormat(WORKER_LOG.what, tuple(c for c in WORKER_LOG.columns if c[0] != "op"),
                    flatten=WORKER_LOG.flatten, unflatten=WORKER_LOG.unflatten)
    for worker, lines in b.workers.items():
        rows = [old.line(_record(line)) for line in lines]
        write_log(run / "workers" / f"{worker}.csv", old, rows)
    assert "op" not in (run / "workers" / "worker-0.csv").read_text().splitlines()[0]
    verdict = check_run([run])
    assert verdict.valid is True, verdict.unknown_reasons


def _record(line: str) -> dict[str, Any]:
    from skiplock.reports.history import parse_row

    return parse_row(Path("x"), 2, line, list(WORKER_LOG.names), WORKER_LOG)


# --------------------------------------------------------------------------------------------
# The dispatcher's side: what it records when a call to the queue raises.
# --------------------------------------------------------------------------------------------


class BrokenRecovery(InMemoryQueue):
    """Recovery raises on its first `failures` calls, then works; claims raise on theirs."""

    shared = False

    def __init__(self, *, recover_failures: int, claim_failures: int = 0) -> None:
        super().__init__()
        self.recover_failures = recover_failures
        self.claim_failures = claim_failures

    def recover(self, limit: int = 100) -> int:
        if self.recover_failures:
            self.recover_failures -= 1
            raise ZeroDivisionError("division by zero")
        return super().recover(limit)

    def claim(self, worker_id: str, batch: int, lease: timedelta) -> list[Lease]:
        if self.claim_failures:
            self.claim_failures -= 1
            raise RuntimeError("claim block refused")
        return super().claim(worker_id, batch, lease)


CONFIG = DispatcherConfig(lease_seconds=5.0, http_timeout_seconds=1.0,
                          write_margin_seconds=0.5, poll_seconds=0.02,
                          recovery_interval_seconds=0.02)


def run_briefly(backend: InMemoryQueue, config: DispatcherConfig = CONFIG,
                seconds: float = 0.4) -> list[tuple[str, dict[str, Any]]]:
    events: list[tuple[str, dict[str, Any]]] = []
    lock = threading.Lock()

    def sink(kind: str, fields: Mapping[str, Any]) -> None:
        with lock:
            events.append((kind, dict(fields)))

    dispatcher = Dispatcher(backend, config, "worker-0", sink)

    async def main() -> None:
        asyncio.get_running_loop().call_later(seconds, dispatcher.request_stop)
        await dispatcher.run()

    asyncio.run(main())
    return events


def test_dispatcher_records_failed_and_successful_recovery_calls() -> None:
    events = run_briefly(BrokenRecovery(recover_failures=2, claim_failures=1))
    errors = [f for kind, f in events if kind == "error"]
    assert [f for f in errors if f["op"] == "recover"] == [
        {"op": "recover", "error": "ZeroDivisionError: division by zero"}] * 2
    assert [f for f in errors if f["op"] == "claim"] == [
        {"op": "claim", "error": "RuntimeError: claim block refused"}]
    # Every recovery call that worked is an event, also when it moved nothing.
    recovered = [f for kind, f in events if kind == "recover"]
    assert recovered and all(f == {"count": 0} for f in recovered)
    for kind, fields in events:
        WORKER_LOG.line({"kind": kind, "worker": "worker-0", "time": 1.0,
                         "job_id": None, "attempt": None, "data": fields})


@pytest.mark.parametrize("enabled", [True, False])
def test_dispatcher_without_recovery_records_no_recover_events(enabled: bool) -> None:
    config = replace(CONFIG, recovery_enabled=enabled)
    events = run_briefly(BrokenRecovery(recover_failures=0), config, seconds=0.2)
    assert any(kind == "recover" for kind, _ in events) is enabled
    assert not any(kind == "error" for kind, _ in events)
