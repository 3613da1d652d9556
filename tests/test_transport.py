"""kvsp_moq.transport on real QUIC (aioquic) over 127.0.0.1, port 0; no mocks.

Nothing sleeps to wait for a condition: every test awaits a future or queue that a handler
callback completes. The only timeouts are safety nets (``wait_for``) that turn a hang into a
failure, and the one test of the handshake timeout itself.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import socket
from collections.abc import AsyncIterator, Callable

import pytest

from kvsp_moq.transport import (
    DEFAULT_ALPNS,
    BaseConnectionHandler,
    ConnectError,
    Connection,
    ConnectionClosedError,
    Server,
    StreamClosedError,
    TransportConfig,
    connect,
    is_client_initiated,
    is_unidirectional,
    run,
    serve,
)
from kvsp_moq.transport.tls import SelfSignedCert, make_self_signed

from tests._transport_backends import client_backend, pairing, server_backend  # noqa: F401

MiB = 1 << 20
GUARD = 30.0  # seconds: a safety net against hangs, never a way to wait for something


async def within(aw, timeout: float = GUARD):
    return await asyncio.wait_for(aw, timeout)


async def shut(conn: Connection) -> None:
    """Close and wait for the closing period to end (a client's socket is released then)."""
    await within(conn.aclose())


class Recorder(BaseConnectionHandler):
    """Records every callback into futures and queues the test can await."""

    def __init__(self) -> None:
        loop = asyncio.get_running_loop()
        self.made: asyncio.Future[str] = loop.create_future()
        self.lost: asyncio.Future[tuple[int, str]] = loop.create_future()
        self.data: dict[int, bytearray] = {}
        self.ended: dict[int, asyncio.Future[bytes]] = {}
        self.new_streams: asyncio.Queue[int] = asyncio.Queue()
        self.resets: asyncio.Queue[tuple[int, int]] = asyncio.Queue()
        self.stops: asyncio.Queue[tuple[int, int]] = asyncio.Queue()
        self.datagrams: asyncio.Queue[bytes] = asyncio.Queue()

    def _end(self, stream_id: int) -> asyncio.Future[bytes]:
        if stream_id not in self.ended:
            self.ended[stream_id] = asyncio.get_running_loop().create_future()
        return self.ended[stream_id]

    async def stream_done(self, stream_id: int) -> bytes:
        return await within(self._end(stream_id))

    # callbacks
    def connection_made(self, conn: Connection, alpn: str) -> None:
        super().connection_made(conn, alpn)
        self.made.set_result(alpn)

    def stream_data(self, stream_id, data, end_stream) -> None:
        if stream_id not in self.data:
            self.data[stream_id] = bytearray()
            self.new_streams.put_nowait(stream_id)
        self.data[stream_id] += data
        if end_stream:
            self._end(stream_id).set_result(bytes(self.data[stream_id]))

    def stream_reset(self, stream_id, error_code) -> None:
        self.resets.put_nowait((stream_id, error_code))

    def stop_sending(self, stream_id, error_code) -> None:
        self.stops.put_nowait((stream_id, error_code))

    def datagram_received(self, data) -> None:
        self.datagrams.put_nowait(bytes(data))

    def connection_lost(self, error_code, reason) -> None:
        assert not self.lost.done(), "connection_lost called twice"
        self.lost.set_result((error_code, reason))


class Echo(Recorder):
    """Echoes stream bytes on the same bidi stream and datagrams as datagrams."""

    def stream_data(self, stream_id, data, end_stream) -> None:
        super().stream_data(stream_id, data, end_stream)
        if not is_unidirectional(stream_id):
            self.conn.send(stream_id, data, end_stream=end_stream)

    def datagram_received(self, data) -> None:
        super().datagram_received(data)
        self.conn.send_datagram(b"echo:" + bytes(data))


class Factory:
    """A handler factory that remembers the handlers it made."""

    def __init__(self, cls: type[Recorder] = Recorder) -> None:
        self.cls = cls
        self.made: list[Recorder] = []
        self.first: asyncio.Future[Recorder] | None = None

    def __call__(self) -> Recorder:
        handler = self.cls()
        if self.first is None:
            self.first = asyncio.get_running_loop().create_future()
        if not self.first.done():
            self.first.set_result(handler)
        self.made.append(handler)
        return handler

    async def next_handler(self) -> Recorder:
        if self.first is None:
            self.first = asyncio.get_running_loop().create_future()
        return await within(self.first)


@pytest.fixture(scope="module")
def cert() -> SelfSignedCert:
    return make_self_signed()


def server_config(cert: SelfSignedCert, **kw) -> TransportConfig:
    kw.setdefault("backend", server_backend())
    return TransportConfig(certificate_pem=cert.cert_pem, private_key_pem=cert.key_pem, **kw)


def client_config(cert: SelfSignedCert, **kw) -> TransportConfig:
    return TransportConfig(ca_data=cert.cert_pem, **kw)


async def start(cert: SelfSignedCert, factory: Callable[[], Recorder], **kw) -> Server:
    return await serve("127.0.0.1", 0, factory, server_config(cert, **kw))


@pytest.fixture
async def echo_server(cert) -> AsyncIterator[tuple[Server, Factory]]:
    factory = Factory(Echo)
    server = await start(cert, factory)
    yield server, factory
    server.close()
    await within(server.wait_closed())


async def dial(server: Server, cert: SelfSignedCert, handler: Recorder | None = None,
               host: str = "127.0.0.1", **kw) -> tuple[Connection, Recorder]:
    handler = handler or Recorder()
    conn = await within(connect(f"moqt://{host}:{server.port}/moq", lambda: handler,
                                client_config(cert, **kw)))
    return conn, handler


# ------------------------------------------------------------------------------------------
# handshake and ALPN


@pytest.mark.parametrize("alpn", DEFAULT_ALPNS)
async def test_handshake_with_each_alpn(cert, echo_server, alpn):
    server, factory = echo_server
    conn, handler = await dial(server, cert, alpn_protocols=[alpn])
    assert conn.alpn == alpn and await within(handler.made) == alpn
    peer = await factory.next_handler()
    assert await within(peer.made) == alpn
    assert conn.is_client and not peer.conn.is_client
    assert conn.remote_address == ("127.0.0.1", server.port)
    assert peer.conn.remote_address[0] == "127.0.0.1"
    assert conn.url is not None and conn.url.path == "/moq" and peer.conn.url is None
    assert server.connections == frozenset({peer.conn})
    await shut(conn)
    await within(conn.wait_closed())


async def test_server_picks_alpn_by_its_own_preference(cert, echo_server):
    server, _ = echo_server
    conn, _ = await dial(server, cert, alpn_protocols=["moqt-18", "moqt-20", "moqt-22"])
    assert conn.alpn == "moqt-22"
    await shut(conn)


async def test_no_common_alpn_fails_cleanly(cert):
    factory = Factory()
    server = await start(cert, factory, alpn_protocols=["moqt-22"])
    try:
        with pytest.raises(ConnectError) as info:
            await dial(server, cert, alpn_protocols=["moqt-18"])
        assert "ALPN" in str(info.value) and "moqt-18" in str(info.value)
        # CRYPTO_ERROR + no_application_protocol (RFC 9001 §8.1); a qh3 server (2.1) sends
        # handshake_failure (40) instead, with the reason "No common ALPN protocols".
        alert = 40 if server_backend() == "qh3" else 120
        assert info.value.error_code == 0x100 + alert
        assert factory.made == []
        # The server is unharmed: a client with a common ALPN gets in.
        conn, _ = await dial(server, cert, alpn_protocols=["moqt-21", "moqt-22"])
        assert conn.alpn == "moqt-22"
        await shut(conn)
    finally:
        server.close()
        await within(server.wait_closed())


# ------------------------------------------------------------------------------------------
# streams


async def test_bidi_echo(cert, echo_server):
    server, _ = echo_server
    conn, handler = await dial(server, cert)
    messages = {}
    for i in range(4):
        sid = conn.open_bidi()
        assert is_client_initiated(sid) and not is_unidirectional(sid)
        messages[sid] = os.urandom(1000 + 7919 * i)
    assert len(messages) == 4  # every open_bidi gave a new ID
    for sid, body in messages.items():
        half = len(body) // 2
        conn.send(sid, body[:half])
        conn.send(sid, memoryview(body)[half:], end_stream=True)
    for sid, body in messages.items():
        assert await handler.stream_done(sid) == body
    await shut(conn)


async def test_uni_streams_both_ways(cert):
    factory = Factory()
    server = await start(cert, factory)
    try:
        conn, handler = await dial(server, cert)
        sid = conn.open_uni()
        assert is_unidirectional(sid) and is_client_initiated(sid)
        conn.send(sid, b"to server", end_stream=True)
        peer = await factory.next_handler()
        assert await peer.stream_done(sid) == b"to server"
        with pytest.raises(ValueError):
            peer.conn.send(sid, b"x")  # receive-only for the server

        back = peer.conn.open_uni()
        assert is_unidirectional(back) and not is_client_initiated(back)
        peer.conn.send(back, b"to ", end_stream=False)
        peer.conn.send(back, b"client", end_stream=True)
        assert await handler.stream_done(back) == b"to client"
        assert await within(handler.new_streams.get()) == back

        # A server-opened bidi stream works too.
        bidi = peer.conn.open_bidi()
        peer.conn.send(bidi, b"ping", end_stream=True)
        assert await handler.stream_done(bidi) == b"ping"
        conn.send(bidi, b"pong", end_stream=True)
        assert await peer.stream_done(bidi) == b"pong"
        await shut(conn)
    finally:
        server.close()
        await within(server.wait_closed())


async def test_64_mib_with_small_window_is_backpressured(cert):
    """One stream carries 64 MiB while the receiver grants a 64 KiB stream window: the
    sender's buffered bytes stay under the low-water mark plus one chunk the whole time, and
    the bytes arrive intact."""
    sink_hash = hashlib.sha256()
    total = 64 * MiB
    loop = asyncio.get_running_loop()
    done: asyncio.Future[int] = loop.create_future()
    received = 0

    class Sink(Recorder):
        def stream_data(self, stream_id, data, end_stream):
            nonlocal received
            sink_hash.update(data)
            received += len(data)
            if end_stream:
                done.set_result(received)

    server = await start(cert, Factory(Sink), max_stream_data=64 * 1024, max_data=256 * 1024)
    try:
        low, high, chunk = 256 * 1024, 1 * MiB, 128 * 1024
        conn, _ = await dial(server, cert, send_buffer_high_water=high,
                             send_buffer_low_water=low)
        # qh3 has no per-stream acknowledgement count: its buffered figure adds the packets in
        # flight, headers included, so packets sent between the waiter's wake-up and this
        # task's turn may add their header bytes (under 1/16 of what they carry).
        slack = 0 if client_backend() == "aioquic" else low // 16
        block = os.urandom(MiB)
        want = hashlib.sha256(block * 64).hexdigest()
        view = memoryview(block)
        sid = conn.open_uni()
        peak = 0
        start_t = loop.time()
        for offset in range(0, total, chunk):
            await within(conn.wait_writable(sid))
            assert conn.stream_send_buffered(sid) <= low + slack
            pos = offset % MiB
            conn.send(sid, view[pos:pos + chunk], end_stream=offset + chunk == total)
            peak = max(peak, conn.stream_send_buffered(sid))
        assert await within(done, 60) == total
        elapsed = loop.time() - start_t
        assert sink_hash.hexdigest() == want
        assert low < peak <= low + chunk + slack  # bounded, and the bound was reached
        print(f"64 MiB over one stream: {total / elapsed / 1e6:.1f} MB/s, "
              f"peak send buffer {peak} bytes")
        await within(conn.wait_writable(sid, threshold=0))  # everything acknowledged
        await shut(conn)
    finally:
        server.close()
        await within(server.wait_closed())


async def test_write_keeps_under_high_water(cert, echo_server):
    server, _ = echo_server
    high = 256 * 1024
    conn, handler = await dial(server, cert, send_buffer_high_water=high)
    body = os.urandom(3 * MiB + 12345)
    sid = conn.open_bidi()
    peak = 0
    real_send = conn.send

    def spying_send(stream_id, data, end_stream=False):
        nonlocal peak
        real_send(stream_id, data, end_stream)
        peak = max(peak, conn.stream_send_buffered(stream_id))

    conn.send = spying_send  # type: ignore[method-assign]
    await within(conn.write(sid, body, end_stream=True))
    assert 0 < peak <= high
    assert await handler.stream_done(sid) == body
    empty = conn.open_bidi()
    await within(conn.write(empty, b"", end_stream=True))  # FIN alone
    assert await handler.stream_done(empty) == b""
    await shut(conn)


async def test_reset_stream_propagates_code(cert):
    factory = Factory()
    server = await start(cert, factory)
    try:
        conn, _ = await dial(server, cert)
        sid = conn.open_bidi()
        conn.send(sid, b"partial")
        peer = await factory.next_handler()
        assert await within(peer.new_streams.get()) == sid
        conn.reset_stream(sid, 0x2A)
        assert await within(peer.resets.get()) == (sid, 0x2A)
        with pytest.raises(StreamClosedError) as info:
            conn.send(sid, b"more")
        assert info.value.error_code == 0x2A
        await shut(conn)
    finally:
        server.close()
        await within(server.wait_closed())


async def test_stop_sending_propagates_and_wakes_writer(cert):
    class Stopper(Recorder):
        def stream_data(self, stream_id, data, end_stream):
            first = stream_id not in self.data
            super().stream_data(stream_id, data, end_stream)
            if first:
                self.conn.stop_sending(stream_id, 0x17)

    factory = Factory(Stopper)
    server = await start(cert, factory, max_stream_data=32 * 1024)
    try:
        conn, handler = await dial(server, cert)
        sid = conn.open_bidi()
        conn.send(sid, bytes(4 * MiB))  # far more than the peer's window lets through
        writer = asyncio.ensure_future(conn.wait_writable(sid, threshold=0))
        assert await within(handler.stops.get()) == (sid, 0x17)
        with pytest.raises(StreamClosedError) as info:
            await within(writer)
        assert info.value.stream_id == sid and info.value.error_code == 0x17
        with pytest.raises(StreamClosedError):
            conn.send(sid, b"more")
        assert conn.stream_send_buffered(sid) == 0
        peer = await factory.next_handler()
        # RFC 9000 §3.5: the stopped sender resets with the same code.
        assert await within(peer.resets.get()) == (sid, 0x17)
        await shut(conn)
    finally:
        server.close()
        await within(server.wait_closed())


# ------------------------------------------------------------------------------------------
# datagrams


async def test_datagrams_both_ways(cert, echo_server):
    server, factory = echo_server
    conn, handler = await dial(server, cert)
    peer = await factory.next_handler()
    for i in range(5):
        conn.send_datagram(b"dg%d" % i)
    got_server = sorted([await within(peer.datagrams.get()) for _ in range(5)])
    got_client = sorted([await within(handler.datagrams.get()) for _ in range(5)])
    assert got_server == [b"dg%d" % i for i in range(5)]
    assert got_client == [b"echo:dg%d" % i for i in range(5)]

    # The largest datagram the API admits fits a packet and arrives; one byte more is refused.
    # (Each end's bound depends on its library's packet-number length: 2 or 4 bytes.)
    biggest = peer.conn.max_datagram_payload
    assert 1100 < biggest < 1200
    peer.conn.send_datagram(os.urandom(biggest))
    assert len(await within(handler.datagrams.get())) == biggest
    with pytest.raises(ValueError, match="max_datagram_payload"):
        conn.send_datagram(bytes(conn.max_datagram_payload + 1))
    await shut(conn)


# ------------------------------------------------------------------------------------------
# close


@pytest.mark.parametrize("closer", ["client", "server"])
async def test_close_code_and_reason_reach_the_peer(cert, closer):
    factory = Factory()
    server = await start(cert, factory)
    try:
        conn, handler = await dial(server, cert)
        peer = await factory.next_handler()
        local, remote = (conn, peer) if closer == "client" else (peer.conn, handler)
        local_handler = handler if closer == "client" else peer
        local.close(0x1234, "going away: test")
        with pytest.raises(ConnectionClosedError):
            local.open_bidi()
        assert await within(remote.lost) == (0x1234, "going away: test")
        info = remote.conn.close_info
        assert info is not None and info.application and not info.local
        assert await within(local_handler.lost) == (0x1234, "going away: test")
        assert local.close_info is not None and local.close_info.local
        assert (await within(local.wait_closed())).error_code == 0x1234
        assert (await within(remote.conn.wait_closed())).reason == "going away: test"
    finally:
        server.close()
        await within(server.wait_closed())


async def test_long_close_reason_is_truncated_not_lost(cert, echo_server):
    server, factory = echo_server
    conn, _ = await dial(server, cert)
    peer = await factory.next_handler()
    conn.close(0x5, "é" * 2000)  # 4000 UTF-8 bytes: more than a packet holds
    code, reason = await within(peer.lost)
    assert code == 0x5 and reason == "é" * 512
    await within(conn.wait_closed())


async def test_server_close_closes_its_connections(cert):
    factory = Factory()
    server = await start(cert, factory)
    conn, handler = await dial(server, cert)
    await factory.next_handler()
    server.close(0x10, "shutting down")
    assert await within(handler.lost) == (0x10, "shutting down")
    await within(server.wait_closed())
    assert server.connections == frozenset()
    assert conn.is_closed
    assert (await within(conn.wait_closed())).error_code == 0x10


async def test_handler_exception_closes_with_internal_error(cert):
    class Broken(Recorder):
        def stream_data(self, stream_id, data, end_stream):
            raise RuntimeError("bug in the upper layer")

    server = await start(cert, Factory(Broken), internal_error_code=0x1)
    try:
        conn, handler = await dial(server, cert)
        sid = conn.open_bidi()
        conn.send(sid, b"boom", end_stream=True)
        code, reason = await within(handler.lost)
        assert code == 0x1 and "RuntimeError" in reason
        await within(conn.wait_closed())
    finally:
        server.close()
        await within(server.wait_closed())


async def test_ping(cert, echo_server):
    server, _ = echo_server
    conn, _ = await dial(server, cert)
    await within(conn.ping())
    await shut(conn)
    with pytest.raises(ConnectionClosedError):
        await conn.ping()


# ------------------------------------------------------------------------------------------
# DATAGRAM extension is required (MOQT)


async def test_client_without_datagram_is_closed_by_server(cert):
    factory = Factory()
    server = await start(cert, factory)
    try:
        handler = Recorder()
        conn = await within(connect(f"moqt://127.0.0.1:{server.port}", lambda: handler,
                                    client_config(cert, datagrams=False)))
        code, reason = await within(handler.lost)
        assert code == 0x3 and "DATAGRAM" in reason
        assert conn.close_info is not None and not conn.close_info.local
        await within(conn.wait_closed())
        assert factory.made == []  # the server never handed it to the upper layer
    finally:
        server.close()
        await within(server.wait_closed())


async def test_server_without_datagram_is_refused_by_client(cert):
    factory = Factory()
    server = await start(cert, factory, datagrams=False)
    try:
        made = []
        with pytest.raises(ConnectError, match="DATAGRAM") as info:
            await within(connect(f"moqt://127.0.0.1:{server.port}", lambda: made.append(1),
                                 client_config(cert)))
        assert info.value.error_code == 0x3 and made == []
    finally:
        server.close()
        await within(server.wait_closed())


# ------------------------------------------------------------------------------------------
# packet size


@pytest.mark.parametrize("size", [1452, 16384])
async def test_large_max_datagram_size(cert, size):
    factory = Factory(Echo)
    server = await start(cert, factory, max_datagram_size=size)
    try:
        conn, handler = await dial(server, cert, max_datagram_size=size)
        peer = await factory.next_handler()
        payload = min(conn.max_datagram_payload, peer.conn.max_datagram_payload)  # echoed
        assert size - 64 < payload < size
        # A datagram only fits when the packets really are this large.
        big = os.urandom(payload - len(b"echo:"))
        conn.send_datagram(big)
        assert await within(handler.datagrams.get()) == b"echo:" + big
        body = os.urandom(2 * MiB)
        sid = conn.open_bidi()
        await within(conn.write(sid, body, end_stream=True))
        assert await handler.stream_done(sid) == body
        await shut(conn)
    finally:
        server.close()
        await within(server.wait_closed())


# ------------------------------------------------------------------------------------------
# TLS


@pytest.mark.parametrize("host", ["localhost", "127.0.0.1"])
async def test_trusted_self_signed_cert_verifies(cert, echo_server, host):
    server, _ = echo_server
    conn, _ = await dial(server, cert, host=host)
    assert conn.alpn == "moqt-22"
    await shut(conn)


async def test_cert_files(tmp_path):
    files = make_self_signed().write_to_dir(tmp_path)
    assert (files[1].stat().st_mode & 0o777) == 0o600
    config = TransportConfig(certificate_file=files[0], private_key_file=files[1],
                             backend=server_backend())
    server = await serve("127.0.0.1", 0, Recorder, config)
    try:
        conn = await within(connect(f"moqt://localhost:{server.port}/", Recorder,
                                    TransportConfig(ca_file=files[0])))
        await shut(conn)
    finally:
        server.close()
        await within(server.wait_closed())


async def test_untrusted_cert_fails_unless_insecure(cert, echo_server):
    server, _ = echo_server
    url = f"moqt://localhost:{server.port}/"
    with pytest.raises(ConnectError, match="TLS") as info:
        await within(connect(url, Recorder, TransportConfig()))
    assert 0x100 <= info.value.error_code <= 0x1FF  # a TLS alert (CRYPTO_ERROR range)
    other = make_self_signed()
    with pytest.raises(ConnectError, match="TLS"):
        await within(connect(url, Recorder, TransportConfig(ca_data=other.cert_pem)))
    with pytest.raises(ConnectError, match="TLS"):  # trusted, but not for this name
        await within(connect(url, Recorder,
                             TransportConfig(ca_data=cert.cert_pem, server_name="example.com")))
    conn = await within(connect(url, Recorder, TransportConfig(insecure=True)))
    await shut(conn)


async def test_handshake_timeout():
    silent = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)  # receives, never answers
    silent.bind(("127.0.0.1", 0))
    try:
        port = silent.getsockname()[1]
        with pytest.raises(ConnectError, match="timed out"):
            await within(connect(f"moqt://127.0.0.1:{port}", Recorder,
                                 TransportConfig(insecure=True, handshake_timeout=0.3)))
    finally:
        silent.close()


