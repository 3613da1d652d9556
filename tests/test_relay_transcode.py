"""Transcoding at the relay's edge (relay/transcode/edge.py, kvsp_moq/bridge/transcoding.py,
docs/relay.md "Transcoding"), over real QUIC on 127.0.0.1: a real holder (BlockStore +
MoqtHolder) publishes a raw block through a real relay given the KVSP transcoder; two
consumers FETCH the replica's ``fp8-e4m3`` track at once; the relay transcodes once (its
counter), both decode within the codec's bound after checking every coded layer against the
digests the relay computed; a later FETCH is a cache hit; a coded byte flipped in the relay's
cache is detected by the consumer. Every wait is bounded; no sleeps."""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest

from bridge_support import HolderNode, Layers, client_config, server_config, within
from kvsp_moq.bridge import binding
from kvsp_moq.bridge.transcoding import KvspTranscoder, fetch_coded_layers, from_descriptors
from kvsp_moq.kvsp.codecs.elements import from_float32, to_float32
from kvsp_moq.kvsp.compat import compat_id, make_descriptor
from kvsp_moq.kvsp.layout import Geometry
from kvsp_moq.kvsp.naming import BlockName
from kvsp_moq.pubsub import connect
from kvsp_moq.storage import RecordKey
from relay import Relay, RelayConfig
from relay.__main__ import build_config, parse_args
from relay.fetch.cache import CachedObject
from relay.ops.metrics import render_metrics
from relay.transcode.edge import LAYER_DIGEST

LAYERS, TOKENS, HEADS, DIM = 4, 32, 2, 64
DOC = make_descriptor(model="relay-transcode-test", model_digest="sha-256:" + "11" * 32,
                      tokenizer_digest="sha-256:" + "22" * 32, layers=LAYERS, kv_heads=HEADS, head_dim=DIM,
                      kv_dtype="bf16", positional="rope", block_tokens=TOKENS, layout="kvsp-layout-1")
GEO = Geometry.from_descriptor_fields(HEADS, DIM, "bf16")
KEY = RecordKey(compat_id(DOC), b"\x07" * 16, hashlib.sha256(b"relay transcoded block").digest())


def _layers() -> Layers:
    rng = np.random.default_rng(5)
    shape = GEO.shape(TOKENS)
    return Layers(GEO, TOKENS, [(from_float32(rng.normal(0, 1, shape).astype(np.float32), "bf16"),
                                 from_float32(rng.normal(0, 2, shape).astype(np.float32), "bf16"))
                                for _ in range(LAYERS)])


def test_the_relay_reads_the_binding_s_object_property() -> None:
    """relay/transcode/edge.py may not import the bridge: its LAYER_DIGEST is the binding's."""
    assert LAYER_DIGEST == binding.LAYER_DIGEST
    transcoder = from_descriptors([DOC])
    ns = BlockName(KEY.compat_id, KEY.scope_id, KEY.block_key, b"\x01" * 16).namespace_fields()
    assert transcoder.source_track(ns, b"fp8-e4m3") == b"raw"
    assert transcoder.source_track(ns, b"zstd-planes") is None  # content-sized sections
    assert transcoder.source_track(ns, b"raw") is None and transcoder.source_track(ns, b"nope") is None
    other = BlockName(b"\x09" * 32, KEY.scope_id, KEY.block_key, b"\x01" * 16).namespace_fields()
    assert transcoder.source_track(other, b"fp8-e4m3") is None  # no descriptor for that compat


def test_python_m_relay_takes_the_kvsp_transcoder_as_a_plugin(tmp_path: Path) -> None:
    path = tmp_path / "model.json"
    path.write_text(json.dumps(DOC))
    config = build_config(parse_args(["--listen", "127.0.0.1:0", "--transcode-descriptor", str(path)]))
    assert isinstance(config.transcoder, KvspTranscoder) and set(config.transcoder.geometries) == {KEY.compat_id}
    assert build_config(parse_args(["--listen", "127.0.0.1:0"])).transcoder is None
    with pytest.raises(SystemExit):
        parse_args(["--transcode-descriptor", str(path), "--workers", "2"])
    (tmp_path / "bad.json").write_text(json.dumps({**DOC, "kv_heads": 0}))
    with pytest.raises(SystemExit) as exited:  # one line naming the option, exit 2
        parse_args(["--transcode-descriptor", str(tmp_path / "bad.json")])
    assert exited.value.code == 2


@pytest.fixture
async def nodes() -> AsyncIterator[tuple[HolderNode, Relay, Layers]]:
    holder = await HolderNode().start()
    relay = await Relay(RelayConfig(server_transport=server_config(), upstream_transport=client_config(),
                                    transcoder=KvspTranscoder(from_descriptors([DOC]).geometries))).start()
    try:
        await within(holder.holder.attach_relay(relay.url, client_config()))
        await within(holder.holder.wait_announced())
        layers = _layers()
        holder.put(KEY, layers)
        yield holder, relay, layers
    finally:
        await within(relay.close())
        await holder.close()


async def test_two_consumers_one_transcoding_verified_and_a_flipped_byte_detected(
        nodes: tuple[HolderNode, Relay, Layers]) -> None:
    holder, relay, layers = nodes
    name = holder.holder.replica_record(KEY).block_name()
    assert name is not None
    a = await within(connect(relay.url, client_config()))
    b = await within(connect(relay.url, client_config()))
    try:
        got = await within(asyncio.gather(*(fetch_coded_layers(s, name, "fp8-e4m3", GEO, 0, LAYERS - 1)
                                            for s in (a, b))))
        assert relay.stats.transcodes == 1 and relay.stats.upstream_fetches == 1
        for decoded in got:
            for (k, v), (dk, dv) in zip(layers.arrays, decoded, strict=True):
                for original, back in ((k, dk), (v, dv)):
                    x, y = to_float32(original, "bf16"), to_float32(back, "bf16")
                    # e4m3: 2**-4 relative, plus the bf16 rounding of the result (2**-8)
                    bound = np.abs(x) * (2.0**-4 + 2.0**-8) + np.abs(x).max() * 2.0**-9
                    assert (np.abs(y - x) <= bound).all()
        # A later FETCH (a layer range) is served from the relay's cache: no new transcoding.
        again = await within(fetch_coded_layers(a, name, "fp8-e4m3", GEO, 1, 2))
        assert [k.tobytes() for k, _ in again] == [k.tobytes() for k, _ in got[0][1:3]]
        assert relay.stats.transcodes == 1 and relay.stats.upstream_fetches == 1
        assert "relay_transcodes_total 1\n" in render_metrics(relay.stats.snapshot())

        # One coded octet flips in the relay's memory: the consumer's check catches it.
        track = (name.namespace_fields(), b"fp8-e4m3")
        good = relay.cache.get(track, 0, 2)
        assert good is not None
        flipped = bytearray(good.payload())
        flipped[len(flipped) // 3] ^= 0x01
        relay.cache.put(track, CachedObject(good.group_id, good.object_id, good.subgroup_id, good.publisher_priority,
                                            good.status, good.raw_properties, (memoryview(bytes(flipped)),),
                                            good.payload_length), replace=True)
        with pytest.raises(binding.BindingError, match="layer 2: digest mismatch"):
            await within(fetch_coded_layers(b, name, "fp8-e4m3", GEO, 0, LAYERS - 1))
    finally:
        for s in (a, b):
            await within(s.close())
    assert relay.transcoding is not None and not relay.transcoding.jobs  # nothing left waiting
