"""`--backend bullmq`: BullMQ, the Redis queue, as a system under test, with its own Worker.

Producers enqueue through BullMQ's own Lua script (`addStandardJob`, the one `Queue.add`
runs), called from a synchronous Redis client: the producers are gevent greenlets, and
BullMQ's Python client is asyncio-only. The jobs of one `enqueue` go in one MULTI/EXEC, all
or nothing, as `Queue.addBulk` sends them. Workers run BullMQ's `Worker` loop
(`skiplock.queue_impl.bullmq_worker`). The final snapshot reads each job's hash and the set it
is in.

What BullMQ promises, declared in `GUARANTEES` and recorded in the run's spec.json:
- no per-account concurrency limits (they are BullMQ Pro's groups), so the checker does not
  judge them;
- fencing: a job's end is written only under its lock token (`moveToFinished` refuses with
  "Missing lock" or "Lock mismatch" otherwise);
- `attempts` counts finished attempts: a pick whose lock expired (a killed worker) is moved
  back to wait by the stalled-job check without counting, so a job may be delivered more
  times than `attempts`; after `maxStalledCount` (1) stalls it is failed without running;
- the retry wait is `base * 2^(attempts made - 1)`, uncapped and unjittered: at or above the
  reference's minimum wait, but it cannot honour a cap that binds;
- no claim transaction to stall (the pause_in_claim fault);
- its stalled-job check always runs (recovery cannot be switched off here).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from datetime import UTC, datetime
from types import SimpleNamespace
from typing import Any

from skiplock.queue_impl.bullmq_worker import job_fields, run_bullmq_worker
from skiplock.queue_impl.config import DispatcherConfig
from skiplock.queue_impl.events import EventSink
from skiplock.queue_impl.interface import (
    Account,
    Guarantees,
    JobState,
    JobStatus,
    NewJob,
)
from skiplock.queue_impl.native import DispatcherCallsRefused

GUARANTEES = Guarantees(account_limits=False, fencing=True, attempts_count="finished",
                        retry_cap=False, claim_transaction=False, recovery_switch=False)

# BullMQ's sets and lists of job ids, and the status each means here. A delayed job that has
# made an attempt waits for its retry; one that has not was added with a delay.
_LISTS = {"wait": JobStatus.PENDING, "paused": JobStatus.PENDING,
          "active": JobStatus.PROCESSING}
_SORTED_SETS = {"prioritized": JobStatus.PENDING, "delayed": JobStatus.PENDING,
                "completed": JobStatus.COMPLETED, "failed": JobStatus.FAILED,
                "waiting-children": JobStatus.PENDING}
_SNAPSHOT_BATCH = 1000


class BullmqQueue(DispatcherCallsRefused):
    """BullMQ queue `queue_name` (keys `<prefix>:<queue_name>:*`) at `url`."""

    name = "bullmq"
    guarantees = GUARANTEES

    def __init__(self, url: str, *, queue_name: str, retry_base_seconds: float = 0.2,
                 prefix: str = "bull") -> None:
        self.url = url
        self.queue_name = queue_name
        self.prefix = prefix
        self.retry_base_seconds = retry_base_seconds
        self._client: Any = None
        self._add_job: Any = None
        self._stand_in: Any = None

    # -- what the harness calls ---------------------------------------------------------

    def _redis(self) -> Any:
        if self._client is None:
            import redis
            from bullmq.queue_keys import QueueKeys
            from bullmq.redis_connection import loadScript

            self._client = redis.Redis.from_url(self.url)
            self._add_job = self._client.register_script(loadScript("addStandardJob-9.lua"))
            self._keys = QueueKeys(self.prefix).getKeys(self.queue_name)
        return self._client

    def _packer(self) -> Any:
        """What BullMQ's `Job` and `Scripts.addJobArgs` read of a queue: its keys and name.
        Their own code packs the script's arguments, so the layout cannot drift from the
        library's."""
        if self._stand_in is None:
            from bullmq.scripts import Scripts

            self._redis()
            packer = Scripts.__new__(Scripts)
            packer.keys = self._keys
            self._stand_in = SimpleNamespace(
                scripts=packer, qualifiedName=f"{self.prefix}:{self.queue_name}")
        return self._stand_in

    def setup(self) -> None:
        """Nothing to create (BullMQ makes its keys as it goes); the server must answer."""
        self._redis().ping()

    def upsert_accounts(self, accounts: Sequence[Account]) -> None:
        """Nothing: BullMQ has no per-account limits (declared, so never judged)."""

    def enqueue(self, jobs: Sequence[NewJob]) -> None:
        from bullmq.job import Job

        client = self._redis()
        queue = self._packer()
        keys = [self._keys[k] for k in ("wait", "paused", "meta", "id", "completed",
                                        "delayed", "active", "events", "marker")]
        with client.pipeline(transaction=True) as pipe:
            for new in jobs:
                if new.run_at is not None:
                    raise ValueError("bullmq: a job with run_at is not supported here")
                fields = job_fields(new.id, new.account_id, new.target_url, new.payload,
                                    new.max_attempts, self.retry_base_seconds)
                job = Job(queue, fields["name"], fields["data"], fields["opts"])
                args = queue.scripts.addJobArgs(job)
                self._add_job(keys=keys, args=[*args, job.timestamp], client=pipe)
            results = pipe.execute()
        refused = [r for r in results if isinstance(r, int) and r < 0]
        if refused:
            raise RuntimeError(f"bullmq refused {len(refused)} jobs (code {refused[0]})")

    def snapshot(self) -> list[JobState]:
        client = self._redis()
        # Every set read in one MULTI/EXEC: a job moving from one to another between two
        # reads would otherwise be missed, and a drain could end while it was live.
        with client.pipeline(transaction=True) as pipe:
            for name in _LISTS:
                pipe.lrange(self._keys[name], 0, -1)
            for name in _SORTED_SETS:
                pipe.zrange(self._keys[name], 0, -1)
            members = pipe.execute()
        where: dict[str, str] = {}
        for name, found in zip([*_LISTS, *_SORTED_SETS], members, strict=True):
            for raw in found:
                where[raw.decode()] = name
        states: list[JobState] = []
        ids = list(where)
        for i in range(0, len(ids), _SNAPSHOT_BATCH):
            chunk = ids[i:i + _SNAPSHOT_BATCH]
            with client.pipeline(transaction=False) as pipe:
                for job_id in chunk:
                    pipe.hmget(f"{self._keys['']}{job_id}", "data", "opts", "ats", "atm",
                               "failedReason", "stc", "finishedOn")
                rows = pipe.execute()
            states.extend(_state(job_id, where[job_id], row)
                          for job_id, row in zip(chunk, rows, strict=True))
        return states

    def teardown(self) -> None:
        """Delete every key of this queue (`<prefix>:<queue>:*`)."""
        client = self._redis()
        pattern = f"{self.prefix}:{self.queue_name}:*"
        batch: list[bytes] = []
        for key in client.scan_iter(match=pattern, count=1000):
            batch.append(key)
            if len(batch) >= 1000:
                client.unlink(*batch)
                batch.clear()
        if batch:
            client.unlink(*batch)

    def close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            client.close()

    async def run_worker(self, config: DispatcherConfig, worker_id: str, sink: EventSink,
                         stop: Any) -> None:
        await run_bullmq_worker(self.url, self.queue_name, config, worker_id, sink, stop,
                                prefix=self.prefix)


def _text(value: bytes | None) -> str | None:
    return value.decode() if value is not None else None


def _state(job_id: str, where: str, row: list[bytes | None]) -> JobState:
    data_raw, opts_raw, ats, atm, reason, stalls, finished_on = row
    data = json.loads(data_raw) if data_raw else {}
    opts = json.loads(opts_raw) if opts_raw else {}
    made = int(atm or 0)
    status = _LISTS.get(where) or _SORTED_SETS[where]
    if where == "delayed" and made:
        status = JobStatus.RETRYING
    return JobState(
        job_id=uuid.UUID(job_id),
        account_id=str(data.get("account_id", "")),
        status=status,
        # Every pick (the lease's attempt number); attempts made when none was recorded.
        attempts=int(ats or 0) or made,
        max_attempts=int(opts.get("attempts", 1)),
        last_error=_text(reason),
        extra={"bullmq_state": where, "attempts_made": made,
               "stalled": int(stalls or 0),
               **({"finished_at": datetime.fromtimestamp(int(finished_on) / 1000, UTC)
                   .isoformat()} if finished_on else {})},
    )
