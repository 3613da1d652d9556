"""Request bookkeeping of the MOQT session: Request IDs and one request stream's state.

Draft-18+ §"Request ID" / moqt-reference §2.6: the client's Request IDs are even, the
server's odd, each +2 per request; SUBSCRIBE, PUBLISH, FETCH, TRACK_STATUS,
PUBLISH_NAMESPACE, SUBSCRIBE_NAMESPACE, SUBSCRIBE_TRACKS and REQUEST_UPDATE consume one.
A Request ID of the wrong parity, or one used before → INVALID_REQUEST_ID. Responses carry
no Request ID: they ride the request's bidirectional stream (§"Request Streams").

The IDs the peer used are a :class:`~.rangeset.RangeSet` over ``request_id >> 1`` (one ID
space per parity): a watermark and a range per run above a gap, so a session that has seen
100,000 requests holds one range, not 100,000 entries.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from ..wire.errors import SessionErrorCode, WireError
from .messages import (
    FETCH_TYPE,
    PUBLISH_NAMESPACE_TYPE,
    PUBLISH_TYPE,
    SUBSCRIBE_NAMESPACE_TYPE,
    SUBSCRIBE_TRACKS_TYPE,
    SUBSCRIBE_TYPE,
    TRACK_STATUS_TYPE,
    ControlStreamReader,
    FetchOk,
    Message,
    ParamContext,
    RequestError,
    RequestOk,
    SubscribeOk,
)
from .rangeset import RangeSet

__all__ = ["INITIAL_RESPONSES", "OK_CONTEXT", "Request", "RequestIdAllocator", "RequestIdChecker"]

#: The messages that may be the first response to each request (§"Request Streams",
#: §"REQUEST_OK": "Exactly one OK/ERROR per request").
INITIAL_RESPONSES: dict[int, tuple[type[Message], ...]] = {
    SUBSCRIBE_TYPE: (SubscribeOk, RequestError),
    FETCH_TYPE: (FetchOk, RequestError),
    PUBLISH_TYPE: (RequestOk, RequestError),
    TRACK_STATUS_TYPE: (RequestOk, RequestError),
    PUBLISH_NAMESPACE_TYPE: (RequestOk, RequestError),
    SUBSCRIBE_NAMESPACE_TYPE: (RequestOk, RequestError),
    SUBSCRIBE_TRACKS_TYPE: (RequestOk, RequestError),
}

#: The parameter context of a REQUEST_OK answering each request (its alias name).
OK_CONTEXT: dict[int, ParamContext] = {
    PUBLISH_TYPE: ParamContext.PUBLISH_OK,
    TRACK_STATUS_TYPE: ParamContext.TRACK_STATUS_OK,
    PUBLISH_NAMESPACE_TYPE: ParamContext.PUBLISH_NAMESPACE_OK,
    SUBSCRIBE_NAMESPACE_TYPE: ParamContext.SUBSCRIBE_NAMESPACE_OK,
    SUBSCRIBE_TRACKS_TYPE: ParamContext.SUBSCRIBE_TRACKS_OK,
}


class RequestIdAllocator:
    """Our Request IDs: 0, 2, 4, ... for a client, 1, 3, 5, ... for a server."""

    __slots__ = ("_next",)

    def __init__(self, is_client: bool) -> None:
        self._next = 0 if is_client else 1

    @property
    def next_id(self) -> int:
        """The ID :meth:`allocate` returns next."""
        return self._next

    def allocate(self) -> int:
        rid = self._next
        self._next += 2
        return rid

    def allocated(self, request_id: int) -> bool:
        """True if ``request_id`` is one of ours already handed out."""
        return request_id & 1 == self._next & 1 and request_id < self._next


class RequestIdChecker:
    """Checks the peer's Request IDs: parity and no reuse (INVALID_REQUEST_ID).

    ``max_gaps`` bounds the range set of used IDs (:meth:`RangeSet.fill_gaps`): IDs the peer
    skipped beyond that many gaps count as used."""

    __slots__ = ("_parity", "_seen", "_max_gaps")

    def __init__(self, peer_is_client: bool, max_gaps: int = 4096) -> None:
        self._parity = 0 if peer_is_client else 1
        self._seen = RangeSet()
        self._max_gaps = max_gaps

    def check(self, request_id: int) -> None:
        if request_id & 1 != self._parity:
            raise WireError(SessionErrorCode.INVALID_REQUEST_ID,
                            f"Request ID {request_id} has the wrong parity")
        index = request_id >> 1
        if index in self._seen:
            raise WireError(SessionErrorCode.INVALID_REQUEST_ID,
                            f"Request ID {request_id} used twice")
        self._seen.add(index)
        self._seen.fill_gaps(self._max_gaps + 1)

    def used(self, request_id: int) -> bool:
        """True if the peer already used ``request_id``."""
        return request_id & 1 == self._parity and (request_id >> 1) in self._seen

    def __len__(self) -> int:
        """Ranges held (the size of this structure)."""
        return len(self._seen)


@dataclass(eq=False)
class Request:
    """One request and its bidirectional stream."""

    request_id: int
    stream_id: int
    request_type: int
    message: Message
    #: True when we sent the request (we are the requester).
    local: bool
    reader: ControlStreamReader
    #: The first response was sent (remote request) or received (local request).
    responded: bool = False
    #: The response was REQUEST_ERROR: the request is over.
    failed: bool = False
    #: Our REQUEST_UPDATE IDs waiting for REQUEST_OK / REQUEST_ERROR, oldest first.
    pending_updates: deque[int] = field(default_factory=deque)
    #: REQUEST_UPDATEs the peer sent on this stream (MAX_REQUEST_UPDATES, draft 19+).
    updates_received: int = 0
    goaway_received: bool = False
    recv_finished: bool = False
    send_finished: bool = False
    #: Track Alias of a subscription (SUBSCRIBE_OK or PUBLISH), for data routing.
    track_alias: int | None = None
    #: Outgoing data streams of this request (we publish).
    data_streams: set[int] = field(default_factory=set)
