"""The checker on hand-built histories: every anomaly kind, explained duplicates for every
fault kind, histories that must pass, and histories that cannot decide.

Unless a test says otherwise: HTTP timeout 2 s, lease 10 s, backoff base 1 s with jitter 0.5
(so the shortest retry waits are 0.5 s, 1 s, 2 s ...), tolerance 0.25 s.
"""

from __future__ import annotations

import csv
import io
import json
from collections import Counter
from collections.abc import Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from skiplock.reports.checker import COUNT_KEYS, VIOLATION_KEYS, Verdict, check_run, write_verdict
from skiplock.reports.history import (
    DELIVERY_LOG,
    ENQUEUE_LOG,
    FINAL_JOBS_LOG,
    WORKER_LOG,
    HistoryError,
    LogFormat,
    read_log,
)
from skiplock.reports.synthetic import LineWriter, RunBuilder, history_files, write_log
from skiplock.scenarios.bench.checker import build_synthetic

LOGS: dict[str, LogFormat] = {"enqueues.csv": ENQUEUE_LOG, "final_jobs.csv": FINAL_JOBS_LOG,
                              "deliveries": DELIVERY_LOG, "workers": WORKER_LOG}


def log_of(path: Path) -> LogFormat:
    return LOGS.get(path.name) or LOGS[path.parent.name]

SUCCEED: dict[str, Any] = {"name": "succeed", "first": {"behaviour": "ok"}, "times": None,
                           "then": {"behaviour": "ok"}}


def script(first: dict[str, Any], times: int | None = None) -> dict[str, Any]:
    return {"name": "custom", "first": first, "times": times, "then": {"behaviour": "ok"}}


FAIL_ONCE = script({"behaviour": "status", "status": 503}, 1)
FAIL_TWICE = script({"behaviour": "status", "status": 503}, 2)
ALWAYS_503 = script({"behaviour": "status", "status": 503})
ALWAYS_400 = script({"behaviour": "status", "status": 400})
ALWAYS_HANG = script({"behaviour": "hang", "seconds": 5.0})
SLOW = script({"behaviour": "slow", "seconds": 0.5})
RESET_ONCE = script({"behaviour": "reset"}, 1)

JOB = "job-1"


def check(builder: RunBuilder, tmp_path: Path, **kwargs: Any) -> Verdict:
    return check_run([builder.write(tmp_path / "run", **kwargs)])


def anomalies(verdict: Verdict) -> dict[str, int]:
    """The non-zero counts that are not plain totals."""
    totals = {"enqueued", "delivered", "completed", "failed"}
    return {k: v for k, v in verdict.counts.items() if v and k not in totals}


def whys(verdict: Verdict, kind: str) -> list[str]:
    return [e["why"] for e in verdict.examples.get(kind, [])]


def said(verdict: Verdict, kind: str) -> list[dict[str, str]]:
    """The examples of `kind` as a person reads them: the job and the sentence."""
    return [{"job_id": e["job_id"], "why": e["why"]} for e in verdict.examples.get(kind, [])]


def succeed_once(b: RunBuilder, job: str, at: float, **kw: Any) -> None:
    b.enqueue(job, script=SUCCEED, time=at - 0.5, account=kw.get("account", "acct-0"))
    b.attempt(job, 1, claimed=at, **kw)
    b.final(job, "COMPLETED", account=kw.get("account", "acct-0"))


# --------------------------------------------------------------------------------------------
# Histories that must pass.
# --------------------------------------------------------------------------------------------


def test_fault_free_run_is_valid(tmp_path: Path) -> None:
    b = RunBuilder(account_limits={"acct-0": 2, "acct-1": None})
    succeed_once(b, "a", 100.0)
    succeed_once(b, "b", 100.0, worker="worker-1")
    succeed_once(b, "c", 101.0, account="acct-1")
    verdict = check(b, tmp_path)
    assert verdict.valid is True
    assert verdict.exit_code == 0
    assert set(verdict.counts) == set(COUNT_KEYS)
    assert verdict.counts["enqueued"] == 3
    assert verdict.counts["delivered"] == 3
    assert verdict.counts["completed"] == 3
    assert anomalies(verdict) == {}
    assert verdict.examples == {}


def test_faulty_scripts_with_correct_retries_and_dead_letters_pass(tmp_path: Path) -> None:
    b = RunBuilder()
    # 503 twice, then 200: retries after 0.5 s and 1 s at least.
    b.enqueue("retry", script=FAIL_TWICE, max_attempts=5)
    b.attempt("retry", 1, claimed=100.0, status=503, behaviour="status")
    b.attempt("retry", 2, claimed=100.7, status=503, behaviour="status")
    b.attempt("retry", 3, claimed=101.9)
    b.final("retry", "COMPLETED", attempts=3, max_attempts=5)
    # 400: dead-lettered at once.
    b.enqueue("perm", script=ALWAYS_400)
    b.attempt("perm", 1, claimed=100.0, status=400, behaviour="status")
    b.final("perm", "FAILED")
    # 503 for ever: dead-lettered at max_attempts.
    b.enqueue("dead", script=ALWAYS_503, max_attempts=3)
    b.attempt("dead", 1, claimed=100.0, status=503, behaviour="status")
    b.attempt("dead", 2, claimed=100.6, status=503, behaviour="status")
    b.attempt("dead", 3, claimed=101.7, status=503, behaviour="status")
    b.final("dead", "FAILED", attempts=3)
    # Slow inside the timeout: a success.
    b.enqueue("slow", script=SLOW)
    b.attempt("slow", 1, claimed=100.0, latency=0.5, behaviour="slow")
    b.final("slow", "COMPLETED")
    # A reset, then 200.
    b.enqueue("reset", script=RESET_ONCE)
    b.attempt("reset", 1, claimed=100.0, answered=False, behaviour="reset",
              result="connection_error")
    b.attempt("reset", 2, claimed=100.6)
    b.final("reset", "COMPLETED", attempts=2)
    # Hangs past the timeout every time: the target answers 200 late (duplicates the timeout
    # explains) and the job is dead-lettered. Each retry waits its backoff after the
    # worker's call ended (claim + 2 s timeout).
    b.enqueue("hang", script=ALWAYS_HANG, max_attempts=3)
    b.attempt("hang", 1, claimed=100.0, latency=5.0, behaviour="hang")
    b.attempt("hang", 2, claimed=102.6, latency=5.0, behaviour="hang")
    b.attempt("hang", 3, claimed=105.7, latency=5.0, behaviour="hang")
    b.final("hang", "FAILED", attempts=3)
    verdict = check(b, tmp_path)
    assert verdict.valid is True, verdict.examples
    assert verdict.counts["enqueued"] == 6
    assert verdict.counts["delivered"] == 13
    assert verdict.counts["completed"] == 3
    assert verdict.counts["failed"] == 3
    assert anomalies(verdict) == {"duplicate_explained": 2}
    assert all("HTTP timeout" in why for why in whys(verdict, "duplicate_explained"))
    assert {e["job_id"] for e in verdict.examples["duplicate_explained"]} == {"hang"}


def test_synthetic_benchmark_history_is_valid(tmp_path: Path) -> None:
    mix = build_synthetic(tmp_path / "run", 3000, seed=7)
    verdict = check_run([tmp_path / "run"])
    assert verdict.valid is True, verdict.examples
    assert verdict.counts["delivered"] == mix["deliveries"]
    assert verdict.counts["duplicate_explained"] == mix["jobs_duplicate"]
    assert verdict.counts["failed"] == mix["jobs_dead"]


