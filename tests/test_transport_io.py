"""The engine's UDP layer on real QUIC over 127.0.0.1: GSO/GRO on and off carry the same
bytes, batching really happens where the kernel has it, and hostile datagrams neither crash
an endpoint nor disturb its connections. Every test runs for every backend pair (see
``_transport_backends``); nothing sleeps to wait for a condition."""

from __future__ import annotations

import asyncio
import hashlib
import os
import socket

import pytest

from kvsp_moq.transport import (
    BaseConnectionHandler,
    Connection,
    TransportConfig,
    connect,
    is_unidirectional,
    new_event_loop,
    serve,
)
from kvsp_moq.transport.tls import SelfSignedCert, make_self_signed
from kvsp_moq.transport.udp import gso_supported
from tests._transport_backends import pairing, server_backend  # noqa: F401

MiB = 1 << 20
GUARD = 60.0  # a safety net against hangs, never a way to wait for something


async def within(aw, timeout: float = GUARD):
    return await asyncio.wait_for(aw, timeout)


@pytest.fixture(scope="module")
def cert() -> SelfSignedCert:
    return make_self_signed()


class Echo(BaseConnectionHandler):
    """Echoes bidi stream bytes and datagrams (when ``echo``); records what it received."""

    def __init__(self, echo: bool = True) -> None:
        loop = asyncio.get_running_loop()
        self.echo = echo
        self.received: dict[int, bytearray] = {}
        self.ended: dict[int, asyncio.Future[bytes]] = {}
        self.datagrams: asyncio.Queue[bytes] = asyncio.Queue()
        self.made: asyncio.Future[Connection] = loop.create_future()

    def connection_made(self, conn: Connection, alpn: str) -> None:
        super().connection_made(conn, alpn)
        self.made.set_result(conn)

    def done(self, stream_id: int) -> asyncio.Future[bytes]:
        if stream_id not in self.ended:
            self.ended[stream_id] = asyncio.get_running_loop().create_future()
        return self.ended[stream_id]

    def stream_data(self, stream_id, data, end_stream) -> None:
        self.received.setdefault(stream_id, bytearray()).extend(data)
        if self.echo and not is_unidirectional(stream_id):
            assert self.conn is not None
            self.conn.send(stream_id, data, end_stream=end_stream)
        if end_stream:
            self.done(stream_id).set_result(bytes(self.received[stream_id]))

    def datagram_received(self, data) -> None:
        self.datagrams.put_nowait(bytes(data))
        assert self.conn is not None
        if self.echo:
            self.conn.send_datagram(b"echo:" + bytes(data)[:self.conn.max_datagram_payload - 5])


async def _exchange(cert: SelfSignedCert, size: int, gso: bool, gro: bool) -> tuple:
    """4 MiB echoed on a bidi stream, 2 MiB on a uni stream, 20 datagrams each way; returns
    what each side received and the UDP counters of both ends."""
    # The server's handler exists once the server side finished its handshake, which may be
    # after connect() returned on the client side.
    first: asyncio.Future[Echo] = asyncio.get_running_loop().create_future()

    def factory() -> Echo:
        echo = Echo()
        if not first.done():
            first.set_result(echo)
        return echo

    common = {"max_datagram_size": size, "udp_gso": gso, "udp_gro": gro}
    server = await serve("127.0.0.1", 0, factory, TransportConfig(
        certificate_pem=cert.cert_pem, private_key_pem=cert.key_pem, backend=server_backend(),
        **common))
    try:
        mine = Echo(echo=False)
        conn = await within(connect(f"moqt://127.0.0.1:{server.port}/", lambda: mine,
                                    TransportConfig(ca_data=cert.cert_pem, **common)))
        peer = await within(first)
        bidi, uni = conn.open_bidi(), conn.open_uni()
        body = os.urandom(4 * MiB)
        other = os.urandom(2 * MiB + 77)
        sending = asyncio.gather(conn.write(bidi, body, end_stream=True),
                                 conn.write(uni, other, end_stream=True))
        payload = min(conn.max_datagram_payload, (await within(peer.made)).max_datagram_payload)
        grams = [os.urandom(payload - 5 - i) for i in range(20)]
        for gram in grams:
            conn.send_datagram(gram)
        await within(sending)
        echoed = await within(mine.done(bidi))
        got_uni = await within(peer.done(uni))
        # Datagrams are unreliable; on loopback with these buffers none are lost, and the
        # transfer is what is compared across settings.
        got_grams = [await within(peer.datagrams.get()) for _ in grams]
        back = [await within(mine.datagrams.get()) for _ in grams]
        assert conn.udp is not None and server.udp is not None  # type: ignore[attr-defined]
        counters = [(e.gso, e.gro, e.packets_sent, e.send_calls, e.packets_received,
                     e.recv_calls) for e in (conn.udp, server.udp)]  # type: ignore
        await within(conn.aclose())
    finally:
        server.close()
        await within(server.wait_closed())
    digest = hashlib.sha256
    return ((digest(echoed).hexdigest(), digest(got_uni).hexdigest(),
             sorted(digest(g).hexdigest() for g in got_grams),
             sorted(digest(g).hexdigest() for g in back)),
            (digest(body).hexdigest(), digest(other).hexdigest(),
             sorted(digest(g).hexdigest() for g in grams),
             sorted(digest(b"echo:" + g).hexdigest() for g in grams)),
            counters)


