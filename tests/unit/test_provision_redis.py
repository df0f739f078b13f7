"""Redis provisioning's pure parts: what a URL shows, and what each durability class runs."""

from __future__ import annotations

import pytest

from skiplock.scenarios.servers.redis import durability_args, redact_url


@pytest.mark.parametrize(("url", "shown"), [
    ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),
    ("redis://:s3cret@host:6379/0", "redis://***@host:6379/0"),
    ("redis://user:s3cret@host:6379/1", "redis://user:***@host:6379/1"),
    ("rediss://token@host/0", "rediss://***@host/0"),
    ("redis://127.0.0.1:6379/0?password=s3cret", "redis://127.0.0.1:6379/0?password=***"),
    ("redis://h/0?socket_timeout=2&Password=s3cret", "redis://h/0?socket_timeout=2&Password=***"),
    ("redis://[::1]:6379/0", "redis://[::1]:6379/0"),
    ("redis://:s3cret@[::1]:6379/0", "redis://***@[::1]:6379/0"),
])
def test_a_url_is_shown_without_its_secret(url: str, shown: str) -> None:
    assert redact_url(url) == shown


def test_an_unparsable_url_is_not_echoed() -> None:
    assert "s3cret" not in redact_url("redis://:s3cret@host:notaport/0")


def test_always_fsyncs_every_write_and_off_keeps_nothing() -> None:
    assert durability_args("always") == ["--appendonly", "yes", "--appendfsync", "always",
                                         "--save", ""]
    assert durability_args("everysec")[3] == "everysec"
    assert durability_args("off") == ["--appendonly", "no", "--save", ""]



def test_the_attempt_is_bullmqs_own_count_and_each_pick_its_own_lease() -> None:
    """BullMQ's `attempts` and its backoff count finished attempts (`attemptsMade`); a pick
    after a stall keeps the number and is told apart by its lease token (job id and lock
    token), also when two jobs fetched in one pass share a lock token."""
    from types import SimpleNamespace

    from skiplock.queue_impl.bullmq_worker import lease_of
    from skiplock.queue_impl.config import DispatcherConfig

    def job(made: int, job_id: str = "6bab294e-e54c-4551-a933-0197328a189a") -> SimpleNamespace:
        return SimpleNamespace(id=job_id, attemptsStarted=made + 2, attemptsMade=made,
                               opts={"attempts": 3},
                               data={"account_id": "a", "target_url": "http://h/", "payload": {}})

    config = DispatcherConfig()
    assert lease_of(job(0), "w:1", config, "w").attempt == 1
    assert lease_of(job(1), "w:2", config, "w").attempt == 2  # after one failed attempt
    stalled, again = lease_of(job(0), "w:1", config, "w"), lease_of(job(0), "w:7", config, "w")
    assert stalled.attempt == again.attempt and stalled.lease_token != again.lease_token
    other = job(0, "0d3f3f1e-4b8a-4c3e-9a55-3f0c3f2b1a10")
    assert lease_of(other, "w:1", config, "w").lease_token != stalled.lease_token
