"""Checks every backend runs on a batch before writing any of it.

A job's target URL becomes an HTTP request and its account id an HTTP header, so a bad value
must be refused at enqueue (one line naming the job and the fix), not discovered by a worker
later. The batch is checked whole first: enqueue stays all or nothing.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Sequence
from urllib.parse import urlsplit

from skiplock.queue_impl.interface import NewJob

ALLOWED_SCHEMES = frozenset({"http", "https"})


def _has_control(text: str) -> bool:
    return any(unicodedata.category(ch) == "Cc" for ch in text)


def job_problem(job: NewJob) -> str | None:
    """What is wrong with one job and how to fix it, or None if it can be enqueued."""
    url = job.target_url
    if not isinstance(url, str) or _has_control(url) or " " in url:
        return "target_url contains spaces or control characters; percent-encode them"
    try:
        parts = urlsplit(url)
        host = parts.hostname
    except ValueError:
        return f"target_url {url!r} is not a valid URL; use http(s)://HOST[:PORT]/PATH"
    if parts.scheme.lower() not in ALLOWED_SCHEMES:
        return f"target_url {url!r} is not http(s); use http(s)://HOST[:PORT]/PATH"
    if not host:
        return f"target_url {url!r} has no host; use http(s)://HOST[:PORT]/PATH"
    if not isinstance(job.account_id, str) or not job.account_id:
        return "account_id is empty; give every job an account id"
    if _has_control(job.account_id):
        return (
            f"account_id {job.account_id!r} contains control characters (it is sent as an "
            "HTTP header); remove them"
        )
    if isinstance(job.max_attempts, bool) or not isinstance(job.max_attempts, int):
        return f"max_attempts {job.max_attempts!r} is not an integer; use 1 or more"
    if job.max_attempts <= 0:
        return f"max_attempts is {job.max_attempts}; use 1 or more"
    if job.run_at is not None and job.run_at.tzinfo is None:
        return "run_at has no timezone; use a timezone-aware datetime (or None: due now)"
    return None


def check_jobs(jobs: Sequence[NewJob]) -> None:
    """Raise ValueError (one line) for the first bad job of the batch; write nothing."""
    for index, job in enumerate(jobs):
        problem = job_problem(job)
        if problem is not None:
            raise ValueError(f"job {job.id} (#{index} of the batch): {problem}")
