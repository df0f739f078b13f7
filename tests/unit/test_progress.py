"""The live sampler's raw anomaly signals, from hand-written run files."""

from __future__ import annotations

from pathlib import Path

from reports.history import DELIVERIES_DIR, ENQUEUES_FILE, JsonlWriter
from scenarios.progress import Sampler, _table


def _delivery(job: str, account: str, in_flight: int) -> dict[str, object]:
    return {"job_id": job, "account": account, "status": 200, "account_in_flight": in_flight}


def test_sampler_counts_what_the_target_log_already_shows(tmp_path: Path) -> None:
    with JsonlWriter(tmp_path / ENQUEUES_FILE) as enq:
        for job in ("a", "b"):
            enq.write({"type": "invoke", "job_id": job, "max_attempts": 2})
            enq.write({"type": "ok", "job_id": job})
    sampler = Sampler(tmp_path, dsn=None, schema="s", limits={"acme": 2, "free": None})
    with JsonlWriter(tmp_path / DELIVERIES_DIR / "t.jsonl") as dels:
        dels.write(_delivery("a", "acme", 1))
        dels.write(_delivery("a", "acme", 2))
        dels.write(_delivery("a", "acme", 3))  # third of max 2, and above acme's limit
        dels.write(_delivery("b", "free", 50))  # unlimited account: never over
        dels.write(_delivery("ghost", "acme", 1))  # never invoked
    sample = sampler.sample("load")
    assert (sample.unexpected, sample.over_attempts, sample.over_limit) == (1, 1, 1)
    assert sample.delivered == 5 and sample.enqueued == 2

    values = [str(v) for v in _table(sample, "t").columns[1].cells]
    assert "unexpected 1, over max_attempts 1, over account limit 1" in values


def test_a_clean_history_shows_no_anomaly(tmp_path: Path) -> None:
    with JsonlWriter(tmp_path / ENQUEUES_FILE) as enq:
        enq.write({"type": "invoke", "job_id": "a", "max_attempts": 3})
    with JsonlWriter(tmp_path / DELIVERIES_DIR / "t.jsonl") as dels:
        dels.write(_delivery("a", "acme", 1))
    sample = Sampler(tmp_path, dsn=None, schema="s", limits={"acme": 1}).sample("load")
    assert (sample.unexpected, sample.over_attempts, sample.over_limit) == (0, 0, 0)
