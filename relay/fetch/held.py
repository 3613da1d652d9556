"""A FETCH answered from what the relay holds, only the gaps going upstream (draft-22
§"FETCH", §"Caching Relays"; moxygen's relay cache does the same).

The range is planned by :func:`relay.fetch.known.plan`: the Normal objects the cache holds (from a
subscription the relay forwards, or an earlier FETCH) and the gaps of unknown status
between them. Each gap is ONE upstream FETCH however many downstream FETCHes need it (the
single-flight of :mod:`relay.fetch.inflight`: an in-flight FETCH of the same or of a covering
range is joined). The fetch stream carries the held objects from the cache and each gap's
objects cut through as they arrive, in ascending Group / Object order (§"FETCH": "A
publisher MUST send fetched groups in the requested group order ... Within each group,
objects are sent in Object ID order"; drafts 18, 20 and 22 alike; descending GROUP_ORDER is
served ascending, as in :mod:`relay.fetch.service`). The stream waits at a gap until its objects
come (§"FETCH": "the relay MUST pause subsequent delivery until it has confirmed the
object's status upstream").

**FETCH_OK** (§"FETCH_OK": "the FETCH_OK MUST NOT be sent until the End Location is known";
§"Subscriber Interactions": a relay without "sufficient information to send a FETCH_OK
immediately ... MUST withhold sending FETCH_OK until it does"):

* the range's end is known here (the last segment is held): FETCH_OK at once, End Location
  the requested end, or the relay's Largest Object when the range reaches past it. When part
  of the range is live (an upstream subscription in progress whose later objects are not
  published yet) §"FETCH" decides: "Objects with Locations larger than the `Largest Object`
  at the time the request is processed will not be retrieved by a FETCH. If the requested
  End Location exceeds the `Largest Object`, the actual end of the FETCH response is
  indicated in the FETCH_OK End Location" (and §"FETCH_OK" End Location: "unless the
  requested range extends beyond Largest Object at the time the request was processed").
  The caller caps the range at the subscription's Largest Object (:mod:`relay.fetch.service`);
* the range ends in a gap: FETCH_OK once that gap's upstream FETCH_OK came, with its End
  Location and End Of Track (INVALID_RANGE there: nothing past what is held, End Location
  the last object held).

**Failures**: a gap's upstream REQUEST_ERROR before our FETCH_OK is passed down with its code
(e.g. NOT_SUPPORTED from a publisher that does not implement FETCH); after it, the fetch
stream is reset UNKNOWN_OBJECT_STATUS (§"FETCH": "If the upstream FETCH fails, the relay
sends a REQUEST_ERROR and can reset the unidirectional stream"; §"Stream Reset Error Codes";
§"FETCH": a relay that "does not have the Object in cache ... can choose to reset the FETCH
data stream with UNKNOWN_OBJECT_STATUS"); a gap reset after it started is passed on with
the upstream's code (:func:`relay.fetch.inflight.reset_code`). INVALID_RANGE for a gap inside the
range: no object there (recorded as a complete empty range, so the next FETCH does not ask).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Protocol

from kvsp_moq.moqt.data import FetchStreamEncoder
from kvsp_moq.moqt.errors import RequestErrorCode
from kvsp_moq.moqt.objects import ObjectStatus
from kvsp_moq.wire.errors import StreamResetCode

from .cache import CachedObject, TrackName
from .inflight import FetchRange, FetchSink, UpstreamFetch, object_pieces
from .known import Gap, HeldPlan
from ..session.peer import PeerSession
from ..session.schedule import PENDING, Piece
from ..session.sender import RequestOut
from ..ops.stats import RelayStats

__all__ = ["HeldAnswer", "HeldFetches", "HeldOutput"]

logger = logging.getLogger(__name__)
Loc = tuple[int, int]
Props = tuple[tuple[int, int | bytes], ...]


class HeldFetches(Protocol):
    """What a :class:`HeldAnswer` needs of the FETCH service (:class:`relay.fetch.service.FetchService`)."""

    stats: RelayStats

    def join_gap(self, sink: FetchSink, rng: FetchRange, route: PeerSession) -> None: ...

    def known_empty(self, track: TrackName, start: Loc, end: Loc) -> None: ...


class HeldOutput(Protocol):
    """Where a :class:`HeldAnswer` goes: a downstream FETCH (FETCH_OK and its fetch stream,
    :mod:`relay.fetch.service`) or a subscription's fill fetch stream (:mod:`relay.fetch.fill`)."""

    #: The stream may open only once the End Location is known (FETCH_OK comes first).
    needs_end: bool

    def open(self, end_location: Loc, end_of_track: bool, publisher_priority: int,
             group_id: int) -> tuple[RequestOut, int] | None:
        """Open the fetch stream (after FETCH_OK, for a FETCH); None: the request is gone."""

    def encoder(self) -> FetchStreamEncoder: ...

    def refuse(self, code: int, reason: str, retry_interval: int) -> None:
        """The answer failed before the stream opened."""

    def done(self) -> None:
        """The stream was FINned or reset (called once)."""


