"""Serving a :class:`~.publish.Catalog` of :class:`~.publish.TrackPublisher` s to the peer of
one session: :class:`CatalogServer`.

It answers the peer's SUBSCRIBE (draft-22 §"SUBSCRIBE": SUBSCRIBE_OK with the Largest
Object and the Track Properties, then the track's writes reach the subscription), FETCH
(:func:`~.fetch_server.serve_fetch`), TRACK_STATUS (REQUEST_OK with LARGEST_OBJECT) and
SUBSCRIBE_NAMESPACE (REQUEST_OK, then one NAMESPACE per catalog namespace under the prefix,
written in pages of :data:`NAMESPACE_PAGE` that each wait for the request stream to drain:
:func:`send_namespaces`; from then on, while the request stands, NAMESPACE when a namespace
under the prefix gets its first track and NAMESPACE_DONE when it loses its last, never
before its NAMESPACE: :class:`Listing`),
and keeps the subscriptions the session serves — the peer's SUBSCRIBEs and our own PUBLISHes
— with the Track Aliases it hands out. Authorization (``RequestGate.allows``) is checked by
the session before a request gets here.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Sequence

from ..moqt.errors import PublishDoneCode, RequestErrorCode
from ..moqt.messages import (
    Fetch,
    FetchWithType,
    Location,
    Message,
    MessageParameters,
    Subscribe,
    SubscribeNamespace,
    TrackStatus,
)
from .fetch_server import serve_fetch
from .ports import ServingSession
from ..transport import TransportError
from .publish import Catalog, Namespace, Outgoing, TrackPublisher
from .window import subscription_window

__all__ = ["NAMESPACE_LIVE_BUFFER", "NAMESPACE_PAGE", "CatalogServer", "Listing",
           "NamespaceFilter", "send_namespaces"]

#: NAMESPACE messages written before waiting for the request stream's send buffer to drain
#: to the transport's low-water mark (each is at most one 4096-octet Track Namespace plus
#: its framing: a page is bounded by ~64 * 4 KiB per subscriber).
NAMESPACE_PAGE = 64
#: Octets of the request stream's send buffer a page waits for (at most) before the next.
NAMESPACE_PAGE_BUFFER = 64 * 1024
#: Octets a standing SUBSCRIBE_NAMESPACE's stream may hold unacknowledged when a change is
#: to be told: past it the request is reset (draft-22 §"SUBSCRIBE_NAMESPACE": "If the
#: publisher is unable to send NAMESPACE or NAMESPACE_DONE messages in a timely manner
#: because the SUBSCRIBE_NAMESPACE response stream is blocked by flow control, the publisher
#: MAY reset the SUBSCRIBE_NAMESPACE response stream").
NAMESPACE_LIVE_BUFFER = 4 * NAMESPACE_PAGE_BUFFER

#: ``shows(message, namespace)``: whether the NAMESPACE answer ``namespace`` of the peer's
#: SUBSCRIBE_NAMESPACE ``message`` may be sent (``RequestGate.shows``).
NamespaceFilter = Callable[[Message, tuple[bytes, ...]], bool]


class Listing:
    """One SUBSCRIBE_NAMESPACE we answer: which namespaces its peer has been told of, in O(1)
    of our memory beyond the changes made while the first listing is still being paged
    (draft-22 §"SUBSCRIBE_NAMESPACE": "The publisher MUST NOT send NAMESPACE_DONE for a
    namespace suffix before the corresponding NAMESPACE")."""

    def __init__(self, msg: SubscribeNamespace) -> None:
        self.msg = msg
        #: The last namespace :func:`send_namespaces` reached, and whether it reached the end.
        self.cursor: Namespace | None = None
        self.paged = False
        #: Namespaces told live (NAMESPACE) while paging: the pager skips them.
        self.live: set[Namespace] = set()

    def told(self, ns: Namespace) -> bool:
        """Whether the peer was sent NAMESPACE for ``ns``, present in the catalog until now."""
        return self.paged or ns in self.live or (self.cursor is not None and ns <= self.cursor)


class CatalogServer:
    """The tracks of ``catalog`` served on ``session``, and the subscriptions it serves."""

    def __init__(self, session: ServingSession, catalog: Catalog,
                 shows: NamespaceFilter | None = None) -> None:
        self.session = session
        self.catalog = catalog
        self._shows = shows
        self._serving: dict[int, TrackPublisher] = {}
        self._aliases = 0
        self._listings: dict[int, Listing] = {}

    # -- Track Aliases (§"Track Alias": the publisher chooses them) ---------------------------
    def next_alias(self) -> int:
        """The session's next unused Track Alias."""
        alias = self._aliases
        self._aliases += 1
        return alias

    def reserve_alias(self, alias: int) -> None:
        """``alias`` was chosen by the application: later ones come after it."""
        self._aliases = max(self._aliases, alias + 1)

    # -- the subscriptions served ------------------------------------------------------------
    def served(self, rid: int) -> TrackPublisher | None:
        """The track subscription ``rid`` (the peer's SUBSCRIBE or our PUBLISH) serves."""
        return self._serving.get(rid)

    def add(self, rid: int, track: TrackPublisher) -> None:
        """Subscription ``rid`` serves ``track`` from now on."""
        self._serving[rid] = track

    def discard(self, rid: int) -> TrackPublisher | None:
        """Forget subscription ``rid`` (ended); the track it served, if any."""
        return self._serving.pop(rid, None)

    def discard_all(self) -> list[tuple[int, TrackPublisher]]:
        """Forget every subscription and listing (the session ended); what they served."""
        items = list(self._serving.items())
        self._serving.clear()
        if self._listings:
            self._listings.clear()
            self.catalog.unwatch(self._namespace_changed)
        return items

    # -- SUBSCRIBE_NAMESPACE: changes after the first listing --------------------------------
    def _namespace_changed(self, ns: Namespace, present: bool) -> None:
        moqt = self.session.moqt
        for rid, listing in list(self._listings.items()):
            req = None if moqt is None or moqt.closed else moqt.requests.get(rid)
            if req is None:
                del self._listings[rid]  # the request ended (cancelled, or the session)
                continue
            assert moqt is not None
            prefix = listing.msg.track_namespace_prefix
            if ns[:len(prefix)] != prefix or (
                    self._shows is not None and not self._shows(listing.msg, ns)):
                continue
            if self.session.connection.stream_send_buffered(req.stream_id) > \
                    NAMESPACE_LIVE_BUFFER:  # a peer that stopped reading: reset, not held
                moqt.cancel(rid)
                del self._listings[rid]
                continue
            if present:
                moqt.namespace(rid, ns[len(prefix):])
                if not listing.paged:
                    listing.live.add(ns)
            else:
                if listing.told(ns):
                    moqt.namespace_done(rid, ns[len(prefix):])
                listing.live.discard(ns)
        if not self._listings:
            self.catalog.unwatch(self._namespace_changed)
        self.session.pump()

    # -- the peer's requests -----------------------------------------------------------------
    def answer(self, rid: int, msg: Message) -> bool:
        """Answer the peer's request ``msg`` if it is one the catalog serves (SUBSCRIBE,
        FETCH, TRACK_STATUS, SUBSCRIBE_NAMESPACE); False for any other."""
        moqt = self.session.moqt
        assert moqt is not None
        if isinstance(msg, Subscribe):
            self._subscribe(rid, msg)
        elif isinstance(msg, Fetch | FetchWithType):
            self.session.spawn(serve_fetch(self.session, self.catalog, rid, msg))
        elif isinstance(msg, SubscribeNamespace):
            moqt.request_ok(rid)
            listing = Listing(msg)
            if not self._listings:
                self.catalog.watch(self._namespace_changed)
            self._listings[rid] = listing
            # The catalog's shared sorted snapshot: O(1) of our memory per subscriber.
            self.session.spawn(send_namespaces(self.session, rid, msg,
                                               self.catalog.sorted_namespaces(), self._shows,
                                               listing=listing, catalog=self.catalog))
        elif isinstance(msg, TrackStatus):
            track = self.catalog.get(msg.track_namespace, msg.track_name)
            if track is None:
                moqt.reject(rid, RequestErrorCode.DOES_NOT_EXIST, "no such track")
            else:
                params = (MessageParameters(largest_object=Location(*track.largest))
                          if track.largest is not None else MessageParameters())
                moqt.request_ok(rid, params, track.response_properties(), end=True)
        else:
            return False
        return True

    def _subscribe(self, rid: int, msg: Subscribe) -> None:
        moqt = self.session.moqt
        assert moqt is not None
        track = self.catalog.get(msg.track_namespace, msg.track_name)
        if track is None or (track.finished and not track.subscribe_after_finish):
            moqt.reject(rid, RequestErrorCode.DOES_NOT_EXIST, "no such track")
            return
        window = subscription_window(msg.parameters.location_filter, track.largest)
        if window.empty:
            moqt.reject(rid, RequestErrorCode.INVALID_RANGE, "the filter's end precedes its start")
            return
        alias = self.next_alias()
        params = MessageParameters()
        if track.largest is not None:
            params = MessageParameters(largest_object=Location(*track.largest))
        moqt.accept_subscribe(rid, alias, params, track.response_properties())
        self._serving[rid] = track
        if track.finished:
            # subscribe_after_finish: nothing more will be published (past objects
            # are read with FETCH): the subscription ends at once, with no data stream.
            self.session.publish_done(rid, PublishDoneCode.TRACK_ENDED, 0, "track ended")
            return
        track.add_subscriber(Outgoing(self.session, rid, alias, window=window))


async def send_namespaces(session: ServingSession, rid: int, msg: SubscribeNamespace,
                          namespaces: Sequence[Namespace],
                          shows: NamespaceFilter | None = None, *,
                          listing: Listing | None = None,
                          catalog: Catalog | None = None) -> None:
    """One NAMESPACE per namespace of ``namespaces`` (sorted) under the request's prefix
    (its suffix after the prefix) on the request stream of SUBSCRIBE_NAMESPACE ``rid``,
    :data:`NAMESPACE_PAGE` at a time: after each page it waits
    for the stream's send buffer to drain to :data:`NAMESPACE_PAGE_BUFFER` octets
    (``Connection.wait_writable``), so one subscriber holds about a page of our memory,
    however large the catalog and however slowly it reads
    (draft-ietf-moq-transport-22 §"Relay security considerations": a short prefix "can
    cause the relay to send a large volume of NAMESPACE ... messages"). Stops when the
    request or the session ends. With ``listing`` and ``catalog``: a namespace gone from
    ``catalog`` by the time the page reaches it, or told live meanwhile, is skipped, and
    ``listing`` records how far the pages got."""
    prefix = msg.track_namespace_prefix
    n = len(prefix)
    sent = 0
    for i in range(bisect_left(namespaces, prefix), len(namespaces)):
        ns = namespaces[i]
        if ns[:n] != prefix:
            break  # past the contiguous run of the prefix
        moqt = session.moqt
        if moqt is None or moqt.closed:
            return
        req = moqt.requests.get(rid)
        if req is None:
            return  # cancelled meanwhile
        if listing is not None:
            listing.cursor = ns
            if ns in listing.live or (catalog is not None and not catalog.has_namespace(ns)):
                continue
        if shows is not None and not shows(msg, ns):
            continue
        moqt.namespace(rid, ns[len(prefix):])
        sent += 1
        if sent % NAMESPACE_PAGE == 0:
            session.pump()
            try:
                await session.connection.wait_writable(req.stream_id, NAMESPACE_PAGE_BUFFER)
            except TransportError:
                return  # the stream or the connection went away
    if listing is not None:
        listing.paged = True
        listing.live.clear()
    session.pump()