def test_server_needs_a_certificate():
    async def main():
        with pytest.raises(ValueError, match="certificate"):
            await serve("127.0.0.1", 0, Recorder, TransportConfig())
    asyncio.run(main())


def test_bad_congestion_control_name_is_rejected():
    async def main():
        with pytest.raises(ValueError, match="congestion"):
            await connect("moqt://127.0.0.1:1", Recorder,
                          TransportConfig(congestion_control_algorithm="no-such-controller"))
    asyncio.run(main())


# ------------------------------------------------------------------------------------------
# uvloop


def _cubic(backend: str) -> str | None:
    return "cubic" if backend == "aioquic" else None  # qh3's controller is not selectable


def test_echo_on_uvloop_via_run(cert):
    uvloop = pytest.importorskip("uvloop")

    async def main() -> tuple[bytes, bool]:
        is_uv = isinstance(asyncio.get_running_loop(), uvloop.Loop)
        factory = Factory(Echo)
        server = await start(cert, factory, congestion_control_algorithm=_cubic(server_backend()))
        try:
            conn, handler = await dial(server, cert,
                                       congestion_control_algorithm=_cubic(client_backend()))
            sid = conn.open_bidi()
            await conn.write(sid, b"over uvloop" * 1000, end_stream=True)
            body = await handler.stream_done(sid)
            conn.send_datagram(b"d")
            assert await within(handler.datagrams.get()) == b"echo:d"
            await shut(conn)
            await within(conn.wait_closed())
            return body, is_uv
        finally:
            server.close()
            await within(server.wait_closed())

    body, is_uv = run(main(), use_uvloop=True)
    assert is_uv and body == b"over uvloop" * 1000
