"""A tampering RELAY (binding §4, §7; issue: "a tampering relay (flips one byte) is detected
and the load falls back"). The relay is a real ``relay.core.Relay`` on loopback QUIC whose
FETCH forwarding path is wrapped in this module: when it forwards the objects of a FETCH
downstream, one layer's payload is copied and one byte of the copy flipped (its cache keeps
the honest bytes; the object's LAYER_DIGEST property and the Track Properties are forwarded
unchanged, as a lying or corrupting relay would). The holder publishes through that relay and
through an honest one; the instance loads with both records, the tampering relay first.
No mocks of the network, no sleeps."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest

from bridge_support import (
    HolderNode,
    client_config,
    make_key,
    make_layers,
    server_config,
    within,
)
from kvsp_moq.bridge import MoqtPool, Source, sink_for_record
from kvsp_moq.bridge.load import BlockLoad
from kvsp_moq.sinks import LayerState
from relay import Relay, RelayConfig
from relay.cache import CachedObject
from relay.fetch import FetchService

torch = pytest.importorskip("torch")

LAYERS = 8
BAD = 3


class TamperingFetchService(FetchService):
    """Forwards every FETCH like the relay's own service, but the payload of object
    ``(0, bad_layer)`` leaves with one byte flipped (the first time only)."""

    def __init__(self, base: FetchService, bad_layer: int) -> None:
        super().__init__(base.cache, base.stats, base.spawn)
        self.bad_layer = bad_layer
        #: (object id, offset) of each flipped byte.
        self.tampered: list[tuple[int, int]] = []

    def serve(self, down, rid, objects: list[CachedObject], end_of_track, track) -> None:
        out = []
        for o in objects:
            if o.location == (0, self.bad_layer) and not self.tampered:
                data = bytearray(o.payload())  # a copy: the cached object stays honest
                at = len(data) // 2
                data[at] ^= 0x40
                self.tampered.append((o.object_id, at))
                o = replace(o, chunks=(memoryview(bytes(data)),))
            out.append(o)
        super().serve(down, rid, out, end_of_track, track)


class TamperingRelay(Relay):
    def __init__(self, config: RelayConfig, bad_layer: int) -> None:
        super().__init__(config)
        self.fetches = TamperingFetchService(self.fetches, bad_layer)


def relay_config() -> RelayConfig:
    return RelayConfig(server_transport=server_config(), upstream_transport=client_config())


def tensor_octets(sink, layer: int) -> bytes:
    k, v = sink.layer(layer)
    return (k.contiguous().view(torch.uint8).numpy().tobytes()
            + v.contiguous().view(torch.uint8).numpy().tobytes())


@pytest.fixture
async def holder():
    node = await HolderNode().start()
    try:
        yield node
    finally:
        await node.close()


async def test_tampering_relay_detected_and_load_falls_back(holder: HolderNode) -> None:
    key, layers = make_key(21), make_layers(LAYERS)
    holder.put(key, layers)
    liar = await TamperingRelay(relay_config(), BAD).start()
    honest = await Relay(relay_config()).start()
    liar_url, honest_url = liar.url, honest.url
    try:
        # The holder publishes its replica through both relays (PUBLISH_NAMESPACE).
        await within(holder.holder.attach_relay(liar.url, client_config()))
        await within(holder.holder.attach_relay(honest.url, client_config()))
        await within(holder.holder.wait_announced())
        via_liar = holder.holder.replica_record(key, holder=liar.url)
        via_honest = holder.holder.replica_record(key, holder=honest.url)
        assert via_liar.moqt_namespace == via_honest.moqt_namespace
        payloads = {layer: holder.payload(key, layer) for layer in range(LAYERS)}

        sink = sink_for_record(via_liar, layers.geometry, layers.tokens, backend="torch")
        exposed: dict[int, bytes] = {}

        async def consumer(load: BlockLoad) -> None:
            # Computes on each layer as soon as the load exposes it: what it reads must be
            # the holder's bytes (the tampered copy of BAD is never exposed).
            for layer in range(LAYERS):
                await load.wait_for_layer(layer)
                exposed[layer] = tensor_octets(sink, layer)

        pool = MoqtPool(client_config())
        load = BlockLoad(sink, [Source.from_record(via_liar), Source.from_record(via_honest)],
                         pool=pool)
        try:
            result, _ = await within(asyncio.gather(load.run(), consumer(load)))
        finally:
            await within(pool.close())
    finally:
        await within(liar.close())
        await within(honest.close())

    # The relay did tamper, exactly once, with layer BAD.
    assert [layer for layer, _ in liar.fetches.tampered] == [BAD]
    assert result.complete and result.verified == tuple(range(LAYERS))
    # Which source served which layer: the tampering relay delivered 0..BAD-1 and failed on
    # BAD (digest check of the sink); the honest relay was asked only for BAD..end.
    first, second = result.attempts
    assert first.url == liar_url and first.layers == (0, LAYERS - 1)
    assert first.verified == tuple(range(BAD))
    assert first.error is not None and f"layer {BAD}" in first.error \
        and "digest mismatch" in first.error
    assert second.url == honest_url and second.layers == (BAD, LAYERS - 1)
    assert second.verified == tuple(range(BAD, LAYERS)) and second.error is None
    # Bit for bit: the torch CPU tensors hold the holder's bytes, and so did every layer the
    # consumer was shown while the load ran.
    for layer in range(LAYERS):
        assert sink.state(layer) is LayerState.READY
        assert tensor_octets(sink, layer) == payloads[layer]
        assert exposed[layer] == payloads[layer]
    # The honest relay fetched the re-requested range from the holder (its cache was cold).
    assert honest.stats.snapshot()["cache_misses"] >= 1
