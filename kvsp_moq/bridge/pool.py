"""A pool of MOQT client connections of an instance, one session per holder or relay URL
(reused across loads). Not a §6.8 inference session: those live in the control plane."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

from ..moqt.messages import Token
from ..moqt.session import SessionConfig
from ..pubsub import MoqtSession, connect
from ..transport import TransportConfig

__all__ = ["MoqtPool", "SessionPool"]


class MoqtPool:
    """``await pool.get(url)``: a live session to ``url``, connected on first use (one
    connect in flight per URL), reconnected after it closed. A source that does not answer
    within ``connect_timeout`` seconds raises ``TimeoutError`` (a dead holder).

    ``setup_tokens``: AUTHORIZATION_TOKEN Setup Options sent on every connection (a bearer
    token of the control plane as bytes / str, or a ``Token``): the instance's credentials
    for the scopes it reads (binding §9)."""

    def __init__(self, config: TransportConfig | None = None, *,
                 connect_timeout: float = 5.0,
                 session_config: Callable[[], SessionConfig] | None = None,
                 setup_tokens: Sequence[Token | bytes | str] = ()) -> None:
        self.config = config or TransportConfig()  # verifies the server (docs/security.md)
        #: A fresh SessionConfig per connection (PATH / AUTHORITY, implementation...).
        self.session_config = session_config
        self.setup_tokens = tuple(setup_tokens)
        self.connect_timeout = connect_timeout
        self._sessions: dict[str, asyncio.Future[MoqtSession]] = {}

    async def get(self, url: str) -> MoqtSession:
        fut = self._sessions.get(url)
        if fut is not None and fut.done() and (fut.exception() is not None or
                                               _closed(fut.result())):
            fut = None
        if fut is None:
            fut = asyncio.ensure_future(asyncio.wait_for(
                connect(url, self.config, setup_timeout=self.connect_timeout,
                        session_config=self.session_config() if self.session_config else None,
                        setup_tokens=self.setup_tokens),
                self.connect_timeout))
            fut.add_done_callback(lambda f: f.cancelled() or f.exception())
            self._sessions[url] = fut
        return await asyncio.shield(fut)

    async def close(self) -> None:
        futs, self._sessions = list(self._sessions.values()), {}
        for fut in futs:
            if not fut.done():
                fut.cancel()
                continue
            if fut.exception() is None and not _closed(fut.result()):
                await fut.result().close()

    async def __aenter__(self) -> MoqtPool:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


def _closed(session: MoqtSession) -> bool:
    return session.closed.done() or session.moqt is None or session.moqt.closed
