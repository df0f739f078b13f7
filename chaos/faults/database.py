"""Faults on the database: terminate the system under test's backends, restart the server,
pin xmin with an idle transaction, exhaust the server's connection slots.

Each acts only through its `NemesisContext`: `ctx.dsn` (never printed or recorded),
`ctx.app_prefix` (the application_name every connection of the system under test starts
with) and, for the restart, `ctx.restart_server()`. The faults' own connections are named
`skiplock-harness-...`, so they never match the system under test's prefix.

A lasting fault's connections are closed by `heal()` (idempotent, safe before or after a
failed `apply()`), and at interpreter exit if nothing healed it. If the process is killed
outright, the kernel closes the sockets and each backend ends at once, taking its
transaction and its connection slot with it.
"""

from __future__ import annotations

import atexit
import contextlib
import threading
import time
import weakref
from typing import Any

import psycopg

from skiplock.chaos.nemesis import Fault, FaultSkipped, register

# libpq's smallest effective connect timeout; a local server answers in milliseconds.
CONNECT_TIMEOUT_SECONDS = 2
# How long a fault waits for the backends it ended or released to be gone.
TERMINATE_WAIT_SECONDS = 2.0
# application_name is cut to NAMEDATALEN - 1 bytes in pg_stat_activity.
APPLICATION_NAME_BYTES = 63
# Beyond its planned window, how long the pinning transaction may stay idle before the
# server ends it: a harness that is frozen (not killed) must not pin xmin forever.
PIN_SAFETY_MARGIN_SECONDS = 60.0

PIN_APPLICATION_NAME = "skiplock-harness-pin-xmin"
EXHAUST_APPLICATION_NAME = "skiplock-harness-exhaust"
TERMINATE_APPLICATION_NAME = "skiplock-harness-terminate"

# Connection errors by which the server says it has no slot left: "sorry, too many clients
# already", and "remaining connection slots are reserved for ..." (wording varies by version).
_REFUSED_MARKERS = ("too many clients", "connection slots are reserved")


def _connect(dsn: str, application_name: str) -> psycopg.Connection[Any]:
    return psycopg.connect(dsn, autocommit=True, connect_timeout=CONNECT_TIMEOUT_SECONDS,
                           application_name=application_name)


def like_prefix(prefix: str) -> str:
    """A LIKE pattern (escape character `\\`) matching every application_name that starts
    with `prefix` as pg_stat_activity shows it: cut to 63 bytes, with `\\`, `%` and `_`
    matched literally."""
    shown = prefix.encode()[:APPLICATION_NAME_BYTES].decode(errors="ignore")
    escaped = shown.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
    return escaped + "%"


def _refusal(exc: psycopg.OperationalError) -> str | None:
    """The server's message when `exc` says it has no connection slot left, else None. Only
    the server's own text is kept (the part before it names the host and port)."""
    text = str(exc)
    if not any(marker in text for marker in _REFUSED_MARKERS):
        return None
    return " ".join(text.rsplit("FATAL:", 1)[-1].split())


def _wait_gone(conn: psycopg.Connection[Any], pids: list[int], deadline: float) -> int:
    """Poll until no backend in `pids` is left or `deadline` (monotonic) passes; how many
    still were."""
    while True:
        row = conn.execute("SELECT count(*) FROM pg_stat_activity WHERE pid = ANY(%s)",
                           (pids,)).fetchone()
        left = int(row[0]) if row else 0
        if left == 0 or time.monotonic() > deadline:
            return left
        time.sleep(0.01)


# Lasting faults that may hold connections now; healed at exit if the run did not.
_HOLDING: weakref.WeakSet[Fault] = weakref.WeakSet()


@atexit.register
def _heal_at_exit() -> None:
    for fault in list(_HOLDING):
        with contextlib.suppress(Exception):
            fault.heal()


