"""Where the CPU went: seconds used by each group of processes on this machine (the
PostgreSQL server, Redis, skiplock's workers, the rest of the harness), and how busy the
machine was, read from /proc for a window of a benchmark or a sweep step."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path


def process_stats() -> Iterator[tuple[int, str, list[str]]]:
    """(pid, name, the fields of /proc/PID/stat after the name) of each process that can be
    read now (Linux; elsewhere, none). Field 0 is the state, 1 the parent, 11 and 12 the
    user and system CPU in clock ticks."""
    proc = Path("/proc")
    if not proc.exists():
        return
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        comm = stat[stat.index("(") + 1: stat.rindex(")")]
        yield int(entry.name), comm, stat.rsplit(")", 1)[1].split()


def cpu_by_process() -> dict[int, tuple[str, float]]:
    """pid -> (group, CPU seconds used so far) for the server's processes, Redis's, the
    workers, and the rest of the harness (producers, the target, this process), told apart by
    their process names (`name_this_process`). Linux only: elsewhere, nothing."""
    found: dict[int, tuple[str, float]] = {}
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    for pid, comm, fields in process_stats():
        if comm.startswith("postgres"):
            group = "server"
        elif comm.startswith("redis-server"):
            group = "redis"
        elif comm == "skiplock-worker":
            group = "workers"
        elif comm in ("skiplock-produc", "skiplock-target") or pid == os.getpid():
            group = "harness"
        else:
            continue
        found[pid] = (group, (int(fields[11]) + int(fields[12])) / tick)
    return found


def machine_cpu() -> tuple[float, float]:
    """(busy, total) jiffies of the machine so far (/proc/stat)."""
    try:
        first = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    except OSError:
        return (0.0, 0.0)
    values = [float(v) for v in first]
    idle = values[3] + (values[4] if len(values) > 4 else 0.0)
    return (sum(values) - idle, sum(values))


class CpuWindow:
    """CPU seconds per group between `start()` and `stop()`; a process that started inside
    the window counts from zero, one that ended inside it up to its last reading."""

    def __init__(self) -> None:
        self._seen: dict[int, tuple[str, float, float]] = {}
        self._machine: tuple[float, float] = (0.0, 0.0)

    def _note(self, *, first: bool) -> None:
        for pid, (group, used) in cpu_by_process().items():
            seen = self._seen.get(pid)
            start = (used if first else 0.0) if seen is None else seen[1]
            self._seen[pid] = (group, start, used)

    def start(self) -> None:
        self._note(first=True)
        self._machine = machine_cpu()

    def stop(self) -> None:
        self._note(first=False)
        after = machine_cpu()
        self._machine = (after[0] - self._machine[0], after[1] - self._machine[1])

    def seconds(self, group: str) -> float | None:
        """CPU seconds of `group` in the window; None when no such process was seen."""
        used = [end - start for kind, start, end in self._seen.values() if kind == group]
        return round(sum(used), 2) if used else None

    def machine_busy(self) -> float | None:
        busy, total = self._machine
        return round(busy / total, 3) if total > 0 else None
