"""Block store: round trips per tier, residency, layer-range readers, put/begin/write, moves,
pins and removal (kvsp_moq.storage; kvsp-draft §4.3, §4.4, §6.6, §6.7)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest

from kvsp_moq.kvsp.container import decode_container, encode_container, extract_layers, replica_digest
from kvsp_moq.kvsp.errors import ContainerError
from kvsp_moq.kvsp.layout import Geometry, encode_raw_block
from kvsp_moq.kvsp.records import ReplicaRecord, Residency
from kvsp_moq.kvsp.registries import CODEC_RAW, ELEMENT_TYPES
from kvsp_moq.storage import (
    BlockStore,
    DeviceTier,
    DiskTier,
    HostTier,
    IncompleteReplica,
    LayersUnavailable,
    LayerWritten,
    NotAddressable,
    RecordKey,
    ReplicaBusy,
    ReplicaExists,
    ReplicaNotFound,
    ReplicaPinned,
    StorageError,
    StoreFull,
    plan_placement,
)

RAW = CODEC_RAW.value
GEOMETRY = Geometry(kv_heads=2, head_dim=4, dtype=ELEMENT_TYPES["fp16"])  # 16 octets a token


def make_key(seed: int = 0) -> RecordKey:
    rng = np.random.default_rng(seed)
    return RecordKey(rng.bytes(32), rng.bytes(16), rng.bytes(32))


def make_container(layers: int = 8, section: int = 96, first: int = 0, seed: int = 1) -> bytes:
    rng = np.random.default_rng(seed)
    sections = [(rng.bytes(section), rng.bytes(section)) for _ in range(layers)]
    return encode_container(RAW, first, 6, sections)


def tier_of(kind: str, tmp_path: Path, capacity: int, rate: float | None = None) -> object:
    if kind == "device":
        return DeviceTier(capacity, device="cpu", read_mbit_per_s=rate)
    if kind == "host":
        return HostTier(capacity, read_mbit_per_s=rate)
    return DiskTier(tmp_path / "disk", capacity, read_mbit_per_s=rate)


def read_all(store: BlockStore, key: RecordKey, *args: int, **kw: object) -> bytes:
    return b"".join(store.open_reader(key, *args, **kw))  # type: ignore[arg-type]


@pytest.fixture
def split_store(tmp_path: Path) -> BlockStore:
    """device takes 2 layers of 192 octets, host 3, disk the rest."""
    return BlockStore([
        DeviceTier(2 * 192, device="cpu", read_mbit_per_s=1_000_000),
        HostTier(3 * 192, read_mbit_per_s=400_000),
        DiskTier(tmp_path / "disk", 1 << 20, read_mbit_per_s=20_000),
    ])


# ---------------------------------------------------------------------------------------------
# Round trips


@pytest.mark.parametrize("kind", ["device", "host", "disk"])
def test_round_trip_per_tier(kind: str, tmp_path: Path) -> None:
    data = make_container()
    store = BlockStore([tier_of(kind, tmp_path, 1 << 20, rate=1234.5)])  # type: ignore[list-item]
    key = make_key()
    info = store.put(key, data)

    reader = store.open_reader(key)
    assert reader.size == len(data)
    assert b"".join(reader) == data
    assert reader.sha256() == hashlib.sha256(data).digest()
    assert store.container_sha256(key) == hashlib.sha256(data).digest()

    container = decode_container(data)
    assert list(info.layer_digests) == container.layer_digests()
    assert info.layer_digests[3] == hashlib.sha256(container.layer_payload(3)).digest()
    assert info.digest == replica_digest(container.layer_digests())
    assert info.size == len(data) and info.complete and info.fully_resident
    assert info.residency == (Residency(tier=kind, layers=(0, 7), read_mbit_per_s=1234.5),)
    assert store.stats().tier(kind).used == container.header.data_size


def test_full_container_digest_is_cached(tmp_path: Path) -> None:
    data = make_container()
    store = BlockStore([HostTier(1 << 20)])
    key = make_key()
    store.put(key, data)
    assert store.open_reader(key).known_sha256 is None
    digest = store.container_sha256(key)
    assert store.open_reader(key).known_sha256 == digest
    assert store.open_reader(key, 0, 3).known_sha256 is None  # ranges are hashed on demand


def test_split_residency_entries_and_record(split_store: BlockStore) -> None:
    data = make_container(layers=8, section=96)
    key = make_key()
    info = split_store.put(key, data)
    assert info.residency == (
        Residency(tier="device", layers=(0, 1), read_mbit_per_s=1_000_000),
        Residency(tier="host", layers=(2, 4), read_mbit_per_s=400_000),
        Residency(tier="disk", layers=(5, 7), read_mbit_per_s=20_000),
    )
    assert read_all(split_store, key) == data

    record = info.replica_record("https://h1.example/kvsp/", ttl_ms=600_000)
    again = ReplicaRecord.from_json(record.to_json())  # digest vs layer digests, no overlap
    assert again.digest == info.digest and again.size == len(data)
    assert again.holds_layers(0, 7) and again.layers_in("host") == (range(2, 5),)

    moqt = info.replica_record("moqt://relay.example:4433", ttl_ms=1000)
    name = ReplicaRecord.from_json(moqt.to_json()).block_name()
    assert name is not None and name.replica_id == info.replica_id


@pytest.mark.parametrize(("first", "last"), [(0, 7), (0, 0), (7, 7), (1, 2), (2, 4), (4, 6), (0, 5), (3, 7)])
def test_layer_range_readers_match_extract_layers(split_store: BlockStore, first: int, last: int) -> None:
    data = make_container(layers=8, section=96)
    key = make_key()
    split_store.put(key, data)
    for chunk_size in (None, 1, 50, 4096):
        reader = split_store.open_reader(key, first, last, chunk_size=chunk_size)
        chunks = list(reader)
        if chunk_size is not None:
            assert all(c.nbytes <= chunk_size for c in chunks[1:])
        body = b"".join(chunks)
        assert body == extract_layers(data, first, last)
        assert reader.size == len(body)
        decoded = decode_container(body)
        assert (decoded.header.first_layer, decoded.header.last_layer) == (first, last)
        assert decoded.layer_digests() == decode_container(data).layer_digests()[first : last + 1]


def test_range_of_a_container_not_starting_at_zero(tmp_path: Path) -> None:
    data = make_container(layers=4, first=16)
    store = BlockStore([HostTier(1 << 20)])
    key = make_key()
    info = store.put(key, data)
    assert (info.first_layer, info.last_layer) == (16, 19)
    assert read_all(store, key, 17, 18) == extract_layers(data, 17, 18)
    assert info.replica_record("https://h/kvsp/", 1000).layer_digests is None
    with pytest.raises(LayersUnavailable):
        store.open_reader(key, 0, 16)


def test_layer_payloads_are_binding_v1_objects(split_store: BlockStore) -> None:
    data = make_container()
    key = make_key()
    info = split_store.put(key, data)
    reader = split_store.open_reader(key, 1, 6)
    for layer, payload in reader.layer_payloads():
        assert hashlib.sha256(payload).digest() == info.layer_digests[layer]
        assert split_store.layer_payload(key, layer) == payload


def test_layers_unavailable_and_not_found(split_store: BlockStore) -> None:
    key = make_key()
    with pytest.raises(ReplicaNotFound):
        split_store.open_reader(key)
    split_store.put(key, make_container(layers=8))
    for first, last in [(0, 8), (8, 9), (5, 4), (-1, 2)]:
        with pytest.raises(LayersUnavailable) as err:
            split_store.open_reader(key, first, last)
        assert err.value.available == ((0, 7),) and (err.value.first, err.value.last) == (first, last)
    stats = split_store.stats()
    assert (stats.hits, stats.misses) == (0, 5)
    split_store.open_reader(key, 0, 1)
    split_store.open_reader(key, touch=False)  # not an access: not counted
    assert (split_store.stats().hits, split_store.stats().misses) == (1, 5)


def test_layer_views(split_store: BlockStore) -> None:
    data = make_container(layers=8, section=96)
    key = make_key()
    split_store.put(key, data)
    container = decode_container(data)
    for layer in range(5):  # device (CPU stand-in) and host: zero-copy host memory
        k, v = split_store.layer_views(key, layer)
        assert k.readonly and v.readonly
        assert (bytes(k), bytes(v)) == (bytes(container.layer(layer).k), bytes(container.layer(layer).v))
    with pytest.raises(NotAddressable):
        split_store.layer_views(key, 6)  # disk: only on request
    k, v = split_store.layer_views(key, 6, allow_disk=True)
    assert bytes(k) + bytes(v) == bytes(container.layer_payload(6))
    with pytest.raises(NotAddressable):
        split_store.layer_tensors(key, 3)
    k_t, v_t = split_store.layer_tensors(key, 0)
    assert bytes(k_t.numpy()) == bytes(container.layer(0).k)


# ---------------------------------------------------------------------------------------------
# Placement


def test_plan_placement() -> None:
    assert plan_placement([10, 10, 10], [25, 100]) == [0, 0, 1]
    assert plan_placement([10, 10, 10], [0, 0, 30]) == [2, 2, 2]
    assert plan_placement([10, 30, 10], [15, 100]) == [0, 1, 1]  # never back up a tier
    assert plan_placement([10, 10], [10, 5]) is None
    assert plan_placement([0, 0], [0]) == [0, 0]
    assert plan_placement([1], []) is None


def test_placement_uses_free_space_and_eviction(tmp_path: Path) -> None:
    store = BlockStore([HostTier(4 * 192, name="fast"), HostTier(16 * 192, name="slow")])
    a, b = make_key(1), make_key(2)
    assert [r.tier for r in store.put(a, make_container(layers=6)).residency] == ["fast", "slow"]
    # b, the newest, takes the fast tier; a's fast layers are demoted (all of them: a victim
    # leaves a tier as a whole), none are lost.
    info = store.put(b, make_container(layers=3, seed=2))
    assert info.residency == (Residency(tier="fast", layers=(0, 2)),)
    assert store.info(a).residency == (Residency(tier="slow", layers=(0, 5)),)
    assert store.stats().demotions == 1 and store.stats().evictions == 0
    assert read_all(store, a) == make_container(layers=6)


# ---------------------------------------------------------------------------------------------
# put


def test_put_rejects_bad_containers_before_evicting(tmp_path: Path) -> None:
    store = BlockStore([HostTier(8 * 192)])
    evicted: list[RecordKey] = []
    store.add_evict_listener(lambda k, r: evicted.append(k))
    store.put(make_key(1), make_container())  # fills the tier
    data = make_container()
    key = make_key(2)
    with pytest.raises(ContainerError):
        store.put(key, data[:-1])
    with pytest.raises(ContainerError):
        store.put(key, b"KVB2" + data[4:])
    with pytest.raises(ContainerError):  # 96-octet sections are not 6 tokens of 32 octets
        store.put(key, data, geometry=Geometry(4, 4, ELEMENT_TYPES["fp16"]))
    digests = decode_container(data).layer_digests()
    wrong = list(digests)
    wrong[5] = bytes(32)
    with pytest.raises(ContainerError):
        store.put(key, data, expected_layer_digests=wrong)
    assert key not in store and evicted == [] and len(store) == 1
    store.put(key, data, expected_layer_digests=digests)
    assert evicted == [make_key(1)]


def test_put_accepts_a_decoded_container_and_decoded_layers(tmp_path: Path) -> None:
    store = BlockStore([HostTier(1 << 20)])
    rng = np.random.default_rng(3)
    arrays = [
        (rng.standard_normal((5, 2, 4)).astype(np.float16), rng.standard_normal((5, 2, 4)).astype(np.float16))
        for _ in range(4)
    ]
    block = encode_raw_block(arrays, GEOMETRY)
    store.put(make_key(1), decode_container(block), geometry=GEOMETRY)
    store.put_layers(make_key(2), arrays, token_count=5, geometry=GEOMETRY)
    # Big-endian arrays are laid out little-endian (kvsp-layout-1) on the way in.
    swapped = [(k.astype(">f2"), v.astype(">f2")) for k, v in arrays]
    store.put_layers(make_key(3), swapped, token_count=5, geometry=GEOMETRY)
    store.put_layers(make_key(4), [(k.tobytes(), memoryview(v.tobytes())) for k, v in arrays], token_count=5)
    for seed in (1, 2, 3, 4):
        assert read_all(store, make_key(seed)) == block
    with pytest.raises(ContainerError):
        store.put_layers(make_key(5), arrays, token_count=6, geometry=GEOMETRY)
    with pytest.raises(ContainerError):
        store.put_layers(make_key(5), [], token_count=5)


def test_put_layers_takes_the_digests_its_caller_computed_over_the_same_octets() -> None:
    """The prefetch path's layers were hashed by the decoder as they arrived (§4.3): the store
    takes those digests instead of hashing again, and still checks them against the record's."""
    store = BlockStore([HostTier(1 << 20)])
    block = decode_container(make_container(seed=7))
    layers = [(layer.k, layer.v) for layer in block.layers()]
    digests = block.layer_digests()
    info = store.put_layers(make_key(1), layers, token_count=block.header.token_count, known_layer_digests=digests)
    assert list(info.layer_digests) == digests and read_all(store, make_key(1)) == make_container(seed=7)
    with pytest.raises(ContainerError):  # the record's digests are checked against the known ones
        store.put_layers(make_key(2), layers, token_count=block.header.token_count, known_layer_digests=digests,
                         expected_layer_digests=[bytes(32)] * len(digests))
    with pytest.raises(ValueError):  # one per layer
        store.put_layers(make_key(2), layers, token_count=block.header.token_count, known_layer_digests=digests[1:])
    assert store.get(make_key(2)) is None


