"""Receiving a FETCH of a block's layers through the native data plane (DESIGN.md §6; binding v1
§6, §8; docs/transport.md "native").

On a connection of the ``native`` transport backend, :class:`NativeFetch` hands the sink's
destinations of layers ``first..last`` to the extension once the FETCH has its Request ID and
before it leaves (``MoqtSession.fetch(on_request=...)``). The extension parses the FETCH's data
stream itself, writes each layer's payload straight from the decrypted STREAM frames into its
destination and computes its SHA-256 as the octets land; Python hears once per layer (object ID,
length, digest) and verifies it against the record's digest (``LayerSink.land_verified``).
Control streams, and any stream nothing registered for, still reach the sans-IO MOQT session.

The rules of :class:`~.receive.LayerReceiver` hold: an object outside the range or of another
Payload Length than the layer's is refused (the extension stops the stream with CANCELLED and
the FETCH fails), a layer already verified or being received is not registered (its object is
discarded). A malformed data stream is a PROTOCOL_VIOLATION of the session, which is closed with
it, as the Python parser closes it. Other backends, and sinks that cannot hand out every
destination at once (a CUDA staging ring), keep the Python path.

A SUBSCRIBE (prefill streaming, binding v1 §6) lands the same way (:class:`NativeSubscribe`):
once SUBSCRIBE_OK names the Track Alias the publisher chose, and before the objects read behind
it are dispatched, the destinations of the layers after its Largest Object (the live ones; the
earlier ones are FETCHed) are handed to the extension for the subscription's SUBGROUP streams. A
layer the sink has no digest for yet is verified against the object's LAYER_DIGEST property, as
:class:`~.receive.LayerReceiver` does with ``accept_announced_digests``. The data streams that
landed natively are counted into the subscription, so that it ends after PUBLISH_DONE's Stream
Count as before. A SUBGROUP stream that reached us before SUBSCRIBE_OK (its first bytes
routed to Python before the registration) is left to the Python path, whose objects for layers
registered here are discarded as duplicates: those layers fail when the subscription ends and
are FETCHed (``subscribe_block``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, Protocol

from ..moqt.data.common import decode_properties
from ..moqt.messages import Message, SubscribeOk
from ..moqt.objects import ObjectBegin
from ..pubsub import ErrorKind, FetchStream, MoqtError, MoqtSession, Subscription
from ..sinks import LayerSink, LayerState, SinkError
from ..wire.errors import WireError
from .binding import BLOCK_GROUP, layer_digest_of

__all__ = ["FETCH_STREAM", "SUBGROUP_STREAM", "NativeFetch", "NativeSubscribe", "native_fetch",
           "native_subscribe"]

#: The extension's kinds of data streams (``receive_objects``): SUBGROUP (by Track Alias) and
#: FETCH (by Request ID).
SUBGROUP_STREAM = 1
FETCH_STREAM = 2


class _ObjectReceiving(Protocol):
    """What the native backend's connection offers (transport/native/connection.py)."""

    def receive_objects(self, kind: int, ident: int, group: int, first: int,
                        dests: list[Any], on_event: Callable[[tuple[Any, ...]], None], *,
                        timed_out_range: bool = True, descending: bool = False,
                        max_properties_length: int = 1 << 20) -> int: ...

    def forget_objects(self, handle: int) -> None: ...

    def subscriptions_pending(self, delta: int) -> None: ...


def _native_connection(session: MoqtSession, sink: LayerSink[Any]) -> _ObjectReceiving | None:
    """The session's connection when it runs on the native backend and the sink can hand out
    its destinations at once; None: the Python path."""
    conn: Any = getattr(session, "connection", None)
    if getattr(conn, "backend", None) != "native" or not hasattr(conn, "receive_objects"):
        return None
    return conn if sink.destinations_at_once() else None


