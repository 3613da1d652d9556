"""Disk tier: atomic replica files, reopening after a restart, rewriting on moves, and
streaming reads that never materialize a container (kvsp_moq.storage)."""

from __future__ import annotations

import gc
import hashlib
import json
import struct
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from kvsp_moq.kvsp.container import decode_container, encode_container, extract_layers
from kvsp_moq.kvsp.registries import CODEC_RAW
from kvsp_moq.storage import (
    BlockStore,
    DiskTier,
    HostTier,
    LayersUnavailable,
    RecordKey,
)

RAW = CODEC_RAW.value


def make_key(seed: int = 0) -> RecordKey:
    rng = np.random.default_rng(seed)
    return RecordKey(rng.bytes(32), rng.bytes(16), rng.bytes(32))


def make_container(layers: int = 8, section: int = 96, seed: int = 1) -> bytes:
    rng = np.random.default_rng(seed)
    return encode_container(RAW, 0, 6, [(rng.bytes(section), rng.bytes(section)) for _ in range(layers)])


def files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def test_atomic_write_and_file_layout(tmp_path: Path) -> None:
    directory = tmp_path / "disk"
    store = BlockStore([DiskTier(directory, 1 << 20)])
    data = make_container()
    info = store.put(make_key(), data)
    name = info.replica_id.hex() + ".kvsd"
    assert files(directory) == [name]  # the temporary file was renamed into place

    raw = (directory / name).read_bytes()
    magic, version, meta_len, data_offset = struct.unpack(">4sB3xIQ", raw[:20])
    assert (magic, version, data_offset % 4096) == (b"KVSD", 1, 0)
    meta = json.loads(raw[20 : 20 + meta_len])
    assert meta["replica_id"] == info.replica_id.hex() and meta["file_layers"] == list(range(8))
    assert meta["layer_digests"] == [d.hex() for d in decode_container(data).layer_digests()]
    # The data section is the K || V of each layer: the container without its header.
    assert raw[data_offset:] == data[decode_container(data).header.header_size :]


def test_reopen_after_restart(tmp_path: Path) -> None:
    directory = tmp_path / "disk"
    store = BlockStore([DiskTier(directory, 1 << 20, read_mbit_per_s=8000)])
    containers = {make_key(s): make_container(layers=4 + s, seed=s) for s in range(3)}
    infos = {key: store.put(key, data) for key, data in containers.items()}
    store.touch(make_key(0))
    store.close()
    (directory / ".deadbeef.123.0.tmp").write_bytes(b"half-written")  # a crash mid-write

    reopened = BlockStore([HostTier(1 << 20), DiskTier(directory, 1 << 20, read_mbit_per_s=8000)])
    recovered = reopened.recover()
    assert {r.key for r in recovered} == set(containers)
    assert not [n for n in files(directory) if n.endswith(".tmp")]
    for key, data in containers.items():
        info = reopened.info(key)
        assert info.replica_id == infos[key].replica_id and info.digest == infos[key].digest
        assert info.residency[0].tier == "disk" and info.residency[0].read_mbit_per_s == 8000
        assert b"".join(reopened.open_reader(key)) == data
        assert reopened.container_sha256(key) == hashlib.sha256(data).digest()
    assert reopened.stats().tier("disk").used == sum(decode_container(d).header.data_size for d in containers.values())
    reopened.promote(make_key(1), "host")
    assert files(directory) == sorted(infos[k].replica_id.hex() + ".kvsd" for k in (make_key(0), make_key(2)))


def test_recovery_of_a_split_replica_keeps_its_record_digest(tmp_path: Path) -> None:
    directory = tmp_path / "disk"
    store = BlockStore([HostTier(3 * 192), DiskTier(directory, 1 << 20)])
    data = make_container(layers=8)
    info = store.put(make_key(), data)
    assert [(r.tier, r.layers) for r in info.residency] == [("host", (0, 2)), ("disk", (3, 7))]
    store.close()  # the host layers are gone with the process

    reopened = BlockStore([HostTier(1 << 20), DiskTier(directory, 1 << 20)])
    (back,) = reopened.recover()
    assert [(r.tier, r.layers) for r in back.residency] == [("disk", (3, 7))]
    assert back.digest == info.digest and back.layer_digests == info.layer_digests
    assert not back.fully_resident and back.holds_layers(3, 7)
    assert b"".join(reopened.open_reader(make_key(), 3, 7)) == extract_layers(data, 3, 7)
    with pytest.raises(LayersUnavailable):
        reopened.open_reader(make_key())
    record = back.replica_record("https://h/kvsp/", 1000)
    assert record.layer_digests == info.layer_digests and record.residency == back.residency