def test_builder_writes_what_the_log_format_writes(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The builder formats lines itself, for speed: every line of a synthetic history, and
    of records with values it cannot take the fast way, is byte for byte what
    `LogFormat.line` writes for the same record, and the files read back."""
    fast = LineWriter.line
    compared: Counter[str] = Counter()

    def compare(self: LineWriter, record: Mapping[str, Any]) -> str:
        line = fast(self, record)
        assert line == self.log.line(record), record
        compared[self.log.what] += 1
        return line

    monkeypatch.setattr(LineWriter, "line", compare)
    run_dir = tmp_path / "run"
    build_synthetic(run_dir, 300, seed=3)
    b = RunBuilder()
    b.enqueue('a,"b"', script=ALWAYS_HANG, account="acct\nnext")
    b.event("renew", "worker-0", 107.0, job_id="a", attempt=1, lost=True)
    b.event("stop", "worker-0", 108.0, reason='error: "boom", again')
    b.deliver("a", attempt=1, received=100.0, answered=None, worker="worker,0",
              behaviour="hang_forever")
    b.final("a", "FAILED")
    b.write(run_dir / "more")
    assert set(compared) == {"enqueue", "delivery", "worker event", "final job state"}
    assert sum(compared.values()) > 1000
    logs = [p for p in history_files(run_dir) if p.suffix == ".csv"]
    assert len(logs) == 11
    for path in logs:
        log = log_of(path)
        written = path.read_text().splitlines(keepends=True)
        assert len(written) > 1, path
        assert written[0] == log.header()
        assert written[1:] == [log.line(r) for r in read_log(path, log)], path


# --------------------------------------------------------------------------------------------
# Excuses duplicates: one per fault kind that can cause a redelivery.
# --------------------------------------------------------------------------------------------


def _redelivered(b: RunBuilder, *, first_write: str | None, result: str | None = None,
                 latency: float = 0.01) -> None:
    """Attempt 1 by worker-0 reaches the target with 200 but its result is not applied;
    the lease expires and worker-1 delivers attempt 2."""
    b.enqueue(JOB, script=SUCCEED)
    b.attempt(JOB, 1, claimed=100.0, worker="worker-0", write=first_write, result=result,
              latency=latency)
    b.attempt(JOB, 2, claimed=110.5, worker="worker-1")
    b.final(JOB, "COMPLETED", attempts=2)


@pytest.mark.parametrize(
    ("fault", "start", "end", "target", "needle"),
    [
        ("kill_worker", 100.2, None, "worker-0", "kill_worker on worker-0"),
        ("pause_worker", 100.05, 111.0, "worker-0", "pause_worker on worker-0"),
        ("crash_after_http", 100.02, None, "worker-0", "crash_after_http on worker-0"),
        ("crash_after_claim", 100.03, None, "worker-0", "crash_after_claim on worker-0"),
        ("terminate_backends", 100.02, None, "postgres", "terminate_backends"),
        ("restart_postgres", 100.02, 104.0, "postgres", "restart_postgres"),
        ("exhaust_pool", 99.0, 105.0, None, "exhaust_pool"),
        ("hang_target", 100.0, 103.0, "target-0", "hang_target on target-0"),
    ],
)
def test_duplicate_explained_by_each_fault(tmp_path: Path, fault: str, start: float,
                                           end: float | None, target: str | None,
                                           needle: str) -> None:
    b = RunBuilder()
    _redelivered(b, first_write=None)
    b.fault(fault, start, end, target=target)
    verdict = check(b, tmp_path)
    assert verdict.valid is True, verdict.examples
    assert anomalies(verdict) == {"duplicate_explained": 1}
    assert needle in whys(verdict, "duplicate_explained")[0]


def test_duplicate_explained_by_failpoint_naming_the_job(tmp_path: Path) -> None:
    b = RunBuilder()
    _redelivered(b, first_write=None)
    b.event("failpoint", "worker-0", 100.02, job_id=JOB, attempt=1, name="crash_after_http")
    b.fault("crash_after_http", 100.02, None, target="worker-0", job_id=JOB, attempt=1)
    verdict = check(b, tmp_path)
    assert anomalies(verdict) == {"duplicate_explained": 1}
    assert whys(verdict, "duplicate_explained") == [
        "failpoint crash_after_http fired in worker-0 at 100.020 s for attempt 1"]


def test_duplicate_explained_by_failpoint_of_a_batch_mate(tmp_path: Path) -> None:
    b = RunBuilder()
    _redelivered(b, first_write=None)
    b.enqueue("other", script=SUCCEED, answer=None)
    b.event("failpoint", "worker-0", 100.05, job_id="other", attempt=1,
            name="crash_after_claim")
    verdict = check(b, tmp_path)
    assert anomalies(verdict) == {"duplicate_explained": 1}
    assert whys(verdict, "duplicate_explained")[0].startswith(
        "failpoint crash_after_claim ended worker-0 at 100.050 s")


def test_duplicate_explained_by_lost_write_connection(tmp_path: Path) -> None:
    b = RunBuilder()
    _redelivered(b, first_write="info")
    verdict = check(b, tmp_path)
    assert anomalies(verdict) == {"duplicate_explained": 1}
    assert "connection lost during the result write of attempt 1" in whys(
        verdict, "duplicate_explained")[0]


def test_duplicate_explained_by_late_answer(tmp_path: Path) -> None:
    b = RunBuilder()
    _redelivered(b, first_write="applied", latency=3.0)
    verdict = check(b, tmp_path)
    assert anomalies(verdict) == {"duplicate_explained": 1}
    assert whys(verdict, "duplicate_explained")[0].startswith("HTTP timeout")


def test_duplicate_explained_by_worker_error_stop(tmp_path: Path) -> None:
    b = RunBuilder()
    _redelivered(b, first_write=None)
    b.event("stop", "worker-0", 100.5, reason="error: OperationalError: gone")
    verdict = check(b, tmp_path)
    assert anomalies(verdict) == {"duplicate_explained": 1}
    assert "error stop" in whys(verdict, "duplicate_explained")[0]


@pytest.mark.parametrize(
    ("fault", "skipped"),
    [
        ("pin_xmin", None),  # holding back xmin loses no write
        ("restart_postgres", "server is external"),  # never applied
    ],
)
def test_faults_that_explain_nothing(tmp_path: Path, fault: str, skipped: str | None) -> None:
    b = RunBuilder()
    _redelivered(b, first_write=None)
    b.fault(fault, 99.0, 120.0, target="postgres", skipped=skipped)
    verdict = check(b, tmp_path)
    assert verdict.valid is False
    assert anomalies(verdict) == {"duplicate_unexplained": 1}


def test_fault_on_another_worker_or_outside_the_window_explains_nothing(
        tmp_path: Path) -> None:
    b = RunBuilder()
    _redelivered(b, first_write=None)
    b.fault("kill_worker", 100.2, None, target="worker-7")
    b.fault("kill_worker", 50.0, None, target="worker-0")
    b.fault("terminate_backends", 130.0, None, target="postgres")
    verdict = check(b, tmp_path)
    assert anomalies(verdict) == {"duplicate_unexplained": 1}


# --------------------------------------------------------------------------------------------
# One anomaly at a time.
# --------------------------------------------------------------------------------------------


def test_lost_never_delivered_and_absent(tmp_path: Path) -> None:
    b = RunBuilder()
    succeed_once(b, "ok", 100.0)
    b.enqueue("gone", script=SUCCEED)
    verdict = check(b, tmp_path)
    assert verdict.valid is False
    assert verdict.exit_code == 1
    assert anomalies(verdict) == {"lost": 1}
    assert said(verdict, "lost") == [{
        "job_id": "gone",
        "why": "enqueue acknowledged, never delivered with 2xx, absent from the final states",
    }]


def test_lost_completed_without_delivery_is_also_a_state_mismatch(tmp_path: Path) -> None:
    b = RunBuilder()
    b.enqueue("ghost", script=SUCCEED)
    b.final("ghost", "COMPLETED")
    verdict = check(b, tmp_path)
    assert anomalies(verdict) == {"lost": 1, "state_mismatch": 1}
    assert whys(verdict, "state_mismatch") == ["COMPLETED but the target never answered 2xx"]


def test_unknown_enqueue_never_delivered_is_not_lost(tmp_path: Path) -> None:
    b = RunBuilder()
    b.enqueue("maybe", script=SUCCEED, answer="info")
    b.enqueue("never-answered", script=SUCCEED, answer=None)
    b.enqueue("refused", script=SUCCEED, answer="fail")
    verdict = check(b, tmp_path)
    assert verdict.valid is True
    assert verdict.counts["enqueued"] == 0
    assert verdict.details["enqueue_unknown"] == 2
    assert verdict.details["enqueue_failed"] == 1


def test_unexpected_deliveries(tmp_path: Path) -> None:
    b = RunBuilder()
    succeed_once(b, "ok", 100.0)
    b.deliver("stranger", attempt=1, received=100.0, answered=100.01)
    b.enqueue("refused", script=SUCCEED, answer="fail")
    b.deliver("refused", attempt=1, received=100.0, answered=100.01)
    verdict = check(b, tmp_path)
    assert anomalies(verdict) == {"unexpected": 2}
    assert said(verdict, "unexpected") == [
        {"job_id": "stranger", "why": "delivered but never enqueued (target target-0)"},
        {"job_id": "refused", "why": "delivered although its enqueue failed (target target-0)"},
    ]


def test_duplicate_unexplained(tmp_path: Path) -> None:
    b = RunBuilder()
    _redelivered(b, first_write="applied")
    verdict = check(b, tmp_path)
    assert verdict.valid is False
    assert anomalies(verdict) == {"duplicate_unexplained": 1}
    assert whys(verdict, "duplicate_unexplained") == [
        "2xx delivered again at 110.501 s (attempt 2 by worker-1) after attempt 1 by worker-0 "
        "succeeded at 100.001 s; nothing recorded explains it"]


def test_concurrent_deliveries_of_a_double_claim(tmp_path: Path) -> None:
    """What a queue without row locks does: two workers run attempt 1 at once."""
    b = RunBuilder()
    b.enqueue(JOB, script=SUCCEED)
    b.attempt(JOB, 1, claimed=100.0, worker="worker-0", latency=0.5)
    b.attempt(JOB, 1, claimed=100.1, worker="worker-1", latency=0.5)
    b.final(JOB, "COMPLETED")
    verdict = check(b, tmp_path)
    assert anomalies(verdict) == {"concurrent_delivery": 1, "duplicate_unexplained": 1}
    assert whys(verdict, "concurrent_delivery") == [
        "delivery at 100.101 s (attempt 1) while attempt 1 from 100.001 s was still in flight "
        "with its lease held"]


def test_concurrent_delivery_alone(tmp_path: Path) -> None:
    b = RunBuilder()
    b.enqueue(JOB, script=SUCCEED)
    b.attempt(JOB, 1, claimed=100.0, worker="worker-0", latency=0.5)
    b.attempt(JOB, 1, claimed=100.1, worker="worker-1", status=503, behaviour="status",
              write="fenced")
    b.final(JOB, "COMPLETED")
    verdict = check(b, tmp_path)
    assert anomalies(verdict) == {"concurrent_delivery": 1}


def test_overlap_before_the_timeout_is_concurrent(tmp_path: Path) -> None:
    """A hang is abandoned at the timeout, not before: a retry while it runs is wrong."""
    b = RunBuilder()
    b.enqueue(JOB, script=script({"behaviour": "hang", "seconds": 5.0}, 1))
    b.attempt(JOB, 1, claimed=100.0, latency=5.0, behaviour="hang", write=None)
    b.attempt(JOB, 2, claimed=100.5, worker="worker-1")
    b.final(JOB, "COMPLETED", attempts=2)
    verdict = check(b, tmp_path)
    assert anomalies(verdict) == {"concurrent_delivery": 1, "early_retry": 1,
                                  "duplicate_unexplained": 1}


def test_overlap_after_an_expired_lease_is_not_concurrent(tmp_path: Path) -> None:
    """Attempt 1 hangs past its lease (unsafe timing); attempt 2 after the lease is fine."""
    b = RunBuilder(http_timeout_seconds=30.0, lease_seconds=10.0)
    b.enqueue(JOB, script=SUCCEED)
    b.attempt(JOB, 1, claimed=100.0, worker="worker-0", latency=15.0, write="fenced")
    b.attempt(JOB, 2, claimed=110.5, worker="worker-1", status=503, behaviour="status")
    b.attempt(JOB, 3, claimed=111.5, worker="worker-1", status=400, behaviour="status")
    b.final(JOB, "COMPLETED", attempts=3)
    verdict = check(b, tmp_path)
    assert anomalies(verdict) == {}


def test_attempts_exceeded(tmp_path: Path) -> None:
    b = RunBuilder()
    b.enqueue("over", script=ALWAYS_503, max_attempts=2)
    b.attempt("over", 1, claimed=100.0, status=503, behaviour="status")
    b.attempt("over", 2, claimed=100.6, status=503, behaviour="status")
    b.attempt("over", 3, claimed=101.7, status=503, behaviour="status")
    b.final("over", "FAILED", attempts=3, max_attempts=2)
    b.enqueue("again", script=ALWAYS_400, max_attempts=3)
    b.attempt("again", 1, claimed=100.0, status=400, behaviour="status")
    b.attempt("again", 2, claimed=101.0, status=400, behaviour="status")
    b.final("again", "FAILED", attempts=2)
    verdict = check(b, tmp_path)
    assert anomalies(verdict) == {"attempts_exceeded": 2}
    assert said(verdict, "attempts_exceeded") == [
        {"job_id": "over", "why": "3 deliveries (0 explained by faults) for max_attempts 2"},
        {"job_id": "again",
         "why": "delivered again at 101.001 s after attempt 1 failed permanently (status 400)"},
    ]


def test_explained_redeliveries_do_not_exceed_attempts(tmp_path: Path) -> None:
    """pg-long-tx: the first claim rolled back with its transaction when the result write
    was lost, so the job was claimed once for good and delivered twice, the first
    delivery explained by the lost write."""
    b = RunBuilder()
    b.run_info["backend"] = "pg-long-tx"
    b.enqueue(JOB, script=SUCCEED, max_attempts=1)
    b.attempt(JOB, 1, claimed=100.0, worker="worker-0", write="info")
    b.attempt(JOB, 1, claimed=110.5, worker="worker-1")
    b.final(JOB, "COMPLETED", max_attempts=1)
    verdict = check(b, tmp_path)
    assert anomalies(verdict) == {"duplicate_explained": 1}


def test_a_fault_never_explains_an_extra_committed_claim(tmp_path: Path) -> None:
    """The reference commits each claim before it calls: the same history there is two
    committed claims for max_attempts 1, whatever explains the second delivery."""
    b = RunBuilder()
    b.enqueue(JOB, script=SUCCEED, max_attempts=1)
    b.attempt(JOB, 1, claimed=100.0, worker="worker-0", write="info")
    b.attempt(JOB, 1, claimed=110.5, worker="worker-1")
    b.final(JOB, "COMPLETED", max_attempts=1)
    verdict = check(b, tmp_path)
    assert anomalies(verdict) == {"duplicate_explained": 1, "attempts_exceeded": 1}
    assert whys(verdict, "attempts_exceeded") == [
        "2 committed claims for max_attempts 1 (0 given back by release)"]


def test_a_claim_given_back_by_release_uses_no_attempt(tmp_path: Path) -> None:
    """Claimed, given back unexecuted (an applied release), claimed again and delivered:
    one attempt of one, and a pause over the released claim explains no missing attempt."""
    b = RunBuilder()
    b.enqueue(JOB, script=SUCCEED, max_attempts=1)
    b.event("claim", "worker-0", 100.0, job_id=JOB, attempt=1, lease_token="t1",
            locked_until=110.0)
    b.event("release", "worker-0", 100.01, job_id=JOB, attempt=1, result="applied")
    b.attempt(JOB, 1, claimed=101.0, worker="worker-1")
    b.final(JOB, "COMPLETED", max_attempts=1)
    assert anomalies(check(b, tmp_path / "a")) == {}

    fail_twice = RunBuilder()
    fail_twice.enqueue(JOB, script=FAIL_TWICE, max_attempts=3)
    fail_twice.event("claim", "worker-0", 100.0, job_id=JOB, attempt=1, lease_token="t1",
                     locked_until=110.0)
    fail_twice.event("release", "worker-0", 100.01, job_id=JOB, attempt=1, result="applied")
    fail_twice.fault("pause_worker", 99.0, 100.02, target="worker-0")
    # A queue that kept the released attempt: two deliveries, then a dead letter.
    fail_twice.attempt(JOB, 2, claimed=101.0, worker="worker-1", status=503,
                       behaviour="status")
    fail_twice.attempt(JOB, 3, claimed=103.0, worker="worker-1", status=503,
                       behaviour="status")
    fail_twice.final(JOB, "FAILED", attempts=3, max_attempts=3)
    verdict = check(fail_twice, tmp_path / "b")
    assert "state_mismatch" in anomalies(verdict), verdict.examples


def test_early_retry(tmp_path: Path) -> None:
    b = RunBuilder()
    b.enqueue(JOB, script=FAIL_ONCE)
    b.attempt(JOB, 1, claimed=100.0, status=503, behaviour="status")
    b.attempt(JOB, 2, claimed=100.1)
    b.final(JOB, "COMPLETED", attempts=2)
    verdict = check(b, tmp_path)
    assert anomalies(verdict) == {"early_retry": 1}
    assert whys(verdict, "early_retry") == [
        "retry at 100.101 s came 0.090s after attempt 1 failed; the backoff allows no less "
        "than 0.500s"]


def test_early_retry_uses_the_attempt_number(tmp_path: Path) -> None:
    """After the second failure the wait is at least 1 s: 0.7 s is early."""
    b = RunBuilder()
    b.enqueue(JOB, script=FAIL_TWICE, max_attempts=5)
    b.attempt(JOB, 1, claimed=100.0, status=503, behaviour="status")
    b.attempt(JOB, 2, claimed=100.6, status=503, behaviour="status")
    b.attempt(JOB, 3, claimed=101.3)
    b.final(JOB, "COMPLETED", attempts=3, max_attempts=5)
    verdict = check(b, tmp_path)
    assert anomalies(verdict) == {"early_retry": 1}


def test_early_retry_after_a_timeout(tmp_path: Path) -> None:
    """A timeout is explained as a cause of duplicates, not as a reason to skip backoff."""
    b = RunBuilder(retry_base_seconds=4.0)  # at least 2 s after the first failure
    b.enqueue(JOB, script=script({"behaviour": "hang", "seconds": 5.0}, 1))
    b.attempt(JOB, 1, claimed=100.0, latency=5.0, behaviour="hang")
    b.attempt(JOB, 2, claimed=102.6)
    b.final(JOB, "COMPLETED", attempts=2)
    verdict = check(b, tmp_path)
    assert anomalies(verdict) == {"early_retry": 1, "duplicate_explained": 1}


def test_retry_after_an_expired_lease_is_due_at_once(tmp_path: Path) -> None:
    """Backoff would be 15 s, but the worker died without writing: recovery makes the job
    due when the 10 s lease runs out."""
    b = RunBuilder(retry_base_seconds=30.0, retry_cap_seconds=60.0)
    b.enqueue(JOB, script=FAIL_ONCE)
    b.attempt(JOB, 1, claimed=100.0, status=503, behaviour="status", write=None)
    b.attempt(JOB, 2, claimed=110.5, worker="worker-1")
    b.final(JOB, "COMPLETED", attempts=2)
    verdict = check(b, tmp_path)
    assert anomalies(verdict) == {}


def test_limit_exceeded(tmp_path: Path) -> None:
    b = RunBuilder(account_limits={"acct-0": 1, "acct-1": None})
    for name, at in (("a", 100.0), ("b", 100.1)):
        b.enqueue(name, script=SUCCEED)
        b.attempt(name, 1, claimed=at, latency=0.5, worker=f"w-{name}")
        b.final(name, "COMPLETED")
    for name in ("c", "d"):  # unlimited account: any overlap is fine
        b.enqueue(name, script=SUCCEED, account="acct-1")
        b.attempt(name, 1, claimed=100.0, latency=0.5, account="acct-1")
        b.final(name, "COMPLETED", account="acct-1")
    verdict = check(b, tmp_path)
    assert anomalies(verdict) == {"limit_exceeded": 1}
    assert said(verdict, "limit_exceeded") == [
        {"job_id": "b", "why": "account acct-0 had 2 deliveries in flight at 100.101 s, limit 1"}]


def test_abandoned_delivery_frees_its_slot(tmp_path: Path) -> None:
    """A delivery the worker gave up on (timeout) holds no slot, though the target is
    still busy with it."""
    b = RunBuilder(account_limits={"acct-0": 1})
    b.enqueue("slowpoke", script=ALWAYS_HANG, max_attempts=1)
    b.attempt("slowpoke", 1, claimed=100.0, latency=5.0, behaviour="hang")
    b.final("slowpoke", "FAILED")
    b.enqueue("next", script=SUCCEED)
    b.attempt("next", 1, claimed=102.3)
    b.final("next", "COMPLETED")
    verdict = check(b, tmp_path)
    assert anomalies(verdict) == {}


def test_a_request_that_reached_the_target_late_frees_its_slot_at_the_workers_timeout(
        tmp_path: Path) -> None:
    """The worker's timer starts before its request reaches the target: abandoned at the
    timeout the worker recorded, the slot is free then, though the target's receipt plus the
    timeout comes later (pgqueuer's long-calls gate run, 0.34 s between start and receipt)."""
    b = RunBuilder(account_limits={"acct-0": 1})
    b.enqueue("late", script=script({"behaviour": "slow", "seconds": 3.0}, 1), max_attempts=1)
    b.event("claim", "worker-0", 100.0, job_id="late", attempt=1, locked_until=110.0)
    b.deliver("late", attempt=1, received=100.5, answered=103.5, behaviour="slow")
    b.event("http", "worker-0", 102.0, job_id="late", attempt=1, start=100.0, end=102.0,
            result="timeout", status=None, error="no answer within 2s")
    b.event("write", "worker-0", 102.01, job_id="late", attempt=1, outcome="transient",
            result="applied", error="no answer within 2s", started=102.0)
    b.final("late", "FAILED")
    b.enqueue("next", script=SUCCEED)
    b.attempt("next", 1, claimed=102.1)
    b.final("next", "COMPLETED")
    assert anomalies(check(b, tmp_path / "recorded")) == {}
    # Without the worker's record of the timeout, receipt + timeout is all there is.
    b.workers["worker-0"] = [line for line in b.workers["worker-0"]
                             if not line.startswith("http,")]
    assert anomalies(check(b, tmp_path / "unrecorded")) == {"limit_exceeded": 1}


def test_account_comes_from_the_enqueue_not_the_header(tmp_path: Path) -> None:
    b = RunBuilder(account_limits={"acct-0": 1})
    b.enqueue("a", script=SUCCEED)
    b.attempt("a", 1, claimed=100.0, latency=0.5)
    b.final("a", "COMPLETED")
    b.enqueue("b", script=SUCCEED)
    b.attempt("b", 1, claimed=100.1, latency=0.5, account="mislabelled")
    b.final("b", "COMPLETED")
    assert anomalies(check(b, tmp_path)) == {"limit_exceeded": 1}


def test_stuck(tmp_path: Path) -> None:
    b = RunBuilder()
    b.enqueue(JOB, script=FAIL_ONCE)
    b.attempt(JOB, 1, claimed=100.0, status=503, behaviour="status")
    b.final(JOB, "RETRYING")
    b.enqueue("orphan", script=SUCCEED)
    b.final("orphan", "PROCESSING")
    verdict = check(b, tmp_path)
    assert anomalies(verdict) == {"stuck": 2}
    assert said(verdict, "stuck") == [
        {"job_id": JOB, "why": "RETRYING after the drain, 1 deliveries"},
        {"job_id": "orphan", "why": "PROCESSING after the drain, 0 deliveries"},
    ]


def test_state_mismatch_failed_after_success(tmp_path: Path) -> None:
    b = RunBuilder()
    b.enqueue(JOB, script=SUCCEED)
    b.attempt(JOB, 1, claimed=100.0)
    b.final(JOB, "FAILED")
    verdict = check(b, tmp_path)
    assert anomalies(verdict) == {"state_mismatch": 1}
    assert whys(verdict, "state_mismatch") == [
        "FAILED although the target answered 2xx to attempt 1 and nothing explains it"]


def test_failed_after_success_explained_by_crash(tmp_path: Path) -> None:
    """The success on the last attempt was never written: recovery dead-letters the job."""
    b = RunBuilder()
    b.enqueue(JOB, script=SUCCEED, max_attempts=1)
    b.attempt(JOB, 1, claimed=100.0, write=None)
    b.event("failpoint", "worker-0", 100.02, job_id=JOB, attempt=1, name="crash_after_http")
    b.final(JOB, "FAILED", max_attempts=1)
    assert anomalies(check(b, tmp_path)) == {}


def test_state_mismatch_failed_against_the_oracle(tmp_path: Path) -> None:
    """503 once then 200 with three attempts must complete; dead-lettering it after one
    failure is wrong (and the job is lost)."""
    b = RunBuilder()
    b.enqueue(JOB, script=FAIL_ONCE, max_attempts=3)
    b.attempt(JOB, 1, claimed=100.0, status=503, behaviour="status")
    b.final(JOB, "FAILED")
    verdict = check(b, tmp_path)
    assert anomalies(verdict) == {"lost": 1, "state_mismatch": 1}
    assert whys(verdict, "state_mismatch") == [
        "FAILED but its script completes within max_attempts (1 deliveries, no fault recorded)"]


def test_fault_that_consumed_attempts_legitimises_failed(tmp_path: Path) -> None:
    """Attempts burnt by crashes after claim leave a completable job FAILED: legitimate."""
    b = RunBuilder()
    b.enqueue(JOB, script=FAIL_ONCE, max_attempts=2)
    b.attempt(JOB, 1, claimed=100.0, status=503, behaviour="status")
    b.event("claim", "worker-1", 101.0, job_id=JOB, attempt=2, locked_until=111.0)
    b.event("failpoint", "worker-1", 101.01, job_id=JOB, attempt=2, name="crash_after_claim")
    b.final(JOB, "FAILED", attempts=2, max_attempts=2)
    assert anomalies(check(b, tmp_path)) == {}


def test_stale_write(tmp_path: Path) -> None:
    """worker-0 is paused past its lease; worker-1 takes attempt 2; worker-0 wakes and its
    write of attempt 1 is applied instead of fenced."""
    b = RunBuilder()
    b.enqueue(JOB, script=SUCCEED)
    b.event("claim", "worker-0", 100.0, job_id=JOB, attempt=1, locked_until=110.0)
    b.deliver(JOB, attempt=1, received=100.001, answered=100.011, worker="worker-0")
    b.fault("pause_worker", 100.05, 115.0, target="worker-0")
    b.attempt(JOB, 2, claimed=111.0, worker="worker-1")
    b.event("write", "worker-0", 115.1, job_id=JOB, attempt=1, outcome="success",
            result="applied", error=None)
    b.final(JOB, "COMPLETED", attempts=2)
    verdict = check(b, tmp_path)
    assert anomalies(verdict) == {"stale_write": 1, "duplicate_explained": 1}
    assert whys(verdict, "stale_write") == [
        "worker-0 applied its result for attempt 1 at 115.100 s, after worker-1 claimed "
        "attempt 2 at 111.000 s"]
    assert "pause_worker on worker-0" in whys(verdict, "duplicate_explained")[0]


def test_fenced_stale_write_is_fine(tmp_path: Path) -> None:
    b = RunBuilder()
    b.enqueue(JOB, script=SUCCEED)
    b.event("claim", "worker-0", 100.0, job_id=JOB, attempt=1, locked_until=110.0)
    b.deliver(JOB, attempt=1, received=100.001, answered=100.011, worker="worker-0")
    b.fault("pause_worker", 100.05, 115.0, target="worker-0")
    b.attempt(JOB, 2, claimed=111.0, worker="worker-1")
    b.event("write", "worker-0", 115.1, job_id=JOB, attempt=1, result="fenced")
    b.final(JOB, "COMPLETED", attempts=2)
    assert anomalies(check(b, tmp_path)) == {"duplicate_explained": 1}


# --------------------------------------------------------------------------------------------
# Mixed histories, examples, several directories.
# --------------------------------------------------------------------------------------------


def test_mixed_history_counts_each_anomaly(tmp_path: Path) -> None:
    b = RunBuilder(account_limits={"acct-0": 1})
    succeed_once(b, "fine", 50.0)
    b.enqueue("gone", script=SUCCEED)  # lost
    b.deliver("stranger", attempt=1, received=60.0, answered=60.01)  # unexpected
    b.enqueue("early", script=FAIL_ONCE)  # early retry
    b.attempt("early", 1, claimed=70.0, status=503, behaviour="status")
    b.attempt("early", 2, claimed=70.05)
    b.final("early", "COMPLETED", attempts=2)
    b.enqueue("twice", script=SUCCEED)  # unexplained duplicate
    b.attempt("twice", 1, claimed=80.0)
    b.attempt("twice", 2, claimed=91.0)
    b.final("twice", "COMPLETED", attempts=2)
    b.enqueue("stuck", script=SUCCEED)
    b.final("stuck", "PENDING")
    b.enqueue("crowd-1", script=SUCCEED)  # over the account limit
    b.attempt("crowd-1", 1, claimed=120.0, latency=1.0)
    b.final("crowd-1", "COMPLETED")
    b.enqueue("crowd-2", script=SUCCEED)
    b.attempt("crowd-2", 1, claimed=120.5, latency=0.1, worker="worker-1")
    b.final("crowd-2", "COMPLETED")
    verdict = check(b, tmp_path)
    assert verdict.valid is False
    assert anomalies(verdict) == {
        "lost": 1,
        "unexpected": 1,
        "early_retry": 1,
        "duplicate_unexplained": 1,
        "stuck": 1,
        "limit_exceeded": 1,
    }
    assert verdict.counts["enqueued"] == 7
    assert verdict.counts["delivered"] == 8
    assert verdict.counts["completed"] == 5
    assert {k: [e["job_id"] for e in v] for k, v in verdict.examples.items()} == {
        "lost": ["gone"],
        "unexpected": ["stranger"],
        "early_retry": ["early"],
        "duplicate_unexplained": ["twice"],
        "stuck": ["stuck"],
        "limit_exceeded": ["crowd-2"],
    }


def rewrite_csv(path: Path, *, quote_all: bool = False, extra: str | None = None) -> None:
    """Rewrite a CSV log with its columns in reverse order, every field quoted or not, and
    maybe a column no reader knows (holding `extra`)."""
    rows = list(csv.reader(io.StringIO(path.read_text())))
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n",
                        quoting=csv.QUOTE_ALL if quote_all else csv.QUOTE_MINIMAL)
    for number, row in enumerate(rows):
        if extra is not None:
            row = [*row, "note" if number == 0 else extra]
        writer.writerow(row[::-1])
    path.write_text(out.getvalue())


def test_layout_does_not_change_the_verdict(tmp_path: Path) -> None:
    """The same history as the writers lay it out, with its columns in another order and a
    column no reader knows (its values quoted, with commas and quotes), with every field
    quoted, and with blank lines between records (read line by line) gets the same
    verdict."""
    b = RunBuilder(account_limits={"acct-0": 1})
    _redelivered(b, first_write="info")
    b.enqueue("gone", script=FAIL_ONCE)
    b.enqueue("early", script=FAIL_ONCE)
    b.attempt("early", 1, claimed=70.0, status=503, behaviour="status")
    b.attempt("early", 2, claimed=70.05, latency=1.0)
    b.final("early", "COMPLETED", attempts=2)
    b.fault("kill_worker", 100.2, None, target="worker-0")
    compact = b.write(tmp_path / "compact")
    reordered = b.write(tmp_path / "reordered")
    quoted = b.write(tmp_path / "quoted")
    blank = b.write(tmp_path / "blank")
    for path in reordered.rglob("*.csv"):
        rewrite_csv(path, extra='said "hi", then left')
    for path in quoted.rglob("*.csv"):
        rewrite_csv(path, quote_all=True)
    for path in blank.rglob("*.csv"):
        path.write_text("".join(line + "\n\n" for line in path.read_text().splitlines()))
    assert (reordered / "deliveries" / "target-0.csv").read_text().startswith(
        "note,lease,account_in_flight,seen,")
    verdicts = [check_run([d]) for d in (compact, reordered, quoted, blank)]
    for other in verdicts[1:]:
        assert other.counts == verdicts[0].counts
        assert other.examples == verdicts[0].examples
    assert anomalies(verdicts[0]) == {"duplicate_explained": 1, "lost": 1, "early_retry": 1}


@pytest.mark.parametrize("renewal", [None, "epoch", "iso", "short", "lost"])
def test_renewal_extends_the_lease_by_the_configured_lease(tmp_path: Path,
                                                          renewal: str | None) -> None:
    """A renewal at 107 s holds the lease until 117 s (the configured 10 s from the renewal),
    whatever lease end the queue reported (epoch seconds, ISO text, or one that already
    passed): a retry at 115 s is concurrent and early. Without the renewal, or with one
    recorded as lost, the lease had expired at 110 s and the retry was due."""
    b = RunBuilder(http_timeout_seconds=60.0, lease_seconds=10.0)
    b.enqueue(JOB, script=SUCCEED)
    b.attempt(JOB, 1, claimed=100.0, worker="worker-0", latency=40.0, status=503,
              behaviour="status", write="fenced")
    if renewal == "lost":
        b.event("renew", "worker-0", 107.0, job_id=JOB, attempt=1, lost=True)
    elif renewal is not None:
        until = {"epoch": 117.0, "iso": 117.0, "short": 101.0}[renewal]
        b.event("renew", "worker-0", 107.0, job_id=JOB, attempt=1,
                locked_until=datetime.fromtimestamp(until, UTC).isoformat()
                if renewal == "iso" else until)
    b.attempt(JOB, 2, claimed=115.0, worker="worker-1")
    b.final(JOB, "COMPLETED", attempts=2)
    verdict = check(b, tmp_path)
    expected = ({} if renewal in (None, "lost")
                else {"concurrent_delivery": 1, "early_retry": 1})
    assert anomalies(verdict) == expected


def test_bad_line_after_blank_lines_is_named(tmp_path: Path) -> None:
    b = RunBuilder()
    succeed_once(b, "a", 100.0)
    run_dir = b.write(tmp_path / "run")
    path = run_dir / "deliveries" / "target-0.csv"
    path.write_text(path.read_text() + "\n" + "a,one,acct-0,worker-0,target-0,101,101.1,200,"
                    "ok,2,1,\n")
    with pytest.raises(HistoryError, match=r"target-0\.csv:4: delivery field attempt is "
                       "not a number"):
        check_run([run_dir])


def test_text_with_separators_and_line_breaks_reads_back(tmp_path: Path) -> None:
    """A worker's error text with a comma, quotes and a line break is quoted and escaped
    in the log, and the explanation quotes it as the worker wrote it, whether the file is
    parsed whole or line by line."""
    error = 'server said "bye", then\nclosed'
    b = RunBuilder()
    b.enqueue(JOB, script=SUCCEED)
    b.attempt(JOB, 1, claimed=100.0, worker="worker-0", write=None)
    b.event("write", "worker-0", 100.02, job_id=JOB, attempt=1, outcome="success",
            result="info", error=error)
    b.attempt(JOB, 2, claimed=110.5, worker="worker-1")
    b.final(JOB, "COMPLETED", attempts=2)
    run_dir = b.write(tmp_path / "run")
    log = run_dir / "workers" / "worker-0.csv"
    assert '"server said ""bye"", then\\nclosed"' in log.read_text()
    whole = check_run([run_dir])
    log.write_text(log.read_text() + "\n")
    by_line = check_run([run_dir])
    assert whys(whole, "duplicate_explained") == whys(by_line, "duplicate_explained") == [
        f"connection lost during the result write of attempt 1 by worker-0 ({error})"]


def test_examples_are_capped_at_ten(tmp_path: Path) -> None:
    b = RunBuilder()
    for n in range(25):
        b.enqueue(f"gone-{n:02d}", script=SUCCEED)
    verdict = check(b, tmp_path)
    assert verdict.counts["lost"] == 25
    assert len(verdict.examples["lost"]) == 10


def test_several_directories_merge_targets_and_workers(tmp_path: Path) -> None:
    main = RunBuilder()
    main.enqueue("here", script=SUCCEED)
    main.attempt("here", 1, claimed=100.0)
    main.final("here", "COMPLETED")
    main.enqueue("there", script=SUCCEED)
    main.final("there", "COMPLETED")
    run_dir = main.write(tmp_path / "run")
    other = RunBuilder()
    other.attempt("there", 1, claimed=100.0, worker="worker-9")
    other_dir = tmp_path / "host-2"
    (other_dir / "deliveries").mkdir(parents=True)
    (other_dir / "workers").mkdir()
    write_log(other_dir / "deliveries" / "target-1.csv", DELIVERY_LOG,
              other.deliveries["target-0"])
    write_log(other_dir / "workers" / "worker-9.csv", WORKER_LOG, other.workers["worker-9"])
    # A target that received nothing: its log is its header alone.
    write_log(other_dir / "deliveries" / "target-2.csv", DELIVERY_LOG, [])
    alone = check_run([run_dir])
    assert anomalies(alone) == {"lost": 1, "state_mismatch": 1}
    merged = check_run([run_dir, other_dir])
    assert merged.valid is True
    assert merged.counts["delivered"] == 2
    assert str(other_dir / "deliveries" / "target-1.csv") in merged.files
    assert str(other_dir / "deliveries" / "target-2.csv") in merged.files


# --------------------------------------------------------------------------------------------
# Unknown: the history cannot decide.
# --------------------------------------------------------------------------------------------


def test_drain_timed_out_is_unknown_not_stuck(tmp_path: Path) -> None:
    b = RunBuilder(drained=False)
    succeed_once(b, "done", 100.0)
    b.enqueue("live", script=SUCCEED)
    b.final("live", "PENDING")
    verdict = check(b, tmp_path)
    assert verdict.valid == "unknown"
    assert verdict.exit_code == 3
    assert verdict.counts["stuck"] == 0
    assert verdict.unknown_reasons == ("the drain timed out with 1 jobs still live",)


def test_violation_beats_unknown(tmp_path: Path) -> None:
    b = RunBuilder(drained=False)
    b.enqueue("gone", script=SUCCEED)
    b.enqueue("live", script=SUCCEED)
    b.final("live", "PENDING")
    verdict = check(b, tmp_path)
    assert verdict.valid is False
    assert anomalies(verdict) == {"lost": 1}


def test_truncated_log_is_unknown(tmp_path: Path) -> None:
    b = RunBuilder()
    succeed_once(b, "a", 100.0)
    run_dir = b.write(tmp_path / "run")
    with (run_dir / "deliveries" / "target-0.csv").open("a") as fh:
        fh.write("a,2,acct-0,wor")
    verdict = check_run([run_dir])
    assert verdict.valid == "unknown"
    assert verdict.counts["delivered"] == 1
    assert verdict.unknown_reasons == (
        f"{run_dir / 'deliveries' / 'target-0.csv'} is truncated mid-line",)


def test_log_cut_off_in_its_header_is_unknown(tmp_path: Path) -> None:
    """A worker that died while its log's header was being written left no event: judged
    on the rest, and unknown."""
    b = RunBuilder()
    succeed_once(b, "a", 100.0)
    run_dir = b.write(tmp_path / "run")
    log = run_dir / "workers" / "worker-7.csv"
    log.write_text(WORKER_LOG.header()[:9])
    verdict = check_run([run_dir])
    assert verdict.valid == "unknown"
    assert verdict.counts["delivered"] == 1
    assert verdict.unknown_reasons == (f"{log} is truncated mid-line",)


def test_header_only_enqueues_are_nothing_to_judge(tmp_path: Path) -> None:
    run_dir = RunBuilder().write(tmp_path / "run")
    assert (run_dir / "enqueues.csv").read_text() == ENQUEUE_LOG.header()
    verdict = check_run([run_dir])
    assert verdict.unknown_reasons == ("no job was enqueued: there is nothing to judge",)


def test_interrupted_run_is_unknown(tmp_path: Path) -> None:
    b = RunBuilder(exit_reason="interrupted")
    succeed_once(b, "a", 100.0)
    verdict = check(b, tmp_path)
    assert verdict.valid == "unknown"


def test_deliveries_without_worker_events_are_unknown(tmp_path: Path) -> None:
    b = RunBuilder()
    b.enqueue("a", script=SUCCEED)
    b.deliver("a", attempt=1, received=100.0, answered=100.01)
    b.final("a", "COMPLETED")
    verdict = check(b, tmp_path)
    assert verdict.valid == "unknown"


def test_worker_without_an_event_log_is_unknown(tmp_path: Path) -> None:
    b = RunBuilder()
    succeed_once(b, "a", 100.0)
    b.enqueue("b", script=SUCCEED)
    b.deliver("b", attempt=1, received=101.0, answered=101.01, worker="worker-9")
    b.final("b", "COMPLETED")
    verdict = check(b, tmp_path)
    assert verdict.valid == "unknown"
    assert verdict.unknown_reasons == (
        "no worker event log for worker-9, though the target saw its deliveries",)


def test_empty_history_is_unknown(tmp_path: Path) -> None:
    verdict = check(RunBuilder(), tmp_path)
    assert verdict.valid == "unknown"
    assert verdict.unknown_reasons == ("no job was enqueued: there is nothing to judge",)


def test_missing_nemesis_file_means_no_faults(tmp_path: Path) -> None:
    b = RunBuilder()
    succeed_once(b, "a", 100.0)
    verdict = check(b, tmp_path, nemesis=False)
    assert verdict.valid is True
    assert verdict.details["faults"] == 0


# --------------------------------------------------------------------------------------------
# Bad input and the verdict file.
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda d: (d / "run.json").unlink(), "run.json is missing"),
        (lambda d: (d / "final_jobs.csv").unlink(), "final_jobs.csv is missing"),
        (lambda d: (d / "deliveries").rename(d / "x"), "deliveries/ is missing"),
        (lambda d: append(d / "enqueues.csv", "invoke,x,1.0\n"),
         r"enqueues\.csv:4 has 3 fields, the header 17"),
        (lambda d: append(d / "enqueues.csv", 'invoke,"x,1.0\n'),
         r"enqueues\.csv:4 has 2 fields, the header 17"),
        (lambda d: append(d / "enqueues.csv", ENQUEUE_LOG.line(
            {"type": "invoke", "job_id": "x", "time": 1.0, "process": "p"})),
         r"enqueues\.csv:4: invoke needs max_attempts"),
        (lambda d: (d / "run.json").write_text('{"drained": true}'), "run.json lacks"),
        (lambda d: (d / "nemesis.jsonl").write_text(
            '{"fault": "meteor", "start": 1.0, "end": null}\n'), "unknown fault kind"),
        (lambda d: (d / "nemesis.jsonl").write_text('{"fault": "kill_worker"\n'),
         r"nemesis\.jsonl:1 is not valid JSON"),
        (lambda d: append(d / "deliveries" / "target-0.csv",
                          "a,1,acct-0,worker-0,target-0,soon,,,ok,1,1,\n"),
         r"target-0\.csv:3: delivery field received is not a number"),
        (lambda d: append(d / "workers" / "worker-0.csv", WORKER_LOG.line(
            {"kind": "renew", "worker": "worker-0", "time": 1.0, "data": {"lost": True}})
            .replace("true", "yes")),
         r"worker-0\.csv:5: worker event field lost is not true or false"),
        (lambda d: append(d / "final_jobs.csv", "a,acct-0,DONE,1,3,,,,\n"),
         r"final_jobs\.csv:3: unknown job status 'DONE'"),
        (lambda d: (d / "deliveries" / "target-0.csv").write_text(
            "a,1,acct-0,worker-0,target-0,1.0,1.1,200,ok,1,1,\n"),
         r"target-0\.csv:1 is not a header of delivery columns"),
        (lambda d: (d / "deliveries" / "target-0.csv").write_text("job_id,attempt\na,1\n"),
         r"target-0\.csv:1: the header has no received column"),
        (lambda d: (d / "workers" / "worker-0.csv").write_text(
            WORKER_LOG.header().replace("kind,", "")),
         r"worker-0\.csv:1: the header has no kind column"),
    ],
)
def test_bad_input_raises_history_error(tmp_path: Path, damage: Any, message: str) -> None:
    b = RunBuilder()
    succeed_once(b, "a", 100.0)
    run_dir = b.write(tmp_path / "run")
    damage(run_dir)
    with pytest.raises(HistoryError, match=message):
        check_run([run_dir])


