"""Moving an Established upstream subscription to a new upstream session after the upstream
relay's GOAWAY, without its subscribers noticing (draft-22 §"Graceful Subscriber Relay
Switchover": "When a subscriber receives the GOAWAY message, it starts the process of
connecting to a new relay and sending the SUBSCRIBE requests for all Established
subscriptions to the new relay. The new relay will send a response to the subscribes and if
they are successful, the subscriptions to the old relay can be cancelled").

* :class:`Switchover` is our SUBSCRIBE of the track on the new session. Objects it brings
  before its SUBSCRIBE_OK are forwarded already. A REQUEST_ERROR, no answer within
  ``request_timeout`` or the new session ending abandons the move: the old subscription
  goes on (and ends as a lost upstream does, if its session goes).
* On SUBSCRIBE_OK the new request becomes the track's upstream subscription (its
  PUBLISH_DONE ends the track's subscribers), and the old one an :class:`OldSource`: its
  objects are still forwarded until it has delivered the Largest Object the new
  SUBSCRIBE_OK reported (everything after it comes on the new subscription) and ended the
  objects it was in the middle of (the new subscription does not carry those: a publisher
  counts an object in its Largest Object once it is whole, and a subscriber joining mid-object
  gets the next one), then it is cancelled (§"Request Cancellation"); that wait is bounded
  by ``request_timeout``. Its PUBLISH_DONE or its session ending only closes its own
  streams; an object it cut so is forgotten by :class:`Dedupe`, so that the new
  subscription's copy, if one comes, is forwarded.
* Both subscriptions may carry the same objects while they overlap: :class:`Dedupe`
  forwards each (group, object) once, whichever subscription brings it first
  (§"Graceful Publisher Relay Switchover": "The relay will attempt to deduplicate Objects
  received on both subscriptions"). It remembers at most :data:`MAX_OVERLAP` locations;
  beyond that the old subscription is cancelled at once.

The stream IDs of the two sessions may collide: each source adds its own offset to its
stream IDs before they reach the fan-out (``STREAM_ID_OFFSET`` per move).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol

from kvsp_moq.moqt.messages import Message, MessageParameters, RequestError, SubscribeOk
from kvsp_moq.moqt.objects import (
    ObjectBegin,
    ObjectDatagram,
    ObjectEnd,
    ObjectPayload,
    SubgroupHeader,
)

from ..fetch.cache import TrackName
from ..session.deadline import Deadline
from .fanout import Fanout
from ..ops.logs import event
from ..ops.names import format_namespace
from ..session.peer import PeerSession, RequestHandler

__all__ = ["MAX_OVERLAP", "STREAM_ID_OFFSET", "Dedupe", "OldSource", "Switchover",
           "SwitchingSubscription"]

logger = logging.getLogger(__name__)

#: Added to a new source's stream IDs (QUIC stream IDs are below 2**62).
STREAM_ID_OFFSET = 1 << 62
#: Object locations :class:`Dedupe` remembers while two subscriptions overlap.
MAX_OVERLAP = 4096

Location = tuple[int, int]


class Dedupe:
    """Each object location forwarded once while two upstream subscriptions overlap."""

    def __init__(self) -> None:
        self.seen: set[Location] = set()
        #: Streams (fan-out IDs) whose current object is a duplicate being skipped.
        self._skipping: set[int] = set()
        #: Set once the old subscription is gone: then only what it brought is checked.
        self.frozen = False

    @property
    def full(self) -> bool:
        return len(self.seen) >= MAX_OVERLAP

    def _first(self, loc: Location) -> bool:
        if loc in self.seen:
            return False
        if not self.frozen:
            self.seen.add(loc)
        return True

    def admit(self, usid: int, e: object) -> bool:
        """Whether data event ``e`` of fan-out stream ``usid`` is forwarded."""
        if isinstance(e, ObjectBegin):
            if self._first((e.group_id, e.object_id)):
                self._skipping.discard(usid)
                return True
            self._skipping.add(usid)
            return False
        if isinstance(e, ObjectPayload | ObjectEnd):
            if usid in self._skipping:
                if isinstance(e, ObjectEnd):
                    self._skipping.discard(usid)
                return False
        return True

    def admit_datagram(self, dg: ObjectDatagram) -> bool:
        return self._first((dg.group_id, dg.object_id))

    def stream_closed(self, usid: int) -> None:
        self._skipping.discard(usid)

    def cut(self, usid: int, loc: Location) -> None:
        """Stream ``usid`` ended inside object ``loc``: if it was the one forwarding it, the
        object is not delivered (the fan-out resets it), so another copy may still be."""
        if usid not in self._skipping:
            self.seen.discard(loc)
        self._skipping.discard(usid)


class SwitchingSubscription(Protocol):
    """What a move needs of the upstream subscription (relay.subscribe.upstream.UpstreamSubscription)."""

    @property
    def track(self) -> TrackName: ...

    @property
    def fanout(self) -> Fanout: ...

    @property
    def ended(self) -> bool: ...

    def feed(self, offset: int, stream_id: int, e: object) -> None:
        """A data event of a source whose stream IDs get ``offset``."""
        ...

    def feed_datagram(self, dg: ObjectDatagram) -> None: ...

    def switched(self, sw: Switchover, largest: Location | None) -> None:
        """The new subscription was accepted (SUBSCRIBE_OK, its Largest Object)."""
        ...

    def abandoned(self, sw: Switchover) -> None:
        """The move failed: the old subscription stays."""
        ...


class _Source(RequestHandler):
    """One subscription feeding the fan-out under a stream-ID offset; remembers its open
    streams so that its end closes only those."""

    def __init__(self, up: SwitchingSubscription, peer: PeerSession, offset: int) -> None:
        self.up, self.peer, self.offset = up, peer, offset
        self.rid: int | None = None
        self.open_streams: set[int] = set()
        self.streams_seen = 0

    def on_data(self, stream_id: int, event: object) -> None:
        if isinstance(event, SubgroupHeader):
            self.open_streams.add(stream_id)
            self.streams_seen += 1
        self.up.feed(self.offset, stream_id, event)

    def on_datagram(self, datagram: ObjectDatagram) -> None:
        self.up.feed_datagram(datagram)

    def on_stream_closed(self, stream_id: int, code: int | None) -> None:
        self.open_streams.discard(stream_id)
        self.up.fanout.on_stream_closed(stream_id + self.offset, code)

    def close_streams(self) -> None:
        """Its streams still open end as if FIN'd there (cut objects reset downstream)."""
        for sid in sorted(self.open_streams):
            self.up.fanout.on_stream_closed(sid + self.offset, None)
        self.open_streams.clear()


