"""The anomalies the checker can find: one module each, one row each in `ANOMALIES`.

A row says what the anomaly is counted in (`unit`), what it means in a line (the report and
the README's table show it), whether it violates a guarantee, how it is found
(`find(frame, excuses) -> examples`, in its module, which computes its own candidate rows
from the frame and asks the fault explainer about them), how an example is said, and which
logs a cut-off tail of which may have lost the records that decide it (a history with such a
log cut short counts it but does not report it).

To add an anomaly: write its module (`find` and `say`), add its row here, and a line to the
anomaly table in docs/reference/anomalies.md."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from types import ModuleType
from typing import Literal

from skiplock.queue_impl.interface import Guarantees
from skiplock.reports.checker.anomalies import (
    attempts_exceeded,
    concurrent_delivery,
    duplicate_explained,
    duplicate_unexplained,
    early_retry,
    limit_exceeded,
    lost,
    objective_missed,
    stale_write,
    starvation,
    state_mismatch,
    stuck,
    unexpected,
)
from skiplock.reports.checker.common import Example
from skiplock.reports.checker.excuses import Excuses
from skiplock.reports.checker.frame import Frame
from skiplock.reports.history import (
    DELIVERIES_DIR,
    ENQUEUES_FILE,
    FINAL_JOBS_FILE,
    NEMESIS_FILE,
    WORKERS_DIR,
)

Unit = Literal["jobs", "deliveries", "writes", "objectives"]


@dataclass(frozen=True)
class Anomaly:
    kind: str
    unit: Unit
    meaning: str
    module: ModuleType  # holds find(frame, excuses) and say(example)
    violation: bool = True
    # The logs a cut-off tail of which may hide what decides it (or invent it, by losing
    # an enqueue, a delivery, or the event or fault that explains one).
    held_back_by: frozenset[str] = frozenset()
    # The promise it judges, if the queue must declare it (`Guarantees`): given the queue's
    # declaration, why the check does not apply, or None when it does.
    not_applicable: Callable[[Guarantees], str | None] = lambda _promised: None

    @property
    def find(self) -> Callable[[Frame, Excuses], Iterable[Example]]:
        return self.module.find  # type: ignore[no-any-return]

    @property
    def say(self) -> Callable[[Example], str]:
        return self.module.say  # type: ignore[no-any-return]


def _needs_limits(promised: Guarantees) -> str | None:
    return None if promised.account_limits else (
        "the queue declares no per-account concurrency limits")


def _needs_fairness(promised: Guarantees) -> str | None:
    return None if promised.fairness else (
        "the queue declares no fairness: it may serve jobs out of the order they became due")


def _needs_fencing(promised: Guarantees) -> str | None:
    return None if promised.fencing else (
        "the queue declares no fencing: a write after its lease was lost is not refused")


_ALL_LOGS = frozenset({ENQUEUES_FILE, DELIVERIES_DIR, WORKERS_DIR, NEMESIS_FILE,
                       FINAL_JOBS_FILE})
_EXPLAINED_BY = frozenset({DELIVERIES_DIR, WORKERS_DIR, NEMESIS_FILE})

ANOMALIES: tuple[Anomaly, ...] = (
    Anomaly("lost", "jobs",
            "acknowledged, never delivered with 2xx, and not legitimately dead-lettered",
            lost, held_back_by=_ALL_LOGS),
    Anomaly("unexpected", "deliveries",
            "a delivery of a job never enqueued (or whose enqueue failed)",
            unexpected, held_back_by=_ALL_LOGS),
    Anomaly("duplicate_explained", "deliveries",
            "a 2xx delivered again, explained by a recorded fault or timeout "
            "(at-least-once, as promised)",
            duplicate_explained, violation=False),
    Anomaly("duplicate_unexplained", "deliveries",
            "a 2xx delivered again with nothing recorded to explain it",
            duplicate_unexplained, held_back_by=_EXPLAINED_BY),
    Anomaly("concurrent_delivery", "deliveries",
            "two deliveries of one job in flight at once, the first lease still held",
            concurrent_delivery, held_back_by=frozenset({WORKERS_DIR, NEMESIS_FILE})),
    Anomaly("attempts_exceeded", "jobs",
            "more deliveries than max_attempts (or one after a permanent failure)",
            attempts_exceeded, held_back_by=_EXPLAINED_BY),
    Anomaly("early_retry", "deliveries",
            "a retry sent before the backoff allows",
            early_retry, held_back_by=_EXPLAINED_BY),
    Anomaly("limit_exceeded", "deliveries",
            "more deliveries of one account in flight than its limit",
            limit_exceeded, held_back_by=frozenset({WORKERS_DIR}),
            not_applicable=_needs_limits),
    Anomaly("stuck", "jobs",
            "a job not finished after a completed drain",
            stuck),
    Anomaly("state_mismatch", "jobs",
            "the final state disagrees with what the target saw",
            state_mismatch, held_back_by=_EXPLAINED_BY | {FINAL_JOBS_FILE}),
    Anomaly("stale_write", "writes",
            "a result applied after another worker claimed a later attempt",
            stale_write, not_applicable=_needs_fencing),
    Anomaly("starvation", "jobs",
            "a due job left waiting past the bound while later jobs of other accounts were "
            "claimed, its own account having a free slot",
            starvation, held_back_by=_ALL_LOGS, not_applicable=_needs_fairness),
    Anomaly("objective_missed", "objectives",
            "a latency or throughput objective of the scenario missed (faults' windows "
            "judged apart)",
            objective_missed, held_back_by=_ALL_LOGS),
)
BY_KIND = {a.kind: a for a in ANOMALIES}
