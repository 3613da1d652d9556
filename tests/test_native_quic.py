"""The native QUIC data plane (kvsp_moq.transport.native._ngtcp2, issue #28 step 1) on real
UDP over 127.0.0.1: two native endpoints, a native endpoint against aioquic either way, TLS
verification, hostile datagrams, and flow control holding when Python does not drain.

The raw module API is driven by a small asyncio reader on the endpoint's eventfd. Nothing
sleeps to wait for a condition: every wait is for an event (GUARD only stops a hang)."""

from __future__ import annotations

import asyncio
import hashlib
import os
import socket
import struct
import sys
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from aioquic.asyncio import QuicConnectionProtocol, connect, serve
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.events import (
    ConnectionTerminated,
    DatagramFrameReceived,
    QuicEvent,
    StreamDataReceived,
)

from kvsp_moq.transport import native
from system_programs import under_ci
from kvsp_moq.transport.tls import make_self_signed

# Skipped where the extension is not built; under CI (the test command installs the Debian
# packages before pip builds it) a missing build is a failure (test_the_extension_is_built).
pytestmark = pytest.mark.skipif(not native.available() and not under_ci(),
                                reason=native.unavailable_reason() or "")


def test_the_extension_is_built() -> None:
    assert native.available(), native.unavailable_reason()

MiB = 1 << 20
GUARD = 60.0  # a safety net against hangs, never a way to wait for something
ALPN = "kvsp-native-test"
WINDOWS: dict[str, Any] = dict(initial_max_data=32 * MiB, initial_max_stream_data=16 * MiB,
               initial_max_streams_bidi=16, initial_max_streams_uni=16)


async def within(aw: Any, timeout: float = GUARD) -> Any:
    return await asyncio.wait_for(aw, timeout)


class Certs:
    def __init__(self, root: Path) -> None:
        cert = make_self_signed()
        self.cert, self.key = (str(p) for p in cert.write_to_dir(root))
        self.ca = str(root / "ca.pem")
        Path(self.ca).write_bytes(cert.ca_pem)


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return Certs(tmp_path_factory.mktemp("certs"))


class Driver:
    """An endpoint drained on the running loop: every event is kept, in order, and waiters
    look for the first unseen one that matches."""

    def __init__(self, ep: Any) -> None:
        self.ep = ep
        self.log: list[tuple[Any, ...]] = []
        self.changed = asyncio.Event()
        self.reading = False
        self.resume()

    def resume(self) -> None:
        if not self.reading:
            asyncio.get_running_loop().add_reader(self.ep.fileno(), self.drain)
            self.reading = True
            self.drain()

    def pause(self) -> None:
        if self.reading:
            asyncio.get_running_loop().remove_reader(self.ep.fileno())
            self.reading = False

    def drain(self) -> None:
        batch = self.ep.events()
        self.log.extend(batch)
        if batch:
            self.changed.set()

    async def until(self, match: Callable[[tuple[Any, ...]], bool], start: int = 0,
                    ) -> tuple[int, tuple[Any, ...]]:
        """The first event from log[start:] that matches (waiting for it)."""
        async def scan() -> tuple[int, tuple[Any, ...]]:
            i = start
            while True:
                while i < len(self.log):
                    if match(self.log[i]):
                        return i, self.log[i]
                    i += 1
                self.changed.clear()
                await self.changed.wait()
        return await within(scan())

    async def event(self, kind: str, conn: int | None = None) -> tuple[Any, ...]:
        _, ev = await self.until(lambda e: e[0] == kind and (conn is None or e[1] == conn))
        return ev

    async def stream_bytes(self, conn: int, stream_id: int) -> bytes:
        """Everything of one stream up to its FIN."""
        out, i = bytearray(), 0
        while True:
            i, ev = await self.until(lambda e: e[0] == "stream" and e[1:3] == (conn, stream_id),
                                     i)
            out += ev[3]
            i += 1
            if ev[4]:
                return bytes(out)

    def close(self) -> None:
        self.pause()
        self.ep.close()


