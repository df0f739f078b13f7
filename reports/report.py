"""`report.html`: one self-contained page a person reads in a minute.

The verdict comes first (valid, violated, unknown, or not judged), with each anomaly's first
examples and, one click away, the whole story of the job involved. Then the throughput and
latency over time with fault windows shaded, the queue's depth and each account's load
against its limit, attempts and dead-letter causes, PostgreSQL's wait events, and what is
needed to replay the run. Plots are PNG embedded in the page, so it opens anywhere, offline.

Several run directories give one page that compares them: a table of headline figures, the
same plots overlaid, then each run's verdict.
"""

from __future__ import annotations

import base64
import html
import json
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from skiplock.reports.checker import MEANINGS
from skiplock.reports.history import HistoryError
from skiplock.reports.report_data import (
    VIOLATIONS,
    RunData,
    bin_seconds,
    dead_letter_causes,
    headline,
    job_story,
    load_run,
    span,
    verdict_word,
)
from skiplock.reports.report_plots import (
    attempts_figure,
    latency_figure,
    load_figure,
    safely,
    throughput_figure,
    waits_figure,
)

REPORT_FILE = "report.html"
EXAMPLES_SHOWN = 5

_CSS = """
body{font:14px/1.45 system-ui,-apple-system,'Segoe UI',sans-serif;margin:0;color:#222;
background:#f6f7f9}
main{max-width:1240px;margin:0 auto;padding:18px 24px 60px}
h1{font-size:20px;margin:4px 0 2px}h2{font-size:16px;margin:28px 0 8px;border-bottom:1px solid
#ddd;padding-bottom:4px}h3{font-size:14px;margin:16px 0 6px}
.sub{color:#666;font-size:13px}
.badge{display:inline-block;padding:6px 16px;border-radius:6px;font-weight:700;font-size:22px;
letter-spacing:.04em;color:#fff;margin-right:14px;vertical-align:middle}
.valid{background:#2e7d32}.violated{background:#c62828}.unknown{background:#ef8f00}
.not-checked{background:#777}
.verdict{background:#fff;border:1px solid #ddd;border-radius:8px;padding:14px 18px}
.summary{font-size:16px;vertical-align:middle}
.notes{background:#fff8e1;border:1px solid #f0d58c;border-radius:6px;padding:8px 14px;
margin:12px 0}
table{border-collapse:collapse;background:#fff;font-size:13px}
td,th{border:1px solid #ddd;padding:3px 8px;text-align:left;vertical-align:top}
th{background:#f0f1f4}td.num{text-align:right;font-variant-numeric:tabular-nums}
tr.bad td{background:#fdecea;font-weight:600}tr.zero td{color:#999}
img.plot{max-width:100%;background:#fff;border:1px solid #ddd;border-radius:6px;
display:block;margin:6px 0}
.row{display:flex;gap:16px;flex-wrap:wrap;align-items:flex-start}
details{margin:4px 0 4px 4px}summary{cursor:pointer;color:#1a56a8}
code,pre{font-family:ui-monospace,Menlo,Consolas,monospace;font-size:12px}
pre{background:#fff;border:1px solid #ddd;padding:8px;overflow:auto;max-height:420px}
.example{background:#fff;border:1px solid #e3e3e3;border-radius:6px;padding:6px 10px;
margin:6px 0}
"""

# Counts a check for the test that opens the page in a browser: every plot decoded.
_SCRIPT = """
window.addEventListener('load', function () {
  var plots = document.querySelectorAll('img.plot');
  var ok = 0;
  plots.forEach(function (img) { if (img.complete && img.naturalWidth > 0) { ok += 1; } });
  document.body.setAttribute('data-plots', String(plots.length));
  document.body.setAttribute('data-plots-rendered', String(ok));
});
"""


def _e(value: Any) -> str:
    return html.escape(str(value))


def _img(data: bytes | None, error: str | None, alt: str) -> str:
    if data is None:
        return f'<p class="notes">{_e(alt)} could not be drawn: {_e(error)}</p>'
    encoded = base64.b64encode(data).decode()
    return f'<img class="plot" alt="{_e(alt)}" src="data:image/png;base64,{encoded}">'