@register
class TerminateBackends(Fault):
    """`pg_terminate_backend` on every session of the system under test in the current
    database (never the harness's own): transactions in flight roll back, and a COMMIT
    under way may or may not have happened. Instantaneous: it returns once the terminated
    backends are gone (or after a short wait). In phase "commit" it lasts instead: for its
    duration it ends up to `count` sessions caught committing (`_CommitHunt`)."""

    kind = "terminate_backends"
    _hunt: _CommitHunt | None = None

    def apply(self) -> list[str | None]:
        if self.planned.phase == "commit":
            # Lasting: ends up to `count` sessions caught committing until healed.
            self._hunt = _CommitHunt(self.ctx.dsn, self.ctx.app_prefix, self.planned.count,
                                     claim_transaction=self.ctx.claim_transaction)
            _HOLDING.add(self)
            self.data["phase"] = "commit"
            return ["postgres"]
        with _connect(self.ctx.dsn, TERMINATE_APPLICATION_NAME) as conn:
            rows = conn.execute(
                """
                SELECT pid, pg_terminate_backend(pid)
                FROM pg_stat_activity
                WHERE application_name LIKE %s ESCAPE '\\'
                  AND datname = current_database()
                  AND pid <> pg_backend_pid()
                """,
                (like_prefix(self.ctx.app_prefix),),
            ).fetchall()
            terminated = [pid for pid, done in rows if done]
            self.data["matched"] = len(rows)
            self.data["terminated"] = len(terminated)
            if not rows:
                raise FaultSkipped("no backend of the system under test was connected")
            self.data["still_alive"] = _wait_gone(
                conn, terminated, time.monotonic() + TERMINATE_WAIT_SECONDS)
        return ["postgres"]

    def heal(self) -> None:
        hunt, self._hunt = self._hunt, None
        if hunt is None:
            return
        hunt.stop()
        _HOLDING.discard(self)
        self.data["terminated"] = hunt.terminated
        self.data["polls"] = hunt.polls
        self.data["aim"] = hunt.aim
        if hunt.error is not None:
            self.data["error"] = hunt.error


# How often a commit-phase terminate_backends looks for sessions caught committing.
COMMIT_POLL_SECONDS = 0.001
# A claim that is a transaction of its own ends in a COMMIT statement, which pg_stat_activity
# shows. A claim that commits alone (an autocommit statement, as pgqueuer's dequeue, or
# statements committed at a pipeline's end) never shows one: its session shows the claim's
# text while it waits for its commit's WAL flush, in one of these wait events. (A server
# that does not wait for the flush, with synchronous_commit or fsync off, shows none.)
WAL_FLUSH_WAITS = (("IO", "WALSync"), ("IO", "WALWrite"), ("LWLock", "WALWrite"))


class _CommitHunt:
    """terminate_backends in phase "commit": a thread that, until stopped or `count`
    sessions are ended, ends sessions of the system under test caught committing. Such a
    commit may complete before the session dies: its client hears only the error, so a
    claim committed there is one its worker never sees. With `claim_transaction` (the
    queue's `Guarantees`) it ends only sessions running a COMMIT statement, where such a
    queue's claims commit; without, sessions waiting for a commit's WAL flush as well
    (`WAL_FLUSH_WAITS`), where a claim that commits alone does."""

    def __init__(self, dsn: str, prefix: str, count: int, *, claim_transaction: bool) -> None:
        self._conn = _connect(dsn, TERMINATE_APPLICATION_NAME)
        self._prefix = like_prefix(prefix)
        self._count = count
        self._flush_waits = [] if claim_transaction else list(WAL_FLUSH_WAITS)
        self.terminated = 0
        self.polls = 0
        self.error: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="terminate-commits", daemon=True)
        self._thread.start()

    @property
    def aim(self) -> str:
        return "commit flushes" if self._flush_waits else "COMMIT statements"

    def _run(self) -> None:
        try:
            while not self._stop.is_set() and self.terminated < self._count:
                # At most the sessions still to end: several may wait on one flush at once.
                rows = self._conn.execute(
                    """
                    WITH caught AS (
                        SELECT pid
                        FROM pg_stat_activity
                        WHERE application_name LIKE %(prefix)s ESCAPE '\\'
                          AND datname = current_database()
                          AND pid <> pg_backend_pid()
                          AND state = 'active'
                          -- COMMIT as a client sends it: asyncpg sends "COMMIT;".
                          AND (upper(btrim(query, E' ;\\n\\r\\t')) IN ('COMMIT', 'END')
                               OR (wait_event_type, wait_event) IN (
                                   SELECT * FROM unnest(%(types)s::text[], %(events)s::text[])))
                        LIMIT %(left)s
                    )
                    SELECT pid, pg_terminate_backend(pid) FROM caught
                    """,
                    {"prefix": self._prefix, "left": self._count - self.terminated,
                     "types": [kind for kind, _ in self._flush_waits],
                     "events": [event for _, event in self._flush_waits]},
                ).fetchall()
                self.polls += 1
                self.terminated += sum(1 for _, done in rows if done)
                self._stop.wait(COMMIT_POLL_SECONDS)
        except psycopg.Error as exc:  # the server restarted under it: the hunt ends
            self.error = f"{type(exc).__name__}: {exc}".splitlines()[0]

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)
        with contextlib.suppress(psycopg.Error):
            self._conn.close()


@register
class RestartPostgres(Fault):
    """Immediate stop and start of a server the harness started (crash recovery runs on
    the start): every session is cut, and only what was committed durably survives.
    Instantaneous: the window is the restart itself."""

    kind = "restart_postgres"

    def apply(self) -> list[str | None]:
        if not self.ctx.server_owned:
            raise FaultSkipped("server is external")
        started = time.monotonic()
        self.ctx.restart_server()
        self.data["seconds"] = round(time.monotonic() - started, 3)
        return ["postgres"]


