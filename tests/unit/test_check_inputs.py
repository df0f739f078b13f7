"""What the checker will not judge: a history it cannot trust is bad input (`HistoryError`,
exit 2) or unknown (exit 3), never a violation (exit 1) and never valid.

Bad input: the same run directory (or log) given twice, a file that is missing, unreadable or
not a regular file, no delivery log at all, a NUL byte in a whole line, an infinite number or a
negative time in a log, run.json settings of the wrong type. Unknown: a log cut off mid-line
(or empty, cut before its header), whose lost tail may hide the records that decide some
anomalies: those are counted but not reported; and a run in which nothing was enqueued.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from skiplock.reports.checker import CUT_MAY_CAUSE, VIOLATION_KEYS, Verdict, check_run
from skiplock.reports.history import ENQUEUE_LOG, WORKER_LOG, HistoryError, read_json
from skiplock.reports.synthetic import RunBuilder

SUCCEED: dict[str, Any] = {"name": "succeed", "first": {"behaviour": "ok"}, "times": None,
                           "then": {"behaviour": "ok"}}
JOB = "job-1"


def succeed_once(b: RunBuilder, job: str, at: float, **kw: Any) -> None:
    b.enqueue(job, script=SUCCEED, time=at - 0.5)
    b.attempt(job, 1, claimed=at, **kw)
    b.final(job, "COMPLETED")


def good_run(tmp_path: Path) -> Path:
    b = RunBuilder()
    succeed_once(b, "a", 100.0)
    succeed_once(b, "b", 101.0)
    return b.write(tmp_path / "run")


def cut_last_line(path: Path, *, keep: int = 7) -> None:
    """Cut a log inside its last line, as a writer killed mid-write leaves it: the line's
    first `keep` bytes stay, without their line break."""
    data = path.read_bytes()
    start = data.rstrip(b"\n").rfind(b"\n") + 1
    path.write_bytes(data[: start + keep])


def append(path: Path, text: str | bytes) -> None:
    with path.open("ab") as fh:
        fh.write(text.encode() if isinstance(text, str) else text)


def not_judged(verdict: Verdict) -> dict[str, int]:
    return dict(verdict.details.get("not_judged", {}))


# --------------------------------------------------------------------------------------------
# The same directory or log twice.
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("again", ["same", "slash", "symlink", "dot"])
def test_a_run_directory_given_twice_is_refused(tmp_path: Path, again: str) -> None:
    run_dir = good_run(tmp_path)
    second = {"same": run_dir, "slash": Path(f"{run_dir}/"), "dot": run_dir / ".",
              "symlink": tmp_path / "link"}[again]
    if again == "symlink":
        second.symlink_to(run_dir)
    with pytest.raises(HistoryError, match=r"^RUN_DIR given twice: "):
        check_run([run_dir, second])


@pytest.mark.parametrize("how", ["symlinked directory", "hard link"])
def test_a_log_reached_through_two_directories_is_refused(tmp_path: Path, how: str) -> None:
    run_dir = good_run(tmp_path)
    other = tmp_path / "other"
    other.mkdir()
    if how == "hard link":
        (other / "workers").mkdir()
        os.link(run_dir / "workers" / "worker-0.csv", other / "workers" / "w.csv")
    else:
        (other / "deliveries").symlink_to(run_dir / "deliveries")
    with pytest.raises(HistoryError, match=r"^a log given twice: .* is the same file as "):
        check_run([run_dir, other])


@pytest.mark.parametrize("tolerance", [math.nan, math.inf, -math.inf, -0.1])
def test_a_tolerance_that_is_not_finite_or_is_negative_is_refused(
        tmp_path: Path, tolerance: float) -> None:
    with pytest.raises(ValueError, match="tolerance_seconds must be finite and >= 0"):
        check_run([good_run(tmp_path)], tolerance_seconds=tolerance)


# --------------------------------------------------------------------------------------------
# Logs cut off: unknown, with what their lost tail may have caused counted, not reported.
# --------------------------------------------------------------------------------------------


def test_cut_enqueues_make_deliveries_unjudged_not_unexpected(tmp_path: Path) -> None:
    """The invoke of job b was being written when the producer died: b's delivery is not
    unexpected, its enqueue is in the lost tail."""
    b = RunBuilder()
    succeed_once(b, "a", 100.0)
    b.attempt("b", 1, claimed=101.0)
    b.final("b", "COMPLETED")
    b.enqueue("b", script=SUCCEED, time=100.9, answer=None)
    run_dir = b.write(tmp_path / "run")
    log = run_dir / "enqueues.csv"
    cut_last_line(log)
    verdict = check_run([run_dir])
    assert verdict.valid == "unknown"
    assert verdict.exit_code == 3
    assert verdict.counts["unexpected"] == 1
    assert not_judged(verdict) == {"unexpected": 1}
    assert f"{log} is truncated mid-line" in verdict.unknown_reasons
    assert (f"not judged: 1 unexpected: {log} was cut off and may have lost the records "
            "that decide them") in verdict.unknown_reasons


def test_cut_target_log_makes_jobs_unjudged_not_lost(tmp_path: Path) -> None:
    run_dir = good_run(tmp_path)
    cut_last_line(run_dir / "deliveries" / "target-0.csv")
    verdict = check_run([run_dir])
    assert verdict.valid == "unknown"
    assert verdict.counts["delivered"] == 1
    assert not_judged(verdict) == {"lost": 1, "state_mismatch": 1}


def test_cut_worker_log_may_hide_what_explains_a_duplicate(tmp_path: Path) -> None:
    """worker-0's log lost its tail: the failpoint that would explain the redelivery may
    have been in it."""
    b = RunBuilder()
    b.enqueue(JOB, script=SUCCEED)
    b.attempt(JOB, 1, claimed=100.0, worker="worker-0", write=None)
    b.attempt(JOB, 2, claimed=110.5, worker="worker-1")
    b.final(JOB, "COMPLETED", attempts=2)
    run_dir = b.write(tmp_path / "run")
    append(run_dir / "workers" / "worker-0.csv", "failpoint,worker-0,100.02,job-")
    verdict = check_run([run_dir])
    assert verdict.valid == "unknown"
    assert not_judged(verdict) == {"duplicate_unexplained": 1}


def test_cut_nemesis_may_hide_the_fault_that_explains_a_duplicate(tmp_path: Path) -> None:
    b = RunBuilder()
    b.enqueue(JOB, script=SUCCEED)
    b.attempt(JOB, 1, claimed=100.0, worker="worker-0", write=None)
    b.attempt(JOB, 2, claimed=110.5, worker="worker-1")
    b.final(JOB, "COMPLETED", attempts=2)
    run_dir = b.write(tmp_path / "run")
    append(run_dir / "nemesis.jsonl", '{"fault":"kill_worker","start":100.2,"en')
    verdict = check_run([run_dir])
    assert verdict.valid == "unknown"
    assert not_judged(verdict) == {"duplicate_unexplained": 1}


def _stale_write(b: RunBuilder) -> str:
    b.enqueue(JOB, script=SUCCEED)
    b.event("claim", "worker-0", 100.0, job_id=JOB, attempt=1, locked_until=110.0)
    b.deliver(JOB, attempt=1, received=100.001, answered=100.011, worker="worker-0")
    b.fault("pause_worker", 100.05, 115.0, target="worker-0")
    b.attempt(JOB, 2, claimed=111.0, worker="worker-1")
    b.event("write", "worker-0", 115.1, job_id=JOB, attempt=1, outcome="success",
            result="applied", error=None)
    b.final(JOB, "COMPLETED", attempts=2)
    return "workers/worker-1.csv"


def _concurrent(b: RunBuilder) -> str:
    b.enqueue(JOB, script=SUCCEED)
    b.attempt(JOB, 1, claimed=100.0, worker="worker-0", latency=0.5)
    b.attempt(JOB, 1, claimed=100.1, worker="worker-1", status=503, behaviour="status",
              write="fenced")
    b.final(JOB, "COMPLETED")
    succeed_once(b, "later", 120.0)
    return "deliveries/target-0.csv"


def _stuck(b: RunBuilder) -> str:
    b.enqueue("orphan", script=SUCCEED)
    b.final("orphan", "PROCESSING")
    b.enqueue("cut", script=SUCCEED)
    b.final("cut", "PENDING")
    return "final_jobs.csv"


def _over_limit(b: RunBuilder) -> str:
    for n in range(2):
        b.enqueue(f"j{n}", script=SUCCEED)
        b.attempt(f"j{n}", 1, claimed=100.0 + n * 0.1, latency=0.5, worker=f"worker-{n}")
        b.final(f"j{n}", "COMPLETED")
    b.fault("pin_xmin", 90.0, 95.0)
    b.fault("pin_xmin", 130.0, 131.0)
    return "nemesis.jsonl"


@pytest.mark.parametrize(
    ("history", "kind", "limit"),
    [(_stale_write, "stale_write", None), (_concurrent, "concurrent_delivery", None),
     (_stuck, "stuck", None), (_over_limit, "limit_exceeded", 1)],
)
def test_violations_a_cut_log_cannot_cause_are_reported(
        tmp_path: Path, history: Callable[[RunBuilder], str], kind: str,
        limit: int | None) -> None:
    """A stale write needs only two recorded events, a concurrent delivery two recorded
    deliveries, a stuck job its own final row, an account over its limit deliveries no fault
    excuses: what a lost tail held cannot undo them."""
    b = RunBuilder(account_limits={"acct-0": limit})
    cut = history(b)
    run_dir = b.write(tmp_path / "run")
    cut_last_line(run_dir / cut)
    verdict = check_run([run_dir])
    assert verdict.valid is False
    assert verdict.exit_code == 1
    assert verdict.counts[kind] >= 1
    assert kind not in not_judged(verdict)
    assert f"{run_dir / cut} is truncated mid-line" in verdict.unknown_reasons


def test_an_empty_log_was_cut_off_before_its_header(tmp_path: Path) -> None:
    run_dir = good_run(tmp_path)
    log = run_dir / "workers" / "worker-7.csv"
    log.write_bytes(b"")
    verdict = check_run([run_dir])
    assert verdict.valid == "unknown"
    assert verdict.unknown_reasons == (f"{log} is empty: it was cut off before its header",)


def test_an_empty_enqueues_log_makes_deliveries_unjudged(tmp_path: Path) -> None:
    run_dir = good_run(tmp_path)
    (run_dir / "enqueues.csv").write_bytes(b"")
    verdict = check_run([run_dir])
    assert verdict.valid == "unknown"
    assert not_judged(verdict) == {"unexpected": 2}


def test_deliveries_when_nothing_was_enqueued_are_unknown(tmp_path: Path) -> None:
    """The producers' enqueues.csv may be in a directory not given: unknown, not 2 unexpected
    deliveries."""
    run_dir = good_run(tmp_path)
    (run_dir / "enqueues.csv").write_text(ENQUEUE_LOG.header())
    verdict = check_run([run_dir])
    assert verdict.valid == "unknown"
    assert not_judged(verdict) == {"unexpected": 2}
    assert ("not judged: 2 unexpected: nothing was enqueued (its enqueues.csv may be in a "
            "directory not given)") in verdict.unknown_reasons


def test_cut_table_covers_every_log_and_never_reports_unexpected_or_lost() -> None:
    assert set(CUT_MAY_CAUSE) == {"enqueues.csv", "deliveries", "workers", "nemesis.jsonl",
                                   "final_jobs.csv"}
    for kinds in CUT_MAY_CAUSE.values():
        assert kinds <= set(VIOLATION_KEYS)
        assert {"unexpected", "lost"} <= kinds


# --------------------------------------------------------------------------------------------
# NUL bytes: damage, never a record.
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "line"),
    [("workers/worker-0.csv", 3), ("deliveries/target-0.csv", 2), ("enqueues.csv", 3),
     ("final_jobs.csv", 2)],
)
def test_a_nul_byte_in_a_log_is_refused_naming_the_line(tmp_path: Path, name: str,
                                                         line: int) -> None:
    run_dir = good_run(tmp_path)
    path = run_dir / name
    lines = path.read_bytes().split(b"\n")
    lines[line - 1] = lines[line - 1].replace(b"a", b"a\x00", 1)
    path.write_bytes(b"\n".join(lines))
    with pytest.raises(HistoryError, match=rf"{name}:{line} holds a NUL byte"):
        check_run([run_dir])


def test_a_nul_byte_in_nemesis_is_refused(tmp_path: Path) -> None:
    run_dir = good_run(tmp_path)
    (run_dir / "nemesis.jsonl").write_bytes(b'{"fault":"pin_xmin","start":1.0,"end":2.0}\n'
                                            b'{"fault":"pin\x00_xmin","start":1.0}\n')
    with pytest.raises(HistoryError, match=r"nemesis\.jsonl:2 holds a NUL byte"):
        check_run([run_dir])


def test_a_nul_byte_in_a_line_read_line_by_line_is_refused(tmp_path: Path) -> None:
    """A blank line sends the file to the line-by-line reader: the NUL is refused there too."""
    run_dir = good_run(tmp_path)
    log = run_dir / "workers" / "worker-0.csv"
    append(log, "\n")
    append(log, WORKER_LOG.line({"kind": "stop", "worker": "worker-0", "time": 200.0,
                                 "data": {"reason": "do\x00ne"}}))
    with pytest.raises(HistoryError, match=r"worker-0\.csv:\d+ holds a NUL byte"):
        check_run([run_dir])


def test_nul_bytes_in_a_cut_last_line_are_part_of_the_cut(tmp_path: Path) -> None:
    """A file system may leave zeros where a crash cut the last write: still a cut log."""
    run_dir = good_run(tmp_path)
    log = run_dir / "workers" / "worker-0.csv"
    append(log, b"\x00" * 64)
    verdict = check_run([run_dir])
    assert verdict.valid == "unknown"
    assert verdict.unknown_reasons == (f"{log} is truncated mid-line",)


# --------------------------------------------------------------------------------------------
# Values no writer writes.
# --------------------------------------------------------------------------------------------


def _rewrite(name: str, old: str, new: str) -> Callable[[Path], None]:
    def damage(run_dir: Path) -> None:
        path = run_dir / name
        text = path.read_text()
        assert old in text
        path.write_text(text.replace(old, new, 1))

    return damage


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (_rewrite("deliveries/target-0.csv", "100.001", "inf"),
         r"target-0\.csv:2: delivery field received is inf, not a time"),
        (_rewrite("deliveries/target-0.csv", "100.001", "-100.001"),
         r"target-0\.csv:2: delivery field received is -100\.001, not a time"),
        (_rewrite("deliveries/target-0.csv", "100.001", "1e999"),
         r"target-0\.csv:2: delivery field received is inf"),
        (_rewrite("deliveries/target-0.csv", ",1,acct-0", ",inf,acct-0"),
         r"target-0\.csv:2: delivery field attempt is inf, not a finite number"),
        (_rewrite("workers/worker-0.csv", "claim,worker-0,100.0", "claim,worker-0,-1"),
         r"worker-0\.csv:2: worker event field time is -1\.0, not a time"),
        (lambda d: append(d / "workers" / "worker-0.csv", WORKER_LOG.line(
            {"kind": "http", "worker": "worker-0", "time": 150.0, "job_id": "a",
             "attempt": 1, "data": {"result": "ok", "end": math.inf}})),
         r"worker-0\.csv:8: worker event field end is inf, not a time"),
        (_rewrite("enqueues.csv", ",3,,,succeed", ",2000000,,,succeed"),
         r"enqueues\.csv:2: invoke needs max_attempts >= 1 \(a whole number, at most"),
        (_rewrite("enqueues.csv", ",ok,,,ok", ",status,inf,,ok"), r"unreadable script"),
    ],
)
def test_numbers_no_writer_writes_are_refused(tmp_path: Path, damage: Callable[[Path], None],
                                              message: str) -> None:
    run_dir = good_run(tmp_path)
    damage(run_dir)
    with pytest.raises(HistoryError, match=message):
        check_run([run_dir])


def _run_json(**changes: Any) -> Callable[[Path], None]:
    def damage(run_dir: Path) -> None:
        info = json.loads((run_dir / "run.json").read_text())
        (run_dir / "run.json").write_text(json.dumps({**info, **changes}))

    return damage


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (_run_json(http_timeout_seconds="2"), "http_timeout_seconds must be a finite number"),
        (_run_json(http_timeout_seconds=True), "http_timeout_seconds must be a finite number"),
        (_run_json(lease_seconds=math.inf), "lease_seconds must be a finite number, not inf"),
        (_run_json(retry_base_seconds=math.nan), "retry_base_seconds must be a finite number"),
        (_run_json(retry_jitter=10**400), "retry_jitter must be a finite number"),
        (_run_json(account_limits={"acct-0": 10**400}), "account_limits must map accounts"),
        (_run_json(exit_reason=None), "exit_reason must be a string"),
        (_run_json(durable="no"), "durable must be true, false or null"),
        (lambda d: (d / "spec.json").write_text(
            '{"postgres": {"harness": {"durable": "off"}}}'),
         r"spec\.json: postgres\.harness\.durable must be true, false or null"),
        (lambda d: (d / "run.json").write_bytes(b'{"drained": "\xff"}'), "is not UTF-8"),
        (lambda d: (d / "run.json").write_text("[" * 100_000), "is nested too deeply"),
        (lambda d: (d / "nemesis.jsonl").write_text("[" * 100_000 + "\n"),
         r"nemesis\.jsonl:1 is nested too deeply"),
    ],
)
def test_run_settings_of_the_wrong_type_are_refused(
        tmp_path: Path, damage: Callable[[Path], None], message: str) -> None:
    run_dir = good_run(tmp_path)
    damage(run_dir)
    with pytest.raises(HistoryError, match=message):
        check_run([run_dir])


# --------------------------------------------------------------------------------------------
# Files that are not there, not files, or not readable.
# --------------------------------------------------------------------------------------------


def _replace(name: str, make: Callable[[Path], None]) -> Callable[[Path], None]:
    def damage(run_dir: Path) -> None:
        path = run_dir / name
        if path.exists():
            path.unlink()
        make(path)

    return damage


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (_replace("enqueues.csv", Path.mkdir),
         r"enqueues\.csv is a directory: a history file must be a regular file"),
        (_replace("workers/worker-0.csv", os.mkfifo), r"worker-0\.csv is not a regular file"),
        (_replace("deliveries/target-0.csv", lambda p: p.symlink_to("/dev/null")),
         r"target-0\.csv is not a regular file"),
        (_replace("nemesis.jsonl", lambda p: p.symlink_to(p.parent / "gone")),
         r"nemesis\.jsonl is a symbolic link to nothing"),
        (_replace("final_jobs.csv", lambda p: p.symlink_to(p)),
         r"final_jobs\.csv cannot be read"),
        (_replace("deliveries/target-0.csv", lambda p: None),
         r"deliveries/ holds no delivery log \(\*\.csv\), nor does any other directory"),
        (_replace("workers/w.csv", Path.mkdir), r"workers/w\.csv is a directory"),
    ],
)
def test_what_is_not_a_readable_regular_file_is_refused(
        tmp_path: Path, damage: Callable[[Path], None], message: str) -> None:
    run_dir = good_run(tmp_path)
    damage(run_dir)
    with pytest.raises(HistoryError, match=message):
        check_run([run_dir])


def _unreadable(path: Path) -> None:
    path.chmod(0)
    if os.access(path, os.R_OK):  # root reads anything
        path.chmod(0o755 if path.is_dir() else 0o644)
        pytest.skip("permissions do not hold for this user (root)")


@pytest.mark.parametrize(
    ("name", "message"),
    [("workers/worker-0.csv", r"worker-0\.csv cannot be read \(Permission denied\)"),
     ("run.json", r"run\.json cannot be read \(Permission denied\)"),
     ("deliveries", r"deliveries/ cannot be listed \(Permission denied\)")],
)
def test_unreadable_files_are_refused(tmp_path: Path, name: str, message: str) -> None:
    run_dir = good_run(tmp_path)
    _unreadable(run_dir / name)
    try:
        with pytest.raises(HistoryError, match=message):
            check_run([run_dir])
    finally:
        (run_dir / name).chmod(0o755)


def test_read_json_names_what_is_wrong(tmp_path: Path) -> None:
    path = tmp_path / "x.json"
    with pytest.raises(HistoryError, match=r"x\.json is missing"):
        read_json(path)
    path.mkdir()
    with pytest.raises(HistoryError, match=r"x\.json cannot be read \(Is a directory\)"):
        read_json(path)
    path.rmdir()
    path.write_bytes(b"\xfe\xff")
    with pytest.raises(HistoryError, match=r"x\.json is not UTF-8"):
        read_json(path)
    path.write_text("[" * 100_000)
    with pytest.raises(HistoryError, match=r"x\.json is nested too deeply"):
        read_json(path)
    path.write_text('{"a": 1}')
    assert read_json(path) == {"a": 1}


# --------------------------------------------------------------------------------------------
# Damage the property test of the CLI found: each is bad input (HistoryError), never a crash.
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["[]", "{}", "[\"kill_worker\"]", "5", "null"])
def test_a_fault_kind_that_is_not_a_string_is_refused(tmp_path: Path, kind: str) -> None:
    run_dir = good_run(tmp_path)
    (run_dir / "nemesis.jsonl").write_text(f'{{"fault":{kind},"start":1.0}}\n')
    with pytest.raises(HistoryError, match=r"nemesis\.jsonl:1"):
        check_run([run_dir])


def test_a_string_in_nemesis_that_is_not_utf8_is_refused(tmp_path: Path) -> None:
    run_dir = good_run(tmp_path)
    (run_dir / "nemesis.jsonl").write_bytes(b'{"fault":"pin_xmin","start":1.0,"end":2.0}\n'
                                            b'{"fault":"pin_xmin","start":1.0,"target":"\xff"}\n')
    with pytest.raises(HistoryError, match=r"nemesis\.jsonl:2 is not valid JSON \(not UTF-8\)"):
        check_run([run_dir])


@pytest.mark.parametrize("damage", ["\r", "\rjob_id", "a\rb,c"])
def test_a_header_with_a_carriage_return_is_not_a_header(tmp_path: Path, damage: str) -> None:
    run_dir = good_run(tmp_path)
    log = run_dir / "deliveries" / "target-0.csv"
    header, rest = log.read_text().split("\n", 1)
    log.write_text(damage + header + "\n" + rest)
    with pytest.raises(HistoryError, match=r"target-0\.csv:1 is not a header"):
        check_run([run_dir])


@pytest.mark.parametrize("blank", ["status", "answered"])
def test_a_delivery_answered_without_a_status_is_refused(tmp_path: Path, blank: str) -> None:
    """The target writes both or neither; judging one without the other would guess (a
    2xx duplicate whose status was blanked would pass as a failed call)."""
    run_dir = good_run(tmp_path)
    log = run_dir / "deliveries" / "target-0.csv"
    lines = log.read_text().splitlines()
    names = lines[0].split(",")
    cells = lines[1].split(",")
    cells[names.index(blank)] = ""
    lines[1] = ",".join(cells)
    log.write_text("\n".join(lines) + "\n")
    with pytest.raises(HistoryError, match=r"target-0\.csv:2: delivery has .* but not the "
                                           r"other"):
        check_run([run_dir])


def test_a_missing_worker_log_holds_what_its_events_may_explain(tmp_path: Path) -> None:
    """worker-0's log lost: its lost `write` may have failed (explaining the redelivery), so
    the duplicate is not reported and the verdict is unknown, not violated."""
    b = RunBuilder()
    b.enqueue(JOB, script=SUCCEED)
    b.attempt(JOB, 1, claimed=100.0, worker="worker-0", write="applied")
    b.attempt(JOB, 2, claimed=110.5, worker="worker-1")
    b.final(JOB, "COMPLETED", attempts=2)
    run_dir = b.write(tmp_path / "run")
    assert check_run([run_dir]).valid is False  # whole, the duplicate is a violation
    (run_dir / "workers" / "worker-0.csv").unlink()
    verdict = check_run([run_dir])
    assert verdict.valid == "unknown"
    assert verdict.counts["duplicate_unexplained"] == 1
    assert not_judged(verdict) == {"duplicate_unexplained": 1}
    assert any("event log is missing" in r for r in verdict.unknown_reasons)


def test_a_missing_worker_log_still_reports_a_stale_write(tmp_path: Path) -> None:
    """What other records prove alone stands: an applied write after a later claim."""
    b = RunBuilder()
    b.enqueue(JOB, script=SUCCEED)
    b.event("claim", "worker-0", 100.0, job_id=JOB, attempt=1, lease_token="t1",
            locked_until=101.0)
    b.deliver(JOB, attempt=1, received=100.01, answered=100.02, worker="worker-0")
    b.event("claim", "worker-1", 102.0, job_id=JOB, attempt=2, lease_token="t2",
            locked_until=103.0)
    b.deliver(JOB, attempt=2, received=102.01, answered=102.02, worker="worker-1")
    b.event("write", "worker-0", 104.0, job_id=JOB, attempt=1, outcome="success",
            result="applied", error=None, started=104.0)
    b.event("write", "worker-1", 102.1, job_id=JOB, attempt=2, outcome="success",
            result="applied", error=None)
    b.final(JOB, "COMPLETED", attempts=2)
    run_dir = b.write(tmp_path / "run")
    whole = check_run([run_dir])
    assert whole.counts["stale_write"] == 1
    b.deliver(JOB, attempt=3, received=105.0, answered=105.01, worker="worker-7")
    run_dir = b.write(tmp_path / "run2")
    verdict = check_run([run_dir])
    assert any("worker-7" in r for r in verdict.unknown_reasons)
    assert verdict.valid is False
    assert verdict.counts["stale_write"] == 1
    assert "stale_write" not in not_judged(verdict)
