"""Upstream subscriptions: exactly ONE upstream SUBSCRIBE per full track name, whatever the
number of downstream subscribers (draft-20 §"Subscriber Interactions": "Subscription
aggregation allows relays to make only a single upstream subscription for the Track").

* The first downstream SUBSCRIBE for a track opens the upstream subscription; later ones
  join it. "The relay MUST have an Established upstream subscription before sending
  SUBSCRIBE_OK": subscribers that arrive while it is pending wait, and get SUBSCRIBE_OK (or
  the upstream's REQUEST_ERROR code) when the upstream answers.
* The upstream subscription has no LOCATION_FILTER (every object from now on, the widest
  live window); each subscriber's own filter is applied by the fan-out.
* When the last subscriber leaves, the upstream subscription is cancelled (RESET_STREAM
  CANCELLED on its request stream, §"Request Cancellation").
* Upstream PUBLISH_DONE is forwarded to every subscriber with its own Stream Count, once
  the upstream's data streams (its Stream Count) have all ended. An upstream session that
  ends first ends the subscriptions with PUBLISH_DONE GOING_AWAY when it had sent GOAWAY,
  INTERNAL_ERROR otherwise (streams mid-object are reset, the others FIN'd).
* After the upstream relay's GOAWAY, :meth:`UpstreamManager.move` moves every Established
  subscription on that session to the new one (:mod:`relay.subscribe.switchover`, draft-22
  §"Graceful Subscriber Relay Switchover"): its subscribers keep their subscription.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol

from kvsp_moq.moqt.errors import PublishDoneCode, RequestErrorCode
from kvsp_moq.moqt.messages import (
    Location,
    Message,
    MessageParameters,
    PublishDone,
    RequestError,
    Subscribe,
    SubscribeOk,
)
from kvsp_moq.moqt.objects import ObjectBegin, ObjectDatagram, ObjectEnd, SubgroupHeader
from kvsp_moq.pubsub.window import subscription_window

from ..fetch.cache import ObjectCache, TrackName
from .datagrams import forward_datagram
from ..session.deadline import Deadline
from .fanout import Fanout, Subscriber, Tap
from ..ops.logs import event
from ..ops.names import format_namespace
from ..session.peer import PeerSession, RequestHandler
from ..ops.stats import RelayStats
from .switchover import STREAM_ID_OFFSET, Dedupe, OldSource, Switchover

__all__ = ["SourceTap", "UpstreamManager", "UpstreamSubscription"]

logger = logging.getLogger(__name__)
UNKNOWN_STREAM_COUNT = (1 << 62) - 1


class SourceTap(Tap, Protocol):
    """A :class:`~relay.subscribe.fanout.Tap` that also waits for the subscription to be Established."""

    def source_established(self, properties: tuple[tuple[int, int | bytes], ...],
                           largest: tuple[int, int] | None) -> None:
        """SUBSCRIBE_OK (or already Established): the track's properties, Largest Object."""
        ...

    def source_refused(self, code: int, reason: str) -> None:
        """The upstream refused the SUBSCRIBE (REQUEST_ERROR ``code``), or it timed out."""
        ...


