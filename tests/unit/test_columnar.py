"""The columnar cache of parsed history files: a second check reads it instead of parsing
the logs, a changed file invalidates it, a truncated, racy or line-by-line file is never
cached, and the cache never changes a verdict nor makes a check fail."""

from __future__ import annotations

import errno
import os
import time
from pathlib import Path
from typing import Any

import pyarrow as pa  # type: ignore[import-untyped]
import pytest

from skiplock.reports import checker, columnar
from skiplock.reports.checker import check_run
from skiplock.reports.checker import read as checker_read
from skiplock.reports.history import DELIVERIES_DIR, DELIVERY_LOG, ENQUEUES_FILE, WORKERS_DIR
from skiplock.reports.synthetic import RunBuilder, history_files, write_log

SUCCEED: dict[str, Any] = {"name": "succeed", "first": {"behaviour": "ok"}, "times": None,
                           "then": {"behaviour": "ok"}}
FAIL_ONCE: dict[str, Any] = {"name": "custom", "first": {"behaviour": "status", "status": 503},
                             "times": 1, "then": {"behaviour": "ok"}}
DELIVERIES = f"{DELIVERIES_DIR}/target-0.csv"


def anomalous(tmp_path: Path, name: str = "run") -> Path:
    """A history with an explained duplicate, a lost job and an early retry, its files
    old enough to be cached."""
    b = RunBuilder()
    b.enqueue("dup", script=SUCCEED)
    b.attempt("dup", 1, claimed=100.0, worker="worker-0", write="info")
    b.attempt("dup", 2, claimed=110.5, worker="worker-1")
    b.final("dup", "COMPLETED", attempts=2)
    b.enqueue("gone", script=FAIL_ONCE)
    b.enqueue("early", script=FAIL_ONCE)
    b.attempt("early", 1, claimed=70.0, status=503, behaviour="status")
    b.attempt("early", 2, claimed=70.05, latency=1.0)
    b.final("early", "COMPLETED", attempts=2)
    b.fault("kill_worker", 100.2, None, target="worker-0")
    run_dir = b.write(tmp_path / name)
    age(run_dir)
    return run_dir


def age(run_dir: Path, seconds: float = 60.0) -> None:
    """Date every history file `seconds` back: a file that was just written is not cached."""
    when = time.time() - seconds
    for path in history_files(run_dir):
        os.utime(path, (when, when))


def judged(verdict: checker.Verdict) -> dict[str, Any]:
    """Everything in a verdict but how long it took."""
    out = verdict.to_json()
    del out["timings"]
    return out


def cached_files(run_dir: Path) -> set[str]:
    root = run_dir / columnar.CACHE_DIR
    return {str(p.relative_to(root)) for p in root.rglob("*" + columnar.SUFFIX)}


