"""A text column read by Arrow keeps the codes of its dictionary, and the judge's
categoricals and its check for empty values are made from them instead of hashing every
value again. These hold the codes to the values they stand for: over files whose
dictionaries differ, with nulls and empty strings, a coded column gives the same
categorical, the same values and the same first bad row as the values read line by line."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pyarrow as pa  # type: ignore[import-untyped]
import pytest
from hypothesis import given
from hypothesis import strategies as st

from skiplock.reports.checker import read as checker_read
from skiplock.reports.checker.validate import Table, table_of
from skiplock.reports.history import HistoryError

# Final job states: two text columns, `status` the one coded.
SOURCE = checker_read._FINAL
VALUES = st.sampled_from(["COMPLETED", "FAILED", "", None, "RETRYING", "dé,jà"])
FILES = st.lists(st.lists(VALUES, max_size=8), min_size=1, max_size=4)


def _arrow_table(files: list[list[str | None]]) -> Table:
    parts = [checker_read._arrow_part(
        Path(f"final-{i}.csv"),
        pa.table({"job_id": pa.array([f"j{i}-{n}" for n in range(len(statuses))], pa.string()),
                  "status": pa.array(statuses, pa.string())}),
        False, SOURCE) for i, statuses in enumerate(files)]
    return table_of(parts, SOURCE.shape)


def _line_table(files: list[list[str | None]]) -> Table:
    parts = [checker_read._python_part(
        Path(f"final-{i}.csv"),
        [{"job_id": f"j{i}-{n}", "status": s} for n, s in enumerate(statuses)],
        list(range(2, len(statuses) + 2)), SOURCE, False) for i, statuses in enumerate(files)]
    return table_of(parts, SOURCE.shape)


def _first_bad(table: Table) -> str | None:
    try:
        table.require_str("status", "final job state")
    except HistoryError as exc:
        return str(exc)
    return None


@given(FILES)
def test_a_coded_column_is_the_values_it_was_read_from(files: list[list[str | None]]) -> None:
    coded, by_line = _arrow_table(files), _line_table(files)
    assert "status" in coded.coded and "status" not in by_line.coded
    everything = [s for statuses in files for s in statuses]
    assert coded.columns["status"].tolist() == everything
    pd.testing.assert_extension_array_equal(coded.categorical("status"),
                                            by_line.categorical("status"))
    assert _first_bad(coded) == _first_bad(by_line)


def test_the_first_empty_or_missing_status_is_named_by_its_file_and_line() -> None:
    table = _arrow_table([["COMPLETED", "FAILED"], ["COMPLETED", ""], [None]])
    with pytest.raises(HistoryError, match=r"^final-1\.csv:3: final job state has no status$"):
        table.require_str("status", "final job state")
    assert _first_bad(_arrow_table([["COMPLETED"], [None, ""]])) == (
        "final-1.csv:2: final job state has no status")
