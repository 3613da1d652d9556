"""A FETCH answered from what the relay holds, only the gaps going upstream (issue 28,
relay/fetch/known.py, relay/fetch/held.py), over real QUIC on 127.0.0.1 with a real relay.

The origin is a real pubsub publisher whose SUBSCRIBEs are served from its catalog as usual
and whose FETCHes are either refused (NOT_SUPPORTED: a publisher that does not implement
FETCH) or held for the test to answer by hand, so what goes upstream is counted at the origin
and every ordering claim is proved by bytes held back there, never by timing. ``within`` only
turns a hang into a failure.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from kvsp_moq.moqt.data import FetchStreamEncoder
from kvsp_moq.moqt.errors import RequestErrorCode, StreamResetCode
from kvsp_moq.moqt.messages import (
    Fetch,
    LocationFilter,
    Message,
    MessageParameters,
    StandaloneFetch,
)
from kvsp_moq.moqt.objects import ObjectStatus
from kvsp_moq.moqt.session import Role, SessionConfig
from kvsp_moq.pubsub import Catalog, MoqtError, MoqtSession, connect
from kvsp_moq.transport import TransportConfig, parse_moqt_url
from kvsp_moq.transport import connect as transport_connect
from kvsp_moq.transport.tls import make_self_signed
from relay import Relay, RelayConfig
from relay.fetch.cache import OBJECT_OVERHEAD, TRACK_OVERHEAD, CachedObject, ObjectCache
from relay.fetch.service import MAX_GAPS, FetchService, fetch_range
from relay.fetch.inflight import WHOLE_GROUP, FetchRange
from relay.ops.stats import RelayStats
from relay.fetch.known import Gap, plan

GUARD = 30.0
NS = ("held", "ns")
DGRAM = 8192
_CERT = make_self_signed()


async def within(aw, timeout: float = GUARD):
    return await asyncio.wait_for(aw, timeout)


def client_config() -> TransportConfig:
    return TransportConfig(insecure=True, max_datagram_size=DGRAM)


def payload(obj: int, size: int) -> bytes:
    return bytes((obj * 13 + i) % 253 for i in range(size))


class Origin(MoqtSession):
    """A real publisher: SUBSCRIBE served from its catalog; FETCH refused NOT_SUPPORTED
    (``refuse``) or queued for the test to answer. Every FETCH it got is in ``seen``."""

    def __init__(self, role: Role, refuse: bool, **kw) -> None:
        super().__init__(role, **kw)
        self.refuse = refuse
        self.seen: list[Message] = []
        self.fetches: asyncio.Queue[tuple[int, Message]] = asyncio.Queue()

    def _on_request(self, rid: int, msg: Message) -> None:
        if isinstance(msg, (Fetch, StandaloneFetch)):
            self.seen.append(msg)
            if self.refuse:
                assert self.moqt is not None
                self.moqt.reject(rid, RequestErrorCode.NOT_SUPPORTED, "this publisher has no FETCH")
                self.pump()
            else:
                self.fetches.put_nowait((rid, msg))
            return
        super()._on_request(rid, msg)

    def answer(self, rid: int, end: tuple[int, int], objects: list[tuple[int, int, bytes]]) -> None:
        """FETCH_OK (End Location ``end``), the objects, FIN."""
        moqt = self.moqt
        assert moqt is not None
        moqt.accept_fetch(rid, end)
        sid = moqt.open_fetch_stream(rid)
        self.pump()
        enc = FetchStreamEncoder(rid, self.version)
        for g, o, data in objects:
            self.connection.send(sid, enc.object_header(g, o, len(data), subgroup_id=0,
                                                        publisher_priority=128) + data)
        self.connection.send(sid, b"", end_stream=True)


class Net:
    def __init__(self) -> None:
        self.relay: Relay | None = None
        self.catalog = Catalog()
        self.sessions: list[MoqtSession] = []

    async def start(self, refuse: bool) -> Origin:
        server = TransportConfig(certificate_pem=_CERT.cert_pem, private_key_pem=_CERT.key_pem,
                                 max_datagram_size=DGRAM)
        self.relay = await Relay(RelayConfig(server_transport=server,
                                             upstream_transport=client_config())).start()
        made: list[Origin] = []

        def factory() -> Origin:
            s = Origin(Role.CLIENT, refuse, catalog=self.catalog,
                       session_config=SessionConfig(path="/moq", authority="127.0.0.1"))
            made.append(s)
            return s

        await within(transport_connect(parse_moqt_url(self.relay.url), factory, client_config()))
        origin = made[0]
        self.sessions.append(origin)
        await within(origin.ready)
        await within(origin.publish_namespace(NS))
        return origin

    async def client(self) -> MoqtSession:
        assert self.relay is not None
        s = await within(connect(self.relay.url, client_config()))
        self.sessions.append(s)
        return s

    async def close(self) -> None:
        for s in self.sessions:
            if not s.closed.done():
                await within(s.close())
        if self.relay is not None:
            await self.relay.close()


@pytest.fixture
async def net() -> AsyncIterator[Net]:
    n = Net()
    try:
        yield n
    finally:
        await n.close()


def got(objs) -> list[tuple[int, int, bytes, list]]:
    return [(o.group_id, o.object_id, bytes(o.payload), [tuple(p) for p in o.properties])
            for o in objs]


# ------------------------------------------------------------------------------------------
async def test_a_late_fetch_of_objects_a_subscription_brought_is_answered_by_the_relay(
        net: Net) -> None:
    """The publisher does not implement FETCH. Objects 1..4 reach the relay through a first
    subscriber's SUBSCRIBE (object 0 was published before it). A late subscriber's FETCH of
    1..4 is answered from the relay, bit-exact with properties, and the publisher never sees
    a FETCH; ranges reaching past the Largest Object end there (FETCH_OK End Location); so is
    a late SUBSCRIBE's fill fetch stream (FILL_PARAMETERS, drafts 20+). A
    FETCH that needs object 0, which the relay never had, sends that gap (only) upstream:
    FETCH_OK went at once (the end is held), so the refusal resets the fetch stream
    UNKNOWN_OBJECT_STATUS."""
    origin = await net.start(refuse=True)
    track = net.catalog.create(NS, "t")
    objs = {o: payload(o, 5000 + 3001 * o) for o in range(5)}
    await within(track.write_object(0, 0, objs[0], properties=[(0x3804, 0)]))
    first = await within((await net.client()).subscribe(NS, "t"))
    await within(track.subscribed.wait())
    for o in range(1, 5):
        await within(track.write_object(0, o, objs[o], properties=[(0x3804, o)]))
    live = [await within(first.__anext__()) for _ in range(1, 5)]
    assert got(live) == [(0, o, objs[o], [(0x3804, o)]) for o in range(1, 5)]

    late = await net.client()
    sub = await within(late.subscribe(NS, "t"))  # SUBSCRIBE_OK: Largest Object (0, 4)
    want = [(0, o, objs[o], [(0x3804, o)]) for o in range(1, 5)]
    for end in ((0, 4), None, (0, 9), (3, 7)):
        stream = await within(late.fetch(NS, "t", start=(0, 1), end=end))
        assert got(await within(stream.collect())) == want
        assert stream.end_location == (0, 4)
    relay = net.relay
    assert relay is not None
    # Drafts 20+: a SUBSCRIBE with FILL_PARAMETERS, its fill fetch stream from the relay too.
    filled = await within(late.subscribe(NS, "t", parameters=MessageParameters(
        fill_parameters=MessageParameters(location_filter=LocationFilter.absolute((0, 1))))))
    assert got([await within(filled.__anext__()) for _ in range(4)]) == want
    assert origin.seen == [] and relay.stats.upstream_fetches == 0
    assert relay.stats.cache_hits == 5

    stream = await within(late.fetch(NS, "t", start=(0, 0), end=(0, 4)))
    with pytest.raises(MoqtError) as exc:
        await within(stream.collect())
    assert exc.value.code == StreamResetCode.UNKNOWN_OBJECT_STATUS
    assert len(origin.seen) == 1 and relay.stats.upstream_fetches == 1
    gap = fetch_range(origin.seen[0])
    assert gap is not None and (gap.start, gap.end) == ((0, 0), (0, 0))  # only the gap
    await within(sub.cancel())
    await within(filled.cancel())


async def test_a_partly_held_range_fetches_only_its_gap_once_for_every_fetch(net: Net) -> None:
    """Held: object 0 (an earlier FETCH) and 2..5 (a subscription); object 1 was published
    before the subscription and never reached the relay. Two FETCHes of 0..5 at once: ONE
    upstream FETCH, of object 1 only; each gets FETCH_OK and object 0 while the origin holds
    that answer, nothing after the gap until it comes, then all six objects in order,
    bit-exact. A third FETCH afterwards is answered from the relay alone."""
    origin = await net.start(refuse=False)
    track = net.catalog.create(NS, "p")
    objs = {o: payload(o, 9000 + 1000 * o) for o in range(6)}
    for o in (0, 1):
        await within(track.write_object(0, o, objs[o]))
    relay = net.relay
    assert relay is not None
    c0 = await net.client()
    early = asyncio.ensure_future(c0.fetch(NS, "p", start=(0, 0), end=(0, 0)))
    rid, msg = await within(origin.fetches.get())
    origin.answer(rid, (0, 0), [(0, 0, objs[0])])
    assert got(await within((await within(early)).collect())) == [(0, 0, objs[0], [])]
    sub = await within(c0.subscribe(NS, "p"))
    await within(track.subscribed.wait())
    for o in range(2, 6):
        await within(track.write_object(0, o, objs[o]))
    assert [o.object_id for o in [await within(sub.__anext__()) for _ in range(2, 6)]] == \
        [2, 3, 4, 5]
    assert relay.stats.upstream_fetches == 1

    arrived: list[dict[tuple[int, int], int]] = [{}, {}]
    first_done = [asyncio.get_running_loop().create_future() for _ in range(2)]

    def progress(i: int):
        def on(begin, n: int) -> None:
            loc = (begin.group_id, begin.object_id)
            arrived[i][loc] = arrived[i].get(loc, 0) + n
            if arrived[i].get((0, 0)) == len(objs[0]) and not first_done[i].done():
                first_done[i].set_result(None)
        return on

    clients = [await net.client() for _ in range(2)]
    streams = [await within(c.fetch(NS, "p", start=(0, 0), end=(0, 5),
                                    on_object_progress=progress(i)))
               for i, c in enumerate(clients)]
    assert [s.end_location for s in streams] == [(0, 5), (0, 5)]  # FETCH_OK before the gap
    rid, msg = await within(origin.fetches.get())
    gap = fetch_range(msg)
    assert gap is not None and (gap.start, gap.end) == ((0, 1), (0, 1))
    for i in range(2):
        await within(first_done[i])  # object 0 came from the relay ...
        assert set(arrived[i]) == {(0, 0)}  # ... and nothing past the gap, held upstream
    origin.answer(rid, (0, 1), [(0, 1, objs[1])])
    for s in streams:
        assert got(await within(s.collect())) == [(0, o, objs[o], []) for o in range(6)]
    assert origin.fetches.empty() and len(origin.seen) == 2
    assert relay.stats.upstream_fetches == 2

    again = await within(clients[0].fetch(NS, "p", start=(0, 0), end=(0, 5)))
    assert got(await within(again.collect())) == [(0, o, objs[o], []) for o in range(6)]
    assert len(origin.seen) == 2 and relay.stats.upstream_fetches == 2
    assert relay.cache.reserved == 0


# -- the plan (pure) -------------------------------------------------------------------------
def obj(g: int, o: int, status: ObjectStatus = ObjectStatus.NORMAL) -> CachedObject:
    return CachedObject(g, o, 0, 128, status, b"", (memoryview(b"x"),), 1)


def shape(segments) -> list:
    return [s.location if isinstance(s, CachedObject) else (s.start, s.end) for s in segments]


def test_the_plan_holds_what_is_known_and_fetches_only_the_unknown() -> None:
    held = [obj(0, 1), obj(0, 2), obj(0, 5), obj(2, 0)]
    p = plan((0, 0), (2, 1), held)
    assert shape(p.segments) == [((0, 0), (0, 0)), (0, 1), (0, 2), ((0, 3), (0, 4)), (0, 5),
                                 ((0, 6), (1, WHOLE_GROUP)), (2, 0), ((2, 1), (2, 1))]
    # A range an upstream FETCH returned whole: what it did not hold does not exist.
    p = plan((0, 0), (0, 5), held, [((0, 0), (0, 4), False)])
    assert shape(p.segments) == [(0, 1), (0, 2), (0, 5)] and not p.gaps
    # End of Group / End of Track status objects rule out what follows them.
    p = plan((0, 1), (2, 0), [obj(0, 1), obj(0, 2, ObjectStatus.END_OF_GROUP), obj(1, 0),
                              obj(1, 1, ObjectStatus.END_OF_GROUP), obj(2, 0)])
    assert shape(p.segments) == [(0, 1), (1, 0), (2, 0)] and not p.end_of_track
    p = plan((0, 1), None, [obj(0, 1), obj(0, 2, ObjectStatus.END_OF_TRACK)])
    assert shape(p.segments) == [(0, 1)] and p.end_of_track
    # To the Largest Object, unknown here: the tail is a gap up to wherever it is.
    p = plan((0, 1), None, [obj(0, 1)])
    assert p.gaps == [Gap((0, 2), None)]


def test_the_cache_keeps_each_track_s_locations_in_order() -> None:
    cache = ObjectCache(4 * (OBJECT_OVERHEAD + 1) + TRACK_OVERHEAD)
    track = ((b"a",), b"t")
    for loc in ((0, 5), (0, 1), (1, 0), (0, 3)):
        assert cache.put(track, obj(*loc))
    assert [o.location for o in cache.held(track, (0, 0), None)] == [(0, 1), (0, 3), (0, 5), (1, 0)]
    assert [o.location for o in cache.held(track, (0, 2), (0, 5))] == [(0, 3), (0, 5)]
    fresh = obj(0, 3)
    assert cache.put(track, fresh, replace=True)  # a verified copy replaces, once
    assert cache.held(track, (0, 3), (0, 3)) == [fresh]
    assert cache.put(track, obj(2, 0))  # over the budget: the least recently used goes
    assert [o.location for o in cache.held(track, (0, 0), None)] == [(0, 3), (0, 5), (1, 0), (2, 0)]


def test_a_scattered_range_goes_upstream_whole() -> None:
    cache = ObjectCache(1 << 20)
    track = ((b"a",), b"t")
    fetches = FetchService(cache, RelayStats(), lambda aw: None)
    for o in range(0, 2 * (MAX_GAPS + 1), 2):  # held: 0, 2, 4, ...: a gap after each
        cache.put(track, obj(0, o))
    last = 2 * MAX_GAPS
    held = fetches.held_plan(FetchRange(track, (0, 0), (0, last)))
    assert held is not None and len(held[0].gaps) == MAX_GAPS and held[1] == (0, last)
    assert fetches.held_plan(FetchRange(track, (0, 0), (0, last + 2))) is None
    # Capped at the live subscription's Largest Object: no gap past it.
    fetches.largest_of = lambda t: (0, 4)
    held = fetches.held_plan(FetchRange(track, (0, 4), None))
    assert held is not None and held[0].gaps == [] and held[1] == (0, 4)
