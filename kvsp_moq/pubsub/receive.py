"""Receiving objects: :class:`Subscription` and :class:`FetchStream` (both :class:`ObjectStream`).

Payload bytes are copied exactly once, from the QUIC receive buffer into their destination:
either a buffer the application hands out from :attr:`ObjectStream.on_object_begin` (a
writable memoryview of the object's declared length), or, without that callback, a
``bytearray`` allocated here and given to the application in :class:`ReceivedObject`.
:class:`ReceiveStats` counts the payload bytes this layer holds (``buffered_bytes``; its peak
in ``peak_buffered_bytes``): zero on the callback path.

What the peer declares never decides what is allocated (:mod:`.limits`): a library-allocated
payload is allocated whole only up to ``ReceiveLimits.preallocate`` octets and otherwise
grows as its bytes arrive; an object over ``max_object_size``, or a request holding more than
``max_buffered_bytes`` / ``max_queued_objects`` unread, has its data stream stopped with
EXCESSIVE_LOAD (draft-ietf-moq-transport-22 §"Resource Exhaustion"). ``on_object_begin`` may
also answer :data:`DISCARD` (the payload is skipped without being stored: the object is
delivered with ``discarded=True`` and no payload) or a :class:`Refuse` (the data stream is
stopped with its code; a FETCH then fails with it).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Final

from ..moqt.messages import (
    FetchOk,
    LocationFilter,
    Message,
    MessageParameters,
    PublishDone,
    SubscribeOk,
)
from ..moqt.objects import ObjectBegin, ObjectDatagram, ObjectEnd, ObjectPayload, ObjectStatus
from ..wire.errors import StreamResetCode
from ..wire.kvp import KeyValuePair
from .errors import ErrorKind, MoqtError
from .limits import DEFAULT_RECEIVE_LIMITS, ReceiveLimits
from .ports import RequestOwner

__all__ = ["DISCARD", "Discard", "FetchStream", "ObjectStream", "ReceiveStats", "ReceivedObject",
           "Refuse", "Subscription"]

logger = logging.getLogger(__name__)


class Discard:
    """The type of :data:`DISCARD`."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "DISCARD"


#: ``on_object_begin`` answer: nobody keeps this object; its payload octets are skipped as
#: they arrive (nothing is allocated) and it is delivered with ``discarded=True``.
DISCARD: Final = Discard()


@dataclass(frozen=True, slots=True)
class Refuse:
    """``on_object_begin`` answer: stop the object's data stream (STOP_SENDING ``code``,
    draft-ietf-moq-transport-22 §"Stream Reset Error Codes"); a FETCH fails with
    ``MoqtError(code, reason)``."""

    code: int = StreamResetCode.CANCELLED
    reason: str = "object refused"


#: ``on_object_begin(info)`` returns where the payload goes (len == info.payload_length),
#: None to let the library allocate a bytearray (bounded by :class:`ReceiveLimits`),
#: :data:`DISCARD` or a :class:`Refuse`.
ObjectBeginCallback = Callable[[ObjectBegin], "memoryview | bytearray | Discard | Refuse | None"]
#: ``on_object_progress(info, n)``: the next ``n`` payload octets of the object ``info`` were
#: just written into its destination (after the one copy), e.g. to hash incrementally.
ObjectProgressCallback = Callable[[ObjectBegin, int], object]


@dataclass(frozen=True, slots=True)
class ReceivedObject:
    group_id: int
    #: None for an object whose Forwarding Preference is Datagram.
    subgroup_id: int | None
    object_id: int
    status: ObjectStatus
    properties: tuple[KeyValuePair, ...]
    #: The payload: the caller's buffer (callback path) or a bytearray.
    payload: memoryview | bytearray
    publisher_priority: int | None = None
    #: The END_OF_GROUP flag of an OBJECT_DATAGRAM (§"Object Datagram").
    end_of_group: bool = False
    #: ``on_object_begin`` answered :data:`DISCARD`: the payload was skipped (empty here).
    discarded: bool = False


@dataclass
class ReceiveStats:
    objects: int = 0
    payload_bytes: int = 0
    #: Payload bytes held by this layer (allocated here, not yet taken by the consumer).
    buffered_bytes: int = 0
    peak_buffered_bytes: int = 0
    data_streams: int = 0
    #: Objects whose payload was skipped (:data:`DISCARD`) and their payload octets.
    discarded_objects: int = 0
    discarded_bytes: int = 0
    #: Data streams this side stopped (a :class:`Refuse`, or a :class:`ReceiveLimits` bound).
    stopped_streams: int = 0
    #: OBJECT_DATAGRAMs dropped because a bound was reached.
    dropped_datagrams: int = 0


