"""The named-SQL loader: the reference file parses, and every kind of bad team file is refused
with one line that names the file and the block."""

from __future__ import annotations

from pathlib import Path

import pytest

from skiplock.queue_impl.sqlfile import (
    BLOCK_NAMES,
    REFERENCE_PATH,
    REQUIRED_PLACEHOLDERS,
    SqlFileError,
    load_statements,
    placeholders,
    statements_with_overrides,
)


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "team.sql"
    path.write_text(text, encoding="utf-8")
    return path


def test_reference_file_defines_every_block_with_its_placeholders() -> None:
    statements = load_statements(REFERENCE_PATH)
    assert set(statements) == BLOCK_NAMES
    for name, text in statements.items():
        assert REQUIRED_PLACEHOLDERS[name] <= placeholders(text), name
        assert "-- name:" not in text


def test_every_claim_cte_has_a_why_comment() -> None:
    claim = load_statements(REFERENCE_PATH)["claim"]
    lines = claim.splitlines()
    ctes = [i for i, line in enumerate(lines) if line.rstrip().endswith(" AS (")]
    assert len(ctes) >= 7
    for i in ctes:
        assert lines[i - 1].lstrip().startswith("--"), lines[i]


def test_override_replaces_by_name_and_falls_back(tmp_path: Path) -> None:
    path = write(tmp_path, "-- name: recover\n-- mine\nSELECT 0 WHERE %(limit)s > 0;\n")
    statements = statements_with_overrides(path)
    assert statements["recover"] == "-- mine\nSELECT 0 WHERE %(limit)s > 0;"
    assert statements["claim"] == load_statements(REFERENCE_PATH)["claim"]
    assert statements_with_overrides(None) == load_statements(REFERENCE_PATH)


