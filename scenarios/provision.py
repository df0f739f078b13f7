"""Where PostgreSQL comes from, for the CLI and the tests alike.

In order: a DSN given (`--dsn`, else `SKIPLOCK_PG_DSN`); else a testcontainers container when
a Docker engine answers; else an embedded server from the `pgserver` package. A server the
harness started is stopped when the context exits: normally, on error, and on Ctrl-C.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Literal

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from scenarios.errors import UsageError

DSN_ENV = "SKIPLOCK_PG_DSN"

ServerKind = Literal["dsn", "docker", "embedded"]


def redact_dsn(dsn: str) -> str:
    """The DSN with any password replaced, safe for logs and reports."""
    try:
        params = conninfo_to_dict(dsn)
    except psycopg.ProgrammingError:
        return "<unparsable DSN>"
    if "password" in params:
        params["password"] = "***"
    return make_conninfo(**{k: str(v) for k, v in params.items() if v is not None})


@dataclass(kw_only=True)
class PgServer:
    dsn: str = field(repr=False)
    kind: ServerKind
    # True when the harness started this server and may restart or stop it.
    owned: bool
    durable: bool

    @property
    def display(self) -> str:
        return redact_dsn(self.dsn)


@contextmanager
def postgres(dsn: str | None = None, *, durable: bool = True) -> Iterator[PgServer]:
    """Yield a reachable PostgreSQL server. Placeholder: only the DSN path exists so far."""
    dsn = dsn or os.environ.get(DSN_ENV)
    if not dsn:
        raise UsageError(f"no PostgreSQL: pass --dsn or set {DSN_ENV}")
    yield PgServer(dsn=dsn, kind="dsn", owned=False, durable=durable)