@dataclass(eq=False)
class _Current:
    begin: ObjectBegin
    #: Where the payload is written at ``pos``; None: into ``owned`` as it grows (or skipped).
    dest: memoryview | None
    owned: bytearray | None
    pos: int = 0
    discard: bool = False
    #: Octets of this object counted in ``ReceiveStats.buffered_bytes``.
    counted: int = 0


_END = object()


class ObjectStream:
    """Objects of one subscription or fetch, as an async iterator of :class:`ReceivedObject`."""

    def __init__(self, session: RequestOwner, request_id: int,
                 limits: ReceiveLimits = DEFAULT_RECEIVE_LIMITS) -> None:
        self.session = session
        self.request_id = request_id
        self.limits = limits
        self.on_object_begin: ObjectBeginCallback | None = None
        self.on_object_progress: ObjectProgressCallback | None = None
        self.stats = ReceiveStats()
        self.response: Message | None = None
        self._queue: asyncio.Queue[object] = asyncio.Queue()
        #: Objects in ``_queue`` not yet taken by the consumer.
        self._queued = 0
        self._current: dict[int, _Current] = {}
        self._open_streams: set[int] = set()
        #: Data streams we stopped, until their DataStreamClosed: (code, reason).
        self._stopped: dict[int, tuple[int, str]] = {}
        self._done = False
        self.error: MoqtError | None = None

    # -- consumer --------------------------------------------------------------------------
    def __aiter__(self) -> ObjectStream:
        return self

    async def __anext__(self) -> ReceivedObject:
        item = await self._queue.get()
        if item is _END:
            self._queue.put_nowait(_END)  # stay ended
            if self.error is not None:
                raise self.error
            raise StopAsyncIteration
        assert isinstance(item, ReceivedObject)
        self._queued -= 1
        if isinstance(item.payload, bytearray):
            self.stats.buffered_bytes -= len(item.payload)
        return item

    async def collect(self) -> list[ReceivedObject]:
        return [obj async for obj in self]

    @property
    def done(self) -> bool:
        return self._done

    def update(self, *, subscriber_priority: int | None = None,
               forward: bool | None = None,
               location_filter: LocationFilter | None = None,
               parameters: MessageParameters | None = None) -> asyncio.Future[Message]:
        """REQUEST_UPDATE on this request (§"REQUEST_UPDATE"), sent at once (before this
        returns); await the result for the REQUEST_OK (its ``parameters.largest_object`` is
        the Largest Object, §"Updating Subscriptions"), or a :class:`MoqtError` with the
        REQUEST_ERROR's code (a failed subscription update is then ended by the publisher
        with PUBLISH_DONE UPDATE_FAILED). Parameters not given stay as they are ("There is
        no mechanism to remove a parameter"). ``parameters`` carries any other update
        parameter (e.g. AUTHORIZATION_TOKEN); the keywords override it. A subscription may
        change SUBSCRIBER_PRIORITY, FORWARD and LOCATION_FILTER, a FETCH its
        SUBSCRIBER_PRIORITY; a parameter the request cannot take raises
        :class:`~kvsp_moq.wire.errors.WireError` before anything is sent."""
        changes: dict[str, object] = {}
        if subscriber_priority is not None:
            changes["subscriber_priority"] = subscriber_priority
        if forward is not None:
            changes["forward"] = forward
        if location_filter is not None:
            changes["location_filter"] = location_filter
        return self.session.update_request(
            self.request_id, replace(parameters or MessageParameters(), **changes))  # type: ignore[arg-type]

    # -- fed by the session ----------------------------------------------------------------
    def feed_data(self, stream_id: int, ev: object) -> None:
        if stream_id in self._stopped:
            return  # events of a stream we stopped, parsed before the stop
        if isinstance(ev, ObjectPayload):
            cur = self._current[stream_id]
            n = len(ev.data)
            self.stats.payload_bytes += n
            if cur.discard:
                self.stats.discarded_bytes += n
                return
            if cur.dest is None:
                assert cur.owned is not None
                if not self._reserve(n):
                    self._stop(stream_id, StreamResetCode.EXCESSIVE_LOAD,
                               f"more than max_buffered_bytes={self.limits.max_buffered_bytes}"
                               " octets held unread")
                    return
                cur.owned += ev.data  # the one copy; grows only with what arrived
                cur.counted += n
            else:
                cur.dest[cur.pos:cur.pos + n] = ev.data  # the one copy of the payload
            cur.pos += n
            if self.on_object_progress is not None and n:
                self.on_object_progress(cur.begin, n)
        elif isinstance(ev, ObjectBegin):
            self._begin(stream_id, ev)
        elif isinstance(ev, ObjectEnd):
            cur = self._current.pop(stream_id)
            b = cur.begin
            payload: memoryview | bytearray
            if cur.discard:
                payload = memoryview(b"")
                self.stats.discarded_objects += 1
            elif cur.owned is not None:
                payload = cur.owned
            else:
                assert cur.dest is not None
                payload = cur.dest[:b.payload_length]
            self.stats.objects += 1
            self._put(ReceivedObject(b.group_id, b.subgroup_id, b.object_id, b.status,
                                     b.properties, payload, b.publisher_priority,
                                     discarded=cur.discard))
        else:  # SubgroupHeader / FetchHeader: a new data stream
            if stream_id not in self._open_streams:
                self._open_streams.add(stream_id)
                self.stats.data_streams += 1

    def _begin(self, stream_id: int, ev: ObjectBegin) -> None:
        """An object header: decide where its payload goes (:mod:`.limits`)."""
        limits = self.limits
        if self._queued + len(self._current) >= limits.max_queued_objects:
            self._stop(stream_id, StreamResetCode.EXCESSIVE_LOAD,
                       f"more than max_queued_objects={limits.max_queued_objects} objects"
                       " held unread")
            return
        dest = self.on_object_begin(ev) if self.on_object_begin is not None else None
        if isinstance(dest, Refuse):
            self._stop(stream_id, dest.code, dest.reason)
            return
        if isinstance(dest, Discard):
            self._current[stream_id] = _Current(ev, None, None, discard=True)
            return
        if dest is not None:
            view = dest if isinstance(dest, memoryview) else memoryview(dest)
            if len(view) < ev.payload_length:
                raise ValueError("on_object_begin returned a buffer shorter than the payload")
            self._current[stream_id] = _Current(ev, view, None)
            return
        length = ev.payload_length
        if length > limits.max_object_size:
            self._stop(stream_id, StreamResetCode.EXCESSIVE_LOAD,
                       f"object of {length} octets exceeds max_object_size="
                       f"{limits.max_object_size}")
            return
        whole = length <= limits.preallocate
        if whole and not self._reserve(length):
            self._stop(stream_id, StreamResetCode.EXCESSIVE_LOAD,
                       f"more than max_buffered_bytes={limits.max_buffered_bytes}"
                       " octets held unread")
            return
        if whole:
            owned = bytearray(length)
            self._current[stream_id] = _Current(ev, memoryview(owned), owned, counted=length)
        else:  # grown as the octets arrive: the declared length is only a claim
            self._current[stream_id] = _Current(ev, None, bytearray())

    def _reserve(self, n: int) -> bool:
        """Count ``n`` more octets held here, if the budget allows."""
        held = self.stats.buffered_bytes + n
        if held > self.limits.max_buffered_bytes:
            return False
        self.stats.buffered_bytes = held
        self.stats.peak_buffered_bytes = max(self.stats.peak_buffered_bytes, held)
        return True

    def _put(self, obj: ReceivedObject) -> None:
        self._queued += 1
        self._queue.put_nowait(obj)

    def _stop(self, stream_id: int, code: int, reason: str) -> None:
        """Stop one data stream of the peer (draft-ietf-moq-transport-22 §"Resource
        Exhaustion": "MUST cancel a stream ... after reaching a resource limit"): its object
        in progress is dropped, its later events ignored; its DataStreamClosed follows."""
        cur = self._current.pop(stream_id, None)
        if cur is not None:
            self.stats.buffered_bytes -= cur.counted
        self._stopped[stream_id] = (code, reason)
        self.stats.stopped_streams += 1
        logger.warning("request %d: data stream %d stopped (0x%x): %s", self.request_id,
                       stream_id, code, reason)
        self.session.stop_data_stream(stream_id, code)

    def feed_datagram(self, dg: ObjectDatagram) -> None:
        """An OBJECT_DATAGRAM of this subscription: one whole object, its payload copied once
        into its destination (``on_object_begin``'s buffer, or a bytearray). Dropped when a
        :class:`ReceiveLimits` bound is reached (datagrams are unreliable) or when
        ``on_object_begin`` answers :data:`DISCARD` / :class:`Refuse`."""
        if self._done:
            return
        if self._queued >= self.limits.max_queued_objects:
            self.stats.dropped_datagrams += 1
            return
        begin = ObjectBegin(dg.group_id, None, dg.object_id, dg.publisher_priority, dg.status,
                            len(dg.payload), dg.properties, dg.raw_properties)
        dest = self.on_object_begin(begin) if self.on_object_begin is not None else None
        n = len(dg.payload)
        if isinstance(dest, Discard | Refuse):
            self.stats.dropped_datagrams += 1
            return
        if dest is None:
            if n > self.limits.max_object_size or not self._reserve(n):
                self.stats.dropped_datagrams += 1
                return
            payload: memoryview | bytearray = bytearray(dg.payload)
        else:
            view = dest if isinstance(dest, memoryview) else memoryview(dest)
            if len(view) < n:
                raise ValueError("on_object_begin returned a buffer shorter than the payload")
            view[:n] = dg.payload
            payload = view[:n]
        self.stats.payload_bytes += n
        self.stats.objects += 1
        if self.on_object_progress is not None and n:
            self.on_object_progress(begin, n)
        self._put(ReceivedObject(dg.group_id, None, dg.object_id, dg.status, dg.properties,
                                 payload, dg.publisher_priority, dg.end_of_group))

    def feed_stream_closed(self, stream_id: int, error_code: int | None) -> None:
        self._open_streams.discard(stream_id)
        cur = self._current.pop(stream_id, None)
        if cur is not None:
            self.stats.buffered_bytes -= cur.counted
        self._stopped.pop(stream_id, None)
        self._check_done()

    def stop_reason(self, stream_id: int) -> tuple[int, str] | None:
        """``(code, reason)`` if this side stopped data stream ``stream_id`` (until its
        close is fed)."""
        return self._stopped.get(stream_id)

    def feed_response(self, msg: Message) -> None:
        self.response = msg

    def _check_done(self) -> None:  # pragma: no cover - overridden
        pass

    def feed_end(self, error: MoqtError | None = None) -> None:
        if self._done:
            return
        self._done = True
        if error is not None and self.error is None:
            self.error = error
        self._queue.put_nowait(_END)
        self.session.stream_finished(self.request_id)

    def feed_cancelled(self, code: int) -> None:
        self.feed_end(MoqtError(code, "request cancelled by the peer", ErrorKind.STREAM))


