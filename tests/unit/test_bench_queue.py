"""The queue benchmark's input checks and its pgbench script, without a server."""

from __future__ import annotations

import argparse
import dataclasses
import re
from pathlib import Path

import pytest

from skiplock.plumbing.errors import UsageError
from skiplock.queue_impl.sqlfile import reference_statements
from skiplock.scenarios.bench import common as bench_common
from skiplock.scenarios.bench import queue as bench_queue
from skiplock.scenarios.bench.common import NO_RATIO, ratio_of


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench_queue.configure(parser)
    return parser.parse_args(list(argv))


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--workers", "0"], "--workers must be a positive integer"),
        (["--batch", "-3"], "--batch must be a positive integer"),
        (["--duration", "0"], "--duration must be a positive number"),
        (["--duration", "nan"], "--duration must be a positive number"),
        (["--prefill", "0"], "--prefill must be a positive integer"),
        (["--rounds", "0"], "--rounds must be from 1 to 20"),
        (["--rounds", "21"], "--rounds must be from 1 to 20"),
    ],
)
def test_non_positive_inputs_are_refused_in_one_line(argv: list[str], message: str) -> None:
    with pytest.raises(UsageError) as caught:
        bench_queue.validate(_args(*argv))
    assert message in str(caught.value)
    assert "\n" not in str(caught.value)
    assert UsageError.exit_code == 2


def test_the_backlog_is_vacuumed_unless_asked_fresh() -> None:
    assert bench_queue.validate(_args()).fill == "vacuumed"
    assert bench_queue.validate(_args("--fill", "fresh")).fill == "fresh"


def test_prefill_defaults_to_enough_for_the_duration() -> None:
    params = bench_queue.validate(_args("--duration", "60"))
    assert params.prefill == 60 * bench_queue.PREFILL_JOBS_PER_SECOND
    assert bench_queue.validate(_args("--duration", "1")).prefill == bench_queue.PREFILL_MIN


def test_pgbench_script_runs_the_reference_statements() -> None:
    statements = reference_statements()
    script = bench_queue.pgbench_script(statements)
    # No psycopg placeholder is left for pgbench to choke on.
    assert "%(" not in script
    # The claim's locking clause and the finish's fencing condition are there unchanged.
    assert "FOR UPDATE OF j SKIP LOCKED" in script
    assert ("j.lease_token = r.lease_token\n      AND CASE j.status WHEN 'PROCESSING' THEN true END"
            in script)
    # One transaction a cycle, as PgQueue's finish_and_claim: the finish, then the claim.
    assert script.count("BEGIN;") == 1 and script.count("COMMIT;") == 1
    finish, claim = script.split("SELECT ord FROM applied;", 1)
    assert "SKIP LOCKED" not in finish and "\\gset" in claim
    # Every variable the finish reads is one the claim hands over, and one the first cycle
    # is given empty.
    handed_over = set(re.findall(r" AS (\w+),", claim))
    used = set(re.findall(r":(\w+)::", finish))
    assert used, "the finish reads no variables"
    assert used <= handed_over
    assert used <= set(bench_queue.PGBENCH_FIRST)


def test_percentile_picks_from_the_sorted_values() -> None:
    values = [float(v) for v in range(1, 101)]
    assert bench_common.percentile(values, 0.5) == 51.0
    assert bench_common.percentile(values, 0.99) == 99.0
    assert bench_common.percentile([], 0.5) is None