def _table(frame: pd.DataFrame, *, index: bool = True) -> str:
    return frame.to_html(index=index, border=0, na_rep="", float_format=lambda v: f"{v:g}")


def _badge(valid: Any, verdict_present: bool) -> str:
    word = verdict_word(valid) if verdict_present else "not checked"
    return f'<span class="badge {word.replace(" ", "-")}">{_e(word.upper())}</span>'


def _summary_sentence(run: RunData) -> str:
    counts = (run.verdict or {}).get("counts") or {}
    if not counts:
        return "no verdict: the run was not judged"
    violated = {k: v for k, v in counts.items() if k in VIOLATIONS and v}
    not_applicable = ((run.verdict or {}).get("details") or {}).get("not_applicable") or {}
    tail = (("every guarantee the queue declares held" if not_applicable
             else "every guarantee held") if not violated else
            "violated: " + ", ".join(f"{v} {k}" for k, v in violated.items()))
    if not_applicable:
        tail += f" ({len(not_applicable)} not applicable: {', '.join(not_applicable)})"
    return (f"{counts.get('enqueued', '?')} jobs enqueued, {counts.get('delivered', '?')} "
            f"deliveries, {counts.get('completed', '?')} completed, "
            f"{counts.get('failed', '?')} dead-lettered; {tail}")


def _counts_table(run: RunData) -> str:
    verdict = run.verdict or {}
    counts = verdict.get("counts") or {}
    not_judged = (verdict.get("details") or {}).get("not_judged") or {}
    not_applicable = (verdict.get("details") or {}).get("not_applicable") or {}
    rows = []
    # What was violated first: the table is read top-down.
    for key, meaning in sorted(VIOLATIONS.items(), key=lambda kv: not counts.get(kv[0])):
        value = counts.get(key, 0)
        css = "bad" if value and key not in not_judged else ("zero" if not value else "")
        note = " (not judged: a log was cut)" if key in not_judged else ""
        if key in not_applicable:
            value, note = "n/a", f" (not applicable: {not_applicable[key]})"
        rows.append(f'<tr class="{css}"><td><code>{_e(key)}</code></td>'
                    f'<td class="num">{_e(value)}</td><td>{_e(meaning + note)}</td></tr>')
    explained = counts.get("duplicate_explained", 0)
    rows.append(f'<tr><td><code>duplicate_explained</code></td><td class="num">{explained}'
                f'</td><td>{_e(MEANINGS["duplicate_explained"])}</td></tr>')
    return ("<table><tr><th>anomaly</th><th>count</th><th>meaning</th></tr>"
            + "".join(rows) + "</table>")


def _story_html(run: RunData, job_id: str) -> str:
    story = job_story(run, job_id)
    if story.empty:
        return "<p class='sub'>nothing recorded about this job</p>"
    story = story.assign(at=story["at"].map(lambda v: "" if pd.isna(v) else f"{v:.3f}"))
    story = story.rename(columns={"at": "at (s)"})
    return _table(story, index=False)


def _examples_html(run: RunData) -> str:
    examples: dict[str, list[dict[str, Any]]] = (run.verdict or {}).get("examples") or {}
    parts = []
    for kind in (*VIOLATIONS, "duplicate_explained"):
        items = [i for i in examples.get(kind) or [] if isinstance(i, dict)]
        if not items:
            continue
        shown = items[:EXAMPLES_SHOWN]
        parts.append(f"<h3><code>{_e(kind)}</code>: first {len(shown)} of "
                     f"{_e((run.verdict or {}).get('counts', {}).get(kind, len(items)))}</h3>")
        for item in shown:
            job = item.get("job_id")
            why = item.get("why", "")
            story = (f"<details><summary>the whole story of job <code>{_e(job)}</code>"
                     f"</summary>{_story_html(run, str(job))}</details>" if job else "")
            parts.append(f'<div class="example"><code>{_e(job)}</code>: {_e(why)}{story}'
                         "</div>")
    if not parts:
        return ""
    return "<h2>Anomalies and their examples</h2>" + "".join(parts)