def endpoint(server: bool, certs: Certs, **kw: Any) -> Any:
    opts: dict[str, Any] = dict(WINDOWS, alpns=[ALPN])
    if server:
        opts.update(cert_file=certs.cert, key_file=certs.key)
    else:
        opts.update(ca_file=certs.ca)
    opts.update(kw)
    from kvsp_moq.transport.native import _ngtcp2
    return _ngtcp2.Endpoint(server, "127.0.0.1", 0, **opts)


async def pair(certs: Certs, client_kw: dict[str, Any] | None = None,
               server_kw: dict[str, Any] | None = None) -> tuple[Driver, Driver, int, int]:
    """A native server and client, connected: (server, client, server's conn, client's)."""
    srv = Driver(endpoint(True, certs, **(server_kw or {})))
    cli = Driver(endpoint(False, certs, **(client_kw or {})))
    ch = cli.ep.connect("127.0.0.1", srv.ep.local_address()[1], "localhost")
    est = await cli.event("established", ch)
    assert est[2] == ALPN and est[3] == srv.ep.local_address()
    sest = await srv.event("established")
    assert sest[3] == cli.ep.local_address()
    return srv, cli, sest[1], ch


def test_version_names_both_libraries() -> None:
    from kvsp_moq.transport.native import _ngtcp2
    v = _ngtcp2.version()
    assert v["ngtcp2"].startswith("0.") and v["gnutls"].startswith("3.")
    assert native.unavailable_reason() is None


# --- native <-> native --------------------------------------------------------------------

async def echo_streams(srv: Driver, conn: int) -> None:
    """Server side: echo every bidi stream's bytes as they arrive, FIN included."""
    i = 0
    while True:
        i, ev = await srv.until(lambda e: e[0] in ("stream", "closed") and e[1] == conn, i)
        i += 1
        if ev[0] == "closed":
            return
        if ev[2] % 4 == 0:  # a client-initiated bidirectional stream
            srv.ep.send(conn, ev[2], ev[3], ev[4])


async def test_native_pair_echo_uni_datagrams_and_close(certs: Certs) -> None:
    srv, cli, sc, cc = await pair(certs)
    echo = asyncio.ensure_future(echo_streams(srv, sc))
    try:
        data = os.urandom(32 * MiB)
        sid = cli.ep.open_stream(cc, False)
        cli.ep.send(cc, sid, data, True)
        back = await cli.stream_bytes(cc, sid)
        assert hashlib.sha256(back).digest() == hashlib.sha256(data).digest()

        uni = cli.ep.open_stream(cc, True)
        cli.ep.send(cc, uni, b"one way", False)
        cli.ep.send(cc, uni, memoryview(b"-and more"), True)
        assert await srv.stream_bytes(sc, uni) == b"one way-and more"

        assert cli.ep.max_datagram_payload(cc) > 1000
        cli.ep.send_datagram(cc, b"ping")
        assert (await srv.event("datagram", sc))[2] == b"ping"
        srv.ep.send_datagram(sc, b"pong")
        assert (await cli.event("datagram", cc))[2] == b"pong"

        stats = cli.ep.stats(cc)
        assert stats["cc"] == "bbr" and stats["bytes_sent"] > 32 * MiB and stats["cwnd"] > 0
        assert cli.ep.buffered(cc, sid) == 0

        cli.ep.close_connection(cc, 0x2a, b"done here")
        closed = await srv.event("closed", sc)
        assert closed[2:] == (0x2a, "done here", True, True)
        assert (await cli.event("closed", cc))[2:] == (0x2a, "done here", True, False)
        with pytest.raises(ConnectionError):
            cli.ep.open_stream(cc, False)
    finally:
        echo.cancel()
        cli.close()
        srv.close()


async def test_stream_limit_blocks_then_the_event_says_retry(certs: Certs) -> None:
    srv, cli, sc, cc = await pair(certs, server_kw=dict(initial_max_streams_uni=2))
    try:
        first = [cli.ep.open_stream(cc, True) for _ in range(2)]
        with pytest.raises(BlockingIOError):
            cli.ep.open_stream(cc, True)
        mark = len(cli.log)
        for sid in first:
            cli.ep.send(cc, sid, b"x", True)
        for sid in first:  # drained: the server grants MAX_STREAMS for the closed streams
            assert await srv.stream_bytes(sc, sid) == b"x"
        await cli.until(lambda e: e[0] == "stream_limit", mark)
        assert cli.ep.open_stream(cc, True) == first[-1] + 4
    finally:
        cli.close()
        srv.close()


