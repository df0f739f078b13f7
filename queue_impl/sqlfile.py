"""Named SQL blocks: the reference queue's statements, and a team's replacements for them.

A `.sql` file holds blocks; a line `-- name: BLOCK` starts one and it runs until the next
such line. Placeholders are psycopg named parameters, `%(name)s`; a literal percent sign is
written `%%`. `statements_with_overrides(FILE)` replaces the reference blocks by name with the
file's (the `--sql FILE` option), so a team can gate its own queue SQL; names the file does
not define fall back to the reference. `receive` and `recover_unreceived` came later than the
others: a file that replaces `schema` but defines neither runs without receipts (every
committed claim counts, as before; see `PgQueue.receipts`).

Every statement runs with `search_path` set to the queue's schema, in a READ COMMITTED
transaction (the queue sets it on its connections), and must read the time from
`skiplock_now()`, or `skiplock_lease_base()` for a lease deadline, so that tests can pin the
clock. Arrays are passed aligned, one element per
job, and `ords` numbers the caller's items 0..n-1 so a block can say which ones it applied.

Blocks (placeholders; optional ones in brackets) and what each must do and return:

- `schema` (none; run as one script): create `skiplock_now()` (the pinned clock, else
  `statement_timestamp()`), `skiplock_lease_base()` (the pinned clock, else
  `clock_timestamp()`), tables `accounts`, `jobs` (with a check that `target_url` is
  http(s), a `received_token`, and a `limited` flag that triggers keep equal to whether the
  job's account has a limit), `job_attempts` (outcomes including `unreceived`),
  `fenced_writes` and their indexes if missing; idempotent.
- `setup_lock` (`lock_key`): take a transaction-level advisory lock (serialises `schema`).
- `upsert_accounts` (`account_ids`, `limits`): insert accounts or update their
  `concurrency_limit` (NULL: unlimited).
- `enqueue` (`job_ids`, `account_ids`, `target_urls`, `payloads`, `run_ats`, `max_attempts`):
  insert the batch as PENDING (NULL `run_at`: due now), creating missing accounts unlimited.
  The queue has already checked the batch (http(s) URLs, account ids free of control
  characters, `max_attempts` of 1 or more) and refused it whole if any job was bad.
- `notify` (`channel`): `pg_notify` the channel; runs in the enqueue transaction.
- `claim_lock_accounts` ([`batch`]): lock limited accounts that have due work and (by this
  snapshot) a free slot, `FOR NO KEY UPDATE SKIP LOCKED`, at most `batch` of them, the one
  with the oldest due job first (ties by id); return their `id`. Locking every such account
  would leave a concurrent claimer none.
- `claim` (`locked_accounts`, `batch`, `lease`, `worker_id`): a second statement, so its
  snapshot follows the locks: count active jobs per locked account; pick due PENDING and due
  RETRYING rows `FOR UPDATE SKIP LOCKED` for unlimited accounts (the reference reads those
  as jobs not `limited`) or locked ones with free slots; cut to the free slots and to
  `batch`; set PROCESSING, `attempts + 1`,
  `locked_until = skiplock_lease_base() + lease` (counted from when the row is taken, not
  from when the statement began), a fresh `lease_token`, `locked_by`; insert a `job_attempts`
  row; return `id, account_id, target_url, payload, attempts, max_attempts, lease_token,
  locked_until, locked_by`.
- `claim_lock_accounts_wait`, `claim_wait` (as above): the `pg-for-update` variant, the same
  without SKIP LOCKED (accounts locked in id order, so claimers cannot deadlock).
- `naive_select_due` (`batch`): the `pg-naive` variant: return due `id`s, no row lock.
- `naive_take` (`job_ids`, `lease`, `worker_id`): the `pg-naive` variant: lease those ids
  with no status re-check; return as `claim`.
- `finish` (`ords`, `job_ids`, `lease_tokens`, `outcomes`, `retry_delays` [`attempts`,
  `workers`, `http_statuses`, `errors`, `finished_ats`]): lock the rows still held in id
  order first (so overlapping batches cannot deadlock); only where still PROCESSING with
  the same token: success -> COMPLETED; permanent -> FAILED; transient -> RETRYING at
  now + delay, or FAILED at max_attempts (keeping the error); close the `job_attempts` row;
  record the others in `fenced_writes`; return the applied `ord`s.
- `receive` (`ords`, `job_ids`, `lease_tokens` [`attempts`, `workers`]): lock the rows still
  held in id order, then mark each lease received (`received_token = lease_token`); return
  the applied `ord`s. The worker sends it before its first call: only a received lease can
  have been delivered.
- `renew` (`ords`, `job_ids`, `lease_tokens`, `extend` [`attempts`, `workers`]): lock the
  rows still held in id order, then extend `locked_until` to `skiplock_lease_base()` +
  extend; record the others as fenced; return `ord, locked_until`.
- `release` (`ords`, `job_ids`, `lease_tokens` [`attempts`, `workers`]): lock the rows
  still held in id order, then back to due now with `attempts - 1` and the token cleared;
  record the others as fenced; return the applied `ord`s.
- `recover_unreceived` (`limit`): run just before `recover`, in its transaction and at the
  same instant: give back up to `limit` expired leases never received (`received_token`
  not the lease's token) as `release` does (due now, `attempts - 1`); close their
  `job_attempts` rows as `unreceived`; return one row whose first column is the count.
- `recover` (`limit`): move up to `limit` expired leases, `FOR UPDATE SKIP LOCKED`, to
  RETRYING (due now) or FAILED at max_attempts; close their `job_attempts` rows as
  `lease_expired`; return one row whose first column is the count.
- `snapshot` (none): every job: `id, account_id, status, attempts, max_attempts,
  last_error, locked_until, next_attempt_at` (further columns are kept as extras).
- `list_attempts`, `list_fenced` (none): every `job_attempts` / `fenced_writes` row.
"""

