"""Cut-through of FETCH misses at the relay (issue 16, relay/fetch/inflight.py), over real QUIC on
127.0.0.1: the origin is a real pubsub session whose FETCHes the test answers by hand
(FETCH_OK, object headers, payload chunks, FIN or reset), so every ordering claim is proved by
holding bytes back at the origin, never by timing: a downstream FETCH gets FETCH_OK and the
first chunks of an object while the origin still holds the rest; several FETCHes of a range
share ONE upstream FETCH; a late joiner gets what arrived so far, then the rest live; an
upstream reset mid-object, the upstream cancelling the FETCH and the upstream session lost
mid-range reach the downstream FETCHes as stream resets with the draft's codes; after a cut-through the range is served from
the cache with no upstream request; a fill fetch stream is cut through the same way. Also: a
subscription's objects are forwarded chunk by chunk (no store-and-forward of an object). ``within`` only turns a hang into a failure;
``until`` polls relay state with a bound that fails loudly.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator

import pytest

from bridge_support import until
from kvsp_moq.moqt.data import FetchStreamEncoder
from kvsp_moq.moqt.errors import PublishDoneCode, StreamResetCode
from kvsp_moq.moqt.messages import Fetch, Message, MessageParameters, StandaloneFetch
from kvsp_moq.moqt.session import Role, SessionConfig
from kvsp_moq.pubsub import Catalog, MoqtError, MoqtSession, connect
from kvsp_moq.transport import TransportConfig, parse_moqt_url
from kvsp_moq.transport import connect as transport_connect
from kvsp_moq.transport.tls import make_self_signed
from relay import Relay, RelayConfig
from relay.fetch.digests import FIRST_LAYER, LAYER_COUNT, LAYER_DIGESTS

GUARD = 30.0
NS = ("cut", "through")
NSB = tuple(f.encode() for f in NS)
TRACK = (NSB, b"t")
DGRAM = 8192
CHUNK = 64 << 10
_CERT = make_self_signed()


async def within(aw, timeout: float = GUARD):
    return await asyncio.wait_for(aw, timeout)


def client_config() -> TransportConfig:
    return TransportConfig(insecure=True, max_datagram_size=DGRAM)


def payload(obj: int, size: int) -> bytes:
    return bytes((obj * 7 + i) % 251 for i in range(251)) * (size // 251) + bytes(size % 251)


class Origin(MoqtSession):
    """A real publisher session whose FETCHes the test answers by hand (its SUBSCRIBEs are
    served from its catalog as usual)."""

    def __init__(self, role: Role, **kw) -> None:
        super().__init__(role, **kw)
        self.fetches: asyncio.Queue[tuple[int, Message]] = asyncio.Queue()

    def _on_request(self, rid: int, msg: Message) -> None:
        if isinstance(msg, (Fetch, StandaloneFetch)):
            self.fetches.put_nowait((rid, msg))
            return
        super()._on_request(rid, msg)


class Answer:
    """One FETCH being answered by the :class:`Origin`: FETCH_OK, then bytes as the test says."""

    def __init__(self, origin: Origin, rid: int, end: tuple[int, int],
                 track_properties: tuple[tuple[int, int | bytes], ...] = ()) -> None:
        moqt = origin.moqt
        assert moqt is not None
        self.origin, self.rid = origin, rid
        moqt.accept_fetch(rid, end, end_of_track=False, track_properties=track_properties)
        self.sid = moqt.open_fetch_stream(rid)
        origin.pump()
        self.enc = FetchStreamEncoder(rid, origin.version)

    def header(self, group: int, obj: int, length: int) -> None:
        self.origin.connection.send(self.sid, self.enc.object_header(
            group, obj, length, subgroup_id=0, publisher_priority=128))

    def send(self, data: bytes, fin: bool = False) -> None:
        self.origin.connection.send(self.sid, data, end_stream=fin)

    def obj(self, group: int, obj: int, data: bytes) -> None:
        self.header(group, obj, len(data))
        for i in range(0, len(data), CHUNK):
            self.send(data[i:i + CHUNK])

    def reset(self, code: int) -> None:
        self.origin.connection.reset_stream(self.sid, code)


class Net:
    def __init__(self) -> None:
        self.relay: Relay | None = None
        self.origin: Origin | None = None
        self.catalog = Catalog()
        self.sessions: list[MoqtSession] = []

    async def start(self) -> None:
        server = TransportConfig(certificate_pem=_CERT.cert_pem, private_key_pem=_CERT.key_pem,
                                 max_datagram_size=DGRAM)
        self.relay = await Relay(RelayConfig(server_transport=server,
                                             upstream_transport=client_config())).start()
        made: list[Origin] = []

        def factory() -> Origin:
            s = Origin(Role.CLIENT, catalog=self.catalog,
                       session_config=SessionConfig(path="/moq", authority="127.0.0.1"))
            made.append(s)
            return s

        await within(transport_connect(parse_moqt_url(self.relay.url), factory, client_config()))
        self.origin = made[0]
        self.sessions.append(self.origin)
        await within(self.origin.ready)
        await within(self.origin.publish_namespace(NS))

    async def client(self, catalog: Catalog | None = None) -> MoqtSession:
        assert self.relay is not None
        s = await within(connect(self.relay.url, client_config(), catalog=catalog))
        self.sessions.append(s)
        return s

    async def answer(self, end: tuple[int, int],
                     track_properties: tuple[tuple[int, int | bytes], ...] = ()) -> Answer:
        """The next FETCH the origin got, answered FETCH_OK (End Location ``end``)."""
        assert self.origin is not None
        rid, _msg = await within(self.origin.fetches.get())
        return Answer(self.origin, rid, end, track_properties)


@pytest.fixture
async def net() -> AsyncIterator[Net]:
    n = Net()
    await n.start()
    try:
        yield n
    finally:
        for s in n.sessions:
            if not s.closed.done():
                await within(s.close())
        if n.relay is not None:
            await n.relay.close()


class Progress:
    """Payload bytes received per object on one downstream request; resolves waits."""

    def __init__(self) -> None:
        self.got: dict[tuple[int, int], int] = {}
        self._waits: list[tuple[tuple[int, int], int, asyncio.Future[None]]] = []

    def __call__(self, begin, n: int) -> None:
        loc = (begin.group_id, begin.object_id)
        self.got[loc] = self.got.get(loc, 0) + n
        for w in list(self._waits):
            if self.got.get(w[0], 0) >= w[1] and not w[2].done():
                w[2].set_result(None)

    async def reached(self, loc: tuple[int, int], n: int) -> None:
        fut = asyncio.get_running_loop().create_future()
        self._waits.append((loc, n, fut))
        self(type("B", (), {"group_id": loc[0], "object_id": loc[1]}), 0)
        await within(fut)


def stats(net: Net) -> tuple[int, int, int]:
    assert net.relay is not None
    s = net.relay.stats
    return s.upstream_fetches, s.cache_misses, s.cache_hits


# ------------------------------------------------------------------------------------------
async def test_fetch_ok_and_first_chunks_go_down_while_the_origin_holds_the_rest(net: Net) -> None:
    """FETCH_OK reaches the downstream FETCH when the origin's does, and the first chunks of a
    1 MiB object while the origin has not sent its last chunk; then the rest, byte-exact;
    the range is cached: a second FETCH is a hit with no upstream request."""
    objs = [payload(0, 1 << 20), payload(1, 3000), payload(2, 200 << 10)]
    client = await net.client()
    progress = Progress()
    fetch = asyncio.ensure_future(client.fetch(NS, "t", start=(0, 0), end=(0, 2),
                                               on_object_progress=progress))
    ans = await net.answer((0, 2))
    ans.header(0, 0, len(objs[0]))
    held = len(objs[0]) - CHUNK
    for i in range(0, held, CHUNK):
        ans.send(objs[0][i:i + CHUNK])
    stream = await within(fetch)  # FETCH_OK came down before the origin sent the whole object
    assert stream.end_location == (0, 2)
    await progress.reached((0, 0), held)  # ... and every chunk it did send
    assert net.relay is not None and net.relay.fetches.inflight  # still in flight upstream
    ans.send(objs[0][held:])
    ans.obj(0, 1, objs[1])
    ans.obj(0, 2, objs[2])
    ans.send(b"", fin=True)
    got = await within(stream.collect())
    assert [(o.group_id, o.object_id) for o in got] == [(0, 0), (0, 1), (0, 2)]
    assert [bytes(o.payload) for o in got] == objs
    assert stats(net) == (1, 1, 0)
    cached = net.relay.cache.get(TRACK, 0, 0)
    assert cached is not None and len(cached.chunks) > 1  # kept as the received chunks
    # From the cache now: no upstream request, same bytes.
    again = await within(client.fetch(NS, "t", start=(0, 0), end=(0, 2)))
    assert [bytes(o.payload) for o in await within(again.collect())] == objs
    assert stats(net) == (1, 1, 1)
    assert net.origin is not None and net.origin.fetches.empty()
    assert net.relay.cache.reserved == 0 and not net.relay.fetches.inflight


async def test_fetches_of_one_range_share_one_upstream_fetch_and_a_late_joiner_catches_up(
        net: Net) -> None:
    """Two FETCHes of a range before the origin answers and a third that arrives after object
    0 and half of object 1 went through: ONE upstream FETCH; the late joiner gets object 0 and
    the half of object 1 while the origin holds the other half; all three get every byte."""
    objs = [payload(0, 300 << 10), payload(1, 512 << 10), payload(2, 10)]
    clients = [await net.client() for _ in range(3)]
    early = [asyncio.ensure_future(c.fetch(NS, "t", start=(0, 0), end=(0, 2))) for c in clients[:2]]
    ans = await net.answer((0, 2))
    await until(lambda: stats(net)[1] == 2, "both FETCHes waiting on the relay")
    ans.obj(0, 0, objs[0])
    half = len(objs[1]) // 2
    ans.header(0, 1, len(objs[1]))
    ans.send(objs[1][:half])
    streams = [await within(f) for f in early]
    late_progress = Progress()
    late = await within(clients[2].fetch(NS, "t", start=(0, 0), end=(0, 2),
                                         on_object_progress=late_progress))
    await late_progress.reached((0, 1), half)  # caught up with what has arrived
    assert late_progress.got[(0, 0)] == len(objs[0])
    assert stats(net) == (1, 3, 0)
    ans.send(objs[1][half:])
    ans.obj(0, 2, objs[2])
    ans.send(b"", fin=True)
    for s in (*streams, late):
        assert [bytes(o.payload) for o in await within(s.collect())] == objs
    assert stats(net)[0] == 1
    assert net.origin is not None and net.origin.fetches.empty()


@pytest.mark.parametrize("code, expect", [
    (StreamResetCode.UNKNOWN_OBJECT_STATUS, StreamResetCode.UNKNOWN_OBJECT_STATUS),
    (0x3F00, StreamResetCode.INTERNAL_ERROR),  # not a code of the draft
])
async def test_upstream_reset_mid_object_resets_the_downstream_fetches(
        net: Net, code: int, expect: int) -> None:
    """The origin resets its fetch stream in the middle of an object: every downstream FETCH
    of the range (one started, one joined late) is reset with the draft's code; nothing is
    cached or left reserved, and the next FETCH goes upstream again."""
    clients = [await net.client() for _ in range(2)]
    progress = Progress()
    first = asyncio.ensure_future(clients[0].fetch(NS, "t", start=(0, 0), end=(0, 1),
                                                   on_object_progress=progress))
    ans = await net.answer((0, 1))
    ans.obj(0, 0, payload(0, 100))
    ans.header(0, 1, 200 << 10)
    ans.send(payload(1, CHUNK))
    stream = await within(first)
    await progress.reached((0, 1), CHUNK)
    joined = await within(clients[1].fetch(NS, "t", start=(0, 0), end=(0, 1)))
    ans.reset(code)
    for s in (stream, joined):
        with pytest.raises(MoqtError) as exc:
            await within(s.collect())
        assert exc.value.code == expect
    relay = net.relay
    assert relay is not None
    await until(lambda: not relay.fetches.inflight, "the upstream FETCH forgotten")
    assert relay.cache.reserved == 0 and relay.cache.lookup_range(TRACK, (0, 0), (0, 1)) is None
    retry = asyncio.ensure_future(clients[0].fetch(NS, "t", start=(0, 0), end=(0, 1)))
    ans = await net.answer((0, 1))
    ans.obj(0, 0, b"a")
    ans.obj(0, 1, b"b")
    ans.send(b"", fin=True)
    assert [bytes(o.payload) for o in await within((await within(retry)).collect())] == [b"a", b"b"]
    assert stats(net)[0] == 2


async def test_upstream_session_lost_mid_range_resets_with_internal_error(net: Net) -> None:
    """The origin's session ends after object 0 of two: the downstream FETCH, which already
    has FETCH_OK and object 0, sees its fetch stream reset INTERNAL_ERROR (0x0)."""
    client = await net.client()
    progress = Progress()
    fetch = asyncio.ensure_future(client.fetch(NS, "t", start=(0, 0), end=(0, 1),
                                               on_object_progress=progress))
    ans = await net.answer((0, 1))
    ans.obj(0, 0, payload(0, 5000))
    stream = await within(fetch)
    await progress.reached((0, 0), 5000)
    assert net.origin is not None
    await within(net.origin.close())
    with pytest.raises(MoqtError) as exc:
        await within(stream.collect())
    assert exc.value.code == StreamResetCode.INTERNAL_ERROR
    assert net.relay is not None and net.relay.cache.reserved == 0


async def test_upstream_cancels_the_fetch_mid_range(net: Net) -> None:
    """The origin cancels the FETCH (RESET_STREAM / STOP_SENDING CANCELLED on its request
    stream, §"Request Cancellation") after FETCH_OK and object 0: the downstream FETCH's fetch
    stream is reset CANCELLED (0x1, "The stream was cancelled by either endpoint")."""
    client = await net.client()
    progress = Progress()
    fetch = asyncio.ensure_future(client.fetch(NS, "t", start=(0, 0), end=(0, 1),
                                               on_object_progress=progress))
    ans = await net.answer((0, 1))
    ans.obj(0, 0, payload(0, 2000))
    stream = await within(fetch)
    await progress.reached((0, 0), 2000)
    assert net.origin is not None and net.origin.moqt is not None
    net.origin.moqt.cancel(ans.rid)
    net.origin.pump()
    with pytest.raises(MoqtError) as exc:
        await within(stream.collect())
    assert exc.value.code == StreamResetCode.CANCELLED
    relay = net.relay
    assert relay is not None
    await until(lambda: not relay.fetches.inflight, "the upstream FETCH forgotten")
    assert relay.cache.reserved == 0


async def test_subscription_objects_are_forwarded_chunk_by_chunk(net: Net) -> None:
    """A live object of 1 MiB written in 64 KiB chunks: the subscriber through the relay has
    all but the last chunk while the publisher has not written it (no store-and-forward)."""
    catalog = Catalog()
    pub = await net.client(catalog)
    pub_ns = ("cut", "live")
    track = catalog.create(pub_ns, "live")
    await within(pub.publish_namespace(pub_ns))
    progress = Progress()
    sub = await within((await net.client()).subscribe(pub_ns, "live",
                                                      on_object_progress=progress))
    await within(track.subscribed.wait())
    data = payload(3, 1 << 20)
    writer = await within(track.begin_object(0, 0, len(data)))
    for i in range(0, len(data) - CHUNK, CHUNK):
        await within(writer.write(data[i:i + CHUNK]))
    await progress.reached((0, 0), len(data) - CHUNK)
    await within(writer.write(data[-CHUNK:]))
    await within(writer.close())
    got = await within(sub.__anext__())
    assert bytes(got.payload) == data


async def test_fill_stream_is_cut_through_and_counted_in_publish_done(net: Net) -> None:
    """A SUBSCRIBE with FILL_PARAMETERS (the whole track so far): the relay's upstream FETCH
    of the fill range is cut through, so the subscriber has the first fill object and a chunk
    of the second while the origin holds the rest; the origin's PUBLISH_DONE arrives while
    the fill stream still waits for bytes, and the subscriber still gets the whole fill and a
    Stream Count that counts it."""
    track = net.catalog.create(NS, "t")
    objs = [payload(0, 96 << 10), payload(1, 300 << 10)]
    for o, data in enumerate(objs):
        await within(track.write_object(0, o, data))  # stored: the Largest Object is (0, 1)
    progress = Progress()
    client = await net.client()
    sub_task = asyncio.ensure_future(client.subscribe(
        NS, "t", parameters=MessageParameters(fill_parameters=MessageParameters()),
        on_object_progress=progress))
    ans = await net.answer((0, 1))  # the fill range, FETCHed upstream after SUBSCRIBE_OK
    sub = await within(sub_task)
    ans.obj(0, 0, objs[0])
    ans.header(0, 1, len(objs[1]))
    ans.send(objs[1][:CHUNK])
    await progress.reached((0, 1), CHUNK)
    await within(track.finish())  # PUBLISH_DONE upstream while the fill is not done
    ans.send(objs[1][CHUNK:], fin=True)
    got = await within(sub.collect())
    assert [(o.group_id, o.object_id, bytes(o.payload)) for o in got] == \
        [(0, 0, objs[0]), (0, 1, objs[1])]
    done = sub.publish_done
    assert done is not None and done.status_code == PublishDoneCode.TRACK_ENDED
    assert done.stream_count == sub.stats.data_streams == 1  # the fill fetch stream
    assert stats(net)[0] == 1


def digest_properties(objs: list[bytes]) -> tuple[tuple[int, int | bytes], ...]:
    """Track Properties declaring the layer digests of Objects 0.. of group 0 (binding §3.2)."""
    return ((LAYER_DIGESTS, b"".join(hashlib.sha256(o).digest() for o in objs)),
            (FIRST_LAYER, 0), (LAYER_COUNT, len(objs)))


def flipped(data: bytes) -> bytes:
    bad = bytearray(data)
    bad[len(bad) // 2] ^= 0x01
    return bytes(bad)


async def test_a_subscription_object_not_matching_its_layer_digest_is_forwarded_not_cached(
        net: Net) -> None:
    """A track whose SUBSCRIBE_OK declares LAYER_DIGESTS: the object whose bytes do not match
    reaches the subscriber (who verifies, binding §4) but not the relay's cache; the others do."""
    objs = [payload(o, 20 << 10) for o in range(3)]
    catalog = Catalog()
    pub = await net.client(catalog)
    pub_ns = ("cut", "digests")
    track = catalog.create(pub_ns, "raw")
    track.track_properties = digest_properties(objs)
    await within(pub.publish_namespace(pub_ns))
    sub = await within((await net.client()).subscribe(pub_ns, "raw"))
    await within(track.subscribed.wait())
    for o, data in enumerate(objs):
        await within(track.write_object(0, o, flipped(data) if o == 1 else data))
    got = [await within(sub.__anext__()) for _ in objs]
    assert [bytes(g.payload) for g in got] == [objs[0], flipped(objs[1]), objs[2]]
    relay = net.relay
    assert relay is not None
    await until(lambda: relay.stats.digest_checks == 3, "the three objects checked")
    assert relay.stats.digest_mismatches == 1
    name = (tuple(f.encode() for f in pub_ns), b"raw")
    assert [relay.cache.get(name, 0, o) is not None for o in range(3)] == [True, False, True]
    assert relay.cache.reserved == 0


