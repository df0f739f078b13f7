"""The target-side faults over real HTTP on loopback: the echo target's hang window and its
kill / restart, and the `hang_target` / `kill_target` faults acting through a context."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from skiplock.chaos.faults.target import HangTarget, KillTarget
from skiplock.chaos.nemesis import (
    FaultSkipped,
    PlannedFault,
    ScheduledNemesis,
    TargetHandle,
    registry,
)
from skiplock.chaos.target import TargetProcess
from skiplock.queue_impl.interface import ATTEMPT_HEADER, JOB_ID_HEADER, WORKER_HEADER
from skiplock.reports.history import DELIVERY_LOG, Behaviour, FaultEvent, JobScript, Step, read_log

pytestmark = pytest.mark.integration

HANG_CAP = 30.0
OK: dict[str, Any] = {}
FAIL_TWICE = {"script": JobScript(name="test", first=Step(behaviour=Behaviour.STATUS,
                                                          status=503), times=2).to_json()}


@pytest.fixture
def target(tmp_path: Path) -> Iterator[TargetProcess]:
    with TargetProcess(tmp_path, hang_cap_seconds=HANG_CAP, grace_seconds=1.0) as process:
        yield process
    assert not process.alive()


def job_id() -> str:
    return str(uuid.uuid4())


@dataclass
class Answer:
    """What one client saw: the status, or the error it got instead, and when."""

    status: int | None
    error: BaseException | None
    sent: float
    done: float


async def _post(url: str, job: str, payload: dict[str, Any], timeout: float) -> Answer:
    sent = time.time()
    headers = {WORKER_HEADER: "test-worker", JOB_ID_HEADER: job, ATTEMPT_HEADER: "1"}
    try:
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as session,
            session.post(url, json=payload, headers=headers) as response,
        ):
            await response.read()
            return Answer(status=response.status, error=None, sent=sent, done=time.time())
    except (TimeoutError, aiohttp.ClientError) as exc:
        return Answer(status=None, error=exc, sent=sent, done=time.time())


def post(url: str, job: str, payload: dict[str, Any] = OK, timeout: float = 10.0) -> Answer:
    return asyncio.run(_post(url, job, payload, timeout))


async def _post_then(url: str, job: str, timeout: float, then: Callable[[], Any],
                     after: float) -> tuple[Answer, float]:
    """Post, and `after` seconds later call `then()` in a thread while the post waits;
    returns the answer and when `then` was called."""
    request = asyncio.create_task(_post(url, job, OK, timeout))
    await asyncio.sleep(after)
    called = time.time()
    await asyncio.to_thread(then)
    return await request, called


def post_then(url: str, job: str, then: Callable[[], Any], *, after: float = 0.3,
              timeout: float = 10.0) -> tuple[Answer, float]:
    return asyncio.run(_post_then(url, job, timeout, then, after))


def records(target: TargetProcess, job: str) -> list[dict[str, Any]]:
    return [r for r in read_log(target.deliveries_path, DELIVERY_LOG) if r["job_id"] == job]


def wait_until(check: Callable[[], Any], timeout: float = 10.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"condition not met within {timeout} s")
        time.sleep(0.02)


# --------------------------------------------------------------------------------------------
# The hang window.
# --------------------------------------------------------------------------------------------


def test_a_request_in_the_window_is_answered_after_it_with_its_real_times(
    target: TargetProcess,
) -> None:
    opened = time.time()
    target.hang(1.0)
    gives_up, waits = job_id(), job_id()

    async def both() -> list[Answer]:
        return list(await asyncio.gather(_post(target.deliver_url, gives_up, OK, 0.3),
                                         _post(target.deliver_url, waits, OK, 10.0)))

    short, long = asyncio.run(both())
    closed = opened + 1.0
    # The worker's timeout passed with nothing; the patient client got its 200 at the end.
    assert isinstance(short.error, TimeoutError)
    assert long.status == 200 and long.done >= closed - 0.05
    [late] = wait_until(lambda: records(target, gives_up))
    [patient] = records(target, waits)
    for record, answer in ((late, short), (patient, long)):
        assert (record["status"], record["behaviour"], record["seen"]) == (200, "ok", 1)
        # received is the arrival, answered the real answer after the window.
        assert answer.sent - 0.05 <= record["received"] < opened + 0.5
        assert record["answered"] >= closed - 0.05
    assert late["answered"] > short.done


def test_a_request_after_the_window_is_prompt(target: TargetProcess) -> None:
    target.hang(0.3)
    time.sleep(0.5)
    job = job_id()
    answer = post(target.deliver_url, job)
    assert answer.status == 200 and answer.done - answer.sent < 0.25
    [record] = records(target, job)
    assert record["answered"] - record["received"] < 0.1


def test_closing_the_window_early_answers_what_it_holds(target: TargetProcess) -> None:
    target.hang(20.0)
    answer, closed = post_then(target.deliver_url, job_id(), lambda: target.hang(0))
    assert answer.status == 200
    assert answer.done >= closed and answer.done - closed < 1.0
    assert post(target.deliver_url, job_id()).done - closed < 2.0  # and the next is prompt


def test_a_held_request_follows_its_script_after_the_window(target: TargetProcess) -> None:
    job = job_id()
    target.hang(0.3)
    statuses = [post(target.deliver_url, job, FAIL_TWICE).status for _ in range(3)]
    assert statuses == [503, 503, 200]
    assert [r["seen"] for r in records(target, job)] == [1, 2, 3]


@pytest.mark.parametrize("seconds", [-1.0, float("nan"), float("inf"), HANG_CAP + 1])
def test_bad_windows_are_refused(target: TargetProcess, seconds: float) -> None:
    with pytest.raises(ValueError, match="refused the hang"):
        target.hang(seconds)


@pytest.mark.parametrize("query", ["", "?seconds=abc", "?seconds=", "?seconds=1e400"])
def test_the_control_endpoint_answers_400_to_bad_values(target: TargetProcess,
                                                        query: str) -> None:
    request = urllib.request.Request(f"{target.url}/control/hang{query}", data=b"",
                                     method="POST")
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(request, timeout=5.0)
    with caught.value as error:
        assert error.code == 400
        assert b"seconds must be a number" in error.read()


def test_stopping_during_a_long_window_is_prompt_and_records_the_held_delivery(
    target: TargetProcess,
) -> None:
    job = job_id()
    target.hang(HANG_CAP)
    stopped: list[float] = []

    def stop() -> None:
        wait_until(lambda: target.stats()["open"] == 1)
        began = time.monotonic()
        target.stop()
        stopped.append(time.monotonic() - began)

    answer, _ = post_then(target.deliver_url, job, stop, after=0.0)
    # Well under the grace (1 s) plus the 10 s stop() allows: nothing waited the window out.
    assert stopped[0] < 1.0
    assert answer.status is None and isinstance(answer.error, aiohttp.ClientError)
    [record] = records(target, job)
    assert (record["answered"], record["status"], record["behaviour"]) == (None, None, "ok")


# --------------------------------------------------------------------------------------------
# Kill and restart.
# --------------------------------------------------------------------------------------------


def test_kill_then_restart_serves_on_the_same_port_and_the_script_resumes(
    target: TargetProcess,
) -> None:
    job = job_id()
    url, pid = target.deliver_url, target.pid
    assert post(url, job, FAIL_TWICE).status == 503
    target.kill()
    assert not target.alive()
    refused = post(url, job, FAIL_TWICE, timeout=2.0)
    assert isinstance(refused.error, aiohttp.ClientConnectionError)
    target.restart()
    assert target.alive() and target.pid != pid and target.deliver_url == url
    assert [post(url, job, FAIL_TWICE).status for _ in range(2)] == [503, 200]
    assert [(r["seen"], r["status"]) for r in records(target, job)] == [
        (1, 503), (2, 503), (3, 200)]
    assert target.stats()["deliveries"] == 3


def test_restart_right_after_a_kill_with_connections_open(target: TargetProcess) -> None:
    """SIGKILL while a delivery is held and others were just answered (connections in every
    state on the port): the restart binds the same port at once."""
    for _ in range(5):
        assert post(target.deliver_url, job_id()).status == 200
    target.hang(HANG_CAP)
    held = job_id()

    def kill_and_restart() -> None:
        wait_until(lambda: target.stats()["open"] == 1)
        target.kill()
        target.restart()

    answer, _ = post_then(target.deliver_url, held, kill_and_restart, after=0.0)
    assert isinstance(answer.error, aiohttp.ClientError)
    # The held delivery died with the process, unrecorded; the new process has no window.
    assert records(target, held) == []
    assert post(target.deliver_url, held).status == 200
    assert [r["seen"] for r in records(target, held)] == [1]


def test_restart_is_a_no_op_while_running_and_waits_for_a_busy_port(tmp_path: Path) -> None:
    with TargetProcess(tmp_path) as target:
        pid = target.pid
        target.restart()
        assert target.pid == pid
        target.kill()
        # Someone else holds the port for a moment: the restart retries until it is free.
        busy = socket.socket()
        busy.bind(("127.0.0.1", target.port))
        busy.listen()
        began = time.monotonic()

        async def release_then_restart() -> None:
            restart = asyncio.create_task(asyncio.to_thread(target.restart))
            await asyncio.sleep(0.5)
            busy.close()
            await restart

        asyncio.run(release_then_restart())
        assert time.monotonic() - began >= 0.5
        assert post(target.deliver_url, job_id()).status == 200


def test_restart_before_start_is_refused(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="never started"):
        TargetProcess(tmp_path).restart()


# --------------------------------------------------------------------------------------------
# The faults, through a context.
# --------------------------------------------------------------------------------------------


@dataclass
class FakeContext:
    """The part of NemesisContext the target faults use."""

    handles: list[TargetProcess]
    run_dir: Path = Path(".")
    dsn: str = ""
    schema: str = ""
    app_prefix: str = ""
    server_owned: bool = False
    lease_seconds: float = 10.0
    http_timeout_seconds: float = 1.0
    account_limits: dict[str, int | None] = field(default_factory=dict)
    claim_transaction: bool = True
    calls: list[str] = field(default_factory=list)

    def targets(self) -> Sequence[TargetHandle]:
        self.calls.append("targets")
        return self.handles


def planned(kind: str, duration: float, count: int = 1, seed: int = 7) -> PlannedFault:
    return PlannedFault(kind=kind, at=0.0, duration=duration, count=count, probability=1.0,
                        external="skip", seed=seed)


@pytest.fixture
def two_targets(tmp_path: Path) -> Iterator[list[TargetProcess]]:
    with (
        TargetProcess(tmp_path, name="target-0", hang_cap_seconds=HANG_CAP,
                      grace_seconds=1.0) as first,
        TargetProcess(tmp_path, name="target-1", hang_cap_seconds=HANG_CAP,
                      grace_seconds=1.0) as second,
    ):
        yield [first, second]


def test_the_target_faults_are_registered() -> None:
    kinds = registry()
    assert kinds["hang_target"] is HangTarget and kinds["kill_target"] is KillTarget


def test_hang_target_holds_the_chosen_target_and_heals_early(
    two_targets: list[TargetProcess],
) -> None:
    ctx = FakeContext(handles=two_targets)
    fault = HangTarget(ctx, planned("hang_target", 20.0))  # type: ignore[arg-type]
    [hit] = fault.apply()
    assert fault.data["seconds"] == 20.0
    # The same seed chooses the same target.
    again = HangTarget(FakeContext(handles=list(reversed(two_targets))),  # type: ignore[arg-type]
                       planned("hang_target", 0.01))
    assert again.apply() == [hit]
    time.sleep(0.05)
    again.heal()  # its own window is over: leaves the other fault's window alone
    hung = next(t for t in two_targets if t.name == hit)
    free = next(t for t in two_targets if t.name != hit)
    assert post(free.deliver_url, job_id()).status == 200
    answer = post(hung.deliver_url, job_id(), timeout=0.3)
    assert isinstance(answer.error, TimeoutError)
    # Healed before its window ends: the window closes at once.
    answer, healed = post_then(hung.deliver_url, job_id(), fault.heal)
    assert answer.status == 200 and answer.done - healed < 1.0
    fault.heal()  # again: harmless


def test_hang_target_with_a_count_above_the_targets_hangs_all_and_skips_with_none(
    two_targets: list[TargetProcess],
) -> None:
    fault = HangTarget(FakeContext(handles=two_targets),  # type: ignore[arg-type]
                       planned("hang_target", 0.3, count=5))
    assert sorted(fault.apply()) == ["target-0", "target-1"]
    fault.heal()
    with pytest.raises(FaultSkipped):
        HangTarget(FakeContext(handles=[]),  # type: ignore[arg-type]
                   planned("hang_target", 0.3)).apply()


def test_kill_target_kills_the_chosen_target_and_heal_restarts_it(
    two_targets: list[TargetProcess],
) -> None:
    job = job_id()
    for t in two_targets:
        assert post(t.deliver_url, job, FAIL_TWICE).status == 503
    ctx = FakeContext(handles=two_targets)
    fault = KillTarget(ctx, planned("kill_target", 1.0))  # type: ignore[arg-type]
    [hit] = fault.apply()
    killed = next(t for t in two_targets if t.name == hit)
    spared = next(t for t in two_targets if t.name != hit)
    assert not killed.alive() and spared.alive()
    assert isinstance(post(killed.deliver_url, job_id(), timeout=2.0).error,
                      aiohttp.ClientConnectionError)
    fault.heal()
    assert killed.alive()
    assert fault.data["signal"] == "SIGKILL" and fault.data["down_seconds"] >= 0
    # Back on its URL, with the job's script going on from its log.
    assert post(killed.deliver_url, job, FAIL_TWICE).status == 503
    assert post(killed.deliver_url, job, FAIL_TWICE).status == 200


def test_a_target_restarted_from_a_thread_outlives_the_thread(target: TargetProcess) -> None:
    """Children are signalled when the thread that started them ends (PR_SET_PDEATHSIG): a
    restart from a fault's short-lived thread must not take the target down with it."""
    target.kill()
    thread = threading.Thread(target=target.restart)
    thread.start()
    thread.join()
    time.sleep(0.3)
    assert target.alive()
    assert post(target.deliver_url, job_id()).status == 200


