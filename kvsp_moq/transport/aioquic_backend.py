"""The :mod:`kvsp_moq.transport.api` interface on aioquic's asyncio API.

One :class:`_Protocol` (an aioquic ``QuicConnectionProtocol``) per connection feeds QUIC
events to one :class:`AioquicConnection`, which dispatches them to the upper layer's
:class:`~kvsp_moq.transport.api.ConnectionHandler` and implements the
:class:`~kvsp_moq.transport.api.Connection` handle on ``QuicConnection``.

aioquic internals this module relies on (checked against aioquic 1.7.2; each is read in one
helper below so an upgrade is checked in one place):

* ``QuicConnection._remote_max_datagram_frame_size`` — the peer's max_datagram_frame_size
  transport parameter (None when absent); aioquic has no public accessor.
* ``QuicConnection._streams[sid].sender._buffer`` / ``._reset_error_code`` — the send buffer
  (unsent + unacknowledged bytes) and whether the send side was reset; the backpressure
  metric.
* ``QuicConnection._close_event`` / ``._state`` — a close that has begun (sent or received)
  but whose ConnectionTerminated event only comes after the closing period (3 PTO); reading it
  lets the upper layer learn of a peer's CONNECTION_CLOSE at once.
* ``QuicConnection._peer_cid`` is not read: the datagram payload bound assumes the longest
  connection ID (20 bytes) so that a datagram never outgrows a packet after a CID change
  (aioquic would otherwise keep it queued forever, blocking the datagrams behind it).
* ``QuicConnectionProtocol._transmit_soon`` / ``_handle_timer`` — coalesced transmission and
  the timer hook (aioquic's own stream adapter uses ``_transmit_soon``).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
from collections.abc import Callable
from typing import Any

from aioquic.asyncio.protocol import QuicConnectionProtocol
from aioquic.asyncio.server import QuicServer
from aioquic.quic import events
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.congestion import base as _congestion
from aioquic.quic.connection import QuicConnection, QuicConnectionState
from aioquic.quic.packet import QuicErrorCode
from aioquic.quic.packet_builder import PACKET_NUMBER_SEND_SIZE
from aioquic.tls import AlertDescription, load_pem_private_key, load_pem_x509_certificates

from .api import (
    Address,
    CloseInfo,
    ConnectError,
    Connection,
    ConnectionClosedError,
    ConnectionHandler,
    HandlerFactory,
    Server,
    StreamClosedError,
    is_locally_initiated,
    is_unidirectional,
)
from .config import TransportConfig
from .url import MoqtUrl, parse_moqt_url

__all__ = ["AioquicConnection", "AioquicServer", "connect", "serve"]

logger = logging.getLogger(__name__)

_AEAD_TAG_SIZE = 16  # every QUIC v1/v2 AEAD (AES-GCM, ChaCha20-Poly1305)
_MAX_CID_LENGTH = 20  # RFC 9000 §17.2
_NO_APPLICATION_PROTOCOL = QuicErrorCode.CRYPTO_ERROR + AlertDescription.no_application_protocol
_SERVER_CLOSE_GRACE = 5.0  # seconds Server.wait_closed waits for closing periods to end

_DATAGRAM_MISSING_REASON = (
    "peer did not negotiate the QUIC DATAGRAM extension (RFC 9221 max_datagram_frame_size "
    "transport parameter), which MOQT requires")


# ------------------------------------------------------------------------------------------
# aioquic internals, read in one place


def _peer_max_datagram_frame_size(quic: QuicConnection) -> int | None:
    return quic._remote_max_datagram_frame_size


def _sender(quic: QuicConnection, stream_id: int) -> Any | None:
    stream = quic._streams.get(stream_id)
    return None if stream is None else stream.sender


def _stream_ids(quic: QuicConnection) -> list[int]:
    return list(quic._streams)


def _sender_reset_code(sender: Any) -> int | None:
    return sender._reset_error_code


def _sender_buffered(sender: Any) -> int:
    return len(sender._buffer)


def _pending_close(quic: QuicConnection) -> tuple[events.ConnectionTerminated, bool] | None:
    """The close in progress and whether this endpoint began it, or None."""
    event = quic._close_event
    if event is None:
        return None
    return event, quic._state is not QuicConnectionState.DRAINING


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


# ------------------------------------------------------------------------------------------
# configuration


def _quic_configuration(config: TransportConfig, *, is_client: bool,
                        server_name: str | None = None) -> QuicConfiguration:
    if config.congestion_control_algorithm not in _congestion._factories:
        raise ValueError(
            f"unknown congestion control algorithm {config.congestion_control_algorithm!r};"
            f" aioquic has {sorted(_congestion._factories)}")
    qc = QuicConfiguration(
        alpn_protocols=list(config.alpn_protocols),
        is_client=is_client,
        congestion_control_algorithm=config.congestion_control_algorithm,
        idle_timeout=config.idle_timeout,
        max_data=config.max_data,
        max_stream_data=config.max_stream_data,
        max_datagram_size=config.max_datagram_size,
        max_datagram_frame_size=config.max_datagram_frame_size if config.datagrams else None,
        initial_rtt=config.initial_rtt,
        server_name=server_name,
    )
    if is_client:
        if config.insecure:
            qc.verify_mode = ssl.CERT_NONE
        if config.ca_file is not None or config.ca_data is not None:
            qc.load_verify_locations(
                cafile=None if config.ca_file is None else str(config.ca_file),
                cadata=config.ca_data)
    if config.certificate_file is not None:
        qc.load_cert_chain(config.certificate_file, config.private_key_file)
    elif config.certificate_pem is not None and config.private_key_pem is not None:
        chain = load_pem_x509_certificates(config.certificate_pem)
        if not chain:
            raise ValueError("certificate_pem holds no certificate")
        qc.certificate, qc.certificate_chain = chain[0], chain[1:]
        qc.private_key = load_pem_private_key(config.private_key_pem)
    elif not is_client:
        raise ValueError("a server needs a certificate: set certificate_file/private_key_file "
                         "or certificate_pem/private_key_pem (see transport.tls for a dev one)")
    if config.keylog_file is not None:
        qc.secrets_log_file = open(config.keylog_file, "a")  # noqa: SIM115 - lives with config
    return qc


def _set_udp_buffers(sock: socket.socket, size: int | None) -> None:
    if not size:
        return
    for force, plain in ((getattr(socket, "SO_RCVBUFFORCE", None), socket.SO_RCVBUF),
                         (getattr(socket, "SO_SNDBUFFORCE", None), socket.SO_SNDBUF)):
        for opt in (force, plain):  # FORCE passes rmem_max/wmem_max when privileged
            if opt is None:
                continue
            try:
                sock.setsockopt(socket.SOL_SOCKET, opt, size)
                break
            except OSError:
                continue


# ------------------------------------------------------------------------------------------
# the connection


class _Protocol(QuicConnectionProtocol):
    """aioquic's datagram protocol, with events and I/O ticks forwarded to the connection."""

    conn: AioquicConnection

    def quic_event_received(self, event: events.QuicEvent) -> None:
        self.conn._on_event(event)

    def datagram_received(self, data: bytes | str, addr: Any) -> None:
        super().datagram_received(data, addr)
        self.conn._after_io()

    def _handle_timer(self) -> None:
        super()._handle_timer()
        self.conn._after_io()


