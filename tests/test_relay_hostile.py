"""The relay under hostile peers (issue 18), over real QUIC on 127.0.0.1: request floods
(the per-session cap's EXCESSIVE_LOAD), 100 000 distinct tracks from one downstream process
(cache structures and RSS bounded), a stalled upstream (a SIGSTOPped publisher process:
REQUEST_ERROR TIMEOUT and state cleaned), the drain (GOAWAY carries the drain time,
GOAWAY_TIMEOUT closes a session that stays), reserved namespaces (never forwarded
upstream), paged SUBSCRIBE_NAMESPACE answers, in-flight bytes counted against the cache
budget, and peers that never answer our PUBLISH up the chain or our solicitation
(SUBSCRIBE_NAMESPACE). No sleeps: every wait is on an event, a future or a process; ``within`` only turns
a hang into a failure. Memory is RSS from /proc/self/status.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import textwrap
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from kvsp_moq.moqt.errors import (
    PublishDoneCode,
    RequestErrorCode,
    SessionErrorCode,
    StreamResetCode,
)
from kvsp_moq.moqt.messages import Publish, SubscribeNamespace
from kvsp_moq.moqt.session import Role, SessionConfig
from kvsp_moq.pubsub import Catalog, MoqtError, MoqtSession, connect
from kvsp_moq.transport import TransportConfig, parse_moqt_url
from kvsp_moq.transport import connect as transport_connect
from kvsp_moq.transport import serve as transport_serve
from kvsp_moq.transport.tls import make_self_signed
from relay import Relay, RelayConfig

GUARD = 60.0
ROOT = Path(__file__).resolve().parent.parent
NS = ("hostile", "ns")
NSB = tuple(f.encode() for f in NS)
DGRAM = 8192
_CERT = make_self_signed()


async def within(aw, timeout: float = GUARD):
    return await asyncio.wait_for(aw, timeout)


def client_config() -> TransportConfig:
    return TransportConfig(insecure=True, max_datagram_size=DGRAM)


def rss_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


class Net:
    def __init__(self) -> None:
        self.relays: list[Relay] = []
        self.sessions: list[MoqtSession] = []
        self.procs: list[asyncio.subprocess.Process] = []

    async def relay(self, **kw) -> Relay:
        server = TransportConfig(certificate_pem=_CERT.cert_pem, private_key_pem=_CERT.key_pem,
                                 max_datagram_size=DGRAM)
        r = await Relay(RelayConfig(server_transport=server, upstream_transport=client_config(),
                                    **kw)).start()
        self.relays.append(r)
        return r

    async def client(self, relay: Relay, catalog: Catalog | None = None) -> MoqtSession:
        s = await within(connect(relay.url, client_config(), catalog=catalog))
        self.sessions.append(s)
        return s

    async def child(self, code: str, *args: str) -> asyncio.subprocess.Process:
        p = await asyncio.create_subprocess_exec(
            sys.executable, "-c", textwrap.dedent(code), *args, cwd=str(ROOT),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        self.procs.append(p)
        return p

    async def close(self) -> None:
        for p in self.procs:
            if p.returncode is None:
                p.send_signal(signal.SIGCONT)
                p.kill()
                await p.wait()
        for s in self.sessions:
            if not s.closed.done():
                await within(s.close())
        for r in reversed(self.relays):
            await within(r.close())


@pytest.fixture
async def net() -> AsyncIterator[Net]:
    n = Net()
    try:
        yield n
    finally:
        await n.close()


# ------------------------------------------------------------------------------------------
async def test_request_flood_gets_excessive_load(net: Net) -> None:
    """Beyond max_requests_per_session open requests of one session, each request gets
    REQUEST_ERROR EXCESSIVE_LOAD (draft-22 §"Subscription Amplification"); a flood of
    2 000 more leaves the relay's memory and state flat. Other sessions are unaffected."""
    cap = 16
    relay = await net.relay(max_requests_per_session=cap)
    flooder = await net.client(relay)
    for i in range(cap):  # PUBLISH_NAMESPACE stays open: each holds one request
        await within(flooder.publish_namespace(("flood", str(i))))
    # A first flood of 500 warms up the allocators (the native backend's network threads
    # have malloc arenas of their own: their first pages count once, not per request).
    await within(asyncio.gather(*(flooder.publish_namespace(("flood", "warm", str(i)))
                                  for i in range(500)), return_exceptions=True))
    before = rss_kib()
    results = await within(asyncio.gather(
        *(flooder.publish_namespace(("flood", "x", str(i))) for i in range(2000)),
        return_exceptions=True))
    codes = {r.code if isinstance(r, MoqtError) else repr(r) for r in results}
    assert codes == {RequestErrorCode.EXCESSIVE_LOAD}
    assert relay.stats.requests == cap  # the refused ones never reached routing
    assert len(relay.routing.namespaces()) == cap
    growth = rss_kib() - before
    assert growth < 32 * 1024, f"RSS grew {growth} KiB for 2000 refused requests"
    # Another session still gets its requests served.
    other = await net.client(relay)
    await within(other.publish_namespace(("other",)))
    assert len(relay.routing.namespaces()) == cap + 1


