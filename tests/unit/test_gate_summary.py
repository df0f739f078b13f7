"""A gate case the backend cannot honour is listed as not applicable: skipped in JUnit,
neither a pass nor a failure; a gate in which nothing applies judged nothing (exit 2)."""

from __future__ import annotations

from skiplock.scenarios.run.gate import CaseResult, GateSummary, junit


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


def test_a_failure_is_one_short_line_with_its_replay_and_a_short_body() -> None:
    many = {kind: [{"job_id": f"job-{kind}-{i}", "why": "x" * 500} for i in range(40)]
            for kind in ("duplicate_unexplained", "concurrent_delivery", "limit_exceeded",
                         "lost", "stale_write", "state_mismatch", "early_retry", "stuck")}
    case = CaseResult(scenario="noisy-neighbour", seed=7, exit_code=1, valid=False,
                      seconds=1.0, counts={kind: 40 for kind in many}, examples=many,
                      run_dir="/tmp/gate/runs/r1")
    summary = GateSummary(backend="pg-naive", sql_path="db/my queue.sql", seeds=[7],
                          scenarios=["noisy-neighbour"], results=[case])
    [failure] = junit(summary).getroot().findall("testcase/failure")
    message = failure.get("message") or ""
    assert "\n" not in message and len(message) < 300, message
    assert message.endswith("replay: skiplock gate --only noisy-neighbour --seed 7"
                            " --backend pg-naive --sql 'db/my queue.sql'")
    assert "duplicate_unexplained=40" in message
    body = (failure.text or "").splitlines()
    assert len(body) < 60, len(body)
    assert body[-1] == "re-check: skiplock check /tmp/gate/runs/r1"
    assert "  job-lost-0: " in "\n".join(body)
