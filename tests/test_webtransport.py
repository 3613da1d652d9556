"""MOQT over WebTransport (``https://``) end to end on 127.0.0.1: our client and server over
real QUIC + HTTP/3 (aioquic and qh3 backends), raw QUIC and WebTransport on one port, the close
code and reason crossing CLOSE_WEBTRANSPORT_SESSION, and the relay between a raw-QUIC
publisher and a WebTransport subscriber (and back). No mocks, no sleeps: every wait is on a
future the protocol completes; ``within`` only turns a hang into a failure.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import re
import signal
import sys
from collections.abc import AsyncIterator

import pytest

from kvsp_moq.moqt.errors import PublishDoneCode, SessionErrorCode
from kvsp_moq.pubsub import Catalog, MoqtSession, connect, serve
from kvsp_moq.pubsub.endpoints import MoqtServer
from kvsp_moq import transport
from kvsp_moq.transport import (
    BaseConnectionHandler,
    Connection,
    TransportConfig,
    available_backends,
    parse_moqt_url,
)
from kvsp_moq.transport.tls import make_self_signed
from kvsp_moq.transport.webtransport import WebTransportSession
from relay import Relay, RelayConfig

GUARD = 30.0
NS = ("wt-test", "ns")
_CERT = make_self_signed()
DGRAM = 1452
BACKENDS = [b for b in ("aioquic", "qh3", "aiopquic", "native") if b in available_backends()]


async def within(aw, timeout: float = GUARD):
    return await asyncio.wait_for(aw, timeout)


def server_config(**kw) -> TransportConfig:
    kw.setdefault("webtransport", True)
    return TransportConfig(certificate_pem=_CERT.cert_pem, private_key_pem=_CERT.key_pem,
                           max_datagram_size=DGRAM, **kw)


def client_config(**kw) -> TransportConfig:
    return TransportConfig(insecure=True, max_datagram_size=DGRAM, **kw)


def payload(g: int, o: int, n: int) -> bytes:
    return bytes((g * 31 + o * 7 + i) & 0xFF for i in range(256)) * (n // 256) + b"x" * (n % 256)


class Server:
    def __init__(self, backend: str) -> None:
        self.backend = backend
        self.catalog = Catalog()
        self.sessions: asyncio.Queue[MoqtSession] = asyncio.Queue()

    async def start(self) -> Server:
        self.server: MoqtServer = await serve(
            "127.0.0.1", 0, server_config(backend=self.backend), catalog=self.catalog,
            on_session=self.sessions.put_nowait)
        return self

    def url(self, scheme: str = "https") -> str:
        return f"{scheme}://127.0.0.1:{self.server.port}/moq"

    async def client(self, scheme: str = "https", **kw) -> tuple[MoqtSession, MoqtSession]:
        c = await within(connect(self.url(scheme), client_config(backend=self.backend, **kw)))
        return c, await within(self.sessions.get())


@pytest.fixture(params=BACKENDS)
async def srv(request) -> AsyncIterator[Server]:
    s = await Server(request.param).start()
    try:
        yield s
    finally:
        s.server.close()
        await within(s.server.wait_closed())


def test_https_urls_parse() -> None:
    u = parse_moqt_url("https://relay.example:4443/moq?x=1")
    assert u.is_webtransport and (u.host, u.port, u.path_and_query) == ("relay.example", 4443,
                                                                         "/moq?x=1")
    assert str(u) == "https://relay.example:4443/moq?x=1"
    assert parse_moqt_url("HTTPS://h").port == 443
    assert not parse_moqt_url("moqt://h/").is_webtransport
    assert str(u.with_scheme("moqt")) == "moqt://relay.example:4443/moq?x=1"


async def test_subscribe_fetch_datagram_exact_bytes(srv: Server) -> None:
    client, server_side = await srv.client()
    conn = client.connection
    assert isinstance(conn, WebTransportSession) and isinstance(server_side.connection,
                                                                WebTransportSession)
    assert conn.alpn == "moqt-22" and client.version == server_side.version
    assert conn.quic.alpn == "h3" and server_side.connection.path == "/moq"
    # the URL travelled in the CONNECT, not in SETUP (MOQT §"PATH", §"AUTHORITY")
    assert server_side.moqt is not None and server_side.moqt.peer_setup is not None
    assert (server_side.moqt.peer_setup.path, server_side.moqt.peer_setup.authority) == (None,
                                                                                         None)
    # Subscribe: three groups of growing objects, exact bytes and properties.
    track = srv.catalog.create(NS, "layers")
    sub = await within(client.subscribe(NS, "layers"))
    await within(track.subscribed.wait())
    sent = {}
    for g in range(3):
        for o in range(3):
            sent[(g, o)] = payload(g, o, 20000 * (o + 1) + g)
            await within(track.write_object(g, o, sent[(g, o)], properties=[(0x3800, g + o)]))
    await within(track.finish())
    got = await within(sub.collect())
    assert {(x.group_id, x.object_id): bytes(x.payload) for x in got} == sent
    assert all(x.properties == ((0x3800, x.group_id + x.object_id),) for x in got)
    assert sub.publish_done is not None and sub.publish_done.stream_count == 3
    # FETCH (a bidirectional request stream and a fetch data stream).
    f = await within(client.fetch(NS, "layers", start=(1, 1), end=(2, 0)))
    assert [(x.group_id, x.object_id, bytes(x.payload)) for x in await within(f.collect())] \
        == [(1, 1, sent[(1, 1)]), (1, 2, sent[(1, 2)]), (2, 0, sent[(2, 0)])]
    # Datagrams carry the Quarter Stream ID: the room left is 1 byte less than the QUIC one.
    assert conn.max_datagram_payload == conn.quic.max_datagram_payload - 1
    dtrack = srv.catalog.create(NS, "dgrams")
    dsub = await within(client.subscribe(NS, "dgrams"))
    await within(dtrack.subscribed.wait())
    await within(dtrack.write_datagram(0, 0, b"d" * 500))
    obj = await within(dsub.__anext__())
    assert (obj.group_id, obj.object_id, bytes(obj.payload)) == (0, 0, b"d" * 500)
    await within(client.close())
    assert await within(server_side.wait_closed()) == (0, "")


async def test_raw_quic_and_webtransport_on_one_port(srv: Server) -> None:
    raw, raw_server = await srv.client("moqt")
    wt, wt_server = await srv.client("https")
    assert not isinstance(raw.connection, WebTransportSession)
    assert raw.connection.alpn == "moqt-22" and isinstance(wt_server.connection,
                                                           WebTransportSession)
    track = srv.catalog.create(NS, "both")
    subs = [await within(s.subscribe(NS, "both")) for s in (raw, wt)]
    await within(track.subscribed.wait())
    await within(track.write_object(0, 0, b"one object"))
    await within(track.finish())
    for sub in subs:
        assert [bytes(x.payload) for x in await within(sub.collect())] == [b"one object"]
    for s in (raw, wt):
        await within(s.close())
    await within(asyncio.gather(raw_server.wait_closed(), wt_server.wait_closed()))


async def test_close_code_and_reason_cross_the_session(srv: Server) -> None:
    client, server_side = await srv.client()
    await within(client.close(SessionErrorCode.PROTOCOL_VIOLATION, "bye from the client"))
    assert await within(server_side.wait_closed()) == (SessionErrorCode.PROTOCOL_VIOLATION,
                                                       "bye from the client")
    info = await within(client.connection.wait_closed())  # the QUIC connection under it too
    assert info.error_code == SessionErrorCode.PROTOCOL_VIOLATION and info.local
    client, server_side = await srv.client()
    await within(server_side.close(SessionErrorCode.GOAWAY_TIMEOUT, "server says so"))
    assert await within(client.wait_closed()) == (SessionErrorCode.GOAWAY_TIMEOUT,
                                                  "server says so")


async def test_connect_to_a_server_without_webtransport_fails_cleanly() -> None:
    plain = await serve("127.0.0.1", 0, server_config(webtransport=False))
    try:
        with pytest.raises(Exception, match="ALPN"):
            await within(connect(f"https://127.0.0.1:{plain.port}/moq", client_config()))
    finally:
        plain.close()
        await within(plain.wait_closed())


# ------------------------------------------------------------------------------------------
# the relay between raw QUIC and WebTransport


@pytest.fixture
async def relay() -> AsyncIterator[Relay]:
    r = await Relay(RelayConfig(server_transport=server_config(),
                                upstream_transport=client_config())).start()
    try:
        yield r
    finally:
        await within(r.close())


@pytest.mark.parametrize("pub_scheme, sub_scheme", [("moqt", "https"), ("https", "moqt")])
async def test_relay_between_raw_quic_and_webtransport(relay: Relay, pub_scheme: str,
                                                       sub_scheme: str) -> None:
    url = f"://127.0.0.1:{relay.port}/moq"
    catalog = Catalog()
    pub = await within(connect(pub_scheme + url, client_config(), catalog=catalog))
    subs = [await within(connect(sub_scheme + url, client_config())) for _ in range(2)]
    try:
        await within(pub.publish_namespace(NS))
        track = catalog.create(NS, "relayed")
        subscriptions = [await within(s.subscribe(NS, "relayed")) for s in subs]
        await within(track.subscribed.wait())
        assert track.subscriber_count == 1  # one upstream subscription for both
        sent = {(g, o): payload(g, o, 30000 + 1000 * o) for g in range(2) for o in range(3)}
        for (g, o), data in sent.items():
            await within(track.write_object(g, o, data))
        await within(track.finish())
        for sub in subscriptions:
            got = await within(sub.collect())
            assert {(x.group_id, x.object_id): bytes(x.payload) for x in got} == sent
            assert sub.publish_done is not None
            assert sub.publish_done.status_code == PublishDoneCode.TRACK_ENDED
        # a FETCH from the cache, over the subscriber's transport
        f = await within(subs[0].fetch(NS, "relayed", start=(1, 0), end=(1, 2)))
        assert [bytes(x.payload) for x in await within(f.collect())] == [
            sent[(1, o)] for o in range(3)]
    finally:
        for s in (*subs, pub):
            await within(s.close())


async def test_relay_upstream_over_webtransport(relay: Relay) -> None:
    """A second relay whose upstream is the first one's https:// URL."""
    second = await Relay(RelayConfig(server_transport=server_config(),
                                     upstream_transport=client_config(),
                                     upstream=f"https://127.0.0.1:{relay.port}/moq")).start()
    catalog = Catalog()
    pub = await within(connect(relay.url, client_config(), catalog=catalog))
    sub = await within(connect(second.url, client_config()))
    try:
        await within(pub.publish_namespace(NS))
        track = catalog.create(NS, "chained")
        subscription = await within(sub.subscribe(NS, "chained"))
        await within(track.subscribed.wait())
        await within(track.write_object(0, 0, b"through two relays"))
        await within(track.finish())
        assert [bytes(x.payload) for x in await within(subscription.collect())] == [
            b"through two relays"]
        assert second.stats.upstream_subscribes == 1
    finally:
        for s in (sub, pub):
            await within(s.close())
        await within(second.close())


