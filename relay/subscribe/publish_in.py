"""Publisher-initiated tracks: PUBLISH into the relay and SUBSCRIBE_TRACKS out of it.

* **PUBLISH** (draft-20 §"PUBLISH", §"Publisher Interactions"): the relay answers REQUEST_OK
  (PUBLISH_OK before draft 18) and the track becomes routable by its **full track name**
  (not by namespace: "If a Publisher would like Subscriptions in a Namespace routed to it, it
  MUST send an explicit PUBLISH_NAMESPACE"). The PUBLISH *is* the track's one upstream
  subscription: a :class:`PublishedTrack` is an :class:`~relay.subscribe.upstream.UpstreamSubscription`
  that is Established at once (Track Properties and LARGEST_OBJECT from the PUBLISH), so
  SUBSCRIBErs join it and get SUBSCRIBE_OK, objects, PUBLISH_DONE exactly as for a
  subscription the relay opened. A PUBLISH with FORWARD=0 gets REQUEST_UPDATE FORWARD=1 when
  the first subscriber with Forward State 1 appears ("If at least one downstream subscriber
  for the Track has Forward State=1, the Relay MUST change the Forward State to 1 with
  REQUEST_UPDATE"). The last subscriber leaving does not end the PUBLISH (the publisher
  owns it). The publisher's PUBLISH_DONE is forwarded to every subscriber (after its Stream
  Count of data streams), then the relay FINs its half; the publisher cancelling the request
  or leaving ends the subscribers with PUBLISH_DONE INTERNAL_ERROR (GOING_AWAY after GOAWAY).
* A second PUBLISH of a track that already has an upstream (another PUBLISH, or a
  subscription the relay opened) is accepted and kept as a **standby**: its objects are not
  forwarded; it takes over (for new subscribers) when the current one ends. (The draft asks
  relays to merge and de-duplicate all publishers of a track; later work.)
* **SUBSCRIBE_TRACKS** (draft 18+, §"SUBSCRIBE_TRACKS"): REQUEST_OK, then one PUBLISH to the
  subscriber per track published (with PUBLISH) under the prefix, now and later, only those
  its principals may subscribe to. Each such PUBLISH is a subscriber of the track's fan-out
  (:class:`PushedSubscriber`); a REQUEST_ERROR answer (e.g. UNINTERESTED) drops it. Its
  FORWARD=0 is passed on in the PUBLISHes. A prefix overlapping another SUBSCRIBE_TRACKS of
  the same session → REQUEST_ERROR PREFIX_OVERLAP. Tracks reachable only through
  PUBLISH_NAMESPACE are not listed (the relay does not know their names).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvsp_moq.moqt.errors import PublishDoneCode, RequestErrorCode
from kvsp_moq.moqt.messages import MessageParameters, Publish, Subscribe, SubscribeTracks
from kvsp_moq.moqt.objects import ObjectDatagram, SubgroupHeader

from ..fetch.cache import TrackName
from ..ops.logs import event
from ..ops.names import format_namespace
from ..session.peer import NamespaceRequestHandler, PeerSession
from .publish_out import PushedSubscriber, UpstreamPublishing, push_publish
from .routing import is_prefix
from .upstream import UpstreamManager, UpstreamSubscription

if TYPE_CHECKING:  # pragma: no cover
    from ..ops.auth import Principal
    from ..ports import RelayContext

__all__ = ["PublishRegistry", "PublishedTrack", "PushedSubscriber", "TracksSubscription"]

Namespace = tuple[bytes, ...]


class PublishedTrack(UpstreamSubscription):
    """A publisher's PUBLISH, serving as the track's upstream subscription."""

    def __init__(self, registry: PublishRegistry, track: TrackName, peer: PeerSession,
                 rid: int, msg: Publish) -> None:
        super().__init__(registry.upstreams, track, peer)
        self.registry = registry
        self.request_id = rid
        self.established = True
        self.active = False
        self.forwarding = msg.parameters.forward is not False
        self._ignored: set[int] = set()
        self.track_properties = tuple(msg.track_properties)
        largest = msg.parameters.largest_object
        if largest is not None:
            self.fanout.largest = (largest.group, largest.object)
        self.fanout.want_forward = self.want_forward

    def activate(self) -> None:
        """Become the track's upstream (new SUBSCRIBEs join us)."""
        self.active = True
        self.manager.tracks[self.track] = self
        self.manager.cache.set_track_properties(self.track, self.track_properties)
        self.fanout.set_track_properties(self.track_properties)

    def start(self) -> None:  # the publisher started it
        raise RuntimeError("a PUBLISHed track is not subscribed upstream")

    # -- downstream side ---------------------------------------------------------------------
    def join(self, down: PeerSession, rid: int, msg: Subscribe) -> None:
        super().join(down, rid, msg)
        if msg.parameters.forward is not False:
            self.want_forward()

    def want_forward(self) -> None:
        """Ask a FORWARD=0 publisher to send objects (REQUEST_UPDATE FORWARD=1), once."""
        moqt = self.peer.moqt
        if self.forwarding or self.ended or moqt is None or moqt.closed \
                or self.request_id not in moqt.requests:
            return
        self.forwarding = True
        assert self.request_id is not None
        moqt.request_update(self.request_id, MessageParameters(forward=True))
        self.peer.flush()

    def on_empty(self) -> None:
        """The last subscriber left: the PUBLISH stays (the publisher owns it)."""

    # -- the publisher's side ----------------------------------------------------------------
    def on_data(self, stream_id: int, event: object) -> None:
        if not self.active or stream_id in self._ignored:
            if isinstance(event, SubgroupHeader):
                self._ignored.add(stream_id)
            return
        super().on_data(stream_id, event)

    def on_datagram(self, datagram: ObjectDatagram) -> None:
        if self.active:  # a standby's objects are not forwarded
            super().on_datagram(datagram)

    def on_stream_closed(self, stream_id: int, code: int | None) -> None:
        if stream_id in self._ignored:
            self._ignored.discard(stream_id)
            return
        super().on_stream_closed(stream_id, code)

    def on_finished(self) -> None:
        if self.done is None and not self.ended:
            self.end_all(PublishDoneCode.INTERNAL_ERROR,
                                 "publisher ended the PUBLISH without PUBLISH_DONE")

    def retire(self) -> None:
        first = not self.ended
        super().retire()
        if first:
            self.registry.removed(self)


