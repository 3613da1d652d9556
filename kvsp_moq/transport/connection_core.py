"""What the two :class:`~.api.Connection` implementations share: :class:`ConnectionCore`.

:class:`~.engine.EngineConnection` (aioquic, qh3: a sans-IO ``QuicConnection`` driven by the
engine) and :class:`~.aiopquic.connection.AiopquicConnection` (picoquic's own thread) differ
in how they reach their QUIC library, not in what the interface promises. This class holds
the promise: the state every backend keeps (handler, ALPN, peer, close bookkeeping, the
established and terminated futures, the ``wait_writable`` waiters), the checks on the
interface's arguments, the calls into the handler (one that raises closes the connection),
the close sequence with its single ``connection_lost``, the answer to STOP_SENDING (RFC 9000
§3.5) and a client's bounded handshake wait. A subclass supplies the library calls through
the hooks marked below, and decides what a close looks like to ``connect`` (each library
reports failed handshakes its own way: :meth:`ConnectionCore._connect_error`).

:func:`datagram_payload_limit` is the largest DATAGRAM payload that fits one packet and the
peer's limit; :func:`plain_address` a socket address as :data:`~.api.Address`. This module
imports no QUIC library.

Public methods of :class:`ConnectionCore` that :class:`~.api.Connection` does not declare
(:meth:`~ConnectionCore.set_peer`, :meth:`~ConnectionCore.refuse`,
:meth:`~ConnectionCore.close_or_refuse`, :meth:`~ConnectionCore.await_handshake`,
:attr:`~ConnectionCore.loop`) are transport-internal: what the backends' endpoints and servers
call on the connections they make; the layers above see only the interface.
"""

from __future__ import annotations

import abc
import asyncio
import logging
from collections.abc import Callable
from typing import Any, ClassVar, Self

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
from .url import MoqtUrl

__all__ = [
    "CRYPTO_ERROR",
    "DATAGRAM_MISSING_REASON",
    "NO_APPLICATION_PROTOCOL",
    "ConnectionCore",
    "datagram_payload_limit",
    "plain_address",
]

NO_ERROR = 0x0
CRYPTO_ERROR = 0x100  # RFC 9000 §20.1: 0x0100-0x01ff carry a TLS alert
NO_APPLICATION_PROTOCOL = CRYPTO_ERROR + 120  # RFC 8446 alert no_application_protocol
DATAGRAM_MISSING_REASON = (
    "peer did not negotiate the QUIC DATAGRAM extension (RFC 9221 max_datagram_frame_size "
    "transport parameter), which MOQT requires")

_AEAD_TAG_SIZE = 16  # every QUIC v1/v2 AEAD (AES-GCM, ChaCha20-Poly1305)
_MAX_CID_LENGTH = 20  # RFC 9000 §17.2


# ------------------------------------------------------------------------------------------
# addresses


def plain_address(addr: Any) -> Address:
    """A socket address as :data:`~.api.Address` (host, port): an IPv4-mapped IPv6 host
    (``::ffff:a.b.c.d``, a dual-stack socket's view of an IPv4 peer) shown as IPv4."""
    host, port = addr[0], addr[1]
    if host.startswith("::ffff:") and "." in host:
        host = host[7:]
    return host, port


# ------------------------------------------------------------------------------------------
# the DATAGRAM payload that fits


def _varint_size(n: int) -> int:
    return 1 if n < 0x40 else 2 if n < 0x4000 else 4 if n < 0x40000000 else 8


def _max_payload(room: int) -> int:
    """Largest n with n + varint_size(n) <= room (a DATAGRAM frame's length field)."""
    best = 0
    for size in (1, 2, 4, 8):
        n = room - size
        if n >= 0 and _varint_size(n) <= size:
            best = max(best, n)
    return best


