"""A tampering RELAY (binding §4, §7; issue: "a tampering relay (flips one byte) is detected
and the load falls back"). The relay is a real ``relay.core.Relay`` on loopback QUIC whose
FETCH forwarding path is wrapped in this module: a cold FETCH is a cache miss, cut through
from the single upstream FETCH (``relay.fetch.inflight.UpstreamFetch.pieces``, docs/relay.md "Cache
and FETCH"); as it forwards that fetch stream downstream, one payload chunk of one layer is
copied and one byte of the copy flipped (the upstream's chunks, shared with the cache, stay
honest; the object's LAYER_DIGEST property and the Track Properties are forwarded unchanged,
as a lying or corrupting relay would). The holder publishes through that relay and through an
honest one; the instance loads with both records, the tampering relay first.
No mocks of the network, no sleeps."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

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
from relay.fetch.service import FetchAnswer, FetchService
from relay.fetch.inflight import UpstreamFetch
from receive_path_support import lands_natively
from relay.session.schedule import Piece

torch = pytest.importorskip("torch")

LAYERS = 8
BAD = 3


class TamperingFetchService(FetchService):
    """Serves every FETCH like the relay's own service, but a cache miss is answered by a
    :class:`TamperingAnswer`: the first payload chunk of object ``(0, bad_layer)`` that it
    forwards leaves with one byte flipped (the first time only)."""

    def __init__(self, base: FetchService, bad_layer: int) -> None:
        super().__init__(base.cache, base.stats, base.spawn, base.request_timeout)
        self.bad_layer = bad_layer
        #: (object id, offset) of each flipped byte.
        self.tampered: list[tuple[int, int]] = []

    def join_or_start(self, down, rid, rng, route) -> None:
        self.wait_upstream(TamperingAnswer(self, down, rid, rng.track), rng, route)

    def tamper(self, up: UpstreamFetch, pieces: Iterator[Piece]) -> Iterator[Piece]:
        """``pieces`` (the cut-through fetch stream of ``up``) with one byte flipped in a
        copy of the first chunk of object ``(0, bad_layer)``."""
        for piece in pieces:
            if not self.tampered:
                bad = next((o for o in (*up.objects, up.arriving) if o is not None
                            and (o.group_id, o.object_id) == (0, self.bad_layer)), None)
                # The pieces are the upstream's own memoryviews: found by identity.
                if bad is not None and any(piece.data is c for c in bad.chunks):
                    data = bytearray(piece.data)  # a copy: the shared chunk stays honest
                    at = len(data) // 2
                    data[at] ^= 0x40
                    self.tampered.append((bad.object_id, at))
                    piece = replace(piece, data=memoryview(bytes(data)))
            yield piece


class TamperedUpstream:
    """``up`` as a downstream FETCH reads it, its fetch stream passed through the tamper."""

    def __init__(self, up: UpstreamFetch, service: TamperingFetchService) -> None:
        self.up, self.service = up, service

    def __getattr__(self, name: str) -> Any:
        return getattr(self.up, name)

    def pieces(self, enc, stats, keep=None) -> Iterator[Piece]:
        return self.service.tamper(self.up, self.up.pieces(enc, stats, keep))


class TamperingAnswer(FetchAnswer):
    """A downstream FETCH answered by cut-through, from the tampered stream."""

    service: TamperingFetchService

    def start(self, up: UpstreamFetch) -> bool:
        return super().start(TamperedUpstream(up, self.service))  # type: ignore[arg-type]


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

    # The relay did tamper, exactly once, with layer BAD, on the cut-through of a miss.
    assert [layer for layer, _ in liar.fetches.tampered] == [BAD]
    assert liar.stats.snapshot()["cache_misses"] >= 1
    assert liar.stats.snapshot()["cache_hits"] == 0
    assert result.complete and result.verified == tuple(range(LAYERS))
    # Which source served which layer: the tampering relay delivered 0..BAD-1 and failed on
    # BAD (digest check of the sink); the Python receive path stops there, the native data
    # plane verifies the layers after BAD as they land. The honest relay was asked only for
    # what was missing: BAD..end, or BAD alone.
    after = tuple(range(BAD + 1, LAYERS)) if lands_natively(sink) else ()
    first, second = result.attempts
    assert first.url == liar_url and first.layers == (0, LAYERS - 1)
    assert first.verified == (*range(BAD), *after)
    assert first.error is not None and f"layer {BAD}" in first.error \
        and "digest mismatch" in first.error
    assert second.url == honest_url and second.layers == (BAD, BAD if after else LAYERS - 1)
    assert second.verified == tuple(range(BAD, second.layers[1] + 1)) and second.error is None
    # Bit for bit: the torch CPU tensors hold the holder's bytes, and so did every layer the
    # consumer was shown while the load ran.
    for layer in range(LAYERS):
        assert sink.state(layer) is LayerState.READY
        assert tensor_octets(sink, layer) == payloads[layer]
        assert exposed[layer] == payloads[layer]
    # The honest relay fetched the re-requested range from the holder (its cache was cold).
    assert honest.stats.snapshot()["cache_misses"] >= 1