class TracksSubscription(NamespaceRequestHandler):
    """A SUBSCRIBE_TRACKS we accepted."""

    def __init__(self, registry: PublishRegistry, peer: PeerSession, rid: int,
                 prefix: Namespace, principals: list[Principal], forward: bool) -> None:
        self.registry, self.peer, self.rid, self.prefix = registry, peer, rid, prefix
        self.principals = principals
        self.forward = forward

    def matches(self, track: PublishedTrack) -> bool:
        return (is_prefix(self.prefix, track.track[0]) and track.peer is not self.peer
                and self.registry.relay.gate.visible(self.principals, track.track[0])
                and not any(s.peer is self.peer for s in track.fanout.subscribers))

    def offer(self, track: PublishedTrack) -> None:
        """PUBLISH ``track`` to the subscriber and add it to the track's fan-out."""
        moqt = self.peer.moqt
        if moqt is None or moqt.closed or self.rid not in moqt.requests:
            self._leave()
            return
        if push_publish(self.registry.relay, self.peer, track, self.forward) is not None \
                and self.forward:
            track.want_forward()

    def _leave(self) -> None:
        self.registry.watchers = [w for w in self.registry.watchers if w is not self]

    def on_cancelled(self, code: int) -> None:
        self._leave()

    def on_session_closed(self, peer: PeerSession) -> None:
        self._leave()


