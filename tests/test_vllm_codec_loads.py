"""The vLLM connector's codec policy (issue 31; docs/vllm.md "Codecs") below the engine: which
codec a request loads in (``ConnectorSettings.codec_of``), and the worker's load of one block
(``integrations.vllm.transfers.load``) in that codec over real QUIC on 127.0.0.1 — a real MOQT
holder publishing a raw block through a real relay given the KVSP transcoder — and over HTTP
from a real holder that transcodes ``GET ...?codec=n``. A coded load is checked and decoded to
the cache's dtype within the codec's bound, and counted as coded; a load without a codec, or
one whose relay does not make the codec, is raw and bit-exact. The engines themselves run in
tests/test_vllm_connector.py. No sleeps: every wait is bounded."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

import numpy as np
import pytest

from bridge_support import HolderNode, Layers, client_config, server_config, within
from kvsp_moq.bridge import MoqtPool
from kvsp_moq.bridge.transcoding import from_descriptors
from kvsp_moq.control.client.http import HttpBlockFetcher
from kvsp_moq.control.common.auth import Authorizer, Grant, Principal
from kvsp_moq.control.common.config import ControlConfig, HolderConfig, IndexConfig, TierConfig
from kvsp_moq.control.common.tls import TlsConfig
from kvsp_moq.control.holder.serve import serve_holder
from kvsp_moq.integrations.vllm.settings import ConnectorSettings, SettingsError
from kvsp_moq.integrations.vllm.transfers import Incoming, Peers, load
from kvsp_moq.kvsp.codecs import coded_section_bytes
from kvsp_moq.kvsp.codecs.elements import from_float32, to_float32
from kvsp_moq.kvsp.compat import compat_id, make_descriptor
from kvsp_moq.kvsp.layout import Geometry
from kvsp_moq.kvsp.scope import scope_id
from kvsp_moq.storage import BlockStore, HostTier, RecordKey
from relay import Relay, RelayConfig

LAYERS, TOKENS, HEADS, DIM = 4, 32, 2, 64
DOC = make_descriptor(model="vllm-codec-loads-test", model_digest="sha-256:" + "31" * 32,
                      tokenizer_digest="sha-256:" + "13" * 32, layers=LAYERS, kv_heads=HEADS, head_dim=DIM,
                      kv_dtype="bf16", positional="rope", block_tokens=TOKENS, layout="kvsp-layout-1")
GEO = Geometry.from_descriptor_fields(HEADS, DIM, "bf16")
KEY = RecordKey(compat_id(DOC), b"\x31" * 16, hashlib.sha256(b"a block of the codec policy").digest())
#: A compat the relay has no descriptor for: it makes no coded track of its blocks.
UNKNOWN = RecordKey(b"\x44" * 32, KEY.scope_id, KEY.block_key)
TOKEN = "codec-loads-token"
SCOPES = {"lossy": "aa" * 32, "plain": "bb" * 32}


def test_the_codec_is_the_operators_never_the_requests_alone() -> None:
    s = ConnectorSettings.from_extra({"index_url": "http://is/", "scopes": SCOPES, "codec_policy": {
        "scopes": {"lossy": "fp8-e4m3"}, "classes": {"bulk": "int8", "exact": "raw"}, "lossless": "zstd-planes"}})
    assert s.codec_policy is not None and set(s.codec_policy.scopes) == {scope_id(bytes.fromhex(SCOPES["lossy"]))}
    name = lambda scope, params=None: (lambda c: c.codec and c.codec.name)(s.codec_of(scope, params))  # noqa: E731
    assert name("lossy") == "fp8-e4m3" and name("plain") == "zstd-planes"
    assert name("lossy", {"kvsp_class": "bulk"}) == "int8"  # the scope allows loss already
    assert name("plain", {"kvsp_class": "bulk"}) == "zstd-planes"  # a lossy class alone: ignored
    assert "ignored" in s.codec_of("plain", {"kvsp_class": "bulk"}).reason
    assert name("lossy", {"kvsp_class": "exact"}) is None  # less loss is always allowed
    assert name("plain", {"kvsp_codec": "int8"}) == "zstd-planes"  # a codec named in the body: nothing
    unset = ConnectorSettings.from_extra({"index_url": "http://is/", "scopes": SCOPES})
    assert unset.codec_policy is None and unset.codec_of("lossy", {"kvsp_class": "bulk"}).codec is None


@pytest.mark.parametrize(("policy", "detail"), [
    ({"scopes": {"nobody": "fp8-e4m3"}}, "'nobody' is not in scopes"),
    ({"lossless": "int8"}, "int8 is lossy"),
    ({"classes": {"bulk": "fp4"}}, "not a registered codec"),
    ({"codecs": {}}, "unknown key"),
    (["fp8-e4m3"], "must be an object"),
])
def test_a_bad_codec_policy_is_refused_at_start(policy: object, detail: str) -> None:
    with pytest.raises(SettingsError, match=detail):
        ConnectorSettings.from_extra({"index_url": "http://is/", "scopes": SCOPES, "codec_policy": policy})


def _layers() -> Layers:
    rng = np.random.default_rng(31)
    shape = GEO.shape(TOKENS)
    return Layers(GEO, TOKENS, [(from_float32(rng.normal(0, 1, shape).astype(np.float32), "bf16"),
                                 from_float32(rng.normal(0, 2, shape).astype(np.float32), "bf16"))
                                for _ in range(LAYERS)])


@dataclass
class Nodes:
    holder: HolderNode
    relay: Relay
    http_record: dict[str, object]
    layers: Layers
    peers: Peers


@pytest.fixture
async def nodes() -> AsyncIterator[Nodes]:
    """A MOQT holder publishing KEY and UNKNOWN raw through a transcoding relay; an HTTP holder
    (the control plane's) storing KEY raw and transcoding for DOC; a worker's Peers."""
    holder = await HolderNode().start()
    relay = await Relay(RelayConfig(server_transport=server_config(), upstream_transport=client_config(),
                                    transcoder=from_descriptors([DOC]))).start()
    layers = _layers()
    store = BlockStore([HostTier(16 << 20)])
    store.put_layers(KEY, layers.arrays, token_count=TOKENS, geometry=GEO)
    everything = Grant(everything=True)
    config = ControlConfig(auth=Authorizer.from_tokens({TOKEN: Principal("t", scopes=everything, holders=everything)}),
                           index=IndexConfig(purge_interval_ms=0),
                           holder=HolderConfig(tiers=(TierConfig("host", 16 << 20),), descriptors=(DOC,)))
    http = await serve_holder(config, "127.0.0.1", 0, store=store)
    settings = ConnectorSettings(relay_url=relay.url, deadline_ms=20_000, moqt_timeout_ms=10_000)
    peers = Peers(settings, BlockStore([HostTier(1 << 20)]), None,
                  HttpBlockFetcher(TOKEN, timeout_s=20, tls=TlsConfig(allow_plain_http=True)), None,
                  pool=MoqtPool(client_config(), connect_timeout=10), load_slots=asyncio.Semaphore(4))
    try:
        holder.put(KEY, layers)
        holder.put(UNKNOWN, layers)
        await within(holder.holder.attach_relay(relay.url, client_config()))
        await within(holder.holder.wait_announced())
        info = store.get(KEY)
        assert info is not None
        yield Nodes(holder, relay, info.replica_record(http.url, 600_000).to_json(), layers, peers)
    finally:
        await within(peers.close())
        await within(http.close())
        await within(relay.close())
        await holder.close()


async def _load(nodes: Nodes, key: RecordKey, codec: str | None, *, http: bool = False) -> Incoming:
    record = nodes.http_record if http else nodes.holder.holder.replica_record(key, holder=nodes.relay.url).to_json()
    incoming = Incoming("req", ((0, 7),), LAYERS)
    await within(load(nodes.peers, incoming, key, [record], GEO, TOKENS, codec=codec), 60)
    return incoming


def _close_to_the_originals(incoming: Incoming, layers: Layers) -> None:
    for (k, v), got in zip(layers.arrays, incoming.kv):
        assert got is not None
        for want, have in zip((k, v), got):
            assert have.dtype == want.dtype and have.shape == want.shape  # the cache's dtype (bf16 bits)
            err = np.abs(to_float32(have, "bf16") - to_float32(want, "bf16"))
            assert 0 < err.max() <= 0.07 * np.abs(to_float32(want, "bf16")).max()  # fp8: 3 mantissa bits


async def test_a_coded_load_comes_through_the_transcoding_relay_and_a_raw_one_bit_exact(nodes: Nodes) -> None:
    section = coded_section_bytes("fp8-e4m3", GEO, TOKENS)
    assert section is not None
    coded = await _load(nodes, KEY, "fp8-e4m3")
    assert coded.failed_from is None and coded.coded == {"moqt": LAYERS * 2 * section}
    assert coded.octets == {"moqt": LAYERS * 2 * GEO.section_bytes(TOKENS)}  # decoded: what is placed
    _close_to_the_originals(coded, nodes.layers)
    assert nodes.relay.stats.transcodes == 1

    raw = await _load(nodes, KEY, None)  # no policy: raw, bit-exact, nothing coded
    assert raw.failed_from is None and raw.coded == {}
    for (k, v), got in zip(nodes.layers.arrays, raw.kv):
        assert got is not None and np.array_equal(got[0], k) and np.array_equal(got[1], v)

    # A relay that does not make the codec (no descriptor for the compat): raw, bit-exact.
    fallback = await _load(nodes, UNKNOWN, "fp8-e4m3")
    assert fallback.failed_from is None and fallback.coded == {} and fallback.source == "moqt"
    for (k, v), got in zip(nodes.layers.arrays, fallback.kv):
        assert got is not None and np.array_equal(got[0], k) and np.array_equal(got[1], v)


async def test_a_coded_load_over_http_asks_the_holder_to_transcode(nodes: Nodes) -> None:
    section = coded_section_bytes("int8", GEO, TOKENS)
    assert section is not None
    coded = await _load(nodes, KEY, "int8", http=True)
    assert coded.failed_from is None and coded.source == "http"
    assert coded.coded == {"http": LAYERS * 2 * section}
    _close_to_the_originals(coded, nodes.layers)
