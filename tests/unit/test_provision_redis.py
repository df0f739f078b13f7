"""Redis provisioning's pure parts: what a URL shows, and what each durability class runs."""

from __future__ import annotations

import pytest

from scenarios.provision_redis import durability_args, redact_url


@pytest.mark.parametrize(("url", "shown"), [
    ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),
    ("redis://:s3cret@host:6379/0", "redis://***@host:6379/0"),
    ("redis://user:s3cret@host:6379/1", "redis://user:***@host:6379/1"),
    ("rediss://token@host/0", "rediss://***@host/0"),
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
