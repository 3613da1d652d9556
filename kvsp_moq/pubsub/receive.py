"""Receiving objects: :class:`Subscription` and :class:`FetchStream` (both :class:`ObjectStream`).

Payload bytes are copied exactly once, from the QUIC receive buffer into their destination:
either a buffer the application hands out from :attr:`ObjectStream.on_object_begin` (a
writable memoryview of the object's declared length), or, without that callback, a
``bytearray`` of that length allocated here and given to the application in
:class:`ReceivedObject`. :class:`ReceiveStats` counts the payload bytes this layer holds
(``buffered_bytes``; its peak in ``peak_buffered_bytes``): zero on the callback path.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, replace

from ..moqt.messages import (
    FetchOk,
    LocationFilter,
    Message,
    MessageParameters,
    PublishDone,
    SubscribeOk,
)
from ..moqt.objects import ObjectBegin, ObjectDatagram, ObjectEnd, ObjectPayload, ObjectStatus
from ..wire.kvp import KeyValuePair
from .errors import ErrorKind, MoqtError
from .ports import RequestOwner

__all__ = ["FetchStream", "ObjectStream", "ReceiveStats", "ReceivedObject", "Subscription"]

#: ``on_object_begin(info)`` returns where the payload goes (len == info.payload_length), or
#: None to let the library allocate a bytearray.
ObjectBeginCallback = Callable[[ObjectBegin], "memoryview | bytearray | None"]
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


@dataclass
class ReceiveStats:
    objects: int = 0
    payload_bytes: int = 0
    #: Payload bytes held by this layer (allocated here, not yet taken by the consumer).
    buffered_bytes: int = 0
    peak_buffered_bytes: int = 0
    data_streams: int = 0


@dataclass(eq=False)
class _Current:
    begin: ObjectBegin
    dest: memoryview
    owned: bytearray | None
    pos: int = 0


_END = object()


class ObjectStream:
    """Objects of one subscription or fetch, as an async iterator of :class:`ReceivedObject`."""

    def __init__(self, session: RequestOwner, request_id: int) -> None:
        self.session = session
        self.request_id = request_id
        self.on_object_begin: ObjectBeginCallback | None = None
        self.on_object_progress: ObjectProgressCallback | None = None
        self.stats = ReceiveStats()
        self.response: Message | None = None
        self._queue: asyncio.Queue[object] = asyncio.Queue()
        self._current: dict[int, _Current] = {}
        self._open_streams: set[int] = set()
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
        if isinstance(ev, ObjectPayload):
            cur = self._current[stream_id]
            n = len(ev.data)
            cur.dest[cur.pos:cur.pos + n] = ev.data  # the one copy of the payload
            cur.pos += n
            self.stats.payload_bytes += n
            if self.on_object_progress is not None and n:
                self.on_object_progress(cur.begin, n)
        elif isinstance(ev, ObjectBegin):
            dest: memoryview | bytearray | None = None
            if self.on_object_begin is not None:
                dest = self.on_object_begin(ev)
            owned = None
            if dest is None:
                owned = bytearray(ev.payload_length)
                dest = owned
                self.stats.buffered_bytes += ev.payload_length
                self.stats.peak_buffered_bytes = max(self.stats.peak_buffered_bytes,
                                                     self.stats.buffered_bytes)
            view = dest if isinstance(dest, memoryview) else memoryview(dest)
            if len(view) < ev.payload_length:
                raise ValueError("on_object_begin returned a buffer shorter than the payload")
            self._current[stream_id] = _Current(ev, view, owned)
        elif isinstance(ev, ObjectEnd):
            cur = self._current.pop(stream_id)
            b = cur.begin
            payload = cur.owned if cur.owned is not None else cur.dest[:b.payload_length]
            self.stats.objects += 1
            self._queue.put_nowait(ReceivedObject(b.group_id, b.subgroup_id, b.object_id,
                                                  b.status, b.properties, payload,
                                                  b.publisher_priority))
        else:  # SubgroupHeader / FetchHeader: a new data stream
            if stream_id not in self._open_streams:
                self._open_streams.add(stream_id)
                self.stats.data_streams += 1

    def feed_datagram(self, dg: ObjectDatagram) -> None:
        """An OBJECT_DATAGRAM of this subscription: one whole object, its payload copied once
        into its destination (``on_object_begin``'s buffer, or a bytearray)."""
        if self._done:
            return
        begin = ObjectBegin(dg.group_id, None, dg.object_id, dg.publisher_priority, dg.status,
                            len(dg.payload), dg.properties, dg.raw_properties)
        dest = self.on_object_begin(begin) if self.on_object_begin is not None else None
        n = len(dg.payload)
        if dest is None:
            payload: memoryview | bytearray = bytearray(dg.payload)
            self.stats.buffered_bytes += n
            self.stats.peak_buffered_bytes = max(self.stats.peak_buffered_bytes,
                                                 self.stats.buffered_bytes)
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
        self._queue.put_nowait(ReceivedObject(dg.group_id, None, dg.object_id, dg.status,
                                              dg.properties, payload, dg.publisher_priority,
                                              dg.end_of_group))

    def feed_stream_closed(self, stream_id: int, error_code: int | None) -> None:
        self._open_streams.discard(stream_id)
        cur = self._current.pop(stream_id, None)
        if cur is not None and cur.owned is not None:
            self.stats.buffered_bytes -= len(cur.owned)
        self._check_done()

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

    def __init__(self, session: RequestOwner, request_id: int) -> None:
        super().__init__(session, request_id)
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
        super().feed_stream_closed(stream_id, error_code)
        if error_code is not None:
            self.feed_end(MoqtError(error_code, "fetch stream reset", ErrorKind.STREAM))
        else:
            self.feed_end()

    async def cancel(self) -> None:
        if not self._done:
            self.session.drop_request(self.request_id)
            self.feed_end()

