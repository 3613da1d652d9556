"""Answering the peer's REQUEST_UPDATEs on the requests a pubsub session serves.

Draft-22 §"REQUEST_UPDATE": "The receiver of a REQUEST_UPDATE MUST respond with exactly one
REQUEST_OK or REQUEST_ERROR". What an update changes (§"Updating Subscriptions"):

* a subscription we publish (the peer's SUBSCRIBE, or our PUBLISH): FORWARD (0: no new
  objects until 1, §"FORWARD"), SUBSCRIBER_PRIORITY (kept; this layer sends each object
  at once, so it ranks nothing), LOCATION_FILTER (the window is recomputed against the
  Largest Object). Answered REQUEST_OK with LARGEST_OBJECT. A filter whose end precedes its
  start is refused: REQUEST_ERROR INVALID_RANGE without ending the request, then PUBLISH_DONE
  UPDATE_FAILED ("When a REQUEST_UPDATE is unsuccessful, the publisher MUST also terminate
  the subscription by sending a PUBLISH_DONE with error code UPDATE_FAILED");
* any other request (a FETCH being served, PUBLISH_NAMESPACE, SUBSCRIBE_NAMESPACE): nothing
  here depends on the updated values, so REQUEST_OK.
"""

from __future__ import annotations

from ..moqt.errors import PublishDoneCode, RequestErrorCode
from ..moqt.messages import Location, Message, MessageParameters, RequestUpdate
from .ports import ServingSession
from .publish import TrackPublisher
from .window import subscription_window

__all__ = ["answer_update"]


def answer_update(session: ServingSession, track: TrackPublisher | None, request_id: int,
                  msg: Message) -> None:
    """Apply the peer's REQUEST_UPDATE ``msg`` on our request ``request_id`` and answer it;
    ``track``: the track that request serves on ``session`` (None: not a subscription we
    publish, see :meth:`~.catalog_server.CatalogServer.served`)."""
    moqt = session.moqt
    if moqt is None or moqt.closed or request_id not in moqt.requests:
        return
    if not isinstance(msg, RequestUpdate):
        return
    out = track.outgoing(session, request_id) if track is not None else None
    if track is None or out is None:
        moqt.request_ok(request_id)
        return
    p = msg.parameters
    if p.location_filter is not None:
        window = subscription_window(p.location_filter, track.largest)
        if window.empty:
            moqt.reject(request_id, RequestErrorCode.INVALID_RANGE,
                        "the filter's end precedes its start", end=False)
            track.complete_soon(out, PublishDoneCode.UPDATE_FAILED, "REQUEST_UPDATE failed")
            return
        out.window = window
    if p.forward is not None:
        out.forward = p.forward
        track.forward_changed()
    if p.subscriber_priority is not None:
        out.subscriber_priority = p.subscriber_priority
    largest = track.largest
    moqt.request_ok(request_id, MessageParameters(
        largest_object=Location(*largest) if largest is not None else None))
    if largest is not None and out.window.passed(*largest):
        track.complete_soon(out)