def _headline(run: RunData) -> str | None:
    """The figures the terminal ends with, in text (those a comparison puts side by side):
    the rate delivered while the load ran, the wait for a first delivery, the retry budget."""
    figures = headline(run)
    parts = []
    rate = figures.get("deliveries/s during load")
    if rate is not None:
        parts.append(f"{rate:,.{1 if rate < 10 else 0}f} deliveries/s during the load")
    wait = "enqueue → first delivery"
    if f"{wait} p50 (s)" in figures:
        parts.append(f"{wait} p50 {figures[f'{wait} p50 (s)'] * 1000:,.0f} ms, "
                     f"p99 {figures[f'{wait} p99 (s)'] * 1000:,.0f} ms")
    if run.scenario.get("max_attempts") is not None:
        parts.append(f"max_attempts {run.scenario['max_attempts']}")
    return "; ".join(parts) or None


def _skipped_faults_html(run: RunData) -> str:
    """Faults of the schedule that did not run (a restart against a server the harness does
    not own, a kill with no lease to hit): a reader must not take their absence for a pass."""
    skipped = [f for f in run.faults if f.get("skipped")]
    if not skipped:
        return ""
    items = "".join(
        f"<li>{_e(f.get('fault'))} at {float(f['start']) - run.t0:.1f} s: "
        f"{_e(f.get('skipped'))}</li>" for f in skipped[:20])
    more = f"<li>and {len(skipped) - 20} more</li>" if len(skipped) > 20 else ""
    return (f"<p><b>Faults scheduled but not applied ({len(skipped)})</b></p>"
            f"<ul>{items}{more}</ul>")


def _verdict_html(run: RunData) -> str:
    verdict = run.verdict or {}
    reasons = verdict.get("unknown_reasons") or []
    unknown = "".join(f"<li>{_e(r)}</li>" for r in reasons)
    return (
        f'<div class="verdict">{_badge(verdict.get("valid"), run.verdict is not None)}'
        f'<span class="summary">{_e(_summary_sentence(run))}</span>'
        + (f"<p class='headline'>{_e(line)}</p>" if (line := _headline(run)) else "")
        + _skipped_faults_html(run)
        + (f"<p><b>Why unknown</b></p><ul>{unknown}</ul>" if unknown else "")
        + (f"<div style='margin-top:10px'>{_counts_table(run)}</div>" if run.verdict else "")
        + "</div>"
    )


def _notes_html(runs: Sequence[RunData]) -> str:
    items = [f"<li>{_e(run.name + ': ' if len(runs) > 1 else '')}{_e(note)}</li>"
             for run in runs for note in run.notes]
    if not items:
        return ""
    return ("<div class='notes'><b>What this report could not read</b> (the figures that need"
            f" it say so; everything else is drawn)<ul>{''.join(items)}</ul></div>")


def _settings_html(run: RunData) -> str:
    spec = run.spec or {}
    scenario = run.scenario
    postgres = spec.get("postgres") or {}
    harness = postgres.get("harness") or {}
    machine = spec.get("machine") or {}
    git = spec.get("git") or {}
    durable = harness.get("durable")
    rows = [
        ("scenario", f"{scenario.get('name', '?')}: {scenario.get('description', '')}"),
        ("backend", spec.get("backend", "?")),
        ("seed", spec.get("seed", "?")),
        ("replay", spec.get("replay") or "(not recorded by this version)"),
        ("PostgreSQL durability", "durable (fsync, synchronous_commit on)" if durable is True
         else "UNSAFE: fsync or synchronous_commit off" if durable is False
         else "not recorded"),
        *_redis_rows(spec),
        ("PostgreSQL", f"{harness.get('server_version', postgres.get('server_version_num', '?'))}"
                       f" ({harness.get('kind', '?')})"),
        ("workers / batch / rate", f"{scenario.get('workers', '?')} / "
                                   f"{scenario.get('batch', '?')} / {scenario.get('rate', '?')}"
                                   " jobs/s"),
        ("lease / HTTP timeout", f"{scenario.get('lease', '?')} s / "
                                 f"{scenario.get('http_timeout', '?')} s"),
        ("machine", f"{machine.get('cpu', '?')}, {machine.get('cpu_count', '?')} cores, "
                    f"{machine.get('memory_gib', '?')} GiB, {machine.get('system', '')} "
                    f"{machine.get('release', '')}"),
        ("Python / packages", f"{(spec.get('python') or {}).get('version', spec.get('python'))}"
                              f"; " + ", ".join(f"{k} {v}" for k, v in
                                                (spec.get("packages") or {}).items()
                                                if v is not None)),
        ("git", f"{git.get('sha', '?')}{' (uncommitted changes)' if git.get('dirty') else ''}"),
        ("ended", (run.run or {}).get("exit_reason", "?")),
    ]
    body = "".join(f"<tr><th>{_e(k)}</th><td>{_e(v)}</td></tr>" for k, v in rows)
    full = _e(json.dumps(spec, indent=2, sort_keys=True, default=str))
    return (f"<h2>Settings, versions and how to replay</h2><table>{body}</table>"
            f"<details><summary>spec.json in full</summary><pre>{full}</pre></details>")