@register
class PinXmin(Fault):
    """A repeatable-read transaction with an xid and a snapshot, left idle until healed:
    the xmin horizon cannot pass it, so no dead row version made meanwhile (the queue's
    finished and updated jobs) can be vacuumed or pruned, and SKIP LOCKED scans wade
    through them."""

    kind = "pin_xmin"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._lock = threading.Lock()
        self._conn: psycopg.Connection[Any] | None = None

    def apply(self) -> list[str | None]:
        conn = _connect(self.ctx.dsn, PIN_APPLICATION_NAME)
        with self._lock:
            self._conn = conn
        _HOLDING.add(self)
        try:
            limit_ms = 0
            if self.planned.duration > 0:
                limit_ms = round((self.planned.duration + PIN_SAFETY_MARGIN_SECONDS) * 1000)
            conn.execute("SELECT set_config('idle_in_transaction_session_timeout', %s, false)",
                         (str(limit_ms),))
            conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
            # An xid of our own, and the snapshot this first statement takes, held to the end.
            row = conn.execute(
                """
                SELECT txid_current(), txid_snapshot_xmin(txid_current_snapshot()),
                       pg_backend_pid()
                """
            ).fetchone()
            assert row is not None
            self.data["xid"], self.data["xmin"], self.data["pid"] = row
            seen = conn.execute(
                "SELECT backend_xmin::text FROM pg_stat_activity WHERE pid = pg_backend_pid()"
            ).fetchone()
            self.data["backend_xmin"] = int(seen[0]) if seen and seen[0] is not None else None
        except BaseException:
            self.heal()
            raise
        self.data["seconds"] = self.planned.duration
        return ["postgres"]

    def heal(self) -> None:
        with self._lock:
            conn, self._conn = self._conn, None
        _HOLDING.discard(self)
        if conn is None:
            return
        with contextlib.suppress(Exception):
            conn.execute("ROLLBACK")
        with contextlib.suppress(Exception):
            conn.close()


@register
class ExhaustPool(Fault):
    """Take every connection slot the server has left (as many as it accepts, at most one
    more than max_connections) and hold them until healed: the system under test's new connections
    are refused meanwhile, its open ones carry on."""

    kind = "exhaust_pool"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._lock = threading.Lock()
        self._conns: list[psycopg.Connection[Any]] = []

    def apply(self) -> list[str | None]:
        started = time.monotonic()
        _HOLDING.add(self)
        try:
            if self._open_one() is not None:
                raise FaultSkipped("the server already refused new connections")
            row = self._conns[0].execute(
                "SELECT current_setting('max_connections')::int"
            ).fetchone()
            cap = int(row[0]) if row else 100
            refusal = None
            # The server cannot accept more than max_connections: one attempt past them
            # sees it refuse, and bounds the loop should something in between accept more.
            while refusal is None and self._held() <= cap:
                refusal = self._open_one()
        except BaseException:
            self.heal()
            raise
        self.data["held"] = self._held()
        self.data["max_connections"] = cap
        self.data["refused"] = refusal is not None
        if refusal is not None:
            self.data["refusal"] = refusal
        self.data["open_seconds"] = round(time.monotonic() - started, 3)
        return ["postgres"]

    def _open_one(self) -> str | None:
        """Open and hold one more connection; the server's message if it has no slot left.
        Any other connection error propagates."""
        try:
            conn = _connect(self.ctx.dsn, EXHAUST_APPLICATION_NAME)
        except psycopg.OperationalError as exc:
            refusal = _refusal(exc)
            if refusal is None:
                raise
            return refusal
        with self._lock:
            self._conns.append(conn)
        return None

    def _held(self) -> int:
        with self._lock:
            return len(self._conns)

    def heal(self) -> None:
        with self._lock:
            conns, self._conns = self._conns, []
        _HOLDING.discard(self)
        pids = []
        for conn in conns:
            with contextlib.suppress(Exception):
                pids.append(conn.info.backend_pid)
                conn.close()
        if pids:
            self._wait_released(pids)

    def _wait_released(self, pids: list[int]) -> None:
        """Wait (bounded) until the closed sessions' backends are gone: a backend frees its
        slot as it exits, a moment after the client closed, and the window must cover it."""
        deadline = time.monotonic() + TERMINATE_WAIT_SECONDS
        while time.monotonic() < deadline:
            try:
                with _connect(self.ctx.dsn, EXHAUST_APPLICATION_NAME) as conn:
                    if _wait_gone(conn, pids, deadline) == 0:
                        return
            except psycopg.OperationalError as exc:
                if _refusal(exc) is None:
                    return  # the server is not answering at all: nothing to wait for
            time.sleep(0.01)