def test_optional_placeholders_are_accepted(tmp_path: Path) -> None:
    text = (
        "-- name: release\n"
        "SELECT unnest(%(ords)s::int[]) AS ord, %(job_ids)s, %(lease_tokens)s, %(workers)s;\n"
    )
    assert "release" in load_statements(write(tmp_path, text))


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("-- name: claimx\nSELECT 1;\n", "unknown block name"),
        ("-- name: recover\nSELECT 1;\n", "missing placeholder(s) %(limit)s"),
        ("-- name: recover\nSELECT %(limit)s, %(oops)s;\n", "unknown placeholder(s) %(oops)s"),
        ("-- name: recover\nSELECT %(limit)s;\n-- name: recover\nSELECT %(limit)s;\n", "twice"),
        ("", "no '-- name: BLOCK' blocks"),
        ("-- only a comment\n", "no '-- name: BLOCK' blocks"),
        ("SELECT 1;\n-- name: recover\nSELECT %(limit)s;\n", "before the first"),
        ("-- name: recover\n-- nothing here\n", "has no SQL"),
        ("-- name: recover\nSELECT %(limit)s WHERE 'a' LIKE '5%';\n", "lone '%'"),
        ("-- name:\nSELECT 1;\n", "without a block name"),
    ],
)
def test_bad_files_are_refused_with_one_line(tmp_path: Path, text: str, expected: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(SqlFileError) as info:
        statements_with_overrides(path)
    message = str(info.value)
    assert expected in message
    assert str(path) in message
    assert "\n" not in message


def test_the_error_names_the_block(tmp_path: Path) -> None:
    with pytest.raises(SqlFileError, match=r"block 'finish': missing placeholder"):
        load_statements(write(tmp_path, "-- name: finish\nSELECT %(ords)s;\n"))


def test_escaped_percent_is_fine(tmp_path: Path) -> None:
    text = "-- name: recover\nSELECT %(limit)s WHERE 'a' LIKE '5%%';\n"
    assert load_statements(write(tmp_path, text))["recover"].endswith("'5%%';")


def test_unreadable_files_are_refused(tmp_path: Path) -> None:
    with pytest.raises(SqlFileError, match="cannot read"):
        load_statements(tmp_path / "missing.sql")
    with pytest.raises(SqlFileError, match="cannot read"):
        load_statements(tmp_path)
    bad = tmp_path / "latin1.sql"
    bad.write_bytes(b"-- name: recover\nSELECT '\xff';\n")
    with pytest.raises(SqlFileError, match="cannot read"):
        load_statements(bad)


@pytest.mark.parametrize(
    "text",
    [
        "SELECT id FROM accounts FOR NO KEY UPDATE SKIP LOCKED;",
        "SELECT id FROM accounts LIMIT %(batch)s FOR NO KEY UPDATE SKIP LOCKED;",
    ],
)
def test_account_lock_blocks_may_cap_at_the_batch_or_not(tmp_path: Path, text: str) -> None:
    """The reference caps claim step 1 at the batch; a team file written before the cap (no
    placeholder) stays valid, because the queue passes `batch` either way."""
    for block in ("claim_lock_accounts", "claim_lock_accounts_wait"):
        statements = load_statements(write(tmp_path, f"-- name: {block}\n{text}\n"))
        assert statements[block] == text


def test_only_the_reference_on_its_own_schema_sends_values_in_binary(tmp_path: Path) -> None:
    from psycopg.adapt import PyFormat

    from skiplock.queue_impl.pg import PgQueue
    from skiplock.queue_impl.sqlfile import positional

    def formats(queue: PgQueue, block: str) -> set[PyFormat]:
        return set(positional(queue._statements[block])[2])

    dsn = "postgresql://nobody@127.0.0.1:1/none"  # never connected to
    reference = PgQueue(dsn)
    assert formats(reference, "finish") == formats(reference, "claim") == {PyFormat.BINARY}
    # The same statement less its comment lines, only the placeholders' format changed: `%%`
    # stays one percent sign.
    query, names, _ = positional(reference._statements["finish"])
    as_written = load_statements(REFERENCE_PATH)["finish"]
    lean = "\n".join(line for line in as_written.splitlines()
                     if not line.lstrip().startswith("--"))
    assert (query, names) == positional(lean)[:2]
    assert len(query) < len(positional(as_written)[0])
    team_finish = write(tmp_path, "-- name: recover\nSELECT 0 WHERE %(limit)s > 0;\n")
    mixed = PgQueue(dsn, sql=team_finish)
    assert formats(mixed, "recover") == {PyFormat.AUTO}
    assert formats(mixed, "finish") == {PyFormat.BINARY}
    (tmp_path / "schema.sql").write_text(
        "-- name: schema\nCREATE TABLE IF NOT EXISTS jobs (id uuid);\n", encoding="utf-8")
    theirs = PgQueue(dsn, sql=tmp_path / "schema.sql")
    assert all(formats(theirs, block) <= {PyFormat.AUTO} for block in BLOCK_NAMES), (
        "a reference block run on a team's schema is sent as written")


def test_the_reference_sends_statements_short_enough_for_psycopg_to_reuse() -> None:
    """psycopg reuses the conversion of a statement's placeholders only up to a length: over
    it, the statement is parsed again on every call (the claim with its comments was)."""
    from skiplock.queue_impl.pg import PgQueue

    try:  # psycopg's own limit where it still keeps it there (private; 4,096 in 3.1-3.3)
        from psycopg._queries import MAX_CACHED_STATEMENT_LENGTH
    except ImportError:
        MAX_CACHED_STATEMENT_LENGTH = 4096

    reference = PgQueue("postgresql://nobody@127.0.0.1:1/none")  # never connected to
    sent = {block: text for block, text in reference._statements.items() if block != "schema"}
    assert sent and all(len(text) <= MAX_CACHED_STATEMENT_LENGTH for text in sent.values())
    assert not any(line.lstrip().startswith("--")
                   for text in sent.values() for line in text.splitlines())
