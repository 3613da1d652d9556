"""Raw MOQT and WebTransport on one server port, by ALPN: :func:`serve_factory`.

``transport.serve`` with ``TransportConfig.webtransport`` offers ``h3`` after the MOQT ALPNs
(``webtransport.server_config``) and wraps the upper layer's handler factory with
:func:`serve_factory`: a connection that negotiated ``h3`` gets an
:class:`~.endpoint.H3Endpoint` (each WebTransport session a handler from the factory), any
other ALPN the factory's handler itself (MOQT §"Session establishment": the client offers
``moqt-NN`` and ``h3``, the server's choice decides).
"""

from __future__ import annotations

from collections.abc import Callable

from ..api import BaseConnectionHandler, Connection, ConnectionHandler, HandlerFactory
from ..config import TransportConfig
from .endpoint import H3Endpoint

__all__ = ["AlpnDispatch", "serve_factory"]


def serve_factory(config: TransportConfig, handler_factory: HandlerFactory
                  ) -> Callable[[], ConnectionHandler]:
    """The handler factory of a server that takes raw MOQT and WebTransport on one port: a
    connection negotiating ``h3`` gets an :class:`H3Endpoint` (each session a handler from
    ``handler_factory``), any other ALPN ``handler_factory``'s handler itself."""

    def make() -> ConnectionHandler:
        return AlpnDispatch(config, handler_factory)

    return make


class AlpnDispatch(BaseConnectionHandler):
    """A server connection's handler until its ALPN is known, then its forwarder."""

    def __init__(self, config: TransportConfig, handler_factory: HandlerFactory) -> None:
        self._config = config
        self._factory = handler_factory
        self._inner: ConnectionHandler | None = None

    def connection_made(self, conn: Connection, alpn: str) -> None:
        self.conn = conn
        inner: ConnectionHandler = (H3Endpoint(self._config, is_client=False,
                                               handler_factory=self._factory)
                                    if alpn == "h3" else self._factory())
        self._inner = inner
        # the forwarders below are bound once: the connection calls them per event
        self.stream_data = inner.stream_data  # type: ignore[method-assign]
        self.stream_reset = inner.stream_reset  # type: ignore[method-assign]
        self.stop_sending = inner.stop_sending  # type: ignore[method-assign]
        self.datagram_received = inner.datagram_received  # type: ignore[method-assign]
        self.connection_lost = inner.connection_lost  # type: ignore[method-assign]
        inner.connection_made(conn, alpn)
