"""Redis provisioning's pure parts: what a URL shows, and what each durability class runs."""

from __future__ import annotations

import pytest

from scenarios.provision_redis import durability_args, redact_url


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



def test_the_attempt_counts_every_pick_as_bullmq_records_it() -> None:
    """BullMQ counts a pick in `attemptsStarted` before the processor runs; `attemptsMade`
    only counts finished attempts, so a pick after a stall must not reuse the number."""
    from types import SimpleNamespace

    from queue_impl.bullmq_worker import lease_of
    from queue_impl.dispatcher import DispatcherConfig

    def job(started: int, made: int) -> SimpleNamespace:
        return SimpleNamespace(id="6bab294e-e54c-4551-a933-0197328a189a", attemptsStarted=started,
                               attemptsMade=made, opts={"attempts": 3},
                               data={"account_id": "a", "target_url": "http://h/", "payload": {}})

    config = DispatcherConfig()
    assert lease_of(job(2, 0), "w:7", config, "w").attempt == 2  # picked again after a stall
    assert lease_of(job(1, 0), "w:1", config, "w").attempt == 1
    assert lease_of(job(0, 1), "w:2", config, "w").attempt == 2  # stored by an older BullMQ
    assert lease_of(job(1, 0), "w:1", config, "w").lease_token != \
        lease_of(job(1, 0), "w:2", config, "w").lease_token
