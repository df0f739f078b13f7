"""The report's figures (matplotlib, drawn off-screen to PNG).

Every time plot shares one axis, seconds since the load started, with the run's phases
marked and, for one run, every fault window shaded and named, so a dip in throughput lines
up with what caused it. Several runs are drawn over each other, one colour per run.
"""

from __future__ import annotations

import io
import math
from collections.abc import Callable, Sequence
from typing import Any

import matplotlib

matplotlib.use("Agg")  # no display: figures only ever become PNG bytes

import matplotlib.pyplot as plt
import pandas as pd
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from skiplock.reports.objectives import ObjectiveError, Objectives
from skiplock.reports.report_data import (
    RunData,
    attempts_table,
    in_flight_by_account,
    latencies,
    outstanding_by_account,
    percentiles_over_time,
    throughput,
    wait_samples,
)

WIDTH_INCHES = 11.0
DPI = 110
_FAULT_COLOURS = ("#e4572e", "#8e44ad", "#f39c12", "#16a085", "#c0392b", "#2c3e50",
                  "#d35400", "#7f8c8d", "#27ae60", "#2980b9")
_SERIES_COLOURS = {"enqueued": "#4c72b0", "delivered": "#55a868", "completed": "#222222",
                   "dead-lettered": "#c44e52", "failed by script": "#937860"}
_RUN_STYLES = ("-", "--", ":", "-.")
# Every time axis: the warm-up's start is 0, as the verdict's sentences count (the "load →"
# mark is where the full rate began).
TIME_AXIS = "seconds since the load started (warm-up at 0)"


def png(figure: Figure, *, tight: bool = True) -> bytes:
    """The figure as PNG bytes. `tight=False` for a figure laid out by hand: measuring a
    log axis's tick labels for a tight box costs most of a second."""
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=DPI, bbox_inches="tight" if tight else None)
    plt.close(figure)
    return buffer.getvalue()


def _mark_phases(ax: Axes, run: RunData, label: bool) -> None:
    for phase in run.phases:
        start = phase.get("start")
        if phase.get("name") in ("load", "drain") and isinstance(start, int | float):
            x = float(start) - run.t0
            ax.axvline(x, color="#999999", linestyle=":", linewidth=1)
            if label:
                # At the foot of the axes: legends and fault names sit at the top.
                ax.annotate(f"{phase['name']} →", (x, 0.0), xycoords=("data", "axes fraction"),
                            xytext=(3, 3), textcoords="offset points", fontsize=8,
                            color="#666666")


def _shade_faults(ax: Axes, run: RunData, label: bool) -> list[Patch]:
    """Shade each applied fault's window; returns legend handles, one per fault kind."""
    kinds: dict[str, str] = {}
    applied = [f for f in run.faults if not f.get("skipped")]
    for fault in applied:
        kind = str(fault.get("fault"))
        colour = kinds.setdefault(kind, _FAULT_COLOURS[len(kinds) % len(_FAULT_COLOURS)])
        start = float(fault["start"]) - run.t0
        end_raw = fault.get("end")
        end = (float(end_raw) - run.t0 if isinstance(end_raw, int | float)
               and math.isfinite(end_raw) else start)
        # A fault that is one instant (a kill) still gets a visible band.
        ax.axvspan(start, max(end, start + 0.15), color=colour, alpha=0.18, linewidth=0)
        if label and len(applied) <= 12:
            ax.annotate(f"{kind} {fault.get('target') or ''}".strip(), (start, 0.98),
                        xycoords=("data", "axes fraction"), rotation=90, va="top",
                        ha="right", fontsize=7, color=colour)
    return [Patch(color=c, alpha=0.35, label=k) for k, c in kinds.items()]


