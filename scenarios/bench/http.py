"""`skiplock bench http`: what one HTTP call costs the worker, aiohttp against the lean client.

Both clients post the same job-like JSON (`{"script": ..., "account": ...}`) with the
dispatcher's identity headers to one echo target in its own process, `--concurrency` calls in
flight, in alternating rounds within this one command (aiohttp first in even rounds, the lean
client first in odd ones), so a busy machine skews both alike. aiohttp is set up as the
dispatcher sets it up: a TCPConnector with the SSRF guard's pinned resolver, no DNS cache,
`limit` = the concurrency, one ClientTimeout per call, no redirects, the body read; the lean
client is `skiplock.queue_impl.http11.Http11Client` with the same limit. Each call encodes its
JSON (aiohttp's `json=` does it inside). The guard's vetting is done once, before timing: it
costs both the same. Client CPU is this process's CPU time over the timed calls (the target
runs in its own process); a warm-up of each client runs first and is not counted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from skiplock.chaos.target import TargetProcess
from skiplock.plumbing.argtypes import positive_int
from skiplock.plumbing.errors import HarnessError, UsageError
from skiplock.queue_impl.http11 import Http11Client, request_target
from skiplock.queue_impl.interface import (
    ACCOUNT_HEADER,
    ATTEMPT_HEADER,
    JOB_ID_HEADER,
    LEASE_HEADER,
    WORKER_HEADER,
)
from skiplock.queue_impl.ssrf import PinnedResolver, UrlGuard, VettedTarget
from skiplock.reports.history import SUCCEED, write_json
from skiplock.reports.selfdescribe import describe
from skiplock.scenarios.bench.common import add_out, result_path

CLIENTS = ("aiohttp", "lean")
TIMEOUT_SECONDS = 10.0

# One call: (job headers, payload) -> the status (None when it failed).
Post = Callable[[dict[str, str], dict[str, Any]], Awaitable[int | None]]


def _warmup(raw: str) -> int:
    return 0 if raw.strip() == "0" else positive_int(raw)


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--requests", type=positive_int, default=20000, metavar="N",
        help="timed requests per client, over all rounds (default %(default)d)",
    )  # fmt: skip
    parser.add_argument(
        "--concurrency", type=positive_int, default=20, metavar="C",
        help="requests in flight at once, and each client's connection limit "
        "(default %(default)d)",
    )  # fmt: skip
    parser.add_argument(
        "--rounds", type=positive_int, default=4, metavar="R",
        help="rounds per client, alternating between the clients (default %(default)d)",
    )  # fmt: skip
    parser.add_argument(
        "--warmup", type=_warmup, default=500, metavar="N",
        help="untimed requests per client before the rounds (default %(default)d)",
    )  # fmt: skip
    add_out(parser)


def _job() -> tuple[dict[str, str], dict[str, Any]]:
    """The headers and payload the dispatcher sends for one job."""
    job_id = uuid.uuid4()
    account = f"bench-{job_id.int % 8}"
    headers = {
        JOB_ID_HEADER: str(job_id),
        ATTEMPT_HEADER: "1",
        ACCOUNT_HEADER: account,
        WORKER_HEADER: "bench-http",
        LEASE_HEADER: str(uuid.uuid4()),
    }
    return headers, {"script": SUCCEED.to_json(), "account": account}


async def _drive(post: Post, requests: int, concurrency: int) -> dict[str, Any]:
    """`requests` calls, `concurrency` at a time; wall and CPU seconds over them. The jobs are
    made before the clock starts (a worker has its jobs' ids and payloads from the claim)."""
    jobs = [_job() for _ in range(requests)]
    jobs.reverse()
    errors = 0

    async def caller() -> None:
        nonlocal errors
        while jobs:
            headers, payload = jobs.pop()
            if await post(headers, payload) != 200:
                errors += 1

    wall, cpu, split = time.perf_counter(), time.process_time(), os.times()
    await asyncio.gather(*(caller() for _ in range(concurrency)))
    after = os.times()
    # process_time is precise; os.times (clock ticks) only splits it into user and system.
    return {"requests": requests, "errors": errors,
            "wall_seconds": time.perf_counter() - wall, "cpu_seconds": time.process_time() - cpu,
            "user_seconds": after.user - split.user,
            "system_seconds": after.system - split.system}


async def _aiohttp_round(target: VettedTarget, requests: int, concurrency: int,
                         warmup: int) -> dict[str, Any]:
    import aiohttp

    resolver = PinnedResolver()
    connector = aiohttp.TCPConnector(resolver=resolver, use_dns_cache=False, limit=concurrency)
    async with aiohttp.ClientSession(connector=connector, raise_for_status=False,
                                     auto_decompress=True) as session:

        async def post(headers: dict[str, str], payload: dict[str, Any]) -> int | None:
            resolver.pin(target)
            timeout = aiohttp.ClientTimeout(total=TIMEOUT_SECONDS)
            try:
                async with session.post(target.url, json=payload, headers=headers,
                                        timeout=timeout, allow_redirects=False) as response:
                    await response.read()
                    return response.status
            except (aiohttp.ClientError, OSError, TimeoutError):
                return None

        await _drive(post, warmup, concurrency)
        return await _drive(post, requests, concurrency)


async def _lean_round(target: VettedTarget, requests: int, concurrency: int,
                      warmup: int) -> dict[str, Any]:
    from skiplock.queue_impl.http11 import ConnectionFailed

    path = request_target(target.url)
    async with Http11Client(concurrency) as client:

        async def post(headers: dict[str, str], payload: dict[str, Any]) -> int | None:
            body = json.dumps(payload).encode()
            try:
                return (await client.post(target, path, headers, body, TIMEOUT_SECONDS)).status
            except (ConnectionFailed, TimeoutError):
                return None

        await _drive(post, warmup, concurrency)
        return await _drive(post, requests, concurrency)


ROUNDS = {"aiohttp": _aiohttp_round, "lean": _lean_round}


def _totals(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    requests = sum(r["requests"] for r in rounds)
    wall = sum(r["wall_seconds"] for r in rounds)
    cpu = sum(r["cpu_seconds"] for r in rounds)
    user = sum(r["user_seconds"] for r in rounds)
    system = sum(r["system_seconds"] for r in rounds)
    return {
        "requests": requests,
        "errors": sum(r["errors"] for r in rounds),
        "requests_per_second": round(requests / wall, 1) if wall > 0 else None,
        "cpu_us_per_request": round(cpu * 1e6 / requests, 1),
        "user_us_per_request": round(user * 1e6 / requests, 1),
        "system_us_per_request": round(system * 1e6 / requests, 1),
        "rounds": [{k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()}
                   for r in rounds],
    }


def bench(*, requests: int, concurrency: int, rounds: int, warmup: int) -> dict[str, Any]:
    """Run the benchmark and return its self-describing result."""
    if requests < rounds:
        raise UsageError(f"--requests {requests} is less than --rounds {rounds}; "
                         "give each round at least one request")
    description = describe()
    started = time.time()
    shares = [requests // rounds + (1 if i < requests % rounds else 0) for i in range(rounds)]
    measured: dict[str, list[dict[str, Any]]] = {name: [] for name in CLIENTS}
    with (
        tempfile.TemporaryDirectory(prefix="skiplock-bench-http-") as tmp,
        TargetProcess(Path(tmp), name="bench") as target,
    ):
        url = target.deliver_url
        vetted = asyncio.run(UrlGuard([f"{target.host}:{target.port}"]).vet(url))
        for index, share in enumerate(shares):
            order = CLIENTS if index % 2 == 0 else CLIENTS[::-1]
            for name in order:
                # The warm-up only before each client's first round.
                first = warmup if index < 2 else 0
                measured[name].append(
                    asyncio.run(ROUNDS[name](vetted, share, concurrency, first)))
    results = {name: _totals(measured[name]) for name in CLIENTS}
    lean, baseline = results["lean"], results["aiohttp"]
    return {
        "benchmark": "http",
        "started": started,
        "finished": time.time(),
        "parameters": {"requests": requests, "concurrency": concurrency, "rounds": rounds,
                       "warmup": warmup, "job_script": SUCCEED.to_json()},
        "results": {
            **results,
            "cpu_ratio_lean_to_aiohttp": None if not baseline["cpu_us_per_request"]
            else round(lean["cpu_us_per_request"] / baseline["cpu_us_per_request"], 3),
            "rate_ratio_lean_to_aiohttp": None
            if not baseline["requests_per_second"] or not lean["requests_per_second"]
            else round(lean["requests_per_second"] / baseline["requests_per_second"], 3),
        },
        **description,
        "notes": "Client CPU is the benchmark process's CPU time over the timed requests; the "
        "echo target runs in its own process on the same machine.",
    }


def run(args: argparse.Namespace) -> int:
    if args.out is not None:
        result_path(args.out, "http")  # refused now, not after the benchmark ran
    result = bench(requests=args.requests, concurrency=args.concurrency, rounds=args.rounds,
                   warmup=args.warmup)
    figures = result["results"]
    for name in CLIENTS:
        client = figures[name]
        print(f"{name:>8}: {client['requests_per_second']:.0f} requests/s, "
              f"{client['cpu_us_per_request']:.0f} us of client CPU per request "
              f"({client['user_us_per_request']:.0f} user, "
              f"{client['system_us_per_request']:.0f} system; "
              f"{client['requests']} requests, {client['errors']} errors)")
    print(f"lean / aiohttp: CPU per request x{figures['cpu_ratio_lean_to_aiohttp']}, "
          f"requests/s x{figures['rate_ratio_lean_to_aiohttp']} "
          f"(concurrency {args.concurrency}, {args.rounds} alternating rounds each)")
    if args.out is not None:
        write_json(args.out, result)
        print(f"wrote {args.out}")
    failed = sum(figures[name]["errors"] for name in CLIENTS)
    if failed:
        raise HarnessError(f"{failed} requests failed; the figures above are not the clients' "
                           "cost per call")
    return 0