def append(path: Path, text: str) -> None:
    with path.open("a") as fh:
        fh.write(text)


def test_write_verdict(tmp_path: Path) -> None:
    b = RunBuilder()
    succeed_once(b, "a", 100.0)
    run_dir = b.write(tmp_path / "run")
    verdict = check_run([run_dir])
    path = write_verdict(run_dir, verdict)
    raw = json.loads(path.read_text())
    assert raw["valid"] is True
    assert set(raw["counts"]) == set(COUNT_KEYS)
    assert all(isinstance(v, int) for v in raw["counts"].values())
    assert set(VIOLATION_KEYS) <= set(raw["counts"])
    assert raw["examples"] == {}


# --------------------------------------------------------------------------------------------
# Dead letters, attempts and final states judged against the oracle, not the queue's word.
# --------------------------------------------------------------------------------------------


def test_dead_letter_before_the_oracle_allows_is_a_state_mismatch(tmp_path: Path) -> None:
    """A job its oracle dead-letters must still get every delivery the oracle requires
    first: 503 for ever with max_attempts 5 needs five, a 400 needs one."""
    b = RunBuilder()
    b.enqueue("early", script=ALWAYS_503, max_attempts=5)
    b.attempt("early", 1, claimed=100.0, status=503, behaviour="status")
    b.final("early", "FAILED", attempts=1, max_attempts=5)
    b.enqueue("never", script=ALWAYS_400, max_attempts=3)
    b.final("never", "FAILED", attempts=0)
    verdict = check(b, tmp_path)
    assert verdict.valid is False
    assert anomalies(verdict) == {"state_mismatch": 2}
    assert said(verdict, "state_mismatch") == [
        {"job_id": "early", "why": "FAILED after 1 deliveries, but a correct queue delivers it "
         "5 times before dead-lettering it (max_attempts 5), and no fault used up attempts"},
        {"job_id": "never", "why": "FAILED after 0 deliveries, but a correct queue delivers it "
         "1 times before dead-lettering it (max_attempts 3), and no fault used up attempts"},
    ]


