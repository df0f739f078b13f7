"""The faults a nemesis records, by what they hit, and their windows."""

from __future__ import annotations

import math
from typing import Any

from skiplock.reports.checker.common import fmt
from skiplock.reports.fault_kinds import NAMES, names_where

# The categories, from the one table of fault kinds (`skiplock.reports.fault_kinds`).
# Faults that hit one worker process: they explain what that worker held at the time.
WORKER_FAULTS = names_where(lambda k: k.hits == "worker")
# Faults that hit the queue's database: any result write in their window may have been lost.
DATABASE_FAULTS = names_where(lambda k: k.hits == "database")
# Faults that last until they are healed; the others are instants.
LASTING_FAULTS = names_where(lambda k: k.lasting)
# Faults that hit one echo target: a delivery there in their window may have been recorded 2xx
# while its answer never reached the worker (held past the timeout, or lost with the process).
TARGET_FAULTS = names_where(lambda k: k.hits == "target")
# Faults that stop every worker while they last (`starvation` excuses only these).
STOP_EVERY_WORKER = names_where(lambda k: k.stops_every_worker)
KNOWN_FAULTS = frozenset(NAMES)


def fault_end(fault: dict[str, Any]) -> float:
    """When a fault ended: its recorded end, else never (a lasting fault never healed) or
    its start (an instant)."""
    end = fault["end"]
    if end is not None:
        return float(end)
    return math.inf if fault["fault"] in LASTING_FAULTS else float(fault["start"])


def fault_span(fault: dict[str, Any]) -> str:
    start, end = float(fault["start"]), fault_end(fault)
    return fmt(start) + ("" if end == start else " to " + fmt(end))