class Switchover(_Source):
    """Our SUBSCRIBE of an Established subscription's track on the new upstream session."""

    def __init__(self, up: SwitchingSubscription, new: PeerSession, offset: int,
                 timeout: float, on_timeout: Callable[[], None]) -> None:
        super().__init__(up, new, offset)
        self._on_timeout = on_timeout
        self.timer = Deadline(timeout, self._timed_out)
        self.done = False

    def start(self) -> None:
        moqt = self.peer.moqt
        assert moqt is not None
        ns, name = self.up.track
        # RENDEZVOUS_TIMEOUT: the new relay may not know the track's publisher yet (it is
        # moving there too); it may hold our SUBSCRIBE until it does (within our deadline).
        self.rid = moqt.subscribe(ns, name, MessageParameters(
            rendezvous_timeout=int(self.timer.seconds * 1000)))
        self.peer.local[self.rid] = self
        event("upstream_switchover", namespace=format_namespace(ns),
              track=name.decode("utf-8", "backslashreplace"), request_id=self.rid,
              upstream=self.peer.address)
        self.timer.arm()
        self.peer.flush()

    def _timed_out(self) -> None:
        if self.done:
            return
        self._on_timeout()
        if self.rid is not None:
            self.peer.cancel_request(self.rid)
        self._abandon()

    def _abandon(self) -> None:
        self.done = True
        self.timer.cancel()
        self.close_streams()
        self.up.abandoned(self)

    def on_response(self, msg: Message) -> None:
        if self.done:
            return
        self.timer.cancel()
        if isinstance(msg, SubscribeOk):
            self.done = True
            largest = msg.parameters.largest_object
            self.up.switched(self, (largest.group, largest.object) if largest else None)
        elif isinstance(msg, RequestError):
            if self.rid is not None:
                self.peer.release(self.rid)
            self._abandon()

    def on_cancelled(self, code: int) -> None:
        if not self.done:
            self._abandon()

    def on_session_closed(self, peer: PeerSession) -> None:
        if not self.done:
            self._abandon()


