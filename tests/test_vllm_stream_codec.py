"""The vLLM connector's streamed (prefill→decode, SUBSCRIBEd) loads honour the codec policy
(kvsp_moq/integrations/vllm/transfers.py ``stream``, docs/vllm.md "Codecs"): over real QUIC on
127.0.0.1, a real holder publishes a block of a stream layer by layer while a worker's
``stream`` loads it in fp8-e4m3 through a real transcoding relay — each layer offered before the
next is computed, coded (what crossed the wire: the codec's octets), within the codec's bound;
where the relay cannot code it (its geometry for that model does not fit the payloads) the block
loads raw, bit-exact. Every wait is bounded; no sleeps."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import numpy as np
import pytest

from bridge_support import HolderNode, client_config, make_key, server_config, within
from kvsp_moq.bridge import MoqtPool
from kvsp_moq.bridge.transcoding import KvspTranscoder
from kvsp_moq.control.client.http import HttpBlockFetcher
from kvsp_moq.control.common.tls import TlsConfig
from kvsp_moq.integrations.vllm.settings import ConnectorSettings
from kvsp_moq.integrations.vllm.stream import stream_replica_id
from kvsp_moq.integrations.vllm.transfers import STREAM, Incoming, Peers, stream
from kvsp_moq.kvsp.codecs import coded_section_bytes
from kvsp_moq.kvsp.codecs.elements import from_float32, to_float32
from kvsp_moq.kvsp.layout import Geometry
from kvsp_moq.storage import BlockStore, HostTier, RecordKey
from relay import Relay, RelayConfig

LAYERS, TOKENS = 3, 32
GEO = Geometry.from_descriptor_fields(2, 64, "bf16")
GOOD, BAD = make_key(41), make_key(42)
STREAM_ID = b"\x5a" * 16


@pytest.fixture
async def nodes() -> AsyncIterator[tuple[HolderNode, Relay, Peers]]:
    holder = await HolderNode().start()
    wrong = Geometry.from_descriptor_fields(2, 128, "bf16")
    relay = await Relay(RelayConfig(server_transport=server_config(), upstream_transport=client_config(),
                                    transcoder=KvspTranscoder({GOOD.compat_id: GEO, BAD.compat_id: wrong}))).start()
    settings = ConnectorSettings(relay_url=relay.url, deadline_ms=20_000, moqt_timeout_ms=10_000)
    peers = Peers(settings, BlockStore([HostTier(1 << 20)]), None,
                  HttpBlockFetcher("unused", timeout_s=20, tls=TlsConfig(allow_plain_http=True)), None,
                  pool=MoqtPool(client_config(), connect_timeout=10), load_slots=asyncio.Semaphore(4))
    try:
        await within(holder.holder.attach_relay(relay.url, client_config()))
        yield holder, relay, peers
    finally:
        await within(peers.close())
        await within(relay.close())
        await holder.close()


def _layers(seed: int) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    shape = GEO.shape(TOKENS)
    return [(from_float32(rng.normal(0, 1, shape).astype(np.float32), "bf16"),
             from_float32(rng.normal(0, 2, shape).astype(np.float32), "bf16")) for _ in range(LAYERS)]


async def _stream(holder: HolderNode, peers: Peers, key: RecordKey,
                  layers: list[tuple[np.ndarray, np.ndarray]]) -> Incoming:
    """The consumer subscribes first (held by the relay: RENDEZVOUS_TIMEOUT), then the producer
    computes the block, layer l + 1 only once layer l was offered (or the load failed)."""
    incoming = Incoming("req", ((0, 7),), LAYERS)
    task = asyncio.ensure_future(stream(peers, incoming, key, STREAM_ID, GEO, TOKENS, codec="fp8-e4m3"))
    writer = holder.holder.begin(key, GEO, LAYERS, TOKENS, replica_id=stream_replica_id(STREAM_ID, key))
    track = holder.holder.track(key)
    assert track is not None
    await within(track.subscribed.wait())  # the relay's one SUBSCRIBE of raw
    for layer, (k, v) in enumerate(layers):
        writer.write_layer(layer, k, v)
        if key == GOOD:
            await within(incoming.ready[layer].wait())  # coded and offered as it was computed
    writer.finish()
    await within(task)
    return incoming


async def test_a_streamed_block_loads_in_the_policy_s_codec_as_the_producer_computes_it(
        nodes: tuple[HolderNode, Relay, Peers]) -> None:
    holder, relay, peers = nodes
    layers = _layers(41)
    incoming = await _stream(holder, peers, GOOD, layers)
    section = coded_section_bytes("fp8-e4m3", GEO, TOKENS)
    assert section is not None
    assert incoming.failed_from is None and incoming.source == STREAM
    assert incoming.coded == {STREAM: LAYERS * 2 * section}  # what crossed the wire
    assert relay.stats.transcoded_objects == LAYERS
    for (k, v), got in zip(layers, incoming.kv, strict=True):
        assert got is not None
        for want, have in zip((k, v), got):
            x, y = to_float32(want, "bf16"), to_float32(have, "bf16")
            assert 0 < np.abs(y - x).max() <= 0.07 * np.abs(x).max()  # fp8: 3 mantissa bits


async def test_a_streamed_block_the_relay_cannot_code_loads_raw_bit_exact(
        nodes: tuple[HolderNode, Relay, Peers]) -> None:
    holder, relay, peers = nodes
    layers = _layers(42)
    incoming = await _stream(holder, peers, BAD, layers)
    assert incoming.failed_from is None and incoming.coded == {} and relay.stats.transcoded_objects == 0
    for (k, v), got in zip(layers, incoming.kv, strict=True):
        assert got is not None and np.array_equal(got[0], k) and np.array_equal(got[1], v)
