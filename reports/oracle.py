"""The per-job oracle: what a correct queue must do with one job, decided before looking at
what happened.

It is built from the job's script (what the echo target will answer to its n-th delivery),
the `max_attempts` the producer asked for, the run's HTTP timeout and the retry policy, all
taken from the run's configuration, never from values the queue wrote about itself, so a
queue that records wrong attempt counts or states is still caught.

Classification follows `skiplock.queue_impl.retry`: a 2xx answer inside the timeout is a
success; 5xx, 408, 429, timeouts and connection errors are transient; any other status is
permanent. SLOW answering inside the timeout is a success; HANG past it is a timeout
(transient), as are HANG_FOREVER and RESET. A SLOW or HANG step whose delay is on the other side
of the timeout is judged by its delay, not by its name.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, assert_never

from skiplock.queue_impl.interface import JobStatus, Outcome
from skiplock.queue_impl.retry import classify_status
from skiplock.reports.history import SUCCEED, Behaviour, JobScript, Step


class Expected(StrEnum):
    COMPLETED = "COMPLETED"
    FAILED = "FAILED"

    @property
    def status(self) -> JobStatus:
        return JobStatus(self.value)


@dataclass(frozen=True, kw_only=True)
class Oracle:
    """What a fault-free, correct run does with one job: `deliveries` deliveries, the last of
    which ends it in `expected`. `outcomes[i]` is the outcome of delivery i + 1.

    A timeout uses an attempt like any transient failure, so `deliveries` is also the least a
    correct queue makes before it dead-letters the job: fewer, with no recorded fault that
    used up attempts, is a state mismatch."""

    expected: Expected
    deliveries: int
    max_attempts: int
    outcomes: tuple[Outcome, ...]


def step_outcome(step: Step, http_timeout_seconds: float) -> Outcome:
    """The outcome the dispatcher sees for one delivery answered by `step`."""
    behaviour = step.behaviour
    match behaviour:
        case Behaviour.OK:
            return Outcome.SUCCESS
        case Behaviour.STATUS:
            return classify_status(step.status)
        case Behaviour.SLOW | Behaviour.HANG:
            # Judged by the delay: a 200 that arrives after the timeout was never seen.
            if step.seconds >= http_timeout_seconds:
                return Outcome.TRANSIENT
            return Outcome.SUCCESS
        case Behaviour.HANG_FOREVER | Behaviour.RESET:
            return Outcome.TRANSIENT
        case _:
            assert_never(behaviour)


def build_oracle(script: JobScript, max_attempts: int, http_timeout_seconds: float) -> Oracle:
    """Walk the script delivery by delivery until an outcome ends the job."""
    if max_attempts < 1:
        raise ValueError("max_attempts must be at least 1")
    outcomes: list[Outcome] = []
    for number in range(1, max_attempts + 1):
        outcome = step_outcome(script.step_for(number), http_timeout_seconds)
        outcomes.append(outcome)
        match outcome:
            case Outcome.SUCCESS | Outcome.PERMANENT:
                return Oracle(
                    expected=(Expected.COMPLETED if outcome is Outcome.SUCCESS
                              else Expected.FAILED),
                    deliveries=number,
                    max_attempts=max_attempts,
                    outcomes=tuple(outcomes),
                )
            case Outcome.TRANSIENT:
                continue
            case _:
                assert_never(outcome)
    # Every attempt was transient: the job is dead-lettered at max_attempts.
    return Oracle(
        expected=Expected.FAILED,
        deliveries=max_attempts,
        max_attempts=max_attempts,
        outcomes=tuple(outcomes),
    )


def script_from_payload(raw: Mapping[str, Any] | None) -> JobScript:
    """The script an enqueue recorded; no script means "succeed" (as the target reads it)."""
    if raw is None:
        return SUCCEED
    return JobScript.from_json(raw)


class OracleCache:
    """Oracles keyed by (script, max_attempts): a run has a handful of distinct scripts and
    a million jobs, so each distinct one is walked once."""

    def __init__(self, http_timeout_seconds: float) -> None:
        self.http_timeout_seconds = http_timeout_seconds
        self._cache: dict[tuple[str, int], Oracle] = {}

    def get(self, script_key: str, script: JobScript, max_attempts: int) -> Oracle:
        key = (script_key, max_attempts)
        found = self._cache.get(key)
        if found is None:
            found = build_oracle(script, max_attempts, self.http_timeout_seconds)
            self._cache[key] = found
        return found
