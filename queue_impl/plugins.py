"""Choosing a system under test by name: the reference queue, its variants, or a plug-in.

A `BackendSpec` is what crosses process boundaries: a small picklable record. Each child
process calls `.create()` after it starts, so every connection is opened in the process that
uses it. Names of the form `package.module:factory` load any other implementation of
`QueueBackend`; the factory is called as `factory(dsn=..., schema=..., sql_path=...)`.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import cast

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from queue_impl.interface import QueueBackend

BACKEND_NAMES: tuple[str, ...] = ("pg", "pg-naive", "pg-for-update", "pg-long-tx")

_FACTORY = re.compile(r"^(?P<module>[A-Za-z_][\w]*(?:\.[A-Za-z_]\w*)*):(?P<attr>[A-Za-z_]\w*)$")

Factory = Callable[..., QueueBackend]


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def load_factory(name: str) -> Factory:
    """The callable named by `package.module:factory`; ValueError with one line if not."""
    match = _FACTORY.match(name)
    if match is None:
        raise ValueError(
            f"unknown backend {name!r}: use one of {', '.join(BACKEND_NAMES)} "
            "or package.module:factory"
        )
    module_name, attr = match.group("module"), match.group("attr")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # any import-time failure is the user's module, reported as such
        raise ValueError(
            f"backend {name!r}: cannot import {module_name} ({_one_line(exc)}); "
            "check the module is on PYTHONPATH"
        ) from exc
    factory = getattr(module, attr, None)
    if factory is None or not callable(factory):
        raise ValueError(f"backend {name!r}: {module_name} has no callable {attr!r}")
    return cast(Factory, factory)


def validate_backend_name(name: str) -> None:
    """Raise ValueError (one line, saying what to use instead) for an unusable name."""
    if name in BACKEND_NAMES:
        return
    load_factory(name)


def redact(dsn: str) -> str:
    """The DSN without its password, for display."""
    try:
        params = conninfo_to_dict(dsn)
    except psycopg.ProgrammingError:
        return "<unparsable DSN>"
    if "password" in params:
        params["password"] = "***"
    return make_conninfo(**{k: str(v) for k, v in params.items() if v is not None})


@dataclass(frozen=True, kw_only=True)
class BackendSpec:
    """Which queue to build, and where; picklable, with no open resources."""

    name: str
    dsn: str | None = field(default=None, repr=False)
    schema: str = "skiplock"
    sql_path: str | None = None

    def create(self) -> QueueBackend:
        """Build the queue in the calling process (its connections open lazily, here)."""
        if self.name in BACKEND_NAMES:
            from queue_impl.pg import PgQueue, Variant

            if not self.dsn:
                raise ValueError(f"backend {self.name!r} needs a PostgreSQL DSN")
            return PgQueue(
                self.dsn,
                schema=self.schema,
                sql=self.sql_path,
                variant=cast(Variant, self.name),
            )
        factory = load_factory(self.name)
        try:
            backend = factory(dsn=self.dsn, schema=self.schema, sql_path=self.sql_path)
        except TypeError as exc:
            raise ValueError(
                f"backend {self.name!r}: cannot be called as factory(dsn=..., schema=..., "
                f"sql_path=...) ({_one_line(exc)})"
            ) from exc
        if not isinstance(backend, QueueBackend):
            raise ValueError(
                f"backend {self.name!r}: the factory returned {type(backend).__name__}, "
                "which does not implement QueueBackend"
            )
        return backend

    def display(self) -> str:
        parts = [self.name, f"schema={self.schema}"]
        if self.dsn:
            parts.append(f"dsn={redact(self.dsn)}")
        if self.sql_path:
            parts.append(f"sql={self.sql_path}")
        return " ".join(parts)
