"""The :class:`~kvsp_moq.transport.api.Server` of the native backend: :class:`NativeServer`.

One ``_ngtcp2.Endpoint`` (one UDP socket bound to ``host:port``, one network thread that
demultiplexes packets to connections by connection ID in C). Its eventfd is watched with
``loop.add_reader``; each drain hands the events to the connections by handle, and an
``established`` event makes a new :class:`~.connection.NativeConnection`. A handshake that
fails never reaches Python. ``close`` closes or refuses every connection; ``wait_closed``
waits for their ``closed`` events (within the grace period of
:class:`~..server_core.ServerCore`), then removes the reader and closes the endpoint, which
joins the network thread.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from typing import Any

from . import extension
from ..tls_files import TlsFiles
from .config import endpoint_options
from .connection import NativeConnection
from ..api import HandlerFactory
from ..config import TransportConfig
from ..connection_core import plain_address
from ..server_core import ServerCore

__all__ = ["NativeServer", "serve"]

logger = logging.getLogger(__name__)

Endpoint = extension().Endpoint


class NativeServer(ServerCore[NativeConnection]):
    """A native endpoint accepting QUIC connections."""

    _log = logger
    _stopping = "closing the endpoint"

    def __init__(self, config: TransportConfig, handler_factory: HandlerFactory) -> None:
        super().__init__(config, handler_factory)
        self._loop = asyncio.get_running_loop()
        self._ep: Any = None
        self._by_handle: dict[int, NativeConnection] = {}

    async def listen(self, host: str, port: int) -> None:
        """Transport-internal (:func:`serve`): bind ``host:port`` and start accepting."""
        with TlsFiles("kvsp-native-") as files:
            options = endpoint_options(self._config, is_client=False, files=files)
            infos = await self._loop.getaddrinfo(host or None, port, type=socket.SOCK_DGRAM,
                                                 flags=socket.AI_PASSIVE)
            addr = infos[0][4]
            # GnuTLS reads the PEM files here, before they are removed.
            self._ep = Endpoint(True, str(addr[0]), port, **options)
        self._address = plain_address(self._ep.local_address())
        self._loop.add_reader(self._ep.fileno(), self._on_readable)

    @property
    def endpoint(self) -> Any:
        """Transport-internal: the ``_ngtcp2.Endpoint`` (None once closed)."""
        return self._ep

    def _on_readable(self) -> None:
        ep = self._ep
        if ep is None:
            return
        try:
            events = ep.events()
        except ValueError:  # closed meanwhile
            return
        conns = self._by_handle
        for event in events:
            conn = conns.get(event[1])
            if conn is not None:
                conn.on_event(event)
            elif event[0] == "established":
                self._accept(event)
            # else: a connection that ended (or was never handed over): nothing to tell

    def _accept(self, event: tuple[Any, ...]) -> None:
        handle = event[1]
        conn = NativeConnection(
            endpoint=self._ep, handle=handle, config=self._config,
            handler_factory=self._factory, url=None, is_client=False,
            admit=lambda: self._closing, on_ended=self._ended)
        self._by_handle[handle] = conn
        self._all.add(conn)
        conn.on_event(event)

    def _ended(self, conn: NativeConnection) -> None:
        self._by_handle.pop(conn.handle, None)
        self._conn_ended(conn)

    async def _stop_endpoint(self) -> None:
        ep, self._ep = self._ep, None
        if ep is None:
            return
        self._loop.remove_reader(ep.fileno())
        ep.close()  # every connection still open gets CONNECTION_CLOSE; the thread is joined
        for conn in list(self._all):
            conn.terminated()


async def serve(host: str, port: int, handler_factory: HandlerFactory,
                config: TransportConfig) -> NativeServer:
    """Listen on ``host:port`` with the native backend; see :func:`kvsp_moq.transport.serve`."""
    server = NativeServer(config, handler_factory)
    await server.listen(host, port)
    return server