def test_dead_letter_early_is_legitimate_when_a_fault_used_up_attempts(tmp_path: Path) -> None:
    b = RunBuilder()
    b.enqueue(JOB, script=ALWAYS_503, max_attempts=2)
    b.attempt(JOB, 1, claimed=100.0, status=503, behaviour="status")
    b.event("claim", "worker-1", 101.0, job_id=JOB, attempt=2)
    b.event("failpoint", "worker-1", 101.01, job_id=JOB, attempt=2, name="crash_after_claim")
    b.final(JOB, "FAILED", attempts=2, max_attempts=2)
    assert anomalies(check(b, tmp_path)) == {}


def test_timeouts_do_not_add_to_the_attempts_allowed(tmp_path: Path) -> None:
    """Every delivery of a hang job times out; each used an attempt. Six deliveries for
    max_attempts 3 is three too many, though each repeated 2xx is explained by a timeout."""
    b = RunBuilder()
    b.enqueue(JOB, script=ALWAYS_HANG, max_attempts=3)
    t = 100.0
    for n in range(1, 7):
        b.attempt(JOB, n, claimed=t, latency=5.0, behaviour="hang")
        t += 70.0
    b.final(JOB, "FAILED", attempts=6)
    verdict = check(b, tmp_path)
    assert anomalies(verdict) == {"attempts_exceeded": 1, "duplicate_explained": 5}
    assert whys(verdict, "attempts_exceeded") == [
        "6 deliveries (0 explained by faults) for max_attempts 3"]
    assert all(w.startswith("HTTP timeout") for w in whys(verdict, "duplicate_explained"))


