"""A columnar cache of the history files the checker has parsed.

The CSV logs (and nemesis.jsonl) stay the run directory's contract: many processes append to
them and a crash loses at most the last line. Parsing them is most of what a check costs (a
million deliveries are about 740 MB of CSV), so the checker keeps the columns it read from
each file it parsed completely and cleanly as an Arrow IPC file (Feather v2, uncompressed:
read through a memory map it costs next to nothing) under `RUN_DIR/.cache/`, mirroring the
file's path in the run directory: `RUN_DIR/workers/worker-0.csv` is cached as
`RUN_DIR/.cache/workers/worker-0.csv.arrow`.

A cache file is used only when the size and modification time it records are those of the
source file now, and it was written by this format version for the same candidate schemas;
otherwise it is ignored and rewritten. A file that was cut off mid-line, read line by line,
holding a NUL byte (the checker refuses it), or still being written is never cached. The
cache cannot make a check fail: a cache that cannot be read is a miss, and one that cannot
be written (read-only directory, full disk) is skipped with one debug log line. Writes run
in the background of the check that parsed the files (`BackgroundWrites`), which waits for
them before it returns.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa  # type: ignore[import-untyped]
import pyarrow.ipc as ipc  # type: ignore[import-untyped]

from skiplock.reports.history import DELIVERIES_DIR, WORKERS_DIR

CACHE_DIR = ".cache"
SUFFIX = ".arrow"
# Bump when what is cached, or how, changes: older cache files then count as misses.
# 2: only files without a NUL byte are cached (the checker refuses one; a cache hit skips it).
FORMAT_VERSION = 2
# A file modified this recently before it was read is not cached: a second change within
# the file system's timestamp granularity (up to 2 s on some) could keep size and mtime.
RACY_SECONDS = 2.0
_META_KEY = b"skiplock.cache"

log = logging.getLogger(__name__)

# Run directories whose writers are known to have stopped (the runner says so when its run
# has ended): their files cannot change under the reader, so the racy-timestamp rule does not
# hold back their cache. Process-wide, because the checker reads files in threads.
_settled_roots: set[Path] = set()


def mark_settled(run_dir: Path) -> None:
    """Declare that nothing writes into `run_dir` any more, so a check run right now may
    cache what it parses (the next check of the run then reads the columnar copy)."""
    _settled_roots.add(run_dir.resolve())


@dataclass(frozen=True, kw_only=True)
class Stamp:
    """What identifies one version of an append-only source file."""

    size: int
    mtime_ns: int

    @classmethod
    def of(cls, path: Path) -> Stamp:
        st = path.stat()
        return cls(size=st.st_size, mtime_ns=st.st_mtime_ns)


def run_root(source: Path) -> Path:
    """The run directory a history file belongs to: logs live in `deliveries/` and
    `workers/`, every other history file at the top of the run directory."""
    parent = source.parent
    return parent.parent if parent.name in (DELIVERIES_DIR, WORKERS_DIR) else parent


def cache_path(source: Path) -> Path:
    """Where the cache of `source` lives."""
    root = run_root(source)
    return root / CACHE_DIR / source.relative_to(root).parent / (source.name + SUFFIX)


def schemas_digest(schemas: Sequence[pa.Schema]) -> str:
    """A digest of the candidate schemas (in order): a cache parsed for other schemas is
    not used."""
    digest = hashlib.sha256()
    for schema in schemas:
        digest.update(schema.serialize().to_pybytes())
    return digest.hexdigest()


def _header(stamp: Stamp, digest: str) -> dict[str, Any]:
    """What a cache file must record to stand for the source version `stamp`."""
    return {"version": FORMAT_VERSION, "size": stamp.size, "mtime_ns": stamp.mtime_ns,
            "schemas": digest}


@dataclass
class Entry:
    """The cache of one source file, looked up before the file is read: `table` is the
    cached table when the cache is valid, else None (then `store` the parsed table)."""

    source: Path
    schemas: Sequence[pa.Schema]
    stamp: Stamp | None  # None: the source could not be stat'ed, so nothing is cached
    looked_up_ns: int  # wall clock before the source was read
    table: pa.Table | None

    def store(self, table: pa.Table, *, read_bytes: int) -> bool:
        """Cache `table`, parsed from all `read_bytes` bytes of the source, if the source
        is still the version looked up and was not being written when it was read.
        Returns whether the cache was written; a failure to write only logs."""
        stamp = self.stamp
        if stamp is None or read_bytes != stamp.size:
            return False
        racy = self.looked_up_ns - stamp.mtime_ns < RACY_SECONDS * 1e9
        if racy and run_root(self.source).resolve() not in _settled_roots:
            return False
        try:
            st = self.source.stat()
            if Stamp(size=st.st_size, mtime_ns=st.st_mtime_ns) != stamp:
                return False
            header = _header(stamp, schemas_digest(self.schemas)) | {"rows": table.num_rows}
            _write(cache_path(self.source),
                   table.replace_schema_metadata({_META_KEY: json.dumps(header).encode()}),
                   mode=st.st_mode & 0o666)
        except Exception as exc:  # the cache must never fail a check
            log.debug("columnar cache for %s not written: %s", self.source, exc)
            return False
        return True


class BackgroundWrites:
    """Cache writes run on one thread of their own while the check goes on: the cache
    serves the next check, so this one does not wait for it before judging. Writes stored
    while the files are still being parsed wait until `release` (parsing keeps every core
    busy; joining and judging keep only one); leaving the `with` block releases them and
    waits for every write (nothing is left half-done at exit). Left on an error or Ctrl-C,
    it drops the writes not yet started."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="skiplock-cache")
        self._held: list[tuple[Entry, pa.Table, int]] | None = []
        self._lock = threading.Lock()

    def store(self, entry: Entry, table: pa.Table, *, read_bytes: int) -> None:
        with self._lock:
            if self._held is not None:
                self._held.append((entry, table, read_bytes))
                return
        self._pool.submit(entry.store, table, read_bytes=read_bytes)

    def release(self) -> None:
        """Start the writes held so far, and every later one as it comes."""
        with self._lock:
            held, self._held = self._held or [], None
        for entry, table, read_bytes in held:
            self._pool.submit(entry.store, table, read_bytes=read_bytes)

    def __enter__(self) -> BackgroundWrites:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *rest: object) -> None:
        if exc_type is None:
            self.release()
        self._pool.shutdown(wait=True, cancel_futures=exc_type is not None)