class UpstreamSubscription(RequestHandler):
    """Our SUBSCRIBE to the publisher (or upstream relay) of one track."""

    def __init__(self, manager: UpstreamManager, track: TrackName, peer: PeerSession) -> None:
        self.manager = manager
        self.track = track
        self.peer = peer
        self.fanout = Fanout(track, manager.cache, manager.stats, self.on_empty, manager.emit)
        self.pending: list[tuple[PeerSession, int, Subscribe]] = []
        #: Taps (relay/transcode/live.py) waiting, like ``pending``, for SUBSCRIBE_OK.
        self.pending_taps: list[SourceTap] = []
        self.request_id: int | None = None
        self.established = False
        self.ended = False
        self.track_properties: tuple[tuple[int, int | bytes], ...] = ()
        self.done: PublishDone | None = None
        self.streams_seen = 0
        #: Added to the stream IDs of our request before they reach the fan-out (a move to a
        #: new upstream session gives its streams another offset), and those still open.
        self.offset = 0
        self.source_streams: set[int] = set()
        #: The largest object our request brought whole, and the one each stream is bringing.
        self.source_largest: tuple[int, int] | None = None
        self._begun: dict[int, tuple[int, int]] = {}
        #: A move after GOAWAY (relay/subscribe/switchover.py): the SUBSCRIBE on the new session, the
        #: old subscription being wound down, and the objects both brought.
        self.switching: Switchover | None = None
        self.old_source: OldSource | None = None
        self.dedupe: Dedupe | None = None
        #: SUBSCRIBE_OK (or REQUEST_ERROR) must come within the request timeout.
        self.timer = Deadline(manager.request_timeout, self._timed_out)

    def start(self) -> None:
        moqt = self.peer.moqt
        assert moqt is not None
        ns, name = self.track
        self.request_id = moqt.subscribe(ns, name, MessageParameters())
        self.peer.local[self.request_id] = self
        self.manager.stats.upstream_subscribes += 1
        self._log("upstream_subscribe")
        self.timer.arm()
        self.peer.flush()

    def _timed_out(self) -> None:
        """No answer within the request timeout: cancel upstream, forget the subscription,
        the waiting subscribers get REQUEST_ERROR TIMEOUT."""
        if self.established or self.ended:
            return
        self._log("upstream_timeout")
        self.manager.stats.upstream_timeouts += 1
        self.retire()
        if self.request_id is not None:
            self.peer.cancel_request(self.request_id)
        self._reject_pending(RequestErrorCode.TIMEOUT, "upstream did not answer SUBSCRIBE in time")

    # -- downstream side ---------------------------------------------------------------------
    def join(self, down: PeerSession, rid: int, msg: Subscribe) -> None:
        if self.established:
            self._accept(down, rid, msg)
        else:
            self.pending.append((down, rid, msg))

    def _accept(self, down: PeerSession, rid: int, msg: Subscribe) -> None:
        moqt = down.moqt
        if moqt is None or moqt.closed or rid not in moqt.requests:
            self.manager.refused(down, rid)
            return  # the subscriber went away while we waited
        window = subscription_window(msg.parameters.location_filter, self.fanout.largest)
        if window.empty:
            moqt.reject(rid, RequestErrorCode.INVALID_RANGE, "the filter's end precedes its start")
            self.manager.stats.subscribe_errors += 1
            down.flush()
            self.manager.refused(down, rid)
            return
        alias = down.next_alias()
        largest = self.fanout.largest
        params = (MessageParameters(largest_object=Location(*largest)) if largest
                  else MessageParameters())
        # §"Relay Track Handling": all Track Properties go into SUBSCRIBE_OK, unchanged.
        moqt.accept_subscribe(rid, alias, params, self.track_properties)
        sub = Subscriber(self.fanout, down, rid, alias, window,
                         self.manager.subscriber_queue_bytes)
        # Draft 18 §"Subscriptions": the Largest Location of SUBSCRIBE_OK is the Joining
        # Location; drafts 20+ evaluate a fill range against the same Largest Object.
        sub.joining_location = largest
        down.served[rid] = sub
        self.fanout.add(sub)
        self.manager.stats.subscribes += 1
        down.flush()
        if self.manager.on_accepted is not None:
            self.manager.on_accepted(self, sub, msg)  # fill fetch stream (relay.fetch.fill)
        # REQUEST_UPDATEs that arrived while the SUBSCRIBE waited (for the upstream
        # subscription, a route, a publisher): applied now, answered after SUBSCRIBE_OK.
        held = down.take_updates(rid)
        if held is not None:
            sub.apply_updates(held.parameters, held.count)

    def tap(self, tap: SourceTap) -> None:
        """``tap`` takes this track's whole objects (told at once when Established, else
        when SUBSCRIBE_OK comes); it keeps the subscription open as a subscriber would."""
        if self.established:
            self.fanout.taps.append(tap)  # first: the tap may leave (untap) while it is told
            self.fanout.want_forward()
            tap.source_established(self.track_properties, self.fanout.largest)
        else:
            self.pending_taps.append(tap)

    def untap(self, tap: SourceTap) -> None:
        """``tap`` wants no more objects (the subscription ends if nobody else is left)."""
        if tap in self.pending_taps:
            self.pending_taps.remove(tap)  # SUBSCRIBE_OK finds nobody left: cancelled then
        else:
            self.fanout.remove_tap(tap)

    def _reject_pending(self, code: int, reason: str) -> None:
        taps, self.pending_taps = self.pending_taps, []
        for tap in taps:
            tap.source_refused(code, reason)
        pending, self.pending = self.pending, []
        for down, rid, _msg in pending:
            moqt = down.moqt
            if moqt is not None and not moqt.closed and rid in moqt.requests:
                moqt.reject(rid, code, reason)
                self.manager.stats.subscribe_errors += 1
                down.flush()
            self.manager.refused(down, rid)

    def on_empty(self) -> None:
        """The last subscriber left: cancel upstream (unless the upstream already ended)."""
        if self.ended or self.pending or self.pending_taps:
            return
        if self.established:
            self.retire()
            if self.request_id is not None and self.peer.is_open:
                self.peer.local.pop(self.request_id, None)
                assert self.peer.moqt is not None
                self.peer.moqt.cancel(self.request_id)
                self._log("upstream_cancel")
                self.peer.flush()

    def _log(self, name: str) -> None:
        ns, track = self.track
        event(name, namespace=format_namespace(ns), track=track.decode("utf-8", "backslashreplace"),
              request_id=self.request_id, upstream=self.peer.address)

    # -- upstream side (RequestHandler of our SUBSCRIBE) -------------------------------------
    def on_response(self, msg: Message) -> None:
        self.timer.cancel()
        if isinstance(msg, SubscribeOk):
            self.established = True
            self.track_properties = tuple(msg.track_properties)
            self.manager.cache.set_track_properties(self.track, self.track_properties)
            self.fanout.set_track_properties(self.track_properties)
            largest = msg.parameters.largest_object
            if largest is not None:
                self.fanout.largest = (largest.group, largest.object)
            pending, self.pending = self.pending, []
            for down, rid, sub in pending:
                self._accept(down, rid, sub)
            taps, self.pending_taps = self.pending_taps, []
            for tap in taps:
                self.tap(tap)
            if not self.fanout.subscribers and not self.fanout.taps:
                self.on_empty()
        elif isinstance(msg, RequestError):
            self.retire()
            self._reject_pending(msg.error_code, msg.error_reason)
            if self.request_id is not None:
                self.peer.release(self.request_id)

    def on_message(self, msg: Message) -> None:
        if isinstance(msg, PublishDone):
            self.done = msg
            self._maybe_done()

    def on_data(self, stream_id: int, event: object) -> None:
        if isinstance(event, SubgroupHeader):
            self.streams_seen += 1
            self.source_streams.add(stream_id)
        elif isinstance(event, ObjectBegin):
            self._begun[stream_id] = (event.group_id, event.object_id)
        elif isinstance(event, ObjectEnd):
            loc = self._begun.pop(stream_id, None)
            if loc is not None and (self.source_largest is None or loc > self.source_largest):
                self.source_largest = loc
        self.feed(self.offset, stream_id, event)

    def feed(self, offset: int, stream_id: int, e: object) -> None:
        """A data event of one of the track's upstream requests (its stream IDs + offset)."""
        usid = stream_id + offset
        if self.dedupe is not None and not self.dedupe.admit(usid, e):
            return  # the other subscription of a move brought this object already
        self.fanout.on_data(usid, e)

    def on_datagram(self, datagram: ObjectDatagram) -> None:
        self.feed_datagram(datagram)

    def feed_datagram(self, dg: ObjectDatagram) -> None:
        if self.dedupe is None or self.dedupe.admit_datagram(dg):
            forward_datagram(self.fanout, dg)  # relay/subscribe/datagrams.py

    def on_stream_closed(self, stream_id: int, code: int | None) -> None:
        self.source_streams.discard(stream_id)
        if self.dedupe is not None:
            self.dedupe.stream_closed(stream_id + self.offset)
        self.fanout.on_stream_closed(stream_id + self.offset, code)
        self._maybe_done()

    # -- a move to a new upstream session (GOAWAY; relay/subscribe/switchover.py) ----------------------
    def move_to(self, new: PeerSession) -> None:
        """SUBSCRIBE on ``new``; on its SUBSCRIBE_OK it takes over (see relay/subscribe/switchover.py)."""
        if not self.established or self.ended or self.switching is not None or (
                self.old_source is not None and not self.old_source.finished):
            return
        if new.moqt is None or new.moqt.closed:
            return
        self.dedupe = Dedupe()
        self.switching = Switchover(self, new, self.offset + STREAM_ID_OFFSET,
                                    self.manager.request_timeout, self._switch_timed_out)
        self.switching.start()

    def _switch_timed_out(self) -> None:
        self._log("upstream_switchover_timeout")
        self.manager.stats.upstream_timeouts += 1

    def switched(self, sw: Switchover, largest: tuple[int, int] | None) -> None:
        """The new session accepted our SUBSCRIBE: it is the track's upstream from now on;
        the old subscription is forwarded until it delivered ``largest``, then cancelled."""
        self.switching = None
        assert sw.rid is not None and self.dedupe is not None
        old_peer, old_rid, old_offset = self.peer, self.request_id, self.offset
        old_streams, old_largest, old_begun = self.source_streams, self.source_largest, \
            self._begun
        self.peer, self.request_id, self.offset = sw.peer, sw.rid, sw.offset
        self.source_streams, self.streams_seen = sw.open_streams, sw.streams_seen
        self.source_largest, self._begun = None, {}
        sw.peer.local[sw.rid] = self
        self.manager.stats.upstream_switchovers += 1
        old = OldSource(self, old_peer, old_rid if old_rid is not None else -1, old_offset,
                        largest, old_streams, self.dedupe, self.manager.source_done,
                        in_progress=old_begun, linger=self.manager.request_timeout)
        old.largest = old_largest
        if old_rid is not None and old_peer.local.get(old_rid) is self:
            old_peer.local[old_rid] = old
        else:
            old.rid = None  # the old request is over already
        self.old_source = old
        self._log("upstream_switched")
        old.check()

    def abandoned(self, sw: Switchover) -> None:
        """The move failed: the old subscription stays the track's upstream."""
        if self.switching is sw:
            self.switching = None
            if self.old_source is None or self.old_source.finished:
                self.dedupe = None

    def _maybe_done(self) -> None:
        done = self.done
        if done is None or self.ended or self.fanout.open_upstream_streams:
            return
        if done.stream_count < UNKNOWN_STREAM_COUNT and self.streams_seen < done.stream_count:
            return  # some upstream streams have not arrived yet
        self.retire()
        self.fanout.end_all(done.status_code, done.error_reason)
        if self.request_id is not None:
            self.peer.release(self.request_id)

    def on_cancelled(self, code: int) -> None:
        self.end_all(PublishDoneCode.INTERNAL_ERROR, f"upstream cancelled ({code})")

    def on_session_closed(self, peer: PeerSession) -> None:
        status = PublishDoneCode.GOING_AWAY if peer.goaway_received else \
            PublishDoneCode.INTERNAL_ERROR
        self.end_all(status, "upstream session closed")

    def end_all(self, status: int, reason: str) -> None:
        """The upstream ended without PUBLISH_DONE: waiting subscribers get REQUEST_ERROR,
        the others PUBLISH_DONE ``status``."""
        if self.ended:
            return
        self.retire()
        self._reject_pending(RequestErrorCode.INTERNAL_ERROR, reason)
        # streams still open upstream: objects cut short are reset downstream
        self.fanout.close_upstream_streams()
        self.fanout.end_all(status, reason)

    def retire(self) -> None:
        """Ended: no longer the track's upstream subscription (new SUBSCRIBEs open another)."""
        self.ended = True
        self.timer.cancel()
        sw, self.switching = self.switching, None
        if sw is not None and sw.rid is not None:
            sw.done = True
            sw.timer.cancel()
            sw.peer.cancel_request(sw.rid)
        if self.old_source is not None:
            self.old_source.finish()
        self.fanout.release_reservations()
        self.manager.drop(self)


