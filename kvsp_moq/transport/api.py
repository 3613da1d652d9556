"""The backend-neutral interface between a QUIC library and the protocol above it.

This module names what a sans-IO protocol object (the MOQT session) is driven through. It
imports no QUIC library, so ``pubsub/``, the relay and tests can be typed against it while the
backend (``"aioquic"`` or ``"qh3"``) is chosen by ``TransportConfig.backend``.

The transport moves bytes, and knows nothing of what they mean:

* the upper layer implements :class:`ConnectionHandler` (six callbacks, all synchronous,
  all called on the event loop thread, in the order QUIC delivered the events);
* it is handed a :class:`Connection` in :meth:`ConnectionHandler.connection_made` and drives
  streams and datagrams through it. Sending never blocks; bulk senders bound the bytes the
  QUIC library buffers with :meth:`Connection.wait_writable` /
  :meth:`Connection.stream_send_buffered`, or use :meth:`Connection.write`, which does it.

Stream IDs are QUIC stream IDs (RFC 9000 §2.1): the two low bits say who opened the stream
and whether it is unidirectional; see :func:`is_unidirectional` and friends.

Errors: misuse (sending on a receive-only stream, a datagram too large) raises
:class:`ValueError`; sending on a stream whose send side was reset or stopped raises
:class:`StreamClosedError`; using a closed connection raises :class:`ConnectionClosedError`;
a failed handshake raises :class:`ConnectError` from ``connect``. An exception raised by a
handler callback is a bug of the upper layer: the transport logs it and closes the connection
with ``TransportConfig.internal_error_code``.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:  # pragma: no cover
    from .url import MoqtUrl

__all__ = [
    "Address",
    "Backend",
    "BackendUnavailableError",
    "BaseConnectionHandler",
    "CloseInfo",
    "ConnectError",
    "Connection",
    "ConnectionClosedError",
    "ConnectionHandler",
    "HandlerFactory",
    "Server",
    "StreamClosedError",
    "TransportError",
    "is_bidirectional",
    "is_client_initiated",
    "is_locally_initiated",
    "is_unidirectional",
]

#: A network address as ``(host, port)``; IPv4-mapped IPv6 addresses are given as IPv4.
Address = tuple[str, int]


# ------------------------------------------------------------------------------------------
# stream IDs (RFC 9000 §2.1)


def is_client_initiated(stream_id: int) -> bool:
    """True when the client opened the stream (bit 0x1 clear)."""
    return not stream_id & 0x1


def is_unidirectional(stream_id: int) -> bool:
    """True for a unidirectional stream (bit 0x2 set)."""
    return bool(stream_id & 0x2)


def is_bidirectional(stream_id: int) -> bool:
    """True for a bidirectional stream (bit 0x2 clear)."""
    return not stream_id & 0x2


def is_locally_initiated(stream_id: int, is_client: bool) -> bool:
    """True when the endpoint that is (or is not) the client opened the stream."""
    return is_client_initiated(stream_id) == is_client


# ------------------------------------------------------------------------------------------
# errors


class TransportError(Exception):
    """Base class of the errors the transport raises."""


class BackendUnavailableError(TransportError, ImportError):
    """The backend named by ``TransportConfig.backend`` cannot be imported: its package is
    not installed. ``package`` is the distribution to install."""

    def __init__(self, backend: str, package: str, cause: BaseException) -> None:
        super().__init__(
            f"QUIC backend {backend!r} needs the Python package {package!r}, which cannot be "
            f"imported ({cause}); install it (pip install 'kvsp-moq[{package}]') or choose "
            f"another backend (TransportConfig.backend / $KVSP_QUIC_BACKEND)")
        self.backend = backend
        self.package = package


class ConnectError(TransportError):
    """The connection could not be established: no common ALPN, the certificate was not
    trusted, the peer did not negotiate the QUIC DATAGRAM extension, or the handshake timed
    out. ``error_code`` is the QUIC (transport or application) close code when there was one,
    ``reason`` the close reason."""

    def __init__(self, message: str, *, error_code: int | None = None, reason: str = "") -> None:
        super().__init__(message)
        self.error_code = error_code
        self.reason = reason


class ConnectionClosedError(TransportError):
    """An operation needed an open connection. ``info`` says how it was closed."""

    def __init__(self, info: CloseInfo) -> None:
        super().__init__(f"connection closed: {info}")
        self.info = info


class StreamClosedError(TransportError):
    """The send side of ``stream_id`` was reset locally, stopped by the peer (STOP_SENDING),
    or finished. ``error_code`` is the reset / STOP_SENDING code, ``None`` if finished."""

    def __init__(self, stream_id: int, error_code: int | None, message: str = "") -> None:
        super().__init__(message or f"stream {stream_id} can no longer send (code {error_code})")
        self.stream_id = stream_id
        self.error_code = error_code


@dataclass(frozen=True, slots=True)
class CloseInfo:
    """How a connection ended.

    ``error_code`` and ``reason`` come from the CONNECTION_CLOSE frame (sent or received);
    ``application`` is True for an application close (0x1d, the code is the upper layer's, e.g.
    an MOQT session error) and False for a QUIC transport error (0x1c, the code is RFC 9000's),
    which includes the idle timeout; ``local`` is True when this endpoint closed it.
    """

    error_code: int
    reason: str
    application: bool
    local: bool

    def __str__(self) -> str:
        kind = "application" if self.application else "transport"
        side = "local" if self.local else "peer"
        return f"{kind} close 0x{self.error_code:x} by {side}: {self.reason!r}"


# ------------------------------------------------------------------------------------------
# what the upper layer implements


@runtime_checkable
class ConnectionHandler(Protocol):
    """Callbacks of one connection, implemented by the protocol object above the transport.

    All are called on the event loop, synchronously, in the order QUIC produced the events;
    none may block. ``connection_made`` comes first (after the handshake succeeded, ALPN and
    DATAGRAM support checked), ``connection_lost`` last and exactly once after it.
    """

    def connection_made(self, conn: Connection, alpn: str) -> None:
        """The handshake completed; ``alpn`` is the negotiated ALPN (e.g. ``"moqt-22"``)."""

    def stream_data(self, stream_id: int, data: bytes | memoryview, end_stream: bool) -> None:
        """Bytes arrived in order on ``stream_id`` (``data`` may be empty when only the FIN
        arrives). The first call for a peer-opened stream is how the upper layer learns of
        it. ``data`` is not copied by the transport; keep it or copy it as needed."""

    def stream_reset(self, stream_id: int, error_code: int) -> None:
        """The peer reset its send side of ``stream_id`` (RESET_STREAM)."""

    def stop_sending(self, stream_id: int, error_code: int) -> None:
        """The peer asked us to stop sending on ``stream_id`` (STOP_SENDING). The transport
        has already reset our send side with the same code (RFC 9000 §3.5); further sends
        on it raise :class:`StreamClosedError`."""

    def datagram_received(self, data: bytes | memoryview) -> None:
        """A QUIC DATAGRAM frame arrived (RFC 9221)."""

    def connection_lost(self, error_code: int, reason: str) -> None:
        """The connection ended (closed by either side, idle timeout, or error); see
        :attr:`Connection.close_info` for who closed it and which kind of close it was."""


class BaseConnectionHandler:
    """A :class:`ConnectionHandler` whose callbacks do nothing; subclass and override."""

    conn: Connection | None = None

    def connection_made(self, conn: Connection, alpn: str) -> None:
        self.conn = conn

    def stream_data(self, stream_id: int, data: bytes | memoryview, end_stream: bool) -> None:
        pass

    def stream_reset(self, stream_id: int, error_code: int) -> None:
        pass

    def stop_sending(self, stream_id: int, error_code: int) -> None:
        pass

    def datagram_received(self, data: bytes | memoryview) -> None:
        pass

    def connection_lost(self, error_code: int, reason: str) -> None:
        pass


#: Makes the handler of a new connection; called once per connection, right before
#: ``connection_made``.
HandlerFactory = Callable[[], ConnectionHandler]


# ------------------------------------------------------------------------------------------
# what the transport gives the upper layer


class Connection(abc.ABC):
    """A QUIC connection, as the upper layer sees it. Created by the backend."""

    # -- identity ---------------------------------------------------------------------------
    @property
    @abc.abstractmethod
    def alpn(self) -> str:
        """The negotiated ALPN protocol (the MOQT version: ``moqt-NN``)."""

    @property
    @abc.abstractmethod
    def is_client(self) -> bool:
        """True on the endpoint that connected, False on the server."""

    @property
    @abc.abstractmethod
    def remote_address(self) -> Address:
        """The peer's current address."""

    @property
    @abc.abstractmethod
    def url(self) -> MoqtUrl | None:
        """The URL a client connected to (its authority and path go in the MOQT SETUP
        options AUTHORITY and PATH, sent by the MOQT layer); ``None`` on a server."""

    @property
    @abc.abstractmethod
    def max_datagram_payload(self) -> int:
        """The largest ``send_datagram`` payload that fits one QUIC packet and the peer's
        ``max_datagram_frame_size``."""

    @property
    @abc.abstractmethod
    def close_info(self) -> CloseInfo | None:
        """How the connection ended, once it has (or is closing); ``None`` while open."""

    @property
    def is_closed(self) -> bool:
        """True once the connection is closing or closed."""
        return self.close_info is not None

    @property
    def is_webtransport(self) -> bool:
        """True for a WebTransport session (``transport.webtransport``), False for a raw
        QUIC connection. MOQT sends no AUTHORITY / PATH over WebTransport."""
        return False

    def congestion_state(self) -> dict[str, Any] | None:
        """The congestion controller's state: ``algorithm``, ``congestion_window``,
        ``bytes_in_flight`` and, for BBR, its model (``max_bw``, ``min_rtt``, ``state`` ...:
        ``transport.bbr.BbrCongestionControl.snapshot``); None where the backend does not
        expose it (qh3, aiopquic). For logs and tests; read-only."""
        return None

    # -- streams ----------------------------------------------------------------------------
    @abc.abstractmethod
    def open_bidi(self) -> int:
        """Open a bidirectional stream and return its ID. The peer learns of it when the
        first bytes (or FIN) are sent."""

    @abc.abstractmethod
    def open_uni(self) -> int:
        """Open a unidirectional (send-only) stream and return its ID."""

    @abc.abstractmethod
    def send(self, stream_id: int, data: bytes | bytearray | memoryview,
             end_stream: bool = False) -> None:
        """Queue ``data`` on ``stream_id`` (FIN after it when ``end_stream``). Never blocks
        and never refuses bytes for flow control: pair it with :meth:`wait_writable` to bound
        what is buffered. ``data`` is copied once into the QUIC library's send buffer, so the
        caller may reuse it on return. Raises :class:`StreamClosedError` when the send side
        was reset or stopped, :class:`ConnectionClosedError` when the connection is closed."""

    def send_stable(self, stream_id: int, data: bytes | bytearray | memoryview,
                    end_stream: bool = False) -> None:
        """:meth:`send` for bytes that never change while the library may still need them (a
        stored object's payload: a store never rewrites a layer it handed out). A backend may
        keep a reference to ``data`` instead of copying it: the native backend sends from it
        and releases it once the peer acknowledged its bytes or the stream closed. The
        others copy it, as :meth:`send` does."""
        self.send(stream_id, data, end_stream)

    @abc.abstractmethod
    def reset_stream(self, stream_id: int, error_code: int) -> None:
        """Abandon our send side of ``stream_id`` (RESET_STREAM). Buffered bytes are
        dropped. A no-op if it was already reset or fully acknowledged."""

    @abc.abstractmethod
    def stop_sending(self, stream_id: int, error_code: int) -> None:
        """Ask the peer to stop sending on ``stream_id`` (STOP_SENDING). A no-op if the
        stream's receive side is already finished and gone."""

    # -- backpressure -----------------------------------------------------------------------
    @abc.abstractmethod
    def stream_send_buffered(self, stream_id: int) -> int:
        """Bytes of ``stream_id`` held by the QUIC library: queued but not yet sent (for
        lack of congestion or flow-control window) plus sent but not yet acknowledged."""

    @abc.abstractmethod
    async def wait_writable(self, stream_id: int, threshold: int | None = None) -> None:
        """Return once ``stream_send_buffered(stream_id) <= threshold`` (default
        ``TransportConfig.send_buffer_low_water``); at once if it already is. Raises
        :class:`StreamClosedError` if the send side is reset or stopped meanwhile, and
        :class:`ConnectionClosedError` if the connection closes."""

    async def write(self, stream_id: int, data: bytes | bytearray | memoryview,
                    end_stream: bool = False, *, stable: bool = False) -> None:
        """Send ``data`` (any size) on ``stream_id`` keeping at most
        ``TransportConfig.send_buffer_high_water`` bytes buffered in the QUIC library: it
        sends what fits, waits for the buffer to drain to the low-water mark, and repeats.
        The FIN goes with the last bytes when ``end_stream``. ``stable``: the bytes never
        change (:meth:`send_stable`)."""
        send = self.send_stable if stable else self.send
        view = data if isinstance(data, memoryview) else memoryview(data)
        if view.ndim != 1 or view.itemsize != 1:
            view = view.cast("B")
        high = self.send_buffer_high_water
        total = len(view)
        pos = 0
        while True:
            room = high - self.stream_send_buffered(stream_id)
            if pos < total and room <= 0:
                await self.wait_writable(stream_id)
                continue
            end = min(total, pos + room) if pos < total else total
            last = end == total
            if end > pos or (last and end_stream):
                send(stream_id, view[pos:end], end_stream=end_stream and last)
            pos = end
            if last:
                return

    @property
    @abc.abstractmethod
    def send_buffer_high_water(self) -> int:
        """The per-stream bound :meth:`write` keeps the send buffer under."""

    # -- datagrams --------------------------------------------------------------------------
    @abc.abstractmethod
    def send_datagram(self, data: bytes | bytearray | memoryview) -> None:
        """Queue one QUIC DATAGRAM frame. Raises :class:`ValueError` if ``len(data)`` exceeds
        :attr:`max_datagram_payload`. Datagrams are unreliable: they may be lost."""

    # -- lifetime ---------------------------------------------------------------------------
    @abc.abstractmethod
    def close(self, error_code: int = 0, reason: str = "") -> None:
        """Close the connection with an application error code (CONNECTION_CLOSE 0x1d) and a
        reason the peer sees. Idempotent; the handler's ``connection_lost`` follows once the
        closing period ends."""

    @abc.abstractmethod
    async def wait_closed(self) -> CloseInfo:
        """Wait until the connection has ended; return how."""

    @abc.abstractmethod
    async def drain(self) -> None:
        """Return once every stream's sent bytes are acknowledged by the peer (streams reset
        or stopped meanwhile count as drained). A sender calls it before a graceful close:
        closing the connection discards whatever is still buffered."""

    @abc.abstractmethod
    async def ping(self) -> None:
        """Send a PING and wait for its acknowledgement (a liveness probe / RTT sample)."""

    async def aclose(self, error_code: int = 0, reason: str = "") -> CloseInfo:
        """:meth:`close`, then :meth:`wait_closed`: on return the socket of a client
        connection is released."""
        self.close(error_code, reason)
        return await self.wait_closed()

    async def __aenter__(self) -> Connection:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


class Backend(Protocol):
    """What a backend module (``aioquic_backend``, ``qh3_backend``) provides; the package's
    ``connect``/``serve`` pick one by ``TransportConfig.backend``."""

    async def connect(self, url: str | MoqtUrl, handler_factory: HandlerFactory,
                      config: Any) -> Connection:
        """Open a client connection (handshake done, ``connection_made`` run)."""

    async def serve(self, host: str, port: int, handler_factory: HandlerFactory,
                    config: Any) -> Server:
        """Listen on ``host:port``."""


class Server(abc.ABC):
    """A listening endpoint. Each accepted connection gets a handler from the factory."""

    @property
    @abc.abstractmethod
    def address(self) -> Address:
        """The bound ``(host, port)`` (the real port when 0 was asked for)."""

    @property
    def port(self) -> int:
        """The bound UDP port."""
        return self.address[1]

    @property
    @abc.abstractmethod
    def connections(self) -> frozenset[Connection]:
        """The established connections that have not ended yet."""

    @abc.abstractmethod
    def close(self, error_code: int = 0, reason: str = "") -> None:
        """Stop accepting connections and close the open ones with ``error_code``."""

    @abc.abstractmethod
    async def wait_closed(self) -> None:
        """Wait until every connection has ended and the socket is closed."""

    async def __aenter__(self) -> Server:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()
        await self.wait_closed()