def test_replica_exists_keeps_the_existing_copy(tmp_path: Path) -> None:
    store = BlockStore([HostTier(1 << 20)])
    key = make_key()
    first = store.put(key, make_container(seed=1))
    with pytest.raises(ReplicaExists) as err:
        store.put(key, make_container(seed=2))
    assert err.value.replica_id == first.replica_id
    with pytest.raises(ReplicaExists):
        store.begin(key, GEOMETRY, 4, 6)
    with pytest.raises(ReplicaExists):
        store.put_layers(key, [(b"x", b"y")], token_count=1)
    assert read_all(store, key) == make_container(seed=1)


def test_replica_ids(tmp_path: Path) -> None:
    store = BlockStore([HostTier(1 << 20)])
    a = store.put(make_key(1), make_container())
    b = store.put(make_key(2), make_container())
    assert len(a.replica_id) == 16 and a.replica_id != b.replica_id  # binding v1: new per replica
    rid = bytes(range(16))
    assert store.put(make_key(3), make_container(), replica_id=rid).replica_id == rid
    with pytest.raises(ValueError):
        store.put(make_key(4), make_container(), replica_id=rid)  # in use
    with pytest.raises(ValueError):
        store.put(make_key(4), make_container(), replica_id=b"short")
    store.remove(make_key(3))
    store.put(make_key(4), make_container(), replica_id=rid)  # free again