def lookup(source: Path, schemas: Sequence[pa.Schema]) -> Entry:
    """Stat `source` and load its cache if the cache matches it and `schemas`."""
    now = time.time_ns()
    try:
        stamp = Stamp.of(source)
    except OSError:
        # The reader reports a missing or unreadable file; no cache stands in for it.
        return Entry(source=source, schemas=schemas, stamp=None, looked_up_ns=now, table=None)
    return Entry(source=source, schemas=schemas, stamp=stamp, looked_up_ns=now,
                 table=_load(source, schemas, stamp))


def _load(source: Path, schemas: Sequence[pa.Schema], stamp: Stamp) -> pa.Table | None:
    path = cache_path(source)
    try:
        if not path.is_file():
            return None
        # Memory-mapped and uncompressed: the columns are read in place, without a copy.
        with pa.memory_map(str(path), "r") as mapped:
            reader = ipc.open_file(mapped)
            found = json.loads((reader.schema.metadata or {}).get(_META_KEY, b"{}"))
            rows = found.pop("rows", None) if isinstance(found, dict) else None
            if found != _header(stamp, schemas_digest(schemas)):
                return None
            table = reader.read_all().replace_schema_metadata(None)
        if table.num_rows != rows or not any(table.schema.equals(s) for s in schemas):
            return None
        table.validate()
        return table
    except Exception as exc:  # an unreadable cache is a miss, never an error
        log.debug("columnar cache %s not used: %s", path, exc)
        return None


def _write(path: Path, table: pa.Table, *, mode: int) -> None:
    """Write atomically: a reader sees the old cache, no cache, or the whole new one.
    The cache is as readable as its source (`mode`)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, mode)
        os.close(fd)
        # Arrow's own file, not a Python file object: the columns go to the file without the
        # GIL and without a copy through Python's buffered writer for each buffer.
        with pa.OSFile(tmp, "wb") as sink, ipc.new_file(sink, table.schema) as writer:
            writer.write_table(table)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def cache_bytes(run_dir: Path) -> int:
    """The size of the cache of `run_dir`."""
    root = Path(run_dir) / CACHE_DIR
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file()) if root.is_dir() else 0


__all__ = [
    "CACHE_DIR",
    "FORMAT_VERSION",
    "RACY_SECONDS",
    "BackgroundWrites",
    "Entry",
    "Stamp",
    "cache_bytes",
    "cache_path",
    "lookup",
    "run_root",
    "schemas_digest",
]
