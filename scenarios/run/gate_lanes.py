"""The gate's cases two (or more) at a time: each lane is a `skiplock gate --lane` process
with its own server, fed one case at a time.

A case is wall-clock bound (a few seconds of load, a drain, a check), so two lanes on two
cores finish a suite in a little over half the time. Each lane owns its server because
some faults restart or fill it: on a shared one they would reach the other lane's run,
whose history has no fault to explain what its workers saw. (On a server given by DSN
such faults are skipped, so lanes share it, each run in its own schema as always.)

Cases are handed out in the gate's order as lanes come free, so a gate cut short has still
tried every scenario of its first seed. The lanes run in sessions of their own: Ctrl-C
reaches this process alone, which passes it on once to each lane and waits while each
stops its run in order. The wire is one line each way: `SCENARIO SEED` to a lane (end of
input: no more), `@lane {json}` back (`accepted`, then a `result` per case).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, TextIO

from skiplock.plumbing.errors import HarnessError, Terminated, UsageError
from skiplock.plumbing.orphans import die_with_parent

PREFIX = "@lane "
# What `skiplock gate` prints before a refusal's message (see scenarios/cli/main.py).
_ERROR_PREFIX = "skiplock: "
# How long a lane may take to stop its case after Ctrl-C or SIGTERM before it is killed.
STOP_GRACE_SECONDS = 60.0

Case = tuple[str, int]


def lane_count(asked: int | None, cases: int) -> int:
    """Lanes for `cases` cases: as asked, else one per core up to two (a case keeps about
    one core busy), never more than there are cases."""
    wanted = asked if asked is not None else min(2, os.cpu_count() or 1)
    return max(1, min(wanted, cases))


# -- the lane's side -----------------------------------------------------------------------

def say(message: dict[str, Any], stream: TextIO | None = None) -> None:
    """One message to the gate that runs this lane."""
    out = stream or sys.stdout
    out.write(PREFIX + json.dumps(message) + "\n")
    out.flush()


def wire(result: Any) -> dict[str, Any]:
    """A case's result as the lane sends it (every field, examples included)."""
    return {"result": dataclasses.asdict(result)}


def cases_from(stream: IO[str]) -> Iterator[Case]:
    """The cases a lane is handed, until its input ends."""
    for raw in stream:
        scenario, _, seed = raw.strip().rpartition(" ")
        if scenario:
            yield scenario, int(seed)


# -- the gate's side -----------------------------------------------------------------------

@dataclass
class _Lane:
    process: subprocess.Popen[str]
    accepted: bool = False
    case: Case | None = None
    done: bool = False
    stderr: list[str] = field(default_factory=list)


@dataclass(kw_only=True)
class LaneCommand:
    """What every lane runs, as `skiplock gate` words (the DSN goes by environment, so no
    password shows in a process list)."""

    backend: str
    sql_path: str | None
    dsn: str | None
    backend_options: tuple[tuple[str, str], ...]
    overrides: Sequence[str]
    out: Path
    html: bool

    def argv(self) -> list[str]:
        words = [sys.executable, "-m", "skiplock", "gate", "--lane", "--backend", self.backend,
                 "--out", str(self.out)]
        for key, value in self.backend_options:
            words += ["--backend-opt", f"{key}={value}"]
        if self.sql_path is not None:
            words += ["--sql", self.sql_path]
        for override in self.overrides:
            words += ["--set", override]
        return words + ([] if self.html else ["--no-report"])

    def env(self) -> dict[str, str]:
        from skiplock.scenarios.servers.postgres import DSN_ENV

        env = dict(os.environ)
        if self.dsn is not None:
            env[DSN_ENV] = self.dsn
        return env


