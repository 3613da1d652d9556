"""FETCH through the relay (draft-22 §"FETCH", §"Caching Relays").

* A FETCH whose whole range is in the cache (see :mod:`relay.fetch.cache`) is answered from it:
  FETCH_OK (End Location = the last object's, the cached Track Properties) and one fetch
  stream with the objects, each with its cached Subgroup ID, priority and raw Object
  Properties: the same bytes the origin sent, the cached chunks handed to QUIC as they are.
* A miss goes upstream ONCE per (track, range) however many FETCHes for it arrive while it
  is in flight (single-flight, :class:`relay.fetch.inflight.UpstreamFetch`), and is **cut
  through**: FETCH_OK goes down when the upstream's FETCH_OK arrives (with its End Location,
  End Of Track and Track Properties), then every object header and payload chunk as it
  arrives, to every FETCH waiting on the range (a later one gets what arrived so far, then
  the rest live); the objects are cached and the range recorded complete at the FIN.
* Upstream REQUEST_ERROR is passed to every waiter with its code and reason; a failure after
  FETCH_OK resets the downstream fetch streams (see :mod:`relay.fetch.inflight`).

* The waiters of an upstream FETCH are :class:`~relay.fetch.inflight.FetchSink` objects: a
  downstream FETCH (:class:`FetchAnswer`), or a fill fetch stream of a subscription
  (:mod:`relay.fetch.fill`), which shares the same single-flight.

* The fetch stream is handed to QUIC by the session's sender (:mod:`relay.session.sender`) with
  the FETCH's SUBSCRIBER_PRIORITY (default 128; changed by REQUEST_UPDATE, §"SUBSCRIBER
  PRIORITY Parameter": "relative to other subscriptions and fetch responses in the same
  session") and each object's publisher priority (§"Priorities": "FETCH responses however
  can contain objects with different publisher priorities"); its objects are pulled from
  the held list one at a time, never copied or queued.

* A range the cache holds only part of — objects a subscription the relay forwards brought,
  or several earlier FETCHes — is answered from what is held, only the gaps of unknown
  status going upstream (:mod:`relay.fetch.known` plans it, :class:`relay.fetch.held.HeldAnswer` answers
  it). A range capped at the Largest Object of the track's live upstream subscription
  (``largest_of``; §"FETCH": objects past the Largest Object "will not be retrieved by a
  FETCH") and held whole needs no upstream request at all, so a publisher that does not
  implement FETCH does not fail it.

Draft-18 Joining FETCHes and draft-20+ fill fetch streams are resolved to a range in
:mod:`relay.fetch.fill` and served here. Not yet: descending GROUP_ORDER (served ascending), End
of Range markers (not cached; a range holding one is served upstream again).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from kvsp_moq.moqt.data import FetchStreamEncoder
from kvsp_moq.moqt.errors import RequestErrorCode
from kvsp_moq.moqt.messages import (
    Fetch,
    Location,
    LocationFilterType,
    Message,
    MessageParameters,
    RequestUpdate,
    StandaloneFetch,
)
from kvsp_moq.moqt.objects import ObjectStatus

from .cache import CachedObject, ObjectCache, TrackName
from .held import HeldAnswer
from .inflight import (
    WHOLE_GROUP,
    FetchRange,
    FetchSink,
    UpstreamFetch,
    fetch_pieces,
    log_range,
)
from .known import Gap, HeldPlan, plan
from ..session.peer import PeerSession, RequestHandler
from ..session.sender import RequestOut
from ..ops.stats import RelayStats

__all__ = ["FetchAnswer", "FetchRange", "FetchService", "FetchSink", "MAX_GAPS", "WHOLE_GROUP",
           "fetch_pieces", "fetch_range"]

logger = logging.getLogger(__name__)
Loc = tuple[int, int]
#: The most upstream FETCHes one downstream FETCH may need for the gaps of a partly held
#: range (relay.fetch.held); a range with more gaps goes upstream whole.
MAX_GAPS = 8


def fetch_range(msg: Message) -> FetchRange | None:
    """The range of a standalone FETCH (draft 18 fields or the 20+ LOCATION_FILTER); None
    for a joining FETCH (not supported)."""
    if isinstance(msg, StandaloneFetch):
        # Draft 18 §"FETCH": End Location is the end plus 1; Object 0 = the whole group.
        e = msg.end_location
        end: Loc | None = (e.group, WHOLE_GROUP) if e.object == 0 else (e.group, e.object - 1)
        if e.group >= (1 << 62) - 1:
            end = None
        return FetchRange((msg.track_namespace, msg.track_name), tuple(msg.start_location), end)  # type: ignore[arg-type]
    if isinstance(msg, Fetch):
        track = (msg.track_namespace, msg.track_name)
        flt = msg.parameters.location_filter
        if flt is None or flt.start_location is None:
            return FetchRange(track, (0, 0), None)
        start = (flt.start_group, flt.start_object)
        if flt.filter_type is LocationFilterType.ABSOLUTE_RANGE_END_OBJECT:
            end = (flt.start_group + flt.end_group_delta, flt.end_object)
        elif flt.filter_type is LocationFilterType.ABSOLUTE_RANGE:
            end = (flt.start_group + flt.end_group_delta, WHOLE_GROUP)
        else:
            end = None
        return FetchRange(track, start, end)
    return None


class FetchAnswer(FetchSink):
    """A downstream FETCH: FETCH_OK and a fetch stream (cut through from the upstream FETCH
    once it answered, or all at once), or REQUEST_ERROR."""

    def __init__(self, service: FetchService, down: PeerSession, rid: int,
                 track: TrackName) -> None:
        self.service, self.down, self.rid, self.track = service, down, rid, track
        self.out: RequestOut | None = None
        self.sid = -1

    def deliver(self, objects: list[CachedObject], end_of_track: bool) -> None:
        if any(o.status is ObjectStatus.NORMAL for o in objects):
            self.service.serve(self.down, self.rid, objects, end_of_track, self.track)
        else:
            self.fail(RequestErrorCode.INVALID_RANGE, "no objects in range")

    def fail(self, code: int, reason: str, retry_interval: int = 0) -> None:
        self.service.reject(self.down, self.rid, code, reason, retry_interval)

    def start(self, up: UpstreamFetch) -> bool:
        got = self.service.answer(self.down, self.rid, up.end_location, up.end_of_track,
                                  up.properties, 128, up.range.start[0])
        if got is None:
            return True  # the request is gone: nothing to send, nothing to wait for
        self.out, self.sid = got
        self.out.feed(self.sid, up.pieces(FetchStreamEncoder(self.rid, self.down.version),
                                          self.service.stats))
        return True

    def progress(self) -> None:
        if self.out is not None:
            self.out.wake(self.sid)

    def finish(self) -> None:
        if self.out is not None:
            self.out.wake(self.sid)  # the rest, then the FIN
            self.out.call(self.service.finisher(self.down, self.rid))

    def cut(self, code: int, reason: str) -> None:
        if self.out is None:
            return
        logger.info("relay: FETCH %d cut (%#x): %s", self.rid, code, reason)
        self.out.reset(self.sid, code)
        self.service.finisher(self.down, self.rid)()


class _FetchOutput:
    """A downstream FETCH answered from what the relay holds (relay.fetch.held): FETCH_OK and its
    fetch stream, or REQUEST_ERROR; our half of the request stream closed at the end."""

    needs_end = True

    def __init__(self, service: FetchService, down: PeerSession, rid: int,
                 track: TrackName) -> None:
        self.service, self.down, self.rid, self.track = service, down, rid, track

    def open(self, end_location: Loc, end_of_track: bool, publisher_priority: int,
             group_id: int) -> tuple[RequestOut, int] | None:
        return self.service.answer(self.down, self.rid, end_location, end_of_track,
                                   self.service.track_properties(self.track),
                                   publisher_priority, group_id)

    def encoder(self) -> FetchStreamEncoder:
        return FetchStreamEncoder(self.rid, self.down.version)

    def refuse(self, code: int, reason: str, retry_interval: int) -> None:
        self.service.reject(self.down, self.rid, code, reason, retry_interval)

    def done(self) -> None:
        self.service.finisher(self.down, self.rid)()


class _ServedFetch(RequestHandler):
    """A downstream FETCH being answered: its output in the session's sender."""

    def __init__(self, down: PeerSession, rid: int, out: RequestOut) -> None:
        self.down, self.rid, self.out = down, rid, out

    def on_cancelled(self, code: int) -> None:
        self.out.abort()  # the session reset the fetch stream

    def on_stream_stopped(self, stream_id: int, code: int) -> None:
        self.out.stopped(stream_id)
        self.out.abort()

    def on_session_closed(self, peer: PeerSession) -> None:
        self.out.abort()

    takes_updates = True

    def on_update(self, msg: RequestUpdate) -> None:
        self.apply_updates(msg.parameters)

    def apply_updates(self, p: MessageParameters, count: int = 1) -> None:
        """REQUEST_UPDATE of the FETCH (or ``count`` of them coalesced, held while the FETCH
        waited for its upstream FETCH): SUBSCRIBER_PRIORITY (the only other parameter it
        may carry is AUTHORIZATION_TOKEN); one REQUEST_OK each."""
        moqt = self.down.moqt
        if moqt is None or moqt.closed or self.rid not in moqt.requests:
            return
        if p.subscriber_priority is not None:
            self.out.set_priority(p.subscriber_priority)
        for _ in range(count):
            moqt.request_ok(self.rid, MessageParameters())
        self.down.flush()


