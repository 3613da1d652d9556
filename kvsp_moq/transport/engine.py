"""The one implementation of :mod:`kvsp_moq.transport.api` on a sans-IO QUIC connection
(aioquic's API; the library is a :class:`~.library.QuicLibrary`): :class:`EngineProtocol`
does the I/O, timers and events of one connection, :class:`EngineConnection` is the
:class:`~.api.Connection` handle. ``endpoints.py`` makes them (client ``connect``, server).
What the protocol calls on its connection (:meth:`EngineConnection.attach`,
:meth:`~EngineConnection.on_quic_event`, :meth:`~EngineConnection.after_io`,
``set_peer``, :attr:`~EngineConnection.library`) is transport-internal.

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
from typing import Any

from .api import (
    Address,
    CloseInfo,
    ConnectError,
    ConnectionClosedError,
    HandlerFactory,
    StreamClosedError,
)
from .config import TransportConfig
from .connection_core import (
    CRYPTO_ERROR,
    DATAGRAM_MISSING_REASON,
    NO_APPLICATION_PROTOCOL,
    ConnectionCore,
    datagram_payload_limit,
    plain_address,
)
from .library import QuicLibrary
from .udp import UdpEndpoint
from .url import MoqtUrl

__all__ = ["EngineConnection", "EngineProtocol"]

logger = logging.getLogger(__name__)

#: Timers due sooner than this run on the next loop pass instead of sleeping (seconds). The
#: loops sleep in whole milliseconds; a longer pacing gap may oversleep, since the pacer's
#: bucket (up to 16 packets) then covers more than the millisecond lost.
_TIMER_GRANULARITY = 2.5e-4


# ------------------------------------------------------------------------------------------
# helpers


def _fit_reason(reason: str, limit: int = 1024) -> str:
    """A reason phrase of at most ``limit`` UTF-8 bytes, so CONNECTION_CLOSE fits a packet
    (MOQT also caps reason phrases at 1024 bytes)."""
    raw = reason.encode("utf-8")
    return reason if len(raw) <= limit else raw[:limit].decode("utf-8", "ignore")


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
        self._library = conn.library
        self._events = self._library.events
        self._loop = conn.loop
        self._clock = _clock_for(self._loop)
        self._transport: UdpEndpoint | None = None
        self._timer: asyncio.Handle | None = None
        self._timer_at: float | None = None
        self._transmit_handle: asyncio.Handle | None = None
        self._ping_waiters: dict[int, asyncio.Future[None]] = {}
        self._connection_id_issued_handler: Callable[[bytes], None] = lambda cid: None
        self._connection_id_retired_handler: Callable[[bytes], None] = lambda cid: None
        self._connection_terminated_handler: Callable[[], None] = lambda: None
        self._library.prepare_connection(quic, conn.transport_config)
        conn.attach(self)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]

    @property
    def udp(self) -> UdpEndpoint | None:
        """The UDP endpoint this protocol sends on (None before ``connection_made``)."""
        return self._transport

    def connect(self, addr: Any) -> None:
        self._quic.connect(addr, now=self._clock())
        self.transmit()

    def datagram_received(self, data: bytes, addr: Any) -> None:
        self._conn.set_peer(addr)
        self._quic.receive_datagram(data, addr, now=self._clock())
        self._process_events()
        # Answer after the receive burst: one transmission (one ACK) for all its packets.
        self.transmit_soon()
        self._conn.after_io()

    def datagrams_received(self, datagrams: list[bytes], addr: Any) -> None:
        """A receive burst's packets from one address, fed in one library call where the
        library has one (qh3's ``receive_many_datagrams``: one pass into its Rust core)."""
        self._conn.set_peer(addr)
        self._library.receive_many(self._quic, datagrams, addr, self._clock())
        self._process_events()
        self.transmit_soon()
        self._conn.after_io()

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
        except self._library.transmit_errors as exc:
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
        self._conn.after_io()

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
            self._conn.on_quic_event(event)
            event = quic.next_event()

    async def ping(self) -> None:
        waiter: asyncio.Future[None] = self._loop.create_future()
        # A caller that stopped waiting (a liveness probe's deadline) leaves the waiter here;
        # its ConnectionError at termination is then nobody's: mark it retrieved.
        waiter.add_done_callback(lambda f: f.cancelled() or f.exception())
        uid = id(waiter)
        self._ping_waiters[uid] = waiter
        self._quic.send_ping(uid)
        self.transmit()
        await asyncio.shield(waiter)


# ------------------------------------------------------------------------------------------
# the connection handle


class EngineConnection(ConnectionCore):
    """A :class:`~kvsp_moq.transport.api.Connection` on a library's ``QuicConnection``; what
    does not depend on the library is :class:`~.connection_core.ConnectionCore`'s."""

    _log = logger

    def __init__(self, *, library: QuicLibrary, quic: Any, config: TransportConfig,
                 handler_factory: HandlerFactory, url: MoqtUrl | None,
                 on_terminated: Callable[[EngineConnection], None] | None = None) -> None:
        super().__init__(quic=quic, config=config, handler_factory=handler_factory, url=url,
                         on_ended=on_terminated)
        self._library = library
        self._protocol: EngineProtocol | None = None
        self._pending: list[Any] | None = []
        self._send_closed: dict[int, int] = {}  # stream -> reset / STOP_SENDING code
        ev = library.events
        self._data_events = (ev.StreamDataReceived, ev.StreamReset, ev.StopSendingReceived,
                             ev.DatagramFrameReceived)

    # -- identity ---------------------------------------------------------------------------
    @property
    def backend(self) -> str:
        """The name of the QUIC library behind this connection."""
        return self._library.name

    @property
    def library(self) -> QuicLibrary:
        """Transport-internal: the QUIC library behind this connection."""
        return self._library

    def attach(self, protocol: EngineProtocol) -> None:
        """Transport-internal: ``protocol`` drives this connection's ``QuicConnection``."""
        self._protocol = protocol

    def congestion_state(self) -> dict[str, Any] | None:
        return self._library.congestion_state(self._quic)

    def _address_of(self, peer: Any) -> Address:
        return plain_address(peer)

    @property
    def max_datagram_payload(self) -> int:
        return datagram_payload_limit(self._config.max_datagram_size,
                                      self._library.packet_number_size,
                                      self._library.peer_max_datagram_frame_size(self._quic))

    @property
    def udp(self) -> UdpEndpoint | None:
        """The UDP endpoint under this connection (shared by a server's connections)."""
        return None if self._protocol is None else self._protocol.udp

    # -- streams ----------------------------------------------------------------------------
    def _open_stream(self, unidirectional: bool) -> int:
        return self._library.open_stream(self._quic, unidirectional)

    def _check_sendable(self, stream_id: int) -> None:
        self._check_direction(stream_id)
        code = self._send_closed.get(stream_id)
        if code is not None:
            raise StreamClosedError(stream_id, code)

    def _send_stream(self, stream_id: int, data: bytes | bytearray | memoryview,
                     end_stream: bool) -> None:
        try:
            self._quic.send_stream_data(stream_id, data, end_stream)
        except self._library.stream_errors as exc:  # after FIN, or a stream it refuses
            raise StreamClosedError(stream_id, None, f"stream {stream_id}: {exc}") from None
        self._transmit_soon()

    def _abandon(self, stream_id: int, error_code: int, *, peer_stopped: bool) -> bool:
        if stream_id in self._send_closed:
            return False
        self._send_closed[stream_id] = error_code
        if peer_stopped:  # aioquic resets it itself; the hook does where a library does not
            self._library.after_stop_sending(self._quic, stream_id, error_code)
            self._transmit_soon()
            return True
        try:
            self._quic.reset_stream(stream_id, error_code)
        except self._library.stream_errors:
            pass  # already finished and acknowledged: nothing to abandon
        return True

    def _stop_stream(self, stream_id: int, error_code: int) -> None:
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

    def _send_closed_code(self, stream_id: int) -> int | None:
        return self._send_closed.get(stream_id)

    def _buffered(self, stream_id: int) -> int:
        if stream_id == _DRAIN:
            return self._library.unacknowledged(self._quic)
        return self.stream_send_buffered(stream_id)

    # -- datagrams --------------------------------------------------------------------------
    def _send_datagram_frame(self, data: bytes) -> None:
        self._quic.send_datagram_frame(data)
        self._transmit_soon()

    # -- lifetime ---------------------------------------------------------------------------
    async def ping(self) -> None:
        self._check_open()
        assert self._protocol is not None
        try:
            await self._protocol.ping()
        except ConnectionError:
            raise ConnectionClosedError(self._close_info or CloseInfo(
                0, "connection closed", application=False, local=False)) from None

    def _close_quic(self, error_code: int, reason: str) -> str:
        reason = _fit_reason(reason)
        self._quic.close(error_code=error_code, reason_phrase=reason)
        return reason

    def _transmit_soon(self) -> None:
        if self._protocol is not None:
            self._protocol.transmit_soon()

    def _transmit_now(self) -> None:
        if self._protocol is not None:
            self._protocol.transmit()

    def _release(self, exc: ConnectionClosedError) -> None:
        self._pending = None

    def _connect_error(self, info: CloseInfo) -> ConnectError:
        return _connect_error(info, self._config)

    # -- events -----------------------------------------------------------------------------
    def on_quic_event(self, event: Any) -> None:
        """Transport-internal: one event of the ``QuicConnection`` (from its protocol)."""
        ev = self._library.events
        handler = self._handler
        self._deliver(event, ev)
        if isinstance(event, self._data_events):
            if handler is None and self._pending is not None:
                self._pending.append(event)  # before the handshake completed (rare)
        elif isinstance(event, ev.HandshakeCompleted):
            self._on_handshake(event)
        elif isinstance(event, ev.ConnectionTerminated):
            self._on_terminated(event)

    def _on_handshake(self, event: Any) -> None:
        if self._close_info is not None:
            return
        alpn = event.alpn_protocol
        if alpn is None:  # cannot happen with ALPN configured; be explicit anyway
            self.refuse(NO_APPLICATION_PROTOCOL, "no ALPN protocol negotiated")
            return
        if self._refuse_without_datagrams(
                self._library.peer_max_datagram_frame_size(self._quic)):
            return
        if not self._start_handler(alpn):
            return
        pending, self._pending = self._pending or [], None
        for queued in pending:
            self.on_quic_event(queued)

    def after_io(self) -> None:
        """Transport-internal: the protocol fed the ``QuicConnection`` (datagrams, a timer):
        notice a close that began, wake the ``wait_writable`` callers."""
        if self._close_info is None:
            pending = self._library.pending_close(self._quic)
            if pending is not None:
                event, local = pending
                self._mark_closed(CloseInfo(event.error_code, event.reason_phrase,
                                            application=event.frame_type is None, local=local))
        if self._waiters:
            self._wake_waiters()

    def _on_terminated(self, event: Any) -> None:
        if self._close_info is None:
            # A peer's close was seen in after_io already; what is left began here (idle
            # timeout, an error the library detected while handling a timer).
            self._mark_closed(CloseInfo(event.error_code, event.reason_phrase,
                                        application=event.frame_type is None, local=True))
        self._ended()


_DRAIN = -1  # waiter key for "every stream acknowledged" (no stream has a negative ID)


def _connect_error(info: CloseInfo, config: TransportConfig) -> ConnectError:
    tls_alert = CRYPTO_ERROR <= info.error_code <= CRYPTO_ERROR + 0xFF and not info.application
    # RFC 9001 §8.1 asks for the no_application_protocol alert; qh3 (2.1) sends
    # handshake_failure with the reason "No common ALPN protocols".
    if tls_alert and (info.error_code == NO_APPLICATION_PROTOCOL
                      or "alpn" in info.reason.lower()):
        what = (f"no common ALPN protocol: we offered {list(config.alpn_protocols)} "
                f"({info.reason or 'no_application_protocol'})")
    elif info.application and info.reason == DATAGRAM_MISSING_REASON:
        what = (f"the server: {info.reason}" if info.local else
                f"the server closed the connection: {info.reason} (we are the peer)")
    elif tls_alert:
        what = f"TLS handshake failed: {info.reason or 'alert ' + str(info.error_code & 0xFF)}"
    else:
        what = f"connection closed during the handshake: {info}"
    return ConnectError(what, error_code=info.error_code, reason=info.reason)
