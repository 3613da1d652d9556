"""The one implementation of :mod:`kvsp_moq.transport.api` on a sans-IO QUIC connection
(aioquic's API; the library is a :class:`~.library.QuicLibrary`): :class:`EngineProtocol`
does the I/O, timers and events of one connection, :class:`EngineConnection` is the
:class:`~.api.Connection` handle. ``endpoints.py`` makes them (client ``connect``, server).

Why not the libraries' own ``QuicConnectionProtocol``: :class:`EngineProtocol` replaces it
to (1) send each transmission's packets in one batch through :mod:`.udp` (GSO), (2) defer
the transmission after a received packet to the end of the receive burst (one ACK for many
packets), and (3) keep QUIC time on a high-resolution clock, with timers due within the
loop's sleep granularity run on the next pass. (3) fixes a throughput collapse on uvloop,
whose ``loop.time()`` only advances once per millisecond: aioquic's protocol passes
``loop.time()`` to the pacer, so a pacing timer due within the current millisecond fires at
once, finds "now" unchanged, sends nothing and re-arms itself — the loop spins (a million
empty timer callbacks for a 32 MiB transfer) — and RTT samples are quantised to 0 or 1 ms.
See docs/transport.md, "The 1200-byte anomaly". This module imports no QUIC library.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .api import (
    Address,
    CloseInfo,
    ConnectError,
    Connection,
    ConnectionClosedError,
    ConnectionHandler,
    HandlerFactory,
    StreamClosedError,
    is_locally_initiated,
    is_unidirectional,
)
from .config import TransportConfig
from .udp import UdpEndpoint
from .url import MoqtUrl

if TYPE_CHECKING:  # pragma: no cover
    from .library import QuicLibrary

__all__ = ["EngineConnection", "EngineProtocol"]

logger = logging.getLogger(__name__)

_AEAD_TAG_SIZE = 16  # every QUIC v1/v2 AEAD (AES-GCM, ChaCha20-Poly1305)
_MAX_CID_LENGTH = 20  # RFC 9000 §17.2
_CRYPTO_ERROR = 0x100  # RFC 9000 §20.1: 0x0100-0x01ff carry a TLS alert
_NO_APPLICATION_PROTOCOL = _CRYPTO_ERROR + 120  # RFC 8446 alert no_application_protocol
#: Timers due sooner than this run on the next loop pass instead of sleeping (seconds). The
#: loops sleep in whole milliseconds; a longer pacing gap may oversleep, since the pacer's
#: bucket (up to 16 packets) then covers more than the millisecond lost.
_TIMER_GRANULARITY = 2.5e-4

_DATAGRAM_MISSING_REASON = (
    "peer did not negotiate the QUIC DATAGRAM extension (RFC 9221 max_datagram_frame_size "
    "transport parameter), which MOQT requires")


# ------------------------------------------------------------------------------------------
# helpers


def _varint_size(n: int) -> int:
    return 1 if n < 0x40 else 2 if n < 0x4000 else 4 if n < 0x40000000 else 8


def _max_payload(room: int) -> int:
    """Largest n with n + varint_size(n) <= room."""
    best = 0
    for size in (1, 2, 4, 8):
        n = room - size
        if n >= 0 and _varint_size(n) <= size:
            best = max(best, n)
    return best


def _fit_reason(reason: str, limit: int = 1024) -> str:
    """A reason phrase of at most ``limit`` UTF-8 bytes, so CONNECTION_CLOSE fits a packet
    (MOQT also caps reason phrases at 1024 bytes)."""
    raw = reason.encode("utf-8")
    return reason if len(raw) <= limit else raw[:limit].decode("utf-8", "ignore")


def _plain_address(addr: Any) -> Address:
    host, port = addr[0], addr[1]
    if host.startswith("::ffff:") and "." in host:
        host = host[7:]
    return host, port


def _clock_for(loop: asyncio.AbstractEventLoop) -> Callable[[], float]:
    """The QUIC clock: ``time.monotonic`` (ns resolution) when it shares the loop clock's
    epoch, as it does for asyncio and uvloop (both CLOCK_MONOTONIC), so timers set with
    ``loop.call_at`` fire at QUIC times; else the loop's own clock."""
    return time.monotonic if abs(loop.time() - time.monotonic()) < 0.05 else loop.time


