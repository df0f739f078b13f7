"""The live sampler asks the queue only for its live jobs, through the partial indexes: the
query's work follows the backlog, not the finished history."""

from __future__ import annotations

from pathlib import Path

import psycopg
import pytest
from psycopg import sql

from skiplock.queue_impl.pg import PgQueue
from skiplock.scenarios.bench.claim import plan_work
from skiplock.scenarios.run.progress import Sampler, live_counts_query

pytestmark = pytest.mark.integration


def test_live_counts_read_the_live_jobs_only(pg_dsn: str, fresh_schema: str,
                                             tmp_path: Path) -> None:
    queue = PgQueue(pg_dsn, schema=fresh_schema)
    queue.setup()
    queue.close()
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("SET search_path TO {}").format(sql.Identifier(fresh_schema)))
        conn.execute("INSERT INTO accounts (id) VALUES ('a')")
        conn.execute(
            """
            INSERT INTO jobs (id, account_id, target_url, payload, status, next_attempt_at,
                attempts, locked_until, lease_token)
            SELECT gen_random_uuid(), 'a', 'http://t/', '{}'::jsonb, s,
                CASE WHEN s = 'RETRYING' THEN now() END, 1,
                CASE WHEN s = 'PROCESSING' THEN now() END,
                CASE WHEN s = 'PROCESSING' THEN gen_random_uuid() END
            FROM unnest(ARRAY['COMPLETED', 'FAILED', 'PENDING', 'RETRYING', 'PROCESSING'],
                        ARRAY[60000, 5000, 7, 3, 2]) AS c (s, n),
                generate_series(1, c.n)
            """
        )
        conn.execute("VACUUM ANALYZE jobs")
        row = conn.execute(sql.SQL("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) ")
                           + live_counts_query(fresh_schema)).fetchone()
    assert row is not None
    _, buffers = plan_work(row[0][0]["Plan"])
    # A scan of 65k finished rows would touch over a thousand buffers.
    assert buffers < 50, f"the live counts touched {buffers} buffers"
    sampler = Sampler(tmp_path, pg_dsn, fresh_schema)
    try:
        assert sampler.status_counts() == {"PENDING": 7, "RETRYING": 3, "PROCESSING": 2}
        assert sampler.status_counts(exact=True) == {
            "COMPLETED": 60000, "FAILED": 5000, "PENDING": 7, "RETRYING": 3, "PROCESSING": 2}
    finally:
        sampler.close()
