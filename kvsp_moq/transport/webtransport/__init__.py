"""WebTransport over HTTP/3 (draft-ietf-webtrans-http3, RFC 9220, RFC 9297) on any backend.

MOQT runs over a WebTransport session as over a raw QUIC connection (MOQT §"Session
establishment"): a :class:`~.session.WebTransportSession` is a
:class:`~kvsp_moq.transport.api.Connection`, so the layers above are unchanged. The HTTP/3
layer (:class:`~.endpoint.H3Endpoint`) is a handler of an ordinary transport connection with
ALPN ``h3`` and speaks only the ``Connection`` interface: it works on the aioquic, qh3 and
aiopquic backends alike, and stream IDs stay the QUIC library's.

* :mod:`.h3` — codes, frames, SETTINGS, capsules, the error-code mapping (sans-IO).
* :mod:`.session` — :class:`WebTransportSession`.
* :mod:`.endpoint` — :class:`H3Endpoint` (control and QPACK streams, CONNECT, routing).
* :mod:`.dispatch` — :func:`serve_factory` (raw MOQT and WebTransport on one port, by ALPN).

:func:`connect` opens a session to an ``https://`` URL; a server takes sessions when
``TransportConfig.webtransport`` is set (``transport.serve`` wraps its handler factory with
:func:`serve_factory` and offers ``h3`` after the MOQT ALPNs). See docs/transport.md,
"WebTransport".
"""

from __future__ import annotations

import asyncio

from ..api import Backend, ConnectError, HandlerFactory, TransportError
from ..config import TransportConfig
from ..url import MoqtUrl
from .dispatch import serve_factory
from .endpoint import H3Endpoint
from .h3 import H3ErrorCode
from .session import WebTransportSession

__all__ = ["ALPN_H3", "H3Endpoint", "WebTransportSession", "connect", "server_config",
           "serve_factory"]

#: The ALPN of HTTP/3 (RFC 9114 §3.1), which a WebTransport session runs on.
ALPN_H3 = "h3"


async def connect(backend: Backend, url: MoqtUrl, handler_factory: HandlerFactory,
                  config: TransportConfig) -> WebTransportSession:
    """Open a QUIC connection with ALPN ``h3`` to ``url`` (an ``https://`` URL) and a
    WebTransport session on it offering ``config.alpn_protocols``; return the session once
    the server accepted it and ``handler.connection_made`` ran. The QUIC handshake and the
    CONNECT are each bounded by ``config.handshake_timeout``. Raises
    :class:`~kvsp_moq.transport.api.ConnectError` on a refusal."""
    endpoint = H3Endpoint(config, is_client=True)
    conn = await backend.connect(url, lambda: endpoint,
                                 config.replace(alpn_protocols=(ALPN_H3,)))
    try:
        return await asyncio.wait_for(endpoint.open_session(url, handler_factory),
                                      config.handshake_timeout)
    except asyncio.TimeoutError:
        conn.close(H3ErrorCode.H3_REQUEST_CANCELLED, "WebTransport CONNECT timed out")
        await conn.wait_closed()
        raise ConnectError(f"WebTransport CONNECT to {url} got no answer within "
                           f"{config.handshake_timeout} s") from None
    except ConnectError as exc:
        conn.close(H3ErrorCode.H3_NO_ERROR, "WebTransport refused")
        await conn.wait_closed()
        raise exc from None
    except (BaseException, TransportError):
        conn.close(H3ErrorCode.H3_REQUEST_CANCELLED, "cancelled")
        raise


def server_config(config: TransportConfig) -> TransportConfig:
    """``config`` with ``h3`` offered after its MOQT ALPNs (a server taking both)."""
    if ALPN_H3 in config.alpn_protocols:
        return config
    return config.replace(alpn_protocols=(*config.alpn_protocols, ALPN_H3))
