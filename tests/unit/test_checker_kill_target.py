"""kill_target explains a redelivery as hang_target does: only for a delivery on the target
it killed, inside its window (the target may have recorded a 2xx whose answer never reached
the worker). Same defaults as test_checker.py: HTTP timeout 2 s, lease 10 s."""

from __future__ import annotations

from pathlib import Path

import pytest

from reports.bench_checker import RunBuilder
from reports.checker import check_run

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
