"""One table of fault kinds (`skiplock.reports.fault_kinds`), and every other list of them
held to it: the nemesis's kinds and classes, the history's vocabulary, the checker's
categories, what a Redis queue cannot feel, `--nemesis`'s help and the docs."""

from __future__ import annotations

import argparse
from pathlib import Path

from skiplock.chaos import nemesis
from skiplock.reports.checker import faults
from skiplock.reports.fault_kinds import BY_NAME, FAULT_KINDS, NAMES
from skiplock.scenarios.cli import run as cmd_run
from skiplock.scenarios.run import honoured

ROOT = Path(__file__).resolve().parents[2]


def test_every_list_of_fault_kinds_is_the_table() -> None:
    assert len(set(NAMES)) == len(FAULT_KINDS)
    assert NAMES == nemesis.NEMESIS_KINDS
    assert set(NAMES) == set(nemesis.registry())  # a class for every row, no more
    assert set(NAMES) == faults.KNOWN_FAULTS
    assert set(NAMES) == set(nemesis.DEFAULT_INTERVAL)


def test_the_categories_follow_each_rows_declaration() -> None:
    derived = {
        "worker": faults.WORKER_FAULTS, "database": faults.DATABASE_FAULTS,
        "target": faults.TARGET_FAULTS, "lasting": faults.LASTING_FAULTS,
        "postgres": honoured.POSTGRES_FAULTS, "failpoint": nemesis.FAILPOINT_KINDS,
        "owned server": nemesis.OWNED_SERVER_KINDS, "stops all": faults.STOP_EVERY_WORKER,
    }
    assert derived == {
        "worker": {"kill_worker", "pause_worker", "crash_after_claim", "crash_after_http"},
        "database": {"terminate_backends", "restart_postgres", "exhaust_pool",
                     "cancel_statements"},
        "target": {"hang_target", "kill_target"},
        "lasting": {"pause_worker", "hang_target", "kill_target", "restart_postgres",
                    "pin_xmin", "exhaust_pool", "cancel_statements"},
        "postgres": {"terminate_backends", "restart_postgres", "pin_xmin", "exhaust_pool",
                     "cancel_statements"},
        "failpoint": {"crash_after_claim", "crash_after_http"},
        "owned server": {"restart_postgres"},
        "stops all": {"terminate_backends", "restart_postgres", "exhaust_pool",
                      "cancel_statements"},
    }
    # A failpoint is a worker's own exit; a fault that stops every worker hits the database.
    for kind in FAULT_KINDS:
        assert not kind.failpoint or kind.hits == "worker", kind.name
        assert not kind.stops_every_worker or kind.hits == "database", kind.name


def test_default_durations_come_from_the_table() -> None:
    assert nemesis.default_duration("pause_worker", lease_seconds=4.0,
                                    http_timeout_seconds=1.0) == 5.0
    assert nemesis.default_duration("hang_target", lease_seconds=4.0,
                                    http_timeout_seconds=1.0) == 2.0
    for kind in FAULT_KINDS:
        if not kind.lasting and not kind.failpoint:
            assert kind.default_duration(4.0, 1.0) == 0.0, kind.name


def test_the_help_and_the_docs_name_every_kind() -> None:
    parser = argparse.ArgumentParser()
    cmd_run.configure(parser)
    [action] = [a for a in parser._actions if "--nemesis" in a.option_strings]
    assert action.help is not None
    docs = (ROOT / "docs" / "reference" / "scenario-files.md").read_text()
    for name in NAMES:
        assert name in action.help
        assert f"`{name}`" in docs, name
        assert BY_NAME[name].does


def test_the_docs_name_the_waits_a_commit_hunt_looks_for() -> None:
    from skiplock.chaos.faults.database import WAL_FLUSH_WAITS

    text = (ROOT / "docs" / "reference" / "scenario-files.md").read_text()
    named = {f"{kind}:{event}" for kind, event in WAL_FLUSH_WAITS}
    assert named and all(f"`{name}`" in text for name in named)
    listed = text.split("a commit's WAL flush (", 1)[1].split(")", 1)[0]
    assert set(listed.replace("`", "").split(", ")) == named
