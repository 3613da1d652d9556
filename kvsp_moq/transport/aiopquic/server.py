"""The :class:`~kvsp_moq.transport.api.Server` of the aiopquic backend: :class:`AiopquicServer`.

One aiopquic ``QuicEngine`` (a :class:`~.stack.StackEngine`): one picoquic context
and network thread with one UDP socket, demultiplexing packets to connections in C. Each
connection it reports gets an :class:`~.connection.AiopquicConnection`.

picoquic binds the wildcard address of the family (``TransportConfig`` cannot narrow it to
``host``): serving on 127.0.0.1 listens on every IPv4 address of the machine. ``address``
reports the host that was asked for. picoquic cannot report the port it bound, so for port 0
the server reserves a free one first (bind, read, close) and binds that: another process could
take it in between, in which case the network thread never reports ready and :func:`serve`
tries another (port 0) or raises ``OSError`` (a given port).
"""

from __future__ import annotations

import asyncio
import logging
import socket
from typing import Any

from .config import quic_configuration, stream_ring_cap
from ..tls_files import TlsFiles
from .connection import AiopquicConnection
from .stack import StackEngine, StackProtocol
from ..api import HandlerFactory
from ..config import TransportConfig
from ..server_core import ServerCore

__all__ = ["AiopquicServer", "serve"]

logger = logging.getLogger(__name__)

_READY_TIMEOUT = 5.0  # seconds for the network thread to bind its socket
_PORT_ATTEMPTS = 3


def _free_port(family: int) -> int:
    """A UDP port free on the wildcard address of ``family`` right now."""
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.bind(("::" if family == socket.AF_INET6 else "0.0.0.0", 0))
        return int(probe.getsockname()[1])


class AiopquicServer(ServerCore[AiopquicConnection]):
    """A picoquic server context accepting QUIC connections."""

    _log = logger

    def __init__(self, config: TransportConfig, handler_factory: HandlerFactory) -> None:
        super().__init__(config, handler_factory)
        self._ring_cap = stream_ring_cap(config)
        self._loop = asyncio.get_running_loop()
        self._engine: Any = None
        self._ready = asyncio.Event()
        self._stopped = False

    async def listen(self, host: str, port: int) -> None:
        """Transport-internal (:func:`serve`): start picoquic's server context on
        ``host:port`` (a free port for 0) and wait until its thread listens."""
        infos = await self._loop.getaddrinfo(host or None, port, type=socket.SOCK_DGRAM,
                                             flags=socket.AI_PASSIVE)
        family, _, _, _, addr = infos[0]
        attempts = _PORT_ATTEMPTS if port == 0 else 1
        for attempt in range(attempts):
            bind_port = _free_port(family) if port == 0 else port
            files = TlsFiles("kvsp-aiopquic-")
            try:
                qconf = quic_configuration(self._config, is_client=False, files=files,
                                           family=family)
                self._ready.clear()
                engine = StackEngine(configuration=qconf, create_protocol=self._new_protocol,
                                     on_ready=self._ready.set)
                engine.start_network_thread(bind_port)  # picoquic reads the PEM files here
            finally:
                files.cleanup()
            self._loop.add_reader(engine.eventfd, engine.drain_and_route)
            try:
                await asyncio.wait_for(self._ready.wait(), _READY_TIMEOUT)
            except asyncio.TimeoutError:
                self._loop.remove_reader(engine.eventfd)
                engine.close()
                if attempt + 1 == attempts:
                    raise OSError(f"picoquic could not listen on UDP port {bind_port}") from None
                continue
            self._engine = engine
            self._address = (str(addr[0]), bind_port)
            return

    def _new_protocol(self, quic: Any, stream_handler: Any = None) -> StackProtocol:
        peer = quic.peer_address()
        conn = AiopquicConnection(
            quic=quic, config=self._config, handler_factory=self._factory, url=None,
            peer=None if peer is None else (str(peer[0]), int(peer[1])),
            ring_cap=self._ring_cap, admit=lambda: self._closing,
            on_ended=self._conn_ended)
        self._all.add(conn)
        return StackProtocol(quic, conn)

    async def _stop_endpoint(self) -> None:
        if self._stopped or self._engine is None:
            return
        self._stopped = True
        engine = self._engine
        self._loop.remove_reader(engine.eventfd)
        engine.close()  # joins picoquic's thread; the socket is closed
        for conn in list(self._all):
            conn.terminated()


async def serve(host: str, port: int, handler_factory: HandlerFactory,
                config: TransportConfig) -> AiopquicServer:
    """Listen on ``host:port`` with aiopquic; see :func:`kvsp_moq.transport.serve`."""
    server = AiopquicServer(config, handler_factory)
    await server.listen(host, port)
    return server
