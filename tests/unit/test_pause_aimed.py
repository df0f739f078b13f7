"""pause_worker with until = "reclaimed": a pause whose end is aimed at the moment when only
the lease token can refuse the paused worker's stale write (pure logic: fake contexts and
event logs written by hand, no processes)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from skiplock.chaos.faults import worker as nemesis_worker
from skiplock.chaos.faults.worker import reclaim_in_flight
from skiplock.chaos.nemesis import (
    HeldLease,
    NemesisError,
    NemesisSpec,
    plan,
    spec_from_mapping,
)
from skiplock.reports.checker.common import DEFAULT_TOLERANCE_SECONDS
from skiplock.reports.history import WORKER_LOG, LogWriter
from skiplock.scenarios.run import spec as spec_mod
from skiplock.scenarios.run.workers import LogSink, _LeaseTracker

# --- the spec ------------------------------------------------------------------------------


def test_until_is_planned_with_the_pause() -> None:
    spec = spec_from_mapping({"kind": "pause_worker", "at": 0.5, "duration": 6.0,
                              "until": "reclaimed"})
    [firing] = plan([spec], seed=1, load_seconds=7.0, lease_seconds=4.0,
                    http_timeout_seconds=1.0)
    assert (firing.until, firing.duration) == ("reclaimed", 6.0)
    [plain] = plan([NemesisSpec(kind="pause_worker")], seed=1, load_seconds=7.0,
                   lease_seconds=4.0, http_timeout_seconds=1.0)
    assert plain.until == "duration"


@pytest.mark.parametrize(("raw", "message"), [
    ({"kind": "pause_worker", "until": "later"}, "until must be 'duration' or 'reclaimed'"),
    ({"kind": "pause_worker", "until": 1}, "until must be a string"),
    ({"kind": "kill_worker", "until": "reclaimed"}, "applies to pause_worker in the lease"),
    ({"kind": "pause_worker", "phase": "claim", "until": "reclaimed"},
     "applies to pause_worker in the lease phase only"),
])
def test_until_is_refused_where_it_means_nothing(raw: dict[str, Any], message: str) -> None:
    with pytest.raises(NemesisError, match=message):
        spec_from_mapping(raw)


def test_the_shipped_fencing_scenarios_aim_their_pauses() -> None:
    for name in ("pause-workers", "mixed"):
        pauses = [n for n in spec_mod.load(name).nemesis
                  if n.kind == "pause_worker" and n.phase == "lease"]
        assert pauses and all(n.until == "reclaimed" for n in pauses), name


def test_the_wake_up_comes_after_the_checkers_tolerance() -> None:
    # A stale write sent within the tolerance of the re-claim is not counted as stale.
    assert nemesis_worker.RECLAIM_MIN_AGE_SECONDS > DEFAULT_TOLERANCE_SECONDS


# --- which delivery a pause wakes for ------------------------------------------------------


def held(worker: str, job: str, attempt: int, claimed_at: float,
         answered: bool = False) -> HeldLease:
    return HeldLease(worker=worker, job_id=job, attempt=attempt, claimed_at=claimed_at,
                     answered=answered)


def test_a_later_attempt_of_a_watched_job_claimed_long_enough_ago_and_still_running() -> None:
    watched = {"j1": 1, "j2": 1}
    found = reclaim_in_flight(
        [held("w0", "j1", 1, 0.0),            # the paused worker's own lease
         held("w1", "j9", 2, 0.0),            # a job it never held
         held("w1", "j1", 2, 9.8),            # claimed too recently
         held("w2", "j2", 2, 9.0, True),      # its call has ended
         held("w2", "j1", 1, 5.0),            # not a later attempt
         held("w1", "j2", 2, 9.5), held("w2", "j1", 3, 9.6)],
        watched, {"w0"}, now=10.0, min_age=0.3)
    assert found == held("w1", "j2", 2, 9.5)  # the earliest of the two that qualify
    assert reclaim_in_flight([held("w1", "j1", 2, 9.8)], watched, {"w0"}, now=10.0,
                             min_age=0.3) is None
    assert reclaim_in_flight([], watched, {"w0"}, now=10.0, min_age=0.3) is None


# --- the lease tracker reads `answered` from the logs ----------------------------------------


def test_the_tracker_sees_claims_answers_and_writes(tmp_path: Path) -> None:
    path = tmp_path / "w1.csv"
    writer = LogWriter(path, WORKER_LOG)
    sink = LogSink(writer, "w1")
    tracker = _LeaseTracker()

    def event(kind: str, job: str, attempt: int, **more: Any) -> None:
        sink(kind, {"job_id": job, "attempt": attempt, **more})

    try:
        event("claim", "a", 1)
        event("claim", "b", 2)
        [a, b] = sorted(tracker.leases({"w1": path}), key=lambda h: h.job_id)
        assert (a.worker, a.job_id, a.attempt, a.answered) == ("w1", "a", 1, False)
        assert b.attempt == 2 and b.claimed_at <= time.time()
        event("http", "a", 1, result="ok", status=200)
        event("write", "b", 2, result="fenced", outcome="success")
        assert tracker.leases({"w1": path}) == [HeldLease(worker="w1", job_id="a", attempt=1,
                                                          claimed_at=a.claimed_at,
                                                          answered=True)]
        assert tracker.holding({"w1": path}) == ["w1"]
        event("write", "a", 1, result="applied", outcome="success")
        assert tracker.leases({"w1": path}) == [] and tracker.holding({"w1": path}) == []
    finally:
        writer.close()