class FetchService:
    def __init__(self, cache: ObjectCache, stats: RelayStats,
                 spawn: Callable[[Awaitable[None]], None], request_timeout: float = 30.0) -> None:
        self.cache = cache
        #: Seconds an upstream FETCH may go without an answer or an object event.
        self.request_timeout = request_timeout
        self.stats = stats
        self.spawn = spawn
        self.inflight: dict[FetchRange, UpstreamFetch] = {}
        #: The Largest Object of a track's live upstream subscription (None: none), set by
        #: the relay: a FETCH's range is capped there (§"FETCH").
        self.largest_of: Callable[[TrackName], Loc | None] = lambda track: None

    def try_cache(self, down: PeerSession, rid: int, rng: FetchRange) -> bool:
        """Serve from the cache if the range is fully cached, or held whole (relay.fetch.known);
        True if it was."""
        hit = self.cache.lookup_range(rng.track, rng.start, rng.end)
        if hit is None:
            held = self.held_plan(rng)
            if held is None or held[1] is None or held[0].gaps:
                return False
            self.stats.cache_hits += 1
            log_range("cache_hit", rng)
            HeldAnswer(self, _FetchOutput(self, down, rid, rng.track), rng.track,
                       *held).start(None)
            return True
        self.stats.cache_hits += 1
        log_range("cache_hit", rng)
        self.serve(down, rid, hit.objects, hit.end_of_track, rng.track)
        return True

    def join_or_start(self, down: PeerSession, rid: int, rng: FetchRange,
                      route: PeerSession) -> None:
        """A miss: answered from the objects held with only the gaps FETCHed upstream
        (relay.fetch.held) when some are held; else wait on the in-flight upstream FETCH of this
        range, or start it."""
        held = self.held_plan(rng)
        if held is not None:
            self.stats.cache_hits += 1
            log_range("cache_partial_hit", rng)
            HeldAnswer(self, _FetchOutput(self, down, rid, rng.track), rng.track,
                       *held).start(route)
            return
        self.wait_upstream(FetchAnswer(self, down, rid, rng.track), rng, route)

    def held_plan(self, rng: FetchRange) -> tuple[HeldPlan, Loc | None] | None:
        """What the cache holds of ``rng`` (relay.fetch.known), and the End Location when the range
        ends in what is held (None: it ends in a gap); None when no Normal object of it is
        held. The range is capped at the Largest Object of the track's live subscription:
        §"FETCH" "Objects with Locations larger than the `Largest Object` at the time the
        request is processed will not be retrieved by a FETCH", and then "the actual end of
        the FETCH response is indicated in the FETCH_OK End Location"."""
        end = rng.end
        live = self.largest_of(rng.track)
        capped = live is not None and (end is None or end > live)
        if capped:
            end = live
        if end is not None and rng.start > end:
            return None  # past the Largest Object: the publisher says INVALID_RANGE
        objects = self.cache.held(rng.track, rng.start, end)
        if not any(o.status is ObjectStatus.NORMAL for o in objects):
            return None
        p = plan(rng.start, end, objects, self.cache.complete_spans(rng.track))
        if len(p.gaps) > MAX_GAPS:
            return None  # scattered: one upstream FETCH of the range, not one per gap
        if isinstance(p.segments[-1], Gap):
            return p, None
        if capped:
            return p, live
        if end is not None and end[1] != WHOLE_GROUP:
            return p, end
        return p, p.objects[-1].location

    def join_gap(self, sink: FetchSink, rng: FetchRange, route: PeerSession) -> None:
        """A gap of a partly held range (relay.fetch.held): join an in-flight upstream FETCH of the
        same range or of one covering it, else start one (single-flight)."""
        for up in self.inflight.values():
            r = up.range
            if (r.track == rng.track and r != rng and not up.done and r.start <= rng.start
                    and r.end is not None and rng.end is not None and rng.end <= r.end):
                self.stats.cache_misses += 1
                log_range("cache_miss", rng)
                up.add(sink)
                return
        self.wait_upstream(sink, rng, route)

    def track_properties(self, track: TrackName) -> tuple[tuple[int, int | bytes], ...]:
        return self.cache.track_properties(track) or ()

    def known_empty(self, track: TrackName, start: Loc, end: Loc) -> None:
        """``start`` .. ``end`` of ``track`` holds no object (relay.fetch.held)."""
        self.cache.record_range(track, start, end, (), False)

    def wait_upstream(self, sink: FetchSink, rng: FetchRange, route: PeerSession) -> None:
        """A miss for ``sink``: join the in-flight upstream FETCH of ``rng`` (cut through
        from its first object), or start it."""
        self.stats.cache_misses += 1
        log_range("cache_miss", rng)
        up = self.inflight.get(rng)
        if up is None:
            up = UpstreamFetch(rng, route, self.cache, self.stats, self.request_timeout,
                               self.forget)
            self.inflight[rng] = up
            up.add(sink)
            up.start()
        else:
            up.add(sink)

    def forget(self, up: UpstreamFetch) -> None:
        if self.inflight.get(up.range) is up:
            del self.inflight[up.range]

    def reject(self, down: PeerSession, rid: int, code: int, reason: str,
               retry_interval: int = 0) -> None:
        moqt = down.moqt
        if moqt is not None and not moqt.closed and rid in moqt.requests:
            moqt.reject(rid, code, reason, retry_interval=retry_interval)
            down.flush()

    def answer(self, down: PeerSession, rid: int, end_location: Loc, end_of_track: bool,
               props: tuple[tuple[int, int | bytes], ...], publisher_priority: int,
               group_id: int) -> tuple[RequestOut, int] | None:
        """FETCH_OK on ``rid`` and its fetch stream, registered in the session's sender
        (ranked first by ``publisher_priority`` / ``group_id``); None if the request is gone."""
        moqt = down.moqt
        if moqt is None or moqt.closed or rid not in moqt.requests:
            return None
        req = moqt.requests[rid]
        params = getattr(req.message, "parameters", None)
        out = down.sender.request(getattr(params, "subscriber_priority", None))
        served = down.served[rid] = _ServedFetch(down, rid, out)
        moqt.accept_fetch(rid, Location(*end_location), end_of_track=end_of_track,
                          track_properties=props)
        held = down.take_updates(rid)  # updates that came while the FETCH waited upstream
        if held is not None:
            served.apply_updates(held.parameters, held.count)
        sid = moqt.open_fetch_stream(rid)
        down.flush()
        out.open_stream(sid, publisher_priority, group_id)
        return out, sid

    @staticmethod
    def finisher(down: PeerSession, rid: int) -> Callable[[], None]:
        """What ends a FETCH answer once its stream was FINned (or reset): our half of the
        request stream is closed."""
        def done() -> None:
            down.served.pop(rid, None)
            if down.moqt is not None and not down.moqt.closed:
                down.moqt.finish_request(rid)
                down.flush()

        return done

    def serve(self, down: PeerSession, rid: int, objects: list[CachedObject],
              end_of_track: bool, track: TrackName) -> None:
        """FETCH_OK and the fetch stream of ``objects`` (through the session's sender)."""
        objects = [o for o in objects if o.status is ObjectStatus.NORMAL]
        got = self.answer(down, rid, objects[-1].location, end_of_track,
                          self.cache.track_properties(track) or (),
                          objects[0].publisher_priority, objects[0].group_id)
        if got is None:
            return
        out, sid = got
        out.feed(sid, fetch_pieces(FetchStreamEncoder(rid, down.version), objects, self.stats))
        out.call(self.finisher(down, rid))