class PublishRegistry:
    """Every PUBLISH the relay accepted, and the SUBSCRIBE_TRACKS watchers."""

    def __init__(self, relay: RelayContext, upstreams: UpstreamManager) -> None:
        self.relay = relay
        #: The relay's upstream subscriptions: a PUBLISH is the one of its track.
        self.upstreams = upstreams
        #: full track name → its PUBLISHes, the active one first.
        self.tracks: dict[TrackName, list[PublishedTrack]] = {}
        self.watchers: list[TracksSubscription] = []
        self.upstream = UpstreamPublishing(relay)

    def active(self, prefix: Namespace = ()) -> list[PublishedTrack]:
        return [pts[0] for t, pts in sorted(self.tracks.items())
                if pts and pts[0].active and is_prefix(prefix, t[0])]

    # -- PUBLISH -----------------------------------------------------------------------------
    def on_publish(self, peer: PeerSession, rid: int, msg: Publish) -> None:
        moqt = peer.moqt
        assert moqt is not None
        track: TrackName = (tuple(msg.track_namespace), bytes(msg.track_name))
        pt = PublishedTrack(self, track, peer, rid, msg)
        peer.served[rid] = pt
        moqt.request_ok(rid)
        peer.flush()
        event("publish", peer=peer.address, request_id=rid,
              namespace=format_namespace(track[0]),
              track=track[1].decode("utf-8", "backslashreplace"))
        self.tracks.setdefault(track, []).append(pt)
        if self.upstreams.get(track) is None:
            self._activate(pt)
        self.relay.emit("publish", pt)  # observers (tests, tools): a PUBLISH was accepted

    def _activate(self, pt: PublishedTrack) -> None:
        pt.activate()
        self.upstream.track_active(pt)  # chaining: PUBLISH it to the upstream relay
        # Held SUBSCRIBEs (RENDEZVOUS_TIMEOUT) proceed first; SUBSCRIBE_TRACKS watchers of
        # those sessions then get no PUBLISH (§"Publisher Interactions").
        self.relay.publisher_appeared(pt.track[0], pt.track[1])
        for w in list(self.watchers):
            if w.matches(pt):
                w.offer(pt)

    def removed(self, pt: PublishedTrack) -> None:
        """``pt`` ended (PUBLISH_DONE, cancelled, session gone): FIN our half, promote a
        standby."""
        pts = self.tracks.get(pt.track, [])
        if pt in pts:
            pts.remove(pt)
        pt.peer.served.pop(pt.request_id, None)  # type: ignore[arg-type]
        moqt = pt.peer.moqt
        if moqt is not None and not moqt.closed and pt.request_id is not None:
            moqt.finish_request(pt.request_id)
            pt.peer.flush()
        was_active, pt.active = pt.active, False
        while pts and was_active and self.upstreams.get(pt.track) is None:
            nxt = pts[0]
            if nxt.peer.is_open and not nxt.ended:
                self._activate(nxt)
                break
            pts.pop(0)
        if not pts:
            self.tracks.pop(pt.track, None)

    # -- SUBSCRIBE_TRACKS --------------------------------------------------------------------
    def on_subscribe_tracks(self, peer: PeerSession, rid: int, msg: SubscribeTracks,
                            principals: list[Principal]) -> None:
        moqt = peer.moqt
        assert moqt is not None
        prefix = tuple(msg.track_namespace_prefix)
        for w in self.watchers:
            if w.peer is peer and (is_prefix(w.prefix, prefix) or is_prefix(prefix, w.prefix)):
                moqt.reject(rid, RequestErrorCode.PREFIX_OVERLAP,
                            "overlaps another SUBSCRIBE_TRACKS of this session")
                peer.flush()
                return
        moqt.request_ok(rid)
        w = TracksSubscription(self, peer, rid, prefix, principals,
                               msg.parameters.forward is not False)
        peer.served[rid] = w
        self.watchers.append(w)
        peer.flush()
        for pt in self.active(prefix):
            if w.matches(pt):
                w.offer(pt)
