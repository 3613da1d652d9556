"""Joining a track with its recent past: draft-18 Joining FETCH and the fill fetch streams
of drafts 20+ (SUBSCRIBE with FILL_PARAMETERS).

* **Joining FETCH** (draft 18 §"Joining Fetches", Fetch Type 0x2 Relative / 0x3 Absolute):
  the joined subscription is the peer's SUBSCRIBE with the Joining Request ID on the same
  session (one still waiting for its upstream subscription is waited for, §"the Publisher
  receiving the Joining Fetch buffers the pending Joining Fetch until ... the Subscription
  is established"). §"Joining Fetch Range Calculation": the range ends at the subscription's
  Joining Location (the Largest Object of its SUBSCRIBE_OK, inclusive) and starts at
  ``{Joining Location.Group - Joining Start, 0}`` (Relative, clamped at 0) or
  ``{Joining Start, 0}`` (Absolute). It is then a FETCH of that range (:mod:`relay.fetch.service`):
  from the cache when the range is complete there, else ONE upstream FETCH to the joined
  subscription's publisher (single-flight with any other FETCH / fill of the same range).
  Errors: no such subscription → INVALID_JOINING_REQUEST_ID (0x32); nothing published yet
  or an absolute start past the Joining Location → INVALID_RANGE (0x11).
* **Fill fetch stream** (draft-20 editor's copy §"Fill Semantics"): a SUBSCRIBE with
  FILL_PARAMETERS and Forward State 1 gets, besides SUBSCRIBE_OK and the live objects, one
  uni stream with FETCH_HEADER{Request ID = the SUBSCRIBE's} carrying the fill range: the
  LOCATION_FILTER inside FILL_PARAMETERS (else the subscription's) evaluated with the FETCH
  rules against the Largest Object of SUBSCRIBE_OK, so it never goes past it. Served from
  the cache, from what the relay holds with only the gaps FETCHed upstream (relay.fetch.held), or
  an upstream FETCH like a FETCH; FIN when done; an empty range opens no
  stream; a failed upstream FETCH resets the stream (INTERNAL_ERROR) right after its
  header. The stream belongs to the subscription's request in the session's sender
  (:mod:`relay.session.sender`): ranked with its subscriber priority, before subscription-delivered
  objects of the same group (§"Scheduling Algorithm" rule 4), pulled object by object (no
  copy, no budget), and closed before that subscription's PUBLISH_DONE, whose Stream Count
  includes it.

Not yet: FILL_PARAMETERS in REQUEST_UPDATE (no new fill stream is opened), the fill's own
GROUP_ORDER (descending), SUBSCRIBER_PRIORITY and FILL_TIMEOUT, a Joining FETCH for a
SUBSCRIBE still being routed (before its upstream SUBSCRIBE exists:
INVALID_JOINING_REQUEST_ID).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvsp_moq.moqt.data import FetchStreamEncoder
from kvsp_moq.moqt.errors import RequestErrorCode
from kvsp_moq.moqt.messages import LocationFilter, LocationFilterType, Subscribe
from kvsp_moq.moqt.messages.fetch import FetchType, JoiningFetch
from kvsp_moq.moqt.objects import ObjectStatus
from kvsp_moq.pubsub.window import subscription_window
from kvsp_moq.wire.errors import StreamResetCode

from .cache import CachedObject
from ..subscribe.fanout import Subscriber
from .service import FetchService
from .held import HeldAnswer
from .inflight import WHOLE_GROUP, FetchRange, FetchSink, UpstreamFetch, fetch_pieces
from ..session.peer import PeerSession
from ..session.sender import RequestOut
from ..subscribe.upstream import UpstreamManager, UpstreamSubscription

if TYPE_CHECKING:  # pragma: no cover
    from ..ports import Requests

__all__ = ["FillService", "fill_range", "joining_range"]

logger = logging.getLogger(__name__)
Loc = tuple[int, int]


def joining_range(msg: JoiningFetch, joining_location: Loc) -> tuple[Loc, Loc] | None:
    """Draft 18 §"Joining Fetch Range Calculation": (start, inclusive end), or None when the
    start lies after the end."""
    if msg.fetch_type is FetchType.RELATIVE_JOINING:
        start = (max(0, joining_location[0] - msg.joining_start), 0)
    else:
        start = (msg.joining_start, 0)
    return (start, joining_location) if start <= joining_location else None


def fill_range(flt: LocationFilter | None, largest: Loc | None) -> tuple[Loc, Loc] | None:
    """The fill range (§"Fill Semantics"): ``flt`` evaluated with the FETCH rules (no filter:
    the whole track), capped at the Largest Object; None when empty."""
    if largest is None:
        return None  # nothing published: an empty range
    if flt is None or flt.filter_type is LocationFilterType.NONE:
        return (0, 0), largest
    w = subscription_window(flt, largest)
    end = largest
    if w.end_group is not None:
        end = min(largest, (w.end_group, WHOLE_GROUP if w.end_object is None else w.end_object))
    return (w.start, end) if w.start <= end else None


class _FillStream(FetchSink):
    """The fill fetch stream of one subscription: written through its ordered queue."""

    def __init__(self, service: FillService, sub: Subscriber, first: Loc, last: Loc) -> None:
        self.service, self.sub, self.first, self.last = service, sub, first, last
        self.sid: int | None = None

    def _open(self, publisher_priority: int, group_id: int) -> int | None:
        sub = self.sub
        moqt = sub.peer.moqt
        if sub.ended or moqt is None or moqt.closed or sub.request_id not in moqt.requests:
            return None
        sid = moqt.open_fetch_stream(sub.request_id)  # FETCH_HEADER{the SUBSCRIBE's ID}
        sub.streams_opened += 1  # counted in PUBLISH_DONE's Stream Count
        sub.peer.flush()
        sub.out.open_stream(sid, publisher_priority, group_id, fill=True)
        self.sid = sid
        return sid

    def _keep(self, loc: Loc) -> bool:
        return self.first <= loc <= self.last

    def _encoder(self) -> FetchStreamEncoder:
        return FetchStreamEncoder(self.sub.request_id, self.sub.peer.version)

    def deliver(self, objects: list[CachedObject], end_of_track: bool) -> None:
        mine = [o for o in objects if o.status is ObjectStatus.NORMAL and self._keep(o.location)]
        first = mine[0] if mine else None
        sid = self._open(first.publisher_priority if first else 128,
                         first.group_id if first else self.first[0])
        if sid is not None:
            self.sub.out.feed(sid, fetch_pieces(self._encoder(), mine, self.service.fetches.stats))

    def start(self, up: UpstreamFetch) -> bool:
        """Cut through: the stream opens now and carries the objects as they arrive."""
        sid = self._open(128, self.first[0])
        if sid is not None:
            self.sub.out.feed(sid, up.pieces(self._encoder(), self.service.fetches.stats,
                                             self._keep))
        return True

    def progress(self) -> None:
        if self.sid is not None:
            self.sub.out.wake(self.sid)

    finish = progress  # the rest, then the FIN

    def cut(self, code: int, reason: str) -> None:
        logger.info("relay: fill of request %d cut (%#x): %s", self.sub.request_id, code, reason)
        if self.sid is not None:
            self.sub.out.reset(self.sid, code)

    def fail(self, code: int, reason: str, retry_interval: int = 0) -> None:
        if code == RequestErrorCode.INVALID_RANGE:
            self.deliver([], False)  # no objects in the range: FETCH_HEADER, FIN
            return
        logger.info("relay: fill of request %d failed: %s", self.sub.request_id, reason)
        sid = self._open(128, self.first[0])
        if sid is not None:
            self.sub.out.reset(sid, StreamResetCode.INTERNAL_ERROR)


class _HeldFill:
    """A fill fetch stream answered from what the relay holds, gaps upstream (relay.fetch.held):
    it opens at once (a fill stream has no FETCH_OK to wait for); a failure resets it."""

    needs_end = False

    def __init__(self, fill: _FillStream) -> None:
        self.fill = fill

    def open(self, end_location: Loc, end_of_track: bool, publisher_priority: int,
             group_id: int) -> tuple[RequestOut, int] | None:
        sid = self.fill._open(publisher_priority, group_id)
        return None if sid is None else (self.fill.sub.out, sid)

    def encoder(self) -> FetchStreamEncoder:
        return self.fill._encoder()

    def refuse(self, code: int, reason: str, retry_interval: int) -> None:
        self.fill.fail(code, reason, retry_interval)

    def done(self) -> None:
        """Nothing more: the stream belongs to the subscription (its PUBLISH_DONE counts it)."""


class FillService:
    """Joining FETCHes and fill fetch streams: served from the cache or an upstream FETCH
    (``fetches``), for subscriptions of ``upstreams``; requests are routed and refused by
    the relay (``requests``)."""

    def __init__(self, upstreams: UpstreamManager, fetches: FetchService,
                 requests: Requests) -> None:
        self.upstreams = upstreams
        self.fetches = fetches
        self.requests = requests
        #: (session, SUBSCRIBE request ID) → Joining FETCHes waiting for its SUBSCRIBE_OK.
        self.waiting: dict[tuple[PeerSession, int], list[Callable[[Subscriber | None], None]]] = {}
        upstreams.on_accepted = self._accepted
        upstreams.on_refused = self._refused

    # -- subscriptions -----------------------------------------------------------------------
    def _accepted(self, up: UpstreamSubscription, sub: Subscriber, msg: Subscribe) -> None:
        for fn in self.waiting.pop((sub.peer, sub.request_id), ()):
            fn(sub)
        params = msg.parameters
        fill = params.fill_parameters
        if fill is None or params.forward is False:
            return  # §"Opening and Closing Fill Fetch Streams": Forward 0 opens none
        flt = fill.location_filter if fill.location_filter is not None else \
            params.location_filter
        rng = fill_range(flt, sub.joining_location)
        if rng is None:
            return  # an empty fill range: no stream
        start, end = rng
        sink = _FillStream(self, sub, start, end)
        self._serve(sink, FetchRange(up.track, start, end), up.peer if up.peer.is_open else None)

    def _refused(self, down: PeerSession, rid: int) -> None:
        for fn in self.waiting.pop((down, rid), ()):
            fn(None)

    def _serve(self, sink: _FillStream, rng: FetchRange, route: PeerSession | None) -> None:
        fetches = self.fetches
        hit = fetches.cache.lookup_range(rng.track, rng.start, rng.end)
        held = fetches.held_plan(rng) if hit is None else None
        if hit is not None:
            fetches.stats.cache_hits += 1
            sink.deliver(hit.objects, hit.end_of_track)
        elif held is not None and (route is not None or not held[0].gaps):
            # §"Publisher Interactions": the relay "serves the fill range from its cache and
            # retrieves any missing objects upstream" (relay.fetch.held).
            fetches.stats.cache_hits += 1
            HeldAnswer(fetches, _HeldFill(sink), rng.track, *held).start(route)
        elif route is not None:
            fetches.wait_upstream(sink, rng, route)
        else:
            sink.fail(RequestErrorCode.INTERNAL_ERROR, "the track's publisher went away")

    # -- Joining FETCH (draft 18) ------------------------------------------------------------
    def joining_fetch(self, peer: PeerSession, rid: int, msg: JoiningFetch) -> None:
        jrid = msg.joining_request_id
        h = peer.served.get(jrid)
        if isinstance(h, Subscriber) and not h.ended:
            self._join(peer, rid, msg, h)
        elif self.upstreams.is_pending(peer, jrid):
            def later(sub: Subscriber | None) -> None:
                if sub is None:
                    self._reject(peer, rid, RequestErrorCode.INVALID_JOINING_REQUEST_ID,
                                 "the joined subscription was refused")
                else:
                    self._join(peer, rid, msg, sub)

            self.waiting.setdefault((peer, jrid), []).append(later)
        else:
            self._reject(peer, rid, RequestErrorCode.INVALID_JOINING_REQUEST_ID,
                         f"no established subscription {jrid}")

    def _join(self, peer: PeerSession, rid: int, msg: JoiningFetch, sub: Subscriber) -> None:
        jl = sub.joining_location
        if jl is None:
            self._reject(peer, rid, RequestErrorCode.INVALID_RANGE, "no objects published yet")
            return
        rng = joining_range(msg, jl)
        if rng is None:
            self._reject(peer, rid, RequestErrorCode.INVALID_RANGE,
                         "Joining Start after the Joining Location")
            return
        fetch = FetchRange(sub.fanout.track, *rng)
        if self.fetches.try_cache(peer, rid, fetch):
            return
        up = self.upstreams.get(fetch.track)
        if up is not None and up.peer.is_open:
            self.fetches.join_or_start(peer, rid, fetch, up.peer)
            return

        def go(route: PeerSession) -> None:
            if not self.fetches.try_cache(peer, rid, fetch):
                self.fetches.join_or_start(peer, rid, fetch, route)

        self.requests.route_then(peer, rid, fetch.track[0], go)

    def _reject(self, peer: PeerSession, rid: int, code: int, reason: str) -> None:
        self.requests.reject(peer, rid, code, reason)