# ------------------------------------------------------------------------------------------
# the per-connection protocol: I/O, timers, events


class EngineProtocol(asyncio.DatagramProtocol):
    """Drives one ``QuicConnection``: feeds it datagrams, sends what it produces in batches,
    runs its timer, and hands its events to the :class:`EngineConnection`. Also what a
    library's ``QuicServer`` expects of ``create_protocol`` (the three ``_connection_id_*``
    hooks it sets)."""

    def __init__(self, quic: Any, conn: EngineConnection) -> None:
        self._quic = quic
        self._conn = conn
        self._events = conn._library.events
        self._loop = conn._loop
        self._clock = _clock_for(self._loop)
        self._transport: UdpEndpoint | None = None
        self._timer: asyncio.Handle | None = None
        self._timer_at: float | None = None
        self._transmit_handle: asyncio.Handle | None = None
        self._ping_waiters: dict[int, asyncio.Future[None]] = {}
        self._connection_id_issued_handler: Callable[[bytes], None] = lambda cid: None
        self._connection_id_retired_handler: Callable[[bytes], None] = lambda cid: None
        self._connection_terminated_handler: Callable[[], None] = lambda: None
        conn._protocol = self

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]

    def connect(self, addr: Any) -> None:
        self._quic.connect(addr, now=self._clock())
        self.transmit()

    def datagram_received(self, data: bytes, addr: Any) -> None:
        self._conn._peer = addr
        self._quic.receive_datagram(data, addr, now=self._clock())
        self._process_events()
        # Answer after the receive burst: one transmission (one ACK) for all its packets.
        self.transmit_soon()
        self._conn._after_io()

    def datagrams_received(self, datagrams: list[bytes], addr: Any) -> None:
        """A receive burst's packets from one address, fed in one library call where the
        library has one (qh3's ``receive_many_datagrams``: one pass into its Rust core)."""
        self._conn._peer = addr
        self._conn._library.receive_many(self._quic, datagrams, addr, self._clock())
        self._process_events()
        self.transmit_soon()
        self._conn._after_io()

    def error_received(self, exc: Exception) -> None:
        logger.debug("UDP error on %s: %s", self._conn, exc)

    def transmit_soon(self) -> None:
        if self._transmit_handle is None:
            self._transmit_handle = self._loop.call_soon(self.transmit)

    def transmit(self, now: float | None = None) -> None:
        """Send what the connection has to send, in one batch, and re-arm the timer."""
        if self._transmit_handle is not None:
            self._transmit_handle.cancel()
            self._transmit_handle = None
        quic = self._quic
        try:
            packets = quic.datagrams_to_send(now=self._clock() if now is None else now)
        except self._conn._library.transmit_errors as exc:
            logger.debug("%s: no transmission this time: %s", self._conn, exc)
            packets = []
        if packets and self._transport is not None:
            self._transport.send_packets(packets)
        timer_at = quic.get_timer()
        if self._timer is not None and self._timer_at != timer_at:
            self._timer.cancel()
            self._timer = None
        if self._timer is None and timer_at is not None:
            if timer_at - self._clock() < _TIMER_GRANULARITY:
                # Far sooner than the loop can sleep (epoll and uvloop count in whole
                # milliseconds): a pacing gap of microseconds would cost a millisecond and
                # cap the rate at one pacer burst per millisecond. Check on the next pass.
                self._timer = self._loop.call_soon(self._on_timer)
            else:
                self._timer = self._loop.call_at(timer_at, self._on_timer)
        self._timer_at = timer_at

    def _on_timer(self) -> None:
        # Always the true time, never the deadline: QUIC time must not run ahead of the
        # clock (qh3's core closes the connection with InvalidTime if it goes backwards),
        # and the pacer must credit what really elapsed. A timer the loop ran early
        # re-arms itself for the next pass (see transmit), so it never spins on a clock
        # that does not move (the uvloop anomaly: docs/transport.md).
        now = self._clock()
        self._timer = None
        self._timer_at = None
        self._quic.handle_timer(now=now)
        self._process_events()
        self.transmit(now)
        self._conn._after_io()

    def _process_events(self) -> None:
        ev = self._events
        quic = self._quic
        event = quic.next_event()
        while event is not None:
            if isinstance(event, ev.ConnectionIdIssued):
                self._connection_id_issued_handler(event.connection_id)
            elif isinstance(event, ev.ConnectionIdRetired):
                self._connection_id_retired_handler(event.connection_id)
            elif isinstance(event, ev.PingAcknowledged):
                waiter = self._ping_waiters.pop(event.uid, None)
                if waiter is not None and not waiter.done():
                    waiter.set_result(None)
            elif isinstance(event, ev.ConnectionTerminated):
                self._connection_terminated_handler()
                for waiter in self._ping_waiters.values():
                    if not waiter.done():
                        waiter.set_exception(ConnectionError("connection terminated"))
                self._ping_waiters.clear()
                if self._timer is not None:
                    self._timer.cancel()
                    self._timer = None
            self._conn._on_event(event)
            event = quic.next_event()

    async def ping(self) -> None:
        waiter: asyncio.Future[None] = self._loop.create_future()
        uid = id(waiter)
        self._ping_waiters[uid] = waiter
        self._quic.send_ping(uid)
        self.transmit()
        await asyncio.shield(waiter)