@pytest.mark.parametrize("size", [1200, 16384])
async def test_gso_gro_on_and_off_carry_the_same_bytes(cert, size):
    results = {}
    for gso, gro in ((True, True), (False, False), (True, False), (False, True)):
        got, want, counters = await _exchange(cert, size, gso, gro)
        assert got == want
        results[gso, gro] = counters
        for used_gso, used_gro, sent, send_calls, received, recv_calls in counters:
            assert used_gso == (gso and gso_supported(socket.AF_INET))
            assert send_calls <= sent and recv_calls <= received
            if not used_gso:
                assert send_calls == sent  # one packet per system call
            if not used_gro:
                assert recv_calls == received
    if gso_supported(socket.AF_INET):
        # Batching really happened: the bulk sender (the client) needed fewer send calls
        # than packets with GSO on (the GRO-on receiver may or may not get them coalesced).
        _, _, sent, send_calls, _, _ = results[True, True][0]
        assert send_calls < sent


async def test_hostile_datagrams_do_not_disturb(cert):
    """Garbage and truncated packets at the server's and the client's sockets: empty, one
    byte, random bytes up to 65000, a long header of an unknown QUIC version, an Initial of
    the wrong size, a short header for a connection ID nobody owns. Both endpoints drop
    them; the connection keeps working and the server accepts another one."""
    echoes: list[Echo] = []

    def factory() -> Echo:
        echoes.append(Echo())
        return echoes[-1]

    server = await serve("127.0.0.1", 0, factory, TransportConfig(
        certificate_pem=cert.cert_pem, private_key_pem=cert.key_pem, backend=server_backend(),
        max_datagram_size=1452))
    attacker = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    attacker.bind(("127.0.0.1", 0))
    try:
        mine = Echo(echo=False)
        conn = await within(connect(f"moqt://127.0.0.1:{server.port}/", lambda: mine,
                                    TransportConfig(ca_data=cert.cert_pem,
                                                    max_datagram_size=1452)))
        assert conn.udp is not None  # type: ignore[attr-defined]
        client_port = conn.udp.get_extra_info("sockname")[1]  # type: ignore[attr-defined]
        junk = [b"", b"\x00", os.urandom(20), os.urandom(1200), os.urandom(65000),
                b"\xc0\x0a\x0a\x0a\x0a" + os.urandom(1195),  # long header, unknown version
                b"\xc0\x00\x00\x00\x01\x08" + os.urandom(100),  # a v1 Initial, too short
                b"\xc0\x00\x00\x00\x01" + b"\xff" * 1300,  # v1, CID length 255: malformed
                b"\x40" + os.urandom(1300)]  # short header, unknown connection ID
        for target in (server.port, client_port):
            for data in junk:
                attacker.sendto(data, ("127.0.0.1", target))
        # The same path is still good: ordinary traffic after the junk goes through.
        sid = conn.open_bidi()
        body = os.urandom(256 * 1024)
        await within(conn.write(sid, body, end_stream=True))
        assert await within(mine.done(sid)) == body
        await within(conn.ping())
        # And a newcomer is served.
        second = Echo(echo=False)
        other = await within(connect(f"moqt://127.0.0.1:{server.port}/", lambda: second,
                                     TransportConfig(ca_data=cert.cert_pem,
                                                     max_datagram_size=1452)))
        sid2 = other.open_bidi()
        other.send(sid2, b"still here", end_stream=True)
        assert await within(second.done(sid2)) == b"still here"
        assert not conn.is_closed and len(server.connections) == 2
        await within(other.aclose())
        await within(conn.aclose())
    finally:
        attacker.close()
        server.close()
        await within(server.wait_closed())