def _decorate(ax: Axes, runs: Sequence[RunData], *, first: bool,
              name_faults: bool = False) -> list[Patch]:
    """Phases marked (named on the `first` panel), faults shaded (named where `name_faults`:
    on a wide panel whose legend sits outside it), and one x range for every time plot."""
    handles: list[Patch] = []
    if len(runs) == 1:
        _mark_phases(ax, runs[0], label=first)
        handles = _shade_faults(ax, runs[0], label=name_faults)
    ax.grid(True, alpha=0.3)
    ax.set_xlim(0, _axis_end(runs))
    return handles


def _axis_end(runs: Sequence[RunData]) -> float | None:
    """Where every time axis ends: the last phase's end (the drain's), on the run's axis."""
    ends = [float(p["end"]) - run.t0 for run in runs for p in run.phases
            if isinstance(p.get("end"), int | float) and math.isfinite(p["end"])]
    return max(ends) if ends else None


def _empty(ax: Axes, message: str) -> None:
    ax.text(0.5, 0.5, message, ha="center", va="center", transform=ax.transAxes,
            fontsize=10, color="#777777")
    ax.set_xticks([])
    ax.set_yticks([])


def throughput_figure(runs: Sequence[RunData], width: float, end: float) -> bytes:
    figure, ax = plt.subplots(figsize=(WIDTH_INCHES, 3.6))
    drawn = False
    for index, run in enumerate(runs):
        style = _RUN_STYLES[index % len(_RUN_STYLES)]
        for name, series in throughput(run, width, end).items():
            if len(runs) > 1 and name not in ("delivered", "completed"):
                continue
            label = name if len(runs) == 1 else f"{name}: {run.name}"
            if name == "failed by script":
                # The target's scripted faults, shaded under the rates as faults are.
                ax.fill_between(series.index, series.to_numpy(), step="mid", linewidth=0,
                                color=_SERIES_COLOURS[name], alpha=0.35, label=label)
                continue
            ax.plot(series.index, series.to_numpy(), style, color=_SERIES_COLOURS[name],
                    label=label, linewidth=1.4 if name != "completed" else 1.0)
            drawn = True
    if not drawn:
        _empty(ax, "no enqueue, delivery or worker log could be read")
        return png(figure)
    faults = _decorate(ax, runs, first=True, name_faults=True)
    ax.set_ylabel("per second")
    ax.set_xlabel(TIME_AXIS)
    ax.set_title(f"Throughput ({width:g} s bins)", loc="left", fontsize=11)
    lines, names = ax.get_legend_handles_labels()
    ax.legend(handles=[*lines, *faults],
              labels=[*names, *(f"fault: {p.get_label()}" for p in faults)],
              fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.set_ylim(bottom=0)
    return png(figure)


def latency_figure(runs: Sequence[RunData], width: float) -> bytes:
    names = ("enqueue → claim", "enqueue → first delivery", "HTTP call")
    figure, axes = plt.subplots(1, 3, figsize=(WIDTH_INCHES, 3.4), sharex=True)
    for column, (ax, name) in enumerate(zip(axes, names, strict=True)):
        drawn = False
        for index, run in enumerate(runs):
            frame = latencies(run).get(name)
            if frame is None or frame.empty:
                continue
            table = percentiles_over_time(frame, width)
            style = _RUN_STYLES[index % len(_RUN_STYLES)]
            suffix = "" if len(runs) == 1 else f" {run.name}"
            for q, colour in (("p50", "#4c72b0"), ("p95", "#dd8452"), ("p99", "#c44e52")):
                if len(runs) > 1 and q == "p95":
                    continue
                ax.plot(table.index, table[q].to_numpy(), style, color=colour,
                        label=q + suffix, linewidth=1.2)
            drawn = True
        if not drawn:
            _empty(ax, f"{name}:\nnot recorded")
            continue
        if name == "enqueue → first delivery" and len(runs) == 1:
            _objective_lines(ax, runs[0])
        _decorate(ax, runs, first=column == 0)
        ax.set_yscale("log")
        ax.set_title(name, fontsize=10)
        ax.set_xlabel(TIME_AXIS, fontsize=8)
        if column == 0:
            ax.set_ylabel("seconds (log)")
            ax.legend(fontsize=7, loc="upper left")
        ax.tick_params(labelsize=8)
    figure.suptitle(f"Latency percentiles over time ({width:g} s bins)", x=0.01, ha="left",
                    fontsize=11)
    figure.subplots_adjust(left=0.085, right=0.99, bottom=0.15, top=0.82, wspace=0.22)
    return png(figure, tight=False)


# How each latency objective is drawn on the first-delivery panel (its bound, a level line).
_OBJECTIVE_STYLES = {"first_delivery_p50": ("#4c72b0", "p50"),
                     "first_delivery_p99": ("#c44e52", "p99"),
                     "oldest_due_age": ("#222222", "oldest")}


def _objective_lines(ax: Any, run: RunData) -> None:
    """The run's latency objectives as level lines, labelled at the right edge: solid where
    it bounds every account, dotted for accounts alone, dashed for faults' windows; one line
    and one label per bound, naming every scope that has it."""
    judged = (run.verdict or {}).get("details", {}).get("objectives")
    try:
        objectives = Objectives.from_mapping(
            judged if judged is not None else run.scenario.get("objectives"))
    except ObjectiveError:
        return
    scopes: dict[tuple[str, float, bool], list[str]] = {}
    for bounds, scope, faults in ((objectives.overall, "all", False),
                                  (objectives.during_faults, "in faults", True),
                                  *((b, a, False) for a, b in objectives.accounts.items())):
        for key, bound in bounds.items():
            if key in _OBJECTIVE_STYLES:
                scopes.setdefault((key, bound, faults), []).append(scope)
    for (key, bound, faults), names in scopes.items():
        colour, short = _OBJECTIVE_STYLES[key]
        style = "--" if faults else "-" if "all" in names else ":"
        ax.axhline(bound, color=colour, linestyle=style, linewidth=0.9, alpha=0.8)
        ax.annotate(f"{short} bound: {', '.join(names)}", (1.0, bound),
                    xycoords=("axes fraction", "data"), xytext=(-2, 2),
                    textcoords="offset points", ha="right", va="bottom", fontsize=6.5,
                    color=colour)


def load_figure(run: RunData, width: float, end: float) -> bytes:
    """Queue depth and in-flight work; each account's unfinished jobs; and each account's
    in-flight deliveries against its limit."""
    figure, (left, middle, right) = plt.subplots(1, 3, figsize=(WIDTH_INCHES, 3.4))
    samples = run.samples
    if samples is not None and {"time", "queue_depth", "in_flight"} <= set(samples.columns):
        at = samples["time"] - run.t0
        left.plot(at, samples["queue_depth"], color="#4c72b0", label="queued (pending + "
                  "retrying)")
        left.plot(at, samples["in_flight"], color="#dd8452", label="in flight (leased)")
        _decorate(left, [run], first=True)
        left.legend(fontsize=8, loc="upper right")
        left.set_ylim(bottom=0)
    else:
        _empty(left, "samples.csv not available")
    left.set_title("Queue depth (sampled each second)", fontsize=10)
    left.set_xlabel(TIME_AXIS, fontsize=8)
    limits = run.limits()
    outstanding = outstanding_by_account(run, width, end)
    table = in_flight_by_account(run, width)
    # One colour per account in both panels.
    colour = {account: f"C{index % 10}" for index, account in enumerate(
        sorted(set(outstanding.columns) | set(table.columns), key=str))}
    if outstanding.empty:
        _empty(middle, "no enqueue or worker log")
    else:
        ranked = sorted(outstanding.columns, key=lambda a: -outstanding[a].max())[:6]
        for account in ranked:
            middle.step(outstanding.index, outstanding[account].to_numpy(), where="post",
                        color=colour[account], label=account, linewidth=1.2)
        _decorate(middle, [run], first=False)
        middle.legend(fontsize=8, loc="upper right")
        middle.set_ylim(bottom=0)
    middle.set_title("Unfinished jobs per account", fontsize=10)
    middle.set_xlabel(TIME_AXIS, fontsize=8)
    if table.empty:
        _empty(right, "no delivery log")
    else:
        ranked = sorted(table.columns, key=lambda a: (a not in limits, -table[a].max()))[:6]
        for account in ranked:
            right.step(table.index, table[account].to_numpy(), where="mid",
                       color=colour[account],
                       label=f"{account} (limit {limits[account]})" if account in limits
                       else f"{account} (no limit)", linewidth=1.2)
            if account in limits:
                right.axhline(limits[account], color=colour[account], linestyle="--",
                              linewidth=0.9)
        _decorate(right, [run], first=False)
        right.legend(fontsize=8, loc="upper right")
        right.set_ylim(bottom=0)
    # The target's count includes calls their worker already gave up on at its timeout,
    # which the checker does not hold against the limit: a peak above it is a lead, not a
    # verdict.
    right.set_title("In flight at the target vs limit (dashed)", fontsize=10)
    right.set_xlabel(TIME_AXIS, fontsize=8)
    figure.tight_layout()
    return png(figure)


def attempts_figure(runs: Sequence[RunData]) -> bytes:
    figure, ax = plt.subplots(figsize=(WIDTH_INCHES / 2, 3.2))
    tables = [(run, attempts_table(run)) for run in runs]
    if all(table.empty for _, table in tables):
        _empty(ax, "final_jobs.csv not available")
        return png(figure)
    if len(runs) == 1:
        table = tables[0][1]
        table.plot.bar(stacked=True, ax=ax, color=[_status_colour(s) for s in table.columns],
                       width=0.7)
    else:
        totals = pd.DataFrame({run.name: table.sum(axis=1) for run, table in tables
                               if not table.empty}).fillna(0)
        totals.plot.bar(ax=ax, width=0.8)
    ax.set_xlabel("attempts used (final snapshot)")
    ax.set_ylabel("jobs")
    ax.set_title("Jobs by attempts used and final status", loc="left", fontsize=10)
    ax.tick_params(axis="x", rotation=0)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    return png(figure)


def _status_colour(status: str) -> str:
    return {"COMPLETED": "#55a868", "FAILED": "#c44e52", "PENDING": "#4c72b0",
            "RETRYING": "#dd8452", "PROCESSING": "#8172b3"}.get(status, "#999999")


def waits_figure(run: RunData) -> bytes:
    figure, ax = plt.subplots(figsize=(WIDTH_INCHES, 3.2))
    table, connected = wait_samples(run)
    if connected.empty:
        _empty(ax, "waits.csv not available: no wait events were sampled")
        return png(figure)
    if not table.empty:
        order = table.sum().sort_values(ascending=False).index
        top = list(order[:7])
        shown = table[top].copy()
        if len(order) > 7:
            shown["other"] = table[list(order[7:])].sum(axis=1)
        ax.stackplot(shown.index, shown.T.to_numpy(), labels=list(shown.columns), alpha=0.85,
                     step="mid")
    ax.plot(connected.index, connected.to_numpy(), color="#333333", linewidth=0.8,
            linestyle="--", label="connected sessions")
    _decorate(ax, [run], first=True, name_faults=True)
    ax.set_ylim(bottom=0)
    ax.set_ylabel("sessions")
    ax.set_xlabel(TIME_AXIS)
    ax.set_title("PostgreSQL sessions by wait event (pg_stat_activity, once a second; CPU = "
                 "active, waiting on nothing)", loc="left", fontsize=10)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return png(figure)


Plot = Callable[..., bytes]


def safely(plot: Plot, *args: Any) -> tuple[bytes | None, str | None]:
    """A figure, or why it could not be drawn: one bad series must not cost the report."""
    try:
        return plot(*args), None
    except Exception as exc:
        plt.close("all")
        return None, f"{type(exc).__name__}: {exc}"
