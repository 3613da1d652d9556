"""A pool of MOQT client connections of an instance, one session per holder or relay URL
(reused across loads). Not a §6.8 inference session: those live in the control plane.

GOAWAY (draft-ietf-moq-transport-22 §"GOAWAY", §"Session Migration"): once a session's
peer sent GOAWAY the pool hands it out no more and opens a new session at once, to the New
Session URI if the GOAWAY carried one ("The client MUST use this URI for the new session if
provided"), else to the same URL ("If the URI is zero bytes long, the current URI is reused
instead"). The old session is left to finish what it carries and is closed by us as soon as
it has no request of ours in flight (§"Session Migration": "it's RECOMMENDED that the client
waits until there are no more active requests before closing the session"). A request the
old session refused because of the GOAWAY (REQUEST_ERROR GOING_AWAY from the peer, or ours
before sending) is retried once on the new session: :meth:`MoqtPool.call`,
:func:`refused_by_goaway`.

A relay that dies or restarts (issue 19; ``kvsp_moq.pubsub.liveness``): every session is
PINGed every ``reconnect.keepalive`` seconds, and one whose PING is not acknowledged within
``reconnect.liveness_timeout`` is closed and dropped (a relay killed and restarted on the same
port drops the old connection's packets silently: without the probe the session would look
open until the QUIC idle timeout). Its requests in flight fail at once with the session's close
(their loads fall over to the next source) and the next :meth:`MoqtPool.get` connects again,
reaching the restarted relay at the same URL. A URL whose connect failed is not tried again
before a backoff (``reconnect.backoff_initial``, doubling per failure up to
``reconnect.backoff_max``): meanwhile :meth:`MoqtPool.get` raises ``ConnectionError`` at once,
so a load falls over to its next source without waiting ``connect_timeout`` for a relay that is
down.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

from ..moqt.errors import RequestErrorCode, SessionErrorCode
from ..moqt.messages import Token
from ..moqt.session import SessionConfig
from ..pubsub import DEFAULT_RECEIVE_LIMITS, ErrorKind, MoqtError, MoqtSession, ReceiveLimits, connect
from ..pubsub.liveness import Reconnect, probe_liveness
from ..transport import TransportConfig, parse_moqt_url

__all__ = ["MoqtPool", "refused_by_goaway"]

log = logging.getLogger(__name__)

T = TypeVar("T")


def refused_by_goaway(exc: BaseException) -> bool:
    """Whether ``exc`` is a request refused because of a GOAWAY: REQUEST_ERROR GOING_AWAY
    (draft-ietf-moq-transport-22 §"REQUEST_ERROR Codes": "The endpoint is rejecting this
    request because it has sent or received a GOAWAY"), or our own refusal to send a
    request on a session whose peer sent GOAWAY."""
    return (isinstance(exc, MoqtError) and exc.code == RequestErrorCode.GOING_AWAY
            and exc.kind in (ErrorKind.REQUEST, ErrorKind.LOCAL))


class MoqtPool:
    """``await pool.get(url)``: a live session to ``url``, connected on first use (one
    connect in flight per URL), reconnected after it closed or its peer sent GOAWAY. A
    source that does not answer within ``connect_timeout`` seconds raises ``TimeoutError``
    (a dead holder).

    ``setup_tokens``: AUTHORIZATION_TOKEN Setup Options sent on every connection (a bearer
    token of the control plane as bytes / str, or a ``Token``): the instance's credentials
    for the scopes it reads (binding §9). ``receive_limits``: what a source may make each
    session hold (pubsub/limits.py; block loads receive into sinks of the layer's size).
    ``reconnect``: the liveness probe of each session and the backoff after a failed connect
    (see the module notes)."""

    def __init__(self, config: TransportConfig | None = None, *,
                 connect_timeout: float = 5.0,
                 session_config: Callable[[], SessionConfig] | None = None,
                 setup_tokens: Sequence[Token | bytes | str] = (),
                 receive_limits: ReceiveLimits = DEFAULT_RECEIVE_LIMITS,
                 reconnect: Reconnect = Reconnect()) -> None:
        self.config = config or TransportConfig()  # verifies the server (docs/security.md)
        #: A fresh SessionConfig per connection (PATH / AUTHORITY, implementation...).
        self.session_config = session_config
        self.setup_tokens = tuple(setup_tokens)
        self.connect_timeout = connect_timeout
        self.receive_limits = receive_limits
        self._sessions: dict[str, asyncio.Future[MoqtSession]] = {}
        #: Where the session for a URL is opened: the URL, or the New Session URI of the
        #: last GOAWAY on it.
        self._targets: dict[str, str] = {}
        #: Sessions whose peer sent GOAWAY, until they are closed.
        self._draining: set[MoqtSession] = set()
        self._closing: set[asyncio.Future[None]] = set()
        #: GOAWAYs received on sessions of this pool (a counter for tests and metrics).
        self.goaways = 0
        self.reconnect = reconnect
        #: URL -> (connects failed in a row, loop time before which it is not tried again).
        self._backoff: dict[str, tuple[int, float]] = {}
        #: The liveness probes of the pool's sessions.
        self._probes: set[asyncio.Future[None]] = set()
        #: Sessions closed because their peer stopped acknowledging PINGs (a counter).
        self.dead = 0

    def target(self, url: str) -> str:
        """Where a session for ``url`` is opened now (a New Session URI after GOAWAY)."""
        return self._targets.get(url, url)

    async def get(self, url: str) -> MoqtSession:
        fut = self._sessions.get(url)
        if fut is not None and fut.done() and (fut.cancelled() or fut.exception() is not None
                                               or not _usable(fut.result())):
            fut = None
        if fut is None:
            failures, not_before = self._backoff.get(url, (0, 0.0))
            wait = not_before - asyncio.get_running_loop().time()
            if wait > 0:
                raise ConnectionError(f"{url}: {failures} connect(s) failed in a row; "
                                      f"not tried again for {wait:.2f} s")
            fut = self._connect(url)
        return await asyncio.shield(fut)

    async def call(self, url: str, op: Callable[[MoqtSession], Awaitable[T]]) -> T:
        """``await op(session)`` on the session for ``url``; if the peer refused it because
        of a GOAWAY (:func:`refused_by_goaway`), once more on the pool's new session."""
        session = await self.get(url)
        try:
            return await op(session)
        except MoqtError as exc:
            if not refused_by_goaway(exc):
                raise
            log.info("%s: request refused after GOAWAY; retrying on a new session", url)
        return await op(await self.get(url))

    def _connect(self, url: str) -> asyncio.Future[MoqtSession]:
        fut = asyncio.ensure_future(asyncio.wait_for(
            connect(self.target(url), self.config, setup_timeout=self.connect_timeout,
                    session_config=self.session_config() if self.session_config else None,
                    setup_tokens=self.setup_tokens, receive_limits=self.receive_limits),
            self.connect_timeout))

        def connected(f: asyncio.Future[MoqtSession]) -> None:
            if f.cancelled() or f.exception() is not None:
                failures = self._backoff.get(url, (0, 0.0))[0] + 1
                self._backoff[url] = (failures, asyncio.get_running_loop().time()
                                      + self.reconnect.delay(failures))
                return
            self._backoff.pop(url, None)
            session = f.result()
            session.goaway_received.add_done_callback(
                lambda g: self._on_goaway(url, session, g))
            probe = asyncio.ensure_future(self._probe(url, session))
            self._probes.add(probe)
            probe.add_done_callback(self._probes.discard)

        fut.add_done_callback(connected)
        self._sessions[url] = fut
        return fut

    def _on_goaway(self, url: str, session: MoqtSession, goaway: asyncio.Future[str]) -> None:
        if goaway.cancelled() or goaway.exception() is not None:
            return
        self.goaways += 1
        new_uri = goaway.result()
        if new_uri:
            try:
                parse_moqt_url(new_uri)
            except ValueError as exc:  # unusable: the current target is reused
                log.warning("%s: GOAWAY with an unusable New Session URI %r (%s)", url,
                            new_uri[:200], exc)
                new_uri = ""
            else:
                self._targets[url] = new_uri
        log.info("%s: GOAWAY%s; new requests go to a new session", url,
                 f" (New Session URI {new_uri})" if new_uri else "")
        current = self._sessions.get(url)
        if current is not None and current.done() and not current.cancelled() and \
                current.exception() is None and current.result() is session:
            fut = self._connect(url)  # at once: the next request need not wait for it
            fut.add_done_callback(lambda f: f.cancelled() or f.exception())
        self._draining.add(session)
        task = asyncio.ensure_future(self._close_when_idle(session))
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def _probe(self, url: str, session: MoqtSession) -> None:
        """Close ``session`` when its peer stops acknowledging PINGs (a dead relay)."""
        reason = await probe_liveness(session.connection, self.reconnect)
        if reason is None or _closed(session):
            return
        self.dead += 1
        log.warning("%s: %s; the session is closed, the next request reconnects", url, reason)
        current = self._sessions.get(url)
        if current is not None and current.done() and not current.cancelled() and \
                current.exception() is None and current.result() is session:
            del self._sessions[url]
        await session.close(SessionErrorCode.NO_ERROR, f"peer unresponsive: {reason}")

    async def _close_when_idle(self, session: MoqtSession) -> None:
        """Close a GOAWAY'd session once none of our requests is in flight on it (or the
        peer closed it first)."""
        try:
            await session.close_when_idle()
        finally:
            self._draining.discard(session)

    async def close(self) -> None:
        futs, self._sessions = list(self._sessions.values()), {}
        for task in list(self._closing) + list(self._probes):
            task.cancel()
        for fut in futs:
            if not fut.done():
                fut.cancel()
                continue
            if fut.exception() is None and not _closed(fut.result()):
                await fut.result().close()
        for session in list(self._draining):
            self._draining.discard(session)
            if not _closed(session):
                await session.close()

    async def __aenter__(self) -> MoqtPool:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


def _closed(session: MoqtSession) -> bool:
    return session.closed.done() or session.moqt is None or session.moqt.closed


def _usable(session: MoqtSession) -> bool:
    """Open, and its peer has not sent GOAWAY (§"GOAWAY": no new requests on it)."""
    return not _closed(session) and not session.goaway_received.done()
