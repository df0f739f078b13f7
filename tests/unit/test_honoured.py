"""Settings a queue cannot honour are refused before a run starts, with what to change."""

from __future__ import annotations

from skiplock.queue_impl.bullmq_queue import GUARANTEES as BULLMQ
from skiplock.queue_impl.interface import REFERENCE_GUARANTEES
from skiplock.scenarios.run.honoured import unhonoured
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


def test_faults_that_cannot_reach_the_queue_are_refused() -> None:
    said = unhonoured(load("db-faults", []), "bullmq", BULLMQ)
    assert said is not None and "acts on PostgreSQL" in said
    said = unhonoured(load("exhaust-attempts", []), "bullmq", BULLMQ)
    assert said is not None and 'phase = "lease"' in said
    assert unhonoured(load("exhaust-attempts", []), "pg", REFERENCE_GUARANTEES) is None
