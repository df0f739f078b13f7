"""`cancel_statements`: for its window, `pg_cancel_backend` on every statement the system under
test runs, as a too-short `statement_timeout` or an operator's cancel would. Unlike
`terminate_backends` the sessions live on: a claim, a renewal or a result write fails with
`QueryCanceled` inside an open transaction, and the worker must roll back and carry on with the
same connection. A queue that keeps using an aborted transaction, or takes a cancelled result
write for a done one, shows here."""

from __future__ import annotations

import contextlib
import threading
from typing import Any

import psycopg

from skiplock.chaos.faults.database import _connect, like_prefix
from skiplock.chaos.nemesis import Fault, register

CANCEL_APPLICATION_NAME = "skiplock-harness-cancel"
# How often the fault looks for running statements: often enough to catch a claim, which
# runs for a millisecond or two.
CANCEL_POLL_SECONDS = 0.002


@register
class CancelStatements(Fault):
    kind = "cancel_statements"
    _thread: threading.Thread | None = None

    def apply(self) -> list[str | None]:
        self._stop = threading.Event()
        self._conn: psycopg.Connection[Any] = _connect(self.ctx.dsn, CANCEL_APPLICATION_NAME)
        self.data["cancelled"] = 0
        self._thread = threading.Thread(target=self._cancel_until_healed,
                                        name="cancel-statements", daemon=True)
        self._thread.start()
        return ["postgres"]

    def _cancel_until_healed(self) -> None:
        prefix = like_prefix(self.ctx.app_prefix)
        try:
            while not self._stop.is_set():
                rows = self._conn.execute(
                    """
                    SELECT pid, pg_cancel_backend(pid)
                    FROM pg_stat_activity
                    WHERE application_name LIKE %s ESCAPE '\\'
                      AND datname = current_database()
                      AND pid <> pg_backend_pid()
                      AND state = 'active'
                    """,
                    (prefix,),
                ).fetchall()
                self.data["cancelled"] += sum(1 for _, done in rows if done)
                self._stop.wait(CANCEL_POLL_SECONDS)
        except psycopg.Error as exc:  # the server went away under it: the fault ends
            self.data["error"] = f"{type(exc).__name__}: {exc}".splitlines()[0]

    def heal(self) -> None:
        thread, self._thread = self._thread, None
        if thread is None:
            return
        self._stop.set()
        thread.join(timeout=5.0)
        with contextlib.suppress(psycopg.Error):
            self._conn.close()
