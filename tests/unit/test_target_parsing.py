"""The echo target's input checks: hosts, names, and job payloads. No sockets."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from skiplock.chaos.target import _parse_script, check_host, check_name, deliveries_path, url_for
from skiplock.reports.history import Behaviour, JobScript, Step


@pytest.mark.parametrize(
    ("host", "bound"),
    [
        ("127.0.0.1", "127.0.0.1"),
        ("127.0.0.2", "127.0.0.2"),
        ("::1", "::1"),
        ("localhost", "127.0.0.1"),
    ],
)
def test_loopback_hosts_are_accepted(host: str, bound: str) -> None:
    assert check_host(host) == bound


@pytest.mark.parametrize(
    "host", ["0.0.0.0", "::", "10.1.2.3", "192.168.0.1", "8.8.8.8", "example.com", ""]
)
def test_other_hosts_are_refused_in_one_line(host: str) -> None:
    with pytest.raises(ValueError, match=r"127\.0\.0\.1, ::1 or localhost") as info:
        check_host(host)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("name", ["target-0", "t1", "a.b_c-d"])
def test_good_names(name: str) -> None:
    assert check_name(name) == name


@pytest.mark.parametrize("name", ["", "../x", "a/b", ".hidden", "x" * 65, "sp ace"])
def test_names_that_would_not_make_a_safe_file_name_are_refused(name: str) -> None:
    with pytest.raises(ValueError, match="target name"):
        check_name(name)


def test_url_brackets_ipv6() -> None:
    assert url_for("127.0.0.1", 8080) == "http://127.0.0.1:8080"
    assert url_for("::1", 8080) == "http://[::1]:8080"


def test_each_target_logs_to_its_own_csv_file() -> None:
    assert deliveries_path(Path("run"), "target-1") == Path("run/deliveries/target-1.csv")


def test_script_round_trips_from_the_payload() -> None:
    script = JobScript(
        name="fail-twice",
        first=Step(behaviour=Behaviour.STATUS, status=503),
        times=2,
        then=Step(behaviour=Behaviour.SLOW, seconds=0.5),
    )
    parsed = _parse_script(json.dumps({"script": script.to_json(), "x": 1}).encode())
    assert parsed == script
    assert isinstance(parsed, JobScript)
    assert [parsed.step_for(n).behaviour for n in (1, 2, 3, 4)] == [
        Behaviour.STATUS,
        Behaviour.STATUS,
        Behaviour.SLOW,
        Behaviour.SLOW,
    ]


def test_no_script_means_succeed() -> None:
    parsed = _parse_script(b'{"anything": true}')
    assert isinstance(parsed, JobScript)
    assert parsed.step_for(1).behaviour is Behaviour.OK
    assert parsed.step_for(100).behaviour is Behaviour.OK


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (b"", "empty body"),
        (b"{nope", "not JSON"),
        (b"[1, 2]", "not a JSON object"),
        (b'{"script": {"first": {"behaviour": "explode"}}}', "bad script"),
        (b'{"script": {"name": "x"}}', "bad script"),
        (b'{"script": "ok"}', "bad script"),
        (b'{"script": {"first": {"behaviour": "status", "status": 99}}}', "not 200-599"),
        (b'{"script": {"first": {"behaviour": "slow", "seconds": -1}}}', "negative"),
    ],
)
def test_payloads_the_target_cannot_obey_say_why(body: bytes, reason: str) -> None:
    parsed = _parse_script(body)
    assert isinstance(parsed, str)
    assert reason in parsed
