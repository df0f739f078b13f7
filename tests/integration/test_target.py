"""The echo target over real HTTP on loopback, in its own process, as runs use it."""

from __future__ import annotations

import asyncio
import socket
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from skiplock.chaos.target import TargetProcess
from skiplock.queue_impl.interface import (
    ACCOUNT_HEADER,
    ATTEMPT_HEADER,
    JOB_ID_HEADER,
    WORKER_HEADER,
)
from skiplock.reports.history import DELIVERY_LOG, Behaviour, JobScript, LogWriter, Step, read_log
from skiplock.scenarios.cli.main import main as cli_main

pytestmark = pytest.mark.integration

HANG_CAP = 1.5


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TargetProcess]:
    out = tmp_path_factory.mktemp("target-run")
    with TargetProcess(out, hang_cap_seconds=HANG_CAP, grace_seconds=1.0) as process:
        yield process
    assert not process.alive()


def job_id() -> str:
    return str(uuid.uuid4())


def script(first: Step, times: int | None = None, then: Step | None = None) -> dict[str, Any]:
    built = JobScript(name="test", first=first, times=times)
    if then is not None:
        built = JobScript(name="test", first=first, times=times, then=then)
    return built.to_json()


async def _post(
    url: str,
    job: str | None,
    payload: dict[str, Any] | None,
    *,
    account: str | None = None,
    attempt: str | None = None,
    timeout: float = 10.0,
    raw_body: bytes | None = None,
) -> int:
    headers = {WORKER_HEADER: "test-worker"}
    if job is not None:
        headers[JOB_ID_HEADER] = job
    if account is not None:
        headers[ACCOUNT_HEADER] = account
    if attempt is not None:
        headers[ATTEMPT_HEADER] = attempt
    data = raw_body if raw_body is not None else None
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as session,
        session.post(
            url,
            json=payload if raw_body is None else None,
            data=data,
            headers=headers,
        ) as response,
    ):
        await response.read()
        return response.status


def post(url: str, job: str | None, payload: dict[str, Any] | None, **kwargs: Any) -> int:
    return asyncio.run(_post(url, job, payload, **kwargs))


def records(target: TargetProcess, job: str) -> list[dict[str, Any]]:
    return [r for r in read_log(target.deliveries_path, DELIVERY_LOG) if r["job_id"] == job]


