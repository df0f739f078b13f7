"""Every fault kind, declared once: what it does, what it hits, how long it lasts, what it
needs and its defaults. The nemesis (`skiplock.chaos.nemesis`), the checker's categories
(`skiplock.reports.checker.faults`), what a backend cannot honour
(`skiplock.scenarios.run.honoured`), `--nemesis`'s help and the docs' table are derived from this
table, and `tests/unit/test_fault_kinds.py` holds every one of them to it.

It lives in `reports/`, the lowest layer that needs it: the checker reads fault records and
must not import the code that injects them.

To add a fault kind: a row here, and its `Fault` subclass in `chaos/` (registered with
`@register` under the row's name); the row's `hits` says what the checker may explain by it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

# What a fault hits, which is what it may explain:
# - worker: one worker process; what that worker held in its window;
# - database: the queue's database; any result write in its window may have been lost;
# - target: one echo target; a delivery there may have been recorded 2xx while its answer
#   never reached the worker;
# - none: nothing a redelivery can be blamed on (it slows the queue down, no more).
Hits = Literal["worker", "database", "target", "none"]


@dataclass(frozen=True)
class FaultKind:
    name: str
    does: str  # one line, as the docs' table and the help say it
    hits: Hits
    # Lasts until healed (a window); else an instant.
    lasting: bool
    # How long a lasting fault is held when the schedule gives no duration, from the lease
    # and the HTTP timeout: long enough to reach the bug it is for.
    default_duration: Callable[[float, float], float]
    # Seconds between firings of the `--nemesis KIND` shortcut.
    shortcut_interval: float
    # Acts on PostgreSQL: a queue kept elsewhere (Redis) never feels it.
    postgres: bool = False
    # Needs a server the harness started (it stops and starts it).
    owned_server: bool = False
    # A dispatcher failpoint (the worker exits at a point of its own code), not a signal.
    failpoint: bool = False
    # Stops every worker while it lasts (the database is gone or refuses every session): only
    # such a fault excuses a due job's wait for fairness (`starvation`).
    stops_every_worker: bool = False


def _instant(_lease: float, _timeout: float) -> float:
    return 0.0


def _seconds(value: float) -> Callable[[float, float], float]:
    return lambda _lease, _timeout: value


FAULT_KINDS: tuple[FaultKind, ...] = (
    FaultKind("kill_worker", "SIGKILL a worker that holds a lease", "worker", lasting=False,
              default_duration=_instant, shortcut_interval=3.0),
    FaultKind("pause_worker", "SIGSTOP a lease holder past its lease, then SIGCONT", "worker",
              lasting=True, default_duration=lambda lease, _timeout: lease + 1.0,
              shortcut_interval=6.0),
    FaultKind("crash_after_claim", "failpoint: a worker dies after its claim commits", "worker",
              lasting=False, default_duration=_seconds(2.0), shortcut_interval=4.0,
              failpoint=True),
    FaultKind("crash_after_http", "failpoint: a worker dies after a 2xx, before its result "
              "write", "worker", lasting=False, default_duration=_seconds(2.0),
              shortcut_interval=4.0, failpoint=True),
    FaultKind("hang_target", "an echo target holds every request past the HTTP timeout",
              "target", lasting=True,
              default_duration=lambda _lease, timeout: timeout + 1.0, shortcut_interval=5.0),
    FaultKind("kill_target", "SIGKILL an echo target, restarted on its address when healed",
              "target", lasting=True, default_duration=_seconds(1.0), shortcut_interval=5.0),
    FaultKind("terminate_backends", "pg_terminate_backend on the queue's sessions",
              "database", lasting=False, default_duration=_instant, shortcut_interval=3.0,
              postgres=True, stops_every_worker=True),
    FaultKind("restart_postgres", "stop and start the server the harness owns", "database",
              lasting=True, default_duration=_instant, shortcut_interval=6.0, postgres=True,
              owned_server=True, stops_every_worker=True),
    FaultKind("pin_xmin", "an idle transaction holds back xmin (dead rows pile up)", "none",
              lasting=True, default_duration=_seconds(3.0), shortcut_interval=5.0,
              postgres=True),
    FaultKind("exhaust_pool", "idle sessions fill the server's connection slots", "database",
              lasting=True, default_duration=_seconds(3.0), shortcut_interval=6.0,
              postgres=True, stops_every_worker=True),
    FaultKind("cancel_statements", "pg_cancel_backend on every statement the queue runs, as a "
              "statement_timeout would", "database", lasting=True,
              default_duration=_seconds(2.0), shortcut_interval=5.0, postgres=True,
              stops_every_worker=True),
)
BY_NAME: dict[str, FaultKind] = {kind.name: kind for kind in FAULT_KINDS}
NAMES: tuple[str, ...] = tuple(BY_NAME)


def names_where(test: Callable[[FaultKind], bool]) -> frozenset[str]:
    """The names of the kinds `test` holds for."""
    return frozenset(kind.name for kind in FAULT_KINDS if test(kind))
