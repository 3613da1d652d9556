"""The native backend (``TransportConfig.backend = "native"``: ngtcp2 0.12 in our C extension)
where the shared transport suite does not reach it: the error where the extension is not
built, ngtcp2's congestion controllers by name, the counters of ``congestion_state``, PING
against a live and a silent peer, STOP_SENDING where ngtcp2 0.12 can report it (what
``_transport_backends.NATIVE_SKIPS`` leaves out), streams opened beyond the peer's limit,
SO_REUSEPORT, the fields it refuses, and that closing leaves no thread, socket or eventfd
behind. Real QUIC over 127.0.0.1; nothing sleeps to wait for a condition (``within`` is a
safety net against hangs)."""

from __future__ import annotations

import asyncio
import hashlib
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from kvsp_moq.transport import (
    BaseConnectionHandler,
    Connection,
    ConnectionClosedError,
    Server,
    StreamClosedError,
    TransportConfig,
    available_backends,
    connect,
    is_unidirectional,
    serve,
)
from kvsp_moq.transport import native
from kvsp_moq.transport.tls import SelfSignedCert, make_self_signed

pytestmark = pytest.mark.skipif(not native.available(), reason=native.unavailable_reason() or "")

MiB = 1 << 20
GUARD = 30.0  # a safety net against hangs, never a way to wait for something
#: The server backends a native client is checked against (those installed).
PEERS = [b for b in ("native", "aioquic", "qh3") if b in available_backends()]


async def within(aw: Any, timeout: float = GUARD) -> Any:
    return await asyncio.wait_for(aw, timeout)


@pytest.fixture(scope="module")
def cert() -> SelfSignedCert:
    return make_self_signed()


class Recorder(BaseConnectionHandler):
    """Records stream bytes, STOP_SENDINGs and the end; ``stop_on_data`` sends STOP_SENDING
    with that code on each peer stream at its first bytes; ``echo_fin`` answers a FIN with
    one on a bidirectional stream."""

    def __init__(self, stop_on_data: int | None = None, echo_fin: bool = False) -> None:
        loop = asyncio.get_running_loop()
        self.stop_on_data = stop_on_data
        self.echo_fin = echo_fin
        self.data: dict[int, bytearray] = {}
        self.ended: dict[int, asyncio.Future[bytes]] = {}
        self.stops: asyncio.Queue[tuple[int, int]] = asyncio.Queue()
        self.made: asyncio.Future[Connection] = loop.create_future()

    def connection_made(self, conn: Connection, alpn: str) -> None:
        super().connection_made(conn, alpn)
        self.made.set_result(conn)

    def done(self, stream_id: int) -> asyncio.Future[bytes]:
        if stream_id not in self.ended:
            self.ended[stream_id] = asyncio.get_running_loop().create_future()
        return self.ended[stream_id]

    def stream_data(self, stream_id: int, data: bytes | memoryview, end_stream: bool) -> None:
        first = stream_id not in self.data
        self.data.setdefault(stream_id, bytearray()).extend(data)
        assert self.conn is not None
        if first and self.stop_on_data is not None:
            self.conn.stop_sending(stream_id, self.stop_on_data)
        if end_stream:
            self.done(stream_id).set_result(bytes(self.data[stream_id]))
            if self.echo_fin and not is_unidirectional(stream_id):
                self.conn.send(stream_id, b"", end_stream=True)

    def stop_sending(self, stream_id: int, error_code: int) -> None:
        self.stops.put_nowait((stream_id, error_code))


