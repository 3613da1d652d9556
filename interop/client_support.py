"""What the interop test client needs beyond the public ``kvsp_moq.pubsub`` API.

``pubsub.Session`` has no call for withdrawing a PUBLISH_NAMESPACE, sending PUBLISH,
SUBSCRIBE_TRACKS or a draft-18 joining FETCH. The sans-IO session underneath
(``session.moqt``) does build those requests (or accepts a message to send), so these helpers
drive it directly and wait for the answer on the pubsub session's waiters. They use a few
private members of ``pubsub.Session`` (``_request``, ``_cancel``, ``_streams``, ``_serving``)
and of ``TrackPublisher`` (``_add``); a public API for them would retire this module.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

from kvsp_moq.moqt.messages import MessageParameters
from kvsp_moq.moqt.messages.fetch import FetchType, JoiningFetch
from kvsp_moq.moqt.messages.namespace import SubscribeTracks
from kvsp_moq.pubsub import Session, TrackPublisher
from kvsp_moq.pubsub.publish import _Outgoing, normalize_namespace
from kvsp_moq.pubsub.receive import FetchStream, Subscription
from kvsp_moq.pubsub.window import subscription_window
from kvsp_moq.transport import TransportConfig

Namespace = tuple[bytes, ...]


@dataclass(frozen=True)
class Target:
    """Where and how the test client connects."""

    url: str
    draft: int | None  # None: our default ALPN list
    insecure: bool

    def transport(self) -> TransportConfig:
        if self.draft is None:
            return TransportConfig(insecure=self.insecure)
        return TransportConfig(insecure=self.insecure, alpn_protocols=[f"moqt-{self.draft}"])


def ns(*fields: str) -> Namespace:
    return normalize_namespace(list(fields))


async def announce(session: Session, namespace: Namespace) -> int:
    """PUBLISH_NAMESPACE; the request ID once REQUEST_OK arrived (raises MoqtError)."""
    rid, _, _ = await session._request(lambda m: m.publish_namespace(namespace))
    return rid


def withdraw(session: Session, request_id: int) -> None:
    """Withdraw a namespace: cancel its request (draft 18+: no PUBLISH_NAMESPACE_DONE)."""
    session._cancel(request_id)


async def publish_track(session: Session, track: TrackPublisher, alias: int,
                        *, forward: bool = True) -> int:
    """PUBLISH ``track`` (§"PUBLISH"): on REQUEST_OK the track's writes go to this request as
    if it were a subscription with no filter. Returns the request ID."""
    params = MessageParameters(forward=forward)
    rid, _, _ = await session._request(
        lambda m: m.publish(track.namespace, track.name, alias, params))
    session._serving[rid] = track
    track._add(_Outgoing(session, rid, alias, window=subscription_window(None, track.largest)))
    return rid


def publish_done_now(session: Session, request_id: int, status: int, count: int) -> None:
    """PUBLISH_DONE on one of our PUBLISH requests."""
    session._publish_done(request_id, status, count, "track ended")


async def subscribe_tracks(session: Session, prefix: Namespace) -> int:
    """SUBSCRIBE_TRACKS (draft 18+): the peer PUBLISHes every track under ``prefix``; they
    arrive on ``session.incoming_publishes`` (connect with ``accept_publish=True``)."""
    moqt = session.moqt
    assert moqt is not None
    rid, _, _ = await session._request(
        lambda m: m._request(lambda r: SubscribeTracks(r, prefix, MessageParameters())))
    return rid


async def joining_fetch(session: Session, sub: Subscription, groups_back: int) -> FetchStream:
    """Draft-18 Relative Joining FETCH for ``sub``."""

    def make(rid: int) -> FetchStream:
        return FetchStream(session, rid)

    _, _, stream = await session._request(
        lambda m: m._request(lambda r: JoiningFetch(
            r, FetchType.RELATIVE_JOINING, sub.request_id, groups_back, MessageParameters())),
        make)
    assert isinstance(stream, FetchStream)
    return stream


async def next_update(session: Session, kinds: Sequence[str], timeout: float
                      ) -> tuple[str, Namespace] | None:
    """The next namespace update of one of ``kinds`` (None on timeout, a safety net)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        remaining = deadline - loop.time()
        if remaining <= 0:
            return None
        try:
            kind, value = await asyncio.wait_for(session.namespace_updates.get(), remaining)
        except asyncio.TimeoutError:
            return None
        if kind in kinds:
            return kind, value
