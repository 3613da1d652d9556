"""The vLLM connector's vLLM-free parts (docs/vllm.md): settings, layouts, the descriptor.

These run without vLLM; tests/test_vllm_connector.py runs the connector in real engines.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from kvsp_moq.integrations.vllm.descriptor import build_descriptor, kv_dtype_name, positional_of
from kvsp_moq.integrations.vllm.layout import HEAD_MAJOR_HALVES, KV_FIRST, SPLIT_CONTENT, LayoutError, layout_for
from kvsp_moq.integrations.vllm.plan import merge_counts
from kvsp_moq.integrations.vllm.settings import (
    ConnectorSettings,
    SettingsError,
    connector_extra_config,
    kv_transfer_config,
)
from kvsp_moq.integrations.vllm.worker import layer_index
from kvsp_moq.kvsp.compat import compat_id
from kvsp_moq.kvsp.errors import DescriptorError

torch = pytest.importorskip("torch", reason="the layouts convert torch tensors")

KEY = bytes(range(32))


# -- settings -------------------------------------------------------------------------------------

def test_settings_defaults_and_round_trip() -> None:
    extra = connector_extra_config(index_url="http://127.0.0.1:1/", scopes={"a": KEY}, default_scope="a",
                                   relay_url="moqt://127.0.0.1:2/moq", deadline_ms=1234)
    s = ConnectorSettings.from_extra(extra)
    assert s.enabled and s.scopes == {"a": KEY} and s.deadline_ms == 1234
    assert (s.moqt_timeout_ms, s.record_ttl_ms, s.load, s.publish, s.insecure) == (2000, 600_000, True, True, False)
    config = kv_transfer_config(extra)
    assert config["kv_connector"] == "KVSPConnector"
    assert config["kv_connector_module_path"] == "kvsp_moq.integrations.vllm.connector"
    assert config["kv_load_failure_policy"] == "recompute" and config["kv_connector_extra_config"] == extra
    assert not ConnectorSettings.from_extra({}).enabled


@pytest.mark.parametrize(("extra", "key"), [
    ({"index_url": "http://x/", "nonsense": 1}, "nonsense"),
    ({"scopes": {"a": "00" * 31}}, "scopes"),  # a Scope Key has at least 32 octets
    ({"scopes": {"a": "zz"}}, "scopes"),
    ({"scopes": {"a": KEY.hex()}, "default_scope": "b"}, "default_scope"),
    ({"relay_url": "http://relay/"}, "relay_url"),
    ({"deadline_ms": 0}, "deadline_ms"),
    ({"deadline_ms": True}, "deadline_ms"),
    ({"load": "yes"}, "load"),
    ({"index_url": ""}, "index_url"),
])
def test_settings_refuse_bad_values(extra: dict[str, object], key: str) -> None:
    with pytest.raises(SettingsError) as info:
        ConnectorSettings.from_extra(extra)
    assert info.value.key == key


def test_scope_of_a_request() -> None:
    s = ConnectorSettings.from_extra({"index_url": "http://x/", "scopes": {"a": KEY.hex(), "b": (KEY * 2).hex()},
                                      "default_scope": "a"})
    assert s.scope_of(None, None) == "a"
    assert s.scope_of({"kvsp_scope": "b"}, None) == "b"
    assert s.scope_of(None, "b") == "b"  # cache_salt names a scope
    assert s.scope_of({"kvsp_scope": "a"}, "b") == "a"  # kv_transfer_params first
    assert s.scope_of({"kvsp_scope": "zz"}, None) is None  # not configured: share nothing
    assert s.scope_of(None, "unknown salt") is None
    assert s.scope_of({"kvsp": False}, "b") is None
    no_default = ConnectorSettings.from_extra({"index_url": "http://x/", "scopes": {"a": KEY.hex()}})
    assert no_default.scope_of(None, None) is None


# -- layouts --------------------------------------------------------------------------------------

H, N, D, BLOCKS = 2, 32, 16, 5


def test_cpu_layout_matches_the_cpu_backends_reading() -> None:
    """vLLM's CPU_ATTN reads K and V as ``view(B, H, 2N, D).chunk(2, dim=2)``."""
    kv = torch.randn(BLOCKS, H, N, 2 * D)
    layout = layout_for("CPU_ATTN", tuple(kv.shape), kv_heads=H, head_dim=D, block_tokens=N)
    assert layout.kind == HEAD_MAJOR_HALVES
    key_cache, value_cache = kv.view(BLOCKS, H, 2 * N, D).chunk(2, dim=2)
    k, v = layout.read(kv, 3)
    assert k.shape == (N, H, D) and k.flags.c_contiguous
    np.testing.assert_array_equal(k, key_cache[3].permute(1, 0, 2).numpy())
    np.testing.assert_array_equal(v, value_cache[3].permute(1, 0, 2).numpy())