async def test_a_verified_fetch_replaces_an_unverified_copy_cached_from_a_subscription(
        net: Net) -> None:
    """Prefill streaming (binding §6): the subscription declares no LAYER_DIGESTS yet, so its
    objects are cached unverified, one of them corrupted on the way. A FETCH of the range that
    went upstream before they came (nothing was held then) declares them: its verified copies
    replace the cached ones (first copy wins no more), and the range is then served warm with
    the right bytes."""
    objs = [payload(o, 30 << 10) for o in range(3)]
    track = net.catalog.create(NS, "t")
    client = await net.client()
    sub = await within(client.subscribe(NS, "t"))
    await within(track.subscribed.wait())
    fetch = asyncio.ensure_future(client.fetch(NS, "t", start=(0, 0), end=(0, 2)))
    rid, _msg = await within(net.origin.fetches.get())  # upstream, held by the origin
    for o, data in enumerate(objs):
        await within(track.write_object(0, o, flipped(data) if o == 1 else data))
    for _ in objs:
        await within(sub.__anext__())
    relay = net.relay
    assert relay is not None
    await until(lambda: relay.cache.get(TRACK, 0, 2) is not None, "the subscription's objects cached")
    poisoned = relay.cache.get(TRACK, 0, 1)
    assert poisoned is not None and poisoned.payload() == flipped(objs[1])
    assert relay.stats.digest_checks == 0  # nothing to verify against yet
    ans = Answer(net.origin, rid, (0, 2), digest_properties(objs))
    for o, data in enumerate(objs):
        ans.obj(0, o, data)
    ans.send(b"", fin=True)
    assert [bytes(o.payload) for o in await within((await within(fetch)).collect())] == objs
    await until(lambda: not relay.fetches.inflight, "the upstream FETCH over")
    assert (relay.stats.digest_checks, relay.stats.digest_mismatches) == (3, 0)
    fixed = relay.cache.get(TRACK, 0, 1)
    assert fixed is not None and fixed.payload() == objs[1]
    warm = await within(client.fetch(NS, "t", start=(0, 0), end=(0, 2)))
    assert [bytes(o.payload) for o in await within(warm.collect())] == objs
    assert stats(net) == (1, 1, 1)
    assert relay.cache.reserved == 0
