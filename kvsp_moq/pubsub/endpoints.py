"""Where pubsub sessions come from: :func:`connect` (a client :class:`~.session.MoqtSession`
once SETUP was exchanged) and :func:`serve` (a listening :class:`MoqtServer` whose sessions
share one :class:`~.publish.Catalog`), on the transport's ``connect`` / ``serve``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

from ..moqt.errors import SessionErrorCode
from ..moqt.session import Role, SessionConfig
from ..transport import Server, TransportConfig, parse_moqt_url
from ..transport import connect as transport_connect
from ..transport import serve as transport_serve
from ..transport.tls import check_credentials
from .limits import DEFAULT_RECEIVE_LIMITS, ReceiveLimits
from .publish import Catalog
from .session import GUARD, MoqtSession, RequestGate, TokenLike

__all__ = ["MoqtServer", "connect", "serve"]


async def connect(url: str, config: TransportConfig | None = None, *,
                  catalog: Catalog | None = None,
                  session_config: SessionConfig | None = None,
                  setup_timeout: float = GUARD, accept_publish: bool = False,
                  setup_tokens: Sequence[TokenLike] = (),
                  receive_limits: ReceiveLimits = DEFAULT_RECEIVE_LIMITS) -> MoqtSession:
    """Connect to ``moqt://host:port/path`` (or ``https://host:port/path``: WebTransport);
    return the session once SETUP was exchanged. The MOQT version is the ALPN (WT-Protocol)
    negotiated from ``config.alpn_protocols``.
    ``setup_tokens``: AUTHORIZATION_TOKEN Setup Options (a ``Token``, or bytes / str sent
    as USE_VALUE with Token Type 0). Tokens over an unverified connection (``insecure``) to
    a host other than loopback raise ``InsecureCredentialsError`` before anything is sent
    (``transport.tls.check_credentials``; docs/security.md)."""
    parsed = parse_moqt_url(url)
    if setup_tokens and config is not None:
        check_credentials(url, config)
    cfg = session_config or SessionConfig()
    if not parsed.is_webtransport:  # WebTransport carries them in CONNECT (§"PATH")
        if cfg.path is None:
            cfg.path = parsed.path_and_query
        if cfg.authority is None:
            cfg.authority = parsed.authority
    made: list[MoqtSession] = []

    def factory() -> MoqtSession:
        s = MoqtSession(Role.CLIENT, catalog=catalog, session_config=cfg,
                        accept_publish=accept_publish, setup_tokens=setup_tokens,
                        receive_limits=receive_limits)
        made.append(s)
        return s

    conn = await transport_connect(parsed, factory, config)
    session = made[0]
    try:
        await asyncio.wait_for(asyncio.shield(session.ready), setup_timeout)
    except BaseException:
        conn.close(SessionErrorCode.CONTROL_MESSAGE_TIMEOUT, "no SETUP")
        raise
    return session


class MoqtServer:
    """A listening MOQT endpoint (wraps the transport server)."""

    def __init__(self) -> None:
        #: The transport server; set by :func:`serve` once it listens.
        self.server: Server | None = None
        self.sessions: set[MoqtSession] = set()

    def _listening(self) -> Server:
        if self.server is None:
            raise RuntimeError("the MOQT server is not listening yet")
        return self.server

    @property
    def port(self) -> int:
        return self._listening().port

    def close(self) -> None:
        self._listening().close()

    async def wait_closed(self) -> None:
        await self._listening().wait_closed()

    async def __aenter__(self) -> MoqtServer:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()
        await self.wait_closed()


async def serve(host: str, port: int, config: TransportConfig, *,
                on_session: Callable[[MoqtSession], object] | None = None,
                catalog: Catalog | None = None,
                session_config: SessionConfig | None = None,
                accept_publish: bool = False, gate: RequestGate | None = None,
                receive_limits: ReceiveLimits = DEFAULT_RECEIVE_LIMITS) -> MoqtServer:
    """Listen for MOQT clients; ``on_session(session)`` (sync or async) runs once each
    client's SETUP arrived. Sessions serve the tracks of ``catalog`` (shared); ``gate``
    authorizes every request of every session (:class:`RequestGate`)."""
    srv = MoqtServer()
    shared = catalog if catalog is not None else Catalog()

    def factory() -> MoqtSession:
        s = MoqtSession(Role.SERVER, catalog=shared, session_config=session_config,
                        accept_publish=accept_publish, gate=gate,
                        receive_limits=receive_limits)
        srv.sessions.add(s)
        s.closed.add_done_callback(lambda _f: srv.sessions.discard(s))

        def on_ready(f: asyncio.Future[None]) -> None:
            if f.cancelled() or f.exception() is not None or on_session is None:
                return
            res = on_session(s)
            if asyncio.iscoroutine(res):
                s.spawn(res)

        s.ready.add_done_callback(on_ready)
        return s

    srv.server = await transport_serve(host, port, factory, config)
    return srv

