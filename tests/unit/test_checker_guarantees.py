"""The checker judges only the promises a queue declares (spec.json `guarantees`): a check
whose promise was not made is listed as not applicable, with why, and never counted as kept
or broken. The same histories are violations under the reference's promises."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from skiplock.queue_impl.interface import REFERENCE_GUARANTEES, Guarantees
from skiplock.reports.checker import check_run
from skiplock.reports.history import HistoryError
from skiplock.reports.synthetic import RunBuilder

SUCCEED = {"name": "succeed", "first": {"behaviour": "ok"}, "times": None}
ALWAYS_503 = {"name": "fail", "first": {"behaviour": "status", "status": 503}, "times": None}
BULLMQ = Guarantees(account_limits=False, fencing=True, attempts_count="finished",
                    retry_cap=False, claim_transaction=False, recovery_switch=False)
FAIL_ONCE = {"name": "fail_once", "first": {"behaviour": "status", "status": 503}, "times": 1,
             "then": {"behaviour": "ok"}}
ALWAYS_400 = {"name": "bad", "first": {"behaviour": "status", "status": 400}, "times": None}


def _over_the_limit(guarantees: Guarantees | None) -> RunBuilder:
    b = RunBuilder(account_limits={"acct-0": 1},
                   guarantees=guarantees.to_json() if guarantees else None)
    for name, at in (("a", 100.0), ("b", 100.1)):
        b.enqueue(name, script=SUCCEED)
        b.attempt(name, 1, claimed=at, latency=0.5, worker=f"w-{name}")
        b.final(name, "COMPLETED")
    return b


def _picked_three_times(guarantees: Guarantees | None) -> RunBuilder:
    """Three claims for max_attempts 2: the first one's worker was killed before it called,
    then a 503 and a 200. Every claim counts in the reference (too many claims); a queue
    counting finished attempts made two, both delivered."""
    finished = guarantees is not None and guarantees.attempts_count == "finished"
    b = RunBuilder(guarantees=guarantees.to_json() if guarantees else None)
    b.enqueue("j", script=FAIL_ONCE, max_attempts=2)
    b.event("claim", "worker-0", 100.0, job_id="j", attempt=1, locked_until=110.0,
            lease_token=str(uuid.uuid5(uuid.NAMESPACE_URL, "j-killed")))
    b.fault("kill_worker", 100.05, 100.06, target="worker-0")
    second = 1 if finished else 2
    b.attempt("j", second, claimed=111.0, status=503, behaviour="status", worker="worker-1")
    b.attempt("j", second + 1, claimed=113.0, worker="worker-1")
    b.final("j", "COMPLETED", attempts=second + 1, max_attempts=2)
    return b


def _delivered_after_a_400(guarantees: Guarantees | None) -> RunBuilder:
    b = RunBuilder(guarantees=guarantees.to_json() if guarantees else None)
    b.enqueue("j", script=ALWAYS_400, max_attempts=3)
    b.attempt("j", 1, claimed=100.0, status=400, behaviour="status")
    b.attempt("j", 2, claimed=101.0, status=400, behaviour="status")
    b.final("j", "FAILED", attempts=2)
    return b


def test_a_promise_not_made_is_not_judged_and_says_why(tmp_path: Path) -> None:
    verdict = check_run([_over_the_limit(BULLMQ).write(tmp_path / "run")])
    assert verdict.valid is True
    assert verdict.counts["limit_exceeded"] == 0
    assert "limit_exceeded" not in verdict.examples
    reasons = verdict.details["not_applicable"]
    assert reasons["limit_exceeded"] == "the queue declares no per-account concurrency limits"
    assert set(reasons) == {"limit_exceeded"}


def test_the_same_history_breaks_the_reference_promise(tmp_path: Path) -> None:
    for i, declared in enumerate((None, REFERENCE_GUARANTEES)):
        verdict = check_run([_over_the_limit(declared).write(tmp_path / f"run{i}")])
        assert verdict.valid is False
        assert verdict.counts["limit_exceeded"] == 1
        assert "not_applicable" not in verdict.details


def test_attempts_counted_in_finished_attempts_are_not_held_to_claims(tmp_path: Path) -> None:
    reference = check_run([_picked_three_times(None).write(tmp_path / "ref")])
    assert reference.counts["attempts_exceeded"] == 1
    assert reference.examples["attempts_exceeded"][0]["case"] == "claims"
    verdict = check_run([_picked_three_times(BULLMQ).write(tmp_path / "bullmq")])
    assert verdict.counts["attempts_exceeded"] == 0, verdict.examples
    assert "attempts_exceeded" not in verdict.details.get("not_applicable", {})


def test_a_delivery_after_a_permanent_failure_is_still_judged(tmp_path: Path) -> None:
    """Counting finished attempts excuses no delivery after a permanent failure."""
    for i, declared in enumerate((None, BULLMQ)):
        verdict = check_run([_delivered_after_a_400(declared).write(tmp_path / f"r{i}")])
        assert verdict.counts["attempts_exceeded"] == 1
        assert verdict.valid is False


@pytest.mark.parametrize(("declared", "message"), [
    ([1], "guarantees must be an object"),
    ({"account_limits": "no"}, "guarantees.account_limits must be true or false"),
    ({"attempts_count": "picks"}, "guarantees.attempts_count must be"),
])
def test_a_malformed_declaration_is_bad_input(tmp_path: Path, declared: object,
                                              message: str) -> None:
    b = RunBuilder()
    b.guarantees = declared  # type: ignore[assignment]
    b.enqueue("a", script=SUCCEED)
    b.attempt("a", 1, claimed=100.0)
    b.final("a", "COMPLETED")
    with pytest.raises(HistoryError, match=message):
        check_run([b.write(tmp_path / "run")])


def test_guarantees_round_trip_through_json() -> None:
    assert Guarantees.from_json(BULLMQ.to_json()) == BULLMQ
    assert Guarantees.from_json({}) == REFERENCE_GUARANTEES


# -- identity by lease: a queue whose numbers do not name a claim --------------------------

FINISHED = Guarantees(account_limits=True, fencing=True, attempts_count="finished",
                      retry_cap=True, claim_transaction=True)


def _stale_write(second_number: int) -> RunBuilder:
    """worker-0's pick of attempt 1 is paused past its lease; worker-1 picks the job again
    (numbered `second_number` by the queue) and completes it; worker-0 wakes and its write
    is applied though another pick holds the job."""
    b = RunBuilder(guarantees=FINISHED.to_json())
    b.enqueue("j", script=SUCCEED)
    b.attempt("j", 1, claimed=100.0, write=None, pick="a", worker="worker-0")
    b.fault("pause_worker", 100.05, 115.0, target="worker-0")
    b.attempt("j", second_number, claimed=111.0, pick="b", worker="worker-1")
    b.event("write", "worker-0", 115.1, job_id="j", attempt=1, outcome="success",
            result="applied", error=None,
            lease_token=str(uuid.uuid5(uuid.NAMESPACE_URL, "j-1a")))
    b.final("j", "COMPLETED", attempts=second_number)
    return b


def _concurrent(second_number: int) -> RunBuilder:
    """worker-1 picks the job again while worker-0's pick still holds its lease and its
    call is still at the target."""
    b = RunBuilder(guarantees=FINISHED.to_json())
    b.enqueue("j", script=SUCCEED)
    b.attempt("j", 1, claimed=100.0, latency=0.5, pick="a", worker="worker-0")
    b.attempt("j", second_number, claimed=100.1, status=503, behaviour="status", pick="b",
              worker="worker-1", write="fenced")
    b.final("j", "COMPLETED")
    return b


@pytest.mark.parametrize(("build", "kind"), [(_stale_write, "stale_write"),
                                             (_concurrent, "concurrent_delivery")])
def test_a_verdict_does_not_depend_on_how_the_queue_numbers_picks(
        tmp_path: Path, build: object, kind: str) -> None:
    """The same history, the second pick numbered as the first (pgqueuer after a stall) or
    as the next: keyed by lease, both give the same anomaly and the same verdict."""
    verdicts = [check_run([build(n).write(tmp_path / f"n{n}")])  # type: ignore[operator]
                for n in (1, 2)]
    for verdict in verdicts:
        assert verdict.valid is False
        assert verdict.counts[kind] == 1
    assert verdicts[0].counts == verdicts[1].counts
    assert verdicts[0].details["repicks_keyed_by_lease"] == 1
    assert "repicks_keyed_by_lease" not in verdicts[1].details


def _last_failure_not_recorded(write: str | None, guarantees: Guarantees) -> RunBuilder:
    """max_attempts 2, every call a 503. The second attempt's failure never reaches the
    queue (`write`: "info", its connection cut mid-write; None, the worker wrote nothing),
    so a queue counting finished attempts picks the job again under number 2 and it is
    delivered a third time."""
    b = RunBuilder(guarantees=guarantees.to_json())
    b.enqueue("j", script=ALWAYS_503, max_attempts=2)
    b.attempt("j", 1, claimed=100.0, status=503, behaviour="status", pick="a")
    b.attempt("j", 2, claimed=105.0, status=503, behaviour="status", pick="b", write=write)
    b.attempt("j", 2, claimed=120.0, status=503, behaviour="status", pick="c",
              worker="worker-1")
    b.final("j", "FAILED", attempts=2, max_attempts=2)
    return b


@pytest.mark.parametrize("guarantees", [FINISHED, BULLMQ], ids=["finished", "bullmq"])
def test_a_repick_after_a_lost_result_write_is_one_more_delivery(
        tmp_path: Path, guarantees: Guarantees) -> None:
    verdict = check_run([_last_failure_not_recorded("info", guarantees).write(tmp_path / "r")])
    assert verdict.counts["attempts_exceeded"] == 0, verdict.examples
    assert verdict.valid is True, verdict.examples


def test_a_repick_nothing_explains_is_still_an_attempt_too_many(tmp_path: Path) -> None:
    verdict = check_run([_last_failure_not_recorded(None, FINISHED).write(tmp_path / "r")])
    assert verdict.counts["attempts_exceeded"] == 1
    example = verdict.examples["attempts_exceeded"][0]
    assert example["case"] == "deliveries"
    assert example["evidence"]["explained_by_faults"] == 0
