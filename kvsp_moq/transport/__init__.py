"""kvsp_moq.transport — QUIC for the layers above (DESIGN.md §2, §6).

The only package that imports a QUIC library. It moves bytes on QUIC streams and datagrams
for a protocol object above it (the sans-IO MOQT session) and knows nothing of what they mean.

* :mod:`.api` — the backend-neutral interface: :class:`ConnectionHandler` (implemented above),
  :class:`Connection` and :class:`Server` (implemented by a backend), errors.
* :mod:`.config` — :class:`TransportConfig`.
* :mod:`.url` — ``moqt://`` URLs.
* :mod:`.tls` — self-signed development certificates.
* :mod:`.loop` — ``run`` / ``new_event_loop`` with uvloop where available.
* :mod:`.aioquic_backend` — the implementation on aioquic (imported on first use).

``connect`` and ``serve`` pick the backend named by ``config.backend``. See docs/transport.md.
"""

from __future__ import annotations

from .api import (
    Address,
    BaseConnectionHandler,
    CloseInfo,
    ConnectError,
    Connection,
    ConnectionClosedError,
    ConnectionHandler,
    HandlerFactory,
    Server,
    StreamClosedError,
    TransportError,
    is_bidirectional,
    is_client_initiated,
    is_locally_initiated,
    is_unidirectional,
)
from .config import DEFAULT_ALPNS, TransportConfig
from .loop import new_event_loop, run, uvloop_available
from .url import MoqtUrl, parse_moqt_url

__all__ = [
    "DEFAULT_ALPNS",
    "Address",
    "BaseConnectionHandler",
    "CloseInfo",
    "ConnectError",
    "Connection",
    "ConnectionClosedError",
    "ConnectionHandler",
    "HandlerFactory",
    "MoqtUrl",
    "Server",
    "StreamClosedError",
    "TransportConfig",
    "TransportError",
    "connect",
    "is_bidirectional",
    "is_client_initiated",
    "is_locally_initiated",
    "is_unidirectional",
    "new_event_loop",
    "parse_moqt_url",
    "run",
    "serve",
    "uvloop_available",
]


async def connect(url: str | MoqtUrl, handler_factory: HandlerFactory,
                  config: TransportConfig | None = None) -> Connection:
    """Open a QUIC connection to a ``moqt://host[:port]/path`` URL with the backend named by
    ``config.backend``; return it once the handshake succeeded and
    ``handler.connection_made`` ran. Raises :class:`ConnectError` on a failed handshake."""
    config = config or TransportConfig()
    if config.backend == "aioquic":
        from . import aioquic_backend

        return await aioquic_backend.connect(url, handler_factory, config)
    raise ValueError(f"unknown transport backend {config.backend!r}")  # pragma: no cover


async def serve(host: str, port: int, handler_factory: HandlerFactory,
                config: TransportConfig | None = None) -> Server:
    """Listen on ``host:port`` (0 picks a free port: see ``Server.port``) with the backend
    named by ``config.backend``; every accepted connection gets ``handler_factory()``."""
    config = config or TransportConfig()
    if config.backend == "aioquic":
        from . import aioquic_backend

        return await aioquic_backend.serve(host, port, handler_factory, config)
    raise ValueError(f"unknown transport backend {config.backend!r}")  # pragma: no cover
