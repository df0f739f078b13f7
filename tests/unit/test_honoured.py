"""Settings a queue cannot honour are refused before a run starts, with what to change; a
fault entry it cannot feel is dropped alone."""

from __future__ import annotations

from skiplock.queue_impl.bullmq_queue import GUARANTEES as BULLMQ
from skiplock.queue_impl.interface import REFERENCE_GUARANTEES
from skiplock.queue_impl.pgqueuer_backend import GUARANTEES as PGQUEUER
from skiplock.scenarios.run.honoured import fault_unhonoured, honoured_faults, unhonoured
from skiplock.scenarios.run.spec import load


def test_the_shipped_scenarios_bullmq_can_run() -> None:
    for name in ("steady", "faulty-targets", "kill-workers", "crash-points"):
        assert unhonoured(load(name, []), "bullmq", BULLMQ) is None, name


def test_a_retry_cap_that_binds_needs_a_capped_backoff() -> None:
    spec = load("steady", ["retry_base=1", "retry_cap=3", "max_attempts=4"])
    said = unhonoured(spec, "bullmq", BULLMQ)
    assert said is not None
    assert "cannot honour retry_cap = 3" in said and "--set retry_cap=4" in said
    assert unhonoured(spec, "pg", REFERENCE_GUARANTEES) is None
    assert unhonoured(load("steady", ["retry_base=1", "retry_cap=4", "max_attempts=4"]),
                      "bullmq", BULLMQ) is None


def test_recovery_a_library_always_runs_cannot_be_switched_off() -> None:
    said = unhonoured(load("steady", ["recovery=false"]), "bullmq", BULLMQ)
    assert said is not None and "--no-recovery" in said
    assert unhonoured(load("steady", ["recovery=false"]), "pg", REFERENCE_GUARANTEES) is None


def test_a_scenario_whose_every_fault_cannot_reach_the_queue_is_refused() -> None:
    said = unhonoured(load("db-faults", []), "bullmq", BULLMQ)
    assert said is not None and "acts on PostgreSQL" in said and "run another scenario" in said


def test_a_fault_the_queue_cannot_feel_is_dropped_alone() -> None:
    spec = load("pause-workers", [])
    for backend, promised in (("bullmq", BULLMQ), ("pgq:factory", PGQUEUER)):
        assert unhonoured(spec, backend, promised) is None
        kept, dropped = honoured_faults(spec, backend, promised)
        # The claim-phase pause goes, with one line naming it; both lease-phase pauses stay.
        assert [(e.kind, e.phase) for e in kept.nemesis] == [("pause_worker", "lease")] * 2
        assert dropped == [f"fault dropped: pause_worker (phase claim) at 6.2 s; backend "
                           f"{backend!r} has no claim transaction to pause in"]
    # The reference has a claim transaction: nothing is dropped.
    assert honoured_faults(spec, "pg", REFERENCE_GUARANTEES) == (spec, [])
    kept, dropped = honoured_faults(load("exhaust-attempts", []), "bullmq", BULLMQ)
    assert len(dropped) == 1 and all(e.phase == "lease" for e in kept.nemesis)
    assert kept.nemesis


def test_planned_firings_are_judged_as_their_entries() -> None:
    from skiplock.chaos.nemesis import plan

    spec = load("pause-workers", [])
    firings = plan(spec.nemesis, seed=1, load_seconds=spec.duration, lease_seconds=spec.lease,
                   http_timeout_seconds=spec.http_timeout)
    left = [f for f in firings if fault_unhonoured(f, "bullmq", BULLMQ) is None]
    assert len(left) == len(firings) - 1 and all(f.phase == "lease" for f in left)
