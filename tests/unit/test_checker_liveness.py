"""Liveness on hand-built histories: `starvation` (a due job passed over while later jobs of
other accounts are claimed, its account having a free slot) and `objective_missed` (the
scenario's latency and throughput objectives), with the faults that excuse them.

Times: enqueues are acknowledged 1 ms after their invoke; a claim's delivery reaches the
target 1 ms after the claim. Lease 10 s unless a test says otherwise."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from skiplock.reports.checker import Verdict, check_run
from skiplock.reports.checker.waits import Held, overlaps
from skiplock.reports.synthetic import RunBuilder

SUCCEED: dict[str, Any] = {"name": "succeed", "first": {"behaviour": "ok"}, "times": None,
                           "then": {"behaviour": "ok"}}


def served(b: RunBuilder, job: str, *, due: float, claimed: float, account: str,
           latency: float = 0.01, worker: str = "worker-0", sent: float | None = None) -> None:
    b.enqueue(job, script=SUCCEED, account=account, time=due - 0.001)
    b.attempt(job, 1, claimed=claimed, account=account, latency=latency, worker=worker,
              sent=sent)
    b.final(job, "COMPLETED", account=account)


def passed_over(b: RunBuilder, *, claimed: float = 105.0, sent: float | None = None) -> None:
    """Job `old` of acct-a due at 100 and claimed at `claimed`; acct-b's jobs due from 101
    claimed at once, one a second."""
    served(b, "old", due=100.0, claimed=claimed, account="acct-a", sent=sent)
    for i in range(4):
        served(b, f"new-{i}", due=101.0 + i, claimed=101.1 + i, account="acct-b",
               worker="worker-1")


def check(b: RunBuilder, tmp_path: Path, **kwargs: Any) -> Verdict:
    return check_run([b.write(tmp_path / "run")], **kwargs)


def test_a_job_passed_over_past_the_bound_is_starved(tmp_path: Path) -> None:
    b = RunBuilder(account_limits={"acct-a": None, "acct-b": None},
                   objectives={"starvation_wait": 2.0})
    passed_over(b)
    verdict = check(b, tmp_path)
    assert verdict.valid is False
    assert verdict.counts["starvation"] == 1
    [example] = verdict.examples["starvation"]
    assert example["job_id"] == "old"
    evidence = example["evidence"]
    assert evidence["waited"] == pytest.approx(5.0, abs=0.01)
    assert evidence["bound"] == 2.0
    # acct-b's jobs due at 102, 103 and 104 were claimed after the bound ran out (102).
    assert evidence["overtaken_by"] == 3
    assert evidence["first_overtaker"]["job_id"] == "new-1"
    assert example["why"].startswith("due at 100.000 s (acct-a, no limit), its claim sent at "
                                     "105.000 s: waited 5.00 s, bound 2.00 s, while 3 jobs")


def test_the_default_bound_is_two_leases(tmp_path: Path) -> None:
    b = RunBuilder(account_limits={"acct-a": None, "acct-b": None}, lease_seconds=2.0)
    passed_over(b)
    assert check(b, tmp_path).counts["starvation"] == 1
    b = RunBuilder(account_limits={"acct-a": None, "acct-b": None}, lease_seconds=3.0)
    passed_over(b)
    assert check(b, tmp_path / "longer").counts["starvation"] == 0


def test_jobs_claimed_in_the_order_they_became_due_are_not_starved(tmp_path: Path) -> None:
    # A queue that is simply slow (every job waits 5 s, in order) starves no one.
    b = RunBuilder(account_limits={"acct-a": None, "acct-b": None},
                   objectives={"starvation_wait": 2.0})
    for i in range(6):
        served(b, f"j-{i}", due=100.0 + i, claimed=105.0 + i,
               account="acct-a" if i % 2 else "acct-b")
    assert check(b, tmp_path).counts["starvation"] == 0


def test_a_full_account_is_not_starved(tmp_path: Path) -> None:
    # acct-a's one slot is held from 99 to 105 by `busy`: its next job waits, rightly.
    b = RunBuilder(account_limits={"acct-a": 1, "acct-b": None}, http_timeout_seconds=8.0,
                   objectives={"starvation_wait": 2.0})
    served(b, "busy", due=98.0, claimed=99.0, account="acct-a", latency=5.99)
    passed_over(b)
    assert check(b, tmp_path).counts["starvation"] == 0


def test_a_slot_free_only_for_a_moment_does_not_count(tmp_path: Path) -> None:
    # acct-a's slot is free from 104.5 (busy's write) and `old` is claimed at 105.0: the
    # claims of acct-b's later jobs at 103.1 and 104.1 found it full, and the one at 105.1
    # comes after `old`'s claim.
    b = RunBuilder(account_limits={"acct-a": 1, "acct-b": None}, http_timeout_seconds=8.0,
                   objectives={"starvation_wait": 2.0})
    served(b, "busy", due=98.0, claimed=99.0, account="acct-a", latency=5.49)
    passed_over(b)
    assert check(b, tmp_path).counts["starvation"] == 0
    # Free from 102.5 on, the slot was free a whole second before acct-b's claim at 104.1.
    b = RunBuilder(account_limits={"acct-a": 1, "acct-b": None}, http_timeout_seconds=8.0,
                   objectives={"starvation_wait": 2.0})
    served(b, "busy", due=98.0, claimed=99.0, account="acct-a", latency=3.49)
    passed_over(b)
    assert check(b, tmp_path / "free").counts["starvation"] == 1


def test_a_slow_claim_counts_from_when_it_was_sent(tmp_path: Path) -> None:
    # `old` was taken by a claim sent at 101.5 that returned at 105: it waited 1.5 s, and
    # acct-b's jobs claimed after 101.5 may have been taken after it.
    b = RunBuilder(account_limits={"acct-a": None, "acct-b": None},
                   objectives={"starvation_wait": 2.0})
    passed_over(b, sent=101.5)
    assert check(b, tmp_path).counts["starvation"] == 0


@pytest.mark.parametrize(("fault", "data", "excused"), [
    ("restart_postgres", {}, True),
    ("terminate_backends", {}, True),
    ("pause_worker", {"phase": "claim"}, True),
    ("pause_worker", {}, False),
    ("kill_worker", {}, False),
])
def test_only_a_fault_that_stops_every_worker_excuses_the_wait(
        tmp_path: Path, fault: str, data: dict[str, Any], excused: bool) -> None:
    b = RunBuilder(account_limits={"acct-a": None, "acct-b": None}, lease_seconds=2.0,
                   objectives={"starvation_wait": 2.0})
    passed_over(b)
    b.fault(fault, 100.5, 101.5, target="worker-0", data=data)
    assert check(b, tmp_path).counts["starvation"] == (0 if excused else 1)


def test_a_queue_that_promises_no_fairness_is_not_judged(tmp_path: Path) -> None:
    b = RunBuilder(account_limits={"acct-a": None, "acct-b": None},
                   objectives={"starvation_wait": 2.0}, guarantees={"fairness": False})
    passed_over(b)
    verdict = check(b, tmp_path)
    assert verdict.valid is True
    assert "fairness" in verdict.details["not_applicable"]["starvation"]


# --------------------------------------------------------------------------------------------
# Objectives.
# --------------------------------------------------------------------------------------------


def waits_of(b: RunBuilder, seconds: list[float], *, account: str = "acct-a",
             start: float = 100.0, every: float = 1.0) -> None:
    """One job each `every` seconds from `start`, each delivered `seconds[i]` after it was
    due."""
    for i, wait in enumerate(seconds):
        served(b, f"{account}-{i}", due=start + i * every,
               claimed=start + i * every + wait - 0.001, account=account)


def test_a_latency_objective_missed_says_the_value_the_bound_and_the_window(
        tmp_path: Path) -> None:
    b = RunBuilder(objectives={"first_delivery_p50": 0.5, "first_delivery_p99": 2.0},
                   account_limits={"acct-a": None})
    waits_of(b, [0.1] * 9 + [3.0])
    verdict = check(b, tmp_path)
    assert verdict.valid is False
    assert verdict.counts["objective_missed"] == 1
    [example] = verdict.examples["objective_missed"]
    evidence = example["evidence"]
    assert example["case"] == "first_delivery_p99"
    assert example["job_id"] == "acct-a-9"  # the longest wait
    assert evidence["bound"] == 2.0
    assert evidence["measured"] == pytest.approx(2.739, abs=0.01)  # numpy's p99 of the ten
    assert evidence["window"] == pytest.approx([100.0, 109.0])
    assert example["why"] == ("first_delivery_p99 of all accounts was 2.739 s, objective at "
                              "most 2.000 s, over 10 jobs due 100.000 s to 109.000 s "
                              "(outside faults)")
    assert verdict.details["objectives"] == {"first_delivery_p50": 0.5,
                                             "first_delivery_p99": 2.0}


def test_an_account_objective_judges_that_account_alone(tmp_path: Path) -> None:
    b = RunBuilder(objectives={"account": {"acct-b": {"oldest_due_age": 1.0}}},
                   account_limits={"acct-a": None, "acct-b": None})
    waits_of(b, [5.0, 5.0])
    waits_of(b, [0.2, 0.9], account="acct-b")
    assert check(b, tmp_path).counts["objective_missed"] == 0
    b = RunBuilder(objectives={"account": {"acct-a": {"oldest_due_age": 1.0}}},
                   account_limits={"acct-a": None, "acct-b": None})
    waits_of(b, [5.0, 5.0])
    verdict = check(b, tmp_path / "a")
    assert verdict.counts["objective_missed"] == 1
    assert verdict.examples["objective_missed"][0]["evidence"]["account"] == "acct-a"


def test_waits_a_fault_covers_are_judged_apart(tmp_path: Path) -> None:
    # The 6 s wait of the job due at 103 overlaps a kill (101 to 101.1, plus one lease).
    objectives: dict[str, Any] = {"oldest_due_age": 1.0}
    b = RunBuilder(objectives=objectives, lease_seconds=2.0, account_limits={"acct-a": None})
    waits_of(b, [0.1, 0.1, 0.1, 6.0])
    waits_of(b, [0.1], start=120.0)
    b.fault("kill_worker", 101.0, 101.1, target="worker-9")
    assert check(b, tmp_path).counts["objective_missed"] == 0
    objectives["during_faults"] = {"oldest_due_age": 5.0}
    b.objectives = objectives
    verdict = check(b, tmp_path / "during")
    [example] = verdict.examples["objective_missed"]
    assert example["evidence"]["during_faults"] is True
    assert example["evidence"]["jobs"] == 3  # due 101 to 103: each wait meets 101 to 103.1
    assert example["why"].endswith("(during faults)")


def test_delivered_ratio_over_the_load(tmp_path: Path) -> None:
    # Forty jobs due over the load (100 to 120), twenty delivered before it ended.
    b = RunBuilder(objectives={"delivered_ratio": 0.9}, load_window=(100.0, 120.0),
                   account_limits={"acct-a": None})
    waits_of(b, [0.1] * 20 + [30.0] * 20, every=0.5)
    verdict = check(b, tmp_path)
    [example] = verdict.examples["objective_missed"]
    assert example["evidence"]["measured"] == pytest.approx(0.5)
    assert "objective at least 0.900" in example["why"]
    # Over a moment, a ratio is its edges: not judged.
    b = RunBuilder(objectives={"delivered_ratio": 0.9}, load_window=(100.0, 101.0),
                   account_limits={"acct-a": None})
    waits_of(b, [0.1] * 20 + [30.0] * 20, every=0.05)
    assert check(b, tmp_path / "short").counts["objective_missed"] == 0


def test_check_can_judge_a_stored_run_against_another_objective(tmp_path: Path) -> None:
    b = RunBuilder(account_limits={"acct-a": None})
    waits_of(b, [0.1, 0.2, 0.3])
    run = b.write(tmp_path / "run")
    assert check_run([run]).counts["objective_missed"] == 0
    verdict = check_run([run], objectives=[("first_delivery_p50", "0.1")])
    assert verdict.counts["objective_missed"] == 1
    assert verdict.details["objectives_changed_by_check"] == ["first_delivery_p50=0.1"]


def test_fault_windows_and_held_slots() -> None:
    import numpy as np

    windows = np.array([[1.0, 2.0], [5.0, 6.0]])
    got = overlaps(windows, np.array([0.0, 2.5, 4.0, 6.5, 0.0]),
                   np.array([0.5, 3.0, 5.0, 7.0, 9.0]))
    assert got.tolist() == [False, False, True, False, True]
    held = Held(np.array([1.0, 2.0]), np.array([3.0, 4.0]))  # [1, 3] and [2, 4]
    assert held.overlapping(0.0, 0.5) == 0
    assert held.overlapping(1.5, 1.6) == 1
    assert held.overlapping(2.5, 2.6) == 2
    assert held.overlapping(3.5, 9.0) == 1
    assert held.overlapping(4.5, 9.0) == 0