from __future__ import annotations

import re
from pathlib import Path

from psycopg.adapt import PyFormat

REFERENCE_PATH = Path(__file__).with_name("sql") / "reference.sql"

_NAME_LINE = re.compile(r"^--\s*name:\s*(?P<name>\S*)\s*$")
_PLACEHOLDER = re.compile(r"%\((?P<name>[A-Za-z_][A-Za-z0-9_]*)\)s")
# What is left of a percent sign once placeholders and escaped %% are taken out.
_LONE_PERCENT = re.compile(r"%")

_ITEMS = frozenset({"ords", "job_ids", "lease_tokens"})
_ITEM_EXTRAS = frozenset({"attempts", "workers"})
_CLAIM = frozenset({"locked_accounts", "batch", "lease", "worker_id"})

REQUIRED_PLACEHOLDERS: dict[str, frozenset[str]] = {
    "schema": frozenset(),
    "setup_lock": frozenset({"lock_key"}),
    "upsert_accounts": frozenset({"account_ids", "limits"}),
    "enqueue": frozenset(
        {"job_ids", "account_ids", "target_urls", "payloads", "run_ats", "max_attempts"}
    ),
    "notify": frozenset({"channel"}),
    "claim_lock_accounts": frozenset(),
    "claim": _CLAIM,
    "claim_lock_accounts_wait": frozenset(),
    "claim_wait": _CLAIM,
    "naive_select_due": frozenset({"batch"}),
    "naive_take": frozenset({"job_ids", "lease", "worker_id"}),
    "finish": _ITEMS | {"outcomes", "retry_delays"},
    "receive": _ITEMS,
    "renew": _ITEMS | {"extend"},
    "release": _ITEMS,
    "recover_unreceived": frozenset({"limit"}),
    "recover": frozenset({"limit"}),
    "snapshot": frozenset(),
    "list_attempts": frozenset(),
    "list_fenced": frozenset(),
}

# Placeholders a block may use beyond the required ones (values the caller always passes).
OPTIONAL_PLACEHOLDERS: dict[str, frozenset[str]] = {
    "claim_lock_accounts": frozenset({"batch"}),
    "claim_lock_accounts_wait": frozenset({"batch"}),
    "finish": _ITEM_EXTRAS | {"http_statuses", "errors", "finished_ats"},
    "receive": _ITEM_EXTRAS,
    "renew": _ITEM_EXTRAS,
    "release": _ITEM_EXTRAS,
}

BLOCK_NAMES = frozenset(REQUIRED_PLACEHOLDERS)


class SqlFileError(ValueError):
    """A SQL file that cannot be used; the message names the file, the block and the fix."""


def allowed_placeholders(block: str) -> frozenset[str]:
    return REQUIRED_PLACEHOLDERS[block] | OPTIONAL_PLACEHOLDERS.get(block, frozenset())


def placeholders(text: str) -> frozenset[str]:
    """The named placeholders a statement uses."""
    return frozenset(m.group("name") for m in _PLACEHOLDER.finditer(text))


def _strip_comments(text: str) -> str:
    return "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("--"))


def _check_block(path: Path, name: str, text: str) -> None:
    where = f"{path}: block {name!r}"
    if name not in BLOCK_NAMES:
        known = ", ".join(sorted(BLOCK_NAMES))
        raise SqlFileError(f"{where}: unknown block name; use one of: {known}")
    if not _strip_comments(text).strip():
        raise SqlFileError(f"{where}: the block has no SQL; write the statement or remove it")
    # Comments count too: psycopg reads placeholders and percent signs in them as well.
    code = text
    used = placeholders(code)
    missing = REQUIRED_PLACEHOLDERS[name] - used
    if missing:
        raise SqlFileError(
            f"{where}: missing placeholder(s) {_fmt(missing)}; the statement must use them"
        )
    unknown = used - allowed_placeholders(name)
    if unknown:
        allowed = _fmt(allowed_placeholders(name)) or "none"
        raise SqlFileError(
            f"{where}: unknown placeholder(s) {_fmt(unknown)}; this block takes {allowed}"
        )
    if name == "schema":
        # The schema block runs as a script with no parameters, so %% would stay doubled.
        return
    rest = _PLACEHOLDER.sub("", code).replace("%%", "")
    if _LONE_PERCENT.search(rest):
        raise SqlFileError(
            f"{where}: a lone '%' that is not a %(name)s placeholder; write '%%' for a literal"
        )


