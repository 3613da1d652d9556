"""Relay parts without sockets: routing table, object cache (LRU budget,
MAX_CACHE_DURATION, complete ranges), FETCH range parsing, config and stats."""

from __future__ import annotations

import pytest

from kvsp_moq.moqt.messages import Fetch, LocationFilter, Location, MessageParameters, StandaloneFetch
from kvsp_moq.moqt.objects import ObjectStatus
from relay import CachedObject, ObjectCache, RelayConfig, RelayStats, RoutingTable
from relay.fetch.cache import OBJECT_OVERHEAD, TRACK_OVERHEAD, max_cache_duration_ms
from relay.fetch.service import WHOLE_GROUP, fetch_range
from relay.subscribe.routing import is_prefix

T = ((b"ns",), b"t")


class Watch:
    def __init__(self, prefix):
        self.prefix = prefix
        self.log = []

    def namespace_added(self, ns):
        self.log.append(("+", ns))

    def namespace_removed(self, ns):
        self.log.append(("-", ns))


def test_routing_longest_prefix_and_watchers() -> None:
    rt: RoutingTable[str] = RoutingTable()
    w = Watch((b"a",))
    assert rt.watch(w) == []
    rt.announce((b"a",), "p1", 1)
    rt.announce((b"a", b"b"), "p2", 1)
    rt.announce((b"c",), "p3", 1)
    assert rt.lookup((b"a", b"b", b"c")) == "p2"
    assert rt.lookup((b"a", b"x")) == "p1"
    assert rt.lookup((b"ab",)) is None
    assert rt.lookup((b"c",)) == "p3"
    rt.announce((b"a", b"b"), "p4", 3)  # a second publisher: most recent wins
    assert rt.lookup((b"a", b"b")) == "p4"
    rt.withdraw("p4")
    assert rt.lookup((b"a", b"b")) == "p2"
    assert w.log == [("+", (b"a",)), ("+", (b"a", b"b"))]
    rt.withdraw("p2", 1)
    assert w.log[-1] == ("-", (b"a", b"b"))
    assert rt.namespaces((b"a",)) == [(b"a",)]
    rt.unwatch(w)
    rt.withdraw("p1")
    assert len(w.log) == 3
    assert is_prefix((), (b"x",)) and not is_prefix((b"x", b"y"), (b"x",))


def obj(g: int, o: int, n: int = 100, expires=None) -> CachedObject:
    return CachedObject(g, o, 0, 128, ObjectStatus.NORMAL, b"\x01\x02",
                        (memoryview(bytes([o]) * n),), n, expires)


def test_cache_lru_budget() -> None:
    size = obj(0, 0).size
    assert size == 100 + 2 + OBJECT_OVERHEAD
    c = ObjectCache(3 * size + TRACK_OVERHEAD)  # three objects and their track's entry
    for o in range(3):
        assert c.put(T, obj(0, o))
    assert c.get(T, 0, 0) is not None  # touch 0: 1 is now least recently used
    c.put(T, obj(0, 3))
    assert c.get(T, 0, 1) is None and c.get(T, 0, 0) is not None
    assert c.bytes == 3 * size + TRACK_OVERHEAD and len(c) == 3 and c.evictions == 1
    assert not c.put(T, obj(0, 9, n=10_000))  # larger than the whole budget
    assert c.largest(T) == (0, 3)  # the Largest Object among the cached ones


