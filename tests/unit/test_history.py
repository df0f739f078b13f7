"""The CSV logs of the run directory: what a writer puts on a line is what a reader gets back,
whatever the text holds, and a log that is damaged or foreign is refused, never half read."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from skiplock.reports.history import (
    DELIVERY_LOG,
    ENQUEUE_LOG,
    FINAL_JOBS_LOG,
    WORKER_LOG,
    Delivery,
    EnqueueOp,
    HistoryError,
    LogWriter,
    WorkerEvent,
    read_log,
    to_record,
    worker_event_line,
    worker_event_record,
)

SCRIPT = {"name": "fail-then-ok", "first": {"behaviour": "status", "status": 503}, "times": 2,
          "then": {"behaviour": "ok"}}


def test_enqueue_round_trip_rebuilds_the_script(tmp_path: Path) -> None:
    path = tmp_path / "enqueues.csv"
    invoke = EnqueueOp(type="invoke", job_id="j-1", time=1.25, process="producer-0",
                       account="acct-1", target_url="http://127.0.0.1:9/deliver",
                       script=SCRIPT, max_attempts=3)
    answer = EnqueueOp(type="info", job_id="j-1", time=1.5, process="producer-0",
                       error='server closed, "unexpectedly"\nduring COMMIT')
    with LogWriter(path, ENQUEUE_LOG) as writer:
        writer.write(invoke)
        writer.write(answer)
    assert list(read_log(path, ENQUEUE_LOG)) == [to_record(invoke), to_record(answer)]
    assert path.read_text().splitlines()[0].startswith("type,job_id,time,")
    assert len(path.read_text().splitlines()) == 3  # the line break stayed inside its field


def test_worker_event_fields_become_columns_and_come_back(tmp_path: Path) -> None:
    path = tmp_path / "worker-0.csv"
    events = [
        WorkerEvent(kind="start", worker="worker-0", time=1.0, data={"pid": 4242}),
        WorkerEvent(kind="claim", worker="worker-0", time=1.5, job_id="j", attempt=1,
                    data={"lease_token": "t-1", "locked_until": "2026-11-30T04:00:10+00:00"}),
        WorkerEvent(kind="http", worker="worker-0", time=2.0, job_id="j", attempt=1,
                    data={"start": 1.5, "end": 2.0, "result": "ok", "status": 200}),
        WorkerEvent(kind="renew", worker="worker-0", time=2.5, job_id="j", attempt=1,
                    data={"lost": True}),
        WorkerEvent(kind="write", worker="worker-0", time=3.0, job_id="j", attempt=1,
                    data={"outcome": "success", "result": "applied", "started": 2.9}),
        WorkerEvent(kind="recover", worker="worker-0", time=3.5, data={"count": 2}),
        WorkerEvent(kind="failpoint", worker="worker-0", time=4.0, job_id="j", attempt=2,
                    data={"name": "crash_after_http"}),
        WorkerEvent(kind="stop", worker="worker-0", time=5.0, data={"reason": "drained"}),
    ]
    with LogWriter(path, WORKER_LOG) as writer:
        for event in events:
            writer.write(event)
    assert list(read_log(path, WORKER_LOG)) == [to_record(e) for e in events]


def test_a_field_without_a_column_is_refused(tmp_path: Path) -> None:
    with LogWriter(tmp_path / "w.csv", WORKER_LOG) as writer, \
            pytest.raises(ValueError, match=r"no column.*'surprise'"):
        writer.write(WorkerEvent(kind="start", worker="w", time=1.0, data={"surprise": 1}))


def test_final_jobs_keep_extra_as_json(tmp_path: Path) -> None:
    path = tmp_path / "final_jobs.csv"
    row = {"job_id": "j", "account_id": "a", "status": "FAILED", "attempts": 3,
           "max_attempts": 3, "last_error": "HTTP 400", "locked_until": None,
           "next_attempt_at": 12.5, "extra": {"priority": 1, "tags": ["x", "y"]}}
    with LogWriter(path, FINAL_JOBS_LOG) as writer:
        writer.write(row)
    assert list(read_log(path, FINAL_JOBS_LOG)) == [row]


text = st.text(st.characters(blacklist_categories=("Cs",)), min_size=1)


@settings(max_examples=500)
@given(job_id=text, account=text, worker=text, behaviour=text)
def test_any_text_reads_back_exactly(tmp_path_factory: pytest.TempPathFactory,
                                           job_id: str, account: str, worker: str,
                                           behaviour: str) -> None:
    path = tmp_path_factory.mktemp("log") / "target-0.csv"
    delivery = Delivery(job_id=job_id, attempt=1, account=account, worker=worker,
                        target="target-0", received=1.0, answered=None, status=None,
                        behaviour=behaviour, seen=1, account_in_flight=1)
    with LogWriter(path, DELIVERY_LOG) as writer:
        writer.write(delivery)
    assert list(read_log(path, DELIVERY_LOG)) == [to_record(delivery)]


def test_a_file_of_another_format_is_not_appended_to(tmp_path: Path) -> None:
    path = tmp_path / "log.csv"
    LogWriter(path, DELIVERY_LOG).close()
    with pytest.raises(HistoryError, match="other columns"):
        LogWriter(path, WORKER_LOG)
    assert path.read_text() == DELIVERY_LOG.header()


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("", None),
        ("job_id,attempt\n" "a,1\n" "b,2", r"log\.csv:3 is truncated mid-line"),
        ("job_id,attempt\n" "a,1,extra\n", r"log\.csv:2 has 3 fields, the header 2"),
        ("job_id,attempt\n" "a,one\n", r"log\.csv:2: delivery field attempt is not a number"),
        ("what,ever\n" "a,1\n", r"log\.csv:1 is not a header of delivery columns"),
        ('job_id,attempt\n' '"a,1\n', r"log\.csv:2 (is not a CSV line|has 1 fields)"),
    ],
)
def test_damaged_logs_name_the_line(tmp_path: Path, content: str, message: str | None) -> None:
    path = tmp_path / "log.csv"
    path.write_text(content)
    if message is None:
        assert list(read_log(path, DELIVERY_LOG)) == []
        return
    with pytest.raises(HistoryError, match=message):
        list(read_log(path, DELIVERY_LOG))


def test_columns_are_found_by_name(tmp_path: Path) -> None:
    """Another writer's column order, an unknown column and a missing one all read."""
    path = tmp_path / "log.csv"
    path.write_text("status,job_id,future_column\n200,a,x\n\n")
    [row] = read_log(path, DELIVERY_LOG)
    assert row["job_id"] == "a" and row["status"] == 200 and row["attempt"] is None
    assert "future_column" not in row