def test_completed_on_a_2xx_answered_after_the_timeout_is_a_state_mismatch(
        tmp_path: Path) -> None:
    """No worker waits past its timeout: a job COMPLETED on a 2xx that came after it was
    completed by a dispatcher that ignores its timeout."""
    b = RunBuilder()
    b.enqueue(JOB, script=ALWAYS_HANG, max_attempts=3)
    b.attempt(JOB, 1, claimed=100.0, latency=5.0, behaviour="hang", result="ok")
    b.final(JOB, "COMPLETED")
    verdict = check(b, tmp_path)
    assert anomalies(verdict) == {"state_mismatch": 1}
    assert whys(verdict, "state_mismatch") == [
        "COMPLETED but every 2xx came past the 2s HTTP timeout (attempt 1 after 5.00s): no "
        "worker could have seen it"]


def test_completed_on_a_late_2xx_is_explained_by_a_paused_worker(tmp_path: Path) -> None:
    """Stopped during the call, the worker's timer cannot fire before the answer is read."""
    b = RunBuilder()
    b.enqueue(JOB, script=ALWAYS_HANG, max_attempts=3)
    b.attempt(JOB, 1, claimed=100.0, latency=5.0, behaviour="hang", result="ok")
    b.fault("pause_worker", 100.5, 106.0, target="worker-0")
    b.final(JOB, "COMPLETED")
    assert anomalies(check(b, tmp_path)) == {}


