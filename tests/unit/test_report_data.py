"""The report's reading of a run directory: lenient where the checker is strict, and the
series it draws computed right on small hand-made logs."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from skiplock.reports.history import (
    DELIVERIES_DIR,
    DELIVERY_LOG,
    ENQUEUE_LOG,
    ENQUEUES_FILE,
    SPEC_FILE,
    WORKER_LOG,
    WORKERS_DIR,
    HistoryError,
    LogWriter,
)
from skiplock.reports.report import render
from skiplock.reports.report_data import (
    bin_seconds,
    load_run,
    outstanding_by_account,
    percentiles_over_time,
    throughput,
)

T0 = 1_000_000.0


def _run_dir(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    (run / DELIVERIES_DIR).mkdir(parents=True)
    (run / WORKERS_DIR).mkdir()
    (run / SPEC_FILE).write_text(json.dumps({
        "scenario": {"name": "unit", "accounts": {"a": 2}},
        "phases": [{"name": "warmup", "start": T0, "end": T0 + 1}]}))
    with LogWriter(run / ENQUEUES_FILE, ENQUEUE_LOG) as log:
        for n, account in enumerate(["a", "a", "b"]):
            log.write({"type": "invoke", "job_id": f"j{n}", "time": T0 + n, "process": "p",
                       "account": account, "max_attempts": 2})
            log.write({"type": "ok", "job_id": f"j{n}", "time": T0 + n + 0.01, "process": "p"})
    with LogWriter(run / WORKERS_DIR / "w.csv", WORKER_LOG) as log:
        for n in range(3):
            log.write({"kind": "claim", "worker": "w", "time": T0 + n + 0.1, "job_id": f"j{n}",
                       "attempt": 1})
        # j0 completes, j1 dead-letters on its last attempt, j2 is never finished.
        log.write({"kind": "write", "worker": "w", "time": T0 + 4, "job_id": "j0",
                   "attempt": 1, "data": {"outcome": "success", "result": "applied"}})
        log.write({"kind": "write", "worker": "w", "time": T0 + 5, "job_id": "j1",
                   "attempt": 2, "data": {"outcome": "transient", "result": "applied"}})
    with LogWriter(run / DELIVERIES_DIR / "t.csv", DELIVERY_LOG) as log:
        log.write({"job_id": "j0", "attempt": 1, "account": "a", "worker": "w", "target": "t",
                   "received": T0 + 0.2, "answered": T0 + 0.3, "status": 200,
                   "behaviour": "ok", "seen": 1, "account_in_flight": 1})
    return run


def test_a_cut_line_and_a_malformed_line_are_left_out_and_said(tmp_path: Path) -> None:
    run = _run_dir(tmp_path)
    deliveries = run / DELIVERIES_DIR / "t.csv"
    with deliveries.open("a") as fh:
        fh.write("j9,1,a\n")  # too few fields
        fh.write("j8,1,a,w,t,1000000.5,1000000.6,200,ok,1,")  # cut before its newline
    data = load_run(run)
    assert data.deliveries is not None and list(data.deliveries["job_id"]) == ["j0"]
    notes = " | ".join(data.notes)
    assert "deliveries/t.csv was cut off mid-line" in notes
    assert "deliveries/t.csv: 1 malformed line(s) left out" in notes
    assert "verdict.json is missing" in notes and "final_jobs.csv is missing" in notes


def test_no_run_at_all_is_bad_input(tmp_path: Path) -> None:
    with pytest.raises(HistoryError, match="holds no run"):
        load_run(tmp_path)
    with pytest.raises(HistoryError, match="does not exist"):
        load_run(tmp_path / "nope")


def test_finishing_writes_and_unfinished_jobs_per_account(tmp_path: Path) -> None:
    data = load_run(_run_dir(tmp_path))
    rates = throughput(data, 1.0, 6.0)
    assert rates["enqueued"].sum() == 3
    assert rates["completed"].sum() == 1
    assert rates["dead-lettered"].sum() == 1  # transient on attempt 2 of max_attempts 2
    unfinished = outstanding_by_account(data, 1.0, 6.0)
    assert unfinished["a"].iloc[-1] == 0  # j0 completed, j1 dead-lettered
    assert unfinished["b"].iloc[-1] == 1  # j2 never finished
    assert unfinished["a"].max() == 2


def test_percentiles_per_bin() -> None:
    frame = pd.DataFrame({"at": [0.1, 0.2, 0.3, 1.5], "seconds": [1.0, 2.0, 3.0, 9.0]})
    table = percentiles_over_time(frame, 1.0)
    assert list(table.index) == [0.5, 1.5]
    assert table.loc[0.5, "p50"] == 2.0 and table.loc[1.5, "p99"] == 9.0


@pytest.mark.parametrize("span, width", [(10, 0.5), (100, 1.0), (1_000, 10.0), (50_000, 600.0)])
def test_bins_keep_a_plot_readable(span: float, width: float) -> None:
    assert bin_seconds(span) == width


@pytest.mark.parametrize(("harness", "said"), [
    ({"redis_version": "7.2.4", "appendonly": "yes", "appendfsync": "always",
      "data_filesystem": "ext4", "durable": True},
     "durable (appendonly yes, appendfsync always, data on ext4)"),
    ({"redis_version": "7.2.4", "appendonly": "no", "appendfsync": "everysec",
      "data_filesystem": "tmpfs", "durable": False}, "NOT durable"),
])
def test_a_redis_run_reports_redis_durability_and_versions(
        tmp_path: Path, harness: dict[str, object], said: str) -> None:
    run = _run_dir(tmp_path)
    spec = json.loads((run / SPEC_FILE).read_text())
    spec.update(backend="bullmq", postgres={"harness": {"durable": True}},
                redis={"kind": "embedded", "harness": harness},
                packages={"bullmq": "2.25.4", "redis": "5.2.1", "pgqueuer": None})
    (run / SPEC_FILE).write_text(json.dumps(spec))
    page = render([load_run(run)])
    assert "<th>Redis durability</th><td>" + said in page.replace("&#x27;", "'")
    assert "<th>Redis</th><td>7.2.4 (embedded); bullmq 2.25.4, redis 5.2.1</td>" in page
    assert "<th>PostgreSQL durability</th><td>durable" in page
    assert "pgqueuer None" not in page


def test_the_verdict_box_states_the_headline_figures_in_text(tmp_path: Path) -> None:
    run = _run_dir(tmp_path)
    spec = json.loads((run / SPEC_FILE).read_text())
    spec["phases"].append({"name": "load", "start": T0, "end": T0 + 2})
    spec["scenario"]["max_attempts"] = 3
    (run / SPEC_FILE).write_text(json.dumps(spec))
    page = render([load_run(run)])
    # One delivery in a 2 s load; j0's enqueue was acknowledged at T0 + 0.01 and it was
    # first delivered at T0 + 0.2.
    assert ("<p class='headline'>0.5 deliveries/s during the load; enqueue → first delivery"
            " p50 190 ms, p99 190 ms; max_attempts 3</p>") in page


def test_a_page_that_cannot_be_written_leaves_no_partial_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import errno

    from skiplock.reports.report import write_index

    def full(self: Path, *args: object, **kwargs: object) -> Path:
        raise OSError(errno.ENOSPC, "No space left on device")

    # The page is written, then its move into place fails: the .tmp must not stay.
    monkeypatch.setattr(Path, "replace", full)
    with pytest.raises(OSError, match="No space left"):
        write_index("gate", [], tmp_path / "report.html")
    assert list(tmp_path.iterdir()) == []


def test_faults_that_were_skipped_are_said_beside_the_verdict(tmp_path: Path) -> None:
    run = _run_dir(tmp_path)
    (run / "nemesis.jsonl").write_text(
        json.dumps({"fault": "restart_postgres", "start": T0 + 3, "end": T0 + 3,
                    "skipped": "needs a PostgreSQL the harness started"}) + "\n"
        + json.dumps({"fault": "kill_worker", "start": T0 + 1, "end": T0 + 1.01,
                      "target": "worker-0"}) + "\n")
    page = render([load_run(run)])
    assert "<b>Faults scheduled but not applied (1)</b>" in page
    assert "<li>restart_postgres at 3.0 s: needs a PostgreSQL the harness started</li>" in page


def test_the_targets_scripted_failures_are_a_series_over_time(tmp_path: Path) -> None:
    run = _run_dir(tmp_path)
    with LogWriter(run / DELIVERIES_DIR / "u.csv", DELIVERY_LOG) as log:
        for n, (behaviour, status) in enumerate([("status", 503), ("status", 200),
                                                 ("reset", None), ("slow", 200)]):
            log.write({"job_id": "j1", "attempt": n + 1, "account": "a", "worker": "w",
                       "target": "u", "received": T0 + 2 + n, "answered": T0 + 2.1 + n,
                       "status": status, "behaviour": behaviour, "seen": n + 1,
                       "account_in_flight": 1})
    rates = throughput(load_run(run), 1.0, 8.0)
    # The 503 and the reset; a scripted 200 and a slow answer are no failures.
    assert rates["failed by script"].sum() == 2
    assert rates["delivered"].sum() == 5
    # Nothing failed by script: no series.
    assert "failed by script" not in throughput(load_run(_run_dir(tmp_path / "plain")), 1.0,
                                                8.0)


def test_first_delivery_waits_count_from_the_acknowledgement(tmp_path: Path) -> None:
    from skiplock.reports.report_data import latencies

    # j0: invoked at T0, acknowledged at T0 + 0.01, first delivered at T0 + 0.2 (the
    # checker's wait, against which objectives are drawn).
    frame = latencies(load_run(_run_dir(tmp_path)))["enqueue → first delivery"]
    assert frame["seconds"].tolist() == pytest.approx([0.19])