# ------------------------------------------------------------------------------------------
# the connection handle


class EngineConnection(Connection):
    """A :class:`~kvsp_moq.transport.api.Connection` on a library's ``QuicConnection``."""

    def __init__(self, *, library: QuicLibrary, quic: Any, config: TransportConfig,
                 handler_factory: HandlerFactory, url: MoqtUrl | None,
                 on_terminated: Callable[[EngineConnection], None] | None = None) -> None:
        self._library = library
        self._loop = asyncio.get_running_loop()
        self._quic = quic
        self._config = config
        self._factory = handler_factory
        self._url = url
        self._on_terminated_cb = on_terminated
        self._protocol: EngineProtocol | None = None
        self._handler: ConnectionHandler | None = None
        self._pending: list[Any] | None = []
        self._alpn: str | None = None
        self._peer: Any = None
        self._close_info: CloseInfo | None = None
        self._lost_notified = False
        self._terminated: asyncio.Future[CloseInfo] = self._loop.create_future()
        self._established: asyncio.Future[None] | None = (
            self._loop.create_future() if quic.configuration.is_client else None)
        self._waiters: dict[int, list[tuple[int, asyncio.Future[None]]]] = {}
        self._send_closed: dict[int, int] = {}  # stream -> reset / STOP_SENDING code
        self._high = config.send_buffer_high_water
        self._low = config.low_water
        ev = library.events
        self._data_events = (ev.StreamDataReceived, ev.StreamReset, ev.StopSendingReceived,
                             ev.DatagramFrameReceived)

    # -- identity ---------------------------------------------------------------------------
    @property
    def backend(self) -> str:
        """The name of the QUIC library behind this connection."""
        return self._library.name

    @property
    def alpn(self) -> str:
        if self._alpn is None:
            raise RuntimeError("handshake not complete")
        return self._alpn

    @property
    def is_client(self) -> bool:
        return bool(self._quic.configuration.is_client)

    @property
    def remote_address(self) -> Address:
        if self._peer is None:
            raise RuntimeError("no peer address yet")
        return _plain_address(self._peer)

    @property
    def url(self) -> MoqtUrl | None:
        return self._url

    @property
    def max_datagram_payload(self) -> int:
        # RFC 9000 §17.3.1 short header (1 + DCID + packet number), AEAD tag, and the
        # DATAGRAM frame type and length (RFC 9221 §4).
        room = (self._config.max_datagram_size
                - (1 + _MAX_CID_LENGTH + self._library.packet_number_size)
                - _AEAD_TAG_SIZE - 1)
        limit = _max_payload(room)
        peer = self._library.peer_max_datagram_frame_size(self._quic)
        if not peer:
            return 0
        # aioquic (up to 1.7.2) rejects a frame whose size *equals* the limit: stay below it.
        return max(0, min(limit, _max_payload(peer - 2)))

    @property
    def close_info(self) -> CloseInfo | None:
        return self._close_info

    @property
    def send_buffer_high_water(self) -> int:
        return self._high

    @property
    def handler(self) -> ConnectionHandler | None:
        """The upper layer's handler (None until established)."""
        return self._handler

    @property
    def udp(self) -> UdpEndpoint | None:
        """The UDP endpoint under this connection (shared by a server's connections)."""
        return None if self._protocol is None else self._protocol._transport

    def __repr__(self) -> str:
        side = "client" if self.is_client else "server"
        state = "closed" if self._close_info else "open" if self._handler else "handshake"
        return f"<{self._library.name} connection {side} {self._alpn or '-'} {state}>"

    # -- streams ----------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._close_info is not None:
            raise ConnectionClosedError(self._close_info)

    def open_bidi(self) -> int:
        self._check_open()
        return self._library.open_stream(self._quic, False)

    def open_uni(self) -> int:
        self._check_open()
        return self._library.open_stream(self._quic, True)

    def _check_sendable(self, stream_id: int) -> None:
        self._check_direction(stream_id)
        code = self._send_closed.get(stream_id)
        if code is not None:
            raise StreamClosedError(stream_id, code)

    def send(self, stream_id: int, data: bytes | bytearray | memoryview,
             end_stream: bool = False) -> None:
        self._check_open()
        self._check_sendable(stream_id)
        if isinstance(data, memoryview) and (data.ndim != 1 or data.itemsize != 1):
            data = data.cast("B")
        try:
            self._quic.send_stream_data(stream_id, data, end_stream)
        except self._library.stream_errors as exc:  # after FIN, or a stream it refuses
            raise StreamClosedError(stream_id, None, f"stream {stream_id}: {exc}") from None
        self._transmit_soon()

    def reset_stream(self, stream_id: int, error_code: int) -> None:
        self._check_open()
        self._check_direction(stream_id)
        if stream_id in self._send_closed:
            return
        self._send_closed[stream_id] = error_code
        try:
            self._quic.reset_stream(stream_id, error_code)
        except self._library.stream_errors:
            pass  # already finished and acknowledged: nothing to abandon
        self._fail_waiters(stream_id, StreamClosedError(stream_id, error_code,
                                                         f"stream {stream_id} was reset"))
        self._transmit_soon()

    def _check_direction(self, stream_id: int) -> None:
        if is_unidirectional(stream_id) and not is_locally_initiated(stream_id, self.is_client):
            raise ValueError(f"stream {stream_id} is the peer's unidirectional stream")

    def stop_sending(self, stream_id: int, error_code: int) -> None:
        self._check_open()
        if is_unidirectional(stream_id) and is_locally_initiated(stream_id, self.is_client):
            raise ValueError(f"stream {stream_id} is our send-only stream")
        if not self._library.has_stream(self._quic, stream_id):
            return  # finished and discarded, or never seen: nothing to stop
        try:
            self._quic.stop_stream(stream_id, error_code)
        except self._library.stream_errors:
            return
        self._transmit_soon()

    # -- backpressure -----------------------------------------------------------------------
    def stream_send_buffered(self, stream_id: int) -> int:
        if stream_id in self._send_closed:
            return 0
        return self._library.stream_buffered(self._quic, stream_id)

    async def drain(self) -> None:
        await self.wait_writable(_DRAIN, 0)

    def _buffered(self, key: int) -> int:
        if key == _DRAIN:
            return self._library.unacknowledged(self._quic)
        return self.stream_send_buffered(key)

    async def wait_writable(self, stream_id: int, threshold: int | None = None) -> None:
        self._check_open()
        limit = self._low if threshold is None else threshold
        code = self._send_closed.get(stream_id)
        if code is not None:
            raise StreamClosedError(stream_id, code)
        if self._buffered(stream_id) <= limit:
            return
        fut: asyncio.Future[None] = self._loop.create_future()
        entry = (limit, fut)
        self._waiters.setdefault(stream_id, []).append(entry)
        try:
            await fut
        finally:
            waiters = self._waiters.get(stream_id)
            if waiters is not None and entry in waiters:
                waiters.remove(entry)
                if not waiters:
                    del self._waiters[stream_id]

    def _check_waiters(self) -> None:
        for stream_id in list(self._waiters):
            buffered = self._buffered(stream_id)
            keep = []
            for limit, fut in self._waiters[stream_id]:
                if fut.done():
                    continue
                if buffered <= limit:
                    fut.set_result(None)
                else:
                    keep.append((limit, fut))
            if keep:
                self._waiters[stream_id] = keep
            else:
                del self._waiters[stream_id]

    def _fail_waiters(self, stream_id: int | None, exc: Exception) -> None:
        ids = list(self._waiters) if stream_id is None else [stream_id]
        for sid in ids:
            for _, fut in self._waiters.pop(sid, ()):
                if not fut.done():
                    fut.set_exception(exc)

    # -- datagrams --------------------------------------------------------------------------
    def send_datagram(self, data: bytes | bytearray | memoryview) -> None:
        self._check_open()
        limit = self.max_datagram_payload
        if len(data) > limit:
            raise ValueError(f"datagram of {len(data)} bytes exceeds max_datagram_payload "
                             f"{limit}")
        # The library queues the object until a packet is built: hand it bytes it owns.
        self._quic.send_datagram_frame(data if isinstance(data, bytes) else bytes(data))
        self._transmit_soon()

    # -- lifetime ---------------------------------------------------------------------------
    def close(self, error_code: int = 0, reason: str = "") -> None:
        if self._close_info is not None:
            return
        reason = _fit_reason(reason)
        self._quic.close(error_code=error_code, reason_phrase=reason)
        self._mark_closed(CloseInfo(error_code, reason, application=True, local=True),
                          notify_soon=True)
        if self._protocol is not None:
            self._protocol.transmit()

    async def wait_closed(self) -> CloseInfo:
        return await asyncio.shield(self._terminated)

    async def ping(self) -> None:
        self._check_open()
        assert self._protocol is not None
        try:
            await self._protocol.ping()
        except ConnectionError:
            raise ConnectionClosedError(self._close_info or CloseInfo(
                0, "connection closed", application=False, local=False)) from None

    def _transmit_soon(self) -> None:
        if self._protocol is not None:
            self._protocol.transmit_soon()

    # -- events -----------------------------------------------------------------------------
    def _on_event(self, event: Any) -> None:
        ev = self._library.events
        handler = self._handler
        if handler is not None and self._close_info is None:
            if isinstance(event, ev.StreamDataReceived):
                self._call("stream_data", event.stream_id, event.data, event.end_stream)
            elif isinstance(event, ev.DatagramFrameReceived):
                self._call("datagram_received", event.data)
            elif isinstance(event, ev.StreamReset):
                self._call("stream_reset", event.stream_id, event.error_code)
            elif isinstance(event, ev.StopSendingReceived):
                self._on_stop_sending(event.stream_id, event.error_code)
        if isinstance(event, self._data_events):
            if handler is None and self._pending is not None:
                self._pending.append(event)  # before the handshake completed (rare)
        elif isinstance(event, ev.HandshakeCompleted):
            self._on_handshake(event)
        elif isinstance(event, ev.ConnectionTerminated):
            self._on_terminated(event)

    def _on_stop_sending(self, stream_id: int, error_code: int) -> None:
        # RFC 9000 §3.5: answer STOP_SENDING with RESET_STREAM carrying the same code.
        if stream_id not in self._send_closed:
            self._send_closed[stream_id] = error_code
            self._library.after_stop_sending(self._quic, stream_id, error_code)
            self._transmit_soon()
        self._fail_waiters(stream_id, StreamClosedError(
            stream_id, error_code, f"peer sent STOP_SENDING on stream {stream_id}"))
        self._call("stop_sending", stream_id, error_code)

    def _on_handshake(self, event: Any) -> None:
        if self._close_info is not None:
            return
        alpn = event.alpn_protocol
        if alpn is None:  # cannot happen with ALPN configured; be explicit anyway
            self._reject(0x178, "no ALPN protocol negotiated")
            return
        if self._config.datagrams and not self._library.peer_max_datagram_frame_size(
                self._quic):
            self._reject(self._config.datagram_required_error_code, _DATAGRAM_MISSING_REASON)
            return
        self._alpn = alpn
        try:
            handler = self._factory()
        except Exception:
            logger.exception("handler factory failed")
            self._reject(self._config.internal_error_code, "internal error: no handler")
            return
        self._handler = handler
        if self._established is not None and not self._established.done():
            self._established.set_result(None)
        self._call("connection_made", self, alpn)
        pending, self._pending = self._pending or [], None
        for queued in pending:
            self._on_event(queued)

    def _reject(self, error_code: int, reason: str) -> None:
        logger.info("closing %s during setup: %s", self, reason)
        reason = _fit_reason(reason)
        self._quic.close(error_code=error_code, reason_phrase=reason)
        self._mark_closed(CloseInfo(error_code, reason, application=True, local=True))
        self._transmit_soon()

    def _call(self, name: str, *args: Any) -> None:
        try:
            getattr(self._handler, name)(*args)
        except Exception as exc:
            logger.exception("%s.%s raised; closing the connection",
                             type(self._handler).__name__, name)
            if self._close_info is None:
                self.close(self._config.internal_error_code,
                           f"internal error in {name}: {type(exc).__name__}")

    def _after_io(self) -> None:
        if self._close_info is None:
            pending = self._library.pending_close(self._quic)
            if pending is not None:
                event, local = pending
                self._mark_closed(CloseInfo(event.error_code, event.reason_phrase,
                                            application=event.frame_type is None, local=local))
        if self._waiters:
            self._check_waiters()

    def _mark_closed(self, info: CloseInfo, *, notify_soon: bool = False) -> None:
        if self._close_info is not None:
            return
        self._close_info = info
        self._pending = None
        self._fail_waiters(None, ConnectionClosedError(info))
        if self._established is not None and not self._established.done():
            self._established.set_exception(_connect_error(info, self._config))
            self._established.exception()  # connect() may have given up: no "never retrieved"
        if self._handler is not None:
            if notify_soon:
                self._loop.call_soon(self._notify_lost)
            else:
                self._notify_lost()

    def _notify_lost(self) -> None:
        if self._lost_notified or self._handler is None or self._close_info is None:
            return
        self._lost_notified = True
        info = self._close_info
        try:
            self._handler.connection_lost(info.error_code, info.reason)
        except Exception:
            logger.exception("%s.connection_lost raised", type(self._handler).__name__)

    def _on_terminated(self, event: Any) -> None:
        if self._close_info is None:
            # A peer's close was seen in _after_io already; what is left began here (idle
            # timeout, an error the library detected while handling a timer).
            self._mark_closed(CloseInfo(event.error_code, event.reason_phrase,
                                        application=event.frame_type is None, local=True))
        assert self._close_info is not None
        if not self._terminated.done():
            self._terminated.set_result(self._close_info)
        if self._on_terminated_cb is not None:
            self._on_terminated_cb(self)


_DRAIN = -1  # waiter key for "every stream acknowledged" (no stream has a negative ID)


def _connect_error(info: CloseInfo, config: TransportConfig) -> ConnectError:
    tls_alert = _CRYPTO_ERROR <= info.error_code <= _CRYPTO_ERROR + 0xFF and not info.application
    # RFC 9001 §8.1 asks for the no_application_protocol alert; qh3 (2.1) sends
    # handshake_failure with the reason "No common ALPN protocols".
    if tls_alert and (info.error_code == _NO_APPLICATION_PROTOCOL
                      or "alpn" in info.reason.lower()):
        what = (f"no common ALPN protocol: we offered {list(config.alpn_protocols)} "
                f"({info.reason or 'no_application_protocol'})")
    elif info.application and info.reason == _DATAGRAM_MISSING_REASON:
        what = (f"the server: {info.reason}" if info.local else
                f"the server closed the connection: {info.reason} (we are the peer)")
    elif tls_alert:
        what = f"TLS handshake failed: {info.reason or 'alert ' + str(info.error_code & 0xFF)}"
    else:
        what = f"connection closed during the handshake: {info}"
    return ConnectError(what, error_code=info.error_code, reason=info.reason)


