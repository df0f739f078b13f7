"""Retry classification and backoff bounds."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from skiplock.queue_impl.interface import Outcome
from skiplock.queue_impl.retry import RetryPolicy, classify_status, status_is_transient


@pytest.mark.parametrize(
    ("status", "outcome"),
    [
        (200, Outcome.SUCCESS),
        (204, Outcome.SUCCESS),
        (299, Outcome.SUCCESS),
        (400, Outcome.PERMANENT),
        (404, Outcome.PERMANENT),
        (409, Outcome.PERMANENT),
        (408, Outcome.TRANSIENT),
        (429, Outcome.TRANSIENT),
        (500, Outcome.TRANSIENT),
        (503, Outcome.TRANSIENT),
        (599, Outcome.TRANSIENT),
        (301, Outcome.PERMANENT),
    ],
)
def test_classify_status(status: int, outcome: Outcome) -> None:
    assert classify_status(status) is outcome
    assert status_is_transient(status) == (outcome is Outcome.TRANSIENT)


def test_backoff_doubles_then_caps() -> None:
    policy = RetryPolicy(base_seconds=30, cap_seconds=100, jitter=0.0)
    assert [policy.max_delay(n) for n in (1, 2, 3, 4)] == [30, 60, 100, 100]
    assert policy.delay(2).total_seconds() == 60
    assert policy.max_delay(10_000) == 100


def test_invalid_policies_are_refused() -> None:
    with pytest.raises(ValueError):
        RetryPolicy(base_seconds=10, cap_seconds=5)
    with pytest.raises(ValueError):
        RetryPolicy(jitter=1.5)
    with pytest.raises(ValueError):
        RetryPolicy().max_delay(0)


@given(
    base=st.floats(min_value=0.0, max_value=100.0),
    extra=st.floats(min_value=0.0, max_value=1000.0),
    jitter=st.floats(min_value=0.0, max_value=1.0),
    attempt=st.integers(min_value=1, max_value=200),
    seed=st.integers(min_value=0, max_value=2**32),
)
def test_delay_stays_within_bounds(
    base: float, extra: float, jitter: float, attempt: int, seed: int
) -> None:
    policy = RetryPolicy(
        base_seconds=base, cap_seconds=base + extra, jitter=jitter, rng=random.Random(seed)
    )
    delay = policy.delay(attempt).total_seconds()
    # timedelta keeps microseconds: allow that rounding, nothing more.
    assert policy.min_delay(attempt) - 1e-6 <= delay <= policy.max_delay(attempt) + 1e-6
    assert policy.max_delay(attempt) <= policy.cap_seconds
    assert policy.min_delay(attempt) >= 0


@given(attempt=st.integers(min_value=1, max_value=60))
def test_max_delay_never_decreases(attempt: int) -> None:
    policy = RetryPolicy(base_seconds=1.0, cap_seconds=3600.0)
    assert policy.max_delay(attempt + 1) >= policy.max_delay(attempt)


def test_jitter_spreads_delays() -> None:
    policy = RetryPolicy(base_seconds=10, cap_seconds=10, jitter=1.0, rng=random.Random(7))
    delays = {policy.delay(1).total_seconds() for _ in range(50)}
    assert len(delays) > 40
    assert min(delays) >= 0 and max(delays) <= 10