class Lanes:
    """Lane processes fed from one list of cases. Entering starts them and waits until each
    has accepted the backend (a refusal is bad input, raised before anything is written);
    `run` hands out the cases; leaving stops whatever still runs."""

    def __init__(self, command: LaneCommand, count: int) -> None:
        self._command = command
        self._count = count
        self._lanes: list[_Lane] = []
        self._stopping = False
        self._on_result: Callable[[dict[str, Any]], None] | None = None
        self._inbox: queue.Queue[tuple[int, dict[str, Any] | None]] = queue.Queue()

    def __enter__(self) -> Lanes:
        for _ in range(self._count):
            # Own session: the terminal's Ctrl-C reaches the gate, which passes it on once.
            process = subprocess.Popen(
                self._command.argv(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=subprocess.PIPE, text=True, bufsize=1, env=self._command.env(),
                start_new_session=True, preexec_fn=die_with_parent)
            self._lanes.append(_Lane(process))
        for index, lane in enumerate(self._lanes):
            threading.Thread(target=self._read, args=(index, lane), daemon=True,
                             name=f"skiplock-lane-{index}").start()
        try:
            self._await_acceptance()
        except BaseException:
            self.__exit__(*sys.exc_info())
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stopping = True
        stop = (signal.SIGTERM if isinstance(exc_info[1], Terminated) else signal.SIGINT)
        for lane in self._lanes:
            if lane.process.poll() is None and exc_info[1] is not None:
                with contextlib.suppress(ProcessLookupError):
                    lane.process.send_signal(stop)
            with contextlib.suppress(OSError):
                if lane.process.stdin is not None:
                    lane.process.stdin.close()
        deadline = time.monotonic() + STOP_GRACE_SECONDS
        for lane in self._lanes:
            try:
                lane.process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                lane.process.kill()
                lane.process.wait()
        # Results that came in while the gate was being stopped still count.
        while self._on_result is not None:
            try:
                _, message = self._inbox.get(timeout=1.0)
            except queue.Empty:
                break
            if message is not None and "result" in message:
                self._on_result(message["result"])

    def _read(self, index: int, lane: _Lane) -> None:
        """Pass a lane's messages to the gate; its other lines to this process's streams."""
        assert lane.process.stdout is not None and lane.process.stderr is not None
        errors = lane.process.stderr

        def relay_stderr() -> None:
            for text in errors:
                lane.stderr.append(text.rstrip("\n"))
                if lane.accepted and not self._stopping:
                    # Before acceptance it may be a refusal, which the gate says once; while
                    # stopping, each lane's "interrupted" would repeat the gate's own.
                    sys.stderr.write(text)

        relay = threading.Thread(target=relay_stderr, daemon=True)
        relay.start()
        for text in lane.process.stdout:
            if text.startswith(PREFIX):
                self._inbox.put((index, json.loads(text[len(PREFIX):])))
            else:
                sys.stdout.write(text)
        relay.join()
        lane.process.wait()
        self._inbox.put((index, None))

    def _next(self) -> tuple[int, dict[str, Any] | None]:
        # A timeout, so that Ctrl-C and SIGTERM are taken while waiting.
        while True:
            with contextlib.suppress(queue.Empty):
                return self._inbox.get(timeout=0.2)

    def _await_acceptance(self) -> None:
        waiting = set(range(len(self._lanes)))
        while waiting:
            index, message = self._next()
            lane = self._lanes[index]
            if message is None:
                lane.done = True
                waiting.discard(index)
                self._refused(lane)
            elif message.get("accepted"):
                lane.accepted = True
                waiting.discard(index)

    def _refused(self, lane: _Lane) -> None:
        """A lane that ended before accepting: its one line, as the gate's own."""
        code = lane.process.returncode
        said = next((text[len(_ERROR_PREFIX):] for text in reversed(lane.stderr)
                     if text.startswith(_ERROR_PREFIX)), f"a gate lane exited with {code}")
        if code == UsageError.exit_code:
            raise UsageError(said)
        raise HarnessError(said.removeprefix("harness failure: "))

    def run(self, todo: Iterable[Case], on_start: Callable[[Case], None],
            on_result: Callable[[dict[str, Any]], None]) -> None:
        """Hand out `todo` in order as lanes come free; each result to `on_result` as it
        arrives. A lane that dies mid-case gives that case a harness failure and takes no
        more; the others go on."""
        self._on_result = on_result
        pending = list(todo)
        pending.reverse()
        for lane in self._lanes:
            self._hand(lane, pending, on_start)
        while any(not lane.done for lane in self._lanes):
            index, message = self._next()
            lane = self._lanes[index]
            if message is None:
                lane.done = True
                if lane.case is not None:
                    on_result(self._lost_case(lane))
                    lane.case = None
            elif "result" in message:
                lane.case = None
                on_result(message["result"])
                self._hand(lane, pending, on_start)
        self._on_result = None

    def _hand(self, lane: _Lane, pending: list[Case], on_start: Callable[[Case], None]) -> None:
        stdin = lane.process.stdin
        assert stdin is not None
        if lane.done or not pending:
            with contextlib.suppress(OSError):
                stdin.close()
            return
        lane.case = pending.pop()
        on_start(lane.case)
        try:
            stdin.write(f"{lane.case[0]} {lane.case[1]}\n")
            stdin.flush()
        except OSError:
            pass  # the lane is gone: its end is read like any other

    def _lost_case(self, lane: _Lane) -> dict[str, Any]:
        assert lane.case is not None
        scenario, seed = lane.case
        last = lane.stderr[-1] if lane.stderr else "no message"
        return {"scenario": scenario, "seed": seed, "exit_code": HarnessError.exit_code,
                "valid": None, "seconds": 0.0,
                "error": f"harness failure: its gate lane exited with"
                         f" {lane.process.returncode} ({last})"}