def test_recovery_removes_corrupt_and_foreign_files(tmp_path: Path) -> None:
    directory = tmp_path / "disk"
    store = BlockStore([DiskTier(directory, 1 << 20)])
    good = store.put(make_key(1), make_container(seed=1))
    bad = store.put(make_key(2), make_container(seed=2))
    short = store.put(make_key(3), make_container(seed=3))
    store.close()
    path = directory / (bad.replica_id.hex() + ".kvsd")
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF  # a flipped bit in the last layer
    path.write_bytes(raw)
    short_path = directory / (short.replica_id.hex() + ".kvsd")
    short_path.write_bytes(short_path.read_bytes()[:-10])  # torn
    (directory / "garbage.kvsd").write_bytes(b"not a replica file")
    (directory / "notes.txt").write_text("left alone")

    reopened = BlockStore([DiskTier(directory, 1 << 20)])
    assert [r.key for r in reopened.recover()] == [make_key(1)]
    assert files(directory) == sorted([good.replica_id.hex() + ".kvsd", "notes.txt"])


def test_recovery_without_verification_and_into_a_small_tier(tmp_path: Path) -> None:
    directory = tmp_path / "disk"
    store = BlockStore([DiskTier(directory, 1 << 20)])
    for seed in range(3):
        store.put(make_key(seed), make_container(seed=seed))
    store.close()
    small = BlockStore([DiskTier(directory, 2 * 8 * 192)])
    assert len(small.recover(verify=False)) == 2  # the third does not fit: removed
    assert len(files(directory)) == 2


def test_moves_rewrite_the_file_atomically(tmp_path: Path) -> None:
    directory = tmp_path / "disk"
    store = BlockStore([HostTier(1 << 20), DiskTier(directory, 1 << 20)])
    data = make_container(layers=8)
    key = make_key()
    info = store.put(key, data)
    assert files(directory) == []
    name = info.replica_id.hex() + ".kvsd"
    store.demote(key, "disk", 4, 7)
    assert files(directory) == [name]
    reader = store.open_reader(key, touch=False)  # holds views of the current file
    store.demote(key, "disk", 0, 1)  # the file is rewritten with layers 0-1 and 4-7
    assert files(directory) == [name]
    assert json.loads((directory / name).read_bytes()[20:].split(b"}", 1)[0] + b"}")["file_layers"] == [0, 1, 4, 5, 6, 7]
    store.promote(key, "host", 4, 5)
    assert b"".join(reader) == data == b"".join(store.open_reader(key))
    assert store.stats().tier("disk").used == 4 * 192
    store.promote(key, "host")
    assert files(directory) == [] and store.stats().tier("disk").used == 0
    assert b"".join(store.open_reader(key)) == data


def test_a_failing_disk_drops_the_victim_and_tells(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    directory = tmp_path / "disk"
    disk = DiskTier(directory, 1 << 20)
    store = BlockStore([HostTier(8 * 192), disk])
    evicted: list[RecordKey] = []
    store.add_evict_listener(lambda k, r: evicted.append(k))
    store.put(make_key(1), make_container(seed=1))

    def broken(*args: object, **kwargs: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(disk, "write_file", broken)
    store.put(make_key(2), make_container(seed=2))  # make_key(1) cannot be demoted: dropped
    assert evicted == [make_key(1)] and make_key(1) not in store
    with pytest.raises(OSError):
        store.demote(make_key(2))  # an explicit move reports the error and changes nothing
    assert b"".join(store.open_reader(make_key(2))) == make_container(seed=2)
    assert disk.used == 0 and files(directory) == []


# ---------------------------------------------------------------------------------------------
# Streaming without materializing the container


@pytest.mark.parametrize("kind", ["host", "disk"])
def test_streaming_a_32_mib_block_stays_within_a_small_memory_bound(kind: str, tmp_path: Path) -> None:
    layers, section = 32, 512 * 1024  # 32 MiB of K and V
    rng = np.random.default_rng(7)
    blob = rng.integers(0, 256, size=2 * layers * section, dtype=np.uint8)
    view = memoryview(blob)
    sections = [(view[(2 * i) * section : (2 * i + 1) * section], view[(2 * i + 1) * section : (2 * i + 2) * section]) for i in range(layers)]
    tier = HostTier(64 << 20) if kind == "host" else DiskTier(tmp_path / "disk", 64 << 20, fsync=False)
    store = BlockStore([tier])
    key = make_key()
    store.put_layers(key, sections, token_count=1)
    del sections, view
    # The expected digest, from the source buffer: K0 V0 K1 V1 ... is exactly its layout.
    expected = hashlib.sha256(store.open_reader(key).header.encode())
    expected.update(blob)
    gc.collect()

    tracemalloc.start()
    try:
        reader = store.open_reader(key, chunk_size=1 << 20)
        h = hashlib.sha256()
        total = 0
        for chunk in reader:
            h.update(chunk)
            total += chunk.nbytes
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert total == reader.size == 20 + 16 * layers + blob.nbytes
    assert h.digest() == expected.digest()
    assert peak < 1 << 20, f"streaming allocated {peak} octets"

    # A layer range streams the same way and equals the extracted range.
    ranged = store.open_reader(key, 10, 11)
    body = b"".join(ranged)
    assert decode_container(body).header.first_layer == 10
    assert body[ranged.header.header_size :] == blob[20 * section : 24 * section].tobytes()
