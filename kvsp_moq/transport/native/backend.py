"""The native backend (``TransportConfig.backend = "native"``): QUIC v1 on ngtcp2 0.12 and
GnuTLS in a network thread of its own, the C extension ``native._ngtcp2`` (issue #28;
:func:`kvsp_moq.transport.native.extension`).

Like aiopquic, and unlike aioquic and qh3, it is not sans-IO: the extension's network thread
does every per-packet step (UDP with GSO/GRO, crypto, loss recovery, pacing, congestion
control) and Python drains coalesced events when the endpoint's eventfd turns readable
(``loop.add_reader``). So it does not use the engine (``engine.py``/``udp.py``); it
implements :mod:`..api` directly:

* :mod:`.config` — ``TransportConfig`` → ``Endpoint(...)``'s arguments (what maps, what does
  not apply);
* :mod:`.opening` — streams opened beyond the peer's stream limit;
* :mod:`.connection` — the :class:`~kvsp_moq.transport.api.Connection` (on
  :class:`~kvsp_moq.transport.connection_core.ConnectionCore`);
* :mod:`.server` — the :class:`~kvsp_moq.transport.api.Server` (on
  :class:`~kvsp_moq.transport.server_core.ServerCore`): one endpoint, events dispatched to
  its connections by handle;
* this module — the :class:`~kvsp_moq.transport.api.Backend` shape: :func:`connect` and
  :func:`serve`.

A client connection owns an endpoint (a socket and a thread, like aioquic's client socket):
once the connection has ended (its ``closed`` event, then the closing or draining period) the
reader is removed and the endpoint closed, which joins the thread, before ``wait_closed``
returns. What differs from the other backends is listed in docs/transport.md, "native".

Importing this module loads the extension; ``load_backend("native")`` raises
:class:`~.unavailable.NativeUnavailableError` first where it is not built.
"""

from __future__ import annotations

import asyncio
import socket

from . import extension
from ..tls_files import TlsFiles
from .config import check_config, endpoint_options
from .connection import NativeConnection
from .server import NativeServer, serve
from ..api import HandlerFactory
from ..config import TransportConfig
from ..url import MoqtUrl, parse_moqt_url

__all__ = ["NativeConnection", "NativeServer", "connect", "serve"]

Endpoint = extension().Endpoint


async def connect(url: str | MoqtUrl, handler_factory: HandlerFactory,
                  config: TransportConfig) -> NativeConnection:
    """Connect to ``moqt://host:port/path`` with the native backend and complete the QUIC
    handshake; see :func:`kvsp_moq.transport.connect`."""
    target = parse_moqt_url(url) if isinstance(url, str) else url
    check_config(config, is_client=True)
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(target.host, target.port, type=socket.SOCK_DGRAM)
    family, _, _, _, addr = infos[0]
    host, port = str(addr[0]), int(addr[1])
    local = "::" if family == socket.AF_INET6 else "0.0.0.0"
    with TlsFiles("kvsp-native-") as files:
        options = endpoint_options(config, is_client=True, files=files)
        ep = Endpoint(False, local, 0, **options)  # GnuTLS reads the files here
    try:
        handle = ep.connect(host, port, config.server_name or target.host)
    except BaseException:
        ep.close()
        raise
    released = False

    def release(_: NativeConnection | None = None) -> None:
        nonlocal released
        if released:
            return
        released = True
        loop.remove_reader(ep.fileno())
        ep.close()  # joins the network thread, closes the socket
        conn.terminated()  # if its closed event never came (handshake timeout, cancelled)

    def on_readable() -> None:
        if released:
            return
        try:
            events = ep.events()
        except ValueError:  # closed meanwhile
            return
        for event in events:
            conn.on_event(event)
            if released:
                return

    conn = NativeConnection(endpoint=ep, handle=handle, config=config,
                            handler_factory=handler_factory, url=target, is_client=True,
                            peer=(host, port), on_ended=release)
    loop.add_reader(ep.fileno(), on_readable)
    await conn.await_handshake(release)
    return conn