def test_uvloop_bulk_transfer_does_not_spin_on_pacing_timers(cert):
    """The 1200-byte anomaly (docs/transport.md): on uvloop, whose clock advances in whole
    milliseconds, a pacing deadline inside the current millisecond used to fire, find the
    time unchanged, send nothing and re-arm, over and over (about 45 timer callbacks per
    packet in a 32 MiB transfer). Count the engine's timer callbacks that sent nothing."""
    uvloop = pytest.importorskip("uvloop")
    from kvsp_moq.transport import engine

    stats = {"timers": 0, "empty": 0}
    real_on_timer = engine.EngineProtocol._on_timer

    def counting_on_timer(self) -> None:
        before = self._transport.packets_sent if self._transport else 0
        real_on_timer(self)
        stats["timers"] += 1
        if self._transport is not None and self._transport.packets_sent == before:
            stats["empty"] += 1

    async def main() -> int:
        assert isinstance(asyncio.get_running_loop(), uvloop.Loop)
        sink = hashlib.sha256()
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        class Sink(BaseConnectionHandler):
            def stream_data(self, stream_id, data, end_stream):
                sink.update(data)
                if end_stream:
                    done.set_result(None)

        server = await serve("127.0.0.1", 0, Sink, TransportConfig(
            certificate_pem=cert.cert_pem, private_key_pem=cert.key_pem,
            backend=server_backend()))
        try:
            conn = await within(connect(f"moqt://127.0.0.1:{server.port}/",
                                        BaseConnectionHandler,
                                        TransportConfig(ca_data=cert.cert_pem)))
            body = os.urandom(8 * MiB)
            sid = conn.open_uni()
            await within(conn.write(sid, body, end_stream=True))
            await within(done)
            assert sink.digest() == hashlib.sha256(body).digest()
            packets = conn.udp.packets_sent  # type: ignore[attr-defined]
            await within(conn.aclose())
            return packets
        finally:
            server.close()
            await within(server.wait_closed())

    engine.EngineProtocol._on_timer = counting_on_timer  # type: ignore[method-assign]
    loop = new_event_loop(use_uvloop=True)
    try:
        packets = loop.run_until_complete(main())
    finally:
        loop.close()
        engine.EngineProtocol._on_timer = real_on_timer  # type: ignore[method-assign]
    assert packets > 8 * MiB // 1200
    # Without the fix: tens of empty timer callbacks per packet. With it, a few per hundred.
    assert stats["empty"] < packets, stats


# -- receive bursts (udp.py): a server socket yields to the loop after SERVER_RECV_BURST_OCTETS


class _Counting(asyncio.DatagramProtocol):
    """Counts datagrams, and how many had come when the loop first ran something else."""

    def __init__(self) -> None:
        self.received = 0
        self.at_first_yield: int | None = None
        self.first_yield = asyncio.get_running_loop().create_future()
        self.all_in = asyncio.get_running_loop().create_future()

    def datagram_received(self, data: bytes, addr: object) -> None:
        self.received += 1
        if self.received == 1:
            asyncio.get_running_loop().call_soon(self._yielded)
        if self.received == 48:
            self.all_in.set_result(None)

    def _yielded(self) -> None:
        self.at_first_yield = self.received
        self.first_yield.set_result(None)


@pytest.mark.parametrize("burst_octets, expected", [(None, 48), ("server", 32)])
async def test_a_server_socket_yields_to_the_loop_after_its_burst_octets(burst_octets, expected):
    """48 datagrams of 16 KiB wait in the socket before its endpoint starts. A client endpoint
    reads them all in one readiness callback (RECV_BURST reads). A server endpoint stops after
    SERVER_RECV_BURST_OCTETS (32 of them) so that the loop runs its other connections'
    transmissions in between; the rest come on the next passes."""
    from kvsp_moq.transport.endpoints import _set_udp_buffers
    from kvsp_moq.transport.udp import RECV_BURST, SERVER_RECV_BURST_OCTETS, open_endpoint

    size = 16384
    assert SERVER_RECV_BURST_OCTETS == 32 * size and RECV_BURST >= 48
    rx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    _set_udp_buffers(rx, 4 << 20)  # as the endpoints do: room for the 48 datagrams (768 KiB)
    assert rx.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF) >= 2 << 20
    rx.bind(("127.0.0.1", 0))
    rx.setblocking(False)
    tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        for i in range(48):
            tx.sendto(bytes([i]) * size, rx.getsockname())
        protocol = _Counting()
        endpoint = await open_endpoint(rx, protocol, gso=False, gro=False,
                                       burst_octets=SERVER_RECV_BURST_OCTETS if burst_octets else None)
        try:
            await asyncio.wait_for(protocol.first_yield, 10)
            assert protocol.at_first_yield == expected
            await asyncio.wait_for(protocol.all_in, 10)  # the rest, on the loop's next passes
        finally:
            endpoint.close()
    finally:
        tx.close()