def _redis_rows(spec: dict[str, Any]) -> list[tuple[str, str]]:
    """A run on Redis (BullMQ) says that store's durability and versions beside PostgreSQL's:
    a comparison that hid them would compare a durable queue with one that is not."""
    redis = spec.get("redis")
    if not isinstance(redis, dict):
        return []
    harness = redis.get("harness") or {}
    durable = harness.get("durable")
    policy = (f"appendonly {harness.get('appendonly', '?')}, appendfsync "
              f"{harness.get('appendfsync', '?')}, data on {harness.get('data_filesystem', '?')}")
    verdict = ("durable" if durable is True else "NOT durable: an acknowledged job can be lost"
               if durable is False else "not recorded")
    packages = spec.get("packages") or {}
    clients = ", ".join(f"{name} {packages[name]}" for name in ("bullmq", "redis")
                        if packages.get(name))
    return [("Redis durability", f"{verdict} ({policy})"),
            ("Redis", f"{harness.get('redis_version', '?')} ({redis.get('kind', '?')})"
                      + (f"; {clients}" if clients else ""))]


def _outcomes_html(run: RunData) -> str:
    causes = dead_letter_causes(run)
    table = (_table(causes.rename("jobs").to_frame().rename_axis("last error"))
             if not causes.empty else "<p class='sub'>no job was dead-lettered</p>")
    figure = _img(*safely(attempts_figure, [run]), "attempts")
    return (f"<h2>Attempts and outcomes</h2><div class='row'><div>{figure}</div><div>"
            f"<h3>Dead letters by cause</h3>{table}</div></div>")


def _single(run: RunData) -> str:
    width = bin_seconds(span([run]))
    end = span([run])
    return "".join([
        f"<h1>skiplock run report: {_e(run.name)}</h1>",
        f"<p class='sub'>{_e(run.run_dir)}</p>",
        _notes_html([run]),
        _verdict_html(run),
        "<h2>Throughput</h2>",
        _img(*safely(throughput_figure, [run], width, end), "throughput"),
        "<h2>Latency</h2>",
        _img(*safely(latency_figure, [run], width), "latency"),
        "<h2>Load per account</h2>",
        _img(*safely(load_figure, run, width, end), "queue depth and account load"),
        _outcomes_html(run),
        "<h2>PostgreSQL wait events</h2>",
        _img(*safely(waits_figure, run), "wait events"),
        _examples_html(run),
        _settings_html(run),
    ])


def _comparison(runs: Sequence[RunData]) -> str:
    width = bin_seconds(span(list(runs)))
    end = span(list(runs))
    heads = pd.DataFrame({run.name: headline(run) for run in runs})
    sections = [
        f"<h1>skiplock comparison of {len(runs)} runs</h1>",
        _notes_html(runs),
        "<h2>Headline figures</h2>", _table(heads),
        "<h2>Throughput (delivered and completed)</h2>",
        _img(*safely(throughput_figure, runs, width, end), "throughput"),
        "<h2>Latency (p50 and p99)</h2>",
        _img(*safely(latency_figure, runs, width), "latency"),
        "<h2>Attempts used</h2>", _img(*safely(attempts_figure, runs), "attempts"),
    ]
    for run in runs:
        sections += [f"<h2>{_e(run.name)}</h2>", _verdict_html(run),
                     f"<details><summary>examples and settings</summary>"
                     f"{_examples_html(run)}{_settings_html(run)}</details>"]
    return "".join(sections)