_WRITE_MANY = """
import sys
from pathlib import Path
from skiplock.reports.history import ENQUEUE_LOG, EnqueueOp, LogWriter
name, count = sys.argv[1], int(sys.argv[2])
with LogWriter(Path(sys.argv[3]), ENQUEUE_LOG) as writer:
    for i in range(count):
        writer.write(EnqueueOp(type="ok", job_id=f"{name}-{i}", time=float(i), process=name))
"""


def test_processes_opening_one_log_at_once_write_one_header(tmp_path: Path) -> None:
    path = tmp_path / "enqueues.csv"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    procs = [subprocess.Popen([sys.executable, "-c", _WRITE_MANY, f"p{n}", "500", str(path)],
                              env=env) for n in range(4)]
    assert [p.wait(timeout=60) for p in procs] == [0, 0, 0, 0]
    assert path.read_text().count("type,job_id") == 1
    rows: list[dict[str, Any]] = list(read_log(path, ENQUEUE_LOG))
    assert sorted(r["job_id"] for r in rows) == sorted(f"p{n}-{i}" for n in range(4)
                                                       for i in range(500))


@pytest.mark.parametrize("text", ["C:\\new\\table", "corp\\north", "a\rb", "a\r\nb", "\\",
                                  "trailing\\", "\\n", "\\\\n", "tab\there"])