@pytest.mark.parametrize(
    ("fault", "target"),
    [
        ("terminate_backends", "postgres"),
        ("restart_postgres", "postgres"),
        ("kill_worker", "worker-0"),
        ("pause_worker", "worker-0"),
        ("exhaust_pool", None),
    ],
)
def test_fault_after_the_applied_write_explains_nothing(tmp_path: Path, fault: str,
                                                        target: str | None) -> None:
    """Attempt 1's success was applied at 100.014 s; a fault at 150 s cannot be why the job
    ran again at 200 s."""
    b = RunBuilder()
    b.enqueue(JOB, script=SUCCEED)
    b.attempt(JOB, 1, claimed=100.0)
    b.fault(fault, 150.0, 150.5, target=target)
    b.attempt(JOB, 2, claimed=200.0, worker="worker-1")
    b.final(JOB, "COMPLETED", attempts=2)
    verdict = check(b, tmp_path)
    assert anomalies(verdict) == {"duplicate_unexplained": 1}


def test_error_stop_after_the_applied_write_explains_nothing(tmp_path: Path) -> None:
    b = RunBuilder()
    b.enqueue(JOB, script=SUCCEED)
    b.attempt(JOB, 1, claimed=100.0)
    b.event("stop", "worker-0", 150.0, reason="error: boom")
    b.attempt(JOB, 2, claimed=200.0, worker="worker-1")
    b.final(JOB, "COMPLETED", attempts=2)
    assert anomalies(check(b, tmp_path)) == {"duplicate_unexplained": 1}


def test_fault_after_the_lease_ran_out_explains_nothing(tmp_path: Path) -> None:
    """No write, so the lease (10 s from the claim at 100 s) bounds the attempt: a kill at
    130 s is not why it was redelivered at 140 s."""
    b = RunBuilder()
    b.enqueue(JOB, script=SUCCEED)
    b.attempt(JOB, 1, claimed=100.0, write=None)
    b.fault("kill_worker", 130.0, None, target="worker-0")
    b.attempt(JOB, 2, claimed=140.0, worker="worker-1")
    b.final(JOB, "COMPLETED", attempts=2)
    assert anomalies(check(b, tmp_path)) == {"duplicate_unexplained": 1}


@pytest.mark.parametrize(("durable", "expected"), [
    (None, "duplicate_unexplained"),  # not recorded: judged as durable
    (True, "duplicate_unexplained"),
    (False, "duplicate_explained"),
])
def test_restart_after_the_applied_write_explains_only_on_a_server_that_is_not_durable(
        tmp_path: Path, durable: bool | None, expected: str) -> None:
    b = RunBuilder()
    b.enqueue(JOB, script=SUCCEED)
    b.attempt(JOB, 1, claimed=100.0)
    b.fault("restart_postgres", 150.0, 152.0, target="postgres")
    b.attempt(JOB, 2, claimed=200.0, worker="worker-1")
    b.final(JOB, "COMPLETED", attempts=2)
    run_dir = b.write(tmp_path / "run")
    if durable is not None:
        (run_dir / "spec.json").write_text(json.dumps(
            {"scenario": "synthetic", "postgres": {"harness": {"durable": durable}}}))
    verdict = check_run([run_dir])
    assert anomalies(verdict) == {expected: 1}
    if expected == "duplicate_explained":
        assert whys(verdict, expected) == [
            "restart_postgres of a server that is not durable at 150.000 s to 152.000 s after the "
            "result of attempt 1 was applied"]


def test_lease_comes_from_the_configuration_not_the_queue(tmp_path: Path) -> None:
    """The queue reports a 0.1 s lease though the run configured 10 s: a second delivery
    0.5 s later, while the first is in flight, is concurrent and early."""
    b = RunBuilder()
    b.enqueue(JOB, script=FAIL_ONCE)
    b.event("claim", "worker-0", 100.0, job_id=JOB, attempt=1, locked_until=100.1)
    b.deliver(JOB, attempt=1, received=100.001, answered=101.0, status=503,
              behaviour="status")
    b.event("http", "worker-0", 101.0, job_id=JOB, attempt=1, start=100.0, end=101.0,
            result="http_error", status=503, error=None)
    b.event("write", "worker-0", 101.01, job_id=JOB, attempt=1, outcome="transient",
            result="fenced", error=None)
    b.attempt(JOB, 2, claimed=100.5, worker="worker-1")
    b.final(JOB, "COMPLETED", attempts=2)
    verdict = check(b, tmp_path)
    assert anomalies(verdict) == {"concurrent_delivery": 1, "early_retry": 1}


def test_backoff_is_numbered_by_the_target_not_the_attempt_header(tmp_path: Path) -> None:
    """A queue that sends attempt 1 every time (and backs off as if each were the first)
    is early on its second and third retries."""
    b = RunBuilder()
    b.enqueue(JOB, script=script({"behaviour": "status", "status": 503}, 3), max_attempts=5)
    for t in (100.0, 100.6, 101.2):
        b.attempt(JOB, 1, claimed=t, status=503, behaviour="status")
    b.attempt(JOB, 1, claimed=101.8)
    b.final(JOB, "COMPLETED", attempts=4, max_attempts=5)
    verdict = check(b, tmp_path)
    assert anomalies(verdict) == {"early_retry": 2}
    assert whys(verdict, "early_retry")[0].endswith("the backoff allows no less than 1.000s")


def test_backoff_after_an_explained_redelivery_uses_the_attempt_header(tmp_path: Path) -> None:
    """Attempt 1's success write was lost and the job redelivered as attempt 1 (a queue that
    does not count an expired lease); its 503 is the first failure, so 0.5 s is enough,
    though the target has seen the job twice."""
    b = RunBuilder()
    b.enqueue(JOB, script={"name": "ok-503-ok", "first": {"behaviour": "ok"}, "times": 1,
                           "then": {"behaviour": "status", "status": 503}}, max_attempts=3)
    b.attempt(JOB, 1, claimed=100.0, write="info")
    b.attempt(JOB, 1, claimed=110.5, worker="worker-1", status=503, behaviour="status")
    b.attempt(JOB, 2, claimed=111.2, worker="worker-1")
    b.final(JOB, "COMPLETED", attempts=2)
    verdict = check(b, tmp_path)
    assert anomalies(verdict) == {"duplicate_explained": 1}


def _snapshot(b: RunBuilder, tmp_path: Path, final_jobs: int | None) -> Verdict:
    for name in ("a", "b", "c"):
        b.enqueue(name, script=SUCCEED)
        b.attempt(name, 1, claimed=100.0)
    b.final("a", "COMPLETED")
    if final_jobs is not None:
        b.run_info["final_jobs"] = final_jobs
    return check(b, tmp_path)


def test_final_snapshot_smaller_than_recorded_is_unknown(tmp_path: Path) -> None:
    verdict = _snapshot(RunBuilder(), tmp_path, 3)
    assert verdict.valid == "unknown"
    assert verdict.unknown_reasons == (
        "final snapshot incomplete: run.json says 3 rows, final_jobs.csv has 1",
        "2 acknowledged jobs have no row in final_jobs.csv and the snapshot is not known "
        "to be whole",
    )


def test_missing_final_rows_without_a_recorded_count_are_unknown(tmp_path: Path) -> None:
    verdict = _snapshot(RunBuilder(), tmp_path, None)
    assert verdict.valid == "unknown"
    assert verdict.unknown_reasons == (
        "2 acknowledged jobs have no row in final_jobs.csv and the snapshot is not known "
        "to be whole",)


def test_job_absent_from_a_whole_snapshot_is_a_state_mismatch(tmp_path: Path) -> None:
    verdict = _snapshot(RunBuilder(), tmp_path, 1)
    assert anomalies(verdict) == {"state_mismatch": 2}
    assert whys(verdict, "state_mismatch")[0] == (
        "delivered with 2xx but absent from the final snapshot, which run.json says is whole "
        "(1 rows)")


@pytest.mark.parametrize(("started", "stale"), [(100.015, False), (100.5, True), (None, True)])
def test_stale_write_compares_claims_with_when_the_write_was_sent(
        tmp_path: Path, started: float | None, stale: bool) -> None:
    """worker-0's 503 result was sent at 100.015 s and applied; the event was logged at 101 s
    (the worker stalled after the commit). worker-1's claim of the retry at 100.2 came after
    the write was sent: no stale write. Sent at 100.5 (or not recorded), it is one."""
    b = RunBuilder(retry_base_seconds=0.1)
    b.enqueue(JOB, script=FAIL_ONCE, max_attempts=3)
    b.event("claim", "worker-0", 100.0, job_id=JOB, attempt=1)
    b.deliver(JOB, attempt=1, received=100.001, answered=100.01, status=503,
              behaviour="status")
    b.event("http", "worker-0", 100.011, job_id=JOB, attempt=1, start=100.0, end=100.011,
            result="http_error", status=503, error=None)
    extra: dict[str, Any] = {} if started is None else {"started": started}
    b.event("write", "worker-0", 101.0, job_id=JOB, attempt=1, outcome="transient",
            result="applied", error=None, **extra)
    b.attempt(JOB, 2, claimed=100.2, worker="worker-1")
    b.final(JOB, "COMPLETED", attempts=2)
    verdict = check(b, tmp_path)
    assert anomalies(verdict) == ({"stale_write": 1} if stale else {})


