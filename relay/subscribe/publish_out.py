"""PUBLISHes the relay sends: to SUBSCRIBE_TRACKS subscribers, and up the relay chain.

Draft-22 §"Publisher Interactions": "Relays MUST forward PUBLISH_NAMESPACE or PUBLISH
messages to all matching subscribers", and "When a relay receives an incoming PUBLISH
message, it MUST send a PUBLISH request to each subscriber that has sent SUBSCRIBE_TRACKS
for the Track's namespace or a prefix thereof".

* :func:`push_publish`: one PUBLISH of a track to one session, as a subscriber of the
  track's fan-out (:class:`PushedSubscriber`): objects, datagrams, PUBLISH_DONE and its
  REQUEST_UPDATEs (FORWARD, SUBSCRIBER_PRIORITY, LOCATION_FILTER) like any subscriber; a
  REQUEST_ERROR answer (e.g. UNINTERESTED) drops it.
* :class:`UpstreamPublishing` (chaining, ``--upstream``): a track PUBLISHed to this relay by
  a downstream publisher is PUBLISHed once to the upstream relay, as announcements go up
  (:mod:`relay.subscribe.namespaces`), so a subscriber at the upstream relay, or at any relay below
  it, reaches the track (rack A ← publisher; datacenter D ← A; subscriber at D or at rack B
  under D). The upstream PUBLISH carries the publisher's Track Properties, LARGEST_OBJECT and
  Forward State: with FORWARD=0 the upstream relay's REQUEST_UPDATE FORWARD=1 (its first
  forwarding subscriber, §"Forward Handling") is passed on to the publisher. The publisher's
  PUBLISH_DONE goes up as the fan-out's PUBLISH_DONE. A PUBLISH that arrived from the
  upstream relay is never sent back up, nor a standby PUBLISH (only the active one of a
  track). If the upstream refuses it, or does not answer it within ``request_timeout``
  (the request is then cancelled, draft-22 §"Request Cancellation"), the track stays local
  (logged): its objects keep flowing to the local subscribers.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Protocol

from kvsp_moq.moqt.messages import Location, Message, MessageParameters, RequestError, RequestOk
from kvsp_moq.pubsub.window import subscription_window
from kvsp_moq.transport import ConnectError, TransportError

from ..fetch.cache import TrackName
from ..session.deadline import Deadline
from .fanout import Fanout, Subscriber
from ..ops.logs import event
from ..ops.names import format_namespace
from ..session.peer import PeerSession

if TYPE_CHECKING:  # pragma: no cover
    from ..ports import UpstreamLink

__all__ = ["Publication", "PushedSubscriber", "UpstreamPublishing", "push_publish"]

logger = logging.getLogger(__name__)


class Publication(Protocol):
    """A track PUBLISHed to the relay, as read here (:class:`relay.subscribe.publish_in.PublishedTrack`):
    its full track name, publisher session, fan-out and Track Properties; whether it is the
    active PUBLISH of its name, has ended, and its Forward State."""

    @property
    def track(self) -> TrackName: ...

    @property
    def peer(self) -> PeerSession: ...

    @property
    def fanout(self) -> Fanout: ...

    @property
    def track_properties(self) -> tuple[tuple[int, int | bytes], ...]: ...

    @property
    def active(self) -> bool: ...

    @property
    def ended(self) -> bool: ...

    @property
    def forwarding(self) -> bool: ...


class PushedSubscriber(Subscriber):
    """A PUBLISH the relay sent: a subscriber of the track's fan-out on a request the relay
    opened."""

    #: The PUBLISH_OK / REQUEST_ERROR must come before it expires (the PUBLISH up the relay
    #: chain: ``request_timeout``, relay/session/deadline.py); None: no bound.
    timer: Deadline | None = None

    def on_response(self, msg: Message) -> None:
        if self.timer is not None:
            self.timer.cancel()
        if isinstance(msg, RequestOk):  # PUBLISH_OK may carry SUBSCRIBER_PRIORITY, FORWARD
            self.apply(msg.parameters)
        elif isinstance(msg, RequestError):  # e.g. UNINTERESTED: stop sending it this track
            ns, name = self.fanout.track
            event("publish_refused", peer=self.peer.address, namespace=format_namespace(ns),
                  track=name.decode("utf-8", "backslashreplace"), code=msg.error_code,
                  reason=msg.error_reason)
            self._drop()

    def _drop(self) -> None:
        """Send it this track no more (the other subscribers of the fan-out keep it)."""
        if self.timer is not None:
            self.timer.cancel()
        self.ended = True
        self.out.abort()
        self.peer.local.pop(self.request_id, None)
        self.fanout.remove(self)

    def _timed_out(self) -> None:
        """No answer within the request timeout: cancel the PUBLISH (RESET_STREAM /
        STOP_SENDING CANCELLED) and treat it as refused."""
        if self.ended or self.peer.local.get(self.request_id) is not self:
            return
        ns, name = self.fanout.track
        event("publish_timeout", logging.WARNING, peer=self.peer.address,
              namespace=format_namespace(ns), track=name.decode("utf-8", "backslashreplace"),
              request_id=self.request_id)
        self.fanout.stats.upstream_timeouts += 1
        self._drop()
        moqt = self.peer.moqt
        if moqt is not None and not moqt.closed:
            moqt.cancel(self.request_id)
            self.peer.flush()
        self.fanout.emit("publish_timeout", self)

    def on_cancelled(self, code: int) -> None:
        if self.timer is not None:
            self.timer.cancel()
        super().on_cancelled(code)

    def on_session_closed(self, peer: PeerSession) -> None:
        if self.timer is not None:
            self.timer.cancel()
        super().on_session_closed(peer)

    def publish_done(self, status: int, reason: str) -> None:
        if self.timer is not None:
            self.timer.cancel()
        super().publish_done(status, reason)
        self.peer.local.pop(self.request_id, None)


def push_publish(relay: UpstreamLink, peer: PeerSession, track: Publication,
                 forward: bool, timeout: float | None = None) -> PushedSubscriber | None:
    """PUBLISH ``track`` on ``peer`` and add it to the track's fan-out (None if the session
    cannot take a request now). With ``timeout`` (seconds) the PUBLISH is cancelled and
    dropped as if refused when no answer came within it."""
    moqt = peer.moqt
    if moqt is None or moqt.closed:
        return None
    ns, name = track.track
    alias = peer.next_alias()
    largest = track.fanout.largest
    params = MessageParameters(
        forward=None if forward else False,
        largest_object=Location(*largest) if largest is not None else None)
    try:
        rid = moqt.publish(ns, name, alias, params, track.track_properties)
    except (RuntimeError, ValueError) as exc:  # e.g. the peer sent GOAWAY
        logger.warning("relay: cannot PUBLISH %s to %r: %s", format_namespace(ns), peer, exc)
        return None
    sub = PushedSubscriber(track.fanout, peer, rid, alias, subscription_window(None, largest),
                           relay.config.subscriber_queue_bytes)
    sub.forward = forward  # our PUBLISH says FORWARD=0 then (§"Forward State")
    peer.local[rid] = sub
    track.fanout.add(sub)
    if timeout is not None:
        sub.timer = Deadline(timeout, sub._timed_out)
        sub.timer.arm()
    peer.flush()
    return sub


class UpstreamPublishing:
    """PUBLISHes of downstream publishers, sent on to the upstream relay."""

    def __init__(self, relay: UpstreamLink) -> None:
        self.relay = relay

    def track_active(self, track: Publication) -> None:
        """``track`` became the active PUBLISH of its full track name here."""
        relay = self.relay
        if not relay.config.upstream or track.peer.upstream or relay.closing:
            return
        relay.spawn(self._publish_up(track))

    def republish(self, tracks: Iterable[Publication], up: PeerSession) -> None:
        """A new upstream session ``up`` (after a loss, or a GOAWAY move: draft-22
        §"Graceful Publisher Relay Switchover", "The publisher sends PUBLISH_NAMESPACE and/or
        PUBLISH messages to begin publishing on the new Session"): each active track of a
        downstream publisher that ``up`` does not carry yet is PUBLISHed there again. A
        PUBLISH still on an old session goes on until that session ends."""
        for track in tracks:
            if not any(s.peer is up for s in track.fanout.subscribers):
                self.track_active(track)

    async def _publish_up(self, track: Publication) -> None:
        relay = self.relay
        try:
            up = await relay.upstream_peer()
        except (ConnectError, TransportError, OSError, asyncio.TimeoutError,
                ConnectionError) as exc:
            logger.warning("relay: upstream %s unreachable, PUBLISH stays local: %s",
                           relay.config.upstream, exc)
            return
        if up is None or up is track.peer or not track.active or track.ended:
            return
        sub = push_publish(relay, up, track, track.forwarding, relay.config.request_timeout)
        if sub is None:
            return
        relay.stats.upstream_publishes += 1
        ns, name = track.track
        event("upstream_publish", namespace=format_namespace(ns),
              track=name.decode("utf-8", "backslashreplace"), request_id=sub.request_id,
              upstream=up.address)
