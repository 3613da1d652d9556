"""Receiving binding-v1 objects of one block into a layer sink (docs/binding.md §6, §8).

The payload of layer ``l`` is copied once, from the QUIC buffer into the sink's own buffer
(``on_object_begin`` returns ``sink.begin_layer``), hashed as it lands
(``on_object_progress`` -> ``sink.chunk_written``; a large layer on the sink's hash worker
thread, off the event loop), and verified by the sink when the object ends
(``sink.end_layer_async``). Nothing here exposes a layer: only the sink does, once verified.

Nothing a source declares is allocated here or in pubsub: the sink's buffer of layer ``l``
has the layer's size (from the Replica Record's geometry and token count, or the Track
Properties), and ``sink.begin_layer`` refuses any other Payload Length. An object outside
the requested range or of the wrong length is refused (:class:`~kvsp_moq.pubsub.receive.Refuse`:
the data stream is stopped with CANCELLED, a FETCH fails, the load moves on to the next
source); a duplicate of a layer already received is skipped without being stored
(:data:`~kvsp_moq.pubsub.receive.DISCARD`).
"""

from __future__ import annotations

from ..moqt.objects import ObjectBegin
from ..pubsub.receive import DISCARD, Discard, Refuse
from ..sinks import LayerSink, LayerState, SinkError
from .binding import BLOCK_GROUP, layer_digest_of

__all__ = ["LayerReceiver"]


class LayerReceiver:
    """The pubsub callbacks that route the objects of one request into ``sink``.

    ``accept_announced_digests``: for a layer whose expected digest is not known yet (a block
    still being computed), take it from the object's LAYER_DIGEST property (prefill
    streaming); otherwise the sink's digests (from the Replica Record or the Track
    Properties) are the only reference.
    """

    def __init__(self, sink: LayerSink[object], first: int, last: int, *,
                 accept_announced_digests: bool = False) -> None:
        self.sink = sink
        self.first, self.last = first, last
        self.accept_announced = accept_announced_digests
        #: Layers this request is delivering into the sink now.
        self.receiving: set[int] = set()
        #: Why this source is bad (unexpected objects, wrong lengths...), first reason first.
        self.problems: list[str] = []

    def on_object_begin(self, info: ObjectBegin) -> memoryview | Discard | Refuse:
        layer = info.object_id
        if info.group_id != BLOCK_GROUP or not self.first <= layer <= self.last:
            problem = f"unexpected object {info.group_id}/{layer}"
            self.problems.append(problem)
            return Refuse(reason=problem)  # this source sends what we did not ask for
        state = self.sink.state(layer)
        if state is LayerState.READY or self.sink.delivering(layer):
            return DISCARD  # a duplicate (live + fetched, or two sources): keep the first
        announced = layer_digest_of(info.properties)
        expected = self.sink.expected_digest(layer)
        if expected is None and announced is not None and self.accept_announced:
            self.sink.set_expected_digest(layer, announced)
        elif expected is not None and announced is not None and announced != expected:
            # The source announces another replica's layer: it can only fail. Receive it
            # anyway (the sink proves it) so that the failure is on record.
            pass
        try:
            view = self.sink.begin_layer(layer, info.payload_length)
        except SinkError as exc:  # e.g. a Payload Length other than the layer's size
            self.problems.append(str(exc))
            return Refuse(reason=str(exc))
        self.receiving.add(layer)
        return view

    def on_object_progress(self, info: ObjectBegin, n: int) -> None:
        if info.object_id in self.receiving:
            try:
                self.sink.chunk_written(info.object_id, n)
            except SinkError as exc:  # more octets than announced: the layer failed
                self.receiving.discard(info.object_id)
                self.problems.append(str(exc))

    async def object_done(self, layer: int) -> bool | None:
        """The object of ``layer`` completed: verify it (awaiting a digest computed off the
        loop). True verified, False failed, None not ours (a duplicate or an unexpected
        object)."""
        if layer not in self.receiving:
            return None
        ok = await self.sink.end_layer_async(layer)
        # Only now: a request cancelled during the await still aborts the layer (abort_pending).
        self.receiving.discard(layer)
        return ok

    def abort_pending(self, reason: str) -> None:
        """The request ended: layers still in flight failed (their octets are never exposed)."""
        for layer in sorted(self.receiving):
            self.sink.abort(layer, reason)
        self.receiving.clear()
