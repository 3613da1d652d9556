"""A SUBSCRIBE of a coded track, transcoded by the relay as the layers arrive
(relay/transcode/live.py, docs/relay.md "Transcoding", docs/binding.md §13), over real QUIC on
127.0.0.1: a real holder publishes a block layer by layer while it is computed (the
prefill→decode path); two consumers SUBSCRIBE to its ``fp8-e4m3`` track and one to ``raw``
through a real relay given the KVSP transcoder. The producer sees one subscription, each layer
is coded once, each coded layer reaches both coded subscribers before the next layer is
written, checks against the digest the relay computed and decodes within the codec's bound;
raw is bit-exact; a later FETCH of the coded track is answered from the relay's cache,
checked against the coded LAYER_DIGESTS. A transcoder that cannot code a layer (a geometry
that does not fit the payloads) ends the coded subscription with PUBLISH_DONE INTERNAL_ERROR
while the raw subscriber gets every layer. The last coded subscriber leaving cancels the relay's
SUBSCRIBE of raw. Every wait is bounded; no sleeps."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator

import numpy as np
import pytest

from bridge_support import HolderNode, client_config, make_key, server_config, within
from kvsp_moq.bridge.binding import BindingError, TrackInfo, layer_digest_of
from kvsp_moq.bridge.transcoding import KvspTranscoder, fetch_coded_layers, subscribed_coded_layers
from kvsp_moq.kvsp.codecs import decode_layer
from kvsp_moq.kvsp.codecs.elements import from_float32, to_float32
from kvsp_moq.kvsp.layout import Geometry
from kvsp_moq.moqt.errors import PublishDoneCode
from kvsp_moq.pubsub import MoqtSession, connect
from kvsp_moq.pubsub.receive import Subscription
from kvsp_moq.storage import RecordKey
from relay import Relay, RelayConfig

LAYERS, TOKENS = 4, 32
GOOD, BAD = make_key(31), make_key(32)
# The relay codes GOOD's replicas with the holder's geometry; BAD's with one that does not fit.
GEO = Geometry.from_descriptor_fields(2, 64, "bf16")
WRONG = Geometry.from_descriptor_fields(GEO.kv_heads, GEO.head_dim * 2, "bf16")


def _layers(count: int, seed: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Finite bf16 K and V (fp8-e4m3 refuses non-finite elements)."""
    rng = np.random.default_rng(seed)
    shape = GEO.shape(TOKENS)
    return [(from_float32(rng.normal(0, 1, shape).astype(np.float32), "bf16"),
             from_float32(rng.normal(0, 2, shape).astype(np.float32), "bf16")) for _ in range(count)]


@pytest.fixture
async def nodes() -> AsyncIterator[tuple[HolderNode, Relay, list[MoqtSession]]]:
    holder = await HolderNode().start()
    relay = await Relay(RelayConfig(server_transport=server_config(), upstream_transport=client_config(),
                                    transcoder=KvspTranscoder({GOOD.compat_id: GEO, BAD.compat_id: WRONG}))).start()
    sessions: list[MoqtSession] = []
    try:
        await within(holder.holder.attach_relay(relay.url, client_config()))
        sessions = list(await within(asyncio.gather(*(connect(relay.url, client_config()) for _ in range(3)))))
        yield holder, relay, sessions
    finally:
        for s in sessions:
            await within(s.close())
        await within(relay.close())
        await holder.close()


def _within_fp8_bound(original: np.ndarray, back: np.ndarray) -> bool:
    x, y = to_float32(original, "bf16"), to_float32(back, "bf16")
    # e4m3: 2**-4 relative, plus the bf16 rounding of the result (2**-8), plus the scale's floor
    return bool((np.abs(y - x) <= np.abs(x) * (2.0**-4 + 2.0**-8) + np.abs(x).max() * 2.0**-9).all())


