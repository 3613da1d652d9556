"""Clocks for TTLs (kvsp-draft §6.1 replica ttl_ms, §6.3 status ttl_ms).

Services read time only through a :class:`Clock`, so tests drive expiry with a
:class:`ManualClock` instead of sleeping. Times are integer milliseconds on a monotonic scale
whose origin is arbitrary: only differences mean anything.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from typing import Protocol


class Clock(Protocol):
    """A monotonic millisecond clock."""

    def now_ms(self) -> int:
        """The current time in milliseconds; never decreases."""
        ...


class MonotonicClock:
    """The process's monotonic clock (``time.monotonic_ns``), in milliseconds."""

    def now_ms(self) -> int:
        return time.monotonic_ns() // 1_000_000

    async def sleep_ms(self, ms: float) -> None:
        await asyncio.sleep(max(0.0, ms) / 1000)


class ManualClock:
    """A clock that moves only when told to (tests)."""

    def __init__(self, start_ms: int = 0) -> None:
        self._now = start_ms
        self._sleepers: list[tuple[float, int, asyncio.Future[None]]] = []
        self._seq = itertools.count()

    def now_ms(self) -> int:
        return self._now

    def advance(self, ms: int) -> None:
        """Move the clock forward by ``ms`` milliseconds (``ms`` >= 0)."""
        if ms < 0:
            raise ValueError("a monotonic clock cannot move backward")
        self._now += ms
        while self._sleepers and self._sleepers[0][0] <= self._now:
            _, _, waiter = heapq.heappop(self._sleepers)
            if not waiter.done():
                waiter.set_result(None)

    async def sleep_ms(self, ms: float) -> None:
        """Wait until :meth:`advance` has moved the clock ``ms`` past now (``ms`` <= 0: yield once)."""
        if ms <= 0:
            await asyncio.sleep(0)
            return
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._sleepers, (self._now + ms, next(self._seq), waiter))
        await waiter

    @property
    def sleepers(self) -> int:
        """How many :meth:`sleep_ms` calls are waiting (tests await a loop reaching its sleep)."""
        return sum(1 for _, _, w in self._sleepers if not w.done())


class Timer(Protocol):
    """Waits on a :class:`Clock` (background loops, deadlines): tests drive it with a
    :class:`ManualClock`, so nothing sleeps in real time."""

    def now_ms(self) -> int:
        ...

    async def sleep_ms(self, ms: float) -> None:
        """Return once ``ms`` milliseconds have passed on this clock."""
        ...