def test_call_made_after_its_lease_ran_out_holds_no_slot(tmp_path: Path) -> None:
    """worker-0 is paused with attempt 1 of "a" past its lease; recovery frees the slot and
    "b" takes it; worker-0 resumes and makes its stale call while "b" is in flight. That
    call held no slot of the account (the queue had already taken the lease back)."""
    b = RunBuilder(account_limits={"acct-0": 1}, http_timeout_seconds=8.0, lease_seconds=10.0)
    b.enqueue("a", script=SUCCEED, max_attempts=3)
    b.event("claim", "worker-0", 100.0, job_id="a", attempt=1)
    b.fault("pause_worker", 100.05, 115.0, target="worker-0")
    b.enqueue("b", script=script({"behaviour": "slow", "seconds": 5.5}))
    b.attempt("b", 1, claimed=110.5, latency=5.5, behaviour="slow", worker="worker-1")
    b.final("b", "COMPLETED")
    b.deliver("a", attempt=1, received=115.01, answered=115.02, worker="worker-0")
    b.event("http", "worker-0", 115.02, job_id="a", attempt=1, start=115.0, end=115.02,
            result="ok", status=200, error=None)
    b.event("write", "worker-0", 115.03, job_id="a", attempt=1, outcome="success",
            result="fenced", error=None)
    b.attempt("a", 2, claimed=116.2, worker="worker-1")
    b.final("a", "COMPLETED", attempts=2)
    verdict = check(b, tmp_path)
    assert anomalies(verdict) == {"duplicate_explained": 1}
    assert verdict.details["limit_excused"] == {"count": 1, "examples": [{
        "job_id": "a",
        "why": "delivered at 115.010 s, after the lease of attempt 1 had run out: it held no "
               "slot"}]}


@pytest.mark.parametrize("blank_line", [False, True])
def test_request_without_a_job_id_is_unexpected(tmp_path: Path, blank_line: bool) -> None:
    """The target logs an empty job id, which reads as null: an unexpected delivery, whether
    the file is parsed whole or (after a blank line) line by line."""
    b = RunBuilder()
    succeed_once(b, "a", 100.0)
    b.deliver("", attempt=None, received=101.0, answered=101.0, status=400, worker=None,
              account=None, behaviour="bad_request")
    run_dir = b.write(tmp_path / "run")
    log = run_dir / "deliveries" / "target-0.csv"
    assert log.read_text().splitlines()[2].startswith(",,,,target-0,101.0,")
    if blank_line:
        append(log, "\n")
    verdict = check_run([run_dir])
    assert anomalies(verdict) == {"unexpected": 1}
    assert said(verdict, "unexpected") == [
        {"job_id": "", "why": "a request without a job id header at 101.000 s (target target-0)"}]


def test_enqueues_of_every_directory_are_merged(tmp_path: Path) -> None:
    """A producer on another machine wrote its own enqueues.csv."""
    main = RunBuilder()
    main.enqueue("here", script=SUCCEED)
    main.attempt("here", 1, claimed=100.0)
    main.final("here", "COMPLETED")
    main.attempt("there", 1, claimed=100.0)
    main.final("there", "COMPLETED")
    run_dir = main.write(tmp_path / "run")
    other = RunBuilder()
    other.enqueue("there", script=SUCCEED)
    other.enqueue("gone", script=SUCCEED)
    other_dir = tmp_path / "producer-2"
    other_dir.mkdir()
    write_log(other_dir / "enqueues.csv", ENQUEUE_LOG, other.enqueues)
    alone = check_run([run_dir])
    assert anomalies(alone) == {"unexpected": 1}
    merged = check_run([run_dir, other_dir])
    assert merged.counts["enqueued"] == 3
    assert anomalies(merged) == {"lost": 1}
    assert [e["job_id"] for e in merged.examples["lost"]] == ["gone"]
    assert str(other_dir / "enqueues.csv") in merged.files


def test_early_retry_after_a_timeout_counts_from_the_workers_end_of_the_call(
        tmp_path: Path) -> None:
    """The worker's timer started at 100 s but the request reached the target only at
    101 s (a slow connect): the call timed out at 102 s, and a retry at 102.6 s is 0.6 s
    later, more than the 0.5 s backoff. Nor is it concurrent: the first call was abandoned."""
    b = RunBuilder()
    b.enqueue(JOB, script=script({"behaviour": "hang", "seconds": 5.0}, 1), max_attempts=3)
    b.event("claim", "worker-0", 100.0, job_id=JOB, attempt=1)
    b.deliver(JOB, attempt=1, received=101.0, answered=106.0, behaviour="hang")
    b.event("http", "worker-0", 102.0, job_id=JOB, attempt=1, start=100.0, end=102.0,
            result="timeout", status=None, error="no answer within 2s")
    b.event("write", "worker-0", 102.01, job_id=JOB, attempt=1, outcome="transient",
            result="applied", error=None, started=102.0)
    b.attempt(JOB, 2, claimed=102.6)
    b.final(JOB, "COMPLETED", attempts=2)
    verdict = check(b, tmp_path)
    assert anomalies(verdict) == {"duplicate_explained": 1}


# --------------------------------------------------------------------------------------------
# Dead letters after attempts that never reached the target: unknown, not a violation.
# --------------------------------------------------------------------------------------------


def unreached_attempt(b: RunBuilder, job: str, attempt: int, *, claimed: float,
                      result: str = "timeout", worker: str = "worker-0") -> None:
    """An attempt whose call never reached the target: the worker records a timeout or a
    connection error and writes the transient failure; the target records nothing."""
    end = claimed + 2.0 if result == "timeout" else claimed + 0.01
    b.event("claim", worker, claimed, job_id=job, attempt=attempt)
    b.event("http", worker, end, job_id=job, attempt=attempt, start=claimed, end=end,
            result=result, status=None, error="no connection")
    b.event("write", worker, end + 0.002, job_id=job, attempt=attempt, outcome="transient",
            result="applied", error=None)


UNREACHED_REASON = (
    "1 jobs dead-lettered after attempts that never reached the target (the worker logged a "
    "timeout or connection error, the target no delivery): the history cannot say whether "
    "the queue or the network lost them; examples: {}")


def test_dead_letter_after_attempts_that_never_reached_the_target_is_unknown(
        tmp_path: Path) -> None:
    """A job that succeeds at its first delivery, FAILED after three attempts none of which
    reached the target: the queue counted them rightly if the worker tells the truth, which
    the history cannot show."""
    b = RunBuilder()
    succeed_once(b, "fine", 99.0)
    b.enqueue(JOB, script=SUCCEED, max_attempts=3)
    unreached_attempt(b, JOB, 1, claimed=100.0)
    unreached_attempt(b, JOB, 2, claimed=103.0, result="connection_error")
    unreached_attempt(b, JOB, 3, claimed=105.0)
    b.final(JOB, "FAILED", attempts=3)
    verdict = check(b, tmp_path)
    assert verdict.valid == "unknown"
    assert verdict.exit_code == 3
    assert anomalies(verdict) == {}
    assert verdict.counts["failed"] == 1
    assert verdict.unknown_reasons == (UNREACHED_REASON.format(JOB),)
    assert verdict.details["unreached_dead_letters"] == {"count": 1, "examples": [{
        "job_id": JOB,
        "why": "FAILED after 0 deliveries; attempts 1, 2, 3 of 3 never reached the target"}]}


def test_retries_that_reached_the_target_make_up_the_rest(tmp_path: Path) -> None:
    """503 twice, then 200, with three attempts: the first never reached the target, the
    other two were its first two deliveries (503 each), so the queue ran out of attempts."""
    b = RunBuilder()
    b.enqueue(JOB, script=FAIL_TWICE, max_attempts=3)
    unreached_attempt(b, JOB, 1, claimed=100.0)
    b.attempt(JOB, 2, claimed=103.0, status=503, behaviour="status")
    b.attempt(JOB, 3, claimed=105.0, status=503, behaviour="status")
    b.final(JOB, "FAILED", attempts=3)
    verdict = check(b, tmp_path)
    assert verdict.valid == "unknown"
    assert anomalies(verdict) == {}
    assert verdict.unknown_reasons == (UNREACHED_REASON.format(JOB),)
    assert whys(verdict, "state_mismatch") == []
    assert verdict.details["unreached_dead_letters"]["examples"][0]["why"] == (
        "FAILED after 2 deliveries; attempt 1 of 3 never reached the target")


def test_dead_letter_short_of_more_than_its_unreached_attempts_is_still_a_state_mismatch(
        tmp_path: Path) -> None:
    """503 for ever with three attempts: one never reached the target and one delivery was
    made, so one attempt is still missing. The one unreached attempt does not excuse it."""
    b = RunBuilder()
    b.enqueue(JOB, script=ALWAYS_503, max_attempts=3)
    unreached_attempt(b, JOB, 1, claimed=100.0)
    b.attempt(JOB, 2, claimed=103.0, status=503, behaviour="status")
    b.final(JOB, "FAILED", attempts=3)
    verdict = check(b, tmp_path)
    assert verdict.valid is False
    assert anomalies(verdict) == {"state_mismatch": 1}
    assert whys(verdict, "state_mismatch") == [
        "FAILED after 1 deliveries, but a correct queue delivers it 3 times before "
        "dead-lettering it (max_attempts 3), and no fault used up attempts"]
    assert verdict.unknown_reasons == ()
    assert "unreached_dead_letters" not in verdict.details


def test_unreached_attempts_other_than_the_attempts_allowed_excuse_nothing(
        tmp_path: Path) -> None:
    """Jobs that succeed at once. "early": FAILED after one attempt that never reached the
    target though it had three; the oracle lacks only one delivery, but a correct queue
    retries a failed connection, so it was given up on early. "overrun": three unreached
    attempts for max_attempts 2, numbered as no correct queue numbers them."""
    b = RunBuilder()
    b.enqueue("early", script=SUCCEED, max_attempts=3)
    unreached_attempt(b, "early", 1, claimed=100.0, result="connection_error")
    b.final("early", "FAILED", attempts=1)
    b.enqueue("overrun", script=SUCCEED, max_attempts=2)
    for n in (1, 2, 3):
        unreached_attempt(b, "overrun", n, claimed=100.0 + 3 * n)
    b.final("overrun", "FAILED", attempts=3, max_attempts=2)
    verdict = check(b, tmp_path)
    assert verdict.valid is False
    # "overrun" is also three committed claims for max_attempts 2.
    assert anomalies(verdict) == {"lost": 2, "state_mismatch": 2, "attempts_exceeded": 1}
    assert verdict.unknown_reasons == ()


def test_unreached_dead_letter_does_not_hide_a_violation(tmp_path: Path) -> None:
    b = RunBuilder()
    _redelivered(b, first_write="applied")
    b.enqueue("unreached", script=SUCCEED, max_attempts=2)
    unreached_attempt(b, "unreached", 1, claimed=100.0)
    unreached_attempt(b, "unreached", 2, claimed=103.0)
    b.final("unreached", "FAILED", attempts=2)
    verdict = check(b, tmp_path)
    assert verdict.valid is False
    assert verdict.exit_code == 1
    assert anomalies(verdict) == {"duplicate_unexplained": 1}
    assert verdict.unknown_reasons == (UNREACHED_REASON.format("unreached"),)


