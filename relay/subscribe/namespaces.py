"""Namespace propagation along a relay chain (``--upstream``; docs/relay.md "Chaining").

Two directions, both over our one session to the upstream relay:

* **Announcements go up.** Every namespace that a downstream publisher (not the upstream
  relay itself) announced to us with PUBLISH_NAMESPACE is announced upstream once
  (:class:`UpstreamAnnouncement`), however many local publishers share it; the upstream
  PUBLISH_NAMESPACE is withdrawn by cancelling it (draft-20 §"Publishing Namespaces") when
  the last of them withdraws or disconnects. The upstream relay then routes SUBSCRIBE /
  FETCH / TRACK_STATUS for that namespace down to us (we are its publisher), and we route
  them on to the publisher as usual (§"Publisher Interactions").
* **Discovery interest goes up.** While local clients have SUBSCRIBE_NAMESPACE on prefix P,
  the relay keeps ONE upstream SUBSCRIBE_NAMESPACE on P (:class:`UpstreamInterest`),
  shared by all of them and cancelled when the last leaves. The upstream's NAMESPACE /
  NAMESPACE_DONE are merged with the local announcements: a watcher hears NAMESPACE when a
  namespace appears on either side and NAMESPACE_DONE only when neither has it any more
  (a namespace both announced locally and upstream, e.g. our own announcement echoed back,
  is reported once). No upstream interest is kept while a local announcement is a prefix
  of P: every track under P is then routed to that local publisher, never upstream, so the
  upstream's namespaces under P would not be reachable through us.

Upstream sessions are connected on first use (:meth:`Relay.upstream_peer`,
:mod:`relay.subscribe.uplink`). When that session is lost, the upstream namespaces are forgotten
(watchers get NAMESPACE_DONE for the upstream-only ones) and the uplink reconnects with
backoff while :meth:`NamespacePropagation.wants_upstream`; on the new session everything
still wanted is announced and subscribed again (:meth:`NamespacePropagation.resync`). After
the upstream's GOAWAY, :meth:`NamespacePropagation.move` sends both on the new session
and cancels them on the old one (draft-22 §"Graceful Publisher Relay Switchover":
"The publisher sends PUBLISH_NAMESPACE and/or PUBLISH messages to begin publishing on the
new Session"; §"Session Migration": "migrating Established subscriptions and published
namespaces"); the namespaces an interest already reported are kept, so watchers see no
NAMESPACE_DONE for a move. The upstream sees our ``upstream_token`` (SETUP).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Protocol

from kvsp_moq.moqt.messages import (
    Message,
    Namespace as NamespaceMsg,
    NamespaceDone,
    RequestError,
    RequestOk,
)

from ..session.deadline import Deadline
from ..session.limits import is_reserved_namespace
from ..ops.logs import event
from ..ops.names import Namespace, format_namespace
from ..session.peer import PeerSession, RequestHandler
from .uplink import UNREACHABLE

if TYPE_CHECKING:  # pragma: no cover
    from ..ports import RelayContext

__all__ = ["NamespacePropagation", "NamespaceWatcher", "UpstreamAnnouncement",
           "UpstreamInterest"]

logger = logging.getLogger(__name__)


class NamespaceWatcher(Protocol):
    """A local SUBSCRIBE_NAMESPACE on ``prefix`` (the relay's handler of it, relay.core):
    told NAMESPACE (``done`` False) / NAMESPACE_DONE of full namespaces under the prefix."""

    @property
    def prefix(self) -> Namespace: ...

    def send(self, ns: Namespace, done: bool) -> None: ...


async def _connect(relay: RelayContext) -> PeerSession | None:
    try:
        return await relay.upstream_peer()
    except UNREACHABLE as exc:
        logger.warning("relay: upstream %s unreachable: %s", relay.config.upstream, exc)
        return None


class UpstreamAnnouncement(RequestHandler):
    """Our PUBLISH_NAMESPACE of one namespace to the upstream relay."""

    def __init__(self, prop: NamespacePropagation, ns: Namespace) -> None:
        self.prop, self.ns = prop, ns
        self.peer: PeerSession | None = None
        self.rid: int | None = None
        self.gone = False  # withdrawn (or refused / lost): do nothing more
        #: REQUEST_OK / REQUEST_ERROR must come within the request timeout.
        self.timer = Deadline(prop.relay.config.request_timeout, self._timed_out)

    def _timed_out(self) -> None:
        """No answer in time: withdrawn (cancelled upstream) as if refused; the next local
        change announces it again."""
        if self.gone:
            return
        logger.warning("relay: upstream did not answer PUBLISH_NAMESPACE %s in time",
                       format_namespace(self.ns))
        self.prop.relay.stats.upstream_timeouts += 1
        self.withdraw()

    async def open(self) -> None:
        peer = await _connect(self.prop.relay)
        if self.gone or peer is None or not peer.is_open:
            self._drop()
            return
        assert peer.moqt is not None
        self.peer = peer
        self.rid = peer.moqt.publish_namespace(self.ns)
        peer.local[self.rid] = self
        self.prop.relay.stats.upstream_announces += 1
        event("upstream_announce", namespace=format_namespace(self.ns), request_id=self.rid,
              upstream=peer.address)
        self.timer.arm()
        peer.flush()

    def withdraw(self) -> None:
        """Cancel the upstream PUBLISH_NAMESPACE (§"Publishing Namespaces")."""
        self._drop()
        peer, rid = self.peer, self.rid
        if peer is not None and rid is not None and peer.is_open:
            peer.cancel_request(rid)
            event("upstream_withdraw", namespace=format_namespace(self.ns), request_id=rid,
                  upstream=peer.address)

    def _drop(self) -> None:
        self.gone = True
        self.timer.cancel()
        if self.prop.announced.get(self.ns) is self:
            del self.prop.announced[self.ns]

    # -- RequestHandler ----------------------------------------------------------------------
    def on_response(self, msg: Message) -> None:
        self.timer.cancel()
        if isinstance(msg, RequestError):
            # e.g. UNAUTHORIZED: our upstream_token may not publish this namespace there.
            logger.warning("relay: upstream refused PUBLISH_NAMESPACE %s: %s (%d)",
                           format_namespace(self.ns), msg.error_reason, msg.error_code)
            self._drop()
            if self.peer is not None and self.rid is not None:
                self.peer.release(self.rid)

    def on_cancelled(self, code: int) -> None:
        # The upstream revoked its acceptance; it will not route to us any more.
        self._drop()

    def on_finished(self) -> None:
        self._drop()

    def on_session_closed(self, peer: PeerSession) -> None:
        # The uplink reconnects; NamespacePropagation.resync announces it again there.
        self._drop()


class UpstreamInterest(RequestHandler):
    """The local SUBSCRIBE_NAMESPACE watchers of one prefix and our one upstream
    SUBSCRIBE_NAMESPACE for them; ``names`` are the full namespaces the upstream reported."""

    def __init__(self, prop: NamespacePropagation, prefix: Namespace) -> None:
        self.prop, self.prefix = prop, prefix
        self.watchers: list[NamespaceWatcher] = []
        self.names: set[Namespace] = set()
        self.peer: PeerSession | None = None
        self.rid: int | None = None
        self.active = False  # an upstream request is wanted (opening or open)
        self._generation = 0  # a close() then open() during a connect starts one request
        #: The upstream refused it (e.g. UNAUTHORIZED) or did not answer within the request
        #: timeout: not asked again while these watchers last (a new interest is made when
        #: the prefix is watched afresh).
        self.refused = False
        self.timer = Deadline(prop.relay.config.request_timeout, self._timed_out)

    def _timed_out(self) -> None:
        if not self.active or self.rid is None:
            return
        logger.warning("relay: upstream did not answer SUBSCRIBE_NAMESPACE %s in time",
                       format_namespace(self.prefix))
        self.prop.relay.stats.upstream_timeouts += 1
        self.refused = True
        self.close()

    # -- upstream request --------------------------------------------------------------------
    def open(self) -> None:
        if self.active:
            return
        self.active = True
        self._generation += 1
        self.prop.relay.spawn(self._open(self._generation))

    async def _open(self, generation: int) -> None:
        peer = await _connect(self.prop.relay)
        if generation != self._generation:
            return  # closed (and maybe reopened) meanwhile
        if not self.active or peer is None or not peer.is_open:
            self.active = False
            return
        assert peer.moqt is not None
        self.peer = peer
        self.rid = peer.moqt.subscribe_namespace(self.prefix)
        peer.local[self.rid] = self
        self.prop.relay.stats.upstream_namespace_subscribes += 1
        event("upstream_subscribe_namespace", prefix=format_namespace(self.prefix),
              request_id=self.rid, upstream=peer.address)
        self.timer.arm()
        peer.flush()

    def close(self, keep_names: bool = False) -> None:
        """Cancel the upstream SUBSCRIBE_NAMESPACE; its namespaces are gone (unless
        ``keep_names``: it is re-opened on a new session at once, which reports them)."""
        self.timer.cancel()
        self.active = False
        self._generation += 1
        peer, rid = self.peer, self.rid
        self.peer = self.rid = None
        if peer is not None and rid is not None and peer.is_open:
            peer.cancel_request(rid)
            event("upstream_unsubscribe_namespace", prefix=format_namespace(self.prefix),
                  request_id=rid, upstream=peer.address)
        if not keep_names:
            self._forget_all()

    def _forget_all(self) -> None:
        names, self.names = self.names, set()
        for ns in sorted(names):
            self._tell(ns, done=True)

    def _tell(self, ns: Namespace, done: bool) -> None:
        if self.prop.relay.routing.has(ns):
            return  # announced locally too: watchers heard of it (and will hear its end)
        for w in list(self.watchers):
            w.send(ns, done)

    # -- RequestHandler ----------------------------------------------------------------------
    def on_response(self, msg: Message) -> None:
        self.timer.cancel()
        if isinstance(msg, RequestError):
            logger.warning("relay: upstream refused SUBSCRIBE_NAMESPACE %s: %s (%d)",
                           format_namespace(self.prefix), msg.error_reason, msg.error_code)
            self.active = False
            self.refused = True
            peer, rid = self.peer, self.rid
            self.peer = self.rid = None
            if peer is not None and rid is not None:
                peer.release(rid)
        elif not isinstance(msg, RequestOk):  # pragma: no cover - the session checks this
            logger.warning("relay: unexpected answer to SUBSCRIBE_NAMESPACE: %s", msg.NAME)

    def on_message(self, msg: Message) -> None:
        if isinstance(msg, NamespaceMsg):
            ns = self.prefix + tuple(msg.track_namespace_suffix)
            if is_reserved_namespace(ns):
                return  # never routed or listed (relay/session/limits.py)
            if ns not in self.names:
                self.names.add(ns)
                self._tell(ns, done=False)
        elif isinstance(msg, NamespaceDone):
            ns = self.prefix + tuple(msg.track_namespace_suffix)
            if ns in self.names:
                self.names.discard(ns)
                self._tell(ns, done=True)

    def on_cancelled(self, code: int) -> None:
        self._lost()

    def on_finished(self) -> None:
        self._lost()

    def on_session_closed(self, peer: PeerSession) -> None:
        self._lost()  # the uplink reconnects; NamespacePropagation.resync re-opens it

    def _lost(self) -> bool:
        """The upstream ended our request; True if it was still wanted."""
        self.timer.cancel()
        was = self.active
        self.active = False
        self.peer = self.rid = None
        self._forget_all()
        return was


class NamespacePropagation:
    """The relay's namespace state shared with its upstream relay."""

    def __init__(self, relay: RelayContext) -> None:
        self.relay = relay
        #: namespace → our upstream PUBLISH_NAMESPACE of it.
        self.announced: dict[Namespace, UpstreamAnnouncement] = {}
        #: prefix → the local watchers of that prefix and our upstream interest in it.
        self.interests: dict[Namespace, UpstreamInterest] = {}

    @property
    def enabled(self) -> bool:
        return bool(self.relay.config.upstream) and not self.relay.closing

    # -- announcements -----------------------------------------------------------------------
    def _wants_announce(self, ns: Namespace) -> bool:
        """Announced by at least one live downstream publisher (never echo what the upstream
        relay itself announced to us back to it)."""
        return any(p.is_open and not p.upstream for p in self.relay.routing.publishers_of(ns))

    def local_changed(self, namespaces: list[Namespace]) -> None:
        """Local announcements of ``namespaces`` changed: announce / withdraw upstream,
        and open / close upstream interests a local announcement now covers / uncovers."""
        if not self.enabled:
            return
        for ns in namespaces:
            want = self._wants_announce(ns)
            a = self.announced.get(ns)
            if want and a is None:
                a = UpstreamAnnouncement(self, ns)
                self.announced[ns] = a
                self.relay.spawn(a.open())
            elif not want and a is not None:
                a.withdraw()
        for interest in list(self.interests.values()):
            self._sync_interest(interest)

    # -- interests ---------------------------------------------------------------------------
    def _covered(self, prefix: Namespace) -> bool:
        """A local announcement is a prefix of ``prefix``: every track under it routes
        locally (longest-prefix match), never upstream."""
        routing = self.relay.routing
        return any(routing.has(prefix[:n]) for n in range(len(prefix) + 1))

    def _sync_interest(self, interest: UpstreamInterest) -> None:
        want = (self.enabled and bool(interest.watchers) and not interest.refused
                and not self._covered(interest.prefix))
        if want and not interest.active:
            interest.open()
        elif not want and interest.active:
            interest.close()

    def upstream_names(self, prefix: Namespace) -> set[Namespace]:
        interest = self.interests.get(prefix)
        return interest.names if interest is not None else set()

    def watch(self, watcher: NamespaceWatcher) -> set[Namespace]:
        """A local SUBSCRIBE_NAMESPACE; returns the upstream namespaces already known."""
        if not self.relay.config.upstream:
            return set()
        interest = self.interests.get(watcher.prefix)
        if interest is None:
            interest = self.interests[watcher.prefix] = UpstreamInterest(self, watcher.prefix)
        interest.watchers.append(watcher)
        self._sync_interest(interest)
        return set(interest.names)

    def unwatch(self, watcher: NamespaceWatcher) -> None:
        interest = self.interests.get(watcher.prefix)
        if interest is None or watcher not in interest.watchers:
            return
        interest.watchers.remove(watcher)
        if not interest.watchers:
            interest.close()
            del self.interests[watcher.prefix]

    # -- the upstream session: lost, restored, moved (relay/subscribe/uplink.py) ----------------------
    def wants_upstream(self) -> bool:
        """A local announcement to propagate, or a prefix watched locally (not refused
        upstream): the uplink keeps reconnecting while this holds."""
        if not self.enabled:
            return False
        return (any(self._wants_announce(ns) for ns in self.relay.routing.namespaces())
                or any(i.watchers and not i.refused for i in self.interests.values()))

    def resync(self) -> None:
        """On a new upstream session: announce and subscribe again what is still wanted
        (what the lost session carried was dropped with it)."""
        self.local_changed(self.relay.routing.namespaces())

    def move(self, old: PeerSession) -> None:
        """The upstream sent GOAWAY on ``old`` and a new session is up: each announcement
        and interest on ``old`` is sent on the new one (``upstream_peer`` now returns it),
        then cancelled on ``old``; watchers keep the namespaces already reported."""
        if not self.enabled:
            return
        moving = [a for a in self.announced.values() if a.peer is old]
        for a in moving:
            del self.announced[a.ns]  # local_changed makes the new session's announcement
        for interest in list(self.interests.values()):
            if interest.peer is old and interest.active:
                interest.close(keep_names=True)  # re-opened by local_changed
        self.local_changed(self.relay.routing.namespaces())
        for a in moving:
            a.withdraw()  # cancelled on old (the new announcement is not touched)