async def test_two_coded_subscribers_and_a_raw_one_share_one_upstream_subscription_each_layer_coded_once(
        nodes: tuple[HolderNode, Relay, list[MoqtSession]]) -> None:
    holder, relay, (a, b, c) = nodes
    layers = _layers(LAYERS, 31)
    writer = holder.holder.begin(GOOD, GEO, LAYERS, TOKENS)
    await within(holder.holder.wait_announced())
    ns = GOOD.block_name(writer.replica_id).namespace_fields()
    subs: list[Subscription] = list(await within(asyncio.gather(
        a.subscribe(ns, "fp8-e4m3"), b.subscribe(ns, "fp8-e4m3"), c.subscribe(ns, "raw"))))
    track = holder.holder.track(GOOD)
    assert track is not None and track.subscriber_count == 1  # the relay's one SUBSCRIBE of raw
    assert relay.stats.upstream_subscribes == 1
    # One coded subscriber reads the objects as they come, the other through the bridge's check.
    checked = subscribed_coded_layers(subs[1], "fp8-e4m3", GEO, 0, LAYERS - 1)
    coded: list[bytes] = []
    for layer, (k, v) in enumerate(layers):
        writer.write_layer(layer, k, v)
        # Layer l reaches every subscriber before layer l + 1 is computed: coded as it came.
        first, second, raw = await within(asyncio.gather(subs[0].__anext__(), checked.__anext__(),
                                                         subs[2].__anext__()))
        assert bytes(raw.payload) == holder.payload(GOOD, layer) and raw.object_id == layer
        payload = bytes(first.payload)
        assert first.object_id == second.index == layer and second.coded_octets == len(payload)
        assert layer_digest_of(first.properties) == hashlib.sha256(payload).digest()
        half = len(payload) // 2
        dk, dv = decode_layer("fp8-e4m3", payload[:half], payload[half:], GEO, TOKENS)
        assert (dk.tobytes(), dv.tobytes()) == (second.k.tobytes(), second.v.tobytes())
        assert _within_fp8_bound(k, dk) and _within_fp8_bound(v, dv)
        assert len(payload) < len(raw.payload)
        coded.append(payload)
    with pytest.raises(StopAsyncIteration):  # the last layer ends it
        await within(checked.__anext__())
    writer.finish()
    assert relay.stats.transcoded_objects == LAYERS and relay.stats.transcodes == 1
    assert relay.stats.upstream_subscribes == 1

    # A later FETCH of the coded track: from the relay's cache, checked against the coded
    # LAYER_DIGESTS the relay declared once every layer was coded; nothing coded again.
    fetches = relay.stats.upstream_fetches
    got = await within(fetch_coded_layers(c, GOOD.block_name(writer.replica_id), "fp8-e4m3", GEO, 0, LAYERS - 1))
    for payload, (k, v) in zip(coded, got, strict=True):
        half = len(payload) // 2
        assert (k.tobytes(), v.tobytes()) == tuple(
            x.tobytes() for x in decode_layer("fp8-e4m3", payload[:half], payload[half:], GEO, TOKENS))
    assert relay.stats.upstream_fetches == fetches and relay.stats.transcoded_objects == LAYERS

    # A SUBSCRIBE of the coded track once it is whole: its SUBSCRIBE_OK declares the coded digests.
    late = await within(b.subscribe(ns, "fp8-e4m3"))
    declared = TrackInfo.parse(late.response.track_properties).layer_digests  # type: ignore[union-attr]
    assert declared == {i: hashlib.sha256(p).digest() for i, p in enumerate(coded)}
    await within(late.cancel())


async def test_a_layer_the_transcoder_cannot_code_ends_the_coded_subscription_not_the_raw_one(
        nodes: tuple[HolderNode, Relay, list[MoqtSession]]) -> None:
    holder, relay, (a, _b, c) = nodes
    layers = _layers(2, 32)
    writer = holder.holder.begin(BAD, GEO, 2, TOKENS)
    await within(holder.holder.wait_announced())
    ns = BAD.block_name(writer.replica_id).namespace_fields()
    coded, raw = await within(asyncio.gather(a.subscribe(ns, "fp8-e4m3"), c.subscribe(ns, "raw")))
    for layer, (k, v) in enumerate(layers):
        writer.write_layer(layer, k, v)
        assert bytes((await within(raw.__anext__())).payload) == holder.payload(BAD, layer)
    with pytest.raises(BindingError, match=r"ended before layer 0: cannot transcode source object \(0, 0\)"):
        await within(anext(subscribed_coded_layers(coded, "fp8-e4m3", GEO, 0, 1)))
    assert coded.publish_done is not None and coded.publish_done.status_code == PublishDoneCode.INTERNAL_ERROR
    assert relay.stats.transcoded_objects == 0
    writer.finish()


async def test_the_last_coded_subscriber_leaving_ends_the_relay_s_subscription_of_raw(
        nodes: tuple[HolderNode, Relay, list[MoqtSession]]) -> None:
    holder, relay, (a, _b, _c) = nodes
    key = RecordKey(GOOD.compat_id, GOOD.scope_id, make_key(33).block_key)  # a compat the relay codes
    writer = holder.holder.begin(key, GEO, 2, TOKENS)
    await within(holder.holder.wait_announced())
    coded = await within(a.subscribe(key.block_name(writer.replica_id).namespace_fields(), "fp8-e4m3"))
    track = holder.holder.track(key)
    assert track is not None and track.subscriber_count == 1
    writer.write_layer(0, *_layers(1, 33)[0])
    assert (await within(coded.__anext__())).object_id == 0
    await within(coded.cancel())
    await within(track.unsubscribed.wait())  # the relay cancelled its SUBSCRIBE of raw
    assert track.subscriber_count == 0 and not relay.upstreams.tracks
    writer.abort()
