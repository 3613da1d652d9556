"""The object cache (draft-20 §"Caching Relays"): objects by (full track name, group,
object), a byte budget with LRU eviction, MAX_CACHE_DURATION, and the object ranges known
to be complete (so a FETCH can be answered without asking upstream).

* Every field of an object is stored (§"Caching Relays": "A cache MUST store all fields of
  an Object"): subgroup ID, publisher priority, status, the Object Properties as their exact
  wire bytes (forwarded unchanged), and the payload.
* The payload is kept as the received chunks (read-only memoryviews of the bytes the QUIC
  layer handed up): no copy is made to cache an object.
* MAX_CACHE_DURATION (Track Property 0x04, §"MAX CACHE DURATION"): an object is not served
  from the cache once that many milliseconds passed since its beginning was received; it
  is then evicted, and any complete range that held it is forgotten.
* A FETCH is served from the cache only when its whole range lies inside a range an
  upstream FETCH returned completely (FETCH_OK then FIN) and every object of it is still
  cached. Objects received on subscriptions are cached too (they serve TRACK_STATUS and the
  objects of a later complete range), but a subscription alone never proves that a range is
  complete (an object that does not exist and one not yet received look the same).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvsp_moq.moqt.objects import ObjectStatus

__all__ = ["CachedObject", "CachedRange", "ObjectCache", "TrackName", "max_cache_duration_ms"]

TrackName = tuple[tuple[bytes, ...], bytes]
Loc = tuple[int, int]
#: Bookkeeping bytes charged per cached object on top of payload and properties.
OBJECT_OVERHEAD = 128
MAX_CACHE_DURATION = 0x04


def max_cache_duration_ms(track_properties: Sequence[tuple[int, int | bytes]]) -> int | None:
    """MAX_CACHE_DURATION from Track Properties (even type: an integer of milliseconds)."""
    for t, v in track_properties:
        if t == MAX_CACHE_DURATION and isinstance(v, int):
            return v
    return None


@dataclass(slots=True, eq=False)
class CachedObject:
    group_id: int
    object_id: int
    subgroup_id: int | None
    publisher_priority: int
    status: ObjectStatus
    raw_properties: bytes
    chunks: tuple[memoryview, ...]
    payload_length: int
    #: ``time.monotonic()`` deadline from MAX_CACHE_DURATION, or None.
    expires_at: float | None = None

    @property
    def location(self) -> Loc:
        return (self.group_id, self.object_id)

    @property
    def size(self) -> int:
        return self.payload_length + len(self.raw_properties) + OBJECT_OVERHEAD

    def payload(self) -> bytes:
        """The payload as one bytes object (copies; for tests and small objects)."""
        return b"".join(self.chunks)


@dataclass(slots=True, eq=False)
class CachedRange:
    """Objects ``start`` .. ``end`` (inclusive) of a track are all known: ``keys``."""

    start: Loc
    end: Loc
    keys: tuple[Loc, ...]
    end_of_track: bool


@dataclass(slots=True)
class RangeHit:
    objects: list[CachedObject]
    end_of_track: bool


class ObjectCache:
    def __init__(self, budget_bytes: int, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.budget = budget_bytes
        self.clock = clock
        self.bytes = 0
        self._objects: OrderedDict[tuple[TrackName, int, int], CachedObject] = OrderedDict()
        self._ranges: dict[TrackName, list[CachedRange]] = {}
        self._properties: dict[TrackName, tuple[tuple[int, int | bytes], ...]] = {}
        self._largest: dict[TrackName, Loc] = {}
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._objects)

    # -- tracks ------------------------------------------------------------------------------
    def set_track_properties(self, track: TrackName,
                             props: Sequence[tuple[int, int | bytes]]) -> None:
        self._properties[track] = tuple(props)

    def track_properties(self, track: TrackName) -> tuple[tuple[int, int | bytes], ...] | None:
        return self._properties.get(track)

    def largest(self, track: TrackName) -> Loc | None:
        return self._largest.get(track)

    def expiry_for(self, track: TrackName, began_at: float) -> float | None:
        ms = max_cache_duration_ms(self._properties.get(track, ()))
        return None if ms is None else began_at + ms / 1000.0

    # -- objects -----------------------------------------------------------------------------
    def put(self, track: TrackName, obj: CachedObject) -> bool:
        """Store ``obj`` (a duplicate replaces nothing: first copy wins). False if it does
        not fit the budget at all or already expired."""
        loc = obj.location
        if self._largest.get(track, (-1, -1)) < loc:
            self._largest[track] = loc
        key = (track, obj.group_id, obj.object_id)
        if key in self._objects:
            self._objects.move_to_end(key)
            return True
        if obj.size > self.budget:
            return False
        if obj.expires_at is not None and obj.expires_at <= self.clock():
            return False
        self._objects[key] = obj
        self.bytes += obj.size
        while self.bytes > self.budget:
            old_key, _ = next(iter(self._objects.items()))
            self._evict(old_key)
        return True

    def get(self, track: TrackName, group: int, obj: int) -> CachedObject | None:
        key = (track, group, obj)
        o = self._objects.get(key)
        if o is None:
            return None
        if o.expires_at is not None and o.expires_at <= self.clock():
            self._evict(key)
            return None
        self._objects.move_to_end(key)
        return o

    def _evict(self, key: tuple[TrackName, int, int]) -> None:
        o = self._objects.pop(key, None)
        if o is None:
            return
        self.bytes -= o.size
        self.evictions += 1
        track = key[0]
        ranges = self._ranges.get(track)
        if ranges:
            loc = (key[1], key[2])
            kept = [r for r in ranges if not (r.start <= loc <= r.end)]
            if kept:
                self._ranges[track] = kept
            else:
                del self._ranges[track]

    # -- complete ranges ---------------------------------------------------------------------
    def record_range(self, track: TrackName, start: Loc, end: Loc, keys: Sequence[Loc],
                     end_of_track: bool) -> None:
        """An upstream FETCH returned every object from ``start`` to ``end``: ``keys``."""
        if not keys or any((track, g, o) not in self._objects for g, o in keys):
            return  # something did not fit: the range cannot be served from here
        self._ranges.setdefault(track, []).append(
            CachedRange(tuple(start), tuple(end), tuple(keys), end_of_track))  # type: ignore[arg-type]

    def lookup_range(self, track: TrackName, start: Loc, end: Loc | None) -> RangeHit | None:
        """The cached objects of ``start`` .. ``end`` (inclusive; None: to the end of the
        track, only known when a range ended with End Of Track), or None on a miss."""
        for r in list(self._ranges.get(track, ())):
            if not r.start <= start:
                continue
            if end is None:
                if not r.end_of_track:
                    continue
            elif not end <= r.end:
                continue
            objs: list[CachedObject] = []
            for g, o in r.keys:
                if (g, o) < start or (end is not None and (g, o) > end):
                    continue
                c = self.get(track, g, o)
                if c is None:
                    return None  # expired or evicted meanwhile (the range is gone now)
                objs.append(c)
            if not objs:
                continue
            return RangeHit(objs, r.end_of_track and (end is None or end >= r.end))
        return None
