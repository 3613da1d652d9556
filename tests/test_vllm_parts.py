"""The vLLM connector's vLLM-free parts (docs/vllm.md): settings, layouts, the descriptor.

These run without vLLM; tests/test_vllm_connector.py runs the connector in real engines.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from kvsp_moq.integrations.vllm.descriptor import (
    EngineModel,
    adapter_digest,
    build_descriptor,
    checkpoint_kv_scales,
    kv_dtype_name,
    kv_scales_digest,
    positional_of,
    shard_of,
)
from kvsp_moq.integrations.vllm.digest_cache import files_digest
from kvsp_moq.integrations.vllm.layout import HEAD_MAJOR_HALVES, KV_FIRST, SPLIT_CONTENT, LayoutError, layout_for
from kvsp_moq.integrations.vllm.plan import merge_counts
from kvsp_moq.integrations.vllm.settings import (
    ConnectorSettings,
    ScopeChoice,
    SettingsError,
    connector_extra_config,
    kv_transfer_config,
    salt_digest,
)
from kvsp_moq.integrations.vllm.worker import layer_index
from kvsp_moq.kvsp.blockkeys import block_keys
from kvsp_moq.kvsp.compat import compat_id, model_digest
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


SALT_A, SALT_B = "secret-of-a", "secret-of-b"


def test_a_scope_is_selected_only_by_a_configured_secret_salt() -> None:
    s = ConnectorSettings.from_extra({"index_url": "http://x/", "scopes": {"a": KEY.hex(), "b": (KEY * 2).hex()},
                                      "default_scope": "a",
                                      "scope_salts": {"a": [salt_digest(SALT_A)], "b": [salt_digest(SALT_B)]}})
    assert s.scope_of(None, None) == ScopeChoice("a")  # no salt: the operator's default
    assert s.scope_of(None, SALT_B) == ScopeChoice("b")  # the secret the operator gave tenant b
    assert s.scope_of(None, SALT_A) == ScopeChoice("a")
    # A name in the request body selects nothing: kvsp_scope is not read, a scope's name is no salt.
    assert s.scope_of({"kvsp_scope": "b"}, None) == ScopeChoice("a")
    assert s.scope_of({"kvsp_scope": "b"}, SALT_A) == ScopeChoice("a")
    named = s.scope_of(None, "b")
    assert named.scope is None and named.reason == "its cache_salt selects no scope"
    unknown = s.scope_of(None, "user-123")  # not silently in another scope: shares nothing, says why
    assert unknown.scope is None and unknown.reason
    assert s.scope_of({"kvsp": False}, SALT_B).scope is None
    no_default = ConnectorSettings.from_extra({"index_url": "http://x/", "scopes": {"a": KEY.hex()}})
    assert no_default.scope_of(None, None).scope is None


@pytest.mark.parametrize(("salts", "detail"), [
    ({"zz": [salt_digest("s")]}, "not in scopes"),
    ({"a": salt_digest("s")}, "non-empty array"),
    ({"a": []}, "non-empty array"),
    ({"a": ["s"]}, "sha-256"),  # the salt itself is never configured, only its digest
    ({"a": ["sha-256:" + "A" * 64]}, "sha-256"),
    ({"a": [salt_digest("s")], "b": [salt_digest("s")]}, "two scopes"),
    (["a"], "object"),
])
def test_scope_salts_refuse_bad_values(salts: object, detail: str) -> None:
    with pytest.raises(SettingsError, match=detail) as info:
        ConnectorSettings.from_extra({"scopes": {"a": KEY.hex(), "b": (KEY * 2).hex()}, "scope_salts": salts})
    assert info.value.key == "scope_salts"


# -- layouts --------------------------------------------------------------------------------------

H, N, D, BLOCKS = 2, 32, 16, 5


def test_cpu_layout_matches_the_cpu_backends_reading() -> None:
    """vLLM's CPU_ATTN reads K and V as ``view(B, H, 2N, D).chunk(2, dim=2)``."""
    kv = torch.randn(BLOCKS, H, N, 2 * D)
    layout = layout_for("CPU_ATTN", tuple(kv.shape), kv_heads=H, head_dim=D, block_tokens=N)
    assert layout.kind == HEAD_MAJOR_HALVES
    key_cache, value_cache = kv.view(BLOCKS, H, 2 * N, D).chunk(2, dim=2)
    k, v = layout.read(kv, 3)  # the elements' bits, as integers of their size
    assert k.shape == (N, H, D) and k.flags.c_contiguous and k.dtype == np.int32
    np.testing.assert_array_equal(k.view(np.float32), key_cache[3].permute(1, 0, 2).numpy())
    np.testing.assert_array_equal(v.view(np.float32), value_cache[3].permute(1, 0, 2).numpy())


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
    np.testing.assert_array_equal(back_k.view(np.float32), k)
    np.testing.assert_array_equal(back_v.view(np.float32), v)
    others = [layout.read(kv, b) for b in range(BLOCKS) if b != 2]
    assert all(not a.any() and not b.any() for a, b in others)


