"""The holder side of binding v1 (docs/binding.md; DESIGN.md §1 "Holder", §4).

:class:`MoqtHolder` publishes the replicas of a :class:`~kvsp_moq.storage.BlockStore` as MOQT
tracks, each under its own five-field namespace:

* as a MOQT server itself (:meth:`MoqtHolder.serve`), and/or
* as a client of one or more relays (:meth:`MoqtHolder.attach_relay`): PUBLISH_NAMESPACE of
  every replica's namespace, then it answers the relay's SUBSCRIBE and FETCH. On the relay's
  GOAWAY (draft-ietf-moq-transport-22 §"GOAWAY", §"Session Migration") it connects at once to
  the New Session URI if the GOAWAY carried one ("The client MUST use this URI for the new
  session if provided"), else to the same URL, PUBLISH_NAMESPACEs every replica there, and
  closes the old session once none of its requests is in flight on it
  (:meth:`~kvsp_moq.pubsub.MoqtSession.wait_idle`): publishing through the relay goes on.
  A relay session that ends otherwise (the relay closed it, or was killed: a PING not
  acknowledged within ``Reconnect.liveness_timeout`` closes it, ``kvsp_moq.pubsub.liveness``)
  is connected again with backoff (``Reconnect.backoff_initial`` doubling up to
  ``backoff_max``) to the same target, and every replica still held is PUBLISH_NAMESPACEd there
  (issue 19: a restarted relay gets the holder's namespaces back).
  :meth:`MoqtHolder.attach_relay_soon` attaches in the background with the same backoff, for
  a relay that may be down when the holder starts.

FETCH is served straight from the store's tier buffers (:class:`~.track.BlockTrack`); a block
still being computed (:meth:`MoqtHolder.begin`) is published layer by layer as it is written.
:meth:`MoqtHolder.replica_record` gives the Replica Record with ``holder`` = the ``moqt://``
URL and ``moqt_namespace`` (kvsp-draft §4.4). Every replica that leaves the store is withdrawn
first (its namespace at each relay, its track here; §6.1 "withdraw ... before or immediately
after evicting").

Authorization (binding §9): a holder serving directly with an ``authorizer``
(:class:`ScopeAuthorizer`) serves a request only if one of the session's SETUP tokens, the
request's own AUTHORIZATION_TOKENs or no token at all (anonymous) is allowed the scope (field 3)
of the namespace it names; otherwise REQUEST_ERROR UNAUTHORIZED, before any lookup.
SUBSCRIBE_NAMESPACE listings show only namespaces of such scopes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..kvsp.layout import Geometry
from ..kvsp.naming import NAMESPACE_TAG, BlockName, NamingError
from ..kvsp.records import ReplicaRecord
from ..moqt.messages import Message, SubscribeNamespace, SubscribeTracks, Token
from ..moqt.session import SessionConfig
from ..pubsub import DEFAULT_RECEIVE_LIMITS, Catalog, MoqtError, MoqtServer, MoqtSession, ReceiveLimits, connect, serve
from ..pubsub.liveness import Reconnect, probe_liveness
from ..pubsub.session import token_values
from ..storage import BlockStore, BlockWriter, RecordKey
from ..transport import TransportConfig
from .track import BlockTrack

__all__ = ["MoqtHolder", "ScopeAuthorizer", "ScopeGate"]

log = logging.getLogger(__name__)

DEFAULT_TTL_MS = 600_000


class ScopeAuthorizer(Protocol):
    """Decides whether a bearer token (a MOQT AUTHORIZATION_TOKEN's Token Value; ``None``:
    a request with no token) may use a Scope ID: publish, subscribe to, fetch and list the
    blocks of that scope (binding §9). The control plane's ``Authorizer`` satisfies it through
    ``kvsp_moq.control.moqt_auth.ControlScopeAuthorizer``."""

    def allowed(self, token: bytes | None, scope_id: bytes) -> bool: ...


def _scope_of(namespace: tuple[bytes, ...]) -> bytes | None:
    """The Scope ID of a binding-v1 block namespace; None if it is not one."""
    try:
        return BlockName.from_fields(namespace).scope_id
    except NamingError:
        return None


class ScopeGate:
    """The :class:`~kvsp_moq.pubsub.session.RequestGate` of a holder serving directly.

    Every request naming a namespace (SUBSCRIBE, FETCH, TRACK_STATUS, and from a peer that
    publishes: PUBLISH_NAMESPACE, PUBLISH) needs the scope of that namespace; a namespace that
    is not a block's is refused the same way (nothing else is served here). SUBSCRIBE_NAMESPACE
    on a prefix that names a scope needs that scope; a shorter prefix is accepted and its
    listing filtered. Requests that name no namespace (a joining FETCH refers to a
    subscription of the same session, itself authorized) pass."""

    def __init__(self, authorizer: ScopeAuthorizer) -> None:
        self.authorizer = authorizer

    def _tokens(self, session: MoqtSession, message: Message) -> tuple[bytes | None, ...]:
        params = getattr(message, "parameters", None)
        own = token_values(getattr(params, "authorization_tokens", ())
                           if params is not None else ())
        return (*session.peer_setup_tokens, *own, None)  # None: the anonymous rights

    def _may_use(self, session: MoqtSession, message: Message, scope: bytes) -> bool:
        allowed = [self.authorizer.allowed(t, scope) for t in self._tokens(session, message)]
        return any(allowed)  # every token is asked: the time taken does not tell which matched

    def allows(self, session: MoqtSession, message: Message) -> bool:
        if isinstance(message, SubscribeNamespace | SubscribeTracks):
            prefix = tuple(message.track_namespace_prefix)
            if len(prefix) >= 3 and prefix[0] == NAMESPACE_TAG:
                return self._may_use(session, message, bytes(prefix[2]))
            return True  # the listing is filtered (shows)
        namespace = getattr(message, "track_namespace", None)
        if namespace is None:
            return True
        scope = _scope_of(tuple(namespace))
        return scope is not None and self._may_use(session, message, scope)

    def shows(self, session: MoqtSession, message: Message, namespace: tuple[bytes, ...]) -> bool:
        scope = _scope_of(namespace)
        return scope is not None and self._may_use(session, message, scope)


@dataclass
class _RelayLink:
    """One :meth:`MoqtHolder.attach_relay`: where its session goes now (the attached URL, or
    the New Session URI of the relay's last GOAWAY), how to connect again, the session."""

    target: str
    config: TransportConfig
    session_config: SessionConfig | None
    setup_tokens: tuple[Token | bytes | str, ...]
    receive_limits: ReceiveLimits
    session: MoqtSession
    #: (key, replica id) of the replicas whose PUBLISH_NAMESPACE the current session's relay accepted.
    announced: set[tuple[RecordKey, bytes]] = field(default_factory=set)
    #: The liveness probe of the session and the backoff of reconnects after it was lost.
    reconnect: Reconnect = field(default_factory=Reconnect)
    reconnecting: bool = False


class MoqtHolder:
    """Publishes the replicas of ``store`` over MOQT (binding v1)."""

    def __init__(self, store: BlockStore, *, ttl_ms: int = DEFAULT_TTL_MS,
                 clock: Callable[[], float] = time.monotonic,
                 authorizer: ScopeAuthorizer | None = None,
                 ttl_of: Callable[[RecordKey, bytes], int | None] | None = None) -> None:
        """``ttl_of(key, replica_id)``: the remaining TTL (ms) of the replica's records, the
        MAX_CACHE_DURATION of its track (binding §7), when the records are published by
        someone else (a holder's ``ReplicaPublisher``); default: from :meth:`replica_record`."""
        self.store = store
        self._ttl_of = ttl_of
        #: Checks the tokens of the clients of :meth:`serve` (None: serve everyone, as a
        #: holder behind a relay that enforces binding §9, or on a trusted network).
        self.authorizer = authorizer
        #: The catalog every session of this holder serves (server sessions and relay links).
        self.catalog = Catalog()
        self.ttl_ms = ttl_ms
        self._clock = clock
        self._tracks: dict[RecordKey, BlockTrack] = {}
        #: Replica id -> monotonic expiry of the last record issued (MAX_CACHE_DURATION).
        self._expires: dict[bytes, float] = {}
        self._server: MoqtServer | None = None
        self._host = "127.0.0.1"
        self._relays: dict[str, _RelayLink] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        #: Relay sessions after a GOAWAY, until closed (their close-when-idle tasks).
        self._draining: dict[MoqtSession, asyncio.Task[None]] = {}
        #: GOAWAYs received from attached relays (a counter for tests and metrics).
        self.goaways = 0
        #: Relay sessions connected again after a loss, and closed for an unacknowledged PING.
        self.reconnects = 0
        self.dead = 0
        #: Liveness probes and reconnect loops of the relay links.
        self._background: set[asyncio.Task[Any]] = set()
        store.add_evict_listener(self._on_evict)
        self._listening = True

    # -- endpoints ----------------------------------------------------------------------------
    async def serve(self, host: str = "127.0.0.1", port: int = 0,
                    config: TransportConfig | None = None) -> str:
        """Listen for MOQT clients; return this endpoint's ``moqt://`` URL."""
        if config is None or config.certificate_pem is None:
            raise ValueError("serve needs a TransportConfig with certificate_pem and private_key_pem")
        gate = ScopeGate(self.authorizer) if self.authorizer is not None else None
        self._server = await serve(host, port, config, catalog=self.catalog, gate=gate)
        self._host = host
        return self.url

    @property
    def url(self) -> str:
        """``moqt://host:port/moq`` of :meth:`serve`."""
        if self._server is None:
            raise RuntimeError("not serving")
        return f"moqt://{self._host}:{self._server.port}/moq"

    async def attach_relay(self, url: str, config: TransportConfig | None = None, *,
                           session_config: SessionConfig | None = None,
                           setup_tokens: Sequence[Token | bytes | str] = (),
                           receive_limits: ReceiveLimits = DEFAULT_RECEIVE_LIMITS,
                           reconnect: Reconnect | None = None) -> MoqtSession:
        """Connect to a relay as a publisher: PUBLISH_NAMESPACE every published replica (and
        every later one); the relay's SUBSCRIBE / FETCH are answered from the store.
        ``setup_tokens`` are sent as AUTHORIZATION_TOKEN Setup Options: the token of a
        principal allowed to publish the scopes (binding §9). The relay's requests on this
        session are not checked against :attr:`authorizer`: the relay enforces binding §9.
        ``receive_limits``: what the relay may make the session hold (pubsub/limits.py).
        After the relay's GOAWAY the link moves to a new session; a session lost otherwise is
        connected again (``reconnect``: liveness probe and backoff; see the module notes)."""
        link = _RelayLink(url, config or TransportConfig(), session_config, tuple(setup_tokens),
                          receive_limits, await self._connect(url, config or TransportConfig(),
                                                              session_config, tuple(setup_tokens),
                                                              receive_limits),
                          reconnect=reconnect or Reconnect())
        session = link.session
        self._relays[url] = link
        self._watch(url, link)
        for track in list(self._tracks.values()):
            await session.publish_namespace(track.namespace)
            link.announced.add((track.key, track.replica_id))
        return session

    def attach_relay_soon(self, url: str, config: TransportConfig | None = None, *,
                          session_config: SessionConfig | None = None,
                          setup_tokens: Sequence[Token | bytes | str] = (),
                          receive_limits: ReceiveLimits = DEFAULT_RECEIVE_LIMITS,
                          reconnect: Reconnect | None = None) -> asyncio.Task[MoqtSession | None]:
        """:meth:`attach_relay` in the background, for a relay that may be down now (an
        instance starting while its relay restarts): tried at once, then again after each
        wait of ``reconnect``'s backoff (``backoff_initial`` doubling up to ``backoff_max``)
        until it succeeds or the holder closes. Each try is bounded by the transport's
        ``handshake_timeout``. Until then nothing is announced at that relay
        (:meth:`is_announced` is False). The task's result: the session (None: closed first)."""
        reconnect = reconnect or Reconnect()

        async def attach() -> MoqtSession | None:
            delays, attempt = reconnect.delays(), 0
            while self._listening:
                attempt += 1
                try:
                    return await self.attach_relay(url, config, session_config=session_config,
                                                   setup_tokens=setup_tokens,
                                                   receive_limits=receive_limits, reconnect=reconnect)
                except Exception as exc:  # unreachable, refused: the next attempt waits longer
                    link = self._relays.get(url)
                    if link is not None:  # connected, then an announcement failed: it stays
                        return link.session
                    (log.warning if attempt == 1 else log.info)(
                        "relay %s: cannot attach (attempt %d): %r; trying again", url, attempt, exc)
                await asyncio.sleep(next(delays))  # the backoff schedule, not a wait for a state
            return None

        task = asyncio.ensure_future(attach())
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    async def _connect(self, url: str, config: TransportConfig, session_config: SessionConfig | None,
                       setup_tokens: tuple[Token | bytes | str, ...],
                       receive_limits: ReceiveLimits) -> MoqtSession:
        return await connect(url, config, catalog=self.catalog, session_config=session_config,
                             setup_tokens=setup_tokens, receive_limits=receive_limits)

    def _watch(self, url: str, link: _RelayLink) -> None:
        session = link.session

        def on_goaway(goaway: asyncio.Future[str]) -> None:
            if goaway.cancelled() or goaway.exception() is not None:
                return
            if self._relays.get(url) is not link or link.session is not session:
                return  # detached or closed meanwhile
            self.goaways += 1
            self._spawn(self._migrate(url, link, session, goaway.result()))

        session.goaway_received.add_done_callback(on_goaway)
        session.closed.add_done_callback(lambda _f: self._on_lost(url, link, session))
        self._background_task(self._probe(link, session))

    def _background_task(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _probe(self, link: _RelayLink, session: MoqtSession) -> None:
        """Close ``session`` when the relay stops acknowledging PINGs (killed, restarted)."""
        reason = await probe_liveness(session.connection, link.reconnect)
        if reason is not None and link.session is session and not session.closed.done():
            self.dead += 1
            log.warning("relay %s: %s; connecting again", link.target, reason)
            await session.close(reason=f"relay unresponsive: {reason}")

    def _current(self, url: str, link: _RelayLink, session: MoqtSession) -> bool:
        return self._listening and self._relays.get(url) is link and link.session is session

    def _on_lost(self, url: str, link: _RelayLink, session: MoqtSession) -> None:
        """A relay session ended: unless it was moved (GOAWAY), detached or we are closing,
        connect again with backoff."""
        if self._current(url, link, session) and not link.reconnecting:
            link.reconnecting = True
            self._background_task(self._reconnect(url, link, session))

    async def _reconnect(self, url: str, link: _RelayLink, lost: MoqtSession) -> None:
        try:
            for delay in link.reconnect.delays():
                await asyncio.sleep(delay)  # the backoff schedule, not a wait for a state
                if not self._current(url, link, lost):
                    return  # attached again meanwhile, or closing
                try:
                    new = await self._connect(link.target, link.config, link.session_config,
                                              link.setup_tokens, link.receive_limits)
                except Exception as exc:  # unreachable, refused: the next attempt waits longer
                    log.info("relay %s: reconnect failed: %r", link.target, exc)
                    continue
                if not self._current(url, link, lost):
                    await new.close()
                    return
                self.reconnects += 1
                log.info("relay %s: connected again; publishing the replicas there", link.target)
                self._adopt(url, link, new, link.target)
                return
        finally:
            link.reconnecting = False

    def _adopt(self, url: str, link: _RelayLink, new: MoqtSession, target: str) -> None:
        """``new`` becomes the link's session: every replica is announced there."""
        link.target, link.session = target, new
        link.announced.clear()
        self._watch(url, link)
        for track in list(self._tracks.values()):
            self._spawn(self._announce(link, new, track))

    async def _migrate(self, url: str, link: _RelayLink, old: MoqtSession, new_uri: str) -> None:
        """The relay sent GOAWAY on ``old``: a new session to ``new_uri`` (empty: the same
        target), every replica published there, ``old`` closed once idle."""
        target = new_uri or link.target
        log.info("relay %s: GOAWAY%s; publishing through a new session", link.target,
                 f" (New Session URI {new_uri})" if new_uri else "")
        try:
            new = await self._connect(target, link.config, link.session_config, link.setup_tokens,
                                      link.receive_limits)
        except Exception as exc:  # the old session serves until the relay closes it
            log.warning("relay %s: cannot connect to %s after GOAWAY: %s", link.target, target, exc)
            return
        if not self._listening or self._relays.get(url) is not link:  # closed meanwhile
            await new.close()
            return
        # Every track published from now on is announced on ``new`` by publish(); _adopt
        # announces the ones published before (no await since the swap).
        self._adopt(url, link, new, target)
        self._close_when_idle(old)

    def _close_when_idle(self, session: MoqtSession) -> None:
        async def close() -> None:
            try:
                await session.close_when_idle()
            finally:
                self._draining.pop(session, None)

        self._draining[session] = asyncio.ensure_future(close())

    def relay_sessions(self) -> list[MoqtSession]:
        """The current sessions to the attached relays."""
        return [link.session for link in self._relays.values()]

    def relay_session(self, url: str) -> MoqtSession | None:
        """The current session of the relay attached as ``url`` (None: not attached)."""
        link = self._relays.get(url)
        return link.session if link is not None else None

    # -- publishing -------------------------------------------------------------------------
    def publish(self, key: RecordKey) -> BlockTrack:
        """Publish the stored replica of ``key`` (complete, or being written through a
        writer whose layers reach :meth:`BlockTrack.layer_written`). Idempotent."""
        info = self.store.info(key)
        track = self._tracks.get(key)
        if track is not None and track.replica_id == info.replica_id:
            return track
        rid = info.replica_id
        track = BlockTrack(self.store, key, remaining_ttl_ms=lambda: self._remaining_ttl_ms(key, rid))
        self._tracks[key] = track
        self.catalog.add(track)
        self._expires.setdefault(info.replica_id, self._clock() + self.ttl_ms / 1000)
        for link in self._relays.values():
            self._spawn(self._announce(link, link.session, track))
        return track

    def publish_all(self) -> list[BlockTrack]:
        """Publish every replica of the store."""
        return [self.publish(info.key) for info in self.store.replicas()]

    def begin(self, key: RecordKey, geometry: Geometry, layers: int | range, tokens: int,
              **kw: Any) -> BlockWriter:
        """``store.begin`` for a block still being computed, published at once: each layer
        goes to the track's subscribers the moment ``write_layer`` stored it."""
        writer = self.store.begin(key, geometry, layers, tokens, **kw)
        track = self.publish(key)
        writer.add_listener(track.layer_written)
        return writer

    async def wait_announced(self, timeout: float | None = None) -> bool:
        """Wait until every pending PUBLISH_NAMESPACE to the relays was answered (at most
        ``timeout`` seconds: then False, the answers still pending)."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while self._tasks:  # asyncio.wait, not gather: a timeout must leave them pending
            left = None if deadline is None else deadline - loop.time()
            if left is not None and left <= 0:
                return False
            await asyncio.wait(set(self._tasks), timeout=left)
        return True

    def is_announced(self, url: str, key: RecordKey) -> bool:
        """Whether the relay attached as ``url`` accepted the namespace of the replica of
        ``key`` now stored (a record naming that relay may be published: binding §10)."""
        link = self._relays.get(url)
        track = self._tracks.get(key)
        return link is not None and track is not None and (key, track.replica_id) in link.announced

    def track(self, key: RecordKey) -> BlockTrack | None:
        return self._tracks.get(key)

    # -- records ----------------------------------------------------------------------------
    def replica_record(self, key: RecordKey, *, holder: str | None = None,
                       ttl_ms: int | None = None) -> ReplicaRecord:
        """The Replica Record of a published, complete replica (kvsp-draft §4.4): ``holder``
        defaults to the first attached relay's URL, else this server's; ``moqt_namespace``
        names the replica (after a relay's GOAWAY with a New Session URI: that URI). Issuing it
        sets the replica's expiry, hence the MAX_CACHE_DURATION relays get (binding §7)."""
        track = self.publish(key)
        ttl = self.ttl_ms if ttl_ms is None else ttl_ms
        url = holder or (next(iter(self._relays.values())).target if self._relays else self.url)
        self._expires[track.replica_id] = self._clock() + ttl / 1000
        return self.store.info(key).replica_record(url, ttl)

    def records_published_by(self, ttl_of: Callable[[RecordKey, bytes], int | None]) -> None:
        """From now on the replicas' records are published (and refreshed) by someone else:
        ``ttl_of`` as in the constructor. A refresh of a record then extends its track's
        MAX_CACHE_DURATION (binding §7), which :meth:`replica_record` alone would not see."""
        self._ttl_of = ttl_of

    def _remaining_ttl_ms(self, key: RecordKey, replica_id: bytes) -> int | None:
        if self._ttl_of is not None:
            return self._ttl_of(key, replica_id)
        expires = self._expires.get(replica_id)
        return None if expires is None else max(0, int((expires - self._clock()) * 1000))

    # -- withdrawal -------------------------------------------------------------------------
    def _on_evict(self, key: RecordKey, replica_id: bytes) -> None:
        track = self._tracks.get(key)
        if track is None or track.replica_id != replica_id:
            return
        del self._tracks[key]
        self._expires.pop(replica_id, None)
        self.catalog.remove(track.namespace, track.name)  # new requests: DOES_NOT_EXIST
        for link in self._relays.values():
            link.announced.discard((key, replica_id))
            link.session.withdraw_namespace(track.namespace)
        self._spawn(track.withdraw("replica evicted"))

    async def _announce(self, link: _RelayLink, session: MoqtSession, track: BlockTrack) -> None:
        try:
            await session.publish_namespace(track.namespace)
        except MoqtError as exc:
            log.warning("PUBLISH_NAMESPACE of %s refused: %s", track.key, exc)
            return
        if link.session is session and self._tracks.get(track.key) is track:
            link.announced.add((track.key, track.replica_id))

    def _spawn(self, coro: Any) -> None:
        try:
            task = asyncio.ensure_future(coro)
        except RuntimeError:  # no running loop (a store call outside the holder's loop)
            coro.close()
            return
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        await self.wait_announced()
        if self._listening:
            self._listening = False
            self.store.remove_evict_listener(self._on_evict)
        for task in list(self._background):
            task.cancel()
        links, self._relays = list(self._relays.values()), {}
        for link in links:
            await link.session.close()
        for session, task in list(self._draining.items()):
            task.cancel()
            self._draining.pop(session, None)
            if not session.closed.done():
                await session.close()
        if self._server is not None:
            for s in list(self._server.sessions):
                await s.close()
            self._server.close()
            await self._server.wait_closed()
            self._server = None

    async def __aenter__(self) -> MoqtHolder:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


