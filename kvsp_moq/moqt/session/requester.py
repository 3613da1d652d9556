"""The requests a session sends (draft-ietf-moq-transport-22 §"Request Streams"): the local
API of :class:`~.machine.SessionMachine` that builds each request message. The machine's
``_request`` allocates the Request ID, opens the stream and sends it."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from ...wire.kvp import KeyValuePair
from ..messages import (
    Fetch,
    FetchType,
    JoiningFetch,
    Location,
    LocationFilter,
    Message,
    MessageParameters,
    Publish,
    PublishNamespace,
    StandaloneFetch,
    Subscribe,
    SubscribeNamespace,
    SubscribeTracks,
    TrackStatus,
)
from ..version import Version

__all__ = ["RequestApi", "kvps"]


def kvps(pairs: Sequence[tuple[int, int | bytes]]) -> tuple[KeyValuePair, ...]:
    """Track Properties as the message fields hold them."""
    return tuple(KeyValuePair(*kv) for kv in pairs)


def _with(params: MessageParameters, **changes: object) -> MessageParameters:
    return dataclasses.replace(params, **changes)  # type: ignore[arg-type]


class RequestApi:
    """SUBSCRIBE, FETCH, PUBLISH, ... of the local API; each returns the Request ID."""

    version: Version

    def _request(self, build: Callable[[int], Message]) -> int:  # pragma: no cover
        raise NotImplementedError

    def subscribe(self, namespace: Sequence[bytes], name: bytes,
                  parameters: MessageParameters = MessageParameters()) -> int:
        return self._request(lambda rid: Subscribe(rid, tuple(namespace), name, parameters))

    def fetch(self, namespace: Sequence[bytes], name: bytes, start: tuple[int, int],
              end: tuple[int, int] | None = None, *,
              parameters: MessageParameters = MessageParameters()) -> int:
        """FETCH objects ``start`` .. ``end`` inclusive (``end`` None: to the largest
        object; ``end.object`` None-like whole group is not expressible here)."""
        start = Location(*start)
        if self.version.fetch_has_fetch_type:
            # Draft 18: End Location is "the end Location, plus 1" (§"FETCH").
            stop = Location((1 << 62) - 1, 0) if end is None else Location(end[0], end[1] + 1)

            def build(rid: int) -> Message:
                return StandaloneFetch(rid, tuple(namespace), name, start, stop, parameters)
        else:
            if end is None and start == (0, 0):
                # "FETCH without filter = {0,0}..Largest Object"; drafts 20/21 cannot even
                # write an absolute start of {0,0} (two zero fields mean Next Object).
                params = parameters
            else:
                flt = (LocationFilter.absolute(start) if end is None
                       else LocationFilter.absolute(start, end[0], end[1]))
                params = _with(parameters, location_filter=flt)

            def build(rid: int) -> Message:
                return Fetch(rid, tuple(namespace), name, params)
        return self._request(build)

    def publish_namespace(self, namespace: Sequence[bytes],
                          parameters: MessageParameters = MessageParameters()) -> int:
        return self._request(lambda rid: PublishNamespace(rid, tuple(namespace), parameters))

    def subscribe_namespace(self, prefix: Sequence[bytes],
                            parameters: MessageParameters = MessageParameters()) -> int:
        return self._request(lambda rid: SubscribeNamespace(rid, tuple(prefix), parameters))

    def track_status(self, namespace: Sequence[bytes], name: bytes,
                     parameters: MessageParameters = MessageParameters()) -> int:
        return self._request(lambda rid: TrackStatus(rid, tuple(namespace), name, parameters))

    def subscribe_tracks(self, prefix: Sequence[bytes],
                         parameters: MessageParameters = MessageParameters()) -> int:
        """SUBSCRIBE_TRACKS (draft 18+, §"SUBSCRIBE_TRACKS"): the peer PUBLISHes every track
        under ``prefix``, now and later."""
        return self._request(lambda rid: SubscribeTracks(rid, tuple(prefix), parameters))

    def joining_fetch(self, subscribe_request_id: int, joining_start: int, *,
                      absolute: bool = False,
                      parameters: MessageParameters = MessageParameters()) -> int:
        """Draft-18 Joining FETCH (§"Joining Fetches") of our subscription
        ``subscribe_request_id``: Relative (``joining_start`` groups before its Joining
        Location) or Absolute (from group ``joining_start``). Removed in draft 20 (fill
        fetch streams replace it): ValueError on other versions."""
        if not self.version.fetch_has_fetch_type:
            raise ValueError(f"{self.version.name} has no Joining FETCH (use FILL_PARAMETERS)")
        kind = FetchType.ABSOLUTE_JOINING if absolute else FetchType.RELATIVE_JOINING
        return self._request(lambda rid: JoiningFetch(rid, kind, subscribe_request_id,
                                                      joining_start, parameters))

    def publish(self, namespace: Sequence[bytes], name: bytes, track_alias: int,
                parameters: MessageParameters = MessageParameters(),
                track_properties: Sequence[tuple[int, int | bytes]] = ()) -> int:
        return self._request(lambda rid: Publish(rid, tuple(namespace), name, track_alias,
                                                 parameters, kvps(track_properties)))
