"""The checker as a table of anomalies: each is found by its own module, named after it; an
example carries its evidence as data; a rule that breaks makes only its own answer unknown."""

from __future__ import annotations

import importlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from skiplock.reports.checker import ANOMALIES, COUNT_KEYS, MEANINGS, VIOLATION_KEYS, check_run
from skiplock.reports.checker.common import Example, times_from
from skiplock.reports.synthetic import RunBuilder

ROOT = Path(__file__).resolve().parents[2]
FAIL_ONCE: dict[str, Any] = {"name": "custom", "first": {"behaviour": "status", "status": 503},
                             "times": 1, "then": {"behaviour": "ok"}}
SUCCEED: dict[str, Any] = {"name": "succeed", "first": {"behaviour": "ok"}, "times": None,
                           "then": {"behaviour": "ok"}}


def test_each_anomaly_is_decided_in_the_module_named_after_it() -> None:
    modules = {p.stem for p in (ROOT / "reports/checker/anomalies").glob("*.py")} - {"__init__"}
    assert modules == {a.kind for a in ANOMALIES}
    for anomaly in ANOMALIES:
        assert anomaly.module.__name__ == f"skiplock.reports.checker.anomalies.{anomaly.kind}"
        assert anomaly.module.__doc__ and anomaly.module.__doc__.startswith(f"`{anomaly.kind}`")


def test_the_table_is_where_counts_violations_and_meanings_come_from() -> None:
    assert COUNT_KEYS[4:] == tuple(a.kind for a in ANOMALIES)
    assert tuple(a.kind for a in ANOMALIES if a.violation) == VIOLATION_KEYS
    assert {a.kind: a.meaning for a in ANOMALIES} == MEANINGS
    assert {a.unit for a in ANOMALIES} <= {"jobs", "deliveries", "writes", "objectives"}


def early_retry_history(tmp_path: Path) -> Path:
    b = RunBuilder()
    b.enqueue("job-1", script=FAIL_ONCE)
    b.attempt("job-1", 1, claimed=100.0, status=503, behaviour="status")
    b.attempt("job-1", 2, claimed=100.1)
    b.final("job-1", "COMPLETED", attempts=2)
    return b.write(tmp_path / "run")


def test_an_example_carries_its_evidence_as_data(tmp_path: Path) -> None:
    verdict = check_run([early_retry_history(tmp_path)])
    [example] = verdict.examples["early_retry"]
    assert example["case"] == "before_backoff"
    evidence = example["evidence"]
    assert evidence["failed_attempt"] == 1
    assert evidence["received"] == pytest.approx(100.101)
    assert evidence["least_delay"] == pytest.approx(0.5)
    # The sentence is said from the evidence, not the other way round, its times counted
    # from the load's start (0 in a synthetic history).
    module = importlib.import_module("skiplock.reports.checker.anomalies.early_retry")
    with times_from(0.0):
        assert module.say(Example("job-1", example["case"], evidence)) == example["why"]
    assert example["why"].startswith("retry at 100.101 s came")


def test_a_rule_that_breaks_makes_its_own_answer_unknown(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A duplicate the other rules find is still reported; the broken rule's count is not
    made up, and the verdict says which rule failed and why."""
    b = RunBuilder()
    b.enqueue("job-1", script=SUCCEED)
    b.attempt("job-1", 1, claimed=100.0, worker="worker-0")
    b.attempt("job-1", 2, claimed=110.5, worker="worker-1")
    b.final("job-1", "COMPLETED", attempts=2)
    run_dir = b.write(tmp_path / "run")

    def broken(frame: Any, explained: Any) -> Iterator[Example]:
        yield Example("job-1", "x", {})
        raise KeyError("deliberately broken")

    monkeypatch.setattr("skiplock.reports.checker.anomalies.stale_write.find", broken)
    verdict = check_run([run_dir])
    assert verdict.valid is False  # the duplicate still stands
    assert verdict.counts["duplicate_unexplained"] == 1
    assert verdict.counts["stale_write"] == 0
    assert verdict.details["rules_failed"] == {"stale_write": "KeyError: 'deliberately broken'"}
    assert any("the stale_write check failed" in r for r in verdict.unknown_reasons)

    # Alone, a broken rule makes the answer unknown, never valid.
    good = RunBuilder()
    good.enqueue("job-2", script=SUCCEED)
    good.attempt("job-2", 1, claimed=100.0)
    good.final("job-2", "COMPLETED")
    alone = check_run([good.write(tmp_path / "good")])
    assert alone.valid == "unknown"
    assert alone.exit_code == 3


@pytest.mark.parametrize(("run_started", "warmup_start", "said", "iso"), [
    (90.0, None, "retry at 10.101 s came", "1970-01-01T00:01:30.000+00:00"),
    # The warm-up's start is where the report's plots count from: it wins over run.json's.
    (90.0, 99.5, "retry at 0.601 s came", "1970-01-01T00:01:39.500+00:00"),
])
def test_times_a_person_reads_count_from_the_load_start(
        tmp_path: Path, run_started: float, warmup_start: float | None, said: str,
        iso: str) -> None:
    run_dir = early_retry_history(tmp_path)
    run = json.loads((run_dir / "run.json").read_text())
    run["started"] = run_started
    (run_dir / "run.json").write_text(json.dumps(run))
    if warmup_start is not None:
        spec = json.loads((run_dir / "spec.json").read_text())
        spec["phases"] = [{"name": "setup", "start": 80.0, "end": warmup_start},
                          {"name": "warmup", "start": warmup_start, "end": 101.0}]
        (run_dir / "spec.json").write_text(json.dumps(spec))
    verdict = check_run([run_dir])
    [example] = verdict.examples["early_retry"]
    assert example["why"].startswith(said)
    assert example["evidence"]["received"] == pytest.approx(100.101)  # data stays epoch
    assert verdict.details["times"]["load_started"] == iso
