"""The per-job oracle: expected terminal state and deliveries from script and configuration."""

from __future__ import annotations

import pytest

from skiplock.queue_impl.interface import Outcome
from skiplock.reports.history import SUCCEED, Behaviour, JobScript, Step
from skiplock.reports.oracle import (
    Expected,
    OracleCache,
    build_oracle,
    script_from_payload,
    step_outcome,
)

TIMEOUT = 2.0


def status(code: int) -> Step:
    return Step(behaviour=Behaviour.STATUS, status=code)


@pytest.mark.parametrize(
    ("step", "outcome"),
    [
        (Step(behaviour=Behaviour.OK), Outcome.SUCCESS),
        (status(200), Outcome.SUCCESS),
        (status(204), Outcome.SUCCESS),
        (status(503), Outcome.TRANSIENT),
        (status(500), Outcome.TRANSIENT),
        (status(408), Outcome.TRANSIENT),
        (status(429), Outcome.TRANSIENT),
        (status(400), Outcome.PERMANENT),
        (status(404), Outcome.PERMANENT),
        (Step(behaviour=Behaviour.SLOW, seconds=0.5), Outcome.SUCCESS),
        # Named by what it does, not by its name: a SLOW past the timeout is a timeout.
        (Step(behaviour=Behaviour.SLOW, seconds=3.0), Outcome.TRANSIENT),
        (Step(behaviour=Behaviour.HANG, seconds=5.0), Outcome.TRANSIENT),
        (Step(behaviour=Behaviour.HANG, seconds=1.0), Outcome.SUCCESS),
        (Step(behaviour=Behaviour.HANG_FOREVER), Outcome.TRANSIENT),
        (Step(behaviour=Behaviour.RESET), Outcome.TRANSIENT),
    ],
)
def test_step_outcome(step: Step, outcome: Outcome) -> None:
    assert step_outcome(step, TIMEOUT) is outcome


def test_succeed_completes_on_first_delivery() -> None:
    oracle = build_oracle(SUCCEED, 3, TIMEOUT)
    assert oracle.expected is Expected.COMPLETED
    assert oracle.deliveries == 1
    assert oracle.outcomes == (Outcome.SUCCESS,)


def test_transient_failures_then_success_within_attempts() -> None:
    script = JobScript(name="fail-2x", first=status(503), times=2)
    oracle = build_oracle(script, 5, TIMEOUT)
    assert oracle.expected is Expected.COMPLETED
    assert oracle.deliveries == 3
    assert oracle.outcomes == (Outcome.TRANSIENT, Outcome.TRANSIENT, Outcome.SUCCESS)


def test_transient_failures_past_max_attempts_dead_letter() -> None:
    script = JobScript(name="fail-3x", first=status(503), times=3)
    oracle = build_oracle(script, 3, TIMEOUT)
    assert oracle.expected is Expected.FAILED
    assert oracle.deliveries == 3


def test_permanent_failure_stops_at_once() -> None:
    script = JobScript(name="always-400", first=status(400))
    oracle = build_oracle(script, 5, TIMEOUT)
    assert oracle.expected is Expected.FAILED
    assert oracle.deliveries == 1
    assert oracle.expected.status.terminal


def test_hang_then_ok_uses_the_timeout() -> None:
    script = JobScript(name="hang-once", first=Step(behaviour=Behaviour.HANG, seconds=5.0),
                       times=1)
    assert build_oracle(script, 2, TIMEOUT).expected is Expected.COMPLETED
    assert build_oracle(script, 1, TIMEOUT).expected is Expected.FAILED
    # With a longer timeout the same hang is only slow.
    assert build_oracle(script, 1, 10.0).expected is Expected.COMPLETED


def test_max_attempts_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_attempts"):
        build_oracle(SUCCEED, 0, TIMEOUT)


def test_script_from_payload_defaults_to_succeed() -> None:
    assert script_from_payload(None) == SUCCEED
    raw = JobScript(name="x", first=status(500), times=1).to_json()
    assert script_from_payload(raw).first.status == 500


def test_cache_walks_each_script_once() -> None:
    cache = OracleCache(TIMEOUT)
    first = cache.get("k", SUCCEED, 3)
    assert cache.get("k", JobScript(name="other", first=status(400)), 3) is first
    assert cache.get("k", SUCCEED, 4) is not first
