"""`skiplock bench target`: the echo target's capacity on its own.

A target runs in its own process; load comes from separate processes (an aiohttp client
loop each, `--concurrency` requests in flight in total), posting `succeed` jobs with the
same headers and payload shape the dispatcher sends. Requests in the warm-up are not
counted. The result says requests/s and p50/p99 latency, and describes itself (machine,
Python, versions, git sha and dirty flag, parameters) so figures can be compared later.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
from array import array
from pathlib import Path
from typing import Any

from skiplock.chaos.target import TargetProcess
from skiplock.plumbing.argtypes import non_negative_float, positive_float, positive_int
from skiplock.plumbing.errors import HarnessError, UsageError
from skiplock.queue_impl.interface import (
    ACCOUNT_HEADER,
    ATTEMPT_HEADER,
    JOB_ID_HEADER,
    WORKER_HEADER,
)
from skiplock.reports.history import SUCCEED, write_json
from skiplock.reports.selfdescribe import describe
from skiplock.scenarios.bench.common import add_out, result_path


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--duration", type=positive_float, default=10.0, metavar="S",
        help="seconds of measured load (default %(default)g)",
    )  # fmt: skip
    parser.add_argument(
        "--concurrency", type=positive_int, default=32, metavar="C",
        help="requests in flight at once, over all load processes (default %(default)d)",
    )  # fmt: skip
    parser.add_argument(
        "--load-processes", type=positive_int, default=1, metavar="N",
        help="client processes generating the load (default %(default)d)",
    )  # fmt: skip
    parser.add_argument(
        "--warmup", type=non_negative_float, default=1.0, metavar="S",
        help="seconds of load before measuring (default %(default)g)",
    )  # fmt: skip
    add_out(parser)


# ----------------------------------------------------------------------------------------------
# The load process.
# ----------------------------------------------------------------------------------------------


async def _drive(
    url: str, prefix: str, concurrency: int, warmup: float, duration: float
) -> dict[str, Any]:
    import aiohttp

    body = json.dumps({"script": SUCCEED.to_json(), "note": "bench"}).encode()
    latencies = array("d")
    errors = 0
    loop = asyncio.get_running_loop()
    begin = loop.time()
    measure_from = begin + warmup
    measure_to = measure_from + duration

    async def user(session: aiohttp.ClientSession, index: int) -> None:
        nonlocal errors
        sequence = 0
        while True:
            sent = loop.time()
            if sent >= measure_to:
                return
            sequence += 1
            headers = {
                JOB_ID_HEADER: f"{prefix}-{index}-{sequence}",
                ATTEMPT_HEADER: "1",
                ACCOUNT_HEADER: f"bench-{index % 8}",
                WORKER_HEADER: prefix,
                "Content-Type": "application/json",
            }
            try:
                async with session.post(url, data=body, headers=headers) as response:
                    await response.read()
                    ok = response.status == 200
            except (aiohttp.ClientError, TimeoutError):
                ok = False
            done = loop.time()
            if sent >= measure_from:
                if ok:
                    latencies.append(done - sent)
                else:
                    errors += 1

    connector = aiohttp.TCPConnector(limit=concurrency)
    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        await asyncio.gather(*(user(session, i) for i in range(concurrency)))
    window = max(loop.time(), measure_to) - measure_from
    return {"requests": len(latencies), "errors": errors, "window": window,
            "latencies": latencies.tobytes()}  # fmt: skip


def _load_main(
    conn: Any, url: str, prefix: str, concurrency: int, warmup: float, duration: float
) -> None:
    try:
        conn.send(("ok", asyncio.run(_drive(url, prefix, concurrency, warmup, duration))))
    except Exception as exc:
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
    finally:
        conn.close()


# ----------------------------------------------------------------------------------------------
# Self-description.
# ----------------------------------------------------------------------------------------------


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds a process has used (Linux /proc), None elsewhere."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    # After the command name: state is field 3, utime 14 and stime 15 (1-based, man proc).
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _percentile(sorted_values: list[float], fraction: float) -> float | None:
    if not sorted_values:
        return None
    index = min(len(sorted_values) - 1, max(0, round(fraction * len(sorted_values)) - 1))
    return sorted_values[index]


# ----------------------------------------------------------------------------------------------
# The benchmark.
# ----------------------------------------------------------------------------------------------


def _run_load(
    ctx: Any, url: str, shares: list[int], warmup: float, duration: float
) -> list[dict[str, Any]]:
    """Start one load process per share of the concurrency and collect what each measured."""
    loaders = []
    for index, share in enumerate(shares):
        parent, child = ctx.Pipe(duplex=False)
        process = ctx.Process(
            target=_load_main,
            args=(child, url, f"load{index}", share, warmup, duration),
            name=f"skiplock-bench-load-{index}",
            daemon=True,
        )
        process.start()
        child.close()
        loaders.append((process, parent))
    results: list[dict[str, Any]] = []
    try:
        for _, parent in loaders:
            # Generous: spawn and import, warm-up, duration, then the last answers.
            if not parent.poll(warmup + duration + 120.0):
                raise HarnessError("a load process did not report back")
            try:
                kind, value = parent.recv()
            except EOFError:
                raise HarnessError("a load process died before reporting") from None
            if kind != "ok":
                raise HarnessError(f"a load process failed: {value}")
            results.append(value)
    finally:
        for process, parent in loaders:
            parent.close()
            process.join(5.0)
            if process.is_alive():
                process.kill()
                process.join()
    return results


def _results(results: list[dict[str, Any]], cpu_used: float | None,
             target_stats: dict[str, Any], log_bytes: int) -> dict[str, Any]:
    """The load processes' requests and latencies, and the target's CPU per delivery."""
    latencies: list[float] = []
    for result in results:
        chunk = array("d")
        chunk.frombytes(result["latencies"])
        latencies.extend(chunk)
    latencies.sort()
    rate = sum(r["requests"] / r["window"] for r in results if r["window"] > 0)
    deliveries = int(target_stats.get("deliveries", 0))
    per_request = None if cpu_used is None or not deliveries else cpu_used * 1e6 / deliveries

    def ms(value: float | None) -> float | None:
        return None if value is None else round(value * 1000.0, 3)

    return {
        "requests": sum(r["requests"] for r in results),
        "errors": sum(r["errors"] for r in results),
        "requests_per_second": round(rate, 1),
        "latency_ms": {
            "p50": ms(_percentile(latencies, 0.50)),
            "p99": ms(_percentile(latencies, 0.99)),
            "max": ms(latencies[-1] if latencies else None),
        },
        # CPU the target spent per delivery (warm-up included): its ceiling on one core,
        # less sensitive to a busy machine than requests/s is.
        "target_cpu_seconds": None if cpu_used is None else round(cpu_used, 3),
        "target_cpu_us_per_request": None if per_request is None else round(per_request, 1),
        "target_capacity_per_core_estimate": None if not per_request else round(1e6 / per_request),
        "target_stats": target_stats,
        "delivery_log_bytes": log_bytes,
    }


def bench(
    *, duration: float, concurrency: int, load_processes: int, warmup: float
) -> dict[str, Any]:
    """Run the benchmark and return its self-describing result."""
    import multiprocess

    if concurrency < load_processes:
        raise UsageError(
            f"--concurrency {concurrency} is less than --load-processes {load_processes}; "
            "give each load process at least one request in flight"
        )
    description = describe()
    started = time.time()
    ctx = multiprocess.get_context("spawn")
    shares = [concurrency // load_processes + (1 if i < concurrency % load_processes else 0)
              for i in range(load_processes)]  # fmt: skip
    with (
        tempfile.TemporaryDirectory(prefix="skiplock-bench-target-") as tmp,
        TargetProcess(Path(tmp), name="bench") as target,
    ):
        assert target.pid is not None
        cpu_before = cpu_seconds(target.pid)
        results = _run_load(ctx, target.deliver_url, shares, warmup, duration)
        cpu_after = cpu_seconds(target.pid)
        target_stats = target.stats()
        log_bytes = target.deliveries_path.stat().st_size

    cpu_used = None if cpu_before is None or cpu_after is None else cpu_after - cpu_before
    return {
        "benchmark": "target",
        "started": started,
        "finished": time.time(),
        "parameters": {
            "duration_seconds": duration,
            "warmup_seconds": warmup,
            "concurrency": concurrency,
            "load_processes": load_processes,
            "job_script": SUCCEED.to_json(),
            "load_client": "aiohttp",
        },
        "results": _results(results, cpu_used, target_stats, log_bytes),
        **description,
        "notes": "The target records every delivery with one write() and no fsync; load "
        "and target share the machine's cores.",
    }


def run(args: argparse.Namespace) -> int:
    if args.out is not None:
        result_path(args.out, "target")  # refused now, not after the benchmark ran
    result = bench(
        duration=args.duration,
        concurrency=args.concurrency,
        load_processes=args.load_processes,
        warmup=args.warmup,
    )
    figures = result["results"]
    latency = figures["latency_ms"]
    print(
        f"echo target: {figures['requests_per_second']:.0f} requests/s, "
        f"p50 {latency['p50']} ms, p99 {latency['p99']} ms "
        f"(target CPU {figures['target_cpu_us_per_request']} us/request; "
        f"{figures['requests']} requests, {figures['errors']} errors, "
        f"concurrency {args.concurrency}, {args.load_processes} load process(es), "
        f"{args.duration:g} s)"
    )
    if args.out is not None:
        write_json(args.out, result)
        print(f"wrote {args.out}")
    if figures["errors"] or not figures["requests"]:
        # A capacity figure with failed requests in it is not a capacity figure.
        raise HarnessError(
            f"{figures['errors']} requests failed and {figures['requests']} succeeded; "
            "the figures above are not the target's capacity"
        )
    return 0