@pytest.mark.parametrize("backend", ["CPU_ATTN", "FLASH_ATTN", "OLD"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pages_move_in_one_copy_exactly_as_page_by_page(backend: str, dtype: torch.dtype) -> None:
    """A KVSP block of several pages (``block_tokens``): ``write_pages``/``read_pages`` put the
    block's tokens in the pages given, in that order (not consecutive ids), bit for bit as
    ``write``/``read`` of each page would, and touch no other page."""
    shape = (2, BLOCKS, N, H, D) if backend == "OLD" else (BLOCKS, H, N, 2 * D)
    layout = layout_for(backend, shape, kv_heads=H, head_dim=D, block_tokens=N)
    pages = [3, 0, 4]
    source = torch.randn(shape).to(dtype)
    k, v = layout.read_pages(source, pages)
    assert k.shape == v.shape == (len(pages) * N, H, D) and k.flags.c_contiguous
    for i, page in enumerate(pages):  # the same bits as page by page
        one_k, one_v = layout.read(source, page)
        np.testing.assert_array_equal(k[i * N:(i + 1) * N], one_k)
        np.testing.assert_array_equal(v[i * N:(i + 1) * N], one_v)
    target = torch.zeros(shape, dtype=dtype)
    k.setflags(write=False)  # sink views are read-only
    layout.write_pages(target, pages, k, v)
    for page in range(BLOCKS):
        got = layout.read(target, page)
        want = layout.read(source, page) if page in pages else (np.zeros_like(got[0]), np.zeros_like(got[1]))
        np.testing.assert_array_equal(got[0], want[0])
        np.testing.assert_array_equal(got[1], want[1])
    with pytest.raises(LayoutError):
        layout.write_pages(target, pages, k[:N], v[:N])  # one page of sections for three pages


def test_split_content_is_k_then_v_per_token() -> None:
    kv = torch.randn(BLOCKS, H, N, 2 * D)
    layout = layout_for("FLASH_ATTN", tuple(kv.shape), kv_heads=H, head_dim=D, block_tokens=N)
    key_cache, value_cache = kv.transpose(1, 2).split(D, dim=-1)  # FlashAttention's reading
    k, v = layout.read(kv, 1)
    np.testing.assert_array_equal(k.view(np.float32), key_cache[1].numpy())
    np.testing.assert_array_equal(v.view(np.float32), value_cache[1].numpy())


def test_unknown_layouts_are_refused() -> None:
    with pytest.raises(LayoutError):
        layout_for("FLASH_ATTN", (BLOCKS, N, 576), kv_heads=H, head_dim=D, block_tokens=N)  # MLA-like
    with pytest.raises(LayoutError):
        layout_for("CPU_ATTN", (BLOCKS, H, N, D), kv_heads=H, head_dim=D, block_tokens=N)
    layout = layout_for("CPU_ATTN", (BLOCKS, H, N, 2 * D), kv_heads=H, head_dim=D, block_tokens=N)
    with pytest.raises(LayoutError):
        layout.write(torch.zeros(BLOCKS, H, N, 2 * D), 0, np.zeros((N - 1, H, D), np.float32),
                     np.zeros((N - 1, H, D), np.float32))


# -- dtypes: bit-exact through the container --------------------------------------------------------

DTYPES = [("float32", "fp32"), ("float16", "fp16"), ("bfloat16", "bf16"), ("float8_e4m3fn", "fp8-e4m3"),
          ("float8_e5m2", "fp8-e5m2")]


def _random_bits(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Every bit pattern may occur (NaN payloads, infinities, subnormals, -0): a float round
    trip would change some of them."""
    size = torch.empty((), dtype=dtype).element_size()
    integer = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[size]
    info = torch.iinfo(integer)
    bits = torch.randint(info.min, info.max, shape, dtype=torch.int64, generator=torch.Generator().manual_seed(seed))
    return bits.to(integer).view(dtype)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


@pytest.mark.parametrize(("torch_name", "kv_dtype"), DTYPES)
@pytest.mark.parametrize("backend", ["CPU_ATTN", "FLASH_ATTN"])
def test_every_kv_dtype_moves_bit_exact_through_a_container(torch_name: str, kv_dtype: str, backend: str) -> None:
    """A block read out of one paged cache, encoded as kvsp-layout-1, decoded and written into
    another cache has the same bits (bf16 and fp8 have no numpy dtype: integer views)."""
    from kvsp_moq.kvsp.layout import Geometry, decode_raw_layer, encode_raw_layer

    dtype = getattr(torch, torch_name)
    shape = (BLOCKS, H, N, 2 * D)
    source = _random_bits(shape, dtype, seed=len(torch_name))
    layout = layout_for(backend, shape, kv_heads=H, head_dim=D, block_tokens=N)
    geometry = Geometry.from_descriptor_fields(H, D, kv_dtype)
    k, v = layout.read(source, 3)
    assert k.dtype.itemsize == geometry.dtype.itemsize and k.shape == (N, H, D)
    section_k, section_v = encode_raw_layer(k, v, geometry)
    k2, v2 = decode_raw_layer(section_k, section_v, geometry, N)  # read-only views, as a sink gives
    target = torch.zeros(shape, dtype=dtype)
    layout.write(target, 1, k2, v2)
    assert torch.equal(_bits(target[1]), _bits(source[3]))
    assert not _bits(target[0]).any() and not _bits(target[2:]).any()  # one block written, no other


def test_a_section_of_another_element_size_is_refused() -> None:
    layout = layout_for("CPU_ATTN", (BLOCKS, H, N, 2 * D), kv_heads=H, head_dim=D, block_tokens=N)
    wrong = np.zeros((N, H, D), np.float32)  # 4-octet elements for a bf16 cache
    with pytest.raises(LayoutError, match="4-octet"):
        layout.write(torch.zeros(BLOCKS, H, N, 2 * D, dtype=torch.bfloat16), 0, wrong, wrong)


# -- descriptor -----------------------------------------------------------------------------------

def _model_dir(tmp_path: Path) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "model.safetensors").write_bytes(b"weights")
    (tmp_path / "tokenizer.json").write_text("{}")
    return tmp_path


def _vllm_config(model: Path, *, tokenizer: Path | None = None, tp: int = 1, pp: int = 1, cache_dtype: str = "auto",
                 dtype: torch.dtype = torch.bfloat16, rope: dict[str, object] | None = None) -> SimpleNamespace:
    """The parts of a ``VllmConfig`` the descriptor reads (duck-typed, as the module reads them)."""
    hf = SimpleNamespace(num_hidden_layers=4, rope_parameters=rope or {"rope_theta": 10000.0, "rope_type": "default"})
    mc = SimpleNamespace(model=str(model), tokenizer=str(tokenizer or model), served_model_name="tiny", dtype=dtype,
                         hf_text_config=hf, get_head_size=lambda: 32, get_total_num_kv_heads=lambda: 4)
    return SimpleNamespace(model_config=mc, cache_config=SimpleNamespace(cache_dtype=cache_dtype, block_size=32),
                           parallel_config=SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=pp))


@pytest.fixture(autouse=True)
def _digest_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSP_DIGEST_CACHE", str(tmp_path / "digests.json"))


def test_descriptor_from_the_engine_config(tmp_path: Path) -> None:
    root = _model_dir(tmp_path / "model")
    model = EngineModel.of(_vllm_config(root))
    doc = model.descriptor()
    assert (doc["kv_dtype"], doc["kv_heads"], doc["block_tokens"], doc["positional"]) == ("bf16", 4, 32, "rope;theta=10000")
    assert "tensor_parallel" not in doc and "adapters" not in doc and "kv_scales" not in doc
    first = compat_id(doc)
    (root / "model.safetensors").write_bytes(b"other weights")  # a new mtime and size: hashed again
    assert compat_id(EngineModel.of(_vllm_config(root)).descriptor()) != first
    # The configured tokenizer, not the model directory's.
    other = tmp_path / "tokenizer"
    other.mkdir()
    (other / "tokenizer.json").write_text('{"other": 1}')
    assert EngineModel.of(_vllm_config(root, tokenizer=other)).tokenizer_digest != model.tokenizer_digest
    (root / "tokenizer.json").unlink()
    with pytest.raises(DescriptorError, match="tokenizer"):
        EngineModel.of(_vllm_config(root))
    with pytest.raises(DescriptorError, match="pipeline"):
        EngineModel.of(_vllm_config(root, tokenizer=other, pp=2))


def test_each_tensor_parallel_rank_names_its_shard(tmp_path: Path) -> None:
    """Two ranks' blocks never mix: each rank's descriptor names its heads (and the parallel
    size), so the Compatibility IDs, hence the Block Keys and MOQT namespaces, differ."""
    root = _model_dir(tmp_path / "model")
    tp2 = EngineModel.of(_vllm_config(root, tp=2))
    r0, r1 = tp2.descriptor(0), tp2.descriptor(1)
    assert r0["kv_heads"] == r1["kv_heads"] == 2
    assert r0["tensor_parallel"] == {"rank": 0, "world_size": 2, "kv_heads": [0, 2]}
    assert r1["tensor_parallel"] == {"rank": 1, "world_size": 2, "kv_heads": [2, 4]}
    one = EngineModel.of(_vllm_config(root)).descriptor()
    ids = {compat_id(r0), compat_id(r1), compat_id(one)}
    assert len(ids) == 3
    keys = [block_keys(KEY, c, list(range(64)), 32) for c in ids]
    assert len({k for ks in keys for k in ks}) == 6
    # vLLM's split: consecutive ranges, or each head replicated over consecutive ranks.
    assert [shard_of(8, 4, r).member()["kv_heads"] for r in range(4)] == [[0, 2], [2, 4], [4, 6], [6, 8]]
    assert [shard_of(2, 8, r).first for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    with pytest.raises(DescriptorError):
        shard_of(6, 4, 0)
    with pytest.raises(DescriptorError):
        shard_of(4, 2, 2)


def test_an_adapter_is_part_of_the_descriptor(tmp_path: Path) -> None:
    root = _model_dir(tmp_path / "model")
    model = EngineModel.of(_vllm_config(root))
    adapter = tmp_path / "lora"
    adapter.mkdir()
    (adapter / "adapter_model.safetensors").write_bytes(b"lora weights")
    digest = adapter_digest(adapter)
    assert digest.startswith("sha-256:")
    with_adapter = model.descriptor(0, [digest])
    assert with_adapter["adapters"] == [digest] and compat_id(with_adapter) != compat_id(model.descriptor())
    (adapter / "adapter_model.safetensors").write_bytes(b"other lora weights")
    assert adapter_digest(adapter) != digest
    with pytest.raises(DescriptorError, match="adapters"):
        adapter_digest(tmp_path / "missing")


def test_fp8_descriptors_carry_the_checkpoint_scales(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    root = _model_dir(tmp_path / "model")
    with pytest.raises(DescriptorError, match="kv_scales"):  # not a safetensors file
        EngineModel.of(_vllm_config(root, cache_dtype="fp8_e4m3"))
    save_file({"model.layers.0.mlp.weight": torch.zeros(2)}, str(root / "model.safetensors"))
    unit = EngineModel.of(_vllm_config(root, cache_dtype="fp8_e4m3"))
    doc = unit.descriptor()
    assert doc["kv_dtype"] == "fp8-e4m3" and doc["kv_scales"] == kv_scales_digest([(1.0, 1.0)] * 4)
    assert "kv_scales" not in EngineModel.of(_vllm_config(root)).descriptor()
    scaled = _model_dir(tmp_path / "scaled")
    (scaled / "model.safetensors").unlink()
    save_file({"model.layers.2.self_attn.k_scale": torch.tensor(0.5),
               "model.layers.2.self_attn.v_scale": torch.tensor(0.25),
               "model.layers.0.mlp.weight": torch.zeros(2)}, str(scaled / "model.safetensors"))
    assert checkpoint_kv_scales([scaled / "model.safetensors"], 4) == [(1.0, 1.0), (1.0, 1.0), (0.5, 0.25), (1.0, 1.0)]
    other = EngineModel.of(_vllm_config(scaled, cache_dtype="fp8_e4m3")).descriptor()
    assert other["kv_scales"] == kv_scales_digest([(1.0, 1.0), (1.0, 1.0), (0.5, 0.25), (1.0, 1.0)]) != doc["kv_scales"]


def test_dtype_and_positional_from_the_engine() -> None:
    assert kv_dtype_name("auto", torch.float32) == "fp32"
    assert kv_dtype_name("auto", torch.bfloat16) == "bf16"
    assert kv_dtype_name("fp8_e5m2", torch.float16) == "fp8-e5m2"
    with pytest.raises(DescriptorError):
        kv_dtype_name("auto", torch.int32)
    assert positional_of(SimpleNamespace(rope_parameters={"rope_theta": 10000.0, "rope_type": "default"})) \
        == ("rope;theta=10000", None)
    # 1e6 is written as the reference model writes it (not 1e+06).
    assert positional_of(SimpleNamespace(rope_theta=1e6))[0] == "rope;theta=1000000"
    llama31 = SimpleNamespace(rope_parameters={"rope_theta": 500000.0, "rope_type": "llama3", "factor": 8.0,
                                               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                               "original_max_position_embeddings": 8192})
    assert positional_of(llama31) == ("rope;theta=500000;scaling=llama3;factor=8;original_max_position=8192",
                                      {"high_freq_factor": 4.0, "low_freq_factor": 1.0})
    partial = SimpleNamespace(rope_parameters={"rope_theta": 10000.0, "partial_rotary_factor": 0.5})
    assert positional_of(partial, 64)[0] == "rope;theta=10000;dim=32"
    assert positional_of(SimpleNamespace(rope_parameters={"rope_theta": 1e4, "rope_type": "dynamic", "factor": 2.5}))[0] \
        == "rope;theta=10000;scaling=ntk;factor=2.5"
    with pytest.raises(DescriptorError, match="registry"):
        positional_of(SimpleNamespace(rope_parameters={"rope_theta": 1e4, "rope_type": "longrope"}))
    with pytest.raises(DescriptorError):
        positional_of(SimpleNamespace())


def test_the_reference_model_and_the_connector_describe_one_model_alike(tmp_path: Path) -> None:
    """One formatter for both paths: the same model (weights, tokenizer, geometry, theta 1e6)
    described by the reference model and by the connector has one Compatibility ID."""
    from kvsp_moq.kvsp.layout import LAYOUT
    from kvsp_moq.model.config import ModelConfig
    from kvsp_moq.model.descriptor import build_descriptor as reference_descriptor
    from kvsp_moq.model.weights import ensure_model_files

    files = ensure_model_files(ModelConfig(name="same", layers=2, rope_theta=1e6), tmp_path / "ref")
    reference = reference_descriptor(files, block_tokens=16)
    positional, extra = positional_of(SimpleNamespace(rope_parameters={"rope_theta": 1000000.0, "rope_type": "default"}))
    connector = build_descriptor(model="same", model_digest=reference["model_digest"],
                                 tokenizer_digest=reference["tokenizer_digest"], layers=2,
                                 kv_heads=files.config.kv_heads, head_dim=files.config.head_dim, kv_dtype="fp32",
                                 positional=positional, positional_extra=extra, block_tokens=16)
    assert reference["positional"] == positional == "rope;theta=1000000" and reference["layout"] == LAYOUT
    assert connector == reference and compat_id(connector) == compat_id(reference)


def test_weights_are_hashed_once_per_host(tmp_path: Path) -> None:
    """The second describer of unchanged files reads the first one's digest (the cache), and a
    file changed in place (size or mtime) is hashed again."""
    weights = tmp_path / "w.safetensors"
    weights.write_bytes(b"x" * 1000)
    cache = tmp_path / "cache.json"
    calls: list[int] = []

    def counting(files: Sequence[Path]) -> str:
        calls.append(1)
        return model_digest(files)

    first = files_digest([weights], compute=counting, cache=cache)
    assert files_digest([weights], compute=counting, cache=cache) == first == model_digest([weights])
    assert len(calls) == 1
    weights.write_bytes(b"y" * 1001)
    assert files_digest([weights], compute=counting, cache=cache) != first and len(calls) == 2
    cache.write_text("not json")  # a damaged cache is only a slower start
    assert files_digest([weights], compute=counting, cache=cache) == model_digest([weights]) and len(calls) == 3


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
    from kvsp_moq.integrations.vllm.transfers import Peers, begin_block, seal, write_layer
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
        assert seal(writer) and peers.publisher is not None
        assert await peers.publisher.publish_written(key) == ["store"]  # no IS, no holder here

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


def test_a_worker_whose_fp8_scales_are_not_its_descriptors_shares_nothing(tmp_path: Path) -> None:
    """The scales the layers run with are checked against those the descriptor (hence the
    Compatibility ID) states: on a mismatch the worker places and publishes nothing, and every
    block planned to load is reported failed (vLLM recomputes it)."""
    from safetensors.torch import save_file

    from kvsp_moq.integrations.vllm.plan import BlockLoad, RequestLoad, StepPlan
    from kvsp_moq.integrations.vllm.worker import WorkerSide

    root = _model_dir(tmp_path / "model")
    save_file({"model.layers.0.mlp.weight": torch.zeros(2)}, str(root / "model.safetensors"))
    model = EngineModel.of(_vllm_config(root, cache_dtype="fp8_e4m3"))
    caches = {f"model.layers.{i}.self_attn.attn": torch.zeros(BLOCKS, 4, 32, 64, dtype=torch.uint8) for i in range(4)}
    stated = model.kv_scales
    plan = StepPlan(loads=[RequestLoad("r", bytes(16), (bytes(32),), (BlockLoad(0, ((0, 3),), (bytes(32),), ((),)),))])
    for actual, shares in ((stated, True), (kv_scales_digest([(0.5, 1.0)] * 4), False)):
        worker = WorkerSide(ConnectorSettings(), model.descriptor())
        try:
            worker.register_kv_caches(caches, "CPU_ATTN", kv_scales=(actual, stated))
            assert (worker.layout is not None) == shares
            worker.start_load_kv(plan)  # no peers here either way: the block is reported failed
            assert worker.get_block_ids_with_load_errors() == {3}
        finally:
            worker.close()


# -- the scheduler's lookup never blocks vLLM's scheduler --------------------------------------------


def test_the_lookup_never_blocks_the_scheduler(tmp_path: Path) -> None:
    """A real ``kvsp index`` process, stalled (SIGSTOP): vLLM's scheduler is answered at once
    with "not yet" (``None``) while the lookup is in flight, and with no hit once its deadline
    has passed. Resumed (SIGCONT), the next request's lookup answers."""
    import concurrent.futures
    import os
    import signal
    import subprocess
    import sys

    from kvsp_moq.integrations.vllm.scheduler import SchedulerSide

    token = "lookup-token-0123456789abcdef"
    config = tmp_path / "kvsp.toml"
    config.write_text(f'[index]\nbase_path = "/"\n\n[[principals]]\nname = "e"\ntoken = "{token}"\nscopes = ["*"]\n')
    proc = subprocess.Popen([sys.executable, "-m", "kvsp_moq", "index", "--listen", "127.0.0.1:0", "--config",
                             str(config)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    scheduler = None
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # the process's first line (it exits, ending the read, on failure)
        assert line.startswith("kvsp index: listening on "), line
        url = line.split()[-1]
        settings = ConnectorSettings.from_extra({"index_url": url, "index_token": token, "scopes": {"a": KEY.hex()},
                                                 "default_scope": "a", "deadline_ms": 500})
        scheduler = SchedulerSide(settings, EngineModel.of(_vllm_config(_model_dir(tmp_path / "model"))))

        def request(rid: str) -> SimpleNamespace:
            return SimpleNamespace(request_id=rid, prompt_token_ids=list(range(3, 3 + 3 * 32 + 5)),
                                   kv_transfer_params=None, cache_salt=None, lora_request=None, mm_features=[])

        os.kill(proc.pid, signal.SIGSTOP)
        stalled = request("stalled")
        assert scheduler.get_num_new_matched_tokens(stalled, 0) == (None, False)  # not waited for
        lookup = scheduler._requests["stalled"].lookup
        assert lookup is not None
        concurrent.futures.wait([lookup], timeout=30)  # bounded on the client loop by deadline_ms
        assert lookup.done()
        assert scheduler.get_num_new_matched_tokens(stalled, 0) == (0, False)  # late: no hit, compute
        assert scheduler.lookup_failures == 1

        os.kill(proc.pid, signal.SIGCONT)
        answered = request("answered")
        assert scheduler.get_num_new_matched_tokens(answered, 0) in ((None, False), (0, False))
        lookup = scheduler._requests["answered"].lookup
        assert lookup is not None
        concurrent.futures.wait([lookup], timeout=30)
        assert scheduler.get_num_new_matched_tokens(answered, 0) == (0, False)  # answered: nothing matched
        assert scheduler.lookup_failures == 1 and scheduler.lookups == 2
    finally:
        if scheduler is not None:
            scheduler.close()
        os.kill(proc.pid, signal.SIGCONT)
        proc.terminate()
        proc.wait(30)


@pytest.mark.parametrize("value", [1199, 65528, True, "16384"])
def test_max_datagram_size_is_checked(value: object) -> None:
    with pytest.raises(SettingsError) as info:
        ConnectorSettings.from_extra({"max_datagram_size": value})
    assert info.value.key == "max_datagram_size"
    assert ConnectorSettings.from_extra({"max_datagram_size": 16384}).max_datagram_size == 16384


def test_requests_whose_kv_block_keys_do_not_cover_share_nothing(tmp_path: Path) -> None:
    """Multimodal inputs and prompt embeddings make KV that token ids do not name: such a
    request shares nothing (no lookup, no load, no publication) and says why; so does an adapter
    that is not a local directory. A plain request of the same tokens is shared."""
    from kvsp_moq.integrations.vllm.scheduler import SchedulerSide

    settings = ConnectorSettings.from_extra({"index_url": "http://127.0.0.1:9/", "scopes": {"a": KEY.hex()},
                                             "default_scope": "a"})
    scheduler = SchedulerSide(settings, EngineModel.of(_vllm_config(_model_dir(tmp_path / "model"))))
    try:
        def request(rid: str, **kw: object) -> SimpleNamespace:
            fields: dict[str, object] = {"request_id": rid, "prompt_token_ids": list(range(3, 40)),
                                         "kv_transfer_params": None, "cache_salt": None, "lora_request": None,
                                         "mm_features": [], "prompt_embeds": None}
            return SimpleNamespace(**{**fields, **kw})

        cases = {
            "image": (request("image", mm_features=[SimpleNamespace(identifier="abc")]), "multimodal inputs"),
            "embeds": (request("embeds", prompt_embeds=torch.zeros(37, 8)), "prompt embeddings"),
            "lora": (request("lora", lora_request=SimpleNamespace(lora_name="x", lora_path=str(tmp_path / "nope"))),
                     "LoRA adapter 'x'"),
        }
        for rid, (req, reason) in cases.items():
            assert scheduler.get_num_new_matched_tokens(req, 0) == (0, False)
            assert rid not in scheduler._requests  # no Block Keys, no lookup, no saves planned
            finished = scheduler.request_finished(req)
            assert finished is not None and finished["kvsp"]["shared"] is False
            assert reason in finished["kvsp"]["reason"], finished
        assert scheduler.lookups == 0
        plain = request("plain")
        scheduler.get_num_new_matched_tokens(plain, 0)  # 1 complete block of 32: nothing to look up
        assert "plain" in scheduler._requests
    finally:
        scheduler.close()


# -- the worker's publications run in the background, bounded --------------------------------------


def _role(args: list[str], config: Path, banner: str) -> tuple[object, str]:
    """A real ``kvsp`` role process on loopback and its URL (its first line)."""
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-m", "kvsp_moq", *args, "--listen", "127.0.0.1:0", "--config",
                             str(config)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()  # its first line (the read ends, and this fails, if it exits)
    assert line.startswith(banner), line
    return proc, line.split()[-1]


def test_publications_run_in_the_background_and_a_stalled_holder_never_holds_a_step(tmp_path: Path) -> None:
    """Real ``kvsp index`` and ``kvsp holder`` processes; the holder stalled (SIGSTOP). A step
    that saves a block returns with the block sealed (``blocks_published``: in the worker's
    store, served over MOQT) while its HTTP PUT is still in flight (``flush`` says so); with
    ``max_saves_in_flight`` = 1 the next block is kept but not PUT (``publish_dropped``).
    Resumed (SIGCONT), the PUT completes and nothing failed."""
    import os
    import signal

    from kvsp_moq.integrations.vllm.plan import BlockSave, RequestSave, StepPlan
    from kvsp_moq.integrations.vllm.worker import WorkerSide
    from kvsp_moq.kvsp.scope import scope_id

    token = "publish-token-0123456789abcdef"
    grants = f'[[principals]]\nname = "all"\ntoken = "{token}"\nscopes = ["*"]\nholders = ["*"]\ninstances = ["*"]\n'
    (tmp_path / "index.toml").write_text('[index]\nbase_path = "/"\n\n' + grants)
    index, index_url = _role(["index"], tmp_path / "index.toml", "kvsp index: listening on ")
    procs = [index]
    worker = None
    try:
        (tmp_path / "holder.toml").write_text(f'[holder]\nindex_url = "{index_url}"\nindex_token = "{token}"\n'
                                              f'tiers = [{{kind = "host", capacity = 16777216}}]\n\n' + grants)
        holder, holder_url = _role(["holder"], tmp_path / "holder.toml", "kvsp holder: listening on ")
        procs.append(holder)
        settings = ConnectorSettings.from_extra({
            "index_url": index_url, "index_token": token, "holder_url": holder_url, "holder_token": token,
            "scopes": {"a": KEY.hex()}, "default_scope": "a", "deadline_ms": 10_000, "max_saves_in_flight": 1})
        model = EngineModel.of(_vllm_config(_model_dir(tmp_path / "model")))
        worker = WorkerSide(settings, model.descriptor())
        caches = {f"model.layers.{i}.self_attn.attn": torch.randn(BLOCKS, 4, 32, 64).to(torch.bfloat16) for i in range(4)}
        worker.register_kv_caches(caches, "CPU_ATTN")
        compat = compat_id(model.descriptor())
        keys = block_keys(KEY, compat, list(range(3, 3 + 2 * 32)), 32)

        def step(block: int) -> dict[str, dict[str, int]]:
            plan = StepPlan(saves=[RequestSave(f"r{block}", scope_id(KEY), (compat,),
                                               (BlockSave(block, (block,), (keys[block],)),))])
            worker.start_load_kv(plan)
            for name, cache in caches.items():
                worker.save_kv_layer(name, cache, plan)
            worker.wait_for_save()
            return worker.take_counts()

        os.kill(holder.pid, signal.SIGSTOP)  # type: ignore[attr-defined]
        assert step(0) == {"r0": {"blocks_published": 1}}  # sealed; its PUT waits on the stalled holder
        assert not worker.flush(0.2)  # ... in the background: the step did not wait for it
        assert step(1) == {"r1": {"blocks_published": 1, "publish_dropped": 1}}  # one in flight at most
        os.kill(holder.pid, signal.SIGCONT)  # type: ignore[attr-defined]
        assert worker.flush(30)
        assert worker.take_counts() == {}  # the PUT went through: no publish_errors
    finally:
        if worker is not None:
            worker.close()
        for proc in procs:
            os.kill(proc.pid, signal.SIGCONT)  # type: ignore[attr-defined]
            proc.terminate()  # type: ignore[attr-defined]
            proc.wait(30)  # type: ignore[attr-defined]