@pytest.mark.parametrize("backend", ["CPU_ATTN", "FLASH_ATTN", "OLD"])
def test_write_then_read_is_the_identity_and_touches_one_block(backend: str) -> None:
    shape = (2, BLOCKS, N, H, D) if backend == "OLD" else (BLOCKS, H, N, 2 * D)
    kv = torch.zeros(shape)
    layout = layout_for(backend, shape, kv_heads=H, head_dim=D, block_tokens=N)
    assert layout.kind == {"CPU_ATTN": HEAD_MAJOR_HALVES, "FLASH_ATTN": SPLIT_CONTENT, "OLD": KV_FIRST}[backend]
    rng = np.random.default_rng(1)
    k = rng.standard_normal((N, H, D), dtype=np.float32)
    v = rng.standard_normal((N, H, D), dtype=np.float32)
    k.setflags(write=False)  # sink views are read-only
    layout.write(kv, 2, k, v)
    back_k, back_v = layout.read(kv, 2)
    np.testing.assert_array_equal(back_k, k)
    np.testing.assert_array_equal(back_v, v)
    others = [layout.read(kv, b) for b in range(BLOCKS) if b != 2]
    assert all(not a.any() and not b.any() for a, b in others)


def test_split_content_is_k_then_v_per_token() -> None:
    kv = torch.randn(BLOCKS, H, N, 2 * D)
    layout = layout_for("FLASH_ATTN", tuple(kv.shape), kv_heads=H, head_dim=D, block_tokens=N)
    key_cache, value_cache = kv.transpose(1, 2).split(D, dim=-1)  # FlashAttention's reading
    k, v = layout.read(kv, 1)
    np.testing.assert_array_equal(k, key_cache[1].numpy())
    np.testing.assert_array_equal(v, value_cache[1].numpy())


def test_unknown_layouts_are_refused() -> None:
    with pytest.raises(LayoutError):
        layout_for("FLASH_ATTN", (BLOCKS, N, 576), kv_heads=H, head_dim=D, block_tokens=N)  # MLA-like
    with pytest.raises(LayoutError):
        layout_for("CPU_ATTN", (BLOCKS, H, N, D), kv_heads=H, head_dim=D, block_tokens=N)
    layout = layout_for("CPU_ATTN", (BLOCKS, H, N, 2 * D), kv_heads=H, head_dim=D, block_tokens=N)
    with pytest.raises(LayoutError):
        layout.write(torch.zeros(BLOCKS, H, N, 2 * D), 0, np.zeros((N - 1, H, D), np.float32),
                     np.zeros((N - 1, H, D), np.float32))


# -- descriptor -----------------------------------------------------------------------------------

def _model_dir(tmp_path: Path) -> Path:
    (tmp_path / "model.safetensors").write_bytes(b"weights")
    (tmp_path / "tokenizer.json").write_text("{}")
    return tmp_path


def test_descriptor_from_the_model_files(tmp_path: Path) -> None:
    root = _model_dir(tmp_path)
    doc = build_descriptor(root, model="tiny", layers=4, kv_heads=2, head_dim=32, kv_dtype="fp32",
                           positional="rope;theta=10000", block_tokens=32)
    assert doc["block_tokens"] == 32 and doc["layout"] == "kvsp-layout-1"
    first = compat_id(doc)
    (root / "model.safetensors").write_bytes(b"other weights")
    again = build_descriptor(root, model="tiny", layers=4, kv_heads=2, head_dim=32, kv_dtype="fp32",
                             positional="rope;theta=10000", block_tokens=32)
    assert compat_id(again) != first  # other weights: another Compatibility ID
    (root / "tokenizer.json").unlink()
    with pytest.raises(DescriptorError):
        build_descriptor(root, model="tiny", layers=4, kv_heads=2, head_dim=32, kv_dtype="fp32",
                         positional="rope;theta=10000", block_tokens=32)


