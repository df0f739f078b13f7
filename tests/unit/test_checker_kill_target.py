"""kill_target explains a redelivery as hang_target does: only for a delivery on the target
it killed, inside its window (the target may have recorded a 2xx whose answer never reached
the worker). Same defaults as test_checker.py: HTTP timeout 2 s, lease 10 s."""

from __future__ import annotations

from pathlib import Path

import pytest

from skiplock.reports.checker import check_run
from skiplock.reports.synthetic import RunBuilder

SUCCEED = {"name": "succeed", "first": {"behaviour": "ok"}, "times": None,
           "then": {"behaviour": "ok"}}
JOB = "job-1"


def redelivered(fault_target: str) -> RunBuilder:
    """Attempt 1 by worker-0 reaches target-0 and is recorded 200, but nothing came of it:
    worker-0 wrote no result (it saw no answer to act on), so the lease expires and worker-1
    delivers attempt 2. A kill_target on `fault_target` covers attempt 1."""
    b = RunBuilder()
    b.enqueue(JOB, script=SUCCEED)
    b.attempt(JOB, 1, claimed=100.0, worker="worker-0", write=None)
    b.attempt(JOB, 2, claimed=110.5, worker="worker-1")
    b.final(JOB, "COMPLETED", attempts=2)
    b.fault("kill_target", 100.005, 101.0, target=fault_target)
    return b


def test_kill_target_on_that_target_explains_the_duplicate(tmp_path: Path) -> None:
    verdict = check_run([redelivered("target-0").write(tmp_path / "run")])
    assert verdict.valid is True, verdict.examples
    assert verdict.counts["duplicate_explained"] == 1
    assert verdict.counts["duplicate_unexplained"] == 0
    [example] = verdict.examples["duplicate_explained"]
    assert "kill_target on target-0" in example["why"]


def test_kill_target_on_another_target_does_not(tmp_path: Path) -> None:
    verdict = check_run([redelivered("target-1").write(tmp_path / "run")])
    assert verdict.valid is False
    assert verdict.counts["duplicate_unexplained"] == 1
    assert verdict.counts["duplicate_explained"] == 0


@pytest.mark.parametrize("fault", ["hang_target", "kill_target"])
def test_an_unhealed_target_fault_lasts_to_the_end(tmp_path: Path, fault: str) -> None:
    """No recorded end (the run died first): the fault is taken to last, like a hang."""
    b = redelivered("target-9")
    b.fault(fault, 99.0, None, target="target-0")
    verdict = check_run([b.write(tmp_path / "run")])
    assert verdict.counts["duplicate_explained"] == 1, verdict.examples


def refused_three_times(fault_window: tuple[float, float] | None) -> RunBuilder:
    """A job that succeeds at once, whose three attempts were all refused before reaching
    the target (connection errors, 1 s apart), dead-lettered at max_attempts 3; a
    kill_target covers `fault_window`, if any."""
    b = RunBuilder()
    b.enqueue(JOB, script=SUCCEED)
    for attempt, at in ((1, 100.0), (2, 101.0), (3, 103.0)):
        b.event("claim", "worker-0", at, job_id=JOB, attempt=attempt,
                lease_token=f"{JOB}-{attempt}", locked_until=at + 10.0)
        b.event("http", "worker-0", at + 0.01, job_id=JOB, attempt=attempt, start=at,
                end=at + 0.01, result="connection_error", status=None, error="refused")
        b.event("write", "worker-0", at + 0.02, job_id=JOB, attempt=attempt,
                outcome="transient", result="applied", error="refused")
    b.final(JOB, "FAILED", attempts=3, last_error="refused")
    if fault_window is not None:
        b.fault("kill_target", *fault_window, target="target-0")
    return b


def test_a_dead_letter_whose_calls_a_down_target_refused_is_legitimate(
        tmp_path: Path) -> None:
    verdict = check_run([refused_three_times((100.5, 103.5)).write(tmp_path / "run")])
    assert verdict.valid is True, (verdict.unknown_reasons, verdict.examples)
    assert verdict.counts["failed"] == 1


def test_without_a_target_fault_the_same_dead_letter_is_undecided(tmp_path: Path) -> None:
    verdict = check_run([refused_three_times(None).write(tmp_path / "run")])
    assert verdict.valid == "unknown"


def test_a_target_fault_outside_the_failed_calls_explains_nothing(tmp_path: Path) -> None:
    verdict = check_run([refused_three_times((104.0, 105.0)).write(tmp_path / "run")])
    assert verdict.valid == "unknown"
