"""`[objectives]`: one schema read by the scenario file, `--set` and the checker alike."""

from __future__ import annotations

import pytest

from skiplock.reports.objectives import ObjectiveError, Objectives, split_overrides
from skiplock.scenarios.run.spec import SpecError, from_mapping, load, replay_command


def test_a_table_reads_back_as_written() -> None:
    raw = {"first_delivery_p99": 2, "starvation_wait": 3.0,
           "account": {"small-a": {"oldest_due_age": 1.5}},
           "during_faults": {"delivered_ratio": 0.5}}
    objectives = Objectives.from_mapping(raw)
    assert objectives.overall == {"first_delivery_p99": 2.0}
    assert objectives.starvation_bound(lease_seconds=4.0) == 3.0
    assert Objectives().starvation_bound(lease_seconds=4.0) == 8.0
    assert Objectives.from_mapping(objectives.to_json()) == objectives
    assert objectives.flat() == {"first_delivery_p99": 2.0, "starvation_wait": 3.0,
                                 "account.small-a.oldest_due_age": 1.5,
                                 "during_faults.delivered_ratio": 0.5}


@pytest.mark.parametrize(("raw", "message"), [
    ({"p99": 1}, "unknown objective objectives.p99; valid: first_delivery_p50"),
    ({"first_delivery_p99": 0}, "must be a positive number of seconds"),
    ({"first_delivery_p99": True}, "must be a finite number"),
    ({"first_delivery_p99": float("nan")}, "must be a finite number"),
    ({"delivered_ratio": 1.5}, "must be a ratio above 0 and at most 1"),
    ({"account": 3}, "objectives.account must be a table of accounts"),
    ({"during_faults": {"oldest_due_age": -1}}, "objectives.during_faults.oldest_due_age"),
])
def test_bad_objectives_are_refused_with_one_line(raw: dict[str, object], message: str) -> None:
    with pytest.raises(ObjectiveError, match=message.replace(".", r"\.").replace("(", r"\(")):
        Objectives.from_mapping(raw)


def test_a_scenario_file_and_set_mean_the_same_thing() -> None:
    by_file = from_mapping({"objectives": {"account": {"acme": {"first_delivery_p99": 1.0}}}})
    by_set = load("steady", ["objectives.account.acme.first_delivery_p99=1"])
    assert by_set.objectives.accounts["acme"] == by_file.objectives.accounts["acme"]
    assert by_set.to_json()["objectives"]["account"]["acme"] == {"first_delivery_p99": 1.0}
    # The replay line says every bound the shipped file does not.
    assert "--set objectives.account.acme.first_delivery_p99=1" in replay_command(
        by_set, seed=1, backend="pg", sql_path=None)


def test_an_objective_for_an_unknown_account_is_refused() -> None:
    with pytest.raises(SpecError, match=r"objectives\.account\.nope: no such account"):
        load("steady", ["objectives.account.nope.first_delivery_p99=1"])
    with pytest.raises(SpecError, match="must be a number"):
        load("steady", ["objectives.first_delivery_p99=fast"])


def test_set_items_are_split_by_what_they_name() -> None:
    assert split_overrides(["objectives.oldest_due_age=2", "rate=5", "objectives="]) == (
        [("oldest_due_age", "2")], ["rate=5", "objectives="])
