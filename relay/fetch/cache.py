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
* What the cache holds of a range (:meth:`ObjectCache.held`, :meth:`ObjectCache.complete_spans`)
  is what :mod:`relay.fetch.known` plans a FETCH from: objects received on subscriptions and on
  FETCHes alike are cached, each track's locations kept sorted, so a FETCH is answered from
  the objects held and only the unknown gaps go upstream (:mod:`relay.fetch.held`). A range an
  upstream FETCH returned completely (FETCH_OK then FIN) is recorded: inside it an object
  not held does not exist. A subscription alone never proves that (§"Objects": "A gap in
  the observed Object IDs does not by itself convey any information about the skipped
  Objects").
* One budget bounds everything (hostile peers, issue 18): each object is charged its
  payload, properties and :data:`OBJECT_OVERHEAD`; each track entry (Track Properties,
  Largest Object, complete ranges) :data:`TRACK_OVERHEAD` plus its properties, and it is
  dropped with the track's last cached object, so 100 000 distinct tracks through a small
  cache leave no more entries than the budget holds; the bytes of objects still arriving
  are reserved (:meth:`ObjectCache.reserve`) before they are buffered, so cached plus in
  flight never exceeds the budget.
"""

from __future__ import annotations

import time
from bisect import bisect_left, insort
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvsp_moq.moqt.objects import ObjectStatus

__all__ = ["CachedObject", "CachedRange", "MAX_RANGES", "OBJECT_OVERHEAD", "ObjectCache",
           "TRACK_OVERHEAD", "TrackName", "max_cache_duration_ms"]

TrackName = tuple[tuple[bytes, ...], bytes]
Loc = tuple[int, int]
#: Bookkeeping bytes charged per cached object on top of payload and properties.
OBJECT_OVERHEAD = 128
#: Bookkeeping bytes charged per track entry on top of its Track Properties.
TRACK_OVERHEAD = 256
MAX_CACHE_DURATION = 0x04
#: Complete ranges kept per track (an empty one holds no object that could evict it).
MAX_RANGES = 64


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


@dataclass(slots=True, eq=False)
class _Track:
    """What the cache keeps of one track besides its objects: its Track Properties, its
    Largest Object among the cached ones, its complete ranges and how many objects it has.
    Charged against the budget (:data:`TRACK_OVERHEAD` + the properties' bytes) and
    dropped with the track's last cached object, so a flood of distinct tracks cannot
    grow it past what the budget holds."""

    properties: tuple[tuple[int, int | bytes], ...]
    size: int
    largest: Loc | None = None
    objects: int = 0
    ranges: list[CachedRange] = field(default_factory=list)
    #: The locations of its cached objects, ascending (what :meth:`ObjectCache.held` reads).
    locs: list[Loc] = field(default_factory=list)

    def unindex(self, loc: Loc) -> None:
        i = bisect_left(self.locs, loc)
        if i < len(self.locs) and self.locs[i] == loc:
            del self.locs[i]


def _properties_size(props: Sequence[tuple[int, int | bytes]]) -> int:
    return sum(16 + (len(v) if isinstance(v, bytes) else 0) for _t, v in props)


class ObjectCache:
    """Objects and per-track metadata under one byte budget (see the module docstring).

    ``bytes`` counts what is held (objects, track entries); ``reserved`` what is in flight:
    bytes of objects still arriving, reserved (:meth:`reserve`) *before* they are buffered,
    so that cached + in flight never exceeds ``budget``."""

    def __init__(self, budget_bytes: int, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.budget = budget_bytes
        self.clock = clock
        self.bytes = 0
        self.reserved = 0
        self._objects: OrderedDict[tuple[TrackName, int, int], CachedObject] = OrderedDict()
        self._tracks: dict[TrackName, _Track] = {}
        #: Track entries holding no object (Track Properties only), oldest first: the first
        #: to go when room is needed.
        self._idle: OrderedDict[TrackName, None] = OrderedDict()
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._objects)

    @property
    def track_count(self) -> int:
        """Track entries held (each has an object, or is an idle entry under the budget)."""
        return len(self._tracks)

    # -- room ----------------------------------------------------------------------------------
    def _make_room(self, n: int) -> bool:
        """Evict (idle track entries first, then the least recently used objects) until
        ``n`` more bytes fit; False if they cannot fit at all."""
        if n + self.reserved > self.budget:
            return False
        while self.bytes + self.reserved + n > self.budget:
            if self._idle:
                self._drop_track(next(iter(self._idle)))
            elif self._objects:
                self._evict(next(iter(self._objects)))
            else:  # pragma: no cover - bytes are only ever held by the two above
                return False
        return True

    def reserve(self, n: int) -> bool:
        """Count ``n`` bytes about to be buffered (an object being received) against the
        budget, evicting to make room; False (nothing reserved) if they cannot fit."""
        if n < 0 or not self._make_room(n):
            return False
        self.reserved += n
        return True

    def release(self, n: int) -> None:
        """Give back a reservation (the object was stored, or abandoned)."""
        self.reserved = max(0, self.reserved - n)

    # -- tracks ------------------------------------------------------------------------------
    def _entry(self, track: TrackName,
               props: Sequence[tuple[int, int | bytes]] | None) -> _Track | None:
        t = self._tracks.get(track)
        if t is not None:
            if props is not None and tuple(props) != t.properties:
                self._set_properties(t, props)
            return t
        p = tuple(props) if props is not None else ()
        size = TRACK_OVERHEAD + _properties_size(p)
        if not self._make_room(size):
            return None
        t = self._tracks[track] = _Track(p, size)
        self.bytes += size
        self._idle[track] = None
        return t

    def _set_properties(self, t: _Track, props: Sequence[tuple[int, int | bytes]]) -> None:
        p = tuple(props)
        size = TRACK_OVERHEAD + _properties_size(p)
        self.bytes += size - t.size
        t.properties, t.size = p, size

    def _drop_track(self, track: TrackName) -> None:
        t = self._tracks.pop(track, None)
        self._idle.pop(track, None)
        if t is not None:
            self.bytes -= t.size

    def set_track_properties(self, track: TrackName,
                             props: Sequence[tuple[int, int | bytes]]) -> None:
        """Remember ``track``'s Track Properties (an entry charged against the budget; one
        holding no object is the first evicted)."""
        self._entry(track, props)

    def track_properties(self, track: TrackName) -> tuple[tuple[int, int | bytes], ...] | None:
        t = self._tracks.get(track)
        return t.properties if t is not None else None

    def largest(self, track: TrackName) -> Loc | None:
        """The Largest Object of ``track`` among its cached objects (None once none is)."""
        t = self._tracks.get(track)
        return t.largest if t is not None else None

    def expiry_for(self, track: TrackName, began_at: float,
                   properties: Sequence[tuple[int, int | bytes]] | None = None) -> float | None:
        """The MAX_CACHE_DURATION deadline of an object of ``track`` begun at ``began_at``
        (``properties``: the track's, when the caller holds them; else the cached ones)."""
        if properties is None:
            t = self._tracks.get(track)
            properties = t.properties if t is not None else ()
        ms = max_cache_duration_ms(properties)
        return None if ms is None else began_at + ms / 1000.0

    # -- objects -----------------------------------------------------------------------------
    def put(self, track: TrackName, obj: CachedObject,
            properties: Sequence[tuple[int, int | bytes]] | None = None, *,
            replace: bool = False) -> bool:
        """Store ``obj`` (a duplicate replaces nothing: first copy wins, unless ``replace``:
        a copy verified against its layer digest supersedes one cached unverified, e.g.
        from a subscription, relay/fetch/digests.py), with the track's ``properties`` when the
        caller has them. False if it does not fit the budget at all or already expired."""
        key = (track, obj.group_id, obj.object_id)
        old = self._objects.get(key)
        if old is not None:
            if not replace or old is obj:
                self._objects.move_to_end(key)
                return True
            self._unlink(key, old)  # the complete ranges holding it now hold ``obj``
        if obj.size + TRACK_OVERHEAD > self.budget:
            return False
        if obj.expires_at is not None and obj.expires_at <= self.clock():
            return False
        t = self._entry(track, properties)
        if t is None:
            return False
        # Held by this object from now on: never evicted to make its own room.
        self._idle.pop(track, None)
        t.objects += 1
        if not self._make_room(obj.size):
            t.objects -= 1
            if not t.objects:
                self._idle[track] = None
            return False
        self._objects[key] = obj
        self.bytes += obj.size
        loc = obj.location
        insort(t.locs, loc)
        if t.largest is None or t.largest < loc:
            t.largest = loc
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

    def _unlink(self, key: tuple[TrackName, int, int], old: CachedObject) -> None:
        """Take ``old`` out to put another copy in its place (its track entry stays)."""
        del self._objects[key]
        self.bytes -= old.size
        t = self._tracks[key[0]]
        t.objects -= 1
        t.unindex((key[1], key[2]))
        if not t.objects:
            self._idle[key[0]] = None

    def _evict(self, key: tuple[TrackName, int, int]) -> None:
        o = self._objects.pop(key, None)
        if o is None:
            return
        self.bytes -= o.size
        self.evictions += 1
        track = key[0]
        t = self._tracks.get(track)
        if t is None:  # pragma: no cover - every object has its track entry
            return
        t.objects -= 1
        if t.objects <= 0:
            self._drop_track(track)  # the track's last object: its metadata goes too
            return
        loc = (key[1], key[2])
        t.unindex(loc)
        if t.ranges:
            t.ranges = [r for r in t.ranges if not (r.start <= loc <= r.end)]

    # -- complete ranges ---------------------------------------------------------------------
    def record_range(self, track: TrackName, start: Loc, end: Loc, keys: Sequence[Loc],
                     end_of_track: bool) -> None:
        """An upstream FETCH returned every object from ``start`` to ``end``: ``keys`` (none:
        the range is known to hold no object, relay.fetch.known). A track keeps its
        :data:`MAX_RANGES` latest ranges."""
        t = self._tracks.get(track)
        if t is None or any((track, g, o) not in self._objects for g, o in keys):
            return  # something did not fit: the range cannot be served from here
        t.ranges.append(
            CachedRange(tuple(start), tuple(end), tuple(keys), end_of_track))  # type: ignore[arg-type]
        del t.ranges[:-MAX_RANGES]

    def lookup_range(self, track: TrackName, start: Loc, end: Loc | None) -> RangeHit | None:
        """The cached objects of ``start`` .. ``end`` (inclusive; None: to the end of the
        track, only known when a range ended with End Of Track), or None on a miss."""
        t = self._tracks.get(track)
        for r in list(t.ranges if t is not None else ()):
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

    # -- what is held of a range (relay.fetch.known, relay.fetch.held) --------------------------------------
    def held(self, track: TrackName, start: Loc, end: Loc | None) -> list[CachedObject]:
        """The objects of ``track`` cached from ``start`` to ``end`` (inclusive; None: to the
        last one), ascending, whatever brought them (a subscription, a FETCH); expired ones
        are evicted on the way."""
        t = self._tracks.get(track)
        if t is None:
            return []
        i = bisect_left(t.locs, start)
        locs = t.locs[i:] if end is None else t.locs[i:bisect_left(t.locs, end, lo=i) + 1]
        out: list[CachedObject] = []
        for g, o in locs:
            if end is not None and (g, o) > end:
                break
            c = self.get(track, g, o)
            if c is not None:
                out.append(c)
        return out

    def complete_spans(self, track: TrackName) -> list[tuple[Loc, Loc, bool]]:
        """The complete ranges of ``track`` (an upstream FETCH returned them, FIN included,
        and every object of them is still cached): ``(start, end, end_of_track)``."""
        t = self._tracks.get(track)
        return [(r.start, r.end, r.end_of_track) for r in t.ranges] if t is not None else []
