"""`skiplock sweep`'s pure parts: the rates it accepts and where it puts the knee."""

from __future__ import annotations

from typing import Any

import pytest

from skiplock.plumbing.errors import UsageError
from skiplock.scenarios.cli.sweep import bottleneck, bracket, capacities, knee_of, parse_rates


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


def _step(rate: float, meets: bool, **more: Any) -> dict[str, Any]:
    return {"rate": rate, "meets_objective": meets, "producers_short": False, **more}


def test_steps_run_again_with_more_producers_do_not_count() -> None:
    steps = [_step(100, True), _step(200, False, producers_short=True, superseded=True),
             _step(200, True), _step(400, False), _step(300, True)]
    # Judged in order of rate, whatever order they ran in (a bisection runs 300 last).
    assert knee_of(steps) == 300
    assert bracket(steps) == (300, 400)


def test_bracket_needs_a_met_rate_below_a_missed_one() -> None:
    assert bracket([_step(100, True), _step(200, True)]) == (200, None)
    assert bracket([_step(100, False)]) == (None, 100)
    # A step the producers could not offer says nothing about the queue.
    assert bracket([_step(100, True), _step(200, False, producers_short=True)]) == (100, None)


def test_slot_capacities_by_littles_law() -> None:
    scenario = {"accounts": {"a": 4, "b": 3, "c": 2, "d": 8}, "workers": 2, "batch": 10}
    assert capacities(scenario, 0.05) == {"account slots (17 in all)": 340.0,
                                          "workers' slots (2 x 10)": 400.0}
    # An unlimited account: the accounts together set no bound.
    assert list(capacities({**scenario, "accounts": {"a": 4, "b": None}}, 0.05)) == [
        "workers' slots (2 x 10)"]
    assert capacities(scenario, None) == {}


def test_the_bound_named_is_the_slots_the_delivered_rate_reached() -> None:
    scenario = {"accounts": {"a": 4, "b": 3, "c": 2, "d": 8}, "workers": 2, "batch": 10}
    caps = capacities(scenario, 0.05)
    near = _step(400, False, delivered_per_second=330.0, lease_hold_seconds=0.05,
                 capacities=caps, cpu={}, waits={})
    said = bottleneck([_step(200, True, capacities=caps), near], knee=200)
    assert said.startswith("at 400 jobs/s: account slots (17 in all)")
    assert "held its slot 50 ms" in said and "about 340 jobs/s" in said
    far = {**near, "delivered_per_second": 120.0,
           "cpu": {"machine_busy": 0.95, "server": 0.9, "workers": 0.5, "harness": 0.2}}
    assert "the machine's CPUs (95% busy" in bottleneck([far], knee=None)
