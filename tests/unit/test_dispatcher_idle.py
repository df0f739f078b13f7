"""The idle worker's waits (pure logic, on the in-memory queue): a backend that skips the
NOTIFY of enqueues closer together than its `notify_interval` gets one more claim that long
after each wake-up, and only one; a backend without one waits the whole poll."""

from __future__ import annotations

import asyncio

from skiplock.queue_impl.config import DispatcherConfig
from skiplock.queue_impl.dispatcher import Dispatcher
from skiplock.queue_impl.memory import InMemoryQueue

POLL = 5.0


class Throttled(InMemoryQueue):
    """Records each wait's timeout; answers "notified" to the first wait only."""

    notify_interval = 0.02

    def __init__(self) -> None:
        super().__init__()
        self.waits: list[float] = []

    def wait_for_work(self, timeout: float) -> bool:
        self.waits.append(timeout)
        return len(self.waits) == 1


def idle_waits(backend: Throttled, times: int) -> list[float]:
    dispatcher = Dispatcher(backend, DispatcherConfig(poll_seconds=POLL), "w", lambda k, f: None)

    async def go() -> None:
        for _ in range(times):
            await dispatcher._idle()

    asyncio.run(go())
    return backend.waits


def test_a_wake_up_is_followed_by_one_short_wait_then_the_poll() -> None:
    first, second, third = idle_waits(Throttled(), 3)
    assert first == POLL
    # Woken: the next wait ends at the interval (+ a little slack), so the next claim comes
    # then rather than after the poll; after that, the poll again.
    assert 0 < second <= Throttled.notify_interval + 0.011
    assert third == POLL


def test_a_backend_without_a_notify_interval_always_waits_the_poll() -> None:
    class Plain(Throttled):
        notify_interval = 0.0

    assert idle_waits(Plain(), 3) == [POLL, POLL, POLL]
