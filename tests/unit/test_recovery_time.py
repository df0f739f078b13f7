"""`skiplock bench recovery` without a server: the rate and recovery computation on
synthetic delivery times, the reading of a delivery log, and the benchmark's bad input."""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest

from skiplock.chaos.nemesis import NEMESIS_KINDS
from skiplock.plumbing.errors import UsageError
from skiplock.reports.history import DELIVERY_LOG, LogWriter
from skiplock.scenarios.bench import recovery as bench_recovery
from skiplock.scenarios.bench.recovery import RecoveryError, read_deliveries, recovery_time

LOAD = 12.0
FAULT = 4.0


def paced(rate: float, start: float, end: float) -> npt.NDArray[np.float64]:
    """`rate` deliveries a second, evenly spaced, none on a bin edge."""
    return np.arange(start + 0.5 / rate, end, 1.0 / rate)


def join(*parts: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    return np.concatenate(parts)


def measure(times: npt.ArrayLike, **kwargs: float) -> bench_recovery.Recovery:
    return recovery_time(times, load_start=0.0, load_end=LOAD, fault_start=FAULT, **kwargs)


def test_a_steady_rate_never_drops() -> None:
    found = measure(paced(60, 0, LOAD))
    assert found.pre_fault_rate == pytest.approx(60)
    assert found.recovery_seconds == 0.0
    assert found.recovered
    assert found.dip == pytest.approx(1.0)
    assert len(found.rates) == 48
    assert found.rolling[:3] == (None, None, None)


def test_an_outage_recovers_once_a_whole_window_is_back() -> None:
    # Nothing for 2 s; the rate then comes back at 60/s without catching up: the rolling
    # 1 s rate is whole again 1 s after the outage ends.
    found = measure(join(paced(60, 0, 4), paced(60, 6, LOAD)))
    assert found.recovery_seconds == pytest.approx(3.0)
    assert found.dip == 0.0
    assert found.dip_at_seconds == pytest.approx(1.0)


def test_a_catch_up_burst_counts_as_back() -> None:
    # 120 jobs of backlog in the first half second back: the window ending at 6.25 s already
    # holds 15 + 60 of them (75/s), a full second earlier than without the burst.
    backlog = np.linspace(6.01, 6.49, 120)
    found = measure(join(paced(60, 0, 4), backlog, paced(60, 6, LOAD)))
    assert found.recovery_seconds == pytest.approx(2.25)


def test_a_brief_return_is_not_recovery() -> None:
    # Back for 1.25 s, out again, then back for good: recovery is the second return.
    times = join(paced(60, 0, 4), paced(60, 5, 6.25), paced(60, 7, LOAD))
    found = measure(times)
    assert found.recovery_seconds == pytest.approx(4.0)


def test_a_partial_dip() -> None:
    found = measure(join(paced(60, 0, 4), paced(40, 4, 6), paced(60, 6, LOAD)))
    assert found.dip == pytest.approx(40 / 60)
    # The window ending at 6.75 s holds one bin at 40/s and three at 60/s: 55/s >= 54/s.
    assert found.recovery_seconds == pytest.approx(2.75)


def test_the_threshold_is_ninety_percent_of_the_level() -> None:
    assert measure(join(paced(60, 0, 4), paced(55, 4, LOAD))).recovery_seconds == 0.0
    slower = measure(join(paced(60, 0, 4), paced(50, 4, LOAD)))
    assert slower.recovery_seconds is None
    assert not slower.recovered
    assert slower.dip == pytest.approx(50 / 60, abs=0.02)


def test_a_later_drop_is_timed_from_the_fault() -> None:
    found = measure(join(paced(60, 0, 6), paced(60, 7, LOAD)))
    assert found.recovery_seconds == pytest.approx(4.0)
    assert found.dip_at_seconds >= 2.0


def test_no_recovery_within_the_load() -> None:
    found = measure(paced(60, 0, 4))
    assert found.recovery_seconds is None
    assert found.dip == 0.0


def test_back_too_late_to_hold_for_a_second() -> None:
    # Whole again at 11.5 s, but the load ends before 12.5 s.
    found = measure(join(paced(60, 0, 4), paced(60, 10.5, LOAD)))
    assert found.recovery_seconds is None


def test_deliveries_outside_the_load_are_ignored() -> None:
    noise = join(np.linspace(-2, -0.01, 500), np.linspace(LOAD, LOAD + 3, 500))
    found = measure(join(noise, paced(60, 0, LOAD)))
    assert found.pre_fault_rate == pytest.approx(60)
    assert found.recovery_seconds == 0.0


def test_uneven_pacing_does_not_inflate_the_level() -> None:
    # Bins of 16, 16, 16, 12 (64, 64, 64, 48 jobs/s), as a constant-rate producer paces
    # 60/s: the level is 60, not the bins' median of 64.
    times = join(*[np.linspace(s + 0.01, s + 0.24, n) for k in range(48)
                   for s, n in [(k * 0.25, 12 if k % 4 == 3 else 16)]])
    assert measure(times).pre_fault_rate == pytest.approx(60)


@pytest.mark.parametrize(
    ("times", "fault", "message"),
    [
        (paced(60, 0, LOAD), 0.5, "no whole 1 s window of load before the fault"),
        (paced(60, 5, LOAD), FAULT, "nothing was delivered before the fault"),
        (paced(60, 0, LOAD), LOAD + 1, "is not inside the load"),
        (paced(60, 0, LOAD), LOAD - 0.9, "less than 1 s of load after the fault"),
    ],
)
def test_what_cannot_be_measured_says_why(times: npt.NDArray[np.float64], fault: float,
                                          message: str) -> None:
    with pytest.raises(RecoveryError, match=message):
        recovery_time(times, load_start=0.0, load_end=LOAD, fault_start=fault)


def test_reading_a_delivery_log(tmp_path: Path) -> None:
    def delivery(job: str, received: float, status: int | None,
                 took: float = 0.01) -> dict[str, object]:
        return {"job_id": job, "attempt": 1, "account": "a", "worker": "w", "target": "t",
                "received": received, "answered": None if status is None else received + took,
                "status": status, "behaviour": "ok", "seen": 1, "account_in_flight": 1}

    with LogWriter(tmp_path / "deliveries" / "target-0.csv", DELIVERY_LOG) as log:
        log.write(delivery("a", 1.0, 200))
        log.write(delivery("a", 3.0, 200))  # a duplicate
        log.write(delivery("b", 2.0, 200, took=1.5))  # late: reached nobody
        log.write(delivery("b", 5.0, 200))
        log.write(delivery("c", 2.0, 503))
        log.write(delivery("c", 4.0, 201))
        log.write(delivery("d", 2.5, None))  # never answered
    found = read_deliveries(tmp_path, http_timeout=1.0)
    assert found.first_timely.sort_index().to_dict() == {"a": 1.0, "b": 5.0, "c": 4.0}
    assert found.deliveries == 7
    assert found.jobs_2xx == 3
    # a twice on time; b once late, once on time.
    assert found.jobs_duplicated == 2


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench_recovery.configure(parser)
    return parser.parse_args(list(argv))


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--kinds", "kill_wroker"], "unknown fault kind 'kill_wroker' in --kinds; valid: "),
        (["--kinds", ","], "--kinds expects KIND[,KIND...]"),
        (["--kinds", "pin_xmin,pin_xmin"], "--kinds names a kind twice"),
        (["--fault-at", "0.5"], "leaves less than 1 s of load before the fault"),
        (["--duration", "5", "--fault-at", "4"], "ends less than 2 s after --fault-at 4"),
    ],
)
def test_bad_input_is_one_line(argv: list[str], message: str) -> None:
    with pytest.raises(UsageError) as caught:
        bench_recovery.validate(_args(*argv))
    assert message in str(caught.value)
    assert "\n" not in str(caught.value)


def test_every_kind_gets_one_fault_at_the_same_time() -> None:
    params = bench_recovery.validate(_args())
    assert params.kinds == NEMESIS_KINDS
    for kind in params.kinds:
        spec = bench_recovery.spec_for(kind, params)
        assert [(n.kind, n.at, n.interval) for n in spec.nemesis] == [(kind, 4.0, 0.0)]
        assert dict(spec.mix) == {"succeed": 1.0}
        assert None in spec.accounts.values()
    claim = bench_recovery.spec_for("crash_after_claim", params).nemesis[0]
    assert (claim.duration, claim.probability) == (1.0, 0.2)
    pause = bench_recovery.spec_for("pause_worker", params)
    assert bench_recovery.window_of("pause_worker", pause) == pause.lease + 1
