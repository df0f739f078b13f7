"""The README says what the code does: the anomalies it lists are the checker's."""

from __future__ import annotations

from pathlib import Path

from skiplock.reports.checker import COUNT_KEYS, MEANINGS, VIOLATION_KEYS

ROOT = Path(__file__).resolve().parents[2]


def test_the_readme_anomaly_table_names_every_anomaly_the_checker_counts() -> None:
    """The README's anomaly table and the checker's one-line meanings (shown in the report)
    name the same anomalies."""
    readme = (ROOT / "README.md").read_text()
    start = readme.index("| anomaly | meaning |")
    rows = readme[start:readme.index("\n\n", start)].splitlines()[2:]
    in_readme = {row.split("|")[1].strip() for row in rows}
    assert in_readme == set(MEANINGS) == {*VIOLATION_KEYS, "duplicate_explained"}
    assert set(MEANINGS) <= set(COUNT_KEYS)