# ------------------------------------------------------------------------------------------
FLOOD_CLIENT = """
import asyncio, sys
from kvsp_moq.pubsub import Catalog, connect
from kvsp_moq.transport import TransportConfig

async def main(url, n, batch):
    catalog = Catalog()
    s = await connect(url, TransportConfig(insecure=True, max_datagram_size=8192),
                      catalog=catalog)
    payload = bytes(1000)

    async def one(i):
        track = catalog.create(("flood", str(i)), "t")
        await s.publish(track)
        await track.write_object(0, 0, payload)
        await track.finish()
        catalog.remove(track.namespace, track.name)

    for start in range(0, n, batch):
        await asyncio.gather(*(one(i) for i in range(start, min(n, start + batch))))
    await s.drain()  # every byte handed to QUIC was acknowledged
    await s.close()
    print("done", flush=True)

asyncio.run(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3])))
"""

N_TRACKS = 100_000


async def test_100000_distinct_tracks_keep_relay_structures_bounded(net: Net) -> None:
    """A downstream process PUBLISHes 100 000 distinct tracks of one 1000-byte object each
    through a relay with a 1 MiB cache: every object arrives, but the cache keeps no more
    track entries than its budget holds (each charged, dropped with its last object), no
    per-track state outlives its PUBLISH, and the relay process's RSS grows by less than
    the documented bound (64 MiB; most of it the sans-IO session's per-request bookkeeping
    and allocator slack, not per-track relay state)."""
    relay = await net.relay(cache_bytes=1 << 20)
    before = rss_kib()
    proc = await net.child(FLOOD_CLIENT, relay.url, str(N_TRACKS), "100")
    out, err = await within(proc.communicate(), 900)
    assert proc.returncode == 0, err.decode()[-2000:]
    assert out.decode().strip() == "done"
    assert relay.stats.objects_in == N_TRACKS
    cache = relay.cache
    assert cache.bytes + cache.reserved <= cache.budget
    assert len(cache) < 1000 and cache.track_count <= len(cache) + 1
    assert cache.reserved == 0
    assert relay.upstreams.tracks == {} and relay.publishes.tracks == {}
    for peer in relay.sessions:
        assert len(peer.served) == 0 and len(peer.held_updates) == 0
    growth = rss_kib() - before
    print(f"relay RSS growth for {N_TRACKS} tracks: {growth} KiB; cache {len(cache)} "
          f"objects, {cache.track_count} track entries")
    assert growth < 64 * 1024, f"RSS grew {growth} KiB"


# ------------------------------------------------------------------------------------------
STALL_PUBLISHER = """
import asyncio, sys
from kvsp_moq.pubsub import Catalog, connect
from kvsp_moq.transport import TransportConfig

async def main(url):
    catalog = Catalog()
    s = await connect(url, TransportConfig(insecure=True, max_datagram_size=8192),
                      catalog=catalog)
    track = catalog.create(("hostile", "ns"), "t")
    await s.publish_namespace(("hostile", "ns"))
    await track.write_object(0, 0, b"x" * 100)
    print("ready", flush=True)
    await asyncio.Event().wait()

asyncio.run(main(sys.argv[1]))
"""