def wait_until(check: Callable[[], Any], timeout: float = 10.0) -> Any:
    """Bounded poll: the first truthy value of `check()`, or fail after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"condition not met within {timeout} s")
        time.sleep(0.05)


def test_ok_is_on_disk_before_the_client_reads_the_answer(target: TargetProcess) -> None:
    job = job_id()
    status = post(
        target.deliver_url,
        job,
        {"script": script(Step(behaviour=Behaviour.OK))},
        account="acct-ok",
        attempt="1",
    )
    assert status == 200
    # No waiting: the record was written before the response left the target.
    [record] = records(target, job)
    assert record["status"] == 200
    assert record["answered"] is not None and record["answered"] >= record["received"]
    assert record["behaviour"] == "ok"
    assert record["attempt"] == 1
    assert record["account"] == "acct-ok"
    assert record["worker"] == "test-worker"
    assert record["target"] == "target-0"
    assert record["seen"] == 1


def test_payload_without_script_succeeds_and_any_deliver_path_works(
    target: TargetProcess,
) -> None:
    job = job_id()
    assert post(target.deliver_url + "/some/thing", job, {"other": 1}) == 200
    [record] = records(target, job)
    assert (record["status"], record["behaviour"], record["attempt"]) == (200, "ok", None)


def test_status_always(target: TargetProcess) -> None:
    job = job_id()
    payload = {"script": script(Step(behaviour=Behaviour.STATUS, status=400))}
    assert [post(target.deliver_url, job, payload) for _ in range(2)] == [400, 400]
    assert [(r["status"], r["seen"]) for r in records(target, job)] == [(400, 1), (400, 2)]


def test_script_steps_follow_the_targets_count_not_the_attempt_header(
    target: TargetProcess,
) -> None:
    job = job_id()
    payload = {
        "script": script(
            Step(behaviour=Behaviour.STATUS, status=503), times=2, then=Step(behaviour=Behaviour.OK)
        )
    }
    before = target.stats()["duplicates"]
    # A queue that always claims attempt 9 cannot make the target skip its failures.
    statuses = [post(target.deliver_url, job, payload, attempt="9") for _ in range(4)]
    assert statuses == [503, 503, 200, 200]
    got = [(r["seen"], r["status"], r["attempt"]) for r in records(target, job)]
    assert got == [(1, 503, 9), (2, 503, 9), (3, 200, 9), (4, 200, 9)]
    # The fourth came after a 2xx answer: a duplicate.
    assert target.stats()["duplicates"] == before + 1


def test_slow_answers_after_its_seconds(target: TargetProcess) -> None:
    job = job_id()
    payload = {"script": script(Step(behaviour=Behaviour.SLOW, seconds=0.3))}
    assert post(target.deliver_url, job, payload) == 200
    [record] = records(target, job)
    assert record["status"] == 200
    assert record["answered"] - record["received"] >= 0.25


def test_hang_is_answered_late_after_the_client_timed_out(target: TargetProcess) -> None:
    job = job_id()
    payload = {"script": script(Step(behaviour=Behaviour.HANG, seconds=2.0))}
    with pytest.raises(TimeoutError):
        post(target.deliver_url, job, payload, timeout=0.2)
    gave_up = time.time()
    assert records(target, job) == []  # still being held
    [record] = wait_until(lambda: records(target, job))
    assert record["status"] == 200
    assert record["behaviour"] == "hang"
    assert record["answered"] > gave_up
    assert record["answered"] - record["received"] >= 1.9


def test_hang_forever_is_unanswered_when_the_client_leaves(target: TargetProcess) -> None:
    job = job_id()
    payload = {"script": script(Step(behaviour=Behaviour.HANG_FOREVER))}
    with pytest.raises(TimeoutError):
        post(target.deliver_url, job, payload, timeout=0.2)
    [record] = wait_until(lambda: records(target, job))
    assert (record["answered"], record["status"]) == (None, None)
    assert record["behaviour"] == "hang_forever"


def test_hang_forever_gives_up_at_the_cap_without_an_answer(target: TargetProcess) -> None:
    job = job_id()
    payload = {"script": script(Step(behaviour=Behaviour.HANG_FOREVER))}
    with pytest.raises(aiohttp.ClientConnectionError):
        post(target.deliver_url, job, payload, timeout=HANG_CAP + 8.0)
    [record] = records(target, job)
    assert (record["answered"], record["status"]) == (None, None)


def test_reset_gives_the_client_a_connection_error(target: TargetProcess) -> None:
    job = job_id()
    payload = {"script": script(Step(behaviour=Behaviour.RESET))}
    with pytest.raises(aiohttp.ClientConnectionError):
        post(target.deliver_url, job, payload)
    [record] = records(target, job)
    assert (record["answered"], record["status"], record["behaviour"]) == (None, None, "reset")


def test_requests_it_cannot_obey_get_400_and_a_record(target: TargetProcess) -> None:
    assert post(target.deliver_url, None, {"script": None}) == 400
    job = job_id()
    assert post(target.deliver_url, job, None, raw_body=b"{not json") == 400
    bad_script = {"script": {"first": {"behaviour": "explode"}}}
    job2 = job_id()
    assert post(target.deliver_url, job2, bad_script) == 400
    # The log has no empty string: a request without a job id reads back as null.
    no_id = [r for r in read_log(target.deliveries_path, DELIVERY_LOG) if r["job_id"] is None]
    assert no_id and no_id[-1]["status"] == 400 and no_id[-1]["behaviour"] == "bad_request"
    assert [r["status"] for r in records(target, job)] == [400]
    assert [r["status"] for r in records(target, job2)] == [400]


def test_in_flight_is_counted_per_account(target: TargetProcess) -> None:
    slow = {"script": script(Step(behaviour=Behaviour.SLOW, seconds=1.5))}
    jobs_a = [job_id() for _ in range(3)]
    job_b = job_id()

    async def together() -> list[int]:
        calls = [_post(target.deliver_url, j, slow, account="acct-a") for j in jobs_a]
        calls.append(_post(target.deliver_url, job_b, slow, account="acct-b"))
        return list(await asyncio.gather(*calls))

    assert asyncio.run(together()) == [200, 200, 200, 200]
    in_flight_a = sorted(records(target, j)[0]["account_in_flight"] for j in jobs_a)
    assert in_flight_a == [1, 2, 3]
    assert records(target, job_b)[0]["account_in_flight"] == 1
    stats = target.stats()
    assert stats["max_in_flight"]["acct-a"] == 3
    assert stats["max_in_flight"]["acct-b"] == 1
    assert stats["in_flight"]["acct-a"] == 0


def test_a_client_that_left_no_longer_counts_in_flight(target: TargetProcess) -> None:
    hung = job_id()
    payload = {"script": script(Step(behaviour=Behaviour.HANG, seconds=3.0))}
    with pytest.raises(TimeoutError):
        post(target.deliver_url, hung, payload, timeout=0.2, account="acct-left")
    wait_until(lambda: target.stats()["in_flight"].get("acct-left") == 0)
    assert records(target, hung) == []  # the target is still working on it
    job = job_id()
    assert post(target.deliver_url, job, {}, account="acct-left") == 200
    assert records(target, job)[0]["account_in_flight"] == 1


def test_two_targets_write_two_files_and_stop_records_what_is_open(
    target: TargetProcess,
) -> None:
    out = target.out_dir
    with TargetProcess(out, name="target-1", grace_seconds=0.5) as second:
        assert second.port != target.port
        first_job, second_job = job_id(), job_id()
        assert post(target.deliver_url, first_job, {}) == 200
        assert post(second.deliver_url, second_job, {}, account="x") == 200
        assert post(second.deliver_url, second_job, {}, account="x") == 200
        failing = job_id()
        fail = {"script": script(Step(behaviour=Behaviour.STATUS, status=500))}
        assert post(second.deliver_url, failing, fail, account="y") == 500
        stats = second.stats()
        assert stats == {
            "target": "target-1",
            "deliveries": 3,
            "answered": {"200": 2, "500": 1},
            "unanswered": 0,
            "open": 0,
            "duplicates": 1,
            "unique_jobs": 2,
            "bad_requests": 0,
            "in_flight": {"x": 0, "y": 0},
            "max_in_flight": {"x": 1, "y": 1},
        }

        # A delivery held when the target stops is recorded as unanswered.
        hung = job_id()
        forever = {"script": script(Step(behaviour=Behaviour.HANG_FOREVER))}

        async def hold_then_stop() -> None:
            call = asyncio.ensure_future(_post(second.deliver_url, hung, forever))
            while second.stats()["open"] == 0:
                await asyncio.sleep(0.05)
            await asyncio.get_running_loop().run_in_executor(None, second.stop)
            with pytest.raises(aiohttp.ClientConnectionError):
                await call

        asyncio.run(hold_then_stop())
        assert not second.alive()

    files = sorted(p.name for p in (out / "deliveries").iterdir())
    assert files == ["target-0.csv", "target-1.csv"]
    second_log = list(read_log(second.deliveries_path, DELIVERY_LOG))
    assert [r["job_id"] for r in second_log] == [
        second_job,
        second_job,
        failing,
        hung,
    ]
    assert {r["target"] for r in second_log} == {"target-1"}
    assert records(target, second_job) == []
    assert [r["target"] for r in records(target, first_job)] == ["target-0"]
    [held] = [r for r in second_log if r["job_id"] == hung]
    assert (held["answered"], held["status"]) == (None, None)


def test_a_killed_target_keeps_every_answered_delivery(tmp_path: Path) -> None:
    with TargetProcess(tmp_path, name="crashy") as crashy:
        jobs = [job_id() for _ in range(20)]
        assert {post(crashy.deliver_url, j, {}) for j in jobs} == {200}
        crashy.kill()
        assert not crashy.alive()
    # read_log refuses a truncated file, so this also says no line was cut.
    assert [r["job_id"] for r in read_log(crashy.deliveries_path, DELIVERY_LOG)] == jobs


def test_a_restarted_target_appends_under_the_one_header(tmp_path: Path) -> None:
    jobs = [job_id(), job_id()]
    for job in jobs:
        with TargetProcess(tmp_path, name="again") as again:
            assert post(again.deliver_url, job, {}) == 200
    lines = again.deliveries_path.read_text().splitlines()
    assert lines[0] + "\n" == DELIVERY_LOG.header() and lines.count(lines[0]) == 1
    assert [r["job_id"] for r in read_log(again.deliveries_path, DELIVERY_LOG)] == jobs


def test_ipv6_loopback(tmp_path: Path) -> None:
    if not socket.has_ipv6:
        pytest.skip("no IPv6 on this machine")
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        pytest.skip("::1 is not configured")
    with TargetProcess(tmp_path, host="::1") as six:
        assert six.url.startswith("http://[::1]:")
        assert post(six.deliver_url, job_id(), {}) == 200


@pytest.mark.parametrize(
    "argv",
    [
        ["target", "--host", "0.0.0.0"],
        ["target", "--host", "192.168.1.10"],
        ["target", "--host", "example.com"],
        ["target", "--port", "70000"],
        ["target", "--port", "http"],
        ["target", "--name", "../escape"],
        ["target", "--hang-cap", "0"],
    ],
)
def test_cli_refuses_bad_input_with_exit_2(
    argv: list[str], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    assert cli_main([*argv, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("skiplock: ") and err.count("\n") == 1


def test_cli_refuses_a_port_in_use_with_exit_2(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert cli_main(["target", "--port", str(port), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "pick another --port" in err and err.count("\n") == 1
    # Refused, it leaves no header-only delivery log, nor the folders it made for one.
    assert not (tmp_path / "out").exists()


def test_cli_refuses_a_log_with_other_columns_with_exit_2(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    log = tmp_path / "deliveries" / "target-0.csv"
    log.parent.mkdir()
    log.write_text("job_id,when\nj,1\n")
    assert cli_main(["target", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "use a new run directory" in err and err.count("\n") == 1
    assert log.read_text() == "job_id,when\nj,1\n"


def test_capacity_benchmark_runs_and_describes_itself() -> None:
    # Speed is measured by `skiplock bench target`, never asserted; this checks it works.
    from skiplock.scenarios.bench.target import bench

    result = bench(duration=0.5, concurrency=4, load_processes=2, warmup=0.0)
    figures = result["results"]
    assert figures["errors"] == 0 and figures["requests"] > 0
    # Every measured request reached the target and was recorded as answered.
    assert figures["target_stats"]["answered"]["200"] >= figures["requests"]
    assert figures["target_stats"]["duplicates"] == 0
    assert figures["latency_ms"]["p50"] <= figures["latency_ms"]["p99"]
    assert result["parameters"]["concurrency"] == 4
    assert {"sha", "dirty"} <= set(result["git"])
    assert result["machine"]["cpu_count"] and result["python"]["version"]


def test_a_restarted_target_goes_on_with_each_jobs_script(tmp_path: Path) -> None:
    """A job that fails twice, then succeeds: a restart between its deliveries does not make
    it fail again from the start, and the stats count what the earlier process answered."""
    job = job_id()
    fail_twice = {"script": script(Step(behaviour=Behaviour.STATUS, status=503), times=2)}
    statuses = []
    for _ in range(3):
        with TargetProcess(tmp_path, name="again") as again:
            statuses.append(post(again.deliver_url, job, fail_twice))
            stats = again.stats()
    assert statuses == [503, 503, 200]
    assert [r["seen"] for r in records(again, job)] == [1, 2, 3]
    assert (stats["deliveries"], stats["answered"]) == (3, {"200": 1, "503": 2})


def test_a_restarted_target_resumes_from_what_each_job_saw(tmp_path: Path) -> None:
    """Records are written when answered: a retry answered before a slow first delivery is
    logged first. The count resumes from the highest `seen`, not from the number of lines;
    another target's records and requests without a job id are kept apart."""
    job, other = job_id(), job_id()
    log = tmp_path / "deliveries" / "again.csv"
    with LogWriter(log, DELIVERY_LOG) as writer:
        for seen, status in ((2, 503), (1, 503)):
            writer.write({"job_id": job, "target": "again", "received": 1.0, "answered": 2.0,
                          "status": status, "behaviour": "status", "seen": seen})
        writer.write({"job_id": other, "target": "target-9", "received": 1.0,
                      "answered": 2.0, "status": 200, "behaviour": "ok", "seen": 7})
        writer.write({"job_id": None, "target": "again", "received": 1.0, "answered": 1.0,
                      "status": 400, "behaviour": "bad_request", "seen": 1})
    fail_twice = {"script": script(Step(behaviour=Behaviour.STATUS, status=503), times=2)}
    with TargetProcess(tmp_path, name="again") as again:
        stats = again.stats()
        assert post(again.deliver_url, job, fail_twice) == 200
        assert post(again.deliver_url, other, fail_twice) == 503
    assert (stats["deliveries"], stats["bad_requests"], stats["answered"]) == (
        3, 1, {"400": 1, "503": 2})
    assert [r["seen"] for r in records(again, job)] == [2, 1, 3]
    assert [r["seen"] for r in records(again, other) if r["target"] == "again"] == [1]


def test_target_processes_are_sized_to_the_rate_and_jobs_keep_to_one() -> None:
    from skiplock.chaos.target import processes_for_rate, route

    assert processes_for_rate(100, cores=2) == 1
    assert processes_for_rate(3000, cores=2) == 2
    assert processes_for_rate(3000, cores=8) == 3
    assert processes_for_rate(0, cores=4) == 4  # a closed loop: one per core
    urls = ["http://127.0.0.1:1/deliver", "http://127.0.0.1:2/deliver"]
    jobs = [uuid.uuid4() for _ in range(400)]
    # Every delivery of a job goes to one process, and the jobs spread over all of them.
    assert all(route(job, urls) == route(job, list(urls)) for job in jobs)
    spread = Counter(route(job, urls) for job in jobs)
    assert set(spread) == set(urls) and min(spread.values()) > 120