def test_dtype_and_positional_from_the_engine() -> None:
    assert kv_dtype_name("auto", torch.float32) == "fp32"
    assert kv_dtype_name("auto", torch.bfloat16) == "bf16"
    assert kv_dtype_name("fp8_e5m2", torch.float16) == "fp8-e5m2"
    with pytest.raises(DescriptorError):
        kv_dtype_name("auto", torch.int32)
    assert positional_of(SimpleNamespace(rope_parameters={"rope_theta": 10000.0, "rope_type": "default"})) \
        == "rope;theta=10000"
    llama3 = SimpleNamespace(rope_parameters={"rope_theta": 500000.0, "rope_type": "llama3", "factor": 8.0,
                                              "original_max_position_embeddings": 8192})
    assert positional_of(llama3) == "rope;theta=500000;scaling=llama3;factor=8;original_max_position=8192"
    with pytest.raises(DescriptorError):
        positional_of(SimpleNamespace())


def test_layer_names_and_counters() -> None:
    assert layer_index("model.layers.11.self_attn.attn") == 11
    assert layer_index("language_model.model.layers.0.self_attn.attn") == 0
    with pytest.raises(ValueError):
        layer_index("lm_head")
    counts = merge_counts({"r": {"blocks_moqt": 1}}, {"r": {"blocks_moqt": 2, "bytes_moqt": 5}, "s": {"x": 1}})
    assert counts == {"r": {"blocks_moqt": 3, "bytes_moqt": 5}, "s": {"x": 1}}


# -- the worker's relay link (transfers.Peers) ------------------------------------------------------


async def test_a_relay_down_at_start_is_attached_once_it_is_up(tmp_path: Path) -> None:
    """The connector's worker starts while its relay is down: it waits at most deadline_ms,
    serves (blocks go to its store, ``relay_attached`` False, no moqt publication), and goes
    on attaching in the background. Once the relay listens, the holder attaches, announces
    the block it published meanwhile, and the relay routes its namespace."""
    import asyncio
    import socket

    from bridge_support import ca_file, client_config, server_config
    from kvsp_moq.integrations.vllm.transfers import Peers, begin_block, complete_block, write_layer
    from kvsp_moq.kvsp.layout import ELEMENT_TYPES, Geometry
    from kvsp_moq.storage import RecordKey
    from relay import Relay, RelayConfig

    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    url = f"moqt://127.0.0.1:{port}/moq"
    settings = ConnectorSettings(relay_url=url, ca_file=ca_file(), deadline_ms=300, moqt_timeout_ms=300)
    peers = await asyncio.wait_for(Peers.open(settings), 30)
    relay = None
    try:
        assert peers.holder is not None and peers.attaching is not None and not peers.attaching.done()
        assert not peers.relay_attached
        geometry = Geometry(kv_heads=1, head_dim=4, dtype=ELEMENT_TYPES["fp32"])
        key = RecordKey(bytes(32), bytes(16), bytes(range(1, 33)))
        writer = begin_block(peers, key, geometry, 2, 16)
        assert writer is not None
        for layer in range(2):
            write_layer(writer, layer, np.full((16, 1, 4), layer, np.float32), np.zeros((16, 1, 4), np.float32))
        assert await complete_block(peers, writer) == ["store"]

        relay = await Relay(RelayConfig(port=port, server_transport=server_config(),
                                        upstream_transport=client_config())).start()
        assert relay.url == url
        session = await asyncio.wait_for(peers.attaching, 30)  # the reconnect backoff: 0.1 s doubling
        assert session is not None and peers.relay_attached
        assert await peers.holder.wait_announced(30)
        namespaces = relay.routing.namespaces()
        assert namespaces == [tuple(peers.holder.publish(key).block_name.namespace_fields())], namespaces
    finally:
        await peers.close()
        if relay is not None:
            await relay.close()
