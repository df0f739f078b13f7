"""The live sampler's raw anomaly signals, from hand-written run files."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from skiplock.reports.history import (
    DELIVERIES_DIR,
    DELIVERY_LOG,
    ENQUEUE_LOG,
    ENQUEUES_FILE,
    WORKER_LOG,
    WORKERS_DIR,
    LogWriter,
)
from skiplock.scenarios.run.progress import Sampler, _table


def _delivery(job: str, account: str, in_flight: int) -> dict[str, object]:
    return {"job_id": job, "account": account, "status": 200, "account_in_flight": in_flight}


def test_sampler_counts_what_the_target_log_already_shows(tmp_path: Path) -> None:
    with LogWriter(tmp_path / ENQUEUES_FILE, ENQUEUE_LOG) as enq:
        for job in ("a", "b"):
            enq.write({"type": "invoke", "job_id": job, "max_attempts": 2})
            enq.write({"type": "ok", "job_id": job})
    sampler = Sampler(tmp_path, dsn=None, schema="s", limits={"acme": 2, "free": None})
    with LogWriter(tmp_path / DELIVERIES_DIR / "t.csv", DELIVERY_LOG) as dels:
        dels.write(_delivery("a", "acme", 1))
        dels.write(_delivery("a", "acme", 2))
        dels.write(_delivery("a", "acme", 3))  # third of max 2, and above acme's limit
        dels.write(_delivery("b", "free", 50))  # unlimited account: never over
        dels.write(_delivery("ghost", "acme", 1))  # never invoked
    first = sampler.sample("load")
    # The ghost's invoke might still be written: it is called unexpected once the enqueues
    # have been read again, after its delivery.
    assert (first.unexpected, first.over_attempts, first.over_limit) == (0, 1, 1)
    sample = sampler.sample("load")
    assert (sample.unexpected, sample.over_attempts, sample.over_limit) == (1, 1, 1)
    assert sample.delivered == 5 and sample.enqueued == 2

    values = [str(v) for v in _table(sample, "t").columns[1].cells]
    assert "unexpected 1, over max_attempts 1, in flight over an account's limit 1" in values


def test_a_clean_history_shows_no_anomaly(tmp_path: Path) -> None:
    with LogWriter(tmp_path / ENQUEUES_FILE, ENQUEUE_LOG) as enq:
        enq.write({"type": "invoke", "job_id": "a", "max_attempts": 3})
    with LogWriter(tmp_path / DELIVERIES_DIR / "t.csv", DELIVERY_LOG) as dels:
        dels.write(_delivery("a", "acme", 1))
    sample = Sampler(tmp_path, dsn=None, schema="s", limits={"acme": 1}).sample("load")
    assert (sample.unexpected, sample.over_attempts, sample.over_limit) == (0, 0, 0)


def test_a_line_still_being_written_is_read_once_it_is_whole(tmp_path: Path) -> None:
    # An account id with a comma and a quote: the fields that follow it stay in their columns.
    account = 'a,"b"'
    with LogWriter(tmp_path / ENQUEUES_FILE, ENQUEUE_LOG) as enq:
        enq.write({"type": "invoke", "job_id": "a", "max_attempts": 1, "account": account})
    sampler = Sampler(tmp_path, dsn=None, schema="s", limits={account: 1})
    log = tmp_path / DELIVERIES_DIR / "t.csv"
    with LogWriter(log, DELIVERY_LOG) as dels:
        dels.write(_delivery("a", account, 2))  # above its limit of 1
    line = DELIVERY_LOG.line(_delivery("a", account, 1)).encode()  # over max_attempts 1
    assert account.encode() not in line  # it is quoted

    with log.open("ab") as fh:
        fh.write(line[:5])
    first = sampler.sample("load")
    assert (first.delivered, first.over_limit, first.over_attempts) == (1, 1, 0)
    with log.open("ab") as fh:
        fh.write(line[5:])
    second = sampler.sample("load")
    assert (second.delivered, second.over_limit, second.over_attempts) == (2, 1, 1)
    assert second.delivered_ok == 2 and second.duplicates == 1


def test_a_malformed_line_costs_only_itself(tmp_path: Path) -> None:
    with LogWriter(tmp_path / ENQUEUES_FILE, ENQUEUE_LOG) as enq:
        enq.write({"type": "invoke", "job_id": "a", "max_attempts": 3})
    log = tmp_path / DELIVERIES_DIR / "t.csv"
    with LogWriter(log, DELIVERY_LOG) as dels:
        dels.write(_delivery("a", "acme", 1))
    with log.open("a") as fh:
        fh.write("a,not-a-number\n")
    with LogWriter(log, DELIVERY_LOG) as dels:
        dels.write(_delivery("a", "acme", 1))
    sampler = Sampler(tmp_path, dsn=None, schema="s", limits={"acme": 1})
    assert sampler.sample("load").delivered == 2
    with LogWriter(log, DELIVERY_LOG) as dels:
        dels.write(_delivery("a", "acme", 1))
    assert sampler.sample("load").delivered == 3


def test_a_log_without_a_header_is_not_counted(tmp_path: Path) -> None:
    (tmp_path / DELIVERIES_DIR).mkdir()
    (tmp_path / DELIVERIES_DIR / "t.csv").write_text("a,1\nb,2\n")
    sampler = Sampler(tmp_path, dsn=None, schema="s", limits={})
    assert sampler.sample("load").delivered == 0
    assert sampler.sample("load").delivered == 0


def test_a_delivery_read_before_its_invoke_is_not_unexpected(tmp_path: Path) -> None:
    """The sampler reads the enqueues, then the deliveries: an invoke written in between
    belongs to a delivery read after it, as if the delivery had come first. That delivery
    waits for the next read of the enqueues."""
    LogWriter(tmp_path / ENQUEUES_FILE, ENQUEUE_LOG).close()
    sampler = Sampler(tmp_path, dsn=None, schema="s", limits={})
    with LogWriter(tmp_path / DELIVERIES_DIR / "t.csv", DELIVERY_LOG) as dels:
        dels.write(_delivery("late", "acme", 1))
        dels.write(_delivery("late", "acme", 1))  # over its max_attempts of 1
    first = sampler.sample("load")
    assert (first.delivered, first.unexpected, first.over_attempts) == (2, 0, 0)
    with LogWriter(tmp_path / ENQUEUES_FILE, ENQUEUE_LOG) as enqueues:
        enqueues.write({"type": "invoke", "job_id": "late", "max_attempts": 1})
    second = sampler.sample("load")
    assert (second.delivered, second.unexpected, second.over_attempts) == (2, 0, 1)


def test_the_final_sample_judges_what_still_waits(tmp_path: Path) -> None:
    LogWriter(tmp_path / ENQUEUES_FILE, ENQUEUE_LOG).close()
    with LogWriter(tmp_path / DELIVERIES_DIR / "t.csv", DELIVERY_LOG) as dels:
        dels.write(_delivery("ghost", "acme", 1))
    sampler = Sampler(tmp_path, dsn=None, schema="s", limits={})
    assert sampler.sample("done", final=True).unexpected == 1


def test_completed_and_failed_come_from_the_workers_applied_writes(tmp_path: Path) -> None:
    with LogWriter(tmp_path / ENQUEUES_FILE, ENQUEUE_LOG) as enq:
        for job, allowed in (("ok", 3), ("perm", 3), ("last", 2), ("again", 2), ("gone", 3)):
            enq.write({"type": "invoke", "job_id": job, "max_attempts": allowed})

    def write(job: str, attempt: int, outcome: str, result: str = "applied") -> dict[str, Any]:
        return {"kind": "write", "worker": "w", "time": 1.0, "job_id": job,
                "attempt": attempt, "data": {"outcome": outcome, "result": result}}

    with LogWriter(tmp_path / WORKERS_DIR / "w.csv", WORKER_LOG) as log:
        log.write(write("ok", 1, "success"))
        log.write(write("perm", 1, "permanent"))
        log.write(write("last", 2, "transient"))  # its last attempt: dead letter
        log.write(write("again", 1, "transient"))  # will be retried
        log.write(write("gone", 1, "success", result="fenced"))  # not this worker's to write
    sample = Sampler(tmp_path, dsn=None, schema="s").sample("load")
    assert (sample.completed, sample.failed) == (1, 2)
