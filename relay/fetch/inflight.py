"""One upstream FETCH, shared by every request waiting on its range, cut through as it
arrives (draft-22 §"FETCH", §"Subscriber Interactions", §"Fetch State Management").

* **Single-flight**: :class:`UpstreamFetch` is THE upstream FETCH of one
  :class:`FetchRange`; every downstream FETCH, Joining FETCH or fill fetch stream of that
  range is a :class:`FetchSink` of it.
* **Cut-through**: the sinks are started (:meth:`FetchSink.start`: FETCH_OK downstream and a
  fetch stream) as soon as the upstream FETCH_OK arrives — §"FETCH_OK": "the FETCH_OK MUST
  NOT be sent until the End Location is known", and the upstream's FETCH_OK is where the
  relay learns it (§"Subscriber Interactions": a relay without "sufficient information to
  send a FETCH_OK immediately ... MUST withhold sending FETCH_OK until it does"). From then
  on each object header and each payload chunk goes down as it arrives
  (:meth:`UpstreamFetch.pieces`, a pull source of the session's scheduler that yields
  ``schedule.PENDING`` while nothing more has arrived; the sinks are woken by
  :meth:`FetchSink.progress`). The chunks are the received read-only memoryviews, shared by
  every sink and, once the range is complete, by the cache: no copy is made.
* **Late joiners** of an in-flight range read the same list from its first object: what
  arrived so far at once, then the rest live.
* **Cache fill**: every object's bytes are reserved against the cache budget when its header
  arrives (issue 18: before any is buffered); at the FIN the objects go into the cache and
  the range is recorded complete (:meth:`relay.fetch.cache.ObjectCache.record_range`).
* **Layer digests** (:mod:`relay.fetch.digests`): when the FETCH_OK's Track Properties carry
  LAYER_DIGESTS, each object's payload is hashed as its chunks arrive (objects that came
  before the FETCH_OK are hashed when it comes) and compared at the object's end. One that
  does not match is not cached (its reservation is given back with the range's, at the
  end) and the range is not recorded complete (a later FETCH of it goes upstream again);
  one that matches replaces
  any unverified copy the cache held (from a subscription). The sinks are not reset: they
  got the bytes cut through and verify them themselves (binding §4), and a reset would take
  the good objects after the bad one from them too; draft-22 §"Stream Reset Error Codes"
  MALFORMED_TRACK is for the conditions of §"Malformed Tracks", which a relay checks without
  knowing the payloads' meaning.
* **Failures**: before FETCH_OK, REQUEST_ERROR to every sink (the upstream's code, or TIMEOUT,
  EXCESSIVE_LOAD, INTERNAL_ERROR); after it, the downstream fetch streams are reset
  (§"Stream Reset Error Codes") with the upstream's reset code when the upstream reset its
  fetch stream or request stream, INTERNAL_ERROR when the upstream session was lost or went
  silent past ``request_timeout``, EXCESSIVE_LOAD when the range outgrew the cache budget
  (§"Fetch State Management": the subscriber's FETCH state ends when "the FETCH data stream
  ... is reset").
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from kvsp_moq.moqt.data import FetchStreamEncoder
from kvsp_moq.moqt.errors import RequestErrorCode
from kvsp_moq.moqt.messages import FetchOk, Location, Message, RequestError
from kvsp_moq.moqt.objects import ObjectBegin, ObjectEnd, ObjectPayload, ObjectStatus
from kvsp_moq.wire.errors import StreamResetCode
from kvsp_moq.wire.varint import VI64_MAX

from .cache import OBJECT_OVERHEAD, CachedObject, ObjectCache, TrackName
from ..session.deadline import Deadline
from .digests import LayerDigests, PayloadCheck, admit
from ..ops.logs import event
from ..ops.names import format_namespace
from ..session.peer import PeerSession, RequestHandler
from ..session.schedule import PENDING, Piece
from ..ops.stats import RelayStats

__all__ = ["FetchRange", "FetchSink", "UpstreamFetch", "WHOLE_GROUP", "fetch_pieces",
           "log_range", "object_pieces", "reset_code"]

Loc = tuple[int, int]
#: "Whole group" as an inclusive end object (no real object has this ID).
WHOLE_GROUP = VI64_MAX - 1
Props = tuple[tuple[int, int | bytes], ...]


@dataclass(frozen=True, slots=True)
class FetchRange:
    track: TrackName
    start: Loc
    #: Inclusive end; ``(g, WHOLE_GROUP)`` = all of group g; None = to the Largest Object.
    end: Loc | None


def log_range(name: str, rng: FetchRange) -> None:
    ns, track = rng.track
    event(name, namespace=format_namespace(ns), track=track.decode("utf-8", "backslashreplace"),
          start=list(rng.start), end=list(rng.end) if rng.end is not None else None)


def reset_code(code: int) -> int:
    """The reset code to pass on for an upstream stream reset with ``code``: a code of
    §"Stream Reset Error Codes" as it is (its meaning holds for the downstream stream too),
    anything else INTERNAL_ERROR."""
    try:
        return StreamResetCode(code)
    except ValueError:
        return StreamResetCode.INTERNAL_ERROR


class FetchSink:
    """A request waiting on an upstream FETCH (a downstream FETCH, a fill fetch stream).

    Before the upstream's FETCH_OK only :meth:`deliver` (the whole range, e.g. from the
    cache or when the upstream ended without FETCH_OK) and :meth:`fail` (REQUEST_ERROR) can
    come. :meth:`start` is the cut-through: a sink that returns True reads the range live
    from then on and gets :meth:`progress`, then :meth:`finish` or :meth:`cut`."""

    def deliver(self, objects: list[CachedObject], end_of_track: bool) -> None:
        """The whole answer at once: ``objects`` (possibly none)."""

    def fail(self, code: int, reason: str, retry_interval: int = 0) -> None:
        """The upstream FETCH failed before the answer started (REQUEST_ERROR ``code``)."""

    def start(self, up: UpstreamFetch) -> bool:
        """The upstream answered FETCH_OK: start answering from ``up.pieces`` (True), or wait
        for :meth:`deliver` (False, the default)."""
        return False

    def progress(self) -> None:
        """More of the range arrived (started sinks)."""

    def finish(self) -> None:
        """The range is complete (started sinks; ``up.pieces`` then ends with the FIN)."""

    def cut(self, code: int, reason: str) -> None:
        """The upstream failed after the answer started: reset with ``code``."""


def fetch_pieces(enc: FetchStreamEncoder, objects: list[CachedObject],
                 stats: RelayStats) -> Iterator[Piece]:
    """A fetch stream's bytes after its FETCH_HEADER, one piece at a time: each object's
    header (with its publisher priority and group, which rank the stream) and its cached
    chunks as they are; then the FIN."""
    yield from object_pieces(enc, objects, stats)
    yield Piece(b"", fin=True)


def object_pieces(enc: FetchStreamEncoder, objects: list[CachedObject],
                  stats: RelayStats) -> Iterator[Piece]:
    """:func:`fetch_pieces` without the FIN (part of a longer fetch stream, relay.fetch.held)."""
    for o in objects:
        yield _header(enc, o)
        yield from map(Piece, o.chunks)
        stats.bytes_out += o.payload_length
        stats.objects_out += 1


def _header(enc: FetchStreamEncoder, o: _Arriving | CachedObject) -> Piece:
    return Piece(enc.object_header(
        o.group_id, o.object_id, o.payload_length, subgroup_id=o.subgroup_id,
        publisher_priority=o.publisher_priority, properties=o.raw_properties),
        publisher_priority=o.publisher_priority, group_id=o.group_id)


@dataclass(slots=True, eq=False)
class _Arriving:
    """The object whose payload is arriving now (its header came)."""

    group_id: int
    object_id: int
    subgroup_id: int | None
    publisher_priority: int
    status: ObjectStatus
    raw_properties: bytes
    payload_length: int
    began_at: float
    reserved: int
    chunks: list[memoryview] = field(default_factory=list)
    #: Its payload's hash against its layer digest (None: no digest covers it, or none is
    #: known yet).
    check: PayloadCheck | None = None
    #: Its ObjectEnd came (it is in ``UpstreamFetch.objects`` now).
    complete: bool = False


class UpstreamFetch(RequestHandler):
    """One upstream FETCH, shared by every downstream request of its range (see the module
    docstring). ``on_over`` runs once it completed or failed (the service forgets it)."""

    def __init__(self, rng: FetchRange, peer: PeerSession, cache: ObjectCache,
                 stats: RelayStats, request_timeout: float,
                 on_over: Callable[[UpstreamFetch], None]) -> None:
        self.range = rng
        self.peer = peer
        self.cache = cache
        self.stats = stats
        self.on_over = on_over
        #: Sinks not started yet (waiting for FETCH_OK, or store-and-forward ones).
        self.waiters: list[FetchSink] = []
        #: Sinks reading the range live.
        self.live: list[FetchSink] = []
        #: Objects complete so far, in arrival order (the order of the fetch stream).
        self.objects: list[CachedObject] = []
        self.arriving: _Arriving | None = None
        self.ok: FetchOk | None = None
        self.request_id: int | None = None
        #: Completed (FIN) or failed: nothing more arrives.
        self.done = False
        self.complete = False
        #: Cache bytes reserved for the objects received so far (and the one arriving):
        #: counted before they are buffered, given back when they are stored or dropped.
        self.reserved = 0
        #: The layer digests of the FETCH_OK's Track Properties (None: nothing to verify).
        self.digests: LayerDigests | None = None
        #: Objects that ended before the FETCH_OK (not checked yet), and the locations of
        #: those that did not match their layer digest (never cached).
        self.unchecked: list[CachedObject] = []
        self.rejected: set[Loc] = set()
        #: No answer / no progress within the request timeout: cancelled, TIMEOUT.
        self.timer = Deadline(request_timeout, self._timed_out)

    # -- the answer so far ---------------------------------------------------------------------
    @property
    def properties(self) -> Props:
        return tuple(self.ok.track_properties) if self.ok is not None else ()

    @property
    def end_location(self) -> Loc:
        assert self.ok is not None
        return (self.ok.end_location.group, self.ok.end_location.object)

    @property
    def end_of_track(self) -> bool:
        return bool(self.ok.end_of_track) if self.ok is not None else False

    def add(self, sink: FetchSink) -> None:
        """A request for this range: started at once if FETCH_OK already came (it reads what
        arrived so far, then the rest live)."""
        if self.ok is not None and sink.start(self):
            self.live.append(sink)
        else:
            self.waiters.append(sink)

    def pieces(self, enc: FetchStreamEncoder, stats: RelayStats,
               keep: Callable[[Loc], bool] | None = None) -> Iterator[Piece]:
        """A fetch stream's bytes after its FETCH_HEADER, from the first object of the range,
        as they arrive: object headers and payload chunks, ``PENDING`` while nothing more has
        come, the FIN once the range completed (nothing once it failed: the sink resets).
        ``keep``: which object locations go out (default all); only Normal objects do."""
        i = 0
        while True:
            o: _Arriving | CachedObject | None = None
            if i < len(self.objects):
                o = self.objects[i]
            elif self.arriving is not None:
                o = self.arriving
            if o is None:
                if self.complete:
                    yield Piece(b"", fin=True)
                    return
                if self.done:
                    return
                yield PENDING
                continue
            i += 1
            if o.status is not ObjectStatus.NORMAL or (keep is not None
                                                        and not keep((o.group_id, o.object_id))):
                while isinstance(o, _Arriving) and not o.complete and not self.done:
                    yield PENDING  # its end comes before the next object
                continue
            yield _header(enc, o)
            j = 0
            while True:
                chunks = o.chunks
                while j < len(chunks):
                    yield Piece(chunks[j])
                    j += 1
                if not isinstance(o, _Arriving) or o.complete:
                    break
                if self.done:
                    return  # failed mid-object
                yield PENDING
            stats.bytes_out += o.payload_length
            stats.objects_out += 1

    # -- the upstream request ------------------------------------------------------------------
    def start(self) -> None:
        moqt = self.peer.moqt
        assert moqt is not None
        ns, name = self.range.track
        end = Location(*self.range.end) if self.range.end is not None else None
        self.request_id = moqt.fetch(ns, name, Location(*self.range.start), end)
        self.peer.local[self.request_id] = self
        self.stats.upstream_fetches += 1
        log_range("upstream_fetch", self.range)
        self.timer.arm()
        self.peer.flush()

    def _timed_out(self) -> None:
        self.stats.upstream_timeouts += 1
        log_range("upstream_fetch_timeout", self.range)
        self._abort(RequestErrorCode.TIMEOUT, "upstream FETCH made no progress in time")

    def _abort(self, code: int, reason: str, retry_interval: int = 0,
               reset: int = StreamResetCode.INTERNAL_ERROR) -> None:
        """Give up: cancel the upstream FETCH, its sinks get ``code`` / ``reset``."""
        if self.done:
            return
        if self.request_id is not None:
            self.peer.cancel_request(self.request_id)
        self._fail(code, reason, retry_interval, reset)

    def on_response(self, msg: Message) -> None:
        self.timer.arm()
        if isinstance(msg, FetchOk):
            self.ok = msg
            self.cache.set_track_properties(self.range.track, msg.track_properties)
            if not self.done:
                self.digests = LayerDigests.of(msg.track_properties)
                self._check_early()
            if not self.done:
                waiting, self.waiters = self.waiters, []
                for sink in waiting:
                    (self.live if sink.start(self) else self.waiters).append(sink)
        elif isinstance(msg, RequestError):
            self._fail(msg.error_code, msg.error_reason)

    def on_data(self, stream_id: int, event: object) -> None:
        if self.done:
            return
        self.timer.touch()
        cur = self.arriving
        if isinstance(event, ObjectPayload):
            if cur is None:
                return
            data = event.data
            chunk = data if data.readonly else memoryview(bytes(data))
            cur.chunks.append(chunk)
            if cur.check is not None:
                cur.check.update(chunk)
            self.stats.bytes_in += len(data)
        elif isinstance(event, ObjectBegin):
            # Each object's bytes are counted against the cache budget before one is
            # buffered; a range that does not fit is refused (issue 18).
            size = event.payload_length + len(event.raw_properties) + OBJECT_OVERHEAD
            if not self.cache.reserve(size):
                self.stats.excessive_load += 1
                self._abort(RequestErrorCode.EXCESSIVE_LOAD,
                            "the fetched range does not fit the relay's cache budget",
                            retry_interval=1001, reset=StreamResetCode.EXCESSIVE_LOAD)
                return
            self.reserved += size
            b = event
            self.arriving = _Arriving(
                b.group_id, b.object_id, b.subgroup_id,
                128 if b.publisher_priority is None else b.publisher_priority, b.status,
                bytes(b.raw_properties), b.payload_length, time.monotonic(), size)
            if self.digests is not None:
                self.arriving.check = self.digests.check(b.group_id, b.object_id, b.status)
        elif isinstance(event, ObjectEnd) and cur is not None:
            obj = CachedObject(
                cur.group_id, cur.object_id, cur.subgroup_id, cur.publisher_priority,
                cur.status, cur.raw_properties, tuple(cur.chunks), cur.payload_length,
                self.cache.expiry_for(self.range.track, cur.began_at, self.properties
                                      if self.ok is not None else None))
            self.objects.append(obj)
            if self.ok is None:
                self.unchecked.append(obj)  # its layer digest is not known yet
            elif not admit(cur.check, self.stats, self.range.track, obj.location):
                self._reject(obj)
            cur.complete = True
            self.arriving = None
            self.stats.objects_in += 1
        else:
            return
        for sink in self.live:
            sink.progress()

    def on_stream_closed(self, stream_id: int, code: int | None) -> None:
        if code is not None:
            self._fail(RequestErrorCode.INTERNAL_ERROR,
                       f"upstream fetch stream reset ({code})", reset=reset_code(code))
            return
        self._complete()

    def on_cancelled(self, code: int) -> None:
        self._fail(RequestErrorCode.INTERNAL_ERROR, "upstream cancelled the fetch",
                   reset=reset_code(code))

    def on_session_closed(self, peer: PeerSession) -> None:
        self._fail(RequestErrorCode.INTERNAL_ERROR, "upstream session closed")

    # -- layer digests (relay.fetch.digests) --------------------------------------------------------
    def _check_early(self) -> None:
        """The FETCH_OK came: check what arrived before it against its layer digests (the
        object arriving now goes on incrementally)."""
        digests, early, self.unchecked = self.digests, self.unchecked, []
        if digests is None:
            return
        cur = self.arriving
        if cur is not None and cur.check is None:
            cur.check = digests.check(cur.group_id, cur.object_id, cur.status, cur.chunks)
        for o in early:
            check = digests.check(o.group_id, o.object_id, o.status, o.chunks)
            if not admit(check, self.stats, self.range.track, o.location):
                self._reject(o)

    def _reject(self, obj: CachedObject) -> None:
        """``obj`` does not match its layer digest: never cached. Its bytes stay reserved
        while this FETCH holds them (late joiners read them), given back with the rest at
        the end: released now, a stream of bad objects would hold more than the budget."""
        self.rejected.add(obj.location)

    # -- the end -------------------------------------------------------------------------------
    def _over(self) -> None:
        self.done = True
        self.timer.cancel()
        self.cache.release(self.reserved)
        self.reserved = 0
        self.on_over(self)

    def _complete(self) -> None:
        if self.done:
            return
        self.complete = True
        self._over()
        cache, track = self.cache, self.range.track
        props = self.properties if self.ok is not None else None
        digests, rejected = self.digests, self.rejected
        for o in self.objects:
            if o.location not in rejected:
                # A verified copy replaces an unverified one (relay.fetch.digests).
                cache.put(track, o, props, replace=digests is not None and digests.covers(
                    o.group_id, o.object_id, o.status))
        ok = self.ok
        if ok is not None and not rejected:  # none at all: known empty (relay.fetch.known)
            end = self.range.end if self.range.end is not None else self.end_location
            cache.record_range(track, self.range.start, end,
                               [o.location for o in self.objects], bool(ok.end_of_track))
        for sink in self.live:
            sink.finish()
        for sink in self.waiters:
            sink.deliver(self.objects, self.end_of_track)
        if self.request_id is not None:
            self.peer.release(self.request_id)

    def _fail(self, code: int, reason: str, retry_interval: int = 0,
              reset: int = StreamResetCode.INTERNAL_ERROR) -> None:
        if self.done:
            return
        self._over()
        for sink in self.live:
            sink.cut(reset, reason)
        for sink in self.waiters:
            sink.fail(code, reason, retry_interval)
        self.objects, self.arriving = [], None
        if self.request_id is not None:
            self.peer.release(self.request_id)
