"""`skiplock sweep`'s pure parts: the rates it accepts and where it puts the knee."""

from __future__ import annotations

from typing import Any

import pytest

from skiplock.plumbing.errors import UsageError
from skiplock.scenarios.cmd_sweep import knee_of, parse_rates


def test_sweep_rates_and_knee() -> None:
    assert parse_rates("50,100,400") == (50.0, 100.0, 400.0)
    for bad in ("", "a", "100,50", "0,10", "nan", "10,10"):
        with pytest.raises(UsageError, match="--rates"):
            parse_rates(bad)

    def step(rate: float, meets: bool, short: bool = False) -> dict[str, Any]:
        return {"rate": rate, "meets_objective": meets, "producers_short": short}

    assert knee_of([step(1, True), step(2, True), step(3, False), step(4, True)]) == 2
    assert knee_of([step(1, False)]) is None
    # The producers could not offer a rate: the queue's limit was never found.
    assert knee_of([step(1, True), step(2, True, short=True)]) is None
