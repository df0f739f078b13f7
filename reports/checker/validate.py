"""Validating what was read: the parts of one kind of log as one table (`Table`), whose
number columns are refused when they hold anything but finite numbers (or negative times),
and whose required text columns are refused when empty; each bad value is named by file and
line."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import cast

import numpy as np
import pandas as pd
import pyarrow as pa  # type: ignore[import-untyped]
import pyarrow.compute as pc  # type: ignore[import-untyped]

from skiplock.reports.checker.common import floats
from skiplock.reports.checker.read import TOKENS, Coded, Nested, Part, data_dict
from skiplock.reports.history import (
    HistoryError,
)


class Columns(dict[str, np.ndarray]):
    """A table's columns by name. A text column every file coded (`coded`) becomes an object
    array only when it is first looked up: most are only compared, counted or made into
    categoricals, from their codes, and a million-row object array is fresh memory to fill."""

    def __init__(self, columns: dict[str, np.ndarray], coded: dict[str, Coded]) -> None:
        super().__init__(columns)
        self._coded = coded

    def __missing__(self, key: str) -> np.ndarray:
        values = self._coded[key].objects()
        self[key] = values
        return values


@dataclass
class Table:
    """Columns read from one or more files of one kind, with where each row came from."""

    columns: Columns
    job_id: pa.ChunkedArray
    tokens: dict[str, pa.ChunkedArray]  # lease tokens, kept in Arrow (see `read.Part`)
    nested: dict[str, Nested]
    typed: bool  # every file went through Arrow
    source: list[str]  # file per file appended
    rows_per_file: list[int]
    header_lines: list[int]  # per file: lines before the first record
    lines: list[list[int] | None]  # per file: line of each row (None: rows are lines)
    coded: dict[str, Coded] = field(default_factory=dict)  # text columns every file coded

    def where(self, row: int) -> str:
        """"file:line" of a row."""
        offset = row
        for name, count, header, lines in zip(self.source, self.rows_per_file,
                                              self.header_lines, self.lines, strict=True):
            if offset < count:
                return f"{name}:{header + 1 + offset if lines is None else lines[offset]}"
            offset -= count
        return "?"

    def number(self, key: str, what: str, *, required: bool, time: bool = False) -> np.ndarray:
        """A float64 column, NaN for null; a value that is not a number is bad input, and so
        is an infinite one (no writer writes one) and, for a `time` (seconds since the
        epoch), a negative one."""
        values = self.columns[key]
        array: np.ndarray
        if values.dtype == np.float64:
            array = values
        else:
            ok_types = [v is None or (isinstance(v, int | float) and not isinstance(v, bool))
                        for v in values.tolist()]
            if not all(ok_types):
                row = ok_types.index(False)
                raise HistoryError(f"{self.where(row)}: {what} field {key} is not a number")
            array = values.astype(np.float64)
        if required and np.isnan(array).any():
            row = int(np.flatnonzero(np.isnan(array))[0])
            raise HistoryError(f"{self.where(row)}: {what} field {key} is not a number")
        refuse_out_of_range(array, lambda row: f"{self.where(row)}: {what} field {key}",
                             time=time)
        return array

    def text(self, key: str, rows: np.ndarray) -> np.ndarray:
        """A text column's values at `rows` as an object array, made from the codes when
        the whole column has not been."""
        coded = self.coded.get(key)
        if coded is not None and key not in self.columns:
            return coded.objects(rows)
        return cast(np.ndarray, self.columns[key][rows])

    def categorical(self, key: str) -> pd.Categorical:
        """A text column (of few distinct values) as a categorical, its categories sorted
        as pandas sorts them; made from the codes Arrow's dictionary gave when every file
        was read by Arrow, so no value is hashed again."""
        coded = self.coded.get(key)
        if coded is None:
            return pd.Categorical(pd.Series(self.columns[key], dtype=object))
        order = np.argsort(coded.labels, kind="stable")
        rank = np.empty(len(order) + 1, dtype=np.int64)
        rank[order] = np.arange(len(order))
        rank[-1] = -1  # null stays null
        return pd.Categorical.from_codes(
            rank[coded.codes], categories=pd.Index(coded.labels[order], dtype=object))

    def require_str(self, key: str, what: str) -> None:
        if key == "job_id":
            # Anything but a string was read as null.
            missing = pc.or_kleene(pc.is_null(self.job_id), pc.equal(self.job_id, ""))
            bad = np.flatnonzero(missing.to_numpy(zero_copy_only=False))
        elif key in self.coded:
            coded = self.coded[key]
            empty = np.append(coded.labels == "", True)  # -1, null, picks the True
            bad = np.flatnonzero(empty[coded.codes])
        else:
            # Read line by line somewhere (a file Arrow could not parse): values of any type.
            bad = np.array([i for i, v in enumerate(self.columns[key].tolist())
                            if type(v) is not str or not v], dtype=np.int64)
        if len(bad):
            raise HistoryError(f"{self.where(int(bad[0]))}: {what} has no {key}")


def refuse_out_of_range(array: np.ndarray, where: Callable[[int], str], *,
                        time: bool) -> None:
    """A HistoryError for the first infinite value of `array` (NaN is null), or for a `time`
    the first negative one: no writer writes either, and judging with them would make up
    anomalies."""
    bad = np.isinf(array)
    if time:
        bad |= array < 0
    if bad.any():
        row = int(np.flatnonzero(bad)[0])
        want = "a time (seconds since the epoch, not negative)" if time else "a finite number"
        raise HistoryError(f"{where(row)} is {float(array[row])!r}, not {want}")


def refuse_bad_times(table: Table, nested: Nested, names: Sequence[str], what: str) -> None:
    """`refuse_out_of_range` for the times held in a nested column (a worker event's own
    fields): the judge reads them only for the few events that explain something, but a bad
    one must not be judged at all."""
    # `starts` has one entry even without parts.
    for part, start in zip(nested.parts, nested.starts.tolist(), strict=False):
        for name in names:
            if isinstance(part, list):
                values = floats(np.array([data_dict(v).get(name) for v in part], dtype=object))
            elif part.type.get_field_index(name) >= 0:
                values = pc.struct_field(part, name).to_numpy(zero_copy_only=False)
            else:
                continue

            def where(row: int, at: int = start, field: str = name) -> str:
                return f"{table.where(at + row)}: {what} field {field}"

            refuse_out_of_range(np.asarray(values, dtype=np.float64), where, time=True)


def table_of(parts: Sequence[Part], schema: pa.Schema) -> Table:
    """The parts of one kind of file, as one table."""
    columns: dict[str, np.ndarray] = {}
    coded: dict[str, Coded] = {}
    for f in schema:
        if pa.types.is_struct(f.type) or f.name == "job_id" or f.name in TOKENS:
            continue
        if parts and all(f.name in p.coded for p in parts):
            # Made into objects only if looked up (`Columns`).
            coded[f.name] = _merged([p.coded[f.name] for p in parts])
            continue
        # A text column of a file read line by line, or a number column.
        got = [p.columns[f.name] if f.name in p.columns else p.coded[f.name].objects()
               for p in parts]
        if not got:
            columns[f.name] = np.empty(0, dtype=object)
        elif len(got) == 1:
            columns[f.name] = got[0]
        elif all(a.dtype == np.float64 for a in got):
            columns[f.name] = np.concatenate(got)
        else:
            columns[f.name] = np.concatenate([a.astype(object) for a in got])
    counts = [p.rows for p in parts]
    starts = np.cumsum([0, *counts[:-1]], dtype=np.int64)
    nested = {f.name: Nested([p.nested[f.name] for p in parts], starts)
              for f in schema if pa.types.is_struct(f.type)}
    job_id = pa.chunked_array([c for p in parts for c in p.job_id.chunks], pa.string())
    tokens = {name: pa.chunked_array([c for p in parts for c in p.tokens[name].chunks],
                                     pa.string())
              for name in TOKENS if name in schema.names}
    return Table(columns=Columns(columns, coded), job_id=job_id, tokens=tokens, nested=nested,
                  typed=all(p.typed for p in parts),
                  source=[str(p.path) for p in parts], rows_per_file=counts,
                  header_lines=[p.header_lines for p in parts], lines=[p.lines for p in parts],
                  coded=coded)


def _merged(parts: Sequence[Coded]) -> Coded:
    """Files' codes of one column as codes into the labels of them all."""
    if len(parts) == 1:
        return parts[0]
    labels = pd.Index(np.concatenate([p.labels for p in parts]), dtype=object).unique()
    codes = []
    for part in parts:
        # Each file's labels to the merged ones; -1 (null) picks the -1 appended last.
        to_merged = np.append(labels.get_indexer(pd.Index(part.labels, dtype=object)), -1)
        codes.append(to_merged[part.codes])
    return Coded(np.concatenate(codes), np.asarray(labels, dtype=object))