def _fmt(names: frozenset[str]) -> str:
    return ", ".join(f"%({n})s" for n in sorted(names))


def load_statements(path: Path | str) -> dict[str, str]:
    """Parse a file of named blocks, checking every block it defines."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise SqlFileError(f"{path}: cannot read the SQL file ({reason}); check the path") from exc
    blocks: dict[str, str] = {}
    current: str | None = None
    lines: list[str] = []

    def close() -> None:
        if current is None:
            return
        _check_block(path, current, "\n".join(lines))
        blocks[current] = "\n".join(lines).strip()

    for number, line in enumerate(text.splitlines(), start=1):
        match = _NAME_LINE.match(line)
        if match is None:
            if current is None and line.strip() and not line.lstrip().startswith("--"):
                raise SqlFileError(
                    f"{path}: line {number}: SQL before the first '-- name: BLOCK' line; "
                    "start every statement with one"
                )
            lines.append(line)
            continue
        close()
        name = match.group("name")
        if not name:
            raise SqlFileError(f"{path}: line {number}: '-- name:' without a block name")
        if name in blocks:
            raise SqlFileError(
                f"{path}: block {name!r}: defined twice (line {number}); keep one definition"
            )
        current, lines = name, []
    close()
    if not blocks:
        raise SqlFileError(
            f"{path}: no '-- name: BLOCK' blocks found; the file is empty or has no named blocks"
        )
    return blocks


_reference_cache: dict[str, str] | None = None


def reference_statements() -> dict[str, str]:
    global _reference_cache
    if _reference_cache is None:
        _reference_cache = load_statements(REFERENCE_PATH)
        absent = BLOCK_NAMES - _reference_cache.keys()
        if absent:
            raise SqlFileError(f"{REFERENCE_PATH}: blocks missing: {', '.join(sorted(absent))}")
    return dict(_reference_cache)


def statements_with_overrides(path: Path | str | None) -> dict[str, str]:
    """The reference statements, with the blocks of `path` (if any) replacing them by name."""
    return statements_and_sources(path)[0]


def statements_and_sources(path: Path | str | None) -> tuple[dict[str, str], dict[str, Path]]:
    """As `statements_with_overrides`, with the file each block came from (`REFERENCE_PATH`
    for the blocks `path` does not define), so an error can name the file to fix."""
    statements = reference_statements()
    sources = dict.fromkeys(statements, REFERENCE_PATH)
    if path is not None:
        overrides = load_statements(path)
        statements.update(overrides)
        sources.update(dict.fromkeys(overrides, Path(path)))
    return statements, sources


# psycopg's own reading of a query: `%%` is a literal percent sign, `%(name)s` a parameter
# (`%(name)b` one sent in binary), left to right (so `%%(x)s` is a percent sign and the text
# `(x)s`).
_PSYCOPG_TOKEN = re.compile(r"%%|%\((?P<name>[A-Za-z_][A-Za-z0-9_]*)\)(?P<format>[sb])")


def positional(text: str) -> tuple[str, tuple[str, ...], tuple[PyFormat, ...]]:
    """The statement as psycopg sends it to the server: each `%(name)s` (or `b`) as `$n`
    (one number per name, in order of first use), `%%` as `%`; and the names and the format
    each is sent in, in parameter order."""
    names: list[str] = []
    formats: list[PyFormat] = []

    def replace(match: re.Match[str]) -> str:
        name = match.group("name")
        if name is None:
            return "%"
        if name not in names:
            names.append(name)
            formats.append(PyFormat(match.group("format")))
        return f"${names.index(name) + 1}"

    return _PSYCOPG_TOKEN.sub(replace, text), tuple(names), tuple(formats)


def as_sent(text: str) -> str:
    """How the reference sends one of its own blocks: without its comment lines (the file
    keeps them for readers), and its values in binary (`binary_parameters`). psycopg converts
    a statement's placeholders once and reuses that only for a statement of at most 4,096
    characters: the claim, at 6,060 with its comments, was converted again on every call."""
    return binary_parameters(_strip_comments(text))


def binary_parameters(text: str) -> str:
    """`text` with every parameter sent in binary (`%(name)b`). Binary values are typed by
    the client (a str as text, where a text value is left for the server to type), which the
    reference's own tables and casts accept. A list sent in text is quoted element by
    element, which cost a result write a third of its client CPU (10 results: 412 against
    266 us a call, measured side by side)."""
    def replace(match: re.Match[str]) -> str:
        name = match.group("name")
        return match.group(0) if name is None else f"%({name})b"

    return _PSYCOPG_TOKEN.sub(replace, text)