def test_the_schedule_kills_and_restarts_a_target_and_records_its_window(
    target: TargetProcess,
) -> None:
    events: list[FaultEvent] = []
    nemesis = ScheduledNemesis([planned("kill_target", 0.3)], events.append)
    began = time.time()
    nemesis.start(FakeContext(handles=[target]), began)  # type: ignore[arg-type]
    wait_until(lambda: events, timeout=10.0)
    nemesis.stop()
    [event] = events
    assert (event.fault, event.target, event.skipped) == ("kill_target", target.name, None)
    assert event.end is not None and event.end - event.start >= 0.3
    assert event.data["seconds"] == 0.3
    time.sleep(0.3)  # the firing's thread has ended by now
    assert target.alive()
    assert post(target.deliver_url, job_id()).status == 200


def test_target_faults_and_scripts_hold_across_target_processes(
        pg_dsn: str, tmp_path: Path) -> None:
    """A run with its echo target as two processes: the hang and the kill each hit both
    (count 2), scripted 503s, resets and late answers keep their step counts because every
    delivery of a job reaches one process, and the checker merges the two logs."""
    import dataclasses

    from skiplock.reports.history import DELIVERIES_DIR, NEMESIS_FILE, read_jsonl
    from skiplock.scenarios.run import spec as spec_mod
    from skiplock.scenarios.run.options import RunOptions
    from skiplock.scenarios.run.runner import run_scenario

    spec = spec_mod.load("target-hangs", ["duration=6", "rate=60"])
    spec = dataclasses.replace(
        spec, nemesis=tuple(dataclasses.replace(n, count=2) for n in spec.nemesis))
    result = run_scenario(spec, RunOptions(seed=1, out=tmp_path, dsn=pg_dsn,
                                           target_processes=2, report=False))
    assert result.verdict.valid is True, result.verdict.counts
    logs = {p.stem: list(read_log(p, DELIVERY_LOG))
            for p in (result.run_dir / DELIVERIES_DIR).glob("*.csv")}
    assert set(logs) == {"target-0", "target-1"} and all(logs.values())
    # No job was delivered to both: each process saw every delivery of its jobs.
    jobs = [{r["job_id"] for r in records} for records in logs.values()]
    assert not jobs[0] & jobs[1]
    retried = [r for records in logs.values() for r in records if r["seen"] >= 2]
    assert retried, "no job was delivered twice: the faults and 503s did nothing"
    hit: dict[str, set[str]] = {}
    for event in read_jsonl(result.run_dir / NEMESIS_FILE):
        if not event.get("skipped"):
            hit.setdefault(event["fault"], set()).add(event["target"])
    both = {"target-0", "target-1"}
    assert hit == {"hang_target": both, "kill_target": both}, hit
    assert result.verdict.counts["enqueued"] == result.verdict.counts["completed"] + \
        result.verdict.counts["failed"]
