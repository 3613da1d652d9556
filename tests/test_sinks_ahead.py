"""A destination handed out ahead of its object (docs/sinks.md "Transport side",
``begin_layer(..., ahead=True)``): the native data plane registers a SUBSCRIBE's live layers
before their producer wrote them (bridge/native_receive.py), so such a layer reads EXPECTED
("nothing received yet") until it lands, while its destination stays taken: no second
delivery begins, no other load fails it, the memory does not move. The bridge side over real
QUIC is tests/test_bridge_streaming.py on the native backend."""

from __future__ import annotations

import asyncio
import hashlib

import pytest

from kvsp_moq.bridge.receive import LayerReceiver
from kvsp_moq.moqt.objects import ObjectBegin, ObjectStatus
from kvsp_moq.pubsub.receive import DISCARD
from kvsp_moq.sinks import LayerFailed, LayerState, NumpySink, SinkError
from test_sinks_support import make_block

GUARD = 10.0


async def test_a_layer_handed_out_ahead_is_expected_until_it_lands() -> None:
    block = make_block("bf16")
    sink = NumpySink(block.geometry, block.tokens, block.layers,
                     [None] * (block.layers[1] + 1))  # a block still being computed
    size = sink.payload_bytes
    views = {layer: sink.begin_layer(layer, size, digest_later=True, ahead=True)
             for layer in (0, 1, 2)}
    waiter = asyncio.ensure_future(sink.wait_for_layer(0))
    for layer in (0, 1, 2):
        assert sink.state(layer) is LayerState.EXPECTED and sink.delivering(layer)
    assert sink.missing_layers() == (0, 1, 2) and sink.ready_layers == ()
    # The destination belongs to that delivery: nothing else begins, retries or accepts it,
    # and a receive path that meets its object treats it as a duplicate.
    with pytest.raises(SinkError, match="already being received"):
        sink.begin_layer(0, size, digest_later=True)
    with pytest.raises(SinkError, match="nothing to retry"):
        sink.retry(0)
    sink.set_expected_digest(0, block.digests[0])
    with pytest.raises(SinkError, match="cannot be accepted"):
        sink.accept_verified(0, block.digests[0])
    begin = ObjectBegin(0, 0, 0, None, ObjectStatus.NORMAL, size)
    assert LayerReceiver(sink, 0, 2).on_object_begin(begin) is DISCARD
    # It lands: EXPECTED -> READY, waiters resume with the octets.
    views[0][:] = block.payloads[0]
    assert sink.land_verified(0, hashlib.sha256(block.payloads[0]).digest())
    await asyncio.wait_for(waiter, GUARD)
    assert sink.state(0) is LayerState.READY and not sink.delivering(0)
    assert b"".join(_octets(sink, 0)) == block.payloads[0]
    # A mismatch: EXPECTED -> FAILED, never exposed; the layer can be delivered again.
    sink.set_expected_digest(1, block.digests[1])
    views[1][:] = block.payloads[1]
    assert not sink.land_verified(1, bytes(32))
    assert sink.state(1) is LayerState.FAILED and not sink.delivering(1)
    with pytest.raises(LayerFailed, match="digest mismatch"):
        sink.layer(1)
    sink.retry(1)
    sink.begin_layer(1, size)
    # The delivery is given up (the subscription ended): the layer fails, its destination free.
    sink.abort(2, "subscription ended")
    assert sink.state(2) is LayerState.FAILED and not sink.delivering(2)
    with pytest.raises(SinkError, match="not being received"):
        sink.land_verified(2, block.digests[2])


def test_a_torch_sink_with_a_layer_handed_out_ahead_does_not_move() -> None:
    pytest.importorskip("torch")
    from kvsp_moq.sinks import TorchSink

    block = make_block("fp16")
    sink = TorchSink(block.geometry, block.tokens, block.layers, block.digests)
    sink.begin_layer(1, sink.payload_bytes, ahead=True)
    with pytest.raises(SinkError, match="shared memory"):
        sink.share_memory()  # the registered view would point at the old memory
    sink.abort(1, "given up")
    sink.share_memory()
    assert sink.is_shared


def _octets(sink: NumpySink, layer: int) -> tuple[bytes, bytes]:
    k, v = sink.layer(layer)
    return k.tobytes(), v.tobytes()
