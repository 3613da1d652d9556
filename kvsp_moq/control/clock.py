"""Clocks for TTLs (kvsp-draft §6.1 replica ttl_ms, §6.3 status ttl_ms).

Services read time only through a :class:`Clock`, so tests drive expiry with a
:class:`ManualClock` instead of sleeping. Times are integer milliseconds on a monotonic scale
whose origin is arbitrary: only differences mean anything.
"""

from __future__ import annotations

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


class ManualClock:
    """A clock that moves only when told to (tests)."""

    def __init__(self, start_ms: int = 0) -> None:
        self._now = start_ms

    def now_ms(self) -> int:
        return self._now

    def advance(self, ms: int) -> None:
        """Move the clock forward by ``ms`` milliseconds (``ms`` >= 0)."""
        if ms < 0:
            raise ValueError("a monotonic clock cannot move backward")
        self._now += ms
