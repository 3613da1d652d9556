"""What the interop test client needs beyond ``kvsp_moq.pubsub``'s request calls: thin
helpers over its public API (PUBLISH_NAMESPACE and its withdrawal, PUBLISH, PUBLISH_DONE,
SUBSCRIBE_TRACKS, the draft-18 joining FETCH) and a bounded wait for namespace updates.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

from kvsp_moq.pubsub import FetchStream, MoqtSession, Subscription, TrackPublisher
from kvsp_moq.pubsub.publish import normalize_namespace
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


async def announce(session: MoqtSession, namespace: Namespace) -> int:
    """PUBLISH_NAMESPACE; the request ID once REQUEST_OK arrived (raises MoqtError)."""
    return await session.publish_namespace(namespace)


def withdraw(session: MoqtSession, request_id: int) -> None:
    """Withdraw a namespace: cancel its request (draft 18+: no PUBLISH_NAMESPACE_DONE)."""
    session.cancel_request(request_id)


async def publish_track(session: MoqtSession, track: TrackPublisher, alias: int,
                        *, forward: bool = True) -> int:
    """PUBLISH ``track`` (§"PUBLISH"): on REQUEST_OK the track's writes go to this request as
    if it were a subscription with no filter. Returns the request ID."""
    return await session.publish(track, forward=forward, track_alias=alias)


def publish_done_now(session: MoqtSession, request_id: int, status: int, count: int = 0) -> None:
    """PUBLISH_DONE on one of our PUBLISH requests (with its exact Stream Count, which
    ``count`` is expected to equal)."""
    session.end_publish(request_id, status, "track ended")


async def subscribe_tracks(session: MoqtSession, prefix: Namespace) -> int:
    """SUBSCRIBE_TRACKS (draft 18+): the peer PUBLISHes every track under ``prefix``; they
    arrive on ``session.incoming_publishes`` (connect with ``accept_publish=True``)."""
    return await session.subscribe_tracks(prefix)


async def joining_fetch(session: MoqtSession, sub: Subscription, groups_back: int) -> FetchStream:
    """Draft-18 Relative Joining FETCH for ``sub``."""
    return await session.joining_fetch(sub, groups_back)


async def next_update(session: MoqtSession, kinds: Sequence[str], timeout: float
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