class Server1:
    """A server of ``backend`` whose first handler is kept."""

    def __init__(self, backend: str, **handler_kw: Any) -> None:
        self.backend = backend
        self.handler_kw = handler_kw
        self.handlers: list[Recorder] = []
        self.server: Server | None = None
        self.first: asyncio.Future[Recorder] = asyncio.get_running_loop().create_future()

    def factory(self) -> Recorder:
        self.handlers.append(Recorder(**self.handler_kw))
        if not self.first.done():
            self.first.set_result(self.handlers[-1])
        return self.handlers[-1]

    async def handler(self) -> Recorder:
        """The first connection's handler, once its handshake completed on the server."""
        return await within(self.first)

    async def __aenter__(self) -> Server1:
        return self

    async def start(self, cert: SelfSignedCert, **kw: Any) -> Server:
        self.server = await serve("127.0.0.1", 0, self.factory, TransportConfig(
            backend=self.backend, certificate_pem=cert.cert_pem, private_key_pem=cert.key_pem,
            **kw))
        return self.server

    async def __aexit__(self, *exc: object) -> None:
        if self.server is not None:
            self.server.close()
            await within(self.server.wait_closed())


async def dial(port: int, cert: SelfSignedCert, handler: Recorder | None = None,
               **kw: Any) -> tuple[Connection, Recorder]:
    handler = handler or Recorder()
    conn = await within(connect(f"moqt://127.0.0.1:{port}/", lambda: handler,
                                TransportConfig(backend="native", ca_data=cert.cert_pem, **kw)))
    return conn, handler


# ------------------------------------------------------------------------------------------
# where the extension is not built


