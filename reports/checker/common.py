"""Small pieces every part of the checker uses: an example of an anomaly, and how values are
shown."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
import pandas as pd

MAX_EXAMPLES = 10
DEFAULT_TOLERANCE_SECONDS = 0.25


@dataclass(frozen=True)
class Example:
    """One instance of an anomaly, as evidence: the job and the facts that decide it (its
    attempts, times, the event or fault that explains it) as data. `case` names which of
    the anomaly's forms it is; the anomaly's `say` turns the evidence into a sentence, for
    display only."""

    job_id: str
    case: str
    evidence: dict[str, Any] = field(default_factory=dict)


def objects(column: pd.Series) -> np.ndarray:
    """A column's values as a numpy array; a categorical's (the text columns of the
    deliveries and events, see `join`) as str objects with None where a value is missing,
    as it was read (a categorical's own `to_numpy` gives NaN there)."""
    if isinstance(column.dtype, pd.CategoricalDtype):
        values = column.array
        return cast(np.ndarray, np.append(values.categories.to_numpy(dtype=object),
                                          np.array([None]))[values.codes])
    return column.to_numpy()


def records(frame: pd.DataFrame) -> list[dict[str, Any]]:
    """Rows as dicts of plain Python values (much faster than DataFrame.to_dict)."""
    names = [str(c) for c in frame.columns]
    values = [objects(frame[c]).tolist() for c in frame.columns]
    return [dict(zip(names, row, strict=True)) for row in zip(*values, strict=True)]


# Where the times a person reads count from: the load's start (epoch seconds), set while a
# history is judged. Evidence keeps epoch seconds; only the sentences said from it change.
_TIME_ORIGIN: ContextVar[float | None] = ContextVar("time_origin", default=None)


@contextlib.contextmanager
def times_from(origin: float | None) -> Iterator[None]:
    """Say every time in seconds since `origin` (the load's start) while judging."""
    token = _TIME_ORIGIN.set(origin)
    try:
        yield
    finally:
        _TIME_ORIGIN.reset(token)


def fmt(seconds: float) -> str:
    """A moment as a person reads it: seconds since the load started, as on every plot and
    job story (raw epoch seconds only where a history says nothing of its start)."""
    origin = _TIME_ORIGIN.get()
    return f"{seconds:.3f}" if origin is None else f"{seconds - origin:.3f} s"


def attempt_label(value: Any) -> str:
    """An attempt number as shown: `?` where the queue sent none."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        return "?"
    return "?" if math.isnan(number) else str(int(number))


def floats(values: np.ndarray) -> np.ndarray:
    """An object array of values as read as float64: NaN for anything but a number."""
    if values.dtype == np.float64:
        return values
    return np.array([float(v) if isinstance(v, int | float) and not isinstance(v, bool)
                     else math.nan for v in values.tolist()], dtype=np.float64)


def attempt_number(value: Any) -> int | None:
    """An attempt number as evidence: None where the queue sent none."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(number) else int(number)


def shown(number: int | None) -> str:
    """An attempt number of evidence as a sentence shows it."""
    return "?" if number is None else str(number)