def test_backslashes_and_line_breaks_read_back_exactly(tmp_path: Path, text: str) -> None:
    path = tmp_path / "w.csv"
    event = WorkerEvent(kind="write", worker="w", time=1.0, job_id="j", attempt=1,
                        data={"error": text, "result": "info"})
    with LogWriter(path, WORKER_LOG) as writer:
        writer.write(event)
    assert len(path.read_text().splitlines()) == 2
    assert list(read_log(path, WORKER_LOG)) == [to_record(event)]


def test_numbers_are_exact_and_ascii(tmp_path: Path) -> None:
    path = tmp_path / "log.csv"
    big = 2**63 + 1
    path.write_text(f"job_id,attempt,received\na,{big},1e-07\n")
    [row] = read_log(path, DELIVERY_LOG)
    assert (row["attempt"], row["received"]) == (big, 1e-07)
    # As Arrow reads them, so that the checker's two paths agree.
    for text, value in ((" 100.0 ", 100.0), ("Infinity", math.inf), ("-inf", -math.inf),
                        ("1" * 400, math.inf), (".5", 0.5), ("+1E+05", 1e5)):
        path.write_text(f"job_id,received\na,{text}\n")
        assert next(read_log(path, DELIVERY_LOG))["received"] == value
    for bad in ("1_0", "\u0661", "0x10", "1,5"):
        path.write_text(f'job_id,attempt\na,"{bad}"\n')
        with pytest.raises(HistoryError, match="attempt is not a number"):
            list(read_log(path, DELIVERY_LOG))


@pytest.mark.parametrize(("field", "value"), [("attempt", True), ("attempt", "3"),
                                              ("received", "soon")])
def test_a_value_of_the_wrong_kind_is_not_written(tmp_path: Path, field: str,
                                                  value: Any) -> None:
    record = {"job_id": "a", "target": "t", "received": 1.0, "behaviour": "ok", field: value}
    with LogWriter(tmp_path / "log.csv", DELIVERY_LOG) as writer, \
            pytest.raises(ValueError, match="is not a number"):
        writer.write(record)


def test_a_header_with_a_byte_order_mark_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "log.csv"
    path.write_text("\ufeffjob_id,attempt\na,1\n")
    with pytest.raises(HistoryError, match="byte-order mark"):
        list(read_log(path, DELIVERY_LOG))


def test_a_log_cut_off_mid_line_is_not_appended_to(tmp_path: Path) -> None:
    path = tmp_path / "w.csv"
    with LogWriter(path, WORKER_LOG) as writer:
        writer.write(WorkerEvent(kind="start", worker="w", time=1.0, data={"pid": 1}))
    cut = path.read_bytes() + b"c"
    path.write_bytes(cut)
    with pytest.raises(HistoryError, match="cut off mid-line"):
        LogWriter(path, WORKER_LOG)
    assert path.read_bytes() == cut


_APPEND_MANY = """
import sys
from pathlib import Path
from skiplock.reports.history import ENQUEUE_LOG, EnqueueOp, LogWriter
with LogWriter(Path(sys.argv[2]), ENQUEUE_LOG) as writer:
    for i in range(5000):
        writer.write(EnqueueOp(type="ok", job_id=f"{sys.argv[1]}-{i}-" + "x" * 200,
                               time=1.0, process="p"))
"""


def test_a_log_being_appended_to_is_not_taken_for_cut_off(tmp_path: Path) -> None:
    """Opening a log while other processes append to it may catch an append halfway: that
    is a live writer, not a line cut off by a crash."""
    path = tmp_path / "enqueues.csv"
    LogWriter(path, ENQUEUE_LOG).close()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    procs = [subprocess.Popen([sys.executable, "-c", _APPEND_MANY, f"p{n}", str(path)],
                              env=env) for n in range(2)]
    opened = 0
    while any(p.poll() is None for p in procs):
        LogWriter(path, ENQUEUE_LOG).close()
        opened += 1
    assert [p.wait() for p in procs] == [0, 0]
    assert opened > 0
    assert len(list(read_log(path, ENQUEUE_LOG))) == 10000