def datagram_payload_limit(max_datagram_size: int, packet_number_size: int,
                           peer_frame: int | None, ceiling: int | None = None) -> int:
    """The largest DATAGRAM payload in one packet of ``max_datagram_size`` bytes: the RFC 9000
    §17.3.1 short header (1 + DCID + packet number), the AEAD tag, and the DATAGRAM frame
    type and length (RFC 9221 §4) taken off; 0 when the peer sent no
    max_datagram_frame_size (``peer_frame``). Strictly below the peer's limit: aioquic (up
    to 1.7.2) rejects a frame whose size *equals* it. ``ceiling``: the library's own."""
    if not peer_frame:
        return 0
    room = (max_datagram_size - (1 + _MAX_CID_LENGTH + packet_number_size)
            - _AEAD_TAG_SIZE - 1)
    limit = min(_max_payload(room), _max_payload(peer_frame - 2))
    return max(0, limit if ceiling is None else min(limit, ceiling))


# ------------------------------------------------------------------------------------------
# the connection


class ConnectionCore(Connection):
    """The backend-neutral part of a :class:`~.api.Connection`. Hooks a subclass implements:
    :meth:`_open_stream`, :meth:`_send_stream`, :meth:`_abandon`, :meth:`_stop_stream`,
    :meth:`_send_closed_code`, :meth:`_buffered`, :meth:`_send_datagram_frame`,
    :meth:`_close_quic` and :meth:`_connect_error`; it may extend :meth:`_check_sendable`,
    :meth:`_watch`, :meth:`_release`, :meth:`_transmit_soon`/:meth:`_transmit_now` and
    :meth:`_address_of`."""

    #: The subclass module's logger (the messages below name the backend's module).
    _log: ClassVar[logging.Logger] = logging.getLogger(__name__)

    def __init__(self, *, quic: Any, config: TransportConfig, handler_factory: HandlerFactory,
                 url: MoqtUrl | None, peer: Any = None,
                 on_ended: Callable[[Self], None] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        self._quic = quic
        self._config = config
        self._factory = handler_factory
        self._url = url
        self._peer = peer
        self._on_ended: Callable[[Any], None] | None = on_ended
        self._is_client = bool(quic.configuration.is_client)
        self._handler: ConnectionHandler | None = None
        self._alpn: str | None = None
        self._close_info: CloseInfo | None = None
        self._lost_notified = False
        self._terminated: asyncio.Future[CloseInfo] = self._loop.create_future()
        self._established: asyncio.Future[None] | None = (
            self._loop.create_future() if self._is_client else None)
        self._waiters: dict[int, list[tuple[int, asyncio.Future[None]]]] = {}
        self._high = config.send_buffer_high_water
        self._low = config.low_water

    # -- identity ---------------------------------------------------------------------------
    @property
    @abc.abstractmethod
    def backend(self) -> str:
        """The name of the QUIC library behind this connection."""

    @property
    def alpn(self) -> str:
        if self._alpn is None:
            raise RuntimeError("handshake not complete")
        return self._alpn

    @property
    def is_client(self) -> bool:
        return self._is_client

    @property
    def remote_address(self) -> Address:
        if self._peer is None:
            raise RuntimeError("no peer address yet")
        return self._address_of(self._peer)

    def _address_of(self, peer: Any) -> Address:
        """``peer`` as :attr:`remote_address` shows it (hook: a backend may normalise it)."""
        return peer

    def set_peer(self, peer: Any) -> None:
        """Transport-internal: the peer's address as the last datagram came from it (what
        :attr:`remote_address` shows, through :meth:`_address_of`)."""
        self._peer = peer

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """Transport-internal: the event loop the connection runs on."""
        return self._loop

    @property
    def url(self) -> MoqtUrl | None:
        return self._url

    @property
    def transport_config(self) -> TransportConfig:
        """Transport-internal: the configuration the connection was made with."""
        return self._config

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

    def __repr__(self) -> str:
        side = "client" if self._is_client else "server"
        state = "closed" if self._close_info else "open" if self._handler else "handshake"
        return f"<{self.backend} connection {side} {self._alpn or '-'} {state}>"

    # -- streams ----------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._close_info is not None:
            raise ConnectionClosedError(self._close_info)

    def _check_direction(self, stream_id: int) -> None:
        if is_unidirectional(stream_id) and not is_locally_initiated(stream_id, self._is_client):
            raise ValueError(f"stream {stream_id} is the peer's unidirectional stream")

    def _check_sendable(self, stream_id: int) -> None:
        """Raise unless ``send`` may queue bytes on ``stream_id`` (hook: a backend adds its
        own record of finished send sides)."""
        self._check_direction(stream_id)

    def open_bidi(self) -> int:
        self._check_open()
        return self._open_stream(False)

    def open_uni(self) -> int:
        self._check_open()
        return self._open_stream(True)

    def send(self, stream_id: int, data: bytes | bytearray | memoryview,
             end_stream: bool = False) -> None:
        self._check_open()
        self._check_sendable(stream_id)
        if isinstance(data, memoryview) and (data.ndim != 1 or data.itemsize != 1):
            data = data.cast("B")
        self._send_stream(stream_id, data, end_stream)

    def reset_stream(self, stream_id: int, error_code: int) -> None:
        self._check_open()
        self._check_direction(stream_id)
        if not self._abandon(stream_id, error_code, peer_stopped=False):
            return
        self._fail_waiters(stream_id, StreamClosedError(stream_id, error_code,
                                                        f"stream {stream_id} was reset"))
        self._transmit_soon()

    def stop_sending(self, stream_id: int, error_code: int) -> None:
        self._check_open()
        if is_unidirectional(stream_id) and is_locally_initiated(stream_id, self._is_client):
            raise ValueError(f"stream {stream_id} is our send-only stream")
        self._stop_stream(stream_id, error_code)

    # hooks
    @abc.abstractmethod
    def _open_stream(self, unidirectional: bool) -> int:
        """The library's next stream ID of that kind."""

    @abc.abstractmethod
    def _send_stream(self, stream_id: int, data: bytes | bytearray | memoryview,
                     end_stream: bool) -> None:
        """Queue checked ``data`` (a byte-format view, if a view) in the library."""

    @abc.abstractmethod
    def _abandon(self, stream_id: int, error_code: int, *, peer_stopped: bool) -> bool:
        """End our send side of ``stream_id`` with RESET_STREAM carrying ``error_code``: on
        :meth:`reset_stream`, or answering the peer's STOP_SENDING (``peer_stopped``). False
        when the send side was over already (nothing done)."""

    @abc.abstractmethod
    def _stop_stream(self, stream_id: int, error_code: int) -> None:
        """Send STOP_SENDING for a checked ``stream_id`` (a no-op when it is gone)."""

    # -- backpressure -----------------------------------------------------------------------
    async def wait_writable(self, stream_id: int, threshold: int | None = None) -> None:
        self._check_open()
        limit = self._low if threshold is None else threshold
        code = self._send_closed_code(stream_id)
        if code is not None:
            raise StreamClosedError(stream_id, code)
        if self._buffered(stream_id) <= limit:
            return
        fut: asyncio.Future[None] = self._loop.create_future()
        entry = (limit, fut)
        self._waiters.setdefault(stream_id, []).append(entry)
        self._watch(stream_id)
        try:
            await fut
        finally:
            waiters = self._waiters.get(stream_id)
            if waiters is not None and entry in waiters:
                waiters.remove(entry)
                if not waiters:
                    del self._waiters[stream_id]
            # A StreamClosedError set on ``fut`` has this frame in its traceback: without
            # the future in the frame, no reference cycle keeps the caller's frames (and the
            # buffers they hold, e.g. a stored payload being written) until a GC pass.
            del fut, entry

    def _wake_waiters(self, stream_id: int | None = None) -> None:
        """Wake the ``wait_writable`` callers of ``stream_id`` (None: of every stream) whose
        threshold the buffered figure has reached; keep watching for the others."""
        ids = list(self._waiters) if stream_id is None else [stream_id]
        for sid in ids:
            entries = self._waiters.get(sid)
            if not entries:
                continue
            buffered = self._buffered(sid)
            keep = []
            for limit, fut in entries:
                if fut.done():
                    continue
                if buffered <= limit:
                    fut.set_result(None)
                else:
                    keep.append((limit, fut))
            if keep:
                self._waiters[sid] = keep
                self._watch(sid)
            else:
                del self._waiters[sid]

    def _fail_waiters(self, stream_id: int | None, exc: Exception) -> None:
        ids = list(self._waiters) if stream_id is None else [stream_id]
        for sid in ids:
            for _, fut in self._waiters.pop(sid, ()):
                if not fut.done():
                    fut.set_exception(exc)

    # hooks
    @abc.abstractmethod
    def _send_closed_code(self, stream_id: int) -> int | None:
        """The RESET_STREAM / STOP_SENDING code that ended our send side, if one did."""

    @abc.abstractmethod
    def _buffered(self, stream_id: int) -> int:
        """The buffered figure ``wait_writable`` compares with its threshold."""

    def _watch(self, stream_id: int) -> None:
        """Someone waits for ``stream_id``'s buffered figure to drop (hook: a backend that
        must ask its library for the next wake-up does it here)."""

    # -- datagrams --------------------------------------------------------------------------
    def send_datagram(self, data: bytes | bytearray | memoryview) -> None:
        self._check_open()
        limit = self.max_datagram_payload
        if len(data) > limit:
            raise ValueError(f"datagram of {len(data)} bytes exceeds max_datagram_payload "
                             f"{limit}")
        # The library queues the object until a packet is built: hand it bytes it owns.
        self._send_datagram_frame(data if isinstance(data, bytes) else bytes(data))

    @abc.abstractmethod
    def _send_datagram_frame(self, data: bytes) -> None:
        """Queue one DATAGRAM frame that fits."""

    # -- lifetime ---------------------------------------------------------------------------
    def close(self, error_code: int = 0, reason: str = "") -> None:
        if self._close_info is not None:
            return
        reason = self._close_quic(error_code, reason)
        self._mark_closed(CloseInfo(error_code, reason, application=True, local=True),
                          notify_soon=True)
        self._transmit_now()

    async def wait_closed(self) -> CloseInfo:
        return await asyncio.shield(self._terminated)

    def refuse(self, error_code: int, reason: str) -> None:
        """Transport-internal: close a connection that is not set up (refused, or its setup
        failed)."""
        self._log.info("closing %s during setup: %s", self, reason)
        reason = self._close_quic(error_code, reason)
        self._mark_closed(CloseInfo(error_code, reason, application=True, local=True))
        self._transmit_soon()

    def close_or_refuse(self, error_code: int, reason: str) -> None:
        """Transport-internal: its server is closing: close the connection if established,
        refuse it if not."""
        if self._close_info is not None:
            return
        if self._handler is not None:
            self.close(error_code, reason)
        else:
            self.refuse(error_code, reason)

    def _mark_closed(self, info: CloseInfo, *, notify_soon: bool = False) -> None:
        """The connection is closing (``info`` says how): fail everything that waits, fail a
        pending ``connect``, and tell the handler (on the next loop pass if ``notify_soon``)."""
        if self._close_info is not None:
            return
        self._close_info = info
        exc = ConnectionClosedError(info)
        self._fail_waiters(None, exc)
        self._release(exc)
        if self._established is not None and not self._established.done():
            self._established.set_exception(self._connect_error(info))
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
            self._log.exception("%s.connection_lost raised", type(self._handler).__name__)

    def _ended(self) -> None:
        """The connection is gone (and marked closed): wake ``wait_closed`` and tell the
        owner, once."""
        assert self._close_info is not None
        if self._terminated.done():
            return
        self._terminated.set_result(self._close_info)
        if self._on_ended is not None:
            self._on_ended(self)

    async def await_handshake(self, release: Callable[[], None]) -> None:
        """Transport-internal (the backends' ``connect``): a client's handshake, bounded by ``handshake_timeout``. On failure the connection
        is closed, ``release`` frees what it holds (its socket, its context) at once rather
        than after the closing period, and :class:`~.api.ConnectError` (or the cancellation)
        is raised."""
        assert self._established is not None and self._url is not None
        timeout = self._config.handshake_timeout
        try:
            await asyncio.wait_for(asyncio.shield(self._established), timeout)
        except asyncio.TimeoutError:
            self.close(NO_ERROR, "handshake timeout")
            release()
            raise ConnectError(f"QUIC handshake with {self._url.host}:{self._url.port} timed "
                               f"out after {timeout} s") from None
        except ConnectError:
            release()  # the connection is dead already
            raise
        except BaseException:
            self.close(NO_ERROR, "cancelled")
            release()
            raise

    # hooks
    @abc.abstractmethod
    def _close_quic(self, error_code: int, reason: str) -> str:
        """Have the library send an application CONNECTION_CLOSE; return the reason as the
        close is recorded (a library may shorten or drop what it sends)."""

    @abc.abstractmethod
    def _connect_error(self, info: CloseInfo) -> ConnectError:
        """What a close during a client's handshake means, for ``connect`` to raise."""

    def _release(self, exc: ConnectionClosedError) -> None:
        """The connection is closing (hook: fail a backend's own waiters with ``exc``, drop
        its send state)."""

    def _transmit_soon(self) -> None:
        """Have what was just queued sent (hook: a library whose I/O runs elsewhere sends by
        itself)."""

    def _transmit_now(self) -> None:
        """As :meth:`_transmit_soon`, at once (the CONNECTION_CLOSE of :meth:`close`)."""

    # -- the handshake and the handler ------------------------------------------------------
    def _refuse_without_datagrams(self, peer_frame: int | None) -> bool:
        """Refuse (True) a peer without DATAGRAM support (its max_datagram_frame_size,
        ``peer_frame``) when the configuration requires it."""
        if self._config.datagrams and not peer_frame:
            self.refuse(self._config.datagram_required_error_code, DATAGRAM_MISSING_REASON)
            return True
        return False

    def _start_handler(self, alpn: str) -> bool:
        """The handshake completed and the connection is accepted: make the handler, settle
        ``connect``, call ``connection_made``. False if the factory failed (refused then)."""
        self._alpn = alpn
        try:
            handler = self._factory()
        except Exception:
            self._log.exception("handler factory failed")
            self.refuse(self._config.internal_error_code, "internal error: no handler")
            return False
        self._handler = handler
        if self._established is not None and not self._established.done():
            self._established.set_result(None)
        self._call("connection_made", self, alpn)
        return True

    def _deliver(self, event: Any, events: Any) -> None:
        """Hand a data event (``events``: the library's aioquic-shaped event classes) to the
        handler while the connection is established and open: stream data, a datagram, a
        stream reset, STOP_SENDING (answered first). Other events are not for the handler."""
        if self._handler is None or self._close_info is not None:
            return
        if isinstance(event, events.StreamDataReceived):
            self._call("stream_data", event.stream_id, event.data, event.end_stream)
        elif isinstance(event, events.DatagramFrameReceived):
            self._call("datagram_received", event.data)
        elif isinstance(event, events.StreamReset):
            self._call("stream_reset", event.stream_id, event.error_code)
        elif isinstance(event, events.StopSendingReceived):
            self._on_stop_sending(event.stream_id, event.error_code)

    def _on_stop_sending(self, stream_id: int, error_code: int) -> None:
        # RFC 9000 §3.5: answer STOP_SENDING with RESET_STREAM carrying the same code.
        self._abandon(stream_id, error_code, peer_stopped=True)
        self._fail_waiters(stream_id, StreamClosedError(
            stream_id, error_code, f"peer sent STOP_SENDING on stream {stream_id}"))
        if self._handler is not None:
            self._call("stop_sending", stream_id, error_code)

    def _call(self, name: str, *args: Any) -> None:
        try:
            getattr(self._handler, name)(*args)
        except Exception as exc:
            self._log.exception("%s.%s raised; closing the connection",
                                type(self._handler).__name__, name)
            if self._close_info is None:
                self.close(self._config.internal_error_code,
                           f"internal error in {name}: {type(exc).__name__}")