def test_store_full_when_bigger_than_every_tier(tmp_path: Path) -> None:
    store = BlockStore([HostTier(1000), DiskTier(tmp_path / "d", 1000)])
    with pytest.raises(StoreFull):
        store.put(make_key(), make_container(layers=12, section=96))
    assert len(store) == 0 and store.stats().used == 0
    assert list((tmp_path / "d").iterdir()) == []


# ---------------------------------------------------------------------------------------------
# The incremental writer


def raw_layers(count: int, tokens: int, seed: int = 5) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    shape = (tokens, GEOMETRY.kv_heads, GEOMETRY.head_dim)
    return [(rng.standard_normal(shape).astype(np.float16), rng.standard_normal(shape).astype(np.float16)) for _ in range(count)]


def test_writer_emits_one_event_per_layer_and_layers_are_readable_at_once(split_store: BlockStore) -> None:
    arrays = raw_layers(8, 6)  # 96-octet sections: split over device, host, disk
    block = encode_raw_block(arrays, GEOMETRY)
    key = make_key()
    events: list[LayerWritten] = []
    seen_bytes: list[bytes] = []

    def on_layer(event: LayerWritten) -> None:
        events.append(event)
        # A publisher sends the layer as soon as it is announced (binding v1 object).
        seen_bytes.append(bytes(split_store.layer_payload(key, event.layer, touch=False)))

    writer = split_store.begin(key, GEOMETRY, 8, 6, on_layer=on_layer)
    assert split_store.info(key).complete is False and split_store.info(key).residency == ()
    assert split_store.stats().writing == 1
    for layer, (k, v) in enumerate(arrays):
        digest = writer.write_layer(layer, k, v)
        assert events[-1] == LayerWritten(key, writer.replica_id, layer, digest, 96, 96, 7 - layer)
        assert read_all(split_store, key, 0, layer) == extract_layers(block, 0, layer)
        if layer < 7:
            with pytest.raises(LayersUnavailable):
                split_store.open_reader(key, 0, layer + 1)
    info = writer.finish()
    container = decode_container(block)
    assert [e.digest for e in events] == container.layer_digests()
    assert seen_bytes == [bytes(container.layer_payload(l)) for l in range(8)]
    assert info.complete and info.digest == container.replica_digest()
    assert [r.tier for r in info.residency] == ["device", "host", "disk"]
    assert read_all(split_store, key) == block
    assert not writer.open and split_store.stats().puts == 1


