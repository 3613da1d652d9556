"""Device tier: torch tensors (a CPU tensor standing in without a GPU; the CUDA tests run only
where CUDA is available), and a storage package that imports without torch."""

from __future__ import annotations

import hashlib
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from kvsp_moq.kvsp.container import decode_container, encode_container  # noqa: E402
from kvsp_moq.kvsp.layout import Geometry  # noqa: E402
from kvsp_moq.kvsp.registries import CODEC_RAW, ELEMENT_TYPES  # noqa: E402
from kvsp_moq.storage import (  # noqa: E402
    BlockStore,
    DeviceTier,
    DiskTier,
    HostTier,
    NotAddressable,
    RecordKey,
)

RAW = CODEC_RAW.value
BF16 = Geometry(kv_heads=2, head_dim=8, dtype=ELEMENT_TYPES["bf16"])  # 32 octets a token
CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")


def make_key(seed: int = 0) -> RecordKey:
    rng = np.random.default_rng(seed)
    return RecordKey(rng.bytes(32), rng.bytes(16), rng.bytes(32))


def bf16_layers(count: int, tokens: int, device: str = "cpu") -> list[tuple[object, object]]:
    gen = torch.Generator().manual_seed(11)
    shape = (tokens, BF16.kv_heads, BF16.head_dim)
    return [
        (torch.randn(shape, generator=gen, dtype=torch.bfloat16).to(device),
         torch.randn(shape, generator=gen, dtype=torch.bfloat16).to(device))
        for _ in range(count)
    ]


def as_bytes(tensor: object) -> bytes:
    t = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)  # type: ignore[attr-defined]
    return bytes(t.numpy())


def expected_container(layers: list[tuple[object, object]], tokens: int) -> bytes:
    return encode_container(RAW, 0, tokens, [(as_bytes(k), as_bytes(v)) for k, v in layers])


def test_cpu_device_tier_round_trip_and_tensors(tmp_path: Path) -> None:
    tier = DeviceTier(1 << 20, device="cpu", read_mbit_per_s=2_000_000)
    assert tier.device.type == "cpu" and tier.host_addressable and not tier.is_cuda
    store = BlockStore([tier, HostTier(1 << 20)])
    layers = bf16_layers(4, 3)
    data = expected_container(layers, 3)
    key = make_key()
    info = store.put_layers(key, layers, token_count=3, geometry=BF16)  # tensors in, no numpy detour
    assert info.residency[0].tier == "device" and info.residency[0].read_mbit_per_s == 2_000_000
    assert b"".join(store.open_reader(key)) == data
    assert list(info.layer_digests) == decode_container(data).layer_digests()
    k, v = store.layer_tensors(key, 2)
    assert k.dtype == torch.uint8 and k.device.type == "cpu"
    # A consumer reinterprets the octets with its own dtype and shape (kvsp-layout-1).
    assert torch.equal(k.view(torch.bfloat16).reshape(3, 2, 8), layers[2][0])
    assert torch.equal(v.view(torch.bfloat16).reshape(3, 2, 8), layers[2][1])
    assert bytes(store.layer_views(key, 1)[1]) == as_bytes(layers[1][1])

    store.demote(key, "host", 2, 3)  # device -> host copies tensors straight into host buffers
    assert [(r.tier, r.layers) for r in store.info(key).residency] == [("device", (0, 1)), ("host", (2, 3))]
    with pytest.raises(NotAddressable):
        store.layer_tensors(key, 3)
    store.promote(key)
    assert b"".join(store.open_reader(key)) == data


def test_writer_takes_tensors_into_every_tier(tmp_path: Path) -> None:
    store = BlockStore([
        DeviceTier(2 * 2 * 64, device="cpu"), HostTier(2 * 2 * 64), DiskTier(tmp_path / "d", 1 << 20),
    ])
    layers = bf16_layers(6, 2)  # 64-octet sections
    writer = store.begin(make_key(), BF16, 6, 2)
    for layer, (k, v) in enumerate(layers):
        writer.write_layer(layer, k, v)
    info = writer.finish()
    assert [r.tier for r in info.residency] == ["device", "host", "disk"]
    data = expected_container(layers, 2)
    assert b"".join(store.open_reader(make_key())) == data
    assert store.container_sha256(make_key()) == hashlib.sha256(data).digest()


def test_storage_imports_and_works_without_torch() -> None:
    code = textwrap.dedent(
        """
        import sys
        sys.modules["torch"] = None  # any `import torch` now fails
        from kvsp_moq.storage import BlockStore, DeviceTier, HostTier, RecordKey, StorageError
        from kvsp_moq.kvsp.container import encode_container
        data = encode_container(1, 0, 1, [(b"k" * 8, b"v" * 8)])
        store = BlockStore([HostTier(1024)])
        key = RecordKey(bytes(32), bytes(16), bytes(32))
        store.put(key, data)
        assert b"".join(store.open_reader(key)) == data
        try:
            DeviceTier(1024)
        except StorageError as exc:
            print("no torch:", exc)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "no torch" in out.stdout


# ---------------------------------------------------------------------------------------------
# CUDA (skipped without a GPU)


@needs_cuda
def test_cuda_device_tier_round_trip(tmp_path: Path) -> None:
    tier = DeviceTier(1 << 20)
    assert tier.is_cuda and not tier.host_addressable
    store = BlockStore([tier, HostTier(1 << 20), DiskTier(tmp_path / "d", 1 << 20)])
    layers = bf16_layers(4, 3, device="cuda")
    data = expected_container(layers, 3)
    key = make_key()
    info = store.put_layers(key, layers, token_count=3, geometry=BF16)  # device to device copies
    assert [r.tier for r in info.residency] == ["device"]
    assert b"".join(store.open_reader(key, chunk_size=17)) == data  # staged one layer at a time
    assert list(info.layer_digests) == decode_container(data).layer_digests()
    k, _ = store.layer_tensors(key, 1)
    assert k.is_cuda and torch.equal(k.view(torch.bfloat16).reshape(3, 2, 8), layers[1][0])
    with pytest.raises(NotAddressable):
        store.layer_views(key, 0)
    assert hashlib.sha256(store.layer_payload(key, 3)).digest() == info.layer_digests[3]
    store.demote(key, "host", 0, 1)
    store.demote(key, "disk", 2, 3)
    assert b"".join(store.open_reader(key)) == data
    store.promote(key)
    assert [r.tier for r in store.info(key).residency] == ["device"]
    assert b"".join(store.open_reader(key)) == data


@needs_cuda
def test_cuda_bytes_from_the_host_and_eviction_to_host(tmp_path: Path) -> None:
    store = BlockStore([DeviceTier(2 * 4 * 96), HostTier(1 << 20)])
    rng = np.random.default_rng(2)
    containers = {
        make_key(s): encode_container(RAW, 0, 6, [(rng.bytes(96), rng.bytes(96)) for _ in range(4)])
        for s in range(3)
    }
    for key, data in containers.items():
        store.put(key, data)  # host octets copied to the GPU
    assert [r.tier for r in store.info(make_key(0)).residency] == ["host"]  # demoted D2H
    for key, data in containers.items():
        assert b"".join(store.open_reader(key)) == data