def test_write_json_writes_into_a_device_instead_of_replacing_it(tmp_path: Path) -> None:
    """`--out /dev/null` for a benchmark: as root, a rename over it would leave a regular
    file where the device was (and break every program that writes to /dev/null)."""
    import stat

    from skiplock.reports.history import write_json

    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    try:
        write_json(fifo, {"a": 1})
        assert stat.S_ISFIFO(fifo.stat().st_mode)
        assert b'"a": 1' in os.read(reader, 1000)
    finally:
        os.close(reader)
    write_json(Path("/dev/null"), {"a": 1})
    assert stat.S_ISCHR(Path("/dev/null").stat().st_mode)


_EVENT_VALUES = st.one_of(
    st.none(), st.integers(-10, 10**6), st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=12), st.booleans())


@settings(max_examples=300, deadline=None)
@given(fields=st.dictionaries(
    st.sampled_from([*WORKER_LOG.names, "data", "nonsense"]), _EVENT_VALUES, max_size=8))
def test_a_worker_event_line_is_the_records_line(fields: dict[str, Any]) -> None:
    """The workers' fast line is the line of the record it stands for, or the same refusal."""
    def made(make: Any) -> str:
        try:
            return str(make())
        except (ValueError, TypeError) as exc:
            return f"refused: {type(exc).__name__}: {exc}"

    kind, worker, when = "claim", "worker-0", 1733450000.123456
    fast = made(lambda: worker_event_line(kind, worker, when, fields))
    slow = made(lambda: WORKER_LOG.line(worker_event_record(kind, worker, when, fields)))
    assert fast == slow


def test_the_dispatchers_events_make_the_same_lines_both_ways() -> None:
    import uuid
    from datetime import UTC, datetime

    from skiplock.queue_impl.events import (
        Call,
        claim_event,
        http_event,
        release_event,
        renew_event,
        write_event,
    )
    from skiplock.queue_impl.interface import Lease, Outcome

    lease = Lease(job_id=uuid.uuid4(), account_id="acct", target_url="http://127.0.0.1:9/",
                  payload={}, attempt=2, max_attempts=3, lease_token=uuid.uuid4(),
                  locked_until=datetime.now(UTC), worker_id="worker-0")
    call = Call(result="http_error", outcome=Outcome.TRANSIENT, status=503,
                error='HTTP 503, "busy"\nretry', start=1.5, end=2.25)
    events = [("claim", claim_event(lease, started=1.25)), ("http", http_event(lease, call)),
              ("write", write_event(lease, Outcome.TRANSIENT, "applied", call.error, 2.5)),
              ("release", release_event(lease, "fenced", "lease too short to send")),
              ("renew", renew_event(lease, None)), ("start", {"pid": 42}),
              ("error", {"op": "claim", "error": "OperationalError: gone"})]
    for kind, fields in events:
        assert worker_event_line(kind, "worker-0", 3.0, fields) == WORKER_LOG.line(
            worker_event_record(kind, "worker-0", 3.0, fields)), kind


def test_a_batch_of_events_is_logged_as_the_same_events_one_by_one(tmp_path: Path) -> None:
    from skiplock.queue_impl.events import emitter_of_many
    from skiplock.scenarios.run.workers import LogSink

    events = [{"job_id": f"j-{i}", "attempt": 1, "lease_token": f"t-{i}", "started": 1.5}
              for i in range(3)]
    apart, together = tmp_path / "apart.csv", tmp_path / "together.csv"
    with LogWriter(apart, WORKER_LOG) as writer:
        sink = LogSink(writer, "worker-0")
        for fields in events:
            sink("claim", fields)
    with LogWriter(together, WORKER_LOG) as writer:
        emitter_of_many(LogSink(writer, "worker-0"))("claim", events)

    def without_time(path: Path) -> list[dict[str, Any]]:
        return [{k: v for k, v in row.items() if k != "time"}
                for row in read_log(path, WORKER_LOG)]

    assert without_time(together) == without_time(apart) and len(without_time(apart)) == 3
    # A sink that takes one event at a time gets them one at a time.
    seen: list[tuple[str, Any]] = []
    emitter_of_many(lambda kind, fields: seen.append((kind, fields)))("claim", events)
    assert seen == [("claim", fields) for fields in events]