def test_writer_out_of_order_and_errors(tmp_path: Path) -> None:
    store = BlockStore([HostTier(1 << 20)])
    arrays = raw_layers(4, 3)
    key = make_key()
    writer = store.begin(key, GEOMETRY, range(10, 14), 3)
    assert writer.layers == range(10, 14)
    writer.write_layer(12, *arrays[2])
    writer.write_layer(10, arrays[0][0].tobytes(), arrays[0][1].tobytes())
    with pytest.raises(ValueError):
        writer.write_layer(12, *arrays[2])  # each layer once
    with pytest.raises(ContainerError):
        writer.write_layer(9, *arrays[0])
    with pytest.raises(ContainerError):
        writer.write_layer(11, b"short", b"short")
    with pytest.raises(IncompleteReplica) as err:
        writer.finish()
    assert err.value.missing == (11, 13)
    with pytest.raises(ReplicaBusy):
        store.remove(key)
    with pytest.raises(ReplicaBusy):
        store.demote(key)
    assert store.info(key).residency == (Residency(tier="host", layers=(10, 10)), Residency(tier="host", layers=(12, 12)))
    writer.write_layer(11, *arrays[1])
    writer.write_layer(13, *arrays[3])
    writer.finish()
    assert read_all(store, key) == encode_raw_block(arrays, GEOMETRY, first_layer=10)
    with pytest.raises(StorageError):
        writer.write_layer(13, *arrays[3])