_DATA_EVENTS = (events.StreamDataReceived, events.StreamReset, events.StopSendingReceived,
                events.DatagramFrameReceived)


class AioquicConnection(Connection):
    """A :class:`~kvsp_moq.transport.api.Connection` on an aioquic ``QuicConnection``."""

    def __init__(self, *, quic: QuicConnection, config: TransportConfig,
                 handler_factory: HandlerFactory, url: MoqtUrl | None,
                 on_terminated: Callable[[AioquicConnection], None] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        self._quic = quic
        self._config = config
        self._factory = handler_factory
        self._url = url
        self._on_terminated_cb = on_terminated
        self._protocol: _Protocol | None = None
        self._handler: ConnectionHandler | None = None
        self._pending: list[events.QuicEvent] | None = []
        self._alpn: str | None = None
        self._close_info: CloseInfo | None = None
        self._lost_notified = False
        self._terminated: asyncio.Future[CloseInfo] = self._loop.create_future()
        self._established: asyncio.Future[None] | None = (
            self._loop.create_future() if quic.configuration.is_client else None)
        self._waiters: dict[int, list[tuple[int, asyncio.Future[None]]]] = {}
        self._high = config.send_buffer_high_water
        self._low = config.low_water

    def _attach(self, protocol: _Protocol) -> None:
        self._protocol = protocol
        protocol.conn = self

    # -- identity ---------------------------------------------------------------------------
    @property
    def alpn(self) -> str:
        if self._alpn is None:
            raise RuntimeError("handshake not complete")
        return self._alpn

    @property
    def is_client(self) -> bool:
        return self._quic.configuration.is_client

    @property
    def remote_address(self) -> Address:
        addr = self._quic.get_peer_address()
        if addr is None:
            raise RuntimeError("no peer address yet")
        return _plain_address(addr)

    @property
    def url(self) -> MoqtUrl | None:
        return self._url

    @property
    def max_datagram_payload(self) -> int:
        room = (self._config.max_datagram_size - (1 + _MAX_CID_LENGTH + PACKET_NUMBER_SEND_SIZE)
                - _AEAD_TAG_SIZE - 1)  # short header, AEAD tag, DATAGRAM frame type
        limit = _max_payload(room)
        peer = _peer_max_datagram_frame_size(self._quic)
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

    def __repr__(self) -> str:
        side = "client" if self.is_client else "server"
        state = "closed" if self._close_info else "open" if self._handler else "handshake"
        return f"<AioquicConnection {side} {self._alpn or '-'} {state}>"

    # -- streams ----------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._close_info is not None:
            raise ConnectionClosedError(self._close_info)

    def _open(self, unidirectional: bool) -> int:
        self._check_open()
        stream_id = self._quic.get_next_available_stream_id(is_unidirectional=unidirectional)
        # Writing nothing creates the stream, so the next call returns another ID.
        self._quic.send_stream_data(stream_id, b"", end_stream=False)
        return stream_id

    def open_bidi(self) -> int:
        return self._open(False)

    def open_uni(self) -> int:
        return self._open(True)

    def send(self, stream_id: int, data: bytes | bytearray | memoryview,
             end_stream: bool = False) -> None:
        self._check_open()
        if isinstance(data, memoryview) and (data.ndim != 1 or data.itemsize != 1):
            data = data.cast("B")
        sender = _sender(self._quic, stream_id)
        if sender is not None:
            code = _sender_reset_code(sender)
            if code is not None:
                raise StreamClosedError(stream_id, code)
        try:
            self._quic.send_stream_data(stream_id, data, end_stream)  # type: ignore[arg-type]
        except RuntimeError as exc:  # after FIN
            raise StreamClosedError(stream_id, None, f"stream {stream_id}: {exc}") from None
        except ValueError as exc:
            if "finished" in str(exc):
                raise StreamClosedError(stream_id, None, f"stream {stream_id}: {exc}") from None
            raise ValueError(f"stream {stream_id}: {exc}") from None
        self._transmit_soon()

    def reset_stream(self, stream_id: int, error_code: int) -> None:
        self._check_open()
        self._quic.reset_stream(stream_id, error_code)
        self._fail_waiters(stream_id, StreamClosedError(stream_id, error_code,
                                                         f"stream {stream_id} was reset"))
        self._transmit_soon()

    def stop_sending(self, stream_id: int, error_code: int) -> None:
        self._check_open()
        if is_unidirectional(stream_id) and is_locally_initiated(stream_id, self.is_client):
            raise ValueError(f"stream {stream_id} is our send-only stream")
        if stream_id not in self._quic._streams:
            return  # finished and discarded, or never seen: nothing to stop
        self._quic.stop_stream(stream_id, error_code)
        self._transmit_soon()

    # -- backpressure -----------------------------------------------------------------------
    def stream_send_buffered(self, stream_id: int) -> int:
        sender = _sender(self._quic, stream_id)
        if sender is None or _sender_reset_code(sender) is not None:
            return 0
        return _sender_buffered(sender)

    async def drain(self) -> None:
        for stream_id in _stream_ids(self._quic):
            if _sender(self._quic, stream_id) is None:
                continue
            try:
                await self.wait_writable(stream_id, 0)
            except StreamClosedError:
                continue  # reset or stopped: nothing more will be delivered

    async def wait_writable(self, stream_id: int, threshold: int | None = None) -> None:
        self._check_open()
        limit = self._low if threshold is None else threshold
        sender = _sender(self._quic, stream_id)
        if sender is not None and _sender_reset_code(sender) is not None:
            raise StreamClosedError(stream_id, _sender_reset_code(sender))
        if self.stream_send_buffered(stream_id) <= limit:
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
            buffered = self.stream_send_buffered(stream_id)
            waiters = self._waiters[stream_id]
            keep = []
            for limit, fut in waiters:
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
        # aioquic queues the object until a packet is built: hand it bytes it owns.
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
            self._protocol._transmit_soon()

    # -- events -----------------------------------------------------------------------------
    def _on_event(self, event: events.QuicEvent) -> None:
        handler = self._handler
        if handler is not None and self._close_info is None:
            if isinstance(event, events.StreamDataReceived):
                self._call("stream_data", event.stream_id, event.data, event.end_stream)
            elif isinstance(event, events.DatagramFrameReceived):
                self._call("datagram_received", event.data)
            elif isinstance(event, events.StreamReset):
                self._call("stream_reset", event.stream_id, event.error_code)
            elif isinstance(event, events.StopSendingReceived):
                self._fail_waiters(event.stream_id, StreamClosedError(
                    event.stream_id, event.error_code,
                    f"peer sent STOP_SENDING on stream {event.stream_id}"))
                self._call("stop_sending", event.stream_id, event.error_code)
        if isinstance(event, _DATA_EVENTS):
            if handler is None and self._pending is not None:
                self._pending.append(event)  # before the handshake completed (rare)
        elif isinstance(event, events.HandshakeCompleted):
            self._on_handshake(event)
        elif isinstance(event, events.ConnectionTerminated):
            self._on_terminated(event)

    def _on_handshake(self, event: events.HandshakeCompleted) -> None:
        if self._close_info is not None:
            return
        alpn = event.alpn_protocol
        if alpn is None:  # cannot happen with ALPN configured; be explicit anyway
            self._reject(0x178, "no ALPN protocol negotiated")
            return
        if self._config.datagrams and not _peer_max_datagram_frame_size(self._quic):
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
        if self._protocol is not None:
            self._protocol._transmit_soon()

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
            pending = _pending_close(self._quic)
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

    def _on_terminated(self, event: events.ConnectionTerminated) -> None:
        if self._close_info is None:
            # A peer's close was seen in _after_io already; what is left began here (idle
            # timeout, an error aioquic detected while handling a timer).
            self._mark_closed(CloseInfo(event.error_code, event.reason_phrase,
                                        application=event.frame_type is None, local=True))
        assert self._close_info is not None
        if not self._terminated.done():
            self._terminated.set_result(self._close_info)
        if self._on_terminated_cb is not None:
            self._on_terminated_cb(self)


def _connect_error(info: CloseInfo, config: TransportConfig) -> ConnectError:
    if info.error_code == _NO_APPLICATION_PROTOCOL and not info.application:
        what = (f"no common ALPN protocol: we offered {list(config.alpn_protocols)} "
                f"({info.reason or 'no_application_protocol'})")
    elif info.application and info.reason == _DATAGRAM_MISSING_REASON:
        what = (f"the server: {info.reason}" if info.local else
                f"the server closed the connection: {info.reason} (we are the peer)")
    elif QuicErrorCode.CRYPTO_ERROR <= info.error_code <= QuicErrorCode.CRYPTO_ERROR + 0xFF \
            and not info.application:
        what = f"TLS handshake failed: {info.reason or 'alert ' + str(info.error_code & 0xFF)}"
    else:
        what = f"connection closed during the handshake: {info}"
    return ConnectError(what, error_code=info.error_code, reason=info.reason)


# ------------------------------------------------------------------------------------------
# client


async def connect(url: str | MoqtUrl, handler_factory: HandlerFactory,
                  config: TransportConfig | None = None) -> AioquicConnection:
    """Connect to ``moqt://host:port/path`` and complete the QUIC handshake.

    Returns the connection after ``handler.connection_made`` ran. Raises
    :class:`~kvsp_moq.transport.api.ConnectError` when the handshake fails or the server does
    not negotiate DATAGRAM, :class:`ValueError` for a bad URL or configuration.
    """
    target = parse_moqt_url(url) if isinstance(url, str) else url
    config = config or TransportConfig()
    qconf = _quic_configuration(config, is_client=True,
                                server_name=config.server_name or target.host)
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(target.host, target.port, type=socket.SOCK_DGRAM)
    family, _, _, _, addr = infos[0]
    sock = socket.socket(family, socket.SOCK_DGRAM)
    try:
        sock.setblocking(False)
        _set_udp_buffers(sock, config.udp_buffer_size)
        sock.bind(("::", 0, 0, 0) if family == socket.AF_INET6 else ("0.0.0.0", 0))
    except BaseException:
        sock.close()
        raise

    quic = QuicConnection(configuration=qconf)
    transport: asyncio.DatagramTransport | None = None

    def closed(_: AioquicConnection) -> None:
        if transport is not None:
            transport.close()

    conn = AioquicConnection(quic=quic, config=config, handler_factory=handler_factory,
                             url=target, on_terminated=closed)

    def make_protocol() -> _Protocol:
        protocol = _Protocol(quic)
        conn._attach(protocol)
        return protocol

    transport, protocol = await loop.create_datagram_endpoint(make_protocol, sock=sock)
    protocol.connect(addr)
    assert conn._established is not None
    try:
        await asyncio.wait_for(asyncio.shield(conn._established), config.handshake_timeout)
    except asyncio.TimeoutError:
        conn.close(QuicErrorCode.NO_ERROR, "handshake timeout")
        transport.close()
        raise ConnectError(f"QUIC handshake with {target.host}:{target.port} timed out after "
                           f"{config.handshake_timeout} s") from None
    except ConnectError:
        # The connection is dead: drop the socket now rather than after the closing period.
        transport.close()
        raise
    except BaseException:
        conn.close(QuicErrorCode.NO_ERROR, "cancelled")
        transport.close()
        raise
    return conn


# ------------------------------------------------------------------------------------------
# server


class _QuicServer(QuicServer):
    owner: AioquicServer

    def connection_lost(self, exc: Exception | None) -> None:
        self.owner._socket_closed()


class AioquicServer(Server):
    """A listening UDP socket accepting QUIC connections."""

    def __init__(self, config: TransportConfig, handler_factory: HandlerFactory) -> None:
        self._config = config
        self._factory = handler_factory
        self._qconf = _quic_configuration(config, is_client=False)
        self._server: _QuicServer | None = None
        self._address: Address = ("", 0)
        self._all: set[AioquicConnection] = set()
        self._closing: tuple[int, str] | None = None
        self._drained = asyncio.Event()
        self._socket_gone = asyncio.Event()

    async def _start(self, host: str, port: int) -> None:
        loop = asyncio.get_running_loop()
        infos = await loop.getaddrinfo(host, port, type=socket.SOCK_DGRAM,
                                       flags=socket.AI_PASSIVE)
        family, _, _, _, addr = infos[0]
        sock = socket.socket(family, socket.SOCK_DGRAM)
        try:
            sock.setblocking(False)
            _set_udp_buffers(sock, self._config.udp_buffer_size)
            sock.bind(addr)
        except BaseException:
            sock.close()
            raise

        def make_server() -> _QuicServer:
            server = _QuicServer(configuration=self._qconf, create_protocol=self._new_protocol)
            server.owner = self
            return server

        _, server = await loop.create_datagram_endpoint(make_server, sock=sock)
        self._server = server
        self._address = _plain_address(sock.getsockname())

    def _new_protocol(self, quic: QuicConnection, stream_handler: Any = None) -> _Protocol:
        conn = AioquicConnection(quic=quic, config=self._config,
                                 handler_factory=self._factory, url=None,
                                 on_terminated=self._conn_terminated)
        protocol = _Protocol(quic)
        conn._attach(protocol)
        self._all.add(conn)
        if self._closing is not None:  # refuse newcomers politely while shutting down
            quic.close(error_code=self._closing[0], reason_phrase=self._closing[1])
            conn._mark_closed(CloseInfo(self._closing[0], self._closing[1], True, True))
            protocol._transmit_soon()
        return protocol

    def _conn_terminated(self, conn: AioquicConnection) -> None:
        self._all.discard(conn)
        if self._closing is not None and not self._all:
            self._drained.set()

    def _socket_closed(self) -> None:
        self._socket_gone.set()

    @property
    def address(self) -> Address:
        return self._address

    @property
    def connections(self) -> frozenset[Connection]:
        return frozenset(c for c in self._all if c._handler is not None and not c.is_closed)

    def close(self, error_code: int = 0, reason: str = "") -> None:
        if self._closing is not None:
            return
        self._closing = (error_code, reason)
        for conn in list(self._all):
            if conn._close_info is None:
                if conn._handler is not None:
                    conn.close(error_code, reason)
                else:
                    conn._reject(error_code, reason)
        if not self._all:
            self._drained.set()

    async def wait_closed(self) -> None:
        if self._closing is None:
            raise RuntimeError("call close() first")
        try:
            await asyncio.wait_for(self._drained.wait(), _SERVER_CLOSE_GRACE)
        except asyncio.TimeoutError:
            logger.warning("%d connections still closing; closing the socket anyway",
                           len(self._all))
        if self._server is not None and self._server._transport is not None:
            self._server._transport.close()
            await self._socket_gone.wait()


async def serve(host: str, port: int, handler_factory: HandlerFactory,
                config: TransportConfig | None = None) -> AioquicServer:
    """Listen for QUIC connections on ``host:port`` (port 0: any free port, see
    :attr:`AioquicServer.port`). Each connection that completes the handshake and negotiates
    DATAGRAM gets ``handler_factory()``."""
    config = config or TransportConfig()
    server = AioquicServer(config, handler_factory)
    await server._start(host, port)
    return server