class OldSource(_Source):
    """The subscription on the old session after the switch: forwarded until it delivered
    ``until`` (the new SUBSCRIBE_OK's Largest Object), then cancelled."""

    def __init__(self, up: SwitchingSubscription, old: PeerSession, rid: int, offset: int,
                 until: Location | None, streams: set[int], dedupe: Dedupe,
                 on_done: Callable[[PeerSession], None], *,
                 in_progress: dict[int, Location], linger: float) -> None:
        super().__init__(up, old, offset)
        self.rid = rid
        self.until = until
        self.open_streams = streams
        self.dedupe = dedupe
        self._on_done = on_done
        #: The largest object this subscription brought whole, and the one each of its
        #: streams is bringing (from before the switch too).
        self.largest: Location | None = None
        self._current: dict[int, Location] = dict(in_progress)
        self.finished = False
        #: The bound on waiting for the objects in progress once ``until`` was delivered.
        self._linger = Deadline(linger, self.finish)

    def check(self) -> None:
        """Done once it delivered ``until`` (or the overlap grew too large) and ended the
        objects it is in the middle of (bounded by ``linger``)."""
        if self.finished:
            return
        if self.until is None or self.dedupe.full or (
                self.largest is not None and self.largest >= self.until):
            if not self._current or self.dedupe.full or self._linger.seconds <= 0:
                self.finish()
            elif not self._linger.armed:
                self._linger.arm()

    def on_data(self, stream_id: int, event: object) -> None:
        if self.finished:
            return
        if isinstance(event, ObjectBegin):
            self._current[stream_id] = (event.group_id, event.object_id)
        super().on_data(stream_id, event)
        if isinstance(event, ObjectEnd):
            loc = self._current.pop(stream_id, None)
            if loc is not None and (self.largest is None or loc > self.largest):
                self.largest = loc  # delivered here (forwarded, or already by the new one)
            self.check()

    def on_stream_closed(self, stream_id: int, code: int | None) -> None:
        loc = self._current.pop(stream_id, None)
        if loc is not None:  # ended inside an object: the fan-out resets it downstream
            self.dedupe.cut(stream_id + self.offset, loc)
        super().on_stream_closed(stream_id, code)
        self.check()

    def finish(self) -> None:
        """Cancel the old subscription (§"Request Cancellation") and close its streams."""
        if self.finished:
            return
        self.finished = True
        self._linger.cancel()
        self.dedupe.frozen = True
        for sid, loc in self._current.items():  # cut: the fan-out resets them downstream
            self.dedupe.cut(sid + self.offset, loc)
        self._current.clear()
        self.close_streams()
        if self.rid is not None and self.peer.is_open:
            self.peer.cancel_request(self.rid)
        self._on_done(self.peer)

    def on_message(self, msg: Message) -> None:  # its PUBLISH_DONE: the new one carries on
        self.finish()

    def on_cancelled(self, code: int) -> None:
        self.finish()

    def on_finished(self) -> None:
        self.finish()

    def on_session_closed(self, peer: PeerSession) -> None:
        self.finish()
