"""Where connections come from: :func:`connect` (a client socket per connection) and
:class:`EngineServer` (one listening socket; the library's ``QuicServer`` demultiplexes packets
to connections by connection ID), on :mod:`.udp` endpoints; :class:`EngineBackend` is the
:class:`~.api.Backend` shape of a library on them (a backend module is ``LIBRARY =
XLibrary()``, ``BACKEND = EngineBackend(LIBRARY)``, ``connect = BACKEND.connect``, ``serve =
BACKEND.serve``). This module imports no QUIC library: the library is a
:class:`~.library.QuicLibrary` argument.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from typing import Any

from .api import HandlerFactory
from .config import TransportConfig
from .connection_core import plain_address
from .engine import EngineConnection, EngineProtocol
from .library import QuicLibrary
from .server_core import ServerCore
from .udp import SERVER_RECV_BURST_OCTETS, UdpEndpoint, open_endpoint
from .url import MoqtUrl, parse_moqt_url

__all__ = ["EngineBackend", "EngineConnection", "EngineServer", "connect", "serve"]

logger = logging.getLogger(__name__)


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


def _bound_socket(family: int, addr: Any, config: TransportConfig) -> socket.socket:
    sock = socket.socket(family, socket.SOCK_DGRAM)
    try:
        sock.setblocking(False)
        _set_udp_buffers(sock, config.udp_buffer_size)
        if config.reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(addr)
    except BaseException:
        sock.close()
        raise
    return sock


# ------------------------------------------------------------------------------------------
# client


async def connect(library: QuicLibrary, url: str | MoqtUrl, handler_factory: HandlerFactory,
                  config: TransportConfig) -> EngineConnection:
    """Connect to ``moqt://host:port/path`` and complete the QUIC handshake; see
    :func:`kvsp_moq.transport.connect`."""
    target = parse_moqt_url(url) if isinstance(url, str) else url
    qconf = library.configuration(config, is_client=True,
                                  server_name=config.server_name or target.host)
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(target.host, target.port, type=socket.SOCK_DGRAM)
    family, _, _, _, addr = infos[0]
    sock = _bound_socket(family, ("::", 0, 0, 0) if family == socket.AF_INET6
                         else ("0.0.0.0", 0), config)
    quic = library.QuicConnection(configuration=qconf)
    endpoint: UdpEndpoint | None = None

    def closed(_: EngineConnection) -> None:
        if endpoint is not None:
            endpoint.close()

    conn = EngineConnection(library=library, quic=quic, config=config,
                            handler_factory=handler_factory, url=target, on_terminated=closed)
    protocol = EngineProtocol(quic, conn)
    try:
        endpoint = await open_endpoint(sock, protocol, gso=config.udp_gso, gro=config.udp_gro)
    except BaseException:
        sock.close()
        raise
    conn.set_peer(addr)
    protocol.connect(addr)
    await conn.await_handshake(endpoint.close)
    return conn


# ------------------------------------------------------------------------------------------
# server


class EngineServer(ServerCore[EngineConnection]):
    """A listening UDP socket accepting QUIC connections; the library's ``QuicServer``
    demultiplexes packets to connections by connection ID."""

    _log = logger
    _stopping = "closing the socket"

    def __init__(self, library: QuicLibrary, config: TransportConfig,
                 handler_factory: HandlerFactory) -> None:
        super().__init__(config, handler_factory)
        self._library = library
        self._qconf = library.configuration(config, is_client=False)
        self._endpoint: UdpEndpoint | None = None
        self._socket_gone = asyncio.Event()

    async def listen(self, host: str, port: int) -> None:
        """Transport-internal (:func:`serve`): bind ``host:port`` and start accepting."""
        loop = asyncio.get_running_loop()
        infos = await loop.getaddrinfo(host, port, type=socket.SOCK_DGRAM,
                                       flags=socket.AI_PASSIVE)
        family, _, _, _, addr = infos[0]
        sock = _bound_socket(family, addr, self._config)
        owner = self
        socket_gone = self._socket_gone

        class _Demux(self._library.QuicServer):  # type: ignore[name-defined]
            def connection_lost(self, exc: Exception | None) -> None:
                socket_gone.set()

            def error_received(self, exc: Exception) -> None:
                logger.debug("UDP error on server %s: %s", owner.address, exc)

        demux = _Demux(configuration=self._qconf, create_protocol=self._new_protocol)
        try:
            self._endpoint = await open_endpoint(sock, demux, gso=self._config.udp_gso,
                                                 gro=self._config.udp_gro,
                                                 burst_octets=SERVER_RECV_BURST_OCTETS)
        except BaseException:
            sock.close()
            raise
        self._address = plain_address(sock.getsockname())

    def _new_protocol(self, quic: Any, stream_handler: Any = None) -> EngineProtocol:
        conn = EngineConnection(library=self._library, quic=quic, config=self._config,
                                handler_factory=self._factory, url=None,
                                on_terminated=self._conn_ended)
        protocol = EngineProtocol(quic, conn)
        self._all.add(conn)
        if self._closing is not None:  # refuse newcomers politely while shutting down
            conn.refuse(*self._closing)
        return protocol

    @property
    def udp(self) -> UdpEndpoint | None:
        """The listening UDP endpoint."""
        return self._endpoint

    async def _stop_endpoint(self) -> None:
        if self._endpoint is not None:
            self._endpoint.close()
            await self._socket_gone.wait()


async def serve(library: QuicLibrary, host: str, port: int, handler_factory: HandlerFactory,
                config: TransportConfig) -> EngineServer:
    """Listen on ``host:port``; see :func:`kvsp_moq.transport.serve`."""
    server = EngineServer(library, config, handler_factory)
    await server.listen(host, port)
    return server


class EngineBackend:
    """A :class:`~.library.QuicLibrary` on the engine, in the :class:`~.api.Backend` shape:
    :meth:`connect` and :meth:`serve` with that library."""

    def __init__(self, library: QuicLibrary) -> None:
        self.library = library

    async def connect(self, url: str | MoqtUrl, handler_factory: HandlerFactory,
                      config: TransportConfig) -> EngineConnection:
        """Connect with this library; see :func:`kvsp_moq.transport.connect`."""
        return await connect(self.library, url, handler_factory, config)

    async def serve(self, host: str, port: int, handler_factory: HandlerFactory,
                    config: TransportConfig) -> EngineServer:
        """Listen with this library; see :func:`kvsp_moq.transport.serve`."""
        return await serve(self.library, host, port, handler_factory, config)
