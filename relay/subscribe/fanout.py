"""Fan-out: one upstream subscription's objects to every downstream subscriber.

Per subscriber (draft-20 §"Subscriber Interactions", §"Relay Object Handling"):

* one subgroup stream per (subscriber, upstream subgroup stream), i.e. per (group,
  subgroup); Group, Subgroup and Object IDs, Object Status, publisher priority and the
  Object Properties (their raw wire bytes) are forwarded unchanged; the SUBGROUP_HEADER
  keeps the upstream flags (Subgroup ID mode, PROPERTIES, END_OF_GROUP, DEFAULT_PRIORITY,
  FIRST_OBJECT) unless the subscriber joins mid-stream, when the Subgroup ID is sent
  explicitly and FIRST_OBJECT is cleared;
* object headers are re-encoded per subscriber (its Track Alias, its stream's deltas); the
  payload chunks are the received memoryviews, handed as the *same object* to every
  subscriber's stream (the QUIC layer's send buffer is the only copy);
* objects outside the subscriber's LOCATION_FILTER window are not sent (§"Location
  Filter"); once the window is passed the subscription ends with SUBSCRIPTION_ENDED;
* each object is cached as it passes (its bytes reserved first) unless it does not match
  the layer digest its track's LAYER_DIGESTS declare (:mod:`relay.fetch.digests`; it is still
  forwarded: subscribers verify what they get);
* a relay MUST NOT reorder or drop objects within a stream: the subscription's streams go
  through its session's sender (:mod:`relay.session.sender`), which hands every stream of the
  session to QUIC by priority (§"Priorities": subscriber priority, publisher priority, the
  subscription's group order, fill first, Subgroup ID; :mod:`relay.session.schedule`) and keeps
  each stream's bytes in order. A subscription whose waiting bytes exceed its budget is
  ended: its data streams are reset with TOO_FAR_BEHIND (stream reset code 0x5) and it gets
  PUBLISH_DONE TOO_FAR_BEHIND (0x5) with its exact Stream Count (§"Delivery Timeouts": "the
  publisher MAY terminate the subscription using PUBLISH_DONE with error TOO_FAR_BEHIND").
  The others never wait for it;
* REQUEST_UPDATE (§"REQUEST_UPDATE", §"Updating Subscriptions") may change the
  subscriber priority (re-ranks what waits and what comes), the Forward State (0: no new
  objects; 1 on a PUBLISHed track asks its publisher to forward) and the LOCATION_FILTER
  (the window is recomputed against the Largest Object); it is answered REQUEST_OK with
  LARGEST_OBJECT. The group order of a subscription cannot be changed.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from kvsp_moq.moqt.data import SubgroupStreamEncoder
from kvsp_moq.moqt.errors import PublishDoneCode, RequestErrorCode
from kvsp_moq.moqt.messages import (
    Location,
    MessageParameters,
    RequestUpdate,
)
from kvsp_moq.moqt.objects import (
    GroupOrder,
    ObjectBegin,
    ObjectEnd,
    ObjectPayload,
    SubgroupHeader,
    SubgroupIdMode,
)
from kvsp_moq.pubsub.window import Window, subscription_window
from kvsp_moq.wire.errors import StreamResetCode

from ..fetch.cache import OBJECT_OVERHEAD, CachedObject, ObjectCache, TrackName
from ..fetch.digests import LayerDigests, PayloadCheck, admit
from ..session.peer import PeerSession, RequestHandler
from ..ops.stats import RelayStats

__all__ = ["Fanout", "Subscriber", "Tap"]

logger = logging.getLogger(__name__)

DEFAULT_PUBLISHER_PRIORITY = 0x0E
DEFAULT_PUBLISHER_GROUP_ORDER = 0x22


# ==========================================================================================
# one downstream subscription
@dataclass(slots=True, eq=False)
class _Down:
    stream_id: int
    encoder: SubgroupStreamEncoder
    #: Payload bytes of the current object not yet forwarded (non-zero: mid-object).
    remaining: int = 0


class Subscriber(RequestHandler):
    """A downstream SUBSCRIBE the relay accepted; the handler of its request stream."""

    def __init__(self, fanout: Fanout, peer: PeerSession, request_id: int, alias: int,
                 window: Window, budget: int) -> None:
        self.fanout = fanout
        self.peer = peer
        self.request_id = request_id
        self.alias = alias
        self.window = window
        #: upstream data stream id → our stream for it.
        self.streams: dict[int, _Down] = {}
        self.streams_opened = 0
        self.ended = False
        self.end_status: int | None = None
        #: The Largest Object when SUBSCRIBE_OK was sent (draft 18: the Joining Location).
        self.joining_location: tuple[int, int] | None = None
        #: Forward State (§"Forward State"): 0 sends no objects until a REQUEST_UPDATE sets 1.
        self.forward = True
        # SUBSCRIBER_PRIORITY (default 128) and GROUP_ORDER (none: the track's
        # DEFAULT_PUBLISHER_GROUP_ORDER) of the request rank this subscription's streams
        # among every stream of the session (relay.session.schedule).
        priority: int | None = None
        self.group_order: int | None = None
        moqt = peer.moqt
        req = moqt.requests.get(request_id) if moqt is not None else None
        params = getattr(getattr(req, "message", None), "parameters", None)
        if params is not None and not (req is not None and req.local):
            priority = getattr(params, "subscriber_priority", None)
            self.group_order = getattr(params, "group_order", None)
            self.forward = getattr(params, "forward", None) is not False
        self.out = peer.sender.request(priority, self.group_order or fanout.default_group_order,
                                       budget, self._too_far_behind)

    @property
    def priority(self) -> int:
        """The subscriber priority now in force."""
        return self.out.priority

    # -- RequestHandler ----------------------------------------------------------------------
    def on_cancelled(self, code: int) -> None:
        # Unsubscribe (§"Request Cancellation"): the session already reset our streams.
        self.ended = True
        self.out.abort()
        self.fanout.remove(self)

    def on_stream_stopped(self, stream_id: int, code: int) -> None:
        self.out.stopped(stream_id)
        for usid, d in list(self.streams.items()):
            if d.stream_id == stream_id:
                del self.streams[usid]

    takes_updates = True

    def on_update(self, msg: RequestUpdate) -> None:
        self.apply_updates(msg.parameters)

    def apply_updates(self, p: MessageParameters, count: int = 1) -> None:
        """REQUEST_UPDATE on this subscription (§"Updating Subscriptions"), or ``count``
        updates coalesced into ``p`` (held while the subscription waited for its upstream):
        what it changes applies to every object not yet handed to QUIC; answered REQUEST_OK
        with LARGEST_OBJECT (one per update). A LOCATION_FILTER whose end precedes its start
        fails it: one REQUEST_ERROR INVALID_RANGE that does not end the request, then the
        subscription ends with PUBLISH_DONE UPDATE_FAILED ("When a REQUEST_UPDATE is
        unsuccessful, the publisher MUST also terminate the subscription by sending a
        PUBLISH_DONE with error code UPDATE_FAILED")."""
        moqt = self.peer.moqt
        if moqt is None or moqt.closed or self.request_id not in moqt.requests:
            return  # PUBLISH_DONE already went: nothing left to change
        if self.ended:
            # Ended by the fan-out, but bytes may still wait: the priority still counts.
            if p.subscriber_priority is not None:
                self.out.set_priority(p.subscriber_priority)
            for _ in range(count):
                moqt.request_ok(self.request_id, MessageParameters())
            self.peer.flush()
            return
        if p.location_filter is not None:
            window = subscription_window(p.location_filter, self.fanout.largest)
            if window.empty:
                moqt.reject(self.request_id, RequestErrorCode.INVALID_RANGE,
                            "the filter's end precedes its start", end=False)
                self.peer.flush()
                self.end(PublishDoneCode.UPDATE_FAILED, "invalid LOCATION_FILTER update")
                return
            self.window = window
        self.apply(p)
        largest = self.fanout.largest
        for _ in range(count):
            moqt.request_ok(self.request_id, MessageParameters(
                largest_object=Location(*largest) if largest is not None else None))
        self.peer.flush()
        if largest is not None and self.window.passed(*largest):
            self.end(PublishDoneCode.SUBSCRIPTION_ENDED, "range delivered")

    def apply(self, p: MessageParameters) -> None:
        """SUBSCRIBER_PRIORITY and FORWARD of an update (or of a PUBLISH_OK)."""
        if p.subscriber_priority is not None:
            self.out.set_priority(p.subscriber_priority)
        if p.forward is not None and p.forward != self.forward:
            self.forward = p.forward
            if p.forward:
                self.fanout.want_forward()

    def on_session_closed(self, peer: PeerSession) -> None:
        self.ended = True
        self.out.abort()
        self.fanout.remove(self)

    # -- ending ------------------------------------------------------------------------------
    def end(self, status: int, reason: str) -> None:
        """Close every data stream (FIN, or reset when mid-object), then PUBLISH_DONE with
        our Stream Count (§"PUBLISH_DONE": only after all data streams are closed)."""
        if self.ended:
            return
        self.ended = True
        self.end_status = status
        for d in self.streams.values():
            if d.remaining:
                self.out.reset(d.stream_id, StreamResetCode.INTERNAL_ERROR)
            else:
                self.out.send(d.stream_id, b"", fin=True)
        self.streams.clear()
        self.out.call(lambda: self.publish_done(status, reason))
        self.fanout.remove(self)

    def publish_done(self, status: int, reason: str) -> None:
        """PUBLISH_DONE now (its data streams are closed) with our Stream Count."""
        moqt = self.peer.moqt
        self.peer.served.pop(self.request_id, None)
        if moqt is None or moqt.closed or self.request_id not in moqt.requests:
            return
        moqt.publish_done(self.request_id, status, self.streams_opened, reason)
        self.peer.flush()

    def _too_far_behind(self) -> None:
        if self.ended:
            return
        self.ended = True
        self.end_status = PublishDoneCode.TOO_FAR_BEHIND
        self.fanout.stats.too_far_behind += 1
        queued = self.out.queued
        self.out.abort(StreamResetCode.TOO_FAR_BEHIND)  # every open stream, the fill too
        self.streams.clear()
        self.publish_done(PublishDoneCode.TOO_FAR_BEHIND,
                           f"subscriber queue exceeded {self.out.budget} bytes")
        logger.info("relay: subscriber %r too far behind (%d bytes queued)", self.peer, queued)
        self.fanout.remove(self)
        self.fanout.emit("too_far_behind", self)


# ==========================================================================================
# an internal consumer of the track's whole objects
class Tap(Protocol):
    """What the relay itself takes from a track (relay/transcode/live.py: a coded track made
    from this one). A tap counts as a subscriber for the upstream subscription's life (it is
    not cancelled while a tap remains) but sends nothing: it is told of each object once it
    is whole, in the order the upstream streams delivered them."""

    def source_object(self, usid: int, header: SubgroupHeader, begin: ObjectBegin,
                      obj: CachedObject | None) -> None:
        """An object ended on upstream stream ``usid``: ``obj`` as cached, or None when it
        was not kept (over the cache budget, or not matching its layer digest)."""
        ...

    def source_stream_closed(self, usid: int, code: int | None) -> None:
        """Upstream stream ``usid`` ended (``code``: its reset code; None: FIN)."""
        ...

    def source_ended(self, status: int, reason: str) -> None:
        """The track's subscription ended (PUBLISH_DONE ``status``)."""
        ...


# ==========================================================================================
# the upstream track's objects → subscribers (and the cache)
@dataclass(slots=True, eq=False)
class _UpStream:
    header: SubgroupHeader
    first_object_id: int | None = None
    targets: list[tuple[Subscriber, _Down]] = field(default_factory=list)
    begin: ObjectBegin | None = None
    began_at: float = 0.0
    chunks: list[memoryview] = field(default_factory=list)
    #: Cache bytes reserved for the object being received (0: it is not being kept, it
    #: did not fit the budget: its bytes are forwarded, never buffered).
    reserved: int = 0
    #: Its payload's hash against its layer digest (relay.fetch.digests; None: not checked).
    check: PayloadCheck | None = None


class Fanout:
    """The objects of one full track name, from one upstream subscription, to N
    subscribers."""

    def __init__(self, track: TrackName, cache: ObjectCache, stats: RelayStats,
                 on_empty: Callable[[], None],
                 emit: Callable[[str, object], None] = lambda kind, obj: None) -> None:
        self.track = track
        self.cache = cache
        self.stats = stats
        self.on_empty = on_empty
        self.emit = emit
        self.subscribers: list[Subscriber] = []
        #: Internal consumers of whole objects (:class:`Tap`).
        self.taps: list[Tap] = []
        self.largest: tuple[int, int] | None = None
        self.default_priority = 128
        #: DEFAULT_PUBLISHER_GROUP_ORDER, for subscriptions that named no GROUP_ORDER.
        self.default_group_order: int = GroupOrder.ASCENDING
        #: Called when a subscriber's Forward State becomes 1 (a PUBLISHed track asks its
        #: publisher to forward, relay.subscribe.publish_in).
        self.want_forward: Callable[[], None] = lambda: None
        self._up: dict[int, _UpStream] = {}
        #: The track's Track Properties (stored with each cached object).
        self.track_properties: tuple[tuple[int, int | bytes], ...] = ()
        #: Their LAYER_DIGESTS: objects are cached only if they match (relay.fetch.digests).
        self.digests: LayerDigests | None = None

    @property
    def open_upstream_streams(self) -> int:
        return len(self._up)

    def set_track_properties(self, props: tuple[tuple[int, int | bytes], ...]) -> None:
        self.track_properties = tuple(props)
        self.digests = LayerDigests.of(props)
        for t, v in props:
            if t == DEFAULT_PUBLISHER_PRIORITY and isinstance(v, int):
                self.default_priority = v
            elif t == DEFAULT_PUBLISHER_GROUP_ORDER and v in (1, 2):
                self.default_group_order = v

    def add(self, sub: Subscriber) -> None:
        self.subscribers.append(sub)

    def remove(self, sub: Subscriber) -> None:
        if sub in self.subscribers:
            self.subscribers.remove(sub)
            if not self.subscribers and not self.taps:
                self.on_empty()

    def remove_tap(self, tap: Tap) -> None:
        if tap in self.taps:
            self.taps.remove(tap)
            if not self.subscribers and not self.taps:
                self.on_empty()

    def end_all(self, status: int, reason: str) -> None:
        for sub in list(self.subscribers):
            sub.end(status, reason)
        taps, self.taps = self.taps, []
        for tap in taps:
            tap.source_ended(status, reason)

    # -- upstream data events ----------------------------------------------------------------
    def on_data(self, usid: int, event: object) -> None:
        if isinstance(event, ObjectPayload):
            self._payload(usid, event.data)
        elif isinstance(event, ObjectBegin):
            self._begin(usid, event)
        elif isinstance(event, ObjectEnd):
            self._end(usid, event)
        elif isinstance(event, SubgroupHeader):
            self._up[usid] = _UpStream(event)

    def _begin(self, usid: int, b: ObjectBegin) -> None:
        st = self._up.get(usid)
        if st is None:
            return
        if st.first_object_id is None:
            st.first_object_id = b.object_id
        loc = (b.group_id, b.object_id)
        targets: list[tuple[Subscriber, _Down]] = []
        for sub in list(self.subscribers):
            if sub.ended or not sub.forward:
                continue
            if sub.window.passed(*loc):
                sub.end(PublishDoneCode.SUBSCRIPTION_ENDED, "range delivered")
                continue
            if not sub.window.admits(*loc):
                continue
            d = sub.streams.get(usid)
            if d is None:
                d = self._open(sub, usid, st, b)
                if d is None:
                    continue
            try:
                head = d.encoder.object_header(b.object_id, b.payload_length,
                                               properties=b.raw_properties, status=b.status)
            except ValueError:
                logger.exception("relay: cannot forward object %s", loc)
                sub.out.reset(d.stream_id, StreamResetCode.INTERNAL_ERROR)
                sub.streams.pop(usid, None)
                continue
            d.remaining = b.payload_length
            sub.out.send(d.stream_id, head)
            if not sub.ended:
                targets.append((sub, d))
        st.targets = targets
        st.begin = b
        st.began_at = time.monotonic()
        st.chunks = []
        # Counted against the cache budget before a byte of it is buffered (issue 18): an
        # object that cannot fit is forwarded but not kept.
        self._release(st)
        size = b.payload_length + len(b.raw_properties) + OBJECT_OVERHEAD
        if self.cache.reserve(size):
            st.reserved = size
            if self.digests is not None:
                st.check = self.digests.check(b.group_id, b.object_id, b.status)
        self.stats.objects_out += len(targets)

    def _open(self, sub: Subscriber, usid: int, st: _UpStream, b: ObjectBegin) -> _Down | None:
        h = st.header
        if st.first_object_id == b.object_id:
            header = dataclasses.replace(h, track_alias=sub.alias)
        else:  # joining mid-stream: say the Subgroup ID outright
            header = SubgroupHeader(sub.alias, h.group_id, b.subgroup_id or 0,
                                    h.publisher_priority, SubgroupIdMode.EXPLICIT,
                                    has_properties=h.has_properties,
                                    end_of_group=h.end_of_group, first_object=False)
        moqt = sub.peer.moqt
        if moqt is None or moqt.closed:
            return None
        try:
            sid = moqt.open_subgroup_stream(sub.request_id, header)
        except KeyError:  # the subscription is gone
            return None
        # The transport opened (and numbered) the stream; its header goes out now, before
        # any object bytes.
        sub.peer.flush()
        sub.out.open_stream(
            sid, self.default_priority if h.publisher_priority is None else h.publisher_priority,
            h.group_id, b.subgroup_id or 0)
        d = _Down(sid, SubgroupStreamEncoder(header, sub.peer.version))
        sub.streams[usid] = d
        sub.streams_opened += 1
        return d

    def _payload(self, usid: int, data: memoryview) -> None:
        st = self._up.get(usid)
        if st is None:
            return
        n = len(data)
        self.stats.bytes_in += n
        for sub, d in st.targets:
            if not sub.ended:
                d.remaining -= n
                sub.out.send(d.stream_id, data)  # the same memoryview for everyone
                self.stats.bytes_out += n
        # Keep the chunk for the cache (its bytes are reserved): a read-only view of
        # received bytes is immutable.
        if st.reserved:
            chunk = data if data.readonly else memoryview(bytes(data))
            st.chunks.append(chunk)
            if st.check is not None:
                st.check.update(chunk)

    def _end(self, usid: int, e: ObjectEnd) -> None:
        st = self._up.get(usid)
        if st is None or st.begin is None:
            return
        b = st.begin
        self.stats.objects_in += 1
        loc = (b.group_id, b.object_id)
        if self.largest is None or loc > self.largest:
            self.largest = loc
        prio = st.header.publisher_priority
        # Cached if kept (its bytes were reserved) and it matches its layer digest, if any.
        kept: CachedObject | None = None
        if st.reserved and admit(st.check, self.stats, self.track, loc):
            chunks, verified = tuple(st.chunks), st.check is not None
            self._release(st)
            kept = CachedObject(
                b.group_id, b.object_id, b.subgroup_id,
                self.default_priority if prio is None else prio, b.status,
                bytes(b.raw_properties), chunks, b.payload_length,
                self.cache.expiry_for(self.track, st.began_at, self.track_properties or None))
            self.cache.put(self.track, kept, self.track_properties or None, replace=verified)
        self._release(st)
        for tap in list(self.taps):
            tap.source_object(usid, st.header, b, kept)
        st.begin, st.chunks = None, []
        for sub, _d in st.targets:
            w = sub.window
            if not sub.ended and w.end_object is not None and loc == (w.end_group, w.end_object):
                sub.end(PublishDoneCode.SUBSCRIPTION_ENDED, "range delivered")
        st.targets = []

    def _release(self, st: _UpStream) -> None:
        if st.reserved:
            self.cache.release(st.reserved)
            st.reserved = 0
            st.chunks = []
        st.check = None

    def release_reservations(self) -> None:
        """The upstream subscription is over: what its objects in progress reserved in the
        cache is given back (their data will not come here any more)."""
        for st in self._up.values():
            self._release(st)

    def close_upstream_streams(self) -> None:
        """The upstream ended with subgroup streams still open: each ends as if FIN'd there
        (objects cut short are reset downstream, the other streams FIN'd)."""
        for usid in list(self._up):
            self.on_stream_closed(usid, None)

    def on_stream_closed(self, usid: int, code: int | None) -> None:
        """An upstream subgroup stream ended: FIN ours for it (reset when it was reset or
        ended mid-object)."""
        st = self._up.pop(usid, None)
        if st is not None:
            self._release(st)
            for tap in list(self.taps):
                tap.source_stream_closed(usid, code)
        for sub in list(self.subscribers):
            d = sub.streams.pop(usid, None)
            if d is None or sub.ended:
                continue
            if code is None and not d.remaining:
                sub.out.send(d.stream_id, b"", fin=True)
            else:
                sub.out.reset(d.stream_id, StreamResetCode.INTERNAL_ERROR if code is None
                              else code)
