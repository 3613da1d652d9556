"""The relay's one session to its ``--upstream`` relay (docs/relay.md "Chaining"):
:class:`Uplink` connects it, watches it, connects again when it is lost and moves to a new
session when the upstream sends GOAWAY.

* **Connect on first use**, one connect at a time (:meth:`Uplink.get`); the whole connect
  (QUIC handshake and MOQT SETUP) is bounded by ``request_timeout``.
* **Liveness** (``upstream_keepalive``, ``upstream_liveness_timeout``): a PING every
  keepalive seconds (``kvsp_moq.pubsub.liveness``). An upstream relay that was killed and
  restarted on the same port drops our old connection's packets without a word, so the
  session would look open until the QUIC idle timeout; an unacknowledged PING closes it at
  once (``upstream_dead``), which ends what rode on it as a session loss does.
* **Reconnect with backoff** (``upstream_reconnect_initial`` .. ``upstream_reconnect_max``):
  when the session is lost (closed by the upstream, unresponsive, or the GOAWAY move failed),
  or a connect failed (an upstream not up yet), while something still wants it (a local announcement, namespace interest or PUBLISH), the
  relay tries again after 0.1 s, 0.2 s, 0.4 s, ... up to the maximum, until it succeeds or
  nothing wants the upstream any more, then the owner re-sends PUBLISH_NAMESPACE,
  SUBSCRIBE_NAMESPACE and PUBLISH there (``restored``). Requests from downstream that need
  the upstream meanwhile wait for the connect in progress (bounded by ``request_timeout``).
* **GOAWAY** (draft-22 §"GOAWAY", §"Session Migration"): no new request goes to the old
  session ("Upon receiving a GOAWAY on the control stream, an endpoint SHOULD NOT initiate
  new requests to the peer"); a new session is opened at once, at the New Session URI when
  the GOAWAY carried one ("The client MUST use this URI for the new session if provided"),
  else at the current target, which stays the target for later reconnects. The owner then
  moves the announcements, interests, PUBLISHes and Established subscriptions to it
  (``moved``, §"Graceful Publisher Relay Switchover", §"Graceful Subscriber Relay
  Switchover"), and the old session is closed with NO_ERROR once none of our requests and
  none of the upstream's remain on it (§"Session Migration": "it's RECOMMENDED that the
  client waits until there are no more Established subscriptions before closing the session
  with NO_ERROR"), or when the upstream closes it first.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from kvsp_moq import transport
from kvsp_moq.moqt.errors import SessionErrorCode
from kvsp_moq.moqt.session import Role, SessionConfig
from kvsp_moq.pubsub.liveness import probe_liveness
from kvsp_moq.transport import ConnectError, TransportError, parse_moqt_url

from ..ops.logs import event
from ..session.peer import NamespaceRequestHandler, PeerSession, SessionOwner
from ..ops.stats import RelayStats

__all__ = ["UNREACHABLE", "Uplink"]

logger = logging.getLogger(__name__)

#: What a failed connect to the upstream raises.
UNREACHABLE = (ConnectError, TransportError, OSError, asyncio.TimeoutError, ConnectionError)


class Uplink:
    """Our session to the upstream relay (see the module notes)."""

    def __init__(self, owner: SessionOwner, stats: RelayStats, *,
                 track: Callable[[PeerSession], PeerSession],
                 spawn: Callable[[Awaitable[None]], None],
                 closing: Callable[[], bool],
                 wanted: Callable[[], bool],
                 restored: Callable[[PeerSession], None],
                 moved: Callable[[PeerSession, PeerSession], None]) -> None:
        self.owner = owner
        self.config = owner.config
        self.stats = stats
        self._track, self._spawn, self._closing = track, spawn, closing
        self._wanted, self._restored, self._moved = wanted, restored, moved
        #: Where the next session goes: ``--upstream``, or the last GOAWAY's New Session URI.
        self.target = self.config.upstream or ""
        self.peer: PeerSession | None = None
        self._lock = asyncio.Lock()
        self._reconnecting = False
        #: Sessions that sent GOAWAY and whose requests moved: closed once idle.
        self.draining: set[PeerSession] = set()

    # -- the session -------------------------------------------------------------------------
    async def get(self) -> PeerSession | None:
        """The session to the upstream relay: the current one while it is open and sent no
        GOAWAY, else a new one (raises one of :data:`UNREACHABLE` if that fails)."""
        if not self.config.upstream:
            return None
        async with self._lock:
            p = self.peer
            if p is not None and p.is_open and not p.goaway_received:
                return p
            try:
                peer = await asyncio.wait_for(self._open(self.target),
                                              self.config.request_timeout)
            except UNREACHABLE:
                self.reconnect()  # unreachable when first needed: keep trying in the background
                raise
            self.peer = peer
            self.stats.upstream_connects += 1
            event("upstream_connect", upstream=peer.address, target=self.target)
            self._spawn(self._watch(peer))
            return peer

    async def _open(self, url: str) -> PeerSession:
        parsed = parse_moqt_url(url)
        wt = parsed.is_webtransport  # https://: the CONNECT carries them (MOQT §"PATH")
        cfg = SessionConfig(path=None if wt else parsed.path_and_query,
                            authority=None if wt else parsed.authority,
                            implementation="kvsp-moq-relay")
        made: list[PeerSession] = []

        def factory() -> PeerSession:
            s = PeerSession(self.owner, Role.CLIENT, cfg, upstream=True)
            made.append(s)
            return s

        await transport.connect(parsed, factory, self.config.upstream_transport)
        peer = self._track(made[0])
        try:
            await asyncio.shield(peer.ready)
        except BaseException:
            peer.close(SessionErrorCode.NO_ERROR, "upstream SETUP not completed")
            raise
        return peer

    async def _watch(self, peer: PeerSession) -> None:
        """Close ``peer`` when it stops acknowledging PINGs (a dead or restarted upstream)."""
        reason = await probe_liveness(peer.connection, self.config.upstream_reconnect)
        if reason is not None and peer.is_open:
            self.stats.upstream_dead += 1
            event("upstream_dead", logging.WARNING, upstream=peer.address, reason=reason)
            peer.close(SessionErrorCode.NO_ERROR, f"upstream unresponsive: {reason}")

    # -- loss and reconnect ------------------------------------------------------------------
    def lost(self, peer: PeerSession) -> None:
        """``peer`` (one of ours to the upstream) ended."""
        self.draining.discard(peer)
        if peer is not self.peer:
            return
        self.peer = None
        self.stats.upstream_losses += 1
        self.reconnect()

    def reconnect(self) -> None:
        """Connect again with backoff while something wants the upstream (one loop)."""
        if self._reconnecting or self._closing() or not self._wanted():
            return
        self._reconnecting = True
        self._spawn(self._reconnect())

    async def _reconnect(self) -> None:
        try:
            for delay in self.config.upstream_reconnect.delays():
                await asyncio.sleep(delay)  # the backoff schedule, not a wait for a state
                if self._closing() or not self._wanted():
                    return
                try:
                    peer = await self.get()
                except UNREACHABLE as exc:
                    logger.info("relay: upstream %s still unreachable: %r", self.target, exc)
                    continue
                if peer is not None:
                    self._restored(peer)
                return
        finally:
            self._reconnecting = False

    # -- GOAWAY ------------------------------------------------------------------------------
    def goaway(self, peer: PeerSession, new_uri: str) -> None:
        """The upstream sent GOAWAY on ``peer``: move to a new session (module notes)."""
        if peer is not self.peer or self._closing():
            return
        if new_uri:
            try:
                parse_moqt_url(new_uri)
            except ValueError as exc:  # a URI we cannot connect to: keep the current target
                logger.warning("relay: the upstream's GOAWAY names an unusable New Session "
                               "URI %r (%s); reconnecting to %s", new_uri[:200], exc, self.target)
            else:
                self.target = new_uri
        event("upstream_goaway", upstream=peer.address, new_session_uri=new_uri)
        self._spawn(self._migrate(peer))

    async def _migrate(self, old: PeerSession) -> None:
        try:
            new = await self.get()
        except UNREACHABLE as exc:
            # The old session keeps serving what it carries; when it ends, lost() retries.
            logger.warning("relay: cannot connect to %s after the upstream's GOAWAY: %r",
                           self.target, exc)
            return
        if new is None or new is old or not old.is_open:
            return
        self.stats.upstream_migrations += 1
        self.draining.add(old)
        self._moved(old, new)
        self.close_if_idle(old)

    def check_idle_soon(self, peer: PeerSession) -> None:
        """:meth:`close_if_idle` once the request that just ended was forgotten."""
        if peer in self.draining:
            asyncio.get_running_loop().call_soon(self.close_if_idle, peer)

    def close_if_idle(self, peer: PeerSession) -> None:
        """Close a GOAWAY'd session once none of our requests remain on it and none of the
        upstream's subscriptions or fetches (its namespace requests, e.g. it soliciting our
        namespaces, carry nothing in flight)."""
        if peer not in self.draining or not peer.is_open or peer.local:
            return
        if any(not isinstance(h, NamespaceRequestHandler) for h in peer.served.values()):
            return
        self.draining.discard(peer)
        peer.close(SessionErrorCode.NO_ERROR, "moved to a new upstream session")