def test_cache_track_entries_go_with_their_last_object() -> None:
    """Issue 18: 100 000 distinct tracks through a small cache leave no more track entries
    than the budget holds (each is charged, and dropped with its track's last object)."""
    c = ObjectCache(1 << 20)
    for i in range(100_000):
        track = ((b"flood", b"%d" % i), b"t")
        c.set_track_properties(track, [(0x04, 60_000), (0x3801, b"x" * 32)])
        assert c.put(track, obj(0, 0, n=1000), [(0x04, 60_000), (0x3801, b"x" * 32)])
        assert c.bytes + c.reserved <= c.budget
    per_track = obj(0, 0, n=1000).size + TRACK_OVERHEAD + 16 + 16 + 32
    assert len(c) == c.track_count <= (1 << 20) // per_track + 1
    assert c.track_count < 1000  # not 100 000
    last = ((b"flood", b"99999"), b"t")
    assert c.largest(last) == (0, 0) and c.track_properties(last) is not None
    assert c.largest(((b"flood", b"0"), b"t")) is None  # evicted with its object
    # Track Properties alone (no object yet) are charged too, and evicted first.
    c2 = ObjectCache(10 * TRACK_OVERHEAD)
    for i in range(1000):
        c2.set_track_properties(((b"p", b"%d" % i), b""), [])
    assert c2.track_count == 10 and c2.bytes <= c2.budget


def test_cache_reservations_count_before_buffering() -> None:
    c = ObjectCache(10_000)
    for o in range(5):
        assert c.put(T, obj(0, o, n=1000))
    assert c.reserve(6000)  # objects in flight: cached ones are evicted to make room
    assert c.bytes + c.reserved <= c.budget
    assert not c.reserve(5000)  # in flight beyond the budget: refused, nothing reserved
    assert c.reserved == 6000
    c.release(6000)
    assert c.reserved == 0 and c.reserve(10_000) and not c.reserve(1)


def test_cache_ranges_and_max_cache_duration() -> None:
    now = [100.0]
    c = ObjectCache(1 << 20, clock=lambda: now[0])
    c.set_track_properties(T, [(0x04, 500)])
    assert max_cache_duration_ms(c.track_properties(T)) == 500
    exp = c.expiry_for(T, now[0])
    assert exp == 100.5
    for o in range(4):
        c.put(T, obj(1, o, expires=exp + o * 0.1))
    c.record_range(T, (1, 0), (1, WHOLE_GROUP), [(1, o) for o in range(4)], False)
    hit = c.lookup_range(T, (1, 1), (1, 2))
    assert [x.object_id for x in hit.objects] == [1, 2]
    assert c.lookup_range(T, (0, 0), (1, 2)) is None  # starts before the known range
    assert c.lookup_range(T, (1, 0), None) is None  # open end: not known complete
    now[0] = 100.55  # object 0 expired (MAX_CACHE_DURATION), 1.. not yet
    assert c.get(T, 1, 0) is None
    assert c.lookup_range(T, (1, 1), (1, 3)) is None  # the range lost an object: forgotten
    assert c.get(T, 1, 1) is not None
    # a range is only recorded when every object of it is in the cache
    c.record_range(T, (1, 0), (1, 3), [(1, 0), (1, 1)], False)
    assert c.lookup_range(T, (1, 1), (1, 1)) is None


def test_fetch_range_forms() -> None:
    f18 = StandaloneFetch(0, (b"ns",), b"t", Location(1, 2), Location(3, 0))
    assert fetch_range(f18).start == (1, 2) and fetch_range(f18).end == (3, WHOLE_GROUP)
    f18b = StandaloneFetch(0, (b"ns",), b"t", Location(1, 2), Location(3, 5))
    assert fetch_range(f18b).end == (3, 4)
    f20 = Fetch(0, (b"ns",), b"t", MessageParameters(
        location_filter=LocationFilter.absolute((1, 0), 2, 7)))
    assert fetch_range(f20).end == (2, 7)
    f20b = Fetch(0, (b"ns",), b"t", MessageParameters(location_filter=LocationFilter.absolute((1, 0))))
    assert fetch_range(f20b).end is None
    assert fetch_range(Fetch(0, (b"ns",), b"t")).start == (0, 0)


def test_config_and_stats() -> None:
    with pytest.raises(ValueError):
        RelayConfig(subscriber_queue_bytes=0)
    s = RelayStats()
    s.cache_hits += 2
    s.gauges = lambda: {"subscribers": 3}
    snap = s.snapshot()
    assert snap["cache_hits"] == 2 and snap["subscribers"] == 3 and "gauges" not in snap