@pytest.mark.parametrize(
    "argv",
    [
        ["bench", "queue", "--workers", "0"],
        ["bench", "queue", "--duration", "-1"],
        ["bench", "queue", "--out", "/"],
        ["bench", "queue", "--dsn", "postgresql://u:sekret-pw@127.0.0.1:1/x", "--duration", "1"],
    ],
)
def test_cli_bad_input_exits_2_with_one_line(
    argv: list[str],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    from skiplock.scenarios.cli.main import main

    monkeypatch.chdir(tmp_path)  # the default result folder is made under the cwd

    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1
    assert captured.err.startswith("skiplock: ")
    assert "sekret-pw" not in captured.err + captured.out


def test_against_pgqueuer_without_it_installed_is_bad_input(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    from skiplock.plumbing.errors import UsageError
    from skiplock.scenarios.bench.pgqueuer import require_pgqueuer

    monkeypatch.setitem(sys.modules, "pgqueuer", None)  # import fails as if absent
    with pytest.raises(UsageError, match=r"pip install 'skiplock\[pgqueuer\]'"):
        require_pgqueuer()


@pytest.mark.parametrize(("queue_rate", "explained"), [(1470.0, True), (900.0, False)])
def test_a_queue_above_its_ceiling_is_explained(
        capsys: pytest.CaptureFixture[str], queue_rate: float, explained: bool) -> None:
    def phase(rate: float) -> bench_queue.PhaseResult:
        return bench_queue.PhaseResult(jobs=int(rate), cycles=1, seconds=1.0,
                                       jobs_per_second=rate, cycle_p50_ms=1.0,
                                       cycle_p99_ms=2.0, ran_dry=False, extra={})

    bench_queue._print_summary(phase(queue_rate), phase(1000.0), queue_rate / 1000.0)
    out = capsys.readouterr().out
    assert f"ratio queue/ceiling: {queue_rate / 1000:.2f}" in out
    assert (bench_queue.CEILING_BEATEN in out) is explained


@pytest.mark.parametrize(("batch", "expected"), [(20, (10, 20)), (7, (3, 7)), (1, (1, 2))])
def test_pgqueuer_holds_a_batch_in_flight_per_process(batch: int,
                                                      expected: tuple[int, int]) -> None:
    from skiplock.scenarios.bench.pgqueuer import _in_flight_per_process

    per_dequeue, in_flight = _in_flight_per_process(batch)
    assert (per_dequeue, in_flight) == expected
    assert in_flight >= 2 * per_dequeue  # pgqueuer refuses less


def _phase(rate: float, *, ran_dry: bool = False) -> bench_queue.PhaseResult:
    return bench_queue.PhaseResult(jobs=int(rate * 10), cycles=1, seconds=10.0,
                                   jobs_per_second=rate, cycle_p50_ms=1.0, cycle_p99_ms=2.0,
                                   ran_dry=ran_dry, extra={})


@pytest.mark.parametrize(("queue_dry", "other_dry"), [(True, False), (False, True), (True, True)])
def test_no_ratio_is_given_with_a_phase_that_ran_dry(
        capsys: pytest.CaptureFixture[str], queue_dry: bool, other_dry: bool) -> None:
    # Both emptied their backlog: 8,000 jobs/s each is the backlog over the duration, and
    # "1.00" would be a claim about two queues that were never measured.
    queue, ceiling = _phase(8000.0, ran_dry=queue_dry), _phase(8000.0, ran_dry=other_dry)
    other = {"jobs_per_second": 8000.0, "ran_dry": other_dry}
    assert ratio_of(queue, ceiling) is None
    assert bench_queue._versus({"queue": queue}, other, "pgqueuer")["ratio_to_pgqueuer"] is None
    figures = bench_queue._round_figures({"queue": queue, "ceiling": ceiling}, other, "pgqueuer")
    assert figures["ratio"] is None
    bench_queue._print_summary(queue, ceiling, None)
    assert f"ratio queue/ceiling: {NO_RATIO}" in capsys.readouterr().out


def test_bench_e2e_gives_no_ratio_with_a_phase_that_ran_dry(
        capsys: pytest.CaptureFixture[str]) -> None:
    # The same rule as bench queue's: the end-to-end phase's dryness voids both its ratios.
    from skiplock.scenarios.bench import e2e as bench_e2e
    from skiplock.scenarios.bench.window import E2eResult

    e2e = E2eResult(jobs=2000, seconds=1.0, jobs_per_second=2000.0, job_p50_ms=1.0,
                    job_p99_ms=2.0, ran_dry=True, worker_cpu_seconds=0.5,
                    target_cpu_seconds=0.2)
    assert ratio_of(e2e, _phase(8000.0)) is None
    assert ratio_of(e2e, {"jobs_per_second": 1500.0, "ran_dry": False}) is None
    doc = {"queue": {**_figures(_phase(8000.0)), "cycle_p50_ms": 1.0, "cycle_p99_ms": 2.0},
           "e2e": dataclasses.asdict(e2e), "ratio": None,
           "pgqueuer": {**dataclasses.asdict(e2e), "ran_dry": False}, "ratio_to_pgqueuer": None}
    bench_e2e._print_summary(doc)
    out = capsys.readouterr().out
    assert f"ratio end to end / queue only: {NO_RATIO}" in out
    assert f"ratio PgQueue end to end / pgqueuer end to end: {NO_RATIO}" in out


def _figures(phase: bench_queue.PhaseResult) -> dict[str, object]:
    return {"jobs_per_second": phase.jobs_per_second, "ran_dry": phase.ran_dry}


def test_a_ratio_is_given_when_neither_phase_ran_dry() -> None:
    assert ratio_of(_phase(9000.0), _phase(7500.0)) == pytest.approx(1.2)
    assert ratio_of(_phase(9000.0), {"jobs_per_second": 0.0, "ran_dry": False}) is None


def test_each_stage_of_a_job_runs_from_one_logged_instant_to_the_next() -> None:
    import pandas as pd

    from skiplock.scenarios.bench.window import STAGES, _stages

    def job(job_id: str, sent: float, stretch: float) -> list[dict[str, object]]:
        """A job whose stages last 1, 2, 3, 4 and 5 ms, times `stretch`; a resend of its
        write, logged later, does not count (each job's first of each)."""
        at = [sent + stretch * sum(range(1, n + 1)) / 1000 for n in range(6)]
        return [
            {"kind": "claim", "job_id": job_id, "started": at[0], "time": at[1]},
            {"kind": "http", "job_id": job_id, "start": at[2], "end": at[3], "time": at[3]},
            {"kind": "write", "job_id": job_id, "started": at[4], "time": at[5]},
            {"kind": "write", "job_id": job_id, "started": at[5] + 1, "time": at[5] + 2},
        ]

    ev = pd.DataFrame([*job("a", 100.0, 1.0), *job("b", 100.5, 3.0), *job("c", 101.0, 2.0)])
    stages = _stages(ev, pd.Index(["a", "b", "c"]))
    assert stages == {name: 2.0 * n for n, name in enumerate(STAGES, start=1)}
    # A peer's log holds no instants within its events: no stages, rather than made-up ones.
    assert _stages(ev[["kind", "job_id", "time"]], pd.Index(["a"])) is None