def render(runs: Sequence[RunData]) -> str:
    title = runs[0].name if len(runs) == 1 else f"{len(runs)} runs compared"
    body = _single(runs[0]) if len(runs) == 1 else _comparison(runs)
    stamp = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    return ("<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>"
            f"<title>skiplock: {_e(title)}</title><style>{_CSS}</style>"
            f"<script>{_SCRIPT}</script></head><body><main>{body}"
            f"<p class='sub'>written by skiplock report at {_e(stamp)}</p></main></body></html>")


def write_report(run_dirs: Sequence[Path], out: Path | None = None) -> Path:
    """Read the run directories and write the page; HistoryError when one is no run."""
    if not run_dirs:
        raise HistoryError("give at least one run directory")
    resolved = [Path(d).resolve() for d in run_dirs]
    if len(set(resolved)) != len(resolved):
        raise HistoryError("a run directory is given twice")
    runs = [load_run(Path(d)) for d in run_dirs]
    path = out if out is not None else (
        Path(run_dirs[0]) / REPORT_FILE if len(runs) == 1 else Path(REPORT_FILE))
    text = render(runs)
    path.parent.mkdir(parents=True, exist_ok=True)
    _write_whole(path, text)
    return path


def _what_broke(row: dict[str, Any]) -> str:
    parts = [_e(row.get("message") or "")]
    if row.get("replay"):
        parts.append(f"<div>replay: <code>{_e(row['replay'])}</code></div>")
    if row.get("details"):
        parts.append(f"<details><summary>first examples</summary>"
                     f"<pre style='white-space:pre-wrap'>{_e(row['details'])}</pre></details>")
    return "".join(parts)


def _write_whole(path: Path, text: str) -> None:
    """Write a page whole or not at all: a reader never sees half of one, and a write that
    fails (a full disk) leaves no `.tmp` behind."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_index(title: str, rows: Sequence[dict[str, Any]], path: Path) -> Path:
    """A page listing several judged runs (a gate's cases): each row's `case`, `outcome`
    (pass, FAIL, unknown, ERROR), `seconds`, `message` and `run_dir`, linked to that run's
    own report.html where it has one; optional `replay` (the command that runs the case
    again) and `details` (its first examples, folded)."""
    word = {"pass": "valid", "FAIL": "violated", "unknown": "unknown"}
    body = []
    for row in rows:
        outcome = str(row.get("outcome", "ERROR"))
        css = word.get(outcome, "not-checked")
        run_dir = row.get("run_dir")
        page = Path(run_dir) / REPORT_FILE if run_dir else None
        if page is not None and page.exists():
            link = os.path.relpath(page, path.parent)
            cell = f"<a href='{_e(link)}'>{_e(Path(str(run_dir)).name)}</a>"
        else:
            cell = _e(Path(str(run_dir)).name if run_dir else "(no run directory)")
        body.append(
            f"<tr><td>{_e(row.get('case', '?'))}</td><td><span class='badge {css}' "
            f"style='font-size:13px;padding:2px 8px'>{_e(outcome)}</span></td>"
            f"<td class='num'>{float(row.get('seconds') or 0):.0f}</td>"
            f"<td>{_what_broke(row)}</td><td>{cell}</td></tr>")
    failed = sum(1 for row in rows if row.get("outcome") != "pass")
    summary = ("every case passed" if rows and not failed else
               f"{failed} of {len(rows)} case(s) did not pass")
    text = ("<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>"
            f"<title>skiplock: {_e(title)}</title><style>{_CSS}</style>"
            f"<script>{_SCRIPT}</script></head><body><main><h1>{_e(title)}</h1>"
            f"<p class='summary'>{_e(summary)}</p><table><tr><th>case</th><th>outcome</th>"
            "<th>seconds</th><th>what broke</th><th>run report</th></tr>"
            f"{''.join(body)}</table></main></body></html>")
    path.parent.mkdir(parents=True, exist_ok=True)
    _write_whole(path, text)
    return path