def test_unbuilt_extension_is_named_with_its_packages() -> None:
    """With the extension made unimportable (as where setup.py could not build it), "native"
    is no backend, and asking for it fails with a BackendUnavailableError (also a ValueError,
    as TransportConfig's other refusals) naming the Debian packages and the reinstall."""
    code = textwrap.dedent("""
        import sys
        sys.modules["kvsp_moq.transport.native._ngtcp2"] = None
        from kvsp_moq.transport import (BACKENDS, BackendUnavailableError, TransportConfig,
                                        available_backends, load_backend)
        assert "native" not in BACKENDS and "native" not in available_backends()
        for ask in (lambda: TransportConfig(backend="native"), lambda: load_backend("native")):
            try:
                ask()
            except BackendUnavailableError as exc:
                assert isinstance(exc, ImportError) and isinstance(exc, ValueError)
                assert exc.backend == "native"
                print(exc)
            else:
                raise SystemExit("no error")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert len(lines) == 2
    for line in lines:
        assert "libngtcp2-dev libngtcp2-crypto-gnutls-dev libgnutls28-dev" in line
        assert "pip install -e ." in line and "'native'" in line


# ------------------------------------------------------------------------------------------
# configuration


@pytest.mark.parametrize("name", ["reno", "cubic", "bbr", "bbr2", None])
async def test_congestion_controllers_by_name_and_their_counters(cert, name):
    """Each of ngtcp2's controllers carries 4 MiB (None: bbr); ``congestion_state`` names it
    and reports the extension's counters: bytes each way, window, RTTs, nothing in flight
    once everything is acknowledged."""
    async with Server1("native") as srv:
        server = await srv.start(cert, congestion_control_algorithm=name)
        conn, _ = await dial(server.port, cert, congestion_control_algorithm=name)
        body = os.urandom(4 * MiB)
        sid = conn.open_uni()
        await within(conn.write(sid, body, end_stream=True))
        peer = await srv.handler()
        assert hashlib.sha256(await within(peer.done(sid))).digest() == \
            hashlib.sha256(body).digest()
        await within(conn.drain())
        await within(conn.ping())
        state = conn.congestion_state()
        assert state is not None and state["algorithm"] == (name or "bbr")
        assert state["bytes_sent"] > len(body) and state["bytes_received"] > 0
        assert state["congestion_window"] > 0 and state["bytes_in_flight"] == 0
        assert 0 < state["min_rtt"] <= state["smoothed_rtt"] < 1
        assert state["packets_lost"] >= 0 and state["max_udp_payload"] == 1200
        assert peer.conn is not None
        peer_state = peer.conn.congestion_state()
        assert peer_state is not None and peer_state["bytes_received"] > len(body)
        await within(conn.aclose())
        assert conn.congestion_state() is None


async def test_fields_it_cannot_honour_are_refused(cert, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="congestion.*reno.*cubic.*bbr.*bbr2"):
        await connect("moqt://127.0.0.1:1", Recorder,
                      TransportConfig(backend="native", congestion_control_algorithm="bbr1"))
    for field, value in (("qlog_dir", tmp_path), ("keylog_file", tmp_path / "keys")):
        with pytest.raises(ValueError, match=field):
            await connect("moqt://127.0.0.1:1", Recorder,
                          TransportConfig(backend="native").replace(**{field: value}))
    with pytest.raises(ValueError, match="certificate"):
        await serve("127.0.0.1", 0, Recorder, TransportConfig(backend="native"))


async def test_two_servers_share_a_port_with_reuse_port(cert) -> None:
    async with Server1("native") as first:
        one = await first.start(cert, reuse_port=True)
        other = await serve("127.0.0.1", one.port, Recorder, TransportConfig(
            backend="native", certificate_pem=cert.cert_pem, private_key_pem=cert.key_pem,
            reuse_port=True))
        try:
            assert other.port == one.port
            conn, _ = await dial(one.port, cert)  # one of the two takes it
            await within(conn.aclose())
        finally:
            other.close()
            await within(other.wait_closed())
        with pytest.raises(OSError):  # without it, the port is taken
            await serve("127.0.0.1", one.port, Recorder, TransportConfig(
                backend="native", certificate_pem=cert.cert_pem,
                private_key_pem=cert.key_pem))


# ------------------------------------------------------------------------------------------
# PING


class _Relay(asyncio.DatagramProtocol):
    """A UDP relay between one client and a server that can go silent (``forward`` False):
    the peer then looks dead, as a killed process does."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.client: Any = None
        self.forward = True
        self.transport: Any = None

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def datagram_received(self, data: bytes, addr: Any) -> None:
        if not self.forward:
            return
        if addr == self.target:
            if self.client is not None:
                self.transport.sendto(data, self.client)
        else:
            self.client = addr
            self.transport.sendto(data, self.target)


@pytest.mark.parametrize("peer", PEERS)
async def test_ping_needs_an_answer_from_the_peer(cert, peer) -> None:
    """A PING is answered by a live peer, idle or while a transfer runs, and not by one that
    went silent; once it answers again, so does the next PING."""
    async with Server1(peer) as srv:
        server = await srv.start(cert)
        loop = asyncio.get_running_loop()
        transport, relay = await loop.create_datagram_endpoint(
            lambda: _Relay(("127.0.0.1", server.port)), local_addr=("127.0.0.1", 0))
        try:
            conn, _ = await dial(transport.get_extra_info("sockname")[1], cert)
            for _ in range(20):
                await within(conn.ping())
            sid = conn.open_uni()
            sending = asyncio.ensure_future(conn.write(sid, os.urandom(16 * MiB),
                                                       end_stream=True))
            while not sending.done():
                await within(conn.ping())
            await within(sending)
            relay.forward = False
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(conn.ping(), 0.5)
            relay.forward = True
            await within(conn.ping())
            await within(conn.aclose())
            with pytest.raises(ConnectionClosedError):
                await conn.ping()
        finally:
            transport.close()


# ------------------------------------------------------------------------------------------
# STOP_SENDING


@pytest.mark.parametrize("peer", PEERS)
async def test_stop_sending_on_a_uni_stream_reaches_the_native_sender(cert, peer) -> None:
    """What NATIVE_SKIPS leaves out of the shared STOP_SENDING test: on a unidirectional
    stream (MOQT's data streams) ngtcp2 0.12 reports the peer's STOP_SENDING once its
    RESET_STREAM is acknowledged: the handler hears it with the code, waiters fail, sends
    raise StreamClosedError and nothing stays buffered."""
    async with Server1(peer, stop_on_data=0x17) as srv:
        server = await srv.start(cert, max_stream_data=32 * 1024)
        conn, handler = await dial(server.port, cert)
        sid = conn.open_uni()
        conn.send(sid, bytes(4 * MiB))  # far more than the peer's window lets through
        writer = asyncio.ensure_future(conn.wait_writable(sid, threshold=0))
        assert await within(handler.stops.get()) == (sid, 0x17)
        # The waiter may have returned before: ngtcp2 dropped the stopped stream's bytes
        # (buffered 0) as it answered the STOP_SENDING, before the stream closed.
        try:
            await within(writer)
        except StreamClosedError as exc:
            assert exc.error_code == 0x17
        with pytest.raises(StreamClosedError) as info:
            await within(conn.wait_writable(sid, threshold=0))
        assert info.value.error_code == 0x17
        with pytest.raises(StreamClosedError):
            conn.send(sid, b"more")
        assert conn.stream_send_buffered(sid) == 0
        await within(conn.drain())  # a stopped stream counts as drained
        await within(conn.aclose())


# ------------------------------------------------------------------------------------------
# stream credit


@pytest.mark.parametrize("peer", [p for p in PEERS if p != "qh3"])  # qh3 grants 100 always
async def test_streams_beyond_the_peer_limit_wait_for_credit(cert, peer) -> None:
    """The server grants 4 bidirectional streams at once; the native client opens 12 at once
    (IDs in order, as if credit were there), writes on all, resets one of the waiting ones:
    as streams end, MAX_STREAMS lets the waiting ones open and their bytes follow."""
    async with Server1(peer, echo_fin=True) as srv:
        server = await srv.start(cert, max_streams_bidi=4)
        conn, handler = await dial(server.port, cert)
        sids = [conn.open_bidi() for _ in range(12)]
        assert sids == list(range(0, 48, 4))
        for i, sid in enumerate(sids):
            conn.send(sid, b"stream %d" % i, end_stream=i != 9)
        assert conn.stream_send_buffered(sids[11]) == len(b"stream 11")  # still waiting
        conn.reset_stream(sids[9], 0x9)  # a waiting stream, never opened: nothing to send
        assert conn.stream_send_buffered(sids[9]) == 0
        for i, sid in enumerate(sids):
            if i == 9:
                continue
            assert await within(handler.done(sid)) == b""  # the server's FIN back
        peer_handler = await srv.handler()
        assert {sid: bytes(peer_handler.data[sid]) for sid in sids if sid != sids[9]} == \
            {sid: b"stream %d" % i for i, sid in enumerate(sids) if i != 9}
        await within(conn.drain())
        await within(conn.aclose())


# ------------------------------------------------------------------------------------------
# nothing left behind


def _tasks_and_fds() -> tuple[int, int]:
    return len(os.listdir("/proc/self/task")), len(os.listdir("/proc/self/fd"))


async def test_close_leaves_no_thread_socket_or_eventfd(cert) -> None:
    """A server and three clients, each an endpoint with its network thread, UDP socket and
    two eventfds: after the clients' ``aclose`` and the server's ``wait_closed`` the process
    has no more threads or file descriptors than before (one round first, so that the
    resolver's executor threads exist already)."""

    async def round_trip() -> None:
        async with Server1("native", echo_fin=True) as srv:
            server = await srv.start(cert)
            conns = [(await dial(server.port, cert))[0] for _ in range(3)]
            for conn in conns:
                sid = conn.open_bidi()
                conn.send(sid, os.urandom(256 * 1024), end_stream=True)
            for conn in conns:
                await within(conn.drain())
            await within(asyncio.gather(*(c.aclose() for c in conns[:2])))
            # the third is still open when the server closes: closed by it
        await within(conns[2].wait_closed())

    await round_trip()
    tasks, fds = _tasks_and_fds()
    await round_trip()
    after_tasks, after_fds = _tasks_and_fds()
    assert after_tasks <= tasks and after_fds <= fds