async def test_reset_and_stop_sending_reach_the_peer(certs: Certs) -> None:
    srv, cli, sc, cc = await pair(certs)
    try:
        uni = cli.ep.open_stream(cc, True)
        cli.ep.send(cc, uni, b"partial", False)
        await srv.until(lambda e: e[0] == "stream" and e[2] == uni)
        cli.ep.reset_stream(cc, uni, 11)
        assert (await srv.event("reset", sc))[2:] == (uni, 11)

        other = cli.ep.open_stream(cc, True)
        cli.ep.send(cc, other, b"more to come", False)
        await srv.until(lambda e: e[0] == "stream" and e[2] == other)
        srv.ep.stop_sending(sc, other, 12)
        assert (await cli.event("stop_sending", cc))[2:] == (other, 12)
    finally:
        cli.close()
        srv.close()


async def test_endpoint_close_tells_the_peer_and_is_idempotent(certs: Certs) -> None:
    srv, cli, sc, cc = await pair(certs)
    try:
        cli.close()
        assert (await srv.event("closed", sc))[2:] == (0, "endpoint closed", False, True)
        cli.ep.close()
        with pytest.raises(ValueError):
            cli.ep.events()
    finally:
        cli.close()
        srv.close()


async def test_many_short_uni_streams_under_a_small_limit(certs: Certs) -> None:
    # The MOQT pattern: a stream per object. A peer's finished streams give their credit
    # back (ngtcp2 0.12 never closes them itself: see nq_stream.c).
    srv, cli, sc, cc = await pair(certs, server_kw=dict(initial_max_streams_uni=4))
    try:
        opened: list[int] = []
        while len(opened) < 200:
            try:
                sid = cli.ep.open_stream(cc, True)
            except BlockingIOError:
                await cli.until(lambda e: e[0] == "stream_limit", len(cli.log))
                continue
            cli.ep.send(cc, sid, b"object %d" % len(opened), True)
            opened.append(sid)
        for i, sid in enumerate(opened):
            assert await srv.stream_bytes(sc, sid) == b"object %d" % i
    finally:
        cli.close()
        srv.close()


async def test_datagram_limits_and_idle_timeout(certs: Certs) -> None:
    srv, cli, sc, cc = await pair(certs, server_kw=dict(max_datagram_frame_size=0,
                                                        idle_timeout_ms=300))
    try:
        assert cli.ep.max_datagram_payload(cc) == 0
        with pytest.raises(ValueError):
            cli.ep.send_datagram(cc, b"x")  # the server offered no DATAGRAM
        limit = srv.ep.max_datagram_payload(sc)
        assert 1000 < limit < 1452
        with pytest.raises(ValueError):
            srv.ep.send_datagram(sc, bytes(limit + 1))
        srv.ep.send_datagram(sc, bytes(limit))
        assert len((await cli.event("datagram", cc))[2]) == limit
        # RFC 9000 §10.1: the smaller idle timeout applies, silently, on both ends.
        assert (await cli.event("closed", cc))[2:] == (0, "idle timeout", False, False)
        assert (await srv.event("closed", sc))[2:] == (0, "idle timeout", False, False)
    finally:
        cli.close()
        srv.close()


async def test_ipv6_loopback(certs: Certs) -> None:
    if not socket.has_ipv6:
        pytest.skip("no IPv6")
    from kvsp_moq.transport.native import _ngtcp2
    srv = Driver(_ngtcp2.Endpoint(True, "::1", 0, alpns=[ALPN], cert_file=certs.cert,
                                  key_file=certs.key, **WINDOWS))
    cli = Driver(_ngtcp2.Endpoint(False, "::1", 0, alpns=[ALPN], ca_file=certs.ca, **WINDOWS))
    try:
        h = cli.ep.connect("::1", srv.ep.local_address()[1], "::1")  # verified against the IP
        assert (await cli.event("established", h))[3] == srv.ep.local_address()
    finally:
        cli.close()
        srv.close()


# --- TLS --------------------------------------------------------------------------------------

