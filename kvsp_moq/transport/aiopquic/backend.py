"""The aiopquic backend (``TransportConfig.backend = "aiopquic"``): picoquic through aiopquic
(the extra ``kvsp-moq[aiopquic]``; wheels for CPython >= 3.12 only; checked against 0.6.1).

Unlike aioquic and qh3, aiopquic is not sans-IO: each picoquic context runs its own network
thread with its own UDP socket (packets, timers, pacing, GSO in C), and hands events to the
asyncio thread over rings signalled by an eventfd. So this backend does not use the engine
(``engine.py``/``udp.py``); it implements :mod:`.api` on aiopquic's own asyncio classes:

* :mod:`.stack` — aiopquic's ``QuicConnection``/``QuicEngine``/``QuicConnectionProtocol``
  with taps for what the interface needs and its events do not carry;
* :mod:`.config` — ``TransportConfig`` → ``QuicConfiguration`` (TLS via files);
* :mod:`.sending` — the send queues in front of aiopquic's per-stream rings;
* :mod:`.connection` — the :class:`~kvsp_moq.transport.api.Connection` (on
  :class:`~kvsp_moq.transport.connection_core.ConnectionCore`, shared with the engine);
* :mod:`.server` — the :class:`~kvsp_moq.transport.api.Server` (on :class:`~kvsp_moq.transport.server_core.ServerCore`);
* this module — the :class:`~kvsp_moq.transport.api.Backend` shape: :func:`connect` and :func:`serve`.

A client connection owns a picoquic context (a thread and a socket), stopped once the
connection has ended (``wait_closed``). What differs from the other backends is listed in
docs/transport.md, "aiopquic".
"""

from __future__ import annotations

import sys

_SUPPORTED = sys.version_info >= (3, 12)  # a plain bool: type-checked on any version
if not _SUPPORTED:  # pragma: no cover - depends on the interpreter
    raise ImportError("aiopquic needs Python >= 3.12 (its wheels are cp312 and later)",
                      name="aiopquic")

import asyncio  # noqa: E402
import socket  # noqa: E402

from .config import quic_configuration, stream_ring_cap  # noqa: E402
from ..tls_files import TlsFiles  # noqa: E402
from .connection import AiopquicConnection  # noqa: E402
from .server import AiopquicServer, serve  # noqa: E402
from .stack import StackConnection, StackProtocol  # noqa: E402
from ..api import HandlerFactory  # noqa: E402
from ..config import TransportConfig  # noqa: E402
from ..url import MoqtUrl, parse_moqt_url  # noqa: E402

__all__ = ["AiopquicConnection", "AiopquicServer", "connect", "serve"]


async def connect(url: str | MoqtUrl, handler_factory: HandlerFactory,
                  config: TransportConfig) -> AiopquicConnection:
    """Connect to ``moqt://host:port/path`` with aiopquic and complete the QUIC handshake;
    see :func:`kvsp_moq.transport.connect`."""
    target = parse_moqt_url(url) if isinstance(url, str) else url
    loop = asyncio.get_running_loop()
    files = TlsFiles("kvsp-aiopquic-")
    try:
        qconf = quic_configuration(config, is_client=True, files=files,
                                   server_name=config.server_name or target.host)
        infos = await loop.getaddrinfo(target.host, target.port, type=socket.SOCK_DGRAM)
        addr = infos[0][4]
        host, port = str(addr[0]), int(addr[1])
        quic = StackConnection(configuration=qconf)
        quic.start_network_thread(port=0)  # picoquic's thread; it reads the PEM files now
    finally:
        files.cleanup()
    protocol: StackProtocol | None = None

    def release(_: AiopquicConnection | None = None) -> None:
        # Not from inside aiopquic's drain of this context's ring: on the next loop pass.
        loop.call_soon(stop)

    def stop() -> None:
        if protocol is not None:
            protocol.unwatch_eventfd()
        quic.stop()  # joins the network thread and closes the socket

    conn = AiopquicConnection(
        quic=quic, config=config, handler_factory=handler_factory, url=target,
        peer=(host[7:] if host.startswith("::ffff:") else host, port),
        ring_cap=stream_ring_cap(config), on_ended=release)
    quic.listener = conn
    protocol = StackProtocol(quic, conn)
    protocol.watch_eventfd(loop)
    protocol.connect((host, port))
    await conn.await_handshake(conn.terminated)
    return conn
