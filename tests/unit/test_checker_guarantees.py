"""The checker judges only the promises a queue declares (spec.json `guarantees`): a check
whose promise was not made is listed as not applicable, with why, and never counted as kept
or broken. The same histories are violations under the reference's promises."""

from __future__ import annotations

from pathlib import Path

import pytest

from queue_impl.interface import REFERENCE_GUARANTEES, Guarantees
from reports.checker import check_run
from reports.history import HistoryError
from reports.synthetic import RunBuilder

SUCCEED = {"name": "succeed", "first": {"behaviour": "ok"}, "times": None}
ALWAYS_503 = {"name": "fail", "first": {"behaviour": "status", "status": 503}, "times": None}
BULLMQ = Guarantees(account_limits=False, fencing=True, attempts_count="finished",
                    retry_cap=False, claim_transaction=False)


def _over_the_limit(guarantees: Guarantees | None) -> RunBuilder:
    b = RunBuilder(account_limits={"acct-0": 1},
                   guarantees=guarantees.to_json() if guarantees else None)
    for name, at in (("a", 100.0), ("b", 100.1)):
        b.enqueue(name, script=SUCCEED)
        b.attempt(name, 1, claimed=at, latency=0.5, worker=f"w-{name}")
        b.final(name, "COMPLETED")
    return b


def _picked_three_times(guarantees: Guarantees | None) -> RunBuilder:
    b = RunBuilder(guarantees=guarantees.to_json() if guarantees else None)
    b.enqueue("over", script=ALWAYS_503, max_attempts=2)
    for attempt, at in ((1, 100.0), (2, 100.6), (3, 101.7)):
        b.attempt("over", attempt, claimed=at, status=503, behaviour="status")
    b.final("over", "FAILED", attempts=3, max_attempts=2)
    return b


def test_a_promise_not_made_is_not_judged_and_says_why(tmp_path: Path) -> None:
    verdict = check_run([_over_the_limit(BULLMQ).write(tmp_path / "run")])
    assert verdict.valid is True
    assert verdict.counts["limit_exceeded"] == 0
    assert "limit_exceeded" not in verdict.examples
    reasons = verdict.details["not_applicable"]
    assert reasons["limit_exceeded"] == "the queue declares no per-account concurrency limits"
    assert set(reasons) == {"limit_exceeded", "attempts_exceeded"}


def test_the_same_history_breaks_the_reference_promise(tmp_path: Path) -> None:
    for i, declared in enumerate((None, REFERENCE_GUARANTEES)):
        verdict = check_run([_over_the_limit(declared).write(tmp_path / f"run{i}")])
        assert verdict.valid is False
        assert verdict.counts["limit_exceeded"] == 1
        assert "not_applicable" not in verdict.details


def test_attempts_counted_in_finished_attempts_are_not_held_to_claims(tmp_path: Path) -> None:
    assert check_run([_picked_three_times(None).write(tmp_path / "ref")]).counts[
        "attempts_exceeded"] == 1
    verdict = check_run([_picked_three_times(BULLMQ).write(tmp_path / "bullmq")])
    assert "attempts_exceeded" in verdict.details["not_applicable"]
    assert verdict.counts["attempts_exceeded"] == 0


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