def no_parsing(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a log was parsed")

    monkeypatch.setattr("pyarrow.csv.read_csv", refuse)
    monkeypatch.setattr("pyarrow.json.read_json", refuse)
    monkeypatch.setattr(checker_read, "_parse_csv_slow", refuse)
    monkeypatch.setattr(checker_read, "_parse_json_slow", refuse)


def test_second_check_reads_the_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run_dir = anomalous(tmp_path)
    first = check_run([run_dir])
    assert first.valid is False
    assert cached_files(run_dir) == {
        ENQUEUES_FILE + ".arrow", DELIVERIES + ".arrow", "final_jobs.csv.arrow",
        "nemesis.jsonl.arrow", f"{WORKERS_DIR}/worker-0.csv.arrow",
        f"{WORKERS_DIR}/worker-1.csv.arrow",
    }
    stamps = {p: p.stat().st_mtime_ns for p in (run_dir / columnar.CACHE_DIR).rglob("*")}
    no_parsing(monkeypatch)
    second = check_run([run_dir])
    assert judged(second) == judged(first)
    assert {p: p.stat().st_mtime_ns for p in stamps} == stamps


def test_cache_mirrors_the_run_directory(tmp_path: Path) -> None:
    run = tmp_path / "run"
    assert columnar.cache_path(run / WORKERS_DIR / "worker-0.csv") == (
        run / ".cache" / WORKERS_DIR / "worker-0.csv.arrow")
    assert columnar.cache_path(run / ENQUEUES_FILE) == run / ".cache" / "enqueues.csv.arrow"
    assert columnar.cache_path(run / "nemesis.jsonl") == run / ".cache" / "nemesis.jsonl.arrow"


def test_verdict_is_the_same_with_and_without_cache(tmp_path: Path) -> None:
    run_dir = anomalous(tmp_path)
    cold = check_run([run_dir])
    warm = check_run([run_dir])
    (run_dir / columnar.CACHE_DIR).rename(tmp_path / "moved")
    uncached = check_run([run_dir])
    assert judged(warm) == judged(cold) == judged(uncached)
    assert cold.counts["duplicate_explained"] == 1
    assert cold.counts["lost"] == 1
    assert cold.counts["early_retry"] == 1


def test_appended_line_invalidates_the_cache(tmp_path: Path) -> None:
    run_dir = anomalous(tmp_path)
    before = check_run([run_dir])
    log = run_dir / DELIVERIES
    # The lost job reaches the target after all: one more delivery the cache does not hold.
    with log.open("a") as fh:
        fh.write(DELIVERY_LOG.line({"job_id": "gone", "attempt": 1, "account": "acct-0",
                                    "worker": "worker-0", "target": "target-0",
                                    "received": 200.0, "answered": 200.01, "status": 200,
                                    "behaviour": "ok", "seen": 1, "account_in_flight": 1}))
    age(run_dir, 30.0)
    after = check_run([run_dir])
    assert after.counts["delivered"] == before.counts["delivered"] + 1
    # The rewritten cache now stands for the longer file: a third check agrees.
    entry = columnar.lookup(log, (checker_read._DELIVERIES_WITHOUT_TOKENS.schema,))
    assert entry.table is not None
    assert entry.table.num_rows == after.counts["delivered"]
    assert judged(check_run([run_dir])) == judged(after)


def test_changed_schemas_or_version_miss(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run_dir = anomalous(tmp_path)
    check_run([run_dir])
    log = run_dir / DELIVERIES
    # The reference's attempt number names its claim: its check reads no lease tokens.
    schema = checker_read._DELIVERIES_WITHOUT_TOKENS.schema
    assert columnar.lookup(log, (schema,)).table is not None
    assert columnar.lookup(log, (checker_read._DELIVERIES.schema,)).table is None
    other = schema.append(pa.field("extra", pa.string()))
    assert columnar.lookup(log, (other,)).table is None
    monkeypatch.setattr(columnar, "FORMAT_VERSION", columnar.FORMAT_VERSION + 1)
    assert columnar.lookup(log, (schema,)).table is None


def test_truncated_file_is_not_cached_and_stays_unknown(tmp_path: Path) -> None:
    b = RunBuilder()
    b.enqueue("a", script=SUCCEED)
    b.attempt("a", 1, claimed=100.0)
    b.final("a", "COMPLETED")
    run_dir = b.write(tmp_path / "run")
    log = run_dir / DELIVERIES
    log.write_bytes(log.read_bytes() + b"b,1,acc")
    age(run_dir)
    verdicts = [check_run([run_dir]) for _ in range(2)]
    for verdict in verdicts:
        assert verdict.valid == "unknown"
        assert f"{log} is truncated mid-line" in verdict.unknown_reasons
    assert judged(verdicts[1]) == judged(verdicts[0])
    assert DELIVERIES + ".arrow" not in cached_files(run_dir)
    assert ENQUEUES_FILE + ".arrow" in cached_files(run_dir)


def test_file_read_line_by_line_is_not_cached(tmp_path: Path) -> None:
    run_dir = anomalous(tmp_path)
    log = run_dir / DELIVERIES
    log.write_text("".join(line + "\n\n" for line in log.read_text().splitlines()))
    age(run_dir)
    first = check_run([run_dir])
    assert DELIVERIES + ".arrow" not in cached_files(run_dir)
    assert judged(check_run([run_dir])) == judged(first)


def test_file_just_written_is_not_cached(tmp_path: Path) -> None:
    run_dir = anomalous(tmp_path)
    now = time.time()
    os.utime(run_dir / DELIVERIES, (now, now))
    check_run([run_dir])
    assert DELIVERIES + ".arrow" not in cached_files(run_dir)
    assert ENQUEUES_FILE + ".arrow" in cached_files(run_dir)


def test_settled_run_caches_files_just_written(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    # The runner marks its run settled once every writer has stopped: the run's own check
    # then keeps the columnar copy even though the logs were written a moment ago.
    monkeypatch.setattr(columnar, "_settled_roots", set())
    run_dir = anomalous(tmp_path)
    now = time.time()
    os.utime(run_dir / DELIVERIES, (now, now))
    columnar.mark_settled(run_dir)
    check_run([run_dir])
    assert DELIVERIES + ".arrow" in cached_files(run_dir)


def test_corrupt_cache_is_a_miss_and_is_rewritten(tmp_path: Path) -> None:
    run_dir = anomalous(tmp_path)
    first = check_run([run_dir])
    cache = columnar.cache_path(run_dir / DELIVERIES)
    cache.write_bytes(b"not arrow at all")
    assert judged(check_run([run_dir])) == judged(first)
    assert cache.read_bytes()[:6] == b"ARROW1"


def test_unwritable_cache_does_not_break_checking(tmp_path: Path) -> None:
    run_dir = anomalous(tmp_path)
    expected = judged(check_run([run_dir]))
    (run_dir / columnar.CACHE_DIR).rename(tmp_path / "moved")
    # A file where the cache directory should be: nothing can be written under it.
    (run_dir / columnar.CACHE_DIR).write_text("in the way")
    assert judged(check_run([run_dir])) == expected
    assert (run_dir / columnar.CACHE_DIR).read_text() == "in the way"


def test_full_disk_does_not_break_checking(tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    run_dir = anomalous(tmp_path)
    expected = judged(check_run([run_dir]))
    (run_dir / columnar.CACHE_DIR).rename(tmp_path / "moved")

    def full(*args: Any, **kwargs: Any) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("pyarrow.ipc.new_file", full)
    assert judged(check_run([run_dir])) == expected
    assert cached_files(run_dir) == set()
    assert not [p for p in (run_dir / columnar.CACHE_DIR).rglob("*") if p.is_file()]


def test_each_run_directory_gets_its_own_cache(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    main = anomalous(tmp_path, "main")
    extra = RunBuilder()
    extra.deliver("dup", attempt=3, received=300.0, answered=300.01, target="target-1")
    extra_dir = tmp_path / "extra"
    (extra_dir / DELIVERIES_DIR).mkdir(parents=True)
    write_log(extra_dir / DELIVERIES_DIR / "target-1.csv", DELIVERY_LOG,
              extra.deliveries["target-1"])
    age(extra_dir)
    alone = check_run([main])
    first = check_run([main, extra_dir])
    assert first.counts["delivered"] == alone.counts["delivered"] + 1
    assert cached_files(extra_dir) == {f"{DELIVERIES_DIR}/target-1.csv.arrow"}
    assert f"{DELIVERIES_DIR}/target-1.csv.arrow" not in cached_files(main)
    no_parsing(monkeypatch)
    assert judged(check_run([main, extra_dir])) == judged(first)


class _Entry:
    """Stands in for a cache entry: records each store; the first waits to be let go."""

    def __init__(self, stored: list[str], name: str, gate: Any = None,
                 began: Any = None) -> None:
        self.stored, self.name, self.gate, self.began = stored, name, gate, began

    def store(self, table: Any, *, read_bytes: int) -> bool:
        if self.gate is not None:
            self.began.set()
            self.gate.wait(5)
        self.stored.append(self.name)
        return True


def test_background_writes_finish_on_leaving_and_drop_the_unstarted_on_an_error() -> None:
    import threading

    stored: list[str] = []
    with columnar.BackgroundWrites() as writes:
        for name in ("a", "b"):
            writes.store(_Entry(stored, name), None, read_bytes=0)  # type: ignore[arg-type]
    assert stored == ["a", "b"]  # every write ended before the block was left

    stored.clear()
    gate, began = threading.Event(), threading.Event()
    with pytest.raises(KeyboardInterrupt), columnar.BackgroundWrites() as writes:
        writes.release()
        first = _Entry(stored, "started", gate, began)
        writes.store(first, None, read_bytes=0)  # type: ignore[arg-type]
        writes.store(_Entry(stored, "queued"), None, read_bytes=0)  # type: ignore[arg-type]
        assert began.wait(5)
        threading.Timer(0.2, gate.set).start()
        raise KeyboardInterrupt
    # The write under way finished (never half-done); the one not started was dropped.
    assert stored == ["started"]


def test_background_writes_wait_for_release_and_a_held_one_is_dropped_on_an_error() -> None:
    import threading

    stored: list[str] = []
    with columnar.BackgroundWrites() as writes:
        writes.store(_Entry(stored, "held"), None, read_bytes=0)  # type: ignore[arg-type]
        threading.Event().wait(0.2)
        assert stored == []  # parsing is still under way: nothing written yet
        writes.release()
        writes.store(_Entry(stored, "after"), None, read_bytes=0)  # type: ignore[arg-type]
    assert stored == ["held", "after"]

    stored.clear()
    with pytest.raises(KeyboardInterrupt), columnar.BackgroundWrites() as writes:
        writes.store(_Entry(stored, "held"), None, read_bytes=0)  # type: ignore[arg-type]
        raise KeyboardInterrupt
    assert stored == []
