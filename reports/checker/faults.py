"""The faults a nemesis records, by what they hit, and their windows."""

from __future__ import annotations

import math
from typing import Any

from skiplock.reports.checker.common import fmt

# Faults that hit one worker process: they explain what that worker held at the time.
WORKER_FAULTS = frozenset({"kill_worker", "pause_worker", "crash_after_claim", "crash_after_http"})
# Faults that hit the queue's database: any result write in their window may have been lost.
DATABASE_FAULTS = frozenset({"terminate_backends", "restart_postgres", "exhaust_pool"})
# Faults that last until they are healed; the others are instants.
LASTING_FAULTS = frozenset({"pause_worker", "hang_target", "kill_target", "restart_postgres",
                             "pin_xmin", "exhaust_pool"})
# Faults that hit one echo target: a delivery there in their window may have been recorded 2xx
# while its answer never reached the worker (held past the timeout, or lost with the process).
TARGET_FAULTS = frozenset({"hang_target", "kill_target"})
KNOWN_FAULTS = frozenset(WORKER_FAULTS | DATABASE_FAULTS | TARGET_FAULTS | {"pin_xmin"})


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
