"""Retry policy: which failures are worth retrying, and how long to wait before the next try.

Transient: timeouts, connection errors, 5xx, 408 and 429. Everything else in 4xx is permanent:
retrying a bad request only repeats it. The delay is exponential in the attempt number,
capped, with "equal jitter" (half fixed, half random) so that a burst of failures does not
come back as a burst of retries, while every retry still waits at least `min_delay`.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from datetime import timedelta

from skiplock.queue_impl.interface import Outcome

TRANSIENT_STATUSES = frozenset({408, 429})


def status_is_transient(status: int) -> bool:
    return status >= 500 or status in TRANSIENT_STATUSES


def classify_status(status: int) -> Outcome:
    """The outcome of an attempt that got an HTTP answer."""
    if 200 <= status < 300:
        return Outcome.SUCCESS
    if status_is_transient(status):
        return Outcome.TRANSIENT
    return Outcome.PERMANENT


@dataclass(frozen=True, kw_only=True)
class RetryPolicy:
    base_seconds: float = 30.0
    cap_seconds: float = 3600.0
    # Fraction of the delay that is random: 0 is fixed backoff, 1 is "full jitter".
    jitter: float = 0.5
    rng: random.Random = field(default_factory=random.Random, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.base_seconds < 0 or self.cap_seconds < self.base_seconds:
            raise ValueError("retry backoff needs 0 <= base <= cap")
        if not 0.0 <= self.jitter <= 1.0:
            raise ValueError("retry jitter must be between 0 and 1")

    def max_delay(self, attempt: int) -> float:
        """The un-jittered delay after failed attempt number `attempt` (1-based)."""
        if attempt < 1:
            raise ValueError("attempt numbers start at 1")
        # Cap the exponent first: 2**attempt overflows a float for absurd attempt counts.
        exponent = min(attempt - 1, 62)
        return min(self.cap_seconds, self.base_seconds * (2.0**exponent))

    def min_delay(self, attempt: int) -> float:
        """The shortest wait the policy ever allows after attempt `attempt`: the checker's
        bound for early_retry."""
        return self.max_delay(attempt) * (1.0 - self.jitter)

    def delay(self, attempt: int) -> timedelta:
        full = self.max_delay(attempt)
        fixed = full * (1.0 - self.jitter)
        return timedelta(seconds=fixed + self.rng.uniform(0.0, full - fixed))
