"""`NativeDelivery`, the surface a native-worker plug-in uses, against a real loopback HTTP
server: the job encoding, the claim/call/write records (a write sorted by its outcome), the
renewal of every pick a heartbeat kept, the run's backoff, and the start/stop events."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable
from datetime import timedelta
from typing import Any

import pytest
from aiohttp import web

from skiplock.queue_impl.config import DispatcherConfig
from skiplock.queue_impl.interface import Account, NewJob, Outcome
from skiplock.queue_impl.native import (
    NativeConfig,
    NativeDelivery,
    WriteRefused,
    decode_job,
    encode_job,
)


def test_a_job_survives_its_encoding() -> None:
    job = NewJob(id=uuid.uuid4(), account_id="acct", target_url="http://127.0.0.1:1/x",
                 payload={"script": {"name": "ok"}}, max_attempts=4)
    data = decode_job(encode_job(job))
    assert (data.job_id, data.account_id, data.target_url, dict(data.payload),
            data.max_attempts) == (job.id, "acct", job.target_url, dict(job.payload), 4)


def test_a_plain_config_becomes_a_native_one_without_accounts() -> None:
    plain = DispatcherConfig(batch=3, lease_seconds=7.0, http_timeout_seconds=2.0,
                             write_margin_seconds=1.0)
    native = NativeConfig.native(plain)
    assert (native.batch, native.lease_seconds, native.accounts) == (3, 7.0, ())
    given = NativeConfig(accounts=(Account(id="a", concurrency_limit=2),), max_attempts=5)
    assert NativeConfig.native(given) is given


async def _serve(statuses: dict[str, int]) -> tuple[web.AppRunner, int]:
    async def handle(request: web.Request) -> web.Response:
        body = await request.json()
        return web.Response(status=statuses[body["name"]])

    app = web.Application()
    app.router.add_post("/deliver", handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    return runner, int(port)


def _exercise() -> list[tuple[str, dict[str, Any]]]:
    events: list[tuple[str, dict[str, Any]]] = []

    async def main() -> None:
        runner, port = await _serve({"ok": 200, "flaky": 503, "bad": 400})
        config = NativeConfig(batch=4, lease_seconds=5.0, http_timeout_seconds=2.0,
                              write_margin_seconds=1.0, retry_base_seconds=0.5,
                              retry_cap_seconds=4.0, retry_jitter=0.0, seed=1,
                              allow_targets=(f"127.0.0.1:{port}",))
        url = f"http://127.0.0.1:{port}/deliver"
        try:
            async with NativeDelivery(config, "w-0", lambda k, f: events.append((k, f))) as d:
                leases = {name: d.lease(encode_job(NewJob(
                    id=uuid.uuid4(), account_id="acct", target_url=url,
                    payload={"name": name}, max_attempts=3)), pick=f"{name}:1", attempt=1)
                    for name in ("ok", "flaky", "bad")}
                for name, lease in leases.items():
                    d.claimed(name, lease, sent=1.0)
                calls = {name: await d.run(name) for name in leases}
                assert calls["ok"].outcome is Outcome.SUCCESS
                assert d.retry_delay("ok") is None
                assert d.retry_delay("flaky") == timedelta(seconds=0.5)
                assert d.retry_delay("bad") is None

                async def returns(answer: Any) -> Any:
                    return answer

                # One heartbeat that kept the picks of two jobs, as a library renews them.
                await d.heartbeat(returns(None), lambda key: key != "bad")
                await d.write(["ok"], returns(1))
                await d.write(["flaky"], returns(0), refused=lambda answer: answer == 0)

                async def raises(exc: BaseException) -> None:
                    raise exc

                with pytest.raises(WriteRefused):
                    await d.write(["bad"], raises(WriteRefused("lock gone")))
                assert d.picks == {}
                # A write whose statement failed: unknown. (No call under that key: not
                # recorded, as a job this worker did not deliver.)
                lost: Awaitable[None] = raises(ConnectionError("reset"))
                with pytest.raises(ConnectionError):
                    await d.write(["never-run"], lost)
                raise RuntimeError("the library's loop gave up")
        except RuntimeError:
            pass
        finally:
            await runner.cleanup()

    asyncio.run(main())
    return events


def test_the_records_of_a_native_loop() -> None:
    events = _exercise()
    kinds = [kind for kind, _ in events]
    assert kinds[0] == "start" and kinds[-1] == "stop"
    assert events[-1][1]["reason"] == "error: RuntimeError: the library's loop gave up"
    assert kinds.count("claim") == 3 and kinds.count("http") == 3
    claims = [f for k, f in events if k == "claim"]
    assert all(f["started"] == 1.0 for f in claims)
    renewals = [f for k, f in events if k == "renew"]
    # The heartbeat kept two picks; both renewals carry when it was sent.
    assert len(renewals) == 2 and all("started" in f and "lost" not in f for f in renewals)
    writes = {f["outcome"]: f["result"] for k, f in events if k == "write"}
    assert writes == {"success": "applied", "transient": "fenced", "permanent": "fenced"}


def test_picks_a_failed_loop_held_are_forgotten_before_it_starts_again() -> None:
    """A library's loop that failed and is started again (pgqueuer's restart on failure)
    neither writes nor renews what it held: after `forget_picks` a heartbeat of the same job
    by the new loop renews only the new pick, and the failure is an `error` event."""
    events: list[tuple[str, dict[str, Any]]] = []

    async def main() -> None:
        config = NativeConfig(batch=4, lease_seconds=5.0, http_timeout_seconds=2.0,
                              write_margin_seconds=1.0, seed=1)
        async with NativeDelivery(config, "w-0", lambda k, f: events.append((k, f))) as d:
            job = encode_job(NewJob(id=uuid.uuid4(), account_id="acct",
                                    target_url="http://127.0.0.1:9/deliver", payload={},
                                    max_attempts=3))
            d.claimed(("job", "old"), d.lease(job, pick="job:old", attempt=1))
            d.error("library", "ConnectionError: the session was cut")
            d.forget_picks()
            assert d.picks == {}
            d.claimed(("job", "new"), d.lease(job, pick="job:new", attempt=1))

            async def returns() -> None:
                return None

            await d.heartbeat(returns(), lambda key: key[0] == "job")

    asyncio.run(main())
    renewals = [f for k, f in events if k == "renew"]
    claims = [f for k, f in events if k == "claim"]
    assert len(renewals) == 1 and renewals[0]["lease_token"] == claims[1]["lease_token"]
    assert ("error", {"op": "library", "error": "ConnectionError: the session was cut"}) in events