async def test_untrusted_certificate_fails_unless_verify_is_off(certs: Certs,
                                                                tmp_path: Path) -> None:
    other = Certs(tmp_path)  # a CA that did not sign the server's certificate
    srv = Driver(endpoint(True, certs))
    port = srv.ep.local_address()[1]
    strict = Driver(endpoint(False, certs, ca_file=other.ca))
    lax = Driver(endpoint(False, certs, ca_file=other.ca, verify=False))
    try:
        h = strict.ep.connect("127.0.0.1", port, "localhost")
        closed = await strict.event("closed", h)
        assert 0x100 <= closed[2] < 0x200 and not closed[4] and not closed[5], closed
        assert not any(e[0] == "established" for e in strict.log)

        h = lax.ep.connect("127.0.0.1", port, "localhost")
        assert (await lax.event("established", h))[2] == ALPN

        wrong_name = strict.ep.connect("127.0.0.1", port, "not-the-server.example")
        closed = await strict.event("closed", wrong_name)
        assert 0x100 <= closed[2] < 0x200
    finally:
        for d in (strict, lax, srv):
            d.close()


async def test_no_common_alpn_is_no_application_protocol(certs: Certs) -> None:
    srv = Driver(endpoint(True, certs, alpns=["a", "b"]))
    cli = Driver(endpoint(False, certs, alpns=["c"]))
    other = Driver(endpoint(False, certs, alpns=["z", "b", "a"]))
    try:
        port = srv.ep.local_address()[1]
        h = cli.ep.connect("127.0.0.1", port, "localhost")
        assert (await cli.event("closed", h))[2] == 0x178, cli.log  # CRYPTO_ERROR + 120
        h = other.ep.connect("127.0.0.1", port, "localhost")
        assert (await other.event("established", h))[2] == "a"  # the server's preference
    finally:
        for d in (cli, other, srv):
            d.close()


# --- aioquic on the other end -----------------------------------------------------------------