class UpstreamManager:
    """Full track name → its :class:`UpstreamSubscription`."""

    def __init__(self, cache: ObjectCache, stats: RelayStats, subscriber_queue_bytes: int,
                 emit: Callable[[str, object], None] = lambda kind, obj: None,
                 request_timeout: float = 30.0) -> None:
        self.cache = cache
        #: Seconds an upstream SUBSCRIBE may wait for its answer (relay.session.deadline).
        self.request_timeout = request_timeout
        self.stats = stats
        self.subscriber_queue_bytes = subscriber_queue_bytes
        self.emit = emit
        self.tracks: dict[TrackName, UpstreamSubscription] = {}
        #: Called once a downstream SUBSCRIBE got SUBSCRIBE_OK / was refused or abandoned
        #: (:mod:`relay.fetch.fill`: fill fetch streams, Joining FETCHes waiting for it).
        self.on_accepted: Callable[[UpstreamSubscription, Subscriber, Subscribe], None] | None \
            = None
        self.on_refused: Callable[[PeerSession, int], None] | None = None
        #: Called with the session of a subscription that ended (relay/subscribe/uplink.py closes a
        #: GOAWAY'd upstream session once nothing remains on it).
        self.on_dropped: Callable[[PeerSession], None] | None = None

    def refused(self, down: PeerSession, rid: int) -> None:
        if self.on_refused is not None:
            self.on_refused(down, rid)

    def is_pending(self, down: PeerSession, rid: int) -> bool:
        """Whether ``down``'s SUBSCRIBE ``rid`` waits for its upstream subscription."""
        return any(d is down and r == rid
                   for up in self.tracks.values() for d, r, _m in up.pending)

    def get(self, track: TrackName) -> UpstreamSubscription | None:
        return self.tracks.get(track)

    def subscribe(self, track: TrackName, route: PeerSession, down: PeerSession, rid: int,
                  msg: Subscribe) -> UpstreamSubscription:
        up = self.tracks.get(track)
        if up is None:
            up = UpstreamSubscription(self, track, route)
            self.tracks[track] = up
            up.join(down, rid, msg)
            up.start()
        else:
            up.join(down, rid, msg)
        return up

    def tap(self, track: TrackName, route: PeerSession, tap: SourceTap) -> UpstreamSubscription:
        """``tap`` takes ``track``'s objects: through its subscription, opened on ``route``
        when there is none (one upstream SUBSCRIBE, shared with the track's subscribers)."""
        up = self.tracks.get(track)
        if up is None:
            up = UpstreamSubscription(self, track, route)
            self.tracks[track] = up
            up.tap(tap)
            up.start()
        else:
            up.tap(tap)
        return up

    def move(self, old: PeerSession, new: PeerSession) -> None:
        """The upstream sent GOAWAY on ``old``: every Established subscription there moves
        to ``new`` (relay/subscribe/switchover.py)."""
        for up in list(self.tracks.values()):
            if up.peer is old:
                up.move_to(new)

    def source_done(self, peer: PeerSession) -> None:
        """An old subscription of a move was cancelled: maybe nothing is left on ``peer``."""
        if self.on_dropped is not None:
            self.on_dropped(peer)

    def drop(self, up: UpstreamSubscription) -> None:
        if self.tracks.get(up.track) is up:
            del self.tracks[up.track]
        if self.on_dropped is not None:
            self.on_dropped(up.peer)

    @property
    def subscriber_count(self) -> int:
        return sum(len(u.fanout.subscribers) for u in self.tracks.values())
