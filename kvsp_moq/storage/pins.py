"""Pins: who keeps a replica from being evicted, and until when (kvsp-draft §6.6).

The holder's lease manager pins every replica a lease covers, with the lease as owner and the
lease's remaining TTL; while any unexpired pin exists the store never evicts the replica
("While a lease is valid the holder MUST NOT evict the leased replicas", §6.6). A pin without
a TTL lasts until unpinned. Expired pins are dropped lazily when the set is consulted.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

__all__ = ["Clock", "PinSet"]

#: Seconds of a monotonic clock (``time.monotonic`` by default; tests inject their own).
Clock = Callable[[], float]


class PinSet:
    """Owner -> expiry (clock seconds, ``None`` for no expiry) of one replica's pins."""

    __slots__ = ("_pins",)

    def __init__(self) -> None:
        self._pins: dict[Hashable, float | None] = {}

    def add(self, owner: Hashable, expires: float | None) -> None:
        """Pin for ``owner`` until ``expires``; pinning again replaces the expiry (a renewal)."""
        self._pins[owner] = expires

    def remove(self, owner: Hashable) -> bool:
        """Drop ``owner``'s pin; whether it had one."""
        if owner not in self._pins:
            return False
        del self._pins[owner]
        return True

    def active(self, now: float) -> bool:
        """Whether any pin is unexpired at ``now`` (expired ones are dropped)."""
        return bool(self.owners(now))

    def owners(self, now: float) -> tuple[Hashable, ...]:
        expired = [o for o, t in self._pins.items() if t is not None and t <= now]
        for owner in expired:
            del self._pins[owner]
        return tuple(self._pins)

    def __bool__(self) -> bool:  # any pin, expired or not
        return bool(self._pins)
