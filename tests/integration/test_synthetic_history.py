"""The hand-built histories the checker's tests use say only what real runs write: every
record `RunBuilder` writes for a correct dispatcher (a success, a transient 503, a permanent
400, a timeout; the enqueues and the deliveries) has the shape of a record a real
`faulty-targets` run wrote, down to which fields are set, their types, and the outcome a
status was judged to be."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import pytest

from skiplock.reports.history import (
    DELIVERIES_DIR,
    DELIVERY_LOG,
    ENQUEUE_LOG,
    ENQUEUES_FILE,
    WORKER_LOG,
    WORKERS_DIR,
    LogFormat,
    read_log,
)
from skiplock.reports.synthetic import RunBuilder
from skiplock.scenarios.run import spec as spec_mod
from skiplock.scenarios.run.options import RunOptions
from skiplock.scenarios.run.runner import run_scenario

pytestmark = [pytest.mark.integration, pytest.mark.timeout(150)]

Shape = tuple[Any, ...]
SUCCEED: dict[str, Any] = {"name": "succeed", "first": {"behaviour": "ok"}, "times": None,
                           "then": {"behaviour": "ok"}}
# What tells records of one kind apart: the values that classify them.
_CLASSIFIERS = ("kind", "type", "result", "outcome", "status")


def _shape(record: Mapping[str, Any]) -> Shape:
    """A record's shape: its classifying values, then each set field with its type."""
    flat = dict(record)
    flat.update(flat.pop("data", None) or {})
    status = flat.get("status")
    classes = tuple((k, flat[k]) for k in _CLASSIFIERS if k in flat and k != "status")
    status_class = None if status is None else (int(status) // 100, int(status))
    fields = tuple(sorted((k, type(v).__name__) for k, v in flat.items() if v is not None))
    return (*classes, status_class, fields)


def _shapes(paths: Iterable[Path], log: LogFormat) -> set[Shape]:
    return {_shape(r) for path in paths for r in read_log(path, log)}


def _attempt_shapes(paths: Iterable[Path]) -> set[Shape]:
    """Per attempt: what the call ended as (result, status) and the outcome its result write
    recorded. Records of one kind alike can still pair wrongly (a 400 written as transient)."""
    calls: dict[tuple[str, int], tuple[Any, Any]] = {}
    writes: dict[tuple[str, int], Any] = {}
    for path in paths:
        for r in read_log(path, WORKER_LOG):
            key = (r["job_id"], r["attempt"])
            if r["kind"] == "http":
                calls[key] = (r["data"]["result"], r["data"].get("status"))
            elif r["kind"] == "write":
                writes[key] = r["data"]["outcome"]
    return {(*calls[k], writes[k]) for k in calls.keys() & writes.keys()}


def _logs(run_dir: Path) -> dict[str, tuple[list[Path], LogFormat]]:
    return {
        "enqueue": ([run_dir / ENQUEUES_FILE], ENQUEUE_LOG),
        "delivery": (sorted((run_dir / DELIVERIES_DIR).glob("*.csv")), DELIVERY_LOG),
        "worker event": (sorted((run_dir / WORKERS_DIR).glob("*.csv")), WORKER_LOG),
    }


def test_the_builder_writes_what_a_real_run_writes(pg_dsn: str, tmp_path: Path) -> None:
    spec = spec_mod.load("faulty-targets", ["warmup=0.5", "duration=4", "drain_timeout=30"])
    result = run_scenario(spec, RunOptions(backend="pg", seed=3, out=tmp_path / "real",
                                           dsn=pg_dsn))
    real = _logs(result.run_dir)

    b = RunBuilder(http_timeout_seconds=spec.http_timeout, lease_seconds=spec.lease)
    b.enqueue("ok", script=SUCCEED)
    b.attempt("ok", 1, claimed=100.0)
    b.enqueue("retry", script=SUCCEED, max_attempts=4)
    b.attempt("retry", 1, claimed=101.0, status=503, behaviour="status")
    b.attempt("retry", 2, claimed=102.0)
    b.enqueue("dead", script=SUCCEED)
    b.attempt("dead", 1, claimed=103.0, status=400, behaviour="status")
    b.enqueue("late", script=SUCCEED)
    b.attempt("late", 1, claimed=104.0, latency=spec.http_timeout + 0.5, behaviour="hang")
    built = _logs(b.write(tmp_path / "built"))

    for what, (paths, log) in built.items():
        real_shapes = _shapes(real[what][0], log)
        # The classifying values the builder writes, where the real run wrote them too.
        unseen = {s for s in _shapes(paths, log)
                  if s not in real_shapes and s[:-1] in {r[:-1] for r in real_shapes}}
        assert not unseen, f"{what} records the builder writes and no real run does: {unseen}"
        never = {s[:-1] for s in _shapes(paths, log)} - {r[:-1] for r in real_shapes}
        assert not never, f"{what} kinds the real run never wrote (cannot compare): {never}"
    attempts = _attempt_shapes(built["worker event"][0])
    assert len(attempts) == 4  # a success, a 503, a 400, a timeout
    unseen_attempts = attempts - _attempt_shapes(real["worker event"][0])
    assert not unseen_attempts, f"attempts no real dispatcher records: {unseen_attempts}"
