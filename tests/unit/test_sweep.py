"""`skiplock sweep`'s pure parts: the rates it accepts and where it puts the knee."""

from __future__ import annotations

from typing import Any

import pytest

from skiplock.plumbing.errors import UsageError
from skiplock.scenarios.cli.sweep import (
    MAX_ENQUEUE_BATCH,
    MAX_USERS,
    ProducerSizes,
    bottleneck,
    bracket,
    capacities,
    enqueue_bound,
    knee_of,
    parse_rates,
    raise_producers,
    size_producers,
    waited_on_enqueue,
)


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
    # Each account takes a quarter of the jobs: c, with 2 slots, fills first, at 2 slots /
    # 0.05 s = 40 jobs/s of its own, when 160 jobs/s are offered in all.
    assert capacities(scenario, 0.05) == {"account c's slots (2, 25% of the jobs)": 160.0,
                                          "workers' slots (2 x 10)": 400.0}
    # Its share decides, not its limit alone: d with 8 slots and 80 % of the jobs fills first.
    skewed = {**scenario, "account_mix": {"d": 12}}
    assert capacities(skewed, 0.05)["account d's slots (8, 80% of the jobs)"] == 200.0
    # An unlimited account sets no bound of its own; the limited one beside it still fills.
    assert capacities({**scenario, "accounts": {"a": 4, "b": None}}, 0.05) == {
        "account a's slots (4, 50% of the jobs)": 160.0, "workers' slots (2 x 10)": 400.0}
    assert list(capacities({**scenario, "accounts": {"b": None}}, 0.05)) == [
        "workers' slots (2 x 10)"]
    assert capacities(scenario, None) == {}


def test_a_refilling_workers_slots_are_counted_to_the_calls_end() -> None:
    # A refilling worker frees a slot when its call ends; the result is written after (a
    # busy writer gathers results first), while the account's limit still counts the job.
    scenario = {"accounts": {"a": 4}, "workers": 2, "batch": 10}
    assert capacities(scenario, 0.05, 0.04) == {"account a's slots (4, 100% of the jobs)": 80.0,
                                                "workers' slots (2 x 10)": 500.0}
    assert capacities({**scenario, "refill": False}, 0.05, 0.04)[
        "workers' slots (2 x 10)"] == 400.0
    caps = capacities({"accounts": {"a": None}, "workers": 2, "batch": 10}, 0.05, 0.04)
    step = _step(400, False, delivered_per_second=450.0, lease_hold_seconds=0.05,
                 slot_hold_seconds=0.04, capacities=caps, cpu={}, waits={})
    said = bottleneck([step], knee=None)
    assert "held its slot 40 ms from claim to its call's end" in said, said
    assert "about 500 jobs/s" in said
    # A barrier worker claims again only when its results are written: its slots are
    # counted, and named, over the lease hold, whatever the calls took.
    barrier = capacities({"accounts": {"a": None}, "workers": 2, "batch": 10,
                          "refill": False}, 0.05, 0.04)
    said = bottleneck([{**step, "capacities": barrier, "refill": False,
                        "delivered_per_second": 380.0}], knee=None)
    assert "held its slot 50 ms from claim to result written" in said, said
    assert "about 400 jobs/s" in said


def test_the_bound_named_is_the_slots_the_delivered_rate_reached() -> None:
    scenario = {"accounts": {"a": 4, "b": 3, "c": 2, "d": 8}, "workers": 2, "batch": 10}
    caps = capacities(scenario, 0.05)
    # Past the point where c fills, the other accounts still deliver: more than c allows.
    near = _step(400, False, delivered_per_second=330.0, lease_hold_seconds=0.05,
                 capacities=caps, cpu={}, waits={})
    said = bottleneck([_step(200, True, capacities=caps), near], knee=200)
    assert said.startswith("at 400 jobs/s: account c's slots (2, 25% of the jobs)"), said
    assert "held its slot 50 ms" in said and "full from about 160 jobs/s offered" in said
    far = {**near, "delivered_per_second": 120.0,
           "cpu": {"machine_busy": 0.95, "server": 0.9, "workers": 0.5, "harness": 0.2}}
    assert "the machine's CPUs (95% busy" in bottleneck([far], knee=None)


STEADY = ProducerSizes(producers=1, users=4, enqueue_batch=1)


def test_producers_are_sized_to_the_rate_asked() -> None:
    # A light rate keeps the scenario's own producers (one process, one job a transaction).
    low = size_producers(20, STEADY, cores=2)
    assert (low.producers, low.enqueue_batch, low.distributed) == (1, 1, False)
    assert low.users >= 4
    # 3,000 jobs/s: a hundred jobs per commit, a process per core in distributed mode.
    high = size_producers(3000, STEADY, cores=2)
    assert high.enqueue_batch == 100 and high.producers == 2 and high.distributed
    # Users enough for twice the transactions in flight if each took 0.6 s.
    assert high.producers * high.users >= 2 * 30 * 0.6
    # One core: one process, whatever the rate; never below what the scenario says.
    assert size_producers(3000, STEADY, cores=1).producers == 1
    own = ProducerSizes(producers=3, users=50, enqueue_batch=100)
    assert size_producers(10, own, cores=2) == own


def test_the_ladder_raises_users_then_processes_then_the_batch_and_ends() -> None:
    sizes: ProducerSizes | None = ProducerSizes(producers=1, users=20, enqueue_batch=30)
    seen = []
    while sizes is not None:
        seen.append(sizes)
        sizes = raise_producers(sizes, cores=2)
    assert [s.users for s in seen[:3]] == [20, 40, MAX_USERS]
    # Then a process per core, the users shared out between them, then bigger batches.
    assert (seen[3].producers, seen[3].users, seen[3].enqueue_batch) == (2, MAX_USERS // 2, 30)
    assert [s.enqueue_batch for s in seen[4:]] == [60, 120, 240, MAX_ENQUEUE_BATCH]
    # Never more connections than the cap, however far it climbs.
    assert all(s.producers * s.users <= MAX_USERS for s in seen)
    # Producers waiting on the queue's commits only get more users in flight.
    waiting = ProducerSizes(producers=2, users=8, enqueue_batch=100)
    assert raise_producers(waiting, cores=2, users_only=True) == ProducerSizes(
        producers=2, users=16, enqueue_batch=100)
    assert raise_producers(seen[3], cores=2, users_only=True) is None


def test_producers_that_waited_on_the_queue_make_the_step_the_queues() -> None:
    waiting = _step(3000, False, producers_short=True, offered_per_second=1800.0,
                    enqueue_p50_seconds=0.81, producer_busiest_core_share=0.08,
                    enqueue_batch=100)
    busy = {**waiting, "producer_busiest_core_share": 0.97}
    assert waited_on_enqueue(waiting) and not waited_on_enqueue(busy)
    # Producers short of CPU: the harness is the limit, and no knee is claimed.
    assert "the harness" in bottleneck([_step(1000, True), busy], None)
    # Producers with CPU to spare, waiting on commits: the queue did not take the rate.
    enqueue_bound(waiting)
    steps = [_step(1000, True), waiting]
    assert knee_of(steps) == 1000 and bracket(steps) == (1000, 3000)
    said = bottleneck(steps, 1000)
    assert "took only 1800 jobs/s" in said and "p50 810 ms" in said
    assert "the queue's enqueue is the limit" in said