# ------------------------------------------------------------------------------------------
# kvsp moq with https:// URLs (real processes)


async def test_kvsp_moq_fetch_and_subscribe_over_https(tmp_path) -> None:
    cmd = [sys.executable, "-m", "kvsp_moq", "moq"]
    data = os.urandom(3 * 50_000 + 77)
    path = tmp_path / "block.bin"
    path.write_bytes(data)
    server = await asyncio.create_subprocess_exec(
        *cmd, "publish", "kvsp-1/wt", "raw", "--file", str(path), "--object-size", "50000",
        "--serve", "127.0.0.1:0", "--subscribers", "1", stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE, start_new_session=True)
    assert server.stderr is not None
    try:
        while True:  # the server says where it listens
            line = (await within(server.stderr.readline())).decode()
            assert line, "publisher exited before serving"
            if m := re.search(r"serving moqt://(\S+)", line):
                url = "https://" + m.group(1)
                break
        chunks = [data[i:i + 50_000] for i in range(0, len(data), 50_000)]
        want = [f"0 {i} {len(c)} {hashlib.sha256(c).hexdigest()}" for i, c in enumerate(chunks)]
        for verb, extra in (("subscribe", ["--count", "4"]), ("fetch", ["--start", "0:1"])):
            proc = await asyncio.create_subprocess_exec(
                *cmd, verb, url, "kvsp-1/wt", "raw", "--insecure", *extra,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
            out, err = await within(proc.communicate())
            assert proc.returncode == 0, err.decode()
            assert out.decode().splitlines() == (want if verb == "subscribe" else want[1:])
    finally:
        if server.returncode is None:
            os.killpg(server.pid, signal.SIGTERM)
            assert await within(server.wait()) == 0


async def test_a_session_closed_as_it_is_accepted() -> None:
    """The server closes the session in connection_made: the CLOSE capsule may come in the
    same packet as the 200 and is held until the client's session exists, whose handler then
    learns the code and reason (no hang, no lost close)."""
    class Refuser(BaseConnectionHandler):
        def connection_made(self, conn: Connection, alpn: str) -> None:
            conn.close(7, "not today")

    class Client(BaseConnectionHandler):
        def __init__(self) -> None:
            loop = asyncio.get_running_loop()
            self.lost: asyncio.Future[tuple[int, str]] = loop.create_future()

        def connection_lost(self, error_code: int, reason: str) -> None:
            self.lost.set_result((error_code, reason))

    server = await transport.serve("127.0.0.1", 0, Refuser, server_config())
    client = Client()
    try:
        conn = await within(transport.connect(f"https://127.0.0.1:{server.port}/moq",
                                              lambda: client, client_config()))
        assert await within(client.lost) == (7, "not today")
        assert (await within(conn.wait_closed())).error_code == 7
    finally:
        server.close()
        await within(server.wait_closed())