def native_fetch(session: MoqtSession, sink: LayerSink[Any], first: int,
                 last: int) -> NativeFetch | None:
    """A :class:`NativeFetch` where the native path applies; None: the Python path."""
    conn = _native_connection(session, sink)
    return None if conn is None else NativeFetch(session, conn, sink, first, last)


def native_subscribe(session: MoqtSession, sink: LayerSink[Any], first: int,
                     last: int) -> NativeSubscribe | None:
    """A :class:`NativeSubscribe` where the native path applies; None: the Python path."""
    conn = _native_connection(session, sink)
    return None if conn is None else NativeSubscribe(session, conn, sink, first, last)


class NativeFetch:
    """The native landing of one FETCH of layers ``first..last`` into ``sink``."""

    def __init__(self, session: MoqtSession, conn: _ObjectReceiving, sink: LayerSink[Any],
                 first: int, last: int) -> None:
        self.session = session
        self.conn = conn
        self.sink = sink
        self.first, self.last = first, last
        #: The registration's handle (None: nothing was registered, the Python path runs).
        self.handle: int | None = None
        #: Layers handed to the extension and not landed yet.
        self.landing: set[int] = set()
        #: Layers verified, in arrival order.
        self.verified: list[int] = []
        #: Why this source failed, first reason first.
        self.problems: list[str] = []
        self.on_progress: Callable[[], None] = lambda: None
        self._done: asyncio.Future[MoqtError | None] = asyncio.get_running_loop().create_future()

    @property
    def active(self) -> bool:
        return self.handle is not None

    def register(self, request_id: int) -> None:
        """``MoqtSession.fetch``'s ``on_request``: hand the destinations over (the FETCH has
        not left yet)."""
        dests: list[Any] = []
        for layer in range(self.first, self.last + 1):
            dests.append(self._begin(layer))
        if not self.landing:
            return  # nothing to receive here: the Python path discards what comes
        version = self.session.version
        try:
            self.handle = self.conn.receive_objects(
                FETCH_STREAM, request_id, BLOCK_GROUP, self.first, dests, self._on_event,
                timed_out_range=version.end_of_timed_out_range)
        except (ConnectionError, ValueError) as exc:
            self._abort_landing(f"native receive: {exc}")

    def _begin(self, layer: int) -> memoryview | None:
        sink = self.sink
        if sink.state(layer) in (LayerState.READY, LayerState.RECEIVING):
            return None  # a duplicate (another source, or the live stream): discarded
        if sink.expected_digest(layer) is None:
            return None  # no reference to verify against: such an object is discarded
        try:
            view = sink.begin_layer(layer, sink.payload_bytes)
        except SinkError:
            return None
        self.landing.add(layer)
        return view

    def _on_event(self, event: tuple[Any, ...]) -> None:
        self.on_progress()
        if event[0] == "object":
            self._on_object(event)
        else:
            self._on_end(str(event[4]), int(event[5]), str(event[6]))

    def _on_object(self, event: tuple[Any, ...]) -> None:
        # The extension checked the object (Object Properties included) as the Python parser
        # does; what is left is the layer.
        layer, digest = int(event[6]), event[10]
        if digest is None or layer not in self.landing:
            return  # discarded (a duplicate, or a status object)
        self.landing.discard(layer)
        try:
            ok = self.sink.land_verified(layer, digest)
        except SinkError as exc:  # aborted meanwhile
            self.problems.append(str(exc))
            return
        if ok:
            self.verified.append(layer)
        else:
            self.problems.append(f"layer {layer}: {self.sink.failure_reason(layer)}")

    def _on_end(self, result: str, code: int, reason: str) -> None:
        if self._done.done():
            return
        if result == "fin":
            self._done.set_result(None)
        elif result == "violation":
            self._violation(code, reason)
        elif result == "reset":
            self._done.set_result(MoqtError(code, "fetch stream reset", ErrorKind.STREAM))
        else:  # limit / refused: the extension stopped the stream with the code
            self.problems.append(reason)
            self._done.set_result(MoqtError(code, reason, ErrorKind.STREAM))

    def _violation(self, code: int, reason: str) -> None:
        """A malformed data stream: the session closes with the code (draft-22 §"Session
        Termination"), in the one place the sans-IO session closes."""
        moqt = self.session.moqt
        if moqt is not None:
            moqt.close(code, reason)
            self.session.pump()
        if not self._done.done():
            self._done.set_result(MoqtError(code, reason, ErrorKind.SESSION))

    async def run(self, stream: FetchStream) -> str | None:
        """Wait for the FETCH's data stream to end (or the session to); the first problem,
        None when it ended cleanly. The FETCH's object stream is ended here: its data stream
        never reached Python."""
        waiter: asyncio.Future[Any] = asyncio.ensure_future(stream.collect())
        done: asyncio.Future[Any] = self._done
        try:
            await asyncio.wait({done, waiter}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not waiter.done():
                waiter.cancel()
            elif not waiter.cancelled():
                waiter.exception()  # retrieved: the session's end is reported below
        error: MoqtError | None = None
        if self._done.done():
            error = self._done.result()
        elif waiter.exception() is not None:  # the session ended (or the peer cancelled)
            exc = waiter.exception()
            error = exc if isinstance(exc, MoqtError) else MoqtError(0, str(exc), ErrorKind.LOCAL)
        stream.feed_end(error)
        if self.problems:
            return self.problems[0]
        if error is not None:
            return f"{type(error).__name__} {error.code:#x}: {error}"
        return None

    def close(self, reason: str) -> None:
        """The FETCH ended: nothing lands any more (the registration is forgotten first, so the
        network thread no longer writes into the sink), layers still landing fail."""
        if self.handle is not None:
            self.conn.forget_objects(self.handle)
            self.handle = None
        self._abort_landing(reason)

    def _abort_landing(self, reason: str) -> None:
        for layer in sorted(self.landing):
            self.sink.abort(layer, reason)
        self.landing.clear()


class NativeSubscribe(NativeFetch):
    """The native landing of the live layers of one SUBSCRIBE of layers ``first..last``."""

    def __init__(self, session: MoqtSession, conn: _ObjectReceiving, sink: LayerSink[Any],
                 first: int, last: int) -> None:
        super().__init__(session, conn, sink, first, last)
        #: Data streams of the subscription that ended here (never seen by the session), not
        #: yet counted into it; the streams seen landing here and not ended.
        self.streams_ended = 0
        self._open: set[int] = set()
        self._sub: Subscription | None = None
        self._pending = False

    def announce(self) -> None:
        """Before the SUBSCRIBE leaves: the extension holds SUBGROUP streams of aliases nothing
        registered until the answer is settled (:meth:`settle`), so that a stream the publisher
        opens right behind SUBSCRIBE_OK cannot reach the session before the registration."""
        if not self._pending:
            self._pending = True
            self.conn.subscriptions_pending(1)

    def settle(self) -> None:
        """The answer was dispatched (or never will be): held streams go to their registration
        or to the session. Idempotent; ``subscribe_block`` calls it in ``finally``."""
        if self._pending:
            self._pending = False
            self.conn.subscriptions_pending(-1)

    def on_answer(self, answer: Message) -> None:
        """``MoqtSession.subscribe``'s ``on_response``: SUBSCRIBE_OK names the Track Alias;
        the layers after its Largest Object are registered before anything behind it is
        read."""
        try:
            if isinstance(answer, SubscribeOk):
                self._register(answer)
        finally:
            self.settle()

    def _register(self, answer: SubscribeOk) -> None:
        largest = answer.parameters.largest_object
        live_from = self.first if largest is None else max(self.first, largest.object + 1)
        dests = [self._begin(layer) if layer >= live_from else None
                 for layer in range(self.first, self.last + 1)]
        if not self.landing:
            return
        try:
            self.handle = self.conn.receive_objects(
                SUBGROUP_STREAM, answer.track_alias, BLOCK_GROUP, self.first, dests,
                self._on_event, timed_out_range=self.session.version.end_of_timed_out_range)
        except (ConnectionError, ValueError) as exc:
            self._abort_landing(f"native receive: {exc}")

    def guard(self, on_object_begin: Callable[[ObjectBegin], Any]) -> Callable[[ObjectBegin], Any]:
        """The Python path's ``on_object_begin`` for the same subscription: an object of a
        layer registered here that reaches the session (its stream's first bytes arrived before
        SUBSCRIBE_OK, so the extension routed it to Python) ends the native landing, and the
        Python path receives the layer (no layer waits on a registration nothing will fill)."""
        def begin(info: ObjectBegin) -> Any:
            if info.object_id in self.landing:
                handed = sorted(self.landing)
                self.close("a data stream of the subscription reached the session first")
                for layer in handed:  # expected again, for the Python path
                    self.sink.retry(layer)
            return on_object_begin(info)
        return begin

    def attach(self, sub: Subscription) -> None:
        """The subscription (once ``subscribe`` returned): the data streams that ended here
        count toward PUBLISH_DONE's Stream Count."""
        self._sub = sub
        self._count_streams()

    def _begin(self, layer: int) -> memoryview | None:
        sink = self.sink
        if sink.state(layer) in (LayerState.READY, LayerState.RECEIVING):
            return None
        try:
            # Without a digest yet: the object's LAYER_DIGEST is taken when it has landed.
            # Ahead: the layer reads EXPECTED until it lands, since its producer may not have
            # written it yet (docs/sinks.md, the state contract).
            view = sink.begin_layer(layer, sink.payload_bytes, digest_later=True, ahead=True)
        except SinkError:
            return None
        self.landing.add(layer)
        return view

    def _on_object(self, event: tuple[Any, ...]) -> None:
        self._open.add(int(event[3]))
        layer, digest = int(event[6]), event[10]
        if digest is None or layer not in self.landing:
            return
        if self.sink.expected_digest(layer) is None:
            try:
                props = decode_properties(bytes(event[11]), self.session.version.vi64_seven_byte)
            except WireError:  # the extension validated them: cannot happen
                props = ()
            announced = layer_digest_of(props)
            if announced is None:
                self.landing.discard(layer)
                self.sink.abort(layer, "no digest to verify it against (LAYER_DIGEST missing)")
                self.problems.append(f"layer {layer}: no LAYER_DIGEST")
                return
            self.sink.set_expected_digest(layer, announced)
        super()._on_object(event)

    def _on_event(self, event: tuple[Any, ...]) -> None:
        if event[0] == "objects_end":
            self._open.discard(int(event[3]))
        super()._on_event(event)

    def close(self, reason: str) -> None:
        # Streams still landing are stopped and their end is not reported: count them here,
        # or the subscription would wait for them (PUBLISH_DONE's Stream Count).
        if self.handle is not None:
            self.streams_ended += len(self._open)
            self._open.clear()
        super().close(reason)
        self._count_streams()

    def _on_end(self, result: str, code: int, reason: str) -> None:
        # One data stream of the subscription ended (a subscription has several: one per
        # group or subgroup); the subscription itself ends with PUBLISH_DONE.
        self.streams_ended += 1
        if result == "violation":
            self._violation(code, reason)
        elif result in ("limit", "refused"):
            self.problems.append(reason)
        self._count_streams()

    def _count_streams(self) -> None:
        sub = self._sub
        if sub is None or self.streams_ended == 0:
            return
        sub.stats.data_streams += self.streams_ended
        self.streams_ended = 0
        if sub.publish_done is not None:
            sub.feed_publish_done(sub.publish_done)  # re-checks the Stream Count