def test_timeout_of_an_attempt_the_target_received_excuses_nothing(tmp_path: Path) -> None:
    """Timeouts the worker recorded for attempts the target received (it answered past
    the timeout) are deliveries, not unreached attempts. 503 for ever with three attempts:
    the second timed out that way and the third was never made, so the job is still one
    short. A job that succeeds at once, whose two attempts both timed out that way, FAILED
    with every attempt delivered: as it is judged without the worker's word."""
    b = RunBuilder()
    b.enqueue(JOB, script=ALWAYS_503, max_attempts=3)
    b.attempt(JOB, 1, claimed=100.0, status=503, behaviour="status")
    b.attempt(JOB, 2, claimed=101.0, status=503, latency=3.0, behaviour="status")
    b.final(JOB, "FAILED", attempts=3)
    b.enqueue("late", script=SUCCEED, max_attempts=2)
    b.attempt("late", 1, claimed=100.0, latency=3.0)
    b.attempt("late", 2, claimed=104.0, latency=3.0)
    b.final("late", "FAILED", attempts=2, max_attempts=2)
    verdict = check(b, tmp_path)
    assert verdict.valid is False
    assert anomalies(verdict) == {"state_mismatch": 2, "duplicate_explained": 1}
    assert said(verdict, "state_mismatch") == [
        {"job_id": "late", "why": "FAILED but its script completes within max_attempts "
         "(2 deliveries, no fault recorded)"},
        {"job_id": JOB, "why": "FAILED after 2 deliveries, but a correct queue delivers it "
         "3 times before dead-lettering it (max_attempts 3), and no fault used up attempts"}]
    assert verdict.unknown_reasons == ()


def test_deliveries_without_an_attempt_header_cannot_match_unreached_attempts(
        tmp_path: Path) -> None:
    """503 twice, then 200, with three attempts, each of which the worker says timed out;
    the target received two, answered past the timeout, but recorded no attempt header.
    With headers 2 and 3 this would be the retry case above; without them the history
    cannot tell which attempts they were, so the verdict stays the violation."""
    b = RunBuilder()
    b.enqueue(JOB, script=FAIL_TWICE, max_attempts=3)
    unreached_attempt(b, JOB, 1, claimed=100.0)
    for n, claimed in ((2, 103.0), (3, 106.0)):
        unreached_attempt(b, JOB, n, claimed=claimed)
        b.deliver(JOB, attempt=None, received=claimed + 0.001, answered=claimed + 3.0,
                  status=503, behaviour="status")
    b.final(JOB, "FAILED", attempts=3)
    verdict = check(b, tmp_path)
    assert verdict.valid is False
    assert anomalies(verdict) == {"lost": 1, "state_mismatch": 1}
    assert verdict.unknown_reasons == ()


@pytest.mark.parametrize("account", ["corp\\north", "C:\\new\\table", "a\rb", "plain"])
@pytest.mark.parametrize("blank_line", [False, True])
def test_escaped_text_reads_back_exactly_on_both_paths(tmp_path: Path, account: str,
                                                       blank_line: bool) -> None:
    """An account name with a backslash or a line break still finds its limit in run.json,
    whether Arrow reads the logs or (a blank line sends them there) the line-by-line path."""
    b = RunBuilder(account_limits={account: 1})
    for name, at in (("a", 100.0), ("b", 100.1)):
        b.enqueue(name, script=SUCCEED, account=account)
        b.attempt(name, 1, claimed=at, latency=0.5, worker=f"w-{name}", account=account)
        b.final(name, "COMPLETED", account=account)
    run_dir = b.write(tmp_path / "run")
    if blank_line:
        for path in run_dir.rglob("*.csv"):
            append(path, "\n")
    verdict = check_run([run_dir])
    assert anomalies(verdict) == {"limit_exceeded": 1}
    [example] = verdict.examples["limit_exceeded"]
    assert f"account {account} had 2 deliveries in flight" in example["why"]


@pytest.mark.parametrize("blank_line", [False, True])
@pytest.mark.parametrize(("damaged", "read_as", "valid"), [
    (',"worker"-0,', "worker-0", True),
    # A worker that left no event log: the history cannot decide.
    (',"wor,ker"-0,', "wor,ker-0", "unknown"),
])
def test_a_stray_quote_reads_the_same_on_both_paths(tmp_path: Path, blank_line: bool,
                                                    damaged: str, read_as: str,
                                                    valid: bool | str) -> None:
    """No writer leaves a quote in the middle of a field; read by hand, Arrow and the
    line-by-line reader take it alike (as CSV readers commonly do), so a blank line
    elsewhere in the file cannot change the verdict."""
    b = RunBuilder()
    succeed_once(b, JOB, 100.0)
    run_dir = b.write(tmp_path / "run")
    log = run_dir / "deliveries" / "target-0.csv"
    log.write_text(log.read_text().replace(",worker-0,", damaged))
    if blank_line:
        append(log, "\n")
    assert check_run([run_dir]).valid == valid
    assert [r["worker"] for r in read_log(log, DELIVERY_LOG)] == [read_as]


def test_a_quote_left_open_on_the_last_line_reads_the_same_on_both_paths(
        tmp_path: Path) -> None:
    b = RunBuilder()
    succeed_once(b, JOB, 100.0)
    run_dir = b.write(tmp_path / "run")
    log = run_dir / "deliveries" / "target-0.csv"
    log.write_text(log.read_text().replace(",ok,", ',"ok,'))
    with pytest.raises(HistoryError, match=r"target-0\.csv:2 has \d+ fields"):
        check_run([run_dir])
    with pytest.raises(HistoryError, match=r"target-0\.csv:2 has \d+ fields"):
        list(read_log(log, DELIVERY_LOG))


def test_an_unknown_worker_event_kind_is_bad_input(tmp_path: Path) -> None:
    b = RunBuilder()
    succeed_once(b, JOB, 100.0)
    b.event("cstart", "worker-0", 99.0)
    with pytest.raises(HistoryError, match=r"worker-0\.csv:5: unknown worker event kind "
                                           r"'cstart'"):
        check(b, tmp_path)


@pytest.mark.parametrize("blank_line", [False, True])
@pytest.mark.parametrize("spelled", [" {} ", "{}0", "+{}"])
def test_a_number_spelled_another_way_reads_the_same_on_both_paths(
        tmp_path: Path, blank_line: bool, spelled: str) -> None:
    b = RunBuilder()
    succeed_once(b, JOB, 100.0)
    run_dir = b.write(tmp_path / "run")
    log = run_dir / "deliveries" / "target-0.csv"
    [received] = [r["received"] for r in read_log(log, DELIVERY_LOG)]
    log.write_text(log.read_text().replace(f",{received!r},",
                                           "," + spelled.format(repr(received)) + ","))
    if blank_line:
        append(log, "\n")
    assert check_run([run_dir]).valid is True


def _fail_twice_with_a_gap(b: RunBuilder, *, missing: int) -> None:
    """A job that needs three deliveries (503, 503, 200), of which attempt `missing` left
    no event at all; the other attempts ran as the script says."""
    b.enqueue(JOB, script=FAIL_TWICE, max_attempts=3)
    at = {1: 100.0, 2: 105.0, 3: 110.0}
    for n in (1, 2, 3):
        if n != missing:
            b.attempt(JOB, n, claimed=at[n], status=503, behaviour="status")


@pytest.mark.parametrize(("kill_at", "valid"), [(106.0, True), (101.0, True), (None, False)])
def test_an_attempt_a_kill_hid_before_it_was_logged(tmp_path: Path, kill_at: float | None,
                                                   valid: bool) -> None:
    """Attempt 2 left no event: its worker may have been killed between committing the claim
    and logging it. A kill in the gap between attempts 1 and 3 explains the dead letter after
    two deliveries; with none, it was dead-lettered early."""
    b = RunBuilder()
    _fail_twice_with_a_gap(b, missing=2)
    b.final(JOB, "FAILED", attempts=3)
    if kill_at is not None:
        b.fault("kill_worker", kill_at, kill_at + 0.01, target="worker-9")
    verdict = check(b, tmp_path)
    assert verdict.valid is valid, verdict.examples
    if not valid:
        assert "state_mismatch" in anomalies(verdict)


@pytest.mark.parametrize(("kill_at", "valid"), [(106.5, True), (120.0, False)])
def test_a_last_attempt_a_kill_hid_only_while_it_was_due(tmp_path: Path, kill_at: float,
                                                         valid: bool) -> None:
    """Attempt 3 left no event. A kill soon after attempt 2, while attempt 3 was due,
    explains it; a kill long after explains nothing (a queue that dead-letters one attempt
    early must not hide behind every later kill). Retries wait at most 2 s here."""
    b = RunBuilder(retry_cap_seconds=2.0)
    _fail_twice_with_a_gap(b, missing=3)
    b.final(JOB, "FAILED", attempts=3)
    b.fault("kill_worker", kill_at, kill_at + 0.01, target="worker-9")
    verdict = check(b, tmp_path)
    assert verdict.valid is valid, verdict.examples


def test_a_quote_left_open_on_the_last_line_is_named_as_the_line_reader_names_it(
        tmp_path: Path) -> None:
    """A last record whose quoted field is never closed: Arrow would take the line break
    into the value, so the file is read line by line, which names the line; in a file with
    no other quote as much as in one with quoted fields elsewhere."""
    for name, extra in (("plain", None), ("quoted", 'said "hi", then left')):
        b = RunBuilder()
        succeed_once(b, "a", 100.0)
        run_dir = b.write(tmp_path / name)
        path = run_dir / "deliveries" / "target-0.csv"
        if extra is not None:
            rewrite_csv(path, extra=extra)
            path.write_text(path.read_text() + '"never closed,lease-x,1,1,ok,200,101.1,101,'
                            "target-0,worker-0,acct-0,1,a\n")
        else:
            path.write_text(path.read_text() + 'a,1,acct-0,worker-0,target-0,101,101.1,200,'
                            '"never closed,1,1,\n')
        lines = len(path.read_text().splitlines())
        with pytest.raises(HistoryError, match=rf"target-0\.csv:{lines}\b"):
            check_run([run_dir])


def test_a_delivery_without_worker_or_account_headers_says_none(tmp_path: Path) -> None:
    """The deliveries' text columns are categoricals (made from Arrow's codes); a value the
    target did not get is still None in the evidence and null in verdict.json, never NaN."""
    b = RunBuilder()
    succeed_once(b, JOB, 100.0)
    b.deliver(JOB, attempt=2, received=110.0, answered=110.01, worker=None, account=None)
    verdict = check(b, tmp_path)
    assert anomalies(verdict) == {"duplicate_unexplained": 1}
    [example] = verdict.examples["duplicate_unexplained"]
    assert example["evidence"]["worker"] is None
    assert example["evidence"]["succeeded_worker"] == "worker-0"
    json.dumps(verdict.to_json(), allow_nan=False)
