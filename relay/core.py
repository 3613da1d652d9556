"""The relay: accepts sessions, answers every request, wires routing, upstream
subscriptions, fan-out, the cache and FETCH together. Content-agnostic (it never looks at
payloads and never imports kvsp_moq.kvsp).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from kvsp_moq import transport
from kvsp_moq.moqt.errors import RequestErrorCode, SessionErrorCode
from kvsp_moq.moqt.messages import (
    Fetch,
    FetchWithType,
    Location,
    Message,
    MessageParameters,
    Publish,
    PublishNamespace,
    RequestError,
    RequestOk,
    Setup,
    Subscribe,
    SubscribeNamespace,
    SubscribeTracks,
    TrackStatus,
)
from kvsp_moq.moqt.session import Role
from kvsp_moq.pubsub.driver import Tasks
from kvsp_moq.transport import Server, TransportError

from .fetch.cache import ObjectCache, TrackName
from .ops.config import RelayConfig
from .ops.auth import Principal
from .fetch.service import FetchService, fetch_range
from .transcode.edge import EdgeTranscoding
from .transcode.live import LiveTranscoding
from .fetch.fill import FillService
from .session.deadline import Deadline
from .ops.gate import Gate
from .session.limits import RETRY_INTERVAL_MS, is_reserved_namespace, open_peer_requests, request_namespace
from .ops.logs import event
from .ops.metrics import MetricsServer
from .ops.names import format_namespace
from .subscribe.namespaces import NamespacePropagation
from .session.peer import NamespaceRequestHandler, PeerSession, RequestHandler
from .subscribe.publish_in import PublishRegistry
from .subscribe.rendezvous import Rendezvous
from .subscribe.routing import RoutingTable
from .subscribe.solicit import maybe_solicit
from .ops.stats import RelayStats
from .subscribe.upstream import UpstreamManager
from .subscribe.uplink import UNREACHABLE, Uplink

__all__ = ["Relay"]

logger = logging.getLogger(__name__)
Namespace = tuple[bytes, ...]
Observer = Callable[[str, object], None]


class _Announcement(NamespaceRequestHandler):
    """A PUBLISH_NAMESPACE we accepted; withdrawn by cancelling it (§"Publishing
    Namespaces")."""

    def __init__(self, relay: Relay, peer: PeerSession, rid: int, ns: Namespace) -> None:
        self.relay, self.peer, self.rid, self.ns = relay, peer, rid, ns

    def on_cancelled(self, code: int) -> None:
        self.relay.routing.withdraw(self.peer, self.rid)
        self.relay.propagation.local_changed([self.ns])


class _NamespaceSubscription(NamespaceRequestHandler):
    """A SUBSCRIBE_NAMESPACE: NAMESPACE / NAMESPACE_DONE (suffixes after the prefix) as
    namespaces under the prefix appear and go (§"Subscribing to Namespaces"), only for the
    namespaces its principals may subscribe to (nothing of the others leaks). With an
    upstream relay, the namespaces it reports under the prefix are merged in
    (:mod:`relay.subscribe.namespaces`): one NAMESPACE while either side has a namespace,
    NAMESPACE_DONE once neither has it."""

    def __init__(self, relay: Relay, peer: PeerSession, rid: int, prefix: Namespace,
                 principals: list[Principal]) -> None:
        self.relay, self.peer, self.rid, self.prefix = relay, peer, rid, prefix
        self.principals = principals
        #: Namespaces told to the upstream relay (when it is the one watching).
        self.told: set[Namespace] = set()
        #: The namespaces known when it arrived, not written yet (the listing is paged:
        #: :meth:`list_known`); one withdrawn meanwhile is dropped from it untold.
        self.unlisted: set[Namespace] = set()
        self._listing: list[Namespace] = []
        self.ended = False

    # -- the initial listing, in pages (issue 18: no unbounded synchronous write) -------------
    def list_known(self, known: list[Namespace]) -> None:
        """NAMESPACE for each of ``known`` (sorted): ``namespace_page_size`` at a time, the
        next page once QUIC has sent what the request stream held (wait_writable)."""
        self._listing = list(reversed(known))
        self.unlisted = set(known)
        if self._write_page():
            self.relay.spawn(self._list_rest())

    def _write_page(self) -> bool:
        """One page; True while more remain."""
        moqt = self.peer.moqt
        if self.ended or moqt is None or moqt.closed or self.rid not in moqt.requests:
            self._listing, self.unlisted = [], set()
            return False
        n = 0
        page = self.relay.config.namespace_page_size
        while self._listing and n < page:
            ns = self._listing.pop()
            if ns not in self.unlisted:
                continue  # withdrawn before its turn
            self.unlisted.discard(ns)
            if not self.visible(ns):
                continue
            if self.peer.upstream:
                self.told.add(ns)
            moqt.namespace(self.rid, ns[len(self.prefix):])
            n += 1
        self.peer.flush()
        self.relay.emit("namespace_page", (self, n))
        return bool(self._listing)

    async def _list_rest(self) -> None:
        moqt = self.peer.moqt
        req = moqt.requests.get(self.rid) if moqt is not None else None
        if req is None:
            return
        try:
            while True:
                await self.peer.connection.wait_writable(req.stream_id)
                if not self._write_page():
                    return
        except TransportError:
            self._listing, self.unlisted = [], set()  # the stream or session is gone

    def visible(self, ns: Namespace) -> bool:
        if self.peer.upstream:
            # Our upstream relay soliciting our namespaces (relay/subscribe/solicit.py on its side):
            # only what downstream publishers announced here, never its own back to it.
            return any(p.is_open and not p.upstream
                       for p in self.relay.routing.publishers_of(ns))
        return self.relay.gate.visible(self.principals, ns)

    def send(self, ns: Namespace, done: bool) -> None:
        if ns in self.unlisted:
            # Still waiting for its page: a withdrawal drops it untold, a repeat is a no-op.
            if done:
                self.unlisted.discard(ns)
            return
        if self.peer.upstream:
            # Downstream namespaces go when their last downstream publisher did: tell the
            # end of exactly what was told.
            if done != (ns in self.told):
                return
            if not done and not self.visible(ns):
                return
            (self.told.discard if done else self.told.add)(ns)
        elif not self.visible(ns):
            return
        moqt = self.peer.moqt
        if moqt is None or moqt.closed or self.rid not in moqt.requests:
            self._leave()
            return
        suffix = ns[len(self.prefix):]
        if done:
            moqt.namespace_done(self.rid, suffix)
        else:
            moqt.namespace(self.rid, suffix)
        self.peer.flush()

    # local announcements (RoutingTable watcher): not told again what the upstream has
    # (the upstream relay soliciting us hears only of local publishers: never filtered by
    # what it reported itself, or an echo would keep a gone namespace alive on both sides)
    def namespace_added(self, namespace: Namespace) -> None:
        if (self.peer.upstream
                or namespace not in self.relay.propagation.upstream_names(self.prefix)):
            self.send(namespace, False)

    def namespace_removed(self, namespace: Namespace) -> None:
        if (self.peer.upstream
                or namespace not in self.relay.propagation.upstream_names(self.prefix)):
            self.send(namespace, True)

    def _leave(self) -> None:
        self.ended = True
        self._listing, self.unlisted = [], set()
        self.relay.routing.unwatch(self)
        self.relay.propagation.unwatch(self)

    def on_cancelled(self, code: int) -> None:
        self._leave()

    def on_session_closed(self, peer: PeerSession) -> None:
        self._leave()


class _TrackStatusProxy(RequestHandler):
    """A TRACK_STATUS we could not answer locally, asked upstream; the answer is relayed."""

    def __init__(self, down: PeerSession, rid: int, up: PeerSession, timeout: float,
                 stats: RelayStats) -> None:
        self.down, self.rid, self.up = down, rid, up
        self.up_rid: int | None = None
        self.stats = stats
        #: The upstream answer must come within the request timeout (relay/session/deadline.py).
        self.timer = Deadline(timeout, self._timed_out)
        self.answered = False

    def _timed_out(self) -> None:
        if self.answered:
            return
        self.stats.upstream_timeouts += 1
        if self.up_rid is not None:
            self.up.cancel_request(self.up_rid)
        self._reject(RequestErrorCode.TIMEOUT, "upstream did not answer TRACK_STATUS in time")

    def _reject(self, code: int, reason: str) -> None:
        self.answered = True
        moqt = self.down.moqt
        if moqt is not None and not moqt.closed and self.rid in moqt.requests:
            moqt.reject(self.rid, code, reason)
            self.down.flush()

    def _answer(self, msg: Message | None) -> None:
        if self.answered:
            return
        self.answered = True
        self.timer.cancel()
        moqt = self.down.moqt
        if moqt is not None and not moqt.closed and self.rid in moqt.requests:
            if isinstance(msg, RequestOk):
                moqt.request_ok(self.rid, msg.parameters, msg.track_properties, end=True)
            elif isinstance(msg, RequestError):
                moqt.reject(self.rid, msg.error_code, msg.error_reason)
            else:
                moqt.reject(self.rid, RequestErrorCode.INTERNAL_ERROR, "upstream went away")
            self.down.flush()
        if self.up_rid is not None:
            self.up.release(self.up_rid)

    def on_response(self, msg: Message) -> None:
        self._answer(msg)

    def on_cancelled(self, code: int) -> None:
        self._answer(None)

    def on_session_closed(self, peer: PeerSession) -> None:
        self._answer(None)


class Relay:
    """A MOQT relay. ``await relay.start()``; ``await relay.shutdown()`` (GOAWAY + drain)."""

    def __init__(self, config: RelayConfig) -> None:
        self.config = config
        self.stats = RelayStats()
        self.cache = ObjectCache(config.cache_bytes)
        self.routing: RoutingTable[PeerSession] = RoutingTable()
        self.observers: list[Observer] = []
        self.upstreams = UpstreamManager(self.cache, self.stats, config.subscriber_queue_bytes,
                                         self.emit, config.request_timeout)
        self.fetches = FetchService(self.cache, self.stats, self.spawn, config.request_timeout)
        self.fetches.largest_of = self._live_largest  # a FETCH is capped there (relay/fetch/service.py)
        # Joining FETCH, fill fetch streams (relay/fetch/fill.py)
        self.fills = FillService(self.upstreams, self.fetches, self)
        #: FETCHes of tracks the configured transcoder makes (relay/transcode/edge.py), or None.
        self.transcoding = (EdgeTranscoding(config.transcoder, self.fetches, self.cache, self.stats, self.spawn,
                                            self.route_then, self.reject, config.request_timeout)
                            if config.transcoder is not None else None)
        #: SUBSCRIBEs of those tracks, coded as the source's objects arrive (relay/transcode/live.py).
        self.live_transcoding = (LiveTranscoding(config.transcoder, self.upstreams, self.spawn,
                                                 config.subscriber_queue_bytes)
                                 if config.transcoder is not None else None)
        self.sessions: set[PeerSession] = set()
        self.server: Server | None = None
        #: Our session to the --upstream relay: connect, liveness, reconnect with backoff,
        #: GOAWAY moves (relay/subscribe/uplink.py).
        self.uplink = Uplink(self, self.stats, track=self._track, spawn=self.spawn,
                             closing=self._is_closing, wanted=self._upstream_wanted,
                             restored=self._upstream_restored, moved=self._upstream_moved)
        self.upstreams.on_dropped = self.uplink.check_idle_soon
        #: Background tasks (cancelled by :meth:`close`; a failure is logged as "relay
        #: task failed").
        self._tasks = Tasks(logger, "relay task")
        self.stats.gauges = self._gauges
        self.gate = Gate(config.auth.authorizer if config.auth is not None else None,
                         self.stats)
        self.metrics: MetricsServer | None = None
        self.observers.append(self._log_observed)
        #: Set by shutdown / close: nothing new is opened upstream.
        self.closing = False
        self.propagation = NamespacePropagation(self)
        #: PUBLISHed tracks and SUBSCRIBE_TRACKS watchers; SUBSCRIBEs held for a publisher.
        self.publishes = PublishRegistry(self, self.upstreams)
        self.rendezvous = Rendezvous(self)

    # -- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> Relay:
        if self.config.auth is None:
            logger.warning("relay: no authorization config (--config): the relay is OPEN, "
                           "every peer may publish and subscribe anything")
        self.server = await transport.serve(self.config.host, self.config.port, self._accept,
                                            self.config.server_transport)
        if self.config.metrics is not None:
            self.metrics = await MetricsServer(self.stats.snapshot).start(*self.config.metrics)
        return self

    @property
    def port(self) -> int:
        assert self.server is not None
        return self.server.port

    @property
    def url(self) -> str:
        return f"moqt://{self.config.host}:{self.port}/moq"

    def _accept(self) -> PeerSession:
        return self._track(PeerSession(self, Role.SERVER))

    def _track(self, peer: PeerSession) -> PeerSession:
        self.sessions.add(peer)
        peer.closed.add_done_callback(lambda _f: self.sessions.discard(peer))
        return peer

    async def shutdown(self, timeout: float | None = None) -> bool:
        """GOAWAY to every session (§"GOAWAY"), wait until they have left or ``timeout``
        (default ``config.drain_timeout``) passed, then close what is left and stop
        listening. True if every session left by itself."""
        timeout = self.config.drain_timeout if timeout is None else timeout
        self.closing = True
        # draft-22 §"GOAWAY": "Timeout: The time in milliseconds the sender will wait for
        # graceful closure" (the same field in drafts 18 and 20).
        timeout_ms = max(0, round(timeout * 1000))
        for peer in list(self.sessions):
            moqt = peer.moqt
            if moqt is None or moqt.closed or moqt.goaway_sent:
                continue
            try:
                moqt.goaway("" if peer.upstream else self.config.goaway_uri, timeout_ms)
            except (RuntimeError, ValueError):
                continue
            peer.flush()
        # Our own upstream sessions are clients of someone else: leave them ourselves.
        for up in [self.uplink.peer, *self.uplink.draining]:
            if up is not None:
                up.close(SessionErrorCode.NO_ERROR, "relay shutting down")
        waiting = [p.closed for p in self.sessions if not p.closed.done()]
        clean = True
        if waiting:
            _done, pending = await asyncio.wait(waiting, timeout=timeout)
            clean = not pending
        # "When sent on the control stream, the sender closes the session with GOAWAY_TIMEOUT
        # after the indicated timeout if there are still open requests."
        for peer in list(self.sessions):
            moqt = peer.moqt
            if peer.is_open and moqt is not None and moqt.requests:
                event("goaway_timeout", logging.WARNING, peer=peer.address,
                      open_requests=len(moqt.requests))
                peer.close(SessionErrorCode.GOAWAY_TIMEOUT, "drain timeout after GOAWAY")
        await self.close()
        return clean

    async def close(self) -> None:
        self.closing = True
        for peer in list(self.sessions):
            peer.close(SessionErrorCode.NO_ERROR, "relay closing")
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()
            self.server = None
        if self.metrics is not None:
            await self.metrics.close()
            self.metrics = None
        self._tasks.cancel_all()

    # -- observability -----------------------------------------------------------------------
    def _gauges(self) -> dict[str, int]:
        return {
            "sessions": len(self.sessions),
            "tracks": len(self.upstreams.tracks),
            "subscribers": self.upstreams.subscriber_count,
            "namespaces": len(self.routing.namespaces()),
            "cache_bytes": self.cache.bytes,
            "cache_objects": len(self.cache),
            "cache_evictions": self.cache.evictions,
            "fetches_in_flight": len(self.fetches.inflight),
        }

    def _log_observed(self, kind: str, obj: object) -> None:
        if kind == "too_far_behind":
            peer = getattr(obj, "peer", None)
            ns, name = getattr(getattr(obj, "fanout", None), "track", ((), b""))
            event("too_far_behind", logging.WARNING,
                  peer=peer.address if peer is not None else "?",
                  request_id=getattr(obj, "request_id", None), namespace=format_namespace(ns),
                  track=name.decode("utf-8", "backslashreplace"))

    def emit(self, kind: str, obj: object) -> None:
        """Tell ``relay.observers`` (tests, tools) ``kind`` happened to ``obj``."""
        for fn in list(self.observers):
            fn(kind, obj)

    def spawn(self, coro: Awaitable[None]) -> None:
        """Run ``coro`` as a task of the relay (cancelled by :meth:`close`; failures
        logged)."""
        self._tasks.spawn(coro)

    # -- routes ------------------------------------------------------------------------------
    async def upstream_peer(self) -> PeerSession | None:
        """Our session to the upstream relay (connected on first use, again after it
        ended or sent GOAWAY; relay/subscribe/uplink.py)."""
        return await self.uplink.get()

    # -- the upstream link's notifications (relay/subscribe/uplink.py) ---------------------------------
    def _is_closing(self) -> bool:
        return self.closing

    def _upstream_wanted(self) -> bool:
        """Something here needs the upstream session: a local announcement or namespace
        interest to propagate, or a track PUBLISHed by a downstream publisher."""
        return self.propagation.wants_upstream() or any(
            not t.peer.upstream for t in self.publishes.active())

    def _upstream_restored(self, peer: PeerSession) -> None:
        """A new upstream session after a loss: announce, subscribe and PUBLISH again."""
        self.propagation.resync()
        self.publishes.upstream.republish(self.publishes.active(), peer)

    def _upstream_moved(self, old: PeerSession, new: PeerSession) -> None:
        """After the upstream's GOAWAY: what rode on ``old`` moves to ``new``."""
        self.propagation.move(old)
        self.publishes.upstream.republish(self.publishes.active(), new)
        self.upstreams.move(old, new)

    def _local_route(self, ns: Namespace, requester: PeerSession) -> PeerSession | None:
        peer = self.routing.lookup(ns)
        return peer if peer is not None and peer.is_open else None

    def route_then(self, down: PeerSession, rid: int, ns: Namespace,
                    then: Callable[[PeerSession], None]) -> None:
        """Find where ``ns`` is served: an announced publisher (longest prefix), else the
        upstream relay, else REQUEST_ERROR DOES_NOT_EXIST. Calls ``then(route)``."""
        route = self._local_route(ns, down)
        if route is not None:
            then(route)
            return
        if not self.config.upstream or down.upstream:
            # A request from the upstream relay is never sent back up (no loops).
            self.reject(down, rid, RequestErrorCode.DOES_NOT_EXIST, "no route for namespace")
            return

        async def via_upstream() -> None:
            try:
                up = await self.upstream_peer()
            except UNREACHABLE as exc:
                logger.warning("relay: upstream %s unreachable: %s", self.config.upstream, exc)
                self.reject(down, rid, RequestErrorCode.INTERNAL_ERROR, "upstream unreachable")
                return
            if up is None or up is down:
                self.reject(down, rid, RequestErrorCode.DOES_NOT_EXIST, "no route")
                return
            then(up)

        self.spawn(via_upstream())

    def reject(self, peer: PeerSession, rid: int, code: int, reason: str,
               retry_interval: int = 0) -> None:
        """REQUEST_ERROR ``code`` for the peer's request ``rid`` (logged), if it is open."""
        moqt = peer.moqt
        event("request_error", peer=peer.address, request_id=rid, code=int(code), reason=reason)
        if moqt is not None and not moqt.closed and rid in moqt.requests:
            moqt.reject(rid, code, reason, retry_interval=retry_interval)
            peer.flush()

    # -- what services tell the relay (relay/ports.py) ----------------------------------------
    def publisher_appeared(self, namespace: Namespace, name: bytes | None = None) -> None:
        """SUBSCRIBEs held for a publisher of ``namespace`` (or of the track) proceed."""
        self.rendezvous.publisher_appeared(namespace, name)

    def local_namespaces_changed(self, namespaces: list[Namespace]) -> None:
        """Local announcements changed: the upstream relay is told (relay/subscribe/namespaces.py)."""
        self.propagation.local_changed(namespaces)

    # -- requests from peers -----------------------------------------------------------------
    def on_request(self, peer: PeerSession, rid: int, msg: Message) -> None:
        principals = self.gate.check(peer, rid, msg)
        if principals is None:
            return  # refused UNAUTHORIZED (or the session closed for its tokens)
        ns = request_namespace(msg)
        if ns is not None and is_reserved_namespace(ns):
            # draft-22 §"Reserved Namespaces" / §"Session-Level Tracks and Namespaces":
            # DOES_NOT_EXIST, never forwarded to another session (relay/session/limits.py).
            self.stats.reserved_refusals += 1
            self.reject(peer, rid, RequestErrorCode.DOES_NOT_EXIST,
                        "reserved namespace: no such session-level track or namespace")
            return
        moqt = peer.moqt
        if (not peer.upstream and moqt is not None
                and open_peer_requests(moqt) > self.config.max_requests_per_session):
            # §"Subscription Amplification": EXCESSIVE_LOAD, with a Retry Interval.
            self.stats.excessive_load += 1
            self.reject(peer, rid, RequestErrorCode.EXCESSIVE_LOAD,
                        f"more than {self.config.max_requests_per_session} open requests "
                        "on this session", retry_interval=RETRY_INTERVAL_MS + 1)
            return
        if isinstance(msg, Subscribe):
            self.on_subscribe(peer, rid, msg)
        elif isinstance(msg, Fetch | FetchWithType):
            self._on_fetch(peer, rid, msg)
        elif isinstance(msg, PublishNamespace):
            self._on_publish_namespace(peer, rid, msg)
        elif isinstance(msg, SubscribeNamespace):
            self._on_subscribe_namespace(peer, rid, msg, principals)
        elif isinstance(msg, TrackStatus):
            self._on_track_status(peer, rid, msg)
        elif isinstance(msg, Publish):
            self.publishes.on_publish(peer, rid, msg)
        elif isinstance(msg, SubscribeTracks):
            self.publishes.on_subscribe_tracks(peer, rid, msg, principals)
        else:
            self.reject(peer, rid, RequestErrorCode.NOT_SUPPORTED,
                         f"{msg.NAME} not supported by this relay")

    def on_subscribe(self, peer: PeerSession, rid: int, msg: Subscribe) -> None:
        """Route a SUBSCRIBE: join the track's upstream subscription, else open one where
        its namespace is served, else hold it for a publisher (RENDEZVOUS_TIMEOUT)."""
        track: TrackName = (tuple(msg.track_namespace), bytes(msg.track_name))
        if self.upstreams.get(track) is not None:
            self.upstreams.get(track).join(peer, rid, msg)  # type: ignore[union-attr]
            return

        live = self.live_transcoding
        source = live.source_of(track) if live is not None else None
        source_up = self.upstreams.get(source) if source is not None else None
        if live is not None and source is not None and source_up is not None:
            # Another codec of a replica whose source is subscribed (or PUBLISHed) here.
            live.subscribe(track, source, source_up.peer, peer, rid, msg)
            return

        def go(route: PeerSession) -> None:
            # Re-check: another SUBSCRIBE may have opened it while we connected upstream.
            if source is not None and live is not None:
                live.subscribe(track, source, route, peer, rid, msg)  # coded here (relay/transcode/live.py)
            else:
                self.upstreams.subscribe(track, route, peer, rid, msg)

        if (self._local_route(track[0], peer) is None
                and (not self.config.upstream or peer.upstream)
                and self.rendezvous.hold(peer, rid, msg)):
            return  # RENDEZVOUS_TIMEOUT: wait for a publisher (relay/subscribe/rendezvous.py)
        self.route_then(peer, rid, track[0], go)

    def _live_largest(self, track: TrackName) -> tuple[int, int] | None:
        """The Largest Object of ``track``'s Established upstream subscription (None: none)."""
        up = self.upstreams.get(track)
        return up.fanout.largest if up is not None and up.established and not up.ended else None

    def _on_fetch(self, peer: PeerSession, rid: int, msg: Message) -> None:
        self.stats.fetches += 1
        rng = fetch_range(msg)
        if rng is None:  # a draft-18 Joining FETCH
            self.fills.joining_fetch(peer, rid, msg)  # type: ignore[arg-type]
            return
        if self.fetches.try_cache(peer, rid, rng):
            return
        if self.transcoding is not None and self.transcoding.fetch(peer, rid, rng):
            return  # another codec of a replica, made here once (relay/transcode/edge.py)

        def go(route: PeerSession) -> None:
            if not self.fetches.try_cache(peer, rid, rng):  # it may have landed meanwhile
                self.fetches.join_or_start(peer, rid, rng, route)

        self.route_then(peer, rid, rng.track[0], go)

    def _on_publish_namespace(self, peer: PeerSession, rid: int, msg: PublishNamespace) -> None:
        assert peer.moqt is not None
        ns = tuple(msg.track_namespace)
        peer.moqt.request_ok(rid)
        peer.served[rid] = _Announcement(self, peer, rid, ns)
        peer.flush()
        self.routing.announce(ns, peer, rid)
        self.propagation.local_changed([ns])
        self.rendezvous.publisher_appeared(ns)

    def _on_subscribe_namespace(self, peer: PeerSession, rid: int,
                                msg: SubscribeNamespace, principals: list[Principal]) -> None:
        assert peer.moqt is not None
        prefix = tuple(msg.track_namespace_prefix)
        peer.moqt.request_ok(rid)
        watcher = _NamespaceSubscription(self, peer, rid, prefix, principals)
        peer.served[rid] = watcher
        known = set(self.routing.watch(watcher))
        if not peer.upstream:  # the upstream relay is not told its own namespaces back
            known |= self.propagation.watch(watcher)
        peer.flush()
        watcher.list_known(sorted(ns for ns in known if not is_reserved_namespace(ns)))

    def _on_track_status(self, peer: PeerSession, rid: int, msg: TrackStatus) -> None:
        track: TrackName = (tuple(msg.track_namespace), bytes(msg.track_name))
        up = self.upstreams.get(track)
        largest = (up.fanout.largest if up is not None else None) or self.cache.largest(track)
        if largest is not None:
            assert peer.moqt is not None
            props = (up.track_properties if up is not None else ()) \
                or self.cache.track_properties(track) or ()
            peer.moqt.request_ok(rid, MessageParameters(largest_object=Location(*largest)),
                                 props, end=True)
            peer.flush()
            return

        def go(route: PeerSession) -> None:
            proxy = _TrackStatusProxy(peer, rid, route, self.config.request_timeout, self.stats)
            assert route.moqt is not None
            proxy.up_rid = route.moqt.track_status(track[0], track[1])
            route.local[proxy.up_rid] = proxy
            proxy.timer.arm()
            route.flush()

        self.route_then(peer, rid, track[0], go)

    # -- session events ----------------------------------------------------------------------
    def on_setup(self, peer: PeerSession, setup: Setup) -> None:
        """A downstream session is established (its SETUP passed the gate)."""
        peer.solicitation = maybe_solicit(self, peer, setup)

    def on_goaway(self, peer: PeerSession) -> None:
        if peer.upstream:  # move to a new upstream session (relay/subscribe/uplink.py)
            self.uplink.goaway(peer, peer.goaway_uri)

    def on_session_closed(self, peer: PeerSession) -> None:
        code, reason = peer.closed.result() if peer.closed.done() else (None, "")
        event("session_close", peer=peer.address if peer.connection is not None else "?",
              upstream=peer.upstream, code=code, reason=reason,
              seconds=round(time.monotonic() - peer.opened_at, 3) if peer.opened_at else None)
        # A publisher leaving withdraws its namespaces: watchers get NAMESPACE_DONE (and
        # the upstream relay our withdrawal).
        mine = self.routing.namespaces_of(peer)
        self.routing.withdraw(peer)
        if mine:
            self.propagation.local_changed(mine)
        if peer.upstream:
            self.uplink.lost(peer)
