"""FETCH through the relay (draft-20 §"FETCH", §"Caching Relays").

* A FETCH whose whole range is in the cache (see :mod:`relay.cache`) is answered from it:
  FETCH_OK (End Location = the last object's, the cached Track Properties) and one fetch
  stream with the objects, each with its cached Subgroup ID, priority and raw Object
  Properties: the same bytes the origin sent.
* A miss goes upstream ONCE per (track, range) however many FETCHes for it arrive while it
  is in flight (single-flight): they all wait on the same upstream FETCH, which is
  store-and-forward (FETCH_OK downstream once the upstream fetch stream has ended: "If a
  relay does not have sufficient information to send a FETCH_OK immediately in response
  to a FETCH, it MUST withhold sending FETCH_OK until it does"). The objects are cached and
  the range recorded as complete.
* Upstream REQUEST_ERROR is passed to every waiter with its code and reason.

* The waiters of an upstream FETCH are :class:`FetchSink` objects: a downstream FETCH
  (:class:`FetchAnswer`: FETCH_OK + fetch stream, or REQUEST_ERROR), or a fill fetch stream
  of a subscription (:mod:`relay.fill`), which shares the same single-flight.

* The fetch stream is handed to QUIC by the session's sender (:mod:`relay.sender`) with
  the FETCH's SUBSCRIBER_PRIORITY (default 128; changed by REQUEST_UPDATE, §"SUBSCRIBER
  PRIORITY Parameter": "relative to other subscriptions and fetch responses in the same
  session") and each object's publisher priority (§"Priorities": "FETCH responses however
  can contain objects with different publisher priorities"); its objects are pulled from
  the held list one at a time, never copied or queued.

Draft-18 Joining FETCHes and draft-20+ fill fetch streams are resolved to a range in
:mod:`relay.fill` and served here. Not yet: descending GROUP_ORDER (served ascending), End
of Range markers (not cached; a range holding one is served upstream again), cut-through of
misses.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass

from kvsp_moq.moqt.data import FetchStreamEncoder
from kvsp_moq.moqt.errors import RequestErrorCode
from kvsp_moq.moqt.messages import (
    Fetch,
    FetchOk,
    Location,
    LocationFilterType,
    Message,
    MessageParameters,
    RequestError,
    RequestUpdate,
    StandaloneFetch,
)
from kvsp_moq.moqt.objects import ObjectBegin, ObjectEnd, ObjectPayload, ObjectStatus
from kvsp_moq.wire.varint import VI64_MAX

from .cache import OBJECT_OVERHEAD, CachedObject, ObjectCache, TrackName
from .deadline import Deadline
from .logs import event
from .names import format_namespace
from .peer import PeerSession, RequestHandler
from .sender import Piece, RequestOut
from .stats import RelayStats

__all__ = ["FetchAnswer", "FetchRange", "FetchService", "FetchSink", "fetch_pieces",
           "fetch_range"]

logger = logging.getLogger(__name__)
Loc = tuple[int, int]
#: "Whole group" as an inclusive end object (no real object has this ID).
WHOLE_GROUP = VI64_MAX - 1


@dataclass(frozen=True, slots=True)
class FetchRange:
    track: TrackName
    start: Loc
    #: Inclusive end; ``(g, WHOLE_GROUP)`` = all of group g; None = to the Largest Object.
    end: Loc | None


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


def _log(name: str, rng: FetchRange) -> None:
    ns, track = rng.track
    event(name, namespace=format_namespace(ns), track=track.decode("utf-8", "backslashreplace"),
          start=list(rng.start), end=list(rng.end) if rng.end is not None else None)


class FetchSink:
    """Where the result of an upstream FETCH goes (one per waiting request)."""

    def deliver(self, objects: list[CachedObject], end_of_track: bool) -> None:
        """The upstream FETCH completed with ``objects`` (possibly none)."""

    def fail(self, code: int, reason: str, retry_interval: int = 0) -> None:
        """The upstream FETCH failed (REQUEST_ERROR, reset, session lost, timeout, too
        large for the cache budget)."""


class FetchAnswer(FetchSink):
    """A downstream FETCH: FETCH_OK and a fetch stream, or REQUEST_ERROR."""

    def __init__(self, service: FetchService, down: PeerSession, rid: int,
                 track: TrackName) -> None:
        self.service, self.down, self.rid, self.track = service, down, rid, track

    def deliver(self, objects: list[CachedObject], end_of_track: bool) -> None:
        if any(o.status is ObjectStatus.NORMAL for o in objects):
            self.service.serve(self.down, self.rid, objects, end_of_track, self.track)
        else:
            self.fail(RequestErrorCode.INVALID_RANGE, "no objects in range")

    def fail(self, code: int, reason: str, retry_interval: int = 0) -> None:
        self.service.reject(self.down, self.rid, code, reason, retry_interval)


def fetch_pieces(enc: FetchStreamEncoder, objects: list[CachedObject],
                 stats: RelayStats) -> Iterator[Piece]:
    """A fetch stream's bytes after its FETCH_HEADER, one piece at a time: each object's
    header (with its publisher priority and group, which rank the stream) and its cached
    chunks as they are; then the FIN."""
    for o in objects:
        yield Piece(enc.object_header(
            o.group_id, o.object_id, o.payload_length, subgroup_id=o.subgroup_id,
            publisher_priority=o.publisher_priority, properties=o.raw_properties),
            publisher_priority=o.publisher_priority, group_id=o.group_id)
        for chunk in o.chunks:
            yield Piece(chunk)
        stats.bytes_out += o.payload_length
        stats.objects_out += 1
    yield Piece(b"", fin=True)


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


class _UpstreamFetch(RequestHandler):
    """One upstream FETCH, shared by every downstream FETCH of the same range."""

    def __init__(self, service: FetchService, rng: FetchRange, peer: PeerSession) -> None:
        self.service = service
        self.range = rng
        self.peer = peer
        self.waiters: list[FetchSink] = []
        self.objects: list[CachedObject] = []
        self.ok: FetchOk | None = None
        self.request_id: int | None = None
        self._begin: ObjectBegin | None = None
        self._began_at = 0.0
        self._chunks: list[memoryview] = []
        self.done = False
        #: Cache bytes reserved for the objects received so far (and the one arriving):
        #: counted before they are buffered, given back when they are stored or dropped.
        self.reserved = 0
        #: No answer / no progress within the request timeout: cancelled, TIMEOUT.
        self.timer = Deadline(service.request_timeout, self._timed_out)

    def start(self) -> None:
        moqt = self.peer.moqt
        assert moqt is not None
        ns, name = self.range.track
        end = Location(*self.range.end) if self.range.end is not None else None
        self.request_id = moqt.fetch(ns, name, Location(*self.range.start), end)
        self.peer.local[self.request_id] = self
        self.service.stats.upstream_fetches += 1
        _log("upstream_fetch", self.range)
        self.timer.arm()
        self.peer.flush()

    def _timed_out(self) -> None:
        self.service.stats.upstream_timeouts += 1
        _log("upstream_fetch_timeout", self.range)
        self._abort(RequestErrorCode.TIMEOUT, "upstream FETCH made no progress in time")

    def _abort(self, code: int, reason: str, retry_interval: int = 0) -> None:
        """Give up: cancel the upstream FETCH, its waiters get REQUEST_ERROR ``code``."""
        if self.done:
            return
        if self.request_id is not None:
            self.peer.cancel_request(self.request_id)
        self._fail(code, reason, retry_interval)

    def on_response(self, msg: Message) -> None:
        self.timer.arm()
        if isinstance(msg, FetchOk):
            self.ok = msg
            self.service.cache.set_track_properties(self.range.track, msg.track_properties)
        elif isinstance(msg, RequestError):
            self._fail(msg.error_code, msg.error_reason)

    def on_data(self, stream_id: int, event: object) -> None:
        if self.done:
            return
        self.timer.arm()
        if isinstance(event, ObjectPayload):
            data = event.data
            self._chunks.append(data if data.readonly else memoryview(bytes(data)))
            self.service.stats.bytes_in += len(data)
        elif isinstance(event, ObjectBegin):
            # The whole answer is held until the fetch stream ends (FETCH_OK is withheld
            # until then): each object's bytes are counted against the cache budget before
            # one is buffered; a range that does not fit is refused (issue 18).
            size = event.payload_length + len(event.raw_properties) + OBJECT_OVERHEAD
            if not self.service.cache.reserve(size):
                self.service.stats.excessive_load += 1
                self._abort(RequestErrorCode.EXCESSIVE_LOAD,
                            "the fetched range does not fit the relay's cache budget",
                            retry_interval=1001)
                return
            self.reserved += size
            self._begin, self._chunks, self._began_at = event, [], time.monotonic()
        elif isinstance(event, ObjectEnd) and self._begin is not None:
            b = self._begin
            self.objects.append(CachedObject(
                b.group_id, b.object_id, b.subgroup_id,
                128 if b.publisher_priority is None else b.publisher_priority, b.status,
                bytes(b.raw_properties), tuple(self._chunks), b.payload_length,
                self.service.cache.expiry_for(self.range.track, self._began_at, self._props())))
            self.service.stats.objects_in += 1
            self._begin, self._chunks = None, []

    def _props(self) -> tuple[tuple[int, int | bytes], ...] | None:
        return tuple(self.ok.track_properties) if self.ok is not None else None

    def _release(self) -> None:
        self.timer.cancel()
        self.service.cache.release(self.reserved)
        self.reserved = 0

    def on_stream_closed(self, stream_id: int, code: int | None) -> None:
        if code is not None:
            self._fail(RequestErrorCode.INTERNAL_ERROR, f"upstream fetch stream reset ({code})")
            return
        self._complete()

    def on_cancelled(self, code: int) -> None:
        self._fail(RequestErrorCode.INTERNAL_ERROR, "upstream cancelled the fetch")

    def on_session_closed(self, peer: PeerSession) -> None:
        self._fail(RequestErrorCode.INTERNAL_ERROR, "upstream session closed")

    def _complete(self) -> None:
        if self.done:
            return
        self.done = True
        self.service.forget(self)
        self._release()
        cache, track = self.service.cache, self.range.track
        props = self._props()
        for o in self.objects:
            cache.put(track, o, props)
        ok = self.ok
        if ok is not None and self.objects:
            end = self.range.end if self.range.end is not None else tuple(ok.end_location)
            cache.record_range(track, self.range.start, end,  # type: ignore[arg-type]
                               [o.location for o in self.objects], ok.end_of_track)
        end_of_track = bool(ok.end_of_track) if ok is not None else False
        for sink in self.waiters:
            sink.deliver(self.objects, end_of_track)
        if self.request_id is not None:
            self.peer.release(self.request_id)

    def _fail(self, code: int, reason: str, retry_interval: int = 0) -> None:
        if self.done:
            return
        self.done = True
        self.service.forget(self)
        self._release()
        self.objects, self._chunks = [], []
        for sink in self.waiters:
            sink.fail(code, reason, retry_interval)
        if self.request_id is not None:
            self.peer.release(self.request_id)


class FetchService:
    def __init__(self, cache: ObjectCache, stats: RelayStats,
                 spawn: Callable[[Awaitable[None]], None], request_timeout: float = 30.0) -> None:
        self.cache = cache
        #: Seconds an upstream FETCH may go without an answer or an object event.
        self.request_timeout = request_timeout
        self.stats = stats
        self.spawn = spawn
        self.inflight: dict[FetchRange, _UpstreamFetch] = {}

    def try_cache(self, down: PeerSession, rid: int, rng: FetchRange) -> bool:
        """Serve from the cache if the range is fully cached; True if it was."""
        hit = self.cache.lookup_range(rng.track, rng.start, rng.end)
        if hit is None:
            return False
        self.stats.cache_hits += 1
        _log("cache_hit", rng)
        self.serve(down, rid, hit.objects, hit.end_of_track, rng.track)
        return True

    def join_or_start(self, down: PeerSession, rid: int, rng: FetchRange,
                      route: PeerSession) -> None:
        """A miss: wait on the in-flight upstream FETCH of this range, or start it."""
        self.wait_upstream(FetchAnswer(self, down, rid, rng.track), rng, route)

    def wait_upstream(self, sink: FetchSink, rng: FetchRange, route: PeerSession) -> None:
        """A miss for ``sink``: join the in-flight upstream FETCH of ``rng``, or start it."""
        self.stats.cache_misses += 1
        _log("cache_miss", rng)
        up = self.inflight.get(rng)
        if up is None:
            up = _UpstreamFetch(self, rng, route)
            self.inflight[rng] = up
            up.waiters.append(sink)
            up.start()
        else:
            up.waiters.append(sink)

    def forget(self, up: _UpstreamFetch) -> None:
        if self.inflight.get(up.range) is up:
            del self.inflight[up.range]

    def reject(self, down: PeerSession, rid: int, code: int, reason: str,
               retry_interval: int = 0) -> None:
        moqt = down.moqt
        if moqt is not None and not moqt.closed and rid in moqt.requests:
            moqt.reject(rid, code, reason, retry_interval=retry_interval)
            down.flush()

    def serve(self, down: PeerSession, rid: int, objects: list[CachedObject],
              end_of_track: bool, track: TrackName) -> None:
        """FETCH_OK and the fetch stream of ``objects`` (through the session's sender)."""
        moqt = down.moqt
        if moqt is None or moqt.closed or rid not in moqt.requests:
            return
        req = moqt.requests[rid]
        params = getattr(req.message, "parameters", None)
        out = down.sender.request(getattr(params, "subscriber_priority", None))
        served = down.served[rid] = _ServedFetch(down, rid, out)
        objects = [o for o in objects if o.status is ObjectStatus.NORMAL]
        props = self.cache.track_properties(track) or ()
        moqt.accept_fetch(rid, Location(*objects[-1].location), end_of_track=end_of_track,
                          track_properties=props)
        held = down.take_updates(rid)  # updates that came while the FETCH waited upstream
        if held is not None:
            served.apply_updates(held.parameters, held.count)
        sid = moqt.open_fetch_stream(rid)
        down.flush()
        out.open_stream(sid, objects[0].publisher_priority, objects[0].group_id)
        out.feed(sid, fetch_pieces(FetchStreamEncoder(rid, down.version), objects, self.stats))

        def done() -> None:  # the FIN was handed to QUIC
            down.served.pop(rid, None)
            if down.moqt is not None and not down.moqt.closed:
                down.moqt.finish_request(rid)
                down.flush()

        out.call(done)