class Subscription(ObjectStream):
    """A SUBSCRIBE that was accepted; iterate it for objects. Ends after PUBLISH_DONE once
    all its data streams (PUBLISH_DONE's Stream Count) have ended."""

    def __init__(self, session: RequestOwner, request_id: int,
                 limits: ReceiveLimits = DEFAULT_RECEIVE_LIMITS) -> None:
        super().__init__(session, request_id, limits)
        self.publish_done: PublishDone | None = None

    @property
    def track_alias(self) -> int | None:
        return self.response.track_alias if isinstance(self.response, SubscribeOk) else None

    def feed_publish_done(self, msg: PublishDone) -> None:
        self.publish_done = msg
        self._check_done()

    def _check_done(self) -> None:
        done = self.publish_done
        if done is None or self._open_streams:
            return
        if done.stream_count < (1 << 62) - 1 and self.stats.data_streams < done.stream_count:
            return  # some data streams have not arrived yet
        self.feed_end()

    async def cancel(self) -> None:
        """Unsubscribe: reset the request stream with CANCELLED (§"Request Streams")."""
        if not self._done:
            self.session.drop_request(self.request_id)
            self.feed_end()


class FetchStream(ObjectStream):
    """A FETCH that was accepted; iterate it for the objects of the range."""

    @property
    def end_location(self) -> tuple[int, int] | None:
        return tuple(self.response.end_location) if isinstance(self.response, FetchOk) else None  # type: ignore[return-value]

    def feed_stream_closed(self, stream_id: int, error_code: int | None) -> None:
        stopped = self.stop_reason(stream_id)
        super().feed_stream_closed(stream_id, error_code)
        if stopped is not None:  # we stopped it (a limit or a Refuse): the fetch failed
            self.feed_end(MoqtError(stopped[0], stopped[1], ErrorKind.STREAM))
        elif error_code is not None:
            self.feed_end(MoqtError(error_code, "fetch stream reset", ErrorKind.STREAM))
        else:
            self.feed_end()

    async def cancel(self) -> None:
        if not self._done:
            self.session.drop_request(self.request_id)
            self.feed_end()

