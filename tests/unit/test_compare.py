"""`skiplock compare`: each figure in its own direction, exit 1 only on a regression beyond
the threshold, and 2 for results it cannot compare."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from skiplock.plumbing.errors import UsageError
from skiplock.scenarios.cli import compare as cmd_compare
from skiplock.scenarios.cli import main as cli

E2E: dict[str, Any] = {
    "benchmark": "e2e",
    "queue": {"jobs_per_second": 3000.0},
    "e2e": {"jobs_per_second": 2400.0, "job_p99_ms": 40.0},
    "ratio": 0.8,
}


def write(path: Path, doc: dict[str, Any]) -> str:
    path.write_text(json.dumps(doc))
    return str(path)


def slower(doc: dict[str, Any], by: float) -> dict[str, Any]:
    out = copy.deepcopy(doc)
    out["e2e"]["jobs_per_second"] *= 1 - by
    out["ratio"] *= 1 - by
    out["e2e"]["job_p99_ms"] *= 1 + by
    return out


def test_a_rerun_of_the_same_figures_passes(tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    base = write(tmp_path / "a.json", E2E)
    assert cli.main(["compare", base, write(tmp_path / "b.json", E2E)]) == 0
    assert "no figure worse" in capsys.readouterr().out


def test_an_injected_twenty_percent_slowdown_fails_the_gate(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = write(tmp_path / "a.json", E2E)
    new = write(tmp_path / "b.json", slower(E2E, 0.2))
    assert cli.main(["compare", base, new, "--threshold", "10%"]) == 1
    out = capsys.readouterr().out
    assert out.count("REGRESSION") == 3  # end to end, the ratio, and p99 (which rose)
    assert "queue only" in out and "-20.0%" in out
    # Within a looser threshold it passes.
    assert cli.main(["compare", base, new, "--threshold", "25%"]) == 0


def test_better_figures_are_never_a_regression(tmp_path: Path) -> None:
    faster = slower(E2E, -0.5)
    assert cli.main(["compare", write(tmp_path / "a.json", E2E),
                     write(tmp_path / "b.json", faster)]) == 0


@pytest.mark.parametrize(("text", "value"), [("10%", 0.1), ("0.2", 0.2), ("0%", 0.0)])
def test_thresholds(text: str, value: float) -> None:
    assert cmd_compare.parse_threshold(text) == pytest.approx(value)


@pytest.mark.parametrize("text", ["ten", "-5%", "nan", "inf", "1e9%"])
def test_bad_thresholds_are_refused(text: str) -> None:
    with pytest.raises(UsageError, match="--threshold"):
        cmd_compare.parse_threshold(text)


def test_results_of_different_benchmarks_are_bad_input(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    queue = {"benchmark": "queue", "queue": {"jobs_per_second": 1.0},
             "ceiling": {"jobs_per_second": 1.0}, "ratio": 1.0}
    code = cli.main(["compare", write(tmp_path / "a.json", E2E),
                     write(tmp_path / "b.json", queue)])
    assert code == 2
    assert capsys.readouterr().err.count("\n") == 1


@pytest.mark.parametrize("content", ["{", "[]", '{"benchmark": "nope"}',
                                     '{"benchmark": "e2e"}'])
def test_files_that_are_not_results_are_bad_input(tmp_path: Path, content: str) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(content)
    assert cli.main(["compare", write(tmp_path / "a.json", E2E), str(bad)]) == 2


def test_sweep_results_compare_the_knee_and_each_common_step(tmp_path: Path) -> None:
    def sweep(knee: float, delivered: float) -> dict[str, Any]:
        return {"benchmark": "sweep", "knee_rate": knee, "steps": [
            {"rate": 100, "delivered_per_second": 100, "p99_seconds": 0.02},
            {"rate": 200, "delivered_per_second": delivered, "p99_seconds": 0.05}]}

    base = write(tmp_path / "a.json", sweep(200, 200))
    assert cli.main(["compare", base, write(tmp_path / "b.json", sweep(200, 195))]) == 0
    assert cli.main(["compare", base, write(tmp_path / "c.json", sweep(100, 150))]) == 1


@pytest.mark.parametrize(("figure", "why"), [
    ("NaN", "not a finite number"),
    ("true", "not a number"),
    ('"2400"', "not a number"),
    ("1" + "0" * 400, "too large a number"),
])
def test_a_figure_that_is_no_measurement_is_bad_input(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], figure: str, why: str) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(E2E).replace("2400.0", figure))
    assert cli.main(["compare", write(tmp_path / "a.json", E2E), str(bad)]) == 2
    err = capsys.readouterr().err
    assert why in err and err.count("\n") == 1


def test_deeply_nested_json_is_bad_input(tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "deep.json"
    bad.write_text("[" * 100_000 + "]" * 100_000)
    assert cli.main(["compare", write(tmp_path / "a.json", E2E), str(bad)]) == 2
    assert "nested too deeply" in capsys.readouterr().err


def test_results_with_different_settings_warn_and_strict_refuses(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = {**copy.deepcopy(E2E), "params": {"enqueue_batch": 1, "workers": 2},
            "durability": "fsync"}
    new = copy.deepcopy(base)
    new["params"]["enqueue_batch"] = 10
    a, b = write(tmp_path / "a.json", base), write(tmp_path / "b.json", new)
    assert cli.main(["compare", a, b]) == 0
    err = capsys.readouterr().err
    assert "WARNING: measured with different settings" in err
    assert "params.enqueue_batch 1 -> 10" in err
    assert cli.main(["compare", a, b, "--strict"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "params.enqueue_batch 1 -> 10" in err
    # Like with like: no warning.
    assert cli.main(["compare", a, a, "--strict"]) == 0
    assert "WARNING" not in capsys.readouterr().err


def test_every_system_in_a_result_is_compared(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = {**copy.deepcopy(E2E), "bullmq": {"jobs_per_second": 1000.0},
            "ratio_to_bullmq": 2.4}
    new = copy.deepcopy(base)
    new["bullmq"]["jobs_per_second"] = 500.0  # Redis got slower; the reference did not
    assert cli.main(["compare", write(tmp_path / "a.json", base),
                     write(tmp_path / "b.json", new)]) == 1
    out = capsys.readouterr().out
    assert "bullmq (jobs/s)" in out and "REGRESSION" in out
    assert "ratio reference / bullmq" in out


def _queue_result(rates: list[float]) -> dict[str, Any]:
    rounds = [{"queue": {"jobs_per_second": r}, "ceiling": {"jobs_per_second": 2500.0},
               "ratio": r / 2500.0} for r in rates]
    median = sorted(rounds, key=lambda r: r["queue"]["jobs_per_second"])[len(rounds) // 2]
    return {"benchmark": "queue", "params": {"rounds": len(rates)}, **median,
            "rounds": rounds}


def test_a_change_inside_the_rounds_spread_is_within_noise(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Back-to-back runs of the same code: medians 26 % apart, rounds overlapping.
    base = _queue_result([2600.0, 2900.0, 2000.0])
    new = _queue_result([2100.0, 1950.0, 2700.0])
    assert cli.main(["compare", write(tmp_path / "a.json", base),
                     write(tmp_path / "b.json", new)]) == 0
    out = capsys.readouterr().out
    assert "within noise" in out and "REGRESSION" not in out
    assert "beyond the spread of the rounds" in out


def test_a_change_beyond_every_round_is_a_regression(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = _queue_result([2600.0, 2700.0, 2650.0])
    new = _queue_result([1800.0, 1900.0, 1850.0])
    assert cli.main(["compare", write(tmp_path / "a.json", base),
                     write(tmp_path / "b.json", new)]) == 1
    assert "REGRESSION" in capsys.readouterr().out