async def test_stalled_upstream_times_out_and_cleans_up(net: Net) -> None:
    """The publisher of a namespace stops answering (its process is SIGSTOPped): the
    relay's upstream SUBSCRIBE, FETCH and TRACK_STATUS each end after request_timeout with
    the downstream request answered REQUEST_ERROR TIMEOUT, and nothing of them is left."""
    relay = await net.relay(request_timeout=0.5)
    proc = await net.child(STALL_PUBLISHER, relay.url)
    assert proc.stdout is not None
    assert (await within(proc.stdout.readline())).strip() == b"ready"
    assert relay.routing.lookup(NSB) is not None
    os.kill(proc.pid, signal.SIGSTOP)
    sub = await net.client(relay)
    for ask in (lambda: sub.subscribe(NS, "t"),
                lambda: sub.fetch(NS, "t", start=(0, 0), end=(0, 0)),
                lambda: sub.track_status(NS, "t")):
        with pytest.raises(MoqtError) as exc:
            await within(ask(), 20)
        assert exc.value.code == RequestErrorCode.TIMEOUT
    assert relay.stats.upstream_timeouts == 3
    assert relay.upstreams.tracks == {} and relay.fetches.inflight == {}
    route = relay.routing.lookup(NSB)
    assert route is not None  # no handler of ours left upstream but our solicitation
    assert [h for h in route.local.values() if h is not route.solicitation] == []
    assert relay.cache.reserved == 0


# ------------------------------------------------------------------------------------------
async def test_goaway_carries_the_drain_time_and_goaway_timeout_closes(net: Net) -> None:
    """shutdown(): GOAWAY's Timeout is the drain time in ms (draft-22 §"GOAWAY"); a
    session that keeps an open subscription past it is closed with GOAWAY_TIMEOUT (0x10)."""
    relay = await net.relay()
    catalog = Catalog()
    pub = await net.client(relay, catalog)
    await within(pub.publish_namespace(NS))
    catalog.create(NS, "t")
    sub_s = await net.client(relay)
    await within(sub_s.subscribe(NS, "t"))
    drain = asyncio.ensure_future(relay.shutdown(timeout=0.75))
    await within(sub_s.goaway_received)
    assert sub_s.moqt is not None and sub_s.moqt.peer_goaway is not None
    assert sub_s.moqt.peer_goaway.timeout == 750
    code, _reason = await within(sub_s.closed)
    assert code == SessionErrorCode.GOAWAY_TIMEOUT
    assert await within(drain) is False


# ------------------------------------------------------------------------------------------
async def test_reserved_namespaces_are_never_forwarded_upstream(net: Net) -> None:
    """Requests for ``.session`` (and exactly ``.``) namespaces get DOES_NOT_EXIST at the
    relay that received them and never reach its upstream relay (draft-22 §"Session-Level
    Tracks and Namespaces": "Relays MUST NOT forward requests for session-level tracks and
    namespaces to other sessions"); an ordinary miss, and another reserved prefix (``.x``),
    do go upstream."""
    origin = await net.relay()
    edge = await net.relay(upstream=origin.url)
    c = await net.client(edge)
    session_ns = (".session", "probe")
    asks = [
        lambda ns: c.subscribe(ns, "t"),
        lambda ns: c.fetch(ns, "t", start=(0, 0), end=(0, 0)),
        lambda ns: c.track_status(ns, "t"),
        lambda ns: c.subscribe_namespace(ns),
    ]  # (PUBLISH_NAMESPACE of them our own session refuses to send)
    for ns in (session_ns, (".session",), (".", "x")):
        for ask in asks:
            with pytest.raises(MoqtError) as exc:
                await within(ask(ns))
            assert exc.value.code == RequestErrorCode.DOES_NOT_EXIST
        assert origin.stats.requests == 0 and origin.stats.sessions_opened == 0
    # The control: an ordinary miss is asked upstream (and refused there).
    with pytest.raises(MoqtError) as exc:
        await within(c.subscribe(("ordinary",), "t"))
    assert exc.value.code == RequestErrorCode.DOES_NOT_EXIST
    assert origin.stats.requests >= 1
    seen = origin.stats.requests
    with pytest.raises(MoqtError):
        await within(c.subscribe((".x",), "t"))  # reserved but not session-level: routed
    assert origin.stats.requests == seen + 1


