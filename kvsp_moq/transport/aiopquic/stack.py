"""aiopquic's own classes, with the taps the aiopquic backend needs (checked against 0.6.1).

aiopquic is not sans-IO: each ``TransportContext`` runs picoquic on its own network thread
with its own UDP socket and hands events to the asyncio thread over rings, signalled by an
eventfd. Its asyncio API (``QuicConnectionProtocol`` fed by a ``QuicConnection`` on the client,
by a ``QuicEngine`` demultiplexing one socket on the server) turns the ring entries into
aioquic-like events but drops what the interface needs, so this module taps the raw entries
before they are converted:

* application close (``_EVT_APP_CLOSE``) versus transport close (``_EVT_CLOSE``): both become
  a bare ``ConnectionTerminated(error_code)``, without ``frame_type``;
* ``_EVT_STREAM_TX_DRAINED`` — the network thread took bytes from a stream's send ring after
  we armed it: room for more (the backpressure wake-up);
* ``_EVT_STREAM_DESTROY`` — picoquic released the stream: for one we finished, every byte
  and the FIN were acknowledged (RFC 9000 §3.1 "Data Recvd"), the only acknowledgement
  signal aiopquic gives per stream;
* the engine-level ``_EVT_READY`` (no connection): the server's thread bound its socket.

Internals used (one place each, all in this module; the other backend modules call the
public names given here): ``QuicConnection._handle_raw_event`` (the client's drain
callback), ``QuicEngine.route_event`` and ``._protocols`` (the server's demultiplexer), the
``_EVT_*`` constants of ``aiopquic.quic.connection``, ``QuicConnection._start_transport`` and
``QuicEngine._start_transport`` (:meth:`StackConnection.start_network_thread`,
:meth:`StackEngine.start_network_thread`), ``QuicConnectionProtocol._start``/``_stop``
(:meth:`StackProtocol.watch_eventfd`/:meth:`~StackProtocol.unwatch_eventfd`), and
``QuicConnection._transport`` (:func:`transport_context`). Imported only by the aiopquic
backend modules; importing it without aiopquic raises the ImportError that names the package.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any, Protocol

__all__ = [
    "EVT_APP_CLOSE",
    "EVT_CLOSE",
    "EVT_READY",
    "EVT_STREAM_DESTROY",
    "EVT_STREAM_TX_DRAINED",
    "QuicConfiguration",
    "RawListener",
    "StackConnection",
    "StackEngine",
    "StackProtocol",
    "events",
    "transport_context",
]

_connection: Any = importlib.import_module("aiopquic.quic.connection")
_protocol: Any = importlib.import_module("aiopquic.asyncio.protocol")
events: Any = importlib.import_module("aiopquic.quic.events")
QuicConfiguration: Any = importlib.import_module("aiopquic.quic.configuration").QuicConfiguration

EVT_CLOSE: int = _connection._EVT_CLOSE
EVT_APP_CLOSE: int = _connection._EVT_APP_CLOSE
EVT_READY: int = _connection._EVT_READY
EVT_STREAM_TX_DRAINED: int = _connection._EVT_STREAM_TX_DRAINED
EVT_STREAM_DESTROY: int = _connection._EVT_STREAM_DESTROY


def transport_context(quic: Any) -> Any:
    """The ``TransportContext`` (picoquic's context and network thread) of an aiopquic
    ``QuicConnection`` — its own on a client, the engine's on the server; None before it
    started. aiopquic keeps it in ``QuicConnection._transport``."""
    return quic._transport


class RawListener(Protocol):
    """What receives the tapped ring entries (an ``AiopquicConnection``)."""

    def raw_event(self, evt_type: int, stream_id: int, error_code: int) -> None:
        """One ring entry of this connection, before aiopquic converts it."""

    def quic_event(self, event: Any) -> None:
        """One converted event, in order."""


class StackConnection(_connection.QuicConnection):
    """A client ``QuicConnection`` (it owns its ``TransportContext``) whose ring entries
    are shown to ``listener`` first."""

    listener: RawListener | None = None

    def start_network_thread(self, port: int = 0) -> None:
        """Create and start this connection's ``TransportContext`` (picoquic's thread, its
        UDP socket on ``port``; it reads the configuration's PEM files now)."""
        self._start_transport(port=port)

    def _handle_raw_event(self, evt_type: int, stream_id: int, data: Any, is_fin: Any,
                          error_code: int, cnx_ptr: int, stream_ctx_ptr: int,
                          sc_ptr: int) -> None:
        if self.listener is not None and cnx_ptr:
            self.listener.raw_event(evt_type, stream_id, error_code)
        super()._handle_raw_event(evt_type, stream_id, data, is_fin, error_code, cnx_ptr,
                                  stream_ctx_ptr, sc_ptr)


class StackProtocol(_protocol.QuicConnectionProtocol):
    """Hands every event of one connection to its listener, in order, on the loop."""

    def __init__(self, quic: Any, listener: RawListener) -> None:
        super().__init__(quic)
        self.listener = listener

    def watch_eventfd(self, loop: Any) -> None:
        """Read the connection's events on ``loop`` (its eventfd registered there)."""
        self._start(loop)

    def unwatch_eventfd(self) -> None:
        """Stop reading them (the eventfd unregistered)."""
        self._stop()

    def quic_event_received(self, event: Any) -> None:
        self.listener.quic_event(event)


class StackEngine(_connection.QuicEngine):
    """aiopquic's server demultiplexer, showing each connection's ring entries to its
    protocol's listener before routing them, and reporting when its thread is ready."""

    def __init__(self, *, configuration: Any,
                 create_protocol: Callable[..., StackProtocol],
                 on_ready: Callable[[], None]) -> None:
        super().__init__(configuration=configuration, create_protocol=create_protocol)
        self._on_ready = on_ready

    def start_network_thread(self, port: int) -> None:
        """Create and start the server's ``TransportContext`` (picoquic's thread, its UDP
        socket bound to ``port``; it reads the configuration's PEM files now)."""
        self._start_transport(port=port)

    def route_event(self, ev: Any) -> None:
        evt_type, stream_id, _data, _fin, error_code, cnx_ptr = ev[:6]
        if not cnx_ptr:
            if evt_type == EVT_READY:
                self._on_ready()
            return
        protocol = self._protocols.get(cnx_ptr)
        if protocol is not None:
            protocol.listener.raw_event(evt_type, stream_id, error_code)
        super().route_event(ev)
