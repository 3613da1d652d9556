"""Layer sinks behind the real MOQT stack: kvsp_moq.pubsub over QUIC (aioquic) on 127.0.0.1.

Binding v1 (DESIGN.md §4): group 0, Object ID = layer index, payload = K || V, SHA-256(payload)
= layer digest. The subscriber hands ``sink.begin_layer`` to ``on_object_begin`` so payload
octets go from the QUIC buffer straight into the tensors' storage, and ends each layer when its
object completes. No sleeps: every wait is on a future the protocol or the sink completes;
``within`` only turns a hang into a failure.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from kvsp_moq.pubsub import Catalog, MoqtSession, connect, serve  # noqa: E402
from kvsp_moq.sinks import LayerSink, LayerState, NumpySink, TorchSink  # noqa: E402
from kvsp_moq.transport import TransportConfig  # noqa: E402
from kvsp_moq.transport.tls import make_self_signed  # noqa: E402
from test_sinks_support import Block, kv_octets, make_block  # noqa: E402

GUARD = 30.0
LAYERS = 8
_CERT = make_self_signed()


async def within(aw: Any, timeout: float = GUARD) -> Any:
    return await asyncio.wait_for(aw, timeout)


class Pair:
    """A publishing server (with a catalog) and a connected subscribing client."""

    async def start(self) -> Pair:
        self.catalog = Catalog()
        sessions: asyncio.Queue[MoqtSession] = asyncio.Queue()
        self.server = await serve(
            "127.0.0.1", 0,
            TransportConfig(certificate_pem=_CERT.cert_pem, private_key_pem=_CERT.key_pem),
            catalog=self.catalog, on_session=sessions.put_nowait)
        self.client = await within(connect(f"moqt://127.0.0.1:{self.server.port}/moq",
                                           TransportConfig(insecure=True)))
        await within(sessions.get())
        return self

    async def stop(self) -> None:
        await within(self.client.close())
        self.server.close()
        await within(self.server.wait_closed())


@pytest.fixture
async def pair() -> AsyncIterator[Pair]:
    p = await Pair().start()
    try:
        yield p
    finally:
        await p.stop()


def the_block() -> Block:
    # bf16, 128 tokens x 4 heads x 64 dims: 64 KiB sections, 128 KiB objects, 8 layers.
    return make_block("bf16", tokens=128, kv_heads=4, head_dim=64, layers=LAYERS, seed=7)


def ns(replica: str) -> tuple[str, ...]:
    return ("kvsp-1", "compat", "scope", "block", replica)


def begin_into(sink: LayerSink[Any]) -> Any:
    """The on_object_begin callback of binding v1: Object ID = layer."""
    return lambda info: sink.begin_layer(info.object_id, info.payload_length)


async def end_layers(stream: Any, sink: LayerSink[Any]) -> list[bool]:
    """End each layer when its object completes; the verdicts in arrival order."""
    return [sink.end_layer(obj.object_id) async for obj in stream]


async def test_subscribe_streams_layers_into_torch_tensors_while_computing(pair: Pair) -> None:
    block = the_block()
    sink = TorchSink(block.geometry, block.tokens, block.layers, block.digests)
    track = pair.catalog.create(ns("a" * 32), "raw", keep=False)
    sub = await within(pair.client.subscribe(ns("a" * 32), "raw",
                                             on_object_begin=begin_into(sink)))
    await within(track.subscribed.wait())
    loop = asyncio.get_running_loop()
    consumed = [loop.create_future() for _ in range(LAYERS)]
    sums: list[float] = []

    async def compute() -> None:  # the engine: layers in ascending order, as they land
        async for layer, (k, v) in sink.ascending():
            sums.append(float(k.float().nan_to_num().sum() + v.float().nan_to_num().sum()))
            consumed[layer].set_result(None)

    async def publish() -> None:
        for layer in range(LAYERS):
            payload = block.payloads[layer]
            half = len(payload) // 2
            writer = await track.begin_object(0, layer, len(payload))
            await writer.write(payload[:half])
            if layer:
                # Layer l - 1 must be verified and computed on while layer l is in flight;
                # were it held back until layer l completes, this would hang (GUARD).
                await consumed[layer - 1]
                assert sink.state(layer) is not LayerState.READY
            await writer.write(payload[half:])
            await writer.close()
        await track.finish()

    verdicts, _, _ = await within(asyncio.gather(end_layers(sub, sink), compute(), publish()))
    assert verdicts == [True] * LAYERS and len(sums) == LAYERS
    assert sink.complete and sink.ready_layers == tuple(range(LAYERS))
    for layer in range(LAYERS):
        assert kv_octets(sink, layer) == block.source_octets(layer)  # bit for bit
    # The payload went straight into the sink's tensors: pubsub held no payload octets.
    assert sub.stats.peak_buffered_bytes == 0
    assert sub.stats.payload_bytes == LAYERS * sink.payload_bytes


@pytest.mark.parametrize("sink_type", [TorchSink, NumpySink])
async def test_fetch_corrupt_layer_then_refetch_it_from_another_replica(
    pair: Pair, sink_type: type[LayerSink[Any]]
) -> None:
    block = the_block()
    sink = sink_type(block.geometry, block.tokens, block.layers, block.digests)
    bad, good = ns("b" * 32), ns("c" * 32)
    bad_track = pair.catalog.create(bad, "raw")  # keep=True: stored, served by FETCH
    good_track = pair.catalog.create(good, "raw")
    for layer in range(LAYERS):
        payload = block.payloads[layer]
        if layer == 3:
            corrupt = bytearray(payload)
            corrupt[len(corrupt) // 3] ^= 0x80
            await bad_track.write_object(0, layer, bytes(corrupt))
        else:
            await bad_track.write_object(0, layer, payload)
        await good_track.write_object(0, layer, payload)

    fetch = await within(pair.client.fetch(bad, "raw", start=(0, 0), end=(0, LAYERS - 1),
                                           on_object_begin=begin_into(sink)))
    verdicts = await within(end_layers(fetch, sink))
    assert verdicts == [layer != 3 for layer in range(LAYERS)]
    assert sink.failed_layers == (3,) and sink.missing_layers() == (3,)
    assert "digest mismatch" in (sink.failure_reason(3) or "")

    # Retry the failed layer from another replica: a FETCH of the one-object range.
    sink.retry(3)  # waiters now wait for the new delivery
    waiter = asyncio.ensure_future(sink.wait_for_layer(3))
    refetch = await within(pair.client.fetch(good, "raw", start=(0, 3), end=(0, 3),
                                             on_object_begin=begin_into(sink)))
    assert await within(end_layers(refetch, sink)) == [True]
    await within(waiter)
    assert sink.complete
    for layer in range(LAYERS):
        assert kv_octets(sink, layer) == block.source_octets(layer)