# ------------------------------------------------------------------------------------------
async def test_subscribe_namespace_answer_is_paged(net: Net) -> None:
    """1 000 announced namespaces are listed to a SUBSCRIBE_NAMESPACE in pages of
    namespace_page_size, each written after QUIC sent the previous ones: every namespace
    exactly once, in order."""
    page = 64
    relay = await net.relay(namespace_page_size=page)
    pages: list[int] = []
    relay.observers.append(lambda kind, obj: pages.append(obj[1]) if kind == "namespace_page"
                           else None)
    # 100 per session: QUIC's initial bidi stream limit (128) bounds the open requests.
    pubs = [await net.client(relay) for _ in range(10)]
    names = [("paged", f"{i:04d}") for i in range(1000)]
    await within(asyncio.gather(*(pubs[i % 10].publish_namespace(ns)
                                  for i, ns in enumerate(names))))
    watcher = await net.client(relay)
    await within(watcher.subscribe_namespace(("paged",)))
    got = [await within(watcher.namespace_updates.get()) for _ in names]
    assert got == [("namespace", (ns[1].encode(),)) for ns in names]
    assert max(pages) <= page and sum(pages) == 1000 and len(pages) >= 1000 // page


# ------------------------------------------------------------------------------------------
async def test_in_flight_bytes_never_exceed_the_cache_budget(net: Net) -> None:
    """A FETCH whose objects do not fit the cache budget is reset EXCESSIVE_LOAD as soon
    as the next object would not fit (its bytes are reserved before they are buffered), and
    a live object larger than the budget is forwarded but not kept: cached plus in flight
    never exceeds the budget."""
    budget = 1 << 20
    relay = await net.relay(cache_bytes=budget)
    peaks: list[int] = []
    catalog = Catalog()
    pub = await net.client(relay, catalog)
    await within(pub.publish_namespace(NS))
    track = catalog.create(NS, "big")
    sub_s = await net.client(relay)
    sub = await within(sub_s.subscribe(NS, "big"))
    await within(track.subscribed.wait())
    chunk = 256 << 10
    for o in range(6):
        await within(track.write_object(0, o, bytes([o]) * chunk))
        peaks.append(relay.cache.bytes + relay.cache.reserved)
    await within(track.write_object(1, 0, b"h" * (3 << 19)))  # larger than the budget
    for o in range(6):
        got = await within(sub.__anext__())
        assert bytes(got.payload) == bytes([o]) * chunk
        peaks.append(relay.cache.bytes + relay.cache.reserved)
    big = await within(sub.__anext__())
    assert len(big.payload) == 3 << 19
    assert relay.cache.get((NSB, b"big"), 1, 0) is None
    # A FETCH of six such objects (1.5 MiB) the relay does not hold cannot be held: it is cut
    # through (FETCH_OK, the first objects) until the next object would not fit, then its
    # fetch stream is reset EXCESSIVE_LOAD; nothing left reserved.
    cold = catalog.create(NS, "cold")
    for o in range(6):
        await within(cold.write_object(0, o, bytes([o]) * chunk))  # kept at the publisher
    fetched = await within(sub_s.fetch(NS, "cold", start=(0, 0), end=(0, 5)))
    with pytest.raises(MoqtError) as exc:
        await within(fetched.collect())
    assert exc.value.code == StreamResetCode.EXCESSIVE_LOAD
    assert relay.cache.reserved == 0
    assert max(peaks) <= budget and relay.cache.bytes <= budget


# ------------------------------------------------------------------------------------------
class Mute(MoqtSession):
    """A real pubsub session that never answers the peer's requests of the ``mute`` types
    (it just records them); it sees their cancellation on ``cancelled``."""

    mute: tuple[type, ...] = ()

    def __init__(self, role: Role, **kw) -> None:
        super().__init__(role, **kw)
        loop = asyncio.get_running_loop()
        self.muted: asyncio.Future[int] = loop.create_future()
        self.cancelled: asyncio.Future[tuple[int, int]] = loop.create_future()

    def _on_request(self, rid: int, msg) -> None:
        if isinstance(msg, self.mute):
            if not self.muted.done():
                self.muted.set_result(rid)
            return  # no REQUEST_OK, no REQUEST_ERROR
        super()._on_request(rid, msg)

    def _on_cancelled(self, rid: int, code: int) -> None:
        super()._on_cancelled(rid, code)
        if not self.cancelled.done():
            self.cancelled.set_result((rid, code))


def observed(relay: Relay, kind: str) -> asyncio.Future:
    """Resolves with the first ``kind`` event the relay reports to its observers."""
    fut = asyncio.get_running_loop().create_future()
    relay.observers.append(lambda k, obj: k == kind and not fut.done() and fut.set_result(obj))
    return fut