class AioquicEcho(QuicConnectionProtocol):
    """Echoes stream bytes and datagrams; records how the connection ended."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.terminated: asyncio.Future[ConnectionTerminated] = (
            asyncio.get_running_loop().create_future())
        self.received: dict[int, bytearray] = {}
        self.ended: dict[int, asyncio.Future[bytes]] = {}
        self.datagrams: asyncio.Queue[bytes] = asyncio.Queue()
        self.echo = True

    def stream_done(self, sid: int) -> asyncio.Future[bytes]:
        return self.ended.setdefault(sid, asyncio.get_running_loop().create_future())

    def quic_event_received(self, event: QuicEvent) -> None:
        if isinstance(event, StreamDataReceived):
            self.received.setdefault(event.stream_id, bytearray()).extend(event.data)
            if self.echo:
                self._quic.send_stream_data(event.stream_id, event.data, event.end_stream)
            if event.end_stream:
                self.stream_done(event.stream_id).set_result(bytes(self.received[event.stream_id]))
        elif isinstance(event, DatagramFrameReceived):
            self.datagrams.put_nowait(event.data)
            if self.echo:
                self._quic.send_datagram_frame(event.data)
        elif isinstance(event, ConnectionTerminated) and not self.terminated.done():
            self.terminated.set_result(event)
        self.transmit()


def aioquic_config(is_client: bool, certs: Certs) -> QuicConfiguration:
    config = QuicConfiguration(is_client=is_client, alpn_protocols=[ALPN],
                               max_datagram_frame_size=65536, max_data=16 * MiB,
                               max_stream_data=8 * MiB)
    if is_client:
        config.load_verify_locations(certs.ca)
        config.server_name = "localhost"
    else:
        config.load_cert_chain(certs.cert, certs.key)
    return config


async def test_native_client_with_aioquic_server(certs: Certs) -> None:
    protocols: list[AioquicEcho] = []

    def factory(*args: Any, **kw: Any) -> AioquicEcho:
        protocols.append(AioquicEcho(*args, **kw))
        return protocols[-1]

    server = await serve("127.0.0.1", 0, configuration=aioquic_config(False, certs),
                         create_protocol=factory)
    assert server._transport is not None
    port = server._transport.get_extra_info("sockname")[1]
    cli = Driver(endpoint(False, certs))
    try:
        cc = cli.ep.connect("127.0.0.1", port, "localhost")
        assert (await cli.event("established", cc))[2] == ALPN
        data = os.urandom(8 * MiB)
        sid = cli.ep.open_stream(cc, False)
        cli.ep.send(cc, sid, data, True)
        assert await cli.stream_bytes(cc, sid) == data  # 8 MiB each way
        assert await within(protocols[0].stream_done(sid)) == data
        cli.ep.send_datagram(cc, b"dgram")
        assert (await cli.event("datagram", cc))[2] == b"dgram"
        cli.ep.close_connection(cc, 0x33, b"native says bye")
        ended = await within(protocols[0].terminated)
        assert (ended.error_code, ended.reason_phrase) == (0x33, "native says bye")
    finally:
        cli.close()
        server.close()


async def test_aioquic_client_with_native_server(certs: Certs) -> None:
    srv = Driver(endpoint(True, certs))
    echo: asyncio.Future[None] | None = None
    try:
        async with connect("127.0.0.1", srv.ep.local_address()[1],
                           configuration=aioquic_config(True, certs),
                           create_protocol=AioquicEcho) as client:
            assert isinstance(client, AioquicEcho)
            client.echo = False
            est = await srv.event("established")
            sc = est[1]
            assert est[2] == ALPN
            echo = asyncio.ensure_future(echo_streams(srv, sc))
            data = os.urandom(8 * MiB)
            sid = client._quic.get_next_available_stream_id()
            client._quic.send_stream_data(sid, data, end_stream=True)
            client.transmit()
            assert await within(client.stream_done(sid)) == data
            assert await srv.stream_bytes(sc, sid) == data
            client._quic.send_datagram_frame(b"to native")
            client.transmit()
            assert (await srv.event("datagram", sc))[2] == b"to native"
            srv.ep.send_datagram(sc, b"to aioquic")
            assert await within(client.datagrams.get()) == b"to aioquic"
            srv.ep.close_connection(sc, 0x44, b"server done")
            ended = await within(client.terminated)
            assert (ended.error_code, ended.reason_phrase) == (0x44, "server done")
    finally:
        if echo is not None:
            echo.cancel()
        srv.close()


# --- hostile input ----------------------------------------------------------------------------

def varint(v: int) -> bytes:
    if v < 1 << 6:
        return bytes([v])
    if v < 1 << 14:
        return struct.pack("!H", v | 0x4000)
    if v < 1 << 30:
        return struct.pack("!I", v | 0x80000000)
    return struct.pack("!Q", v | 0xC000000000000000)


def hostile_datagrams() -> list[bytes]:
    """Random bytes, long headers cut short or claiming huge lengths, unknown versions,
    over-long connection IDs, short headers for unknown connections."""
    rnd = os.urandom
    out = [rnd(n) for n in (1, 5, 20, 100, 1199, 1200, 1500, 9000, 65000)]
    for first in (0xC0, 0xC3, 0xD0, 0xE0, 0xF0):  # Initial, 0-RTT, Handshake, Retry
        head = bytes([first]) + struct.pack("!I", 1)
        out += [head[:k] for k in range(1, len(head))]
        out.append(head + bytes([20]) + rnd(20) + bytes([20]) + rnd(20) + varint(0)
                   + varint((1 << 62) - 1) + rnd(1200))
        out.append(head + bytes([255]) + rnd(40))  # a DCID longer than the datagram
        out.append(head + bytes([8]) + rnd(8) + bytes([8]) + rnd(8) + varint(1 << 40)
                   + varint(5000) + rnd(1300))  # a token length beyond the datagram
        out.append(head + bytes([8]) + rnd(8) + bytes([8]) + rnd(8) + varint(0)
                   + varint(1100) + rnd(1100))  # plausible, undecryptable
    out.append(bytes([0xC0]) + struct.pack("!I", 0x1A2A3A4A) + bytes([8]) + rnd(8)
               + bytes([8]) + rnd(8) + rnd(1300))  # an unknown version: negotiation
    out.append(bytes([0x80]) + struct.pack("!I", 0) + bytes([8]) + rnd(8) + bytes([8])
               + rnd(8) + rnd(100))  # a Version Negotiation packet
    out += [bytes([0x40 | (i & 0x3F)]) + rnd(16) + rnd(200) for i in range(64)]
    return out


async def test_hostile_datagrams_do_not_disturb_a_transfer(certs: Certs) -> None:
    srv = Driver(endpoint(True, certs))
    cli = Driver(endpoint(False, certs))
    junk = hostile_datagrams()
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    echo = None
    try:
        targets = [srv.ep.local_address(), cli.ep.local_address()]

        def spray() -> None:
            for dgram in junk:
                for addr in targets:
                    sock.sendto(dgram, addr)

        spray()
        cc = cli.ep.connect("127.0.0.1", targets[0][1], "localhost")
        spray()
        await cli.event("established", cc)
        sc = (await srv.event("established"))[1]
        echo = asyncio.ensure_future(echo_streams(srv, sc))
        data = os.urandom(4 * MiB)
        sid = cli.ep.open_stream(cc, False)
        cli.ep.send(cc, sid, data[: 2 * MiB])
        spray()
        cli.ep.send(cc, sid, data[2 * MiB:], True)
        spray()
        assert await cli.stream_bytes(cc, sid) == data
        assert not any(e[0] == "closed" for e in cli.log + srv.log)
        # The server still takes new connections.
        again = cli.ep.connect("127.0.0.1", targets[0][1], "localhost")
        await cli.event("established", again)
    finally:
        if echo is not None:
            echo.cancel()
        sock.close()
        cli.close()
        srv.close()


# --- flow control -----------------------------------------------------------------------------

async def test_a_receiver_that_does_not_drain_holds_at_most_its_windows(certs: Certs) -> None:
    stream_window, conn_window = 256 * 1024, 768 * 1024
    srv, cli, sc, cc = await pair(
        certs, server_kw=dict(initial_max_stream_data=stream_window,
                              initial_max_data=conn_window))
    try:
        srv.pause()
        total = 4 * MiB
        streams = [cli.ep.open_stream(cc, True) for _ in range(4)]
        for sid in streams:
            cli.ep.send(cc, sid, os.urandom(total), True)
        # The server acknowledges what it received: exactly its connection window in all,
        # while Python (paused) takes nothing.
        held = lambda: sum(total - cli.ep.buffered(cc, s) for s in streams)  # noqa: E731
        await cli.until(lambda e: e[0] == "acked" and held() == conn_window)
        assert all(total - cli.ep.buffered(cc, s) <= stream_window for s in streams)
        assert srv.ep.stats(sc)["bytes_received"] < conn_window + 64 * 1024
        # One drain hands over what was held, no more, and credit flows again.
        first = srv.ep.events()
        got = {e[2]: len(e[3]) for e in first if e[0] == "stream"}
        assert sum(got.values()) == conn_window and max(got.values()) <= stream_window
        srv.log.extend(first)
        srv.resume()
        for sid in streams:
            assert len(await srv.stream_bytes(sc, sid)) == total
    finally:
        cli.close()
        srv.close()


# ------------------------------------------------------------------------------------------
# zero-copy send (issue 28 step 3): send(..., hold=True) sends from the caller's buffer


async def test_held_sends_arrive_bit_exact_past_the_windows_and_are_released(
        certs: Certs) -> None:
    """Held views of one buffer (and pieces under 4 KiB, which are copied) on a stream 16 times
    the peer's windows: bit-exact at the peer, the buffer held while bytes are unacknowledged
    (its exporter cannot resize), and released by the drain that reports the last ack."""
    srv, cli, sc, cc = await pair(certs, server_kw=dict(initial_max_stream_data=256 * 1024,
                                                         initial_max_data=512 * 1024))
    try:
        block = bytearray(os.urandom(8 * MiB))
        base = sys.getrefcount(block)
        sid = cli.ep.open_stream(cc, True)
        cuts = [0, 100, 100 + 3000, 1 * MiB, 1 * MiB + 4096, 5 * MiB, 8 * MiB]
        for lo, hi in zip(cuts, cuts[1:]):
            cli.ep.send(cc, sid, memoryview(block)[lo:hi], hi == cuts[-1], hold=True)
        assert sys.getrefcount(block) > base  # held, not copied
        with pytest.raises(BufferError):
            block.append(0)  # an exporter held by the extension cannot resize
        got = await srv.stream_bytes(sc, sid)
        assert hashlib.sha256(got).digest() == hashlib.sha256(block).digest()
        await cli.until(lambda e: e[0] == "acked" and e[2] == sid and e[3] == 0)
        assert sys.getrefcount(block) == base
        block.append(0)
    finally:
        cli.close()
        srv.close()


async def test_a_reset_stream_releases_its_held_buffer(certs: Certs) -> None:
    """A stream reset while most of a held buffer is unacknowledged (the peer does not drain:
    flow control holds it back) lets go of the buffer once ngtcp2 closes the stream, and an
    endpoint closed while holding one releases it too."""
    import numpy as np

    srv, cli, sc, cc = await pair(certs, server_kw=dict(initial_max_stream_data=256 * 1024,
                                                         initial_max_data=512 * 1024))
    try:
        srv.pause()
        released = asyncio.Event()
        array = np.frombuffer(os.urandom(4 * MiB), dtype=np.uint8).copy()
        gone = weakref.ref(array, lambda _: released.set())
        sid = cli.ep.open_stream(cc, True)
        cli.ep.send(cc, sid, memoryview(array), False, hold=True)
        del array
        await cli.until(lambda e: e[0] == "acked" and e[2] == sid)  # some bytes are in flight
        assert gone() is not None and cli.ep.buffered(cc, sid) > 3 * MiB  # the rest is held
        cli.ep.reset_stream(cc, sid, 7)
        srv.resume()
        await within(released.wait())
        assert (await srv.event("reset", sc))[2:] == (sid, 7)

        closed = asyncio.Event()
        other = np.zeros(2 * MiB, dtype=np.uint8)
        ref = weakref.ref(other, lambda _: closed.set())
        sid = cli.ep.open_stream(cc, True)
        srv.pause()
        cli.ep.send(cc, sid, memoryview(other), False, hold=True)
        del other
        assert ref() is not None
        cli.close()
        await within(closed.wait())
    finally:
        cli.close()
        srv.close()


# ------------------------------------------------------------------------------------------
# SUBGROUP streams held while a SUBSCRIBE is unanswered (issue 28 step 3)


async def test_subgroup_streams_wait_for_the_registration_of_their_alias(certs: Certs) -> None:
    """While a SUBSCRIBE is pending (``subscriptions_pending``), a SUBGROUP stream of an alias
    nothing registered is held: a stream the peer sent after it reaches Python first. A
    registration of its alias then parses it into the destination; once nothing is pending, a
    held stream of another alias goes to Python whole, and a later one is not held."""
    from kvsp_moq.moqt.data import SubgroupStreamEncoder
    from kvsp_moq.moqt.objects import SubgroupHeader

    srv, cli, sc, cc = await pair(certs)
    try:
        payload = os.urandom(64 * 1024)

        def subgroup(alias: int) -> bytes:
            enc = SubgroupStreamEncoder(SubgroupHeader(alias, 0, 0, 128))
            return enc.header() + enc.object(0, payload)

        cli.ep.subscriptions_pending(cc, 1)
        held = {alias: srv.ep.open_stream(sc, True) for alias in (5, 6)}
        for alias, sid in held.items():
            srv.ep.send(sc, sid, subgroup(alias), True)
        marker = srv.ep.open_stream(sc, True)  # not a data stream: goes to Python at once
        srv.ep.send(sc, marker, b"\x01marker", True)
        assert await cli.stream_bytes(cc, marker) == b"\x01marker"
        assert not any(e[0] == "stream" and e[2] in held.values() for e in cli.log)

        dest = bytearray(len(payload))
        handle = cli.ep.receive_objects(cc, 1, 5, 0, 0, [dest])
        _, obj = await cli.until(lambda e: e[0] == "object" and e[2] == handle)
        assert obj[3] == held[5] and obj[10] == hashlib.sha256(payload).digest()
        assert bytes(dest) == payload

        cli.ep.subscriptions_pending(cc, -1)
        assert await cli.stream_bytes(cc, held[6]) == subgroup(6)
        late = srv.ep.open_stream(sc, True)
        srv.ep.send(sc, late, subgroup(7), True)
        assert await cli.stream_bytes(cc, late) == subgroup(7)
        cli.ep.forget_objects(cc, handle)
    finally:
        cli.close()
        srv.close()
