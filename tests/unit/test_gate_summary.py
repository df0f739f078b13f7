"""A gate case the backend cannot honour is listed as not applicable: skipped in JUnit,
neither a pass nor a failure; a gate in which nothing applies judged nothing (exit 2)."""

from __future__ import annotations

from skiplock.scenarios.gate import CaseResult, GateSummary, junit


def _case(scenario: str, exit_code: int = 0, not_applicable: str | None = None) -> CaseResult:
    return CaseResult(scenario=scenario, seed=1, exit_code=exit_code, valid=None,
                      seconds=0.0, not_applicable=not_applicable)


def test_not_applicable_cases_are_skipped_and_counted_apart() -> None:
    summary = GateSummary(backend="bullmq", sql_path=None, seeds=[1], scenarios=[],
                          results=[_case("steady"), _case("db-faults", not_applicable="x")])
    assert summary.exit_code == 0
    counts = summary.to_json()["counts"]
    assert counts["pass"] == 1 and counts["not_applicable"] == 1
    suite = junit(summary).getroot()
    assert suite.get("skipped") == "1" and suite.get("failures") == "0"
    skipped = suite.findall("testcase/skipped")
    assert [s.get("message") for s in skipped] == ["not applicable: x"]
    assert summary.results[1].outcome == "n/a"


def test_a_violation_still_fails_beside_not_applicable_cases() -> None:
    summary = GateSummary(backend="bullmq", sql_path=None, seeds=[1], scenarios=[],
                          results=[_case("kill-workers", 1), _case("mixed", not_applicable="x")])
    assert summary.exit_code == 1


def test_a_gate_where_nothing_applies_judged_nothing() -> None:
    summary = GateSummary(backend="bullmq", sql_path=None, seeds=[1], scenarios=[],
                          results=[_case("db-faults", not_applicable="x")])
    assert summary.exit_code == 2