class _GapSink(FetchSink):
    """One gap of a :class:`HeldAnswer`, waiting on the upstream FETCH that brings it."""

    def __init__(self, owner: HeldAnswer, gap: Gap, last: bool) -> None:
        self.owner, self.gap, self.last = owner, gap, last
        self.up: UpstreamFetch | None = None
        #: The whole answer at once (an upstream that ended without FETCH_OK), or [] when
        #: the gap holds nothing (INVALID_RANGE).
        self.objects: list[CachedObject] | None = None

    @property
    def ready(self) -> bool:
        return self.up is not None or self.objects is not None

    def pieces(self, enc: FetchStreamEncoder, stats: RelayStats) -> Iterator[Piece]:
        """The gap's objects (no FIN: the stream goes on after it)."""
        if self.objects is not None:
            yield from object_pieces(enc, [o for o in self.objects if o.status is
                                           ObjectStatus.NORMAL and self.gap.holds(o.location)],
                                     stats)
        elif self.up is not None:
            for p in self.up.pieces(enc, stats, self.gap.holds):
                if p.fin:
                    return
                yield p

    def start(self, up: UpstreamFetch) -> bool:
        self.up = up
        if self.last:
            end, eot = up.end_location, up.end_of_track
            if self.gap.end is not None and end > self.gap.end:
                end, eot = self.gap.end, False  # a covering FETCH answers for more
            self.owner.ok(max(end, self.owner.last_held), eot)
        self.owner.wake()
        return True

    def deliver(self, objects: list[CachedObject], end_of_track: bool) -> None:
        self.objects = objects
        if self.last:
            mine = [o.location for o in objects if self.gap.holds(o.location)
                    and o.status is ObjectStatus.NORMAL]
            self.owner.ok(max([self.owner.last_held, *mine]), end_of_track)
        self.owner.wake()

    def fail(self, code: int, reason: str, retry_interval: int = 0) -> None:
        if code == RequestErrorCode.INVALID_RANGE:
            if not self.last and self.gap.end is not None:
                # An object held after the gap exists, so the gap is not past the Largest
                # Object: it holds none (some publishers answer an empty range this way).
                self.owner.fetches.known_empty(self.owner.track, self.gap.start, self.gap.end)
            self.deliver([], False)
            return
        self.owner.failed(code, reason, retry_interval, StreamResetCode.UNKNOWN_OBJECT_STATUS)

    def progress(self) -> None:
        self.owner.wake()

    finish = progress

    def cut(self, code: int, reason: str) -> None:
        self.owner.failed(RequestErrorCode.INTERNAL_ERROR, reason, 0, code)


class HeldAnswer:
    """A downstream FETCH answered from the objects held and, for the gaps, from upstream
    FETCHes (see the module docstring)."""

    def __init__(self, fetches: HeldFetches, output: HeldOutput, track: TrackName,
                 plan: HeldPlan, end_location: Loc | None) -> None:
        self.fetches, self.output, self.track, self.plan = fetches, output, track, plan
        held = plan.objects
        #: The last Normal object held (the plan holds one at least).
        self.last_held = held[-1].location
        self.first = held[0]
        #: Known now when the range ends in what is held; else from the last gap's FETCH_OK.
        self.end_location = end_location
        self.out: RequestOut | None = None
        self.sid = -1
        self.over = False
        self.finished = False
        segments = plan.segments
        self.sinks: dict[Gap, _GapSink] = {
            s: _GapSink(self, s, s is segments[-1]) for s in segments if isinstance(s, Gap)}

    def start(self, route: PeerSession | None) -> None:
        """FETCH_OK now if the End Location is known (a fill stream opens at once); each gap
        FETCHed (or joined) upstream."""
        if self.end_location is not None:
            self.ok(self.end_location, self.plan.end_of_track)
        elif not self.output.needs_end:
            self.ok(self.last_held, False)
        for gap, sink in self.sinks.items():
            if self.over:
                return
            if route is None:
                sink.fail(RequestErrorCode.INTERNAL_ERROR, "no route for the objects not held")
                return
            self.fetches.join_gap(sink, FetchRange(self.track, gap.start, gap.end), route)

    # -- the answer -----------------------------------------------------------------------
    def ok(self, end_location: Loc, end_of_track: bool) -> None:
        """FETCH_OK (End Location known now) and the fetch stream."""
        if self.out is not None or self.over:
            return
        got = self.output.open(end_location, end_of_track, self.first.publisher_priority,
                               self.first.group_id)
        if got is None:  # the request is gone
            self.over = True
            return
        self.out, self.sid = got
        self.out.feed(self.sid, self._pieces(self.output.encoder()))
        self.out.call(self._finish)

    def _pieces(self, enc: FetchStreamEncoder) -> Iterator[Piece]:
        stats = self.fetches.stats
        for seg in self.plan.segments:
            if isinstance(seg, CachedObject):
                yield from object_pieces(enc, [seg], stats)
                continue
            sink = self.sinks[seg]
            while not sink.ready:
                if self.over:
                    return
                yield PENDING
            yield from sink.pieces(enc, stats)
            if self.over:
                return  # failed mid-gap: the stream was reset
        yield Piece(b"", fin=True)

    def wake(self) -> None:
        if self.out is not None:
            self.out.wake(self.sid)

    def failed(self, code: int, reason: str, retry_interval: int, reset: int) -> None:
        """A gap's upstream FETCH failed: REQUEST_ERROR before FETCH_OK, a reset after."""
        if self.over:
            return
        self.over = True
        if self.out is None:
            self.output.refuse(code, reason, retry_interval)
            return
        logger.info("relay: fetch stream %d (partly held) cut (%#x): %s", self.sid, reset, reason)
        self.out.reset(self.sid, reset)
        self._finish()

    def _finish(self) -> None:
        if not self.finished:
            self.finished = True
            self.output.done()