def test_writer_abort_and_context_manager(tmp_path: Path) -> None:
    store = BlockStore([HostTier(1 << 16), DiskTier(tmp_path / "d", 1 << 16)])
    evicted: list[tuple[RecordKey, bytes]] = []
    store.add_evict_listener(lambda k, r: evicted.append((k, r)))
    arrays = raw_layers(2, 2)
    with pytest.raises(RuntimeError):
        with store.begin(make_key(1), GEOMETRY, 2, 2) as writer:
            writer.write_layer(0, *arrays[0])
            raise RuntimeError("prefill failed")
    assert evicted == [(make_key(1), writer.replica_id)]  # announced: it may have been published
    assert make_key(1) not in store and store.stats().used == 0 and store.stats().removals == 1
    with store.begin(make_key(2), GEOMETRY, 2, 2) as writer:
        for layer, (k, v) in enumerate(arrays):
            writer.write_layer(layer, k, v)
    assert store.info(make_key(2)).complete
    with store.begin(make_key(3), GEOMETRY, 2, 2) as writer:
        writer.write_layer(0, *arrays[0])
        writer.abort()
    assert make_key(3) not in store
    assert not [p for p in (tmp_path / "d").iterdir() if p.name.endswith(".tmp")]


def test_writer_listener_failure_does_not_break_storage(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store = BlockStore([HostTier(1 << 16)])

    def broken(event: LayerWritten) -> None:
        raise RuntimeError("publisher down")

    writer = store.begin(make_key(), GEOMETRY, 1, 2, on_layer=broken)
    writer.write_layer(0, *raw_layers(1, 2)[0])
    assert writer.finish().complete
    assert "publisher down" in caplog.text


# ---------------------------------------------------------------------------------------------
# Moving between tiers


def test_promote_demote_move(split_store: BlockStore) -> None:
    data = make_container(layers=8, section=96)
    key, other = make_key(1), make_key(2)
    split_store.put(key, data)
    changes: list[RecordKey] = []
    split_store.add_residency_listener(lambda k, r: changes.append(k))

    info = split_store.demote(key)  # all to the slowest tier
    assert info.residency == (Residency(tier="disk", layers=(0, 7), read_mbit_per_s=20_000),)
    assert read_all(split_store, key) == data
    info = split_store.promote(key, "host", 0, 2)
    assert [(r.tier, r.layers) for r in info.residency] == [("host", (0, 2)), ("disk", (3, 7))]
    info = split_store.promote(key, first_layer=0, last_layer=1)  # to the fastest
    assert [(r.tier, r.layers) for r in info.residency] == [("device", (0, 1)), ("host", (2, 2)), ("disk", (3, 7))]
    info = split_store.demote(key, "host", 0, 7)  # only faster layers move down
    assert [(r.tier, r.layers) for r in info.residency] == [("host", (0, 2)), ("disk", (3, 7))]
    info = split_store.move(key, "disk", 1, 1)
    info = split_store.move(key, "host", 6, 6)
    assert [(r.tier, r.layers) for r in info.residency] == [
        ("host", (0, 0)), ("disk", (1, 1)), ("host", (2, 2)), ("disk", (3, 5)), ("host", (6, 6)), ("disk", (7, 7))]
    assert read_all(split_store, key) == data
    assert read_all(split_store, key, 2, 6) == extract_layers(data, 2, 6)
    assert changes == [key] * 6
    split_store.promote(key, "disk")  # nothing slower than disk: no change, no event
    assert changes == [key] * 6
    with pytest.raises(StoreFull):  # the host is full of this replica's own layers
        split_store.move(key, "host", 7, 7)
    assert read_all(split_store, key) == data

    # Moving a pinned replica is fine; moving into a tier full of pinned data is not.
    split_store.put(other, make_container(layers=2, section=96, seed=9))
    split_store.pin(other, "lease")
    split_store.pin(key, "lease")
    with pytest.raises(StoreFull):
        split_store.promote(key, "device", 3, 5)
    with pytest.raises(LayersUnavailable):
        split_store.move(key, "host", 6, 9)
    with pytest.raises(KeyError):
        split_store.move(key, "tape")


# ---------------------------------------------------------------------------------------------
# Pins and removal


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_pins_and_remove(tmp_path: Path) -> None:
    clock = FakeClock()
    store = BlockStore([HostTier(1 << 16)], clock=clock)
    key = make_key()
    evicted: list[RecordKey] = []
    store.add_evict_listener(lambda k, r: evicted.append(k))
    info = store.put(key, make_container())
    store.pin(key, "lease-a", ttl_ms=2000)
    store.pin(key, "lease-b")
    assert store.is_pinned(key) and store.info(key).pinned
    assert set(store.pin_owners(key)) == {"lease-a", "lease-b"}
    with pytest.raises(ReplicaPinned):
        store.remove(key)
    assert store.unpin(key, "lease-b") and not store.unpin(key, "lease-b")
    clock.now += 1.5
    assert store.is_pinned(key)
    store.pin(key, "lease-a", ttl_ms=2000)  # a renewal restarts the TTL
    clock.now += 1.5
    assert store.is_pinned(key)
    clock.now += 0.6
    assert not store.is_pinned(key) and store.pin_owners(key) == ()
    with pytest.raises(ReplicaNotFound):
        store.pin(key, "x", replica_id=bytes(16))
    with pytest.raises(ValueError):
        store.pin(key, "x", ttl_ms=0)
    store.pin(key, "fault")
    store.remove(key, force=True)  # §6.6: a fault; the record is withdrawn first (listener)
    assert evicted == [key] and key not in store and store.stats().removals == 1
    with pytest.raises(ReplicaNotFound):
        store.remove(key)
    assert not store.unpin(key, "fault")
    assert store.put(key, make_container()).replica_id != info.replica_id


def test_stats(split_store: BlockStore) -> None:
    split_store.put(make_key(1), make_container(layers=8))
    split_store.pin(make_key(1), "l")
    stats = split_store.stats()
    assert (stats.replicas, stats.pinned, stats.writing, stats.puts) == (1, 1, 0, 1)
    assert [(t.name, t.used, t.layers, t.replicas) for t in stats.tiers] == [
        ("device", 384, 2, 1), ("host", 576, 3, 1), ("disk", 576, 3, 1)]
    assert stats.tier("host").free == 0 and stats.used == 8 * 192
