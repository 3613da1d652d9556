"""kvsp_moq.transport — QUIC for the layers above (DESIGN.md §2, §6).

The only package that imports a QUIC library. It moves bytes on QUIC streams and datagrams
for a protocol object above it (the sans-IO MOQT session) and knows nothing of what they mean.

* :mod:`.api` — the backend-neutral interface: :class:`ConnectionHandler` (implemented above),
  :class:`Connection` and :class:`Server` (implemented by a backend), errors.
* :mod:`.config` — :class:`TransportConfig`.
* :mod:`.url` — ``moqt://`` URLs.
* :mod:`.tls` — self-signed development certificates.
* :mod:`.tls_files` — PEM material written to private files, for libraries that read paths.
* :mod:`.loop` — ``run`` / ``new_event_loop`` with uvloop where available.
* :mod:`.engine` — the one implementation of the interface on a sans-IO QUIC connection
  with aioquic's API, parametrized by a :class:`~.engine.QuicLibrary`.
* :mod:`.udp` — batched UDP I/O under it (GSO on send, GRO and bursts on receive).
* :mod:`.connection_core`, :mod:`.server_core` — what every backend's ``Connection`` and
  ``Server`` share (handler calls, close bookkeeping, waiters, the server's close sequence).
* :mod:`.aioquic_backend`, :mod:`.qh3_backend` — the two libraries (imported on first use).
* :mod:`.webtransport` — WebTransport sessions over HTTP/3 on any backend (``https://``).
* :mod:`.aiopquic.backend` — picoquic through aiopquic (Python >= 3.12): not sans-IO, so it
  implements the interface on aiopquic's own asyncio API instead of the engine.
* :mod:`.native.backend` — ngtcp2 and GnuTLS in our C extension (:mod:`.native`, built where
  the Debian packages are installed), its own network thread per endpoint; the interface
  on the extension's events, without the engine.

``connect`` and ``serve`` pick the backend named by ``config.backend`` (default
``$KVSP_QUIC_BACKEND`` or ``"aioquic"``). See docs/transport.md.
"""

from __future__ import annotations

import importlib

from .api import (
    Address,
    Backend,
    BackendUnavailableError,
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
from .config import BACKENDS, DEFAULT_ALPNS, TransportConfig
from .loop import new_event_loop, run, uvloop_available
from .url import MoqtUrl, parse_moqt_url

__all__ = [
    "BACKENDS",
    "DEFAULT_ALPNS",
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
    "available_backends",
    "load_backend",
    "new_event_loop",
    "parse_moqt_url",
    "run",
    "serve",
    "uvloop_available",
]


#: backend name -> (our module, the package it needs; native: the extension, checked apart)
_MODULES = {"aioquic": ("aioquic_backend", "aioquic"), "qh3": ("qh3_backend", "qh3"),
            "aiopquic": ("aiopquic.backend", "aiopquic"), "native": ("native.backend", "")}


def load_backend(name: str) -> Backend:
    """The backend module named ``name``. Raises :class:`BackendUnavailableError` (an
    ImportError) naming the package when its QUIC library is not installed, ValueError for an
    unknown name."""
    if name not in _MODULES:
        raise ValueError(f"unknown transport backend {name!r}; known: {BACKENDS}")
    module, package = _MODULES[name]
    if name == "native":
        from .native import unavailable_reason
        from .native.unavailable import NativeUnavailableError

        reason = unavailable_reason()
        if reason is not None:
            raise NativeUnavailableError(reason)
        return importlib.import_module(f"{__name__}.{module}")  # an ImportError now is a bug
    try:
        return importlib.import_module(f"{__name__}.{module}")
    except ImportError as exc:
        if exc.name is not None and exc.name.split(".")[0] != package:
            raise  # a bug of ours, not a missing package
        raise BackendUnavailableError(name, package, exc) from exc


def available_backends() -> tuple[str, ...]:
    """The backends whose QUIC library can be imported here, in :data:`BACKENDS` order."""
    names = []
    for name in BACKENDS:
        try:
            load_backend(name)
        except BackendUnavailableError:
            continue
        names.append(name)
    return tuple(names)


async def connect(url: str | MoqtUrl, handler_factory: HandlerFactory,
                  config: TransportConfig | None = None) -> Connection:
    """Open a QUIC connection to a ``moqt://host[:port]/path`` URL with the backend named by
    ``config.backend``; return it once the handshake succeeded and
    ``handler.connection_made`` ran. An ``https://`` URL opens a WebTransport session
    instead (ALPN ``h3``, the MOQT versions of ``config.alpn_protocols`` offered in
    WT-Available-Protocols; :mod:`.webtransport`), returned as the ``Connection``.
    Raises :class:`ConnectError` on a failed handshake,
    :class:`BackendUnavailableError` when the backend's package is missing."""
    config = config or TransportConfig()
    backend = load_backend(config.backend)
    target = parse_moqt_url(url) if isinstance(url, str) else url
    if target.is_webtransport:
        from . import webtransport
        return await webtransport.connect(backend, target, handler_factory, config)
    return await backend.connect(target, handler_factory, config)


async def serve(host: str, port: int, handler_factory: HandlerFactory,
                config: TransportConfig | None = None) -> Server:
    """Listen on ``host:port`` (0 picks a free port: see ``Server.port``) with the backend
    named by ``config.backend``; every accepted connection gets ``handler_factory()``. With
    ``config.webtransport`` the port also takes WebTransport sessions (ALPN ``h3``): each
    session gets ``handler_factory()`` and is the ``Connection`` its handler is given."""
    config = config or TransportConfig()
    if config.webtransport:
        from . import webtransport
        handler_factory = webtransport.serve_factory(config, handler_factory)
        config = webtransport.server_config(config)
    return await load_backend(config.backend).serve(host, port, handler_factory, config)