async def test_upstream_publish_without_answer_times_out_and_stays_local(net: Net) -> None:
    """Chaining: the upstream relay (a real session that never answers PUBLISH) gets our
    PUBLISH of a downstream publisher's track; after request_timeout the relay cancels it
    (RESET_STREAM / STOP_SENDING CANCELLED) and treats it as refused: no state left for it
    on the upstream session, and the track's objects keep flowing to local subscribers."""
    made: list[Mute] = []
    # The upstream's session for the relay's connection: made when that connection's
    # handshake is processed on our side, which may come after the relay has answered.
    upstream_session: asyncio.Future[Mute] = asyncio.get_running_loop().create_future()

    def factory() -> Mute:
        s = Mute(Role.SERVER)
        s.mute = (Publish,)
        made.append(s)
        if not upstream_session.done():
            upstream_session.set_result(s)
        return s

    server = TransportConfig(certificate_pem=_CERT.cert_pem, private_key_pem=_CERT.key_pem,
                             max_datagram_size=DGRAM)
    upstream = await transport_serve("127.0.0.1", 0, factory, server)
    try:
        relay = await net.relay(upstream=f"moqt://127.0.0.1:{upstream.port}/moq",
                                request_timeout=0.5)
        timed_out = observed(relay, "publish_timeout")
        catalog = Catalog()
        pub = await net.client(relay, catalog)
        track = catalog.create(NS, "t")
        await within(pub.publish(track))
        sub = await within((await net.client(relay)).subscribe(NS, "t"))
        muted = await within(upstream_session)
        up_rid = await within(muted.muted)  # the PUBLISH reached the upstream
        pushed = await within(timed_out)
        assert pushed.request_id == up_rid
        rid, code = await within(muted.cancelled)
        assert (rid, code) == (up_rid, StreamResetCode.CANCELLED)
        assert relay.stats.upstream_publishes == 1 and relay.stats.upstream_timeouts == 1
        up = next(p for p in relay.sessions if p.upstream)
        assert up_rid not in up.local and pushed.ended  # (a PUBLISH_NAMESPACE may still wait)
        published = relay.upstreams.tracks[(NSB, b"t")]
        assert pushed not in published.fanout.subscribers
        for g in range(2):
            await within(track.write_object(g, 0, b"o%d" % g))
        await within(track.finish())
        objs = await within(sub.collect())
        assert [(o.group_id, bytes(o.payload)) for o in objs] == [(0, b"o0"), (1, b"o1")]
        assert sub.publish_done is not None
        assert sub.publish_done.status_code == PublishDoneCode.TRACK_ENDED
    finally:
        upstream.close()
        for s in made:
            if not s.closed.done():
                await within(s.close())


async def test_solicitation_without_answer_times_out_as_refused(net: Net) -> None:
    """A downstream session that never answers the relay's SUBSCRIBE_NAMESPACE (sent after
    SETUP, relay/subscribe/solicit.py): after request_timeout the relay cancels it and treats it as
    refused (no handler left, nothing routed); the session itself is served as usual."""
    relay = await net.relay(request_timeout=0.5)
    timed_out = observed(relay, "namespace_solicit_timeout")
    made: list[Mute] = []

    def factory() -> Mute:
        s = Mute(Role.CLIENT, session_config=SessionConfig(path="/moq",
                                                           authority="127.0.0.1"))
        s.mute = (SubscribeNamespace,)
        made.append(s)
        return s

    await within(transport_connect(parse_moqt_url(relay.url), factory, client_config()))
    client = made[0]
    net.sessions.append(client)
    await within(client.ready)
    solicit_rid = await within(client.muted)
    solicitation = await within(timed_out)
    assert solicitation.rid == solicit_rid and solicitation.ended
    rid, code = await within(client.cancelled)
    assert (rid, code) == (solicit_rid, StreamResetCode.CANCELLED)
    assert relay.stats.upstream_timeouts == 1
    peer = next(p for p in relay.sessions if p.solicitation is solicitation)
    assert peer.local == {}
    assert relay.routing.namespaces() == []
    # Treated as refused, not as a broken session: its own requests are served.
    await within(client.publish_namespace(NS))
    route = relay.routing.lookup(NSB)
    assert route is peer
