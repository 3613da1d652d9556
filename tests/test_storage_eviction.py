"""Block store eviction: LRU order, demotion, pins (kvsp-draft §6.6) and the evict listeners
(§6.1), including a randomized check of the invariants."""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from kvsp_moq.kvsp.container import encode_container
from kvsp_moq.kvsp.layout import Geometry
from kvsp_moq.kvsp.registries import CODEC_RAW, ELEMENT_TYPES
from kvsp_moq.storage import (
    BlockStore,
    DiskTier,
    HostTier,
    RecordKey,
    ReplicaNotFound,
    StoreFull,
)

RAW = CODEC_RAW.value
LAYER = 64  # octets of one layer (two 32-octet sections)


def make_key(seed: int) -> RecordKey:
    rng = np.random.default_rng(seed)
    return RecordKey(rng.bytes(32), rng.bytes(16), rng.bytes(32))


def make_container(layers: int, seed: int) -> bytes:
    rng = np.random.default_rng(seed + 1000)
    return encode_container(RAW, 0, 2, [(rng.bytes(LAYER // 2), rng.bytes(LAYER // 2)) for _ in range(layers)])


class Recorder:
    """An evict listener that checks, when called, that the octets are still there."""

    def __init__(self, store: BlockStore, expected: dict[RecordKey, bytes]) -> None:
        self.store = store
        self.expected = expected
        self.calls: list[RecordKey] = []
        store.add_evict_listener(self)

    def __call__(self, key: RecordKey, replica_id: bytes) -> None:
        assert self.store.info(key).replica_id == replica_id
        assert b"".join(self.store.open_reader(key, touch=False)) == self.expected[key]
        self.calls.append(key)


def host_store(replicas: int, layers: int = 2) -> tuple[BlockStore, dict[RecordKey, bytes], Recorder]:
    store = BlockStore([HostTier(replicas * layers * LAYER)])
    expected: dict[RecordKey, bytes] = {}
    return store, expected, Recorder(store, expected)


def put(store: BlockStore, expected: dict[RecordKey, bytes], seed: int, layers: int = 2) -> RecordKey:
    key = make_key(seed)
    expected[key] = make_container(layers, seed)
    store.put(key, expected[key])
    return key


def test_lru_order_within_a_tier() -> None:
    store, expected, rec = host_store(3)
    a, b, c = (put(store, expected, s) for s in (1, 2, 3))
    store.open_reader(a)  # a is now the most recently used
    d = put(store, expected, 4)
    assert rec.calls == [b]
    store.layer_views(c, 0)
    put(store, expected, 5)
    assert rec.calls == [b, a]
    store.touch(d)
    put(store, expected, 6)
    assert rec.calls == [b, a, c]
    store.open_reader(d, touch=False)  # not an access
    put(store, expected, 7)
    assert rec.calls == [b, a, c, make_key(5)]
    assert store.stats().evictions == 4


def test_one_put_evicts_as_many_as_needed_oldest_first() -> None:
    store, expected, rec = host_store(4, layers=1)
    keys = [put(store, expected, s, layers=1) for s in range(4)]
    put(store, expected, 10, layers=3)
    assert rec.calls == keys[:3]


def test_demotion_before_dropping(tmp_path: Path) -> None:
    store = BlockStore([HostTier(2 * LAYER, name="fast"), HostTier(4 * LAYER, name="slow")])
    expected: dict[RecordKey, bytes] = {}
    rec = Recorder(store, expected)
    moves: list[RecordKey] = []
    store.add_residency_listener(lambda k, r: moves.append(k))
    a = put(store, expected, 1)
    b = put(store, expected, 2)  # a is demoted to make room
    assert [r.tier for r in store.info(a).residency] == ["slow"] and moves == [a]
    c = put(store, expected, 3)  # b demoted; slow now holds a and b
    assert [r.tier for r in store.info(b).residency] == ["slow"] and rec.calls == []
    put(store, expected, 4)  # c must go down; slow is full: its oldest (a) is dropped for it
    assert rec.calls == [a] and [r.tier for r in store.info(c).residency] == ["slow"]
    stats = store.stats()
    assert (stats.demotions, stats.evictions) == (3, 1)


def test_a_victim_never_pushes_out_a_more_recently_used_replica() -> None:
    store = BlockStore([HostTier(2 * LAYER, name="fast"), HostTier(2 * LAYER, name="slow")])
    expected: dict[RecordKey, bytes] = {}
    rec = Recorder(store, expected)
    a = put(store, expected, 1)
    b = put(store, expected, 2)  # a demoted to slow
    store.touch(a)  # a (slow) is now more recently used than b (fast)
    put(store, expected, 3)  # b must leave fast; slow holds only a, newer than b: b is dropped
    assert rec.calls == [b] and a in store


def test_pinned_replicas_are_never_evicted() -> None:
    store, expected, rec = host_store(3)
    a, b, c = (put(store, expected, s) for s in (1, 2, 3))
    store.pin(a, "lease-1")
    put(store, expected, 4)
    assert rec.calls == [b]
    store.pin(c, "lease-2")
    store.pin(make_key(4), "lease-3")
    before = store.stats()
    with pytest.raises(StoreFull):
        put(store, expected, 5)
    # Nothing changed: no eviction, no partial replica.
    assert rec.calls == [b] and make_key(5) not in store and store.stats() == before
    store.unpin(c, "lease-2")
    put(store, expected, 5)
    assert rec.calls == [b, c]


def test_expired_pins_do_not_protect() -> None:
    now = [0.0]
    store = BlockStore([HostTier(2 * 2 * LAYER)], clock=lambda: now[0])
    expected: dict[RecordKey, bytes] = {}
    rec = Recorder(store, expected)
    a = put(store, expected, 1)
    put(store, expected, 2)
    store.pin(a, "lease", ttl_ms=500)
    put(store, expected, 3)
    assert rec.calls == [make_key(2)]
    now[0] = 0.5
    put(store, expected, 4)
    assert rec.calls == [make_key(2), a]


def test_replicas_being_written_are_not_evicted() -> None:
    store, expected, rec = host_store(2)
    geometry = Geometry(kv_heads=1, head_dim=16, dtype=ELEMENT_TYPES["fp8-e4m3"])  # 16 octets a token
    writer = store.begin(make_key(1), geometry, 2, 2)  # 2 layers of 64 octets
    put(store, expected, 2)
    with pytest.raises(StoreFull):
        put(store, expected, 3, layers=3)
    writer.write_layer(0, bytes(32), bytes(32))
    writer.write_layer(1, bytes(32), bytes(32))
    expected[make_key(1)] = encode_container(RAW, 0, 2, [(bytes(32), bytes(32))] * 2)
    writer.finish()
    put(store, expected, 3, layers=4)
    assert rec.calls == [make_key(1), make_key(2)]


def test_listener_failures_do_not_stop_eviction(caplog: pytest.LogCaptureFixture) -> None:
    store, expected, rec = host_store(1)

    def broken(key: RecordKey, replica_id: bytes) -> None:
        raise RuntimeError("index unreachable")

    store.add_evict_listener(broken)
    a = put(store, expected, 1)
    with caplog.at_level(logging.ERROR):
        put(store, expected, 2)
    assert a not in store and rec.calls == [a] and "index unreachable" in caplog.text
    store.remove_evict_listener(broken)


def test_a_reader_opened_before_eviction_still_streams_the_same_octets(tmp_path: Path) -> None:
    store = BlockStore([HostTier(2 * LAYER), DiskTier(tmp_path / "d", 2 * LAYER)])
    expected: dict[RecordKey, bytes] = {}
    Recorder(store, expected)
    a = put(store, expected, 1)
    reader = store.open_reader(a, touch=False)
    put(store, expected, 2)  # a -> disk
    disk_reader = store.open_reader(a, touch=False)
    put(store, expected, 3)  # b -> disk, a dropped
    with pytest.raises(ReplicaNotFound):
        store.open_reader(a)
    assert b"".join(reader) == expected[a] == b"".join(disk_reader)


# ---------------------------------------------------------------------------------------------
# Randomized invariants


# Each operation: (kind, index of an existing replica, argument); "put" creates a new one.
KINDS = ["put"] * 5 + ["pin", "pin", "unpin", "read", "read", "promote", "demote", "remove"]
ops = st.lists(
    st.tuples(st.sampled_from(KINDS), st.integers(0, 1000), st.integers(0, 3)), min_size=6, max_size=50
)
OWNERS = ["l1", "l2"]
TIERS = ["fast", "slow", "disk"]


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=ops, capacities=st.tuples(st.integers(0, 4), st.integers(0, 6), st.integers(3, 10)))
def test_random_operations_keep_the_invariants(
    ops: list[tuple[str, int, int]], capacities: tuple[int, int, int]
) -> None:
    with tempfile.TemporaryDirectory() as directory:
        fast, slow, disk = (c * LAYER for c in capacities)
        tiers = [HostTier(fast, name="fast"), HostTier(slow, name="slow"), DiskTier(directory, disk, fsync=False)]
        store = BlockStore(tiers)
        model: dict[RecordKey, bytes] = {}  # what the store must hold
        pinned: set[tuple[RecordKey, str]] = set()
        forced: set[RecordKey] = set()
        full = 0

        def on_evict(key: RecordKey, replica_id: bytes) -> None:
            # Called before the octets go: the replica is still complete and readable.
            assert key in model and store.info(key).replica_id == replica_id
            assert b"".join(store.open_reader(key, touch=False)) == model[key]
            if key not in forced:
                assert not any(k == key for k, _ in pinned), "a pinned replica was evicted"
            assert all(t.used <= t.capacity for t in tiers)
            del model[key]

        store.add_evict_listener(on_evict)

        created: list[RecordKey] = []
        for op, index, arg in ops:
            if op == "put":
                key = make_key(len(created))
                created.append(key)
                before = [t.used for t in tiers]
                try:
                    store.put(key, make_container(arg + 1, len(created) - 1))
                except StoreFull:  # decided before anything changed
                    assert [t.used for t in tiers] == before and key not in store
                    full += 1
                else:
                    model[key] = make_container(arg + 1, len(created) - 1)
                continue
            if not created or created[index % len(created)] not in store:
                continue
            key = created[index % len(created)]
            if op == "pin":
                store.pin(key, OWNERS[arg % 2])
                pinned.add((key, OWNERS[arg % 2]))
            elif op == "unpin":
                store.unpin(key, OWNERS[arg % 2])
                pinned.discard((key, OWNERS[arg % 2]))
            elif op == "read":
                info = store.info(key)
                first = min(arg, info.last_layer)
                tail = (info.last_layer - first + 1) * LAYER
                body = b"".join(store.open_reader(key, first, info.last_layer))
                assert body[-tail:] == model[key][-tail:]
            elif op in ("promote", "demote"):
                try:
                    getattr(store, op)(key, TIERS[arg % 3])
                except StoreFull:
                    pass
            elif op == "remove":
                if arg == 0:
                    forced.add(key)
                    store.remove(key, force=True)
                    forced.discard(key)
                    pinned = {(k, o) for k, o in pinned if k != key}
                elif not any(k == key for k, _ in pinned):
                    store.remove(key)

            # Invariants after every operation.
            assert {r.key for r in store.replicas()} == set(model), "a replica was lost silently"
            for tier in tiers:
                assert 0 <= tier.used <= tier.capacity
            stats = store.stats()
            for tier_stats, tier in zip(stats.tiers, tiers):
                held = sum(
                    LAYER * (r.layers[1] - r.layers[0] + 1)
                    for info in store.replicas()
                    for r in info.residency
                    if r.tier == tier.name
                )
                assert tier_stats.used == held
            for k, _ in pinned:
                assert k in store
            # Exactly one file per replica with layers on disk, no leftovers.
            on_disk = {i.replica_id.hex() + ".kvsd" for i in store.replicas() if any(r.tier == "disk" for r in i.residency)}
            assert set(os.listdir(directory)) == on_disk
        for key, data in model.items():
            assert b"".join(store.open_reader(key, touch=False)) == data
        stats = store.stats()
        event(f"evictions: {min(stats.evictions, 3)}, demotions: {min(stats.demotions, 3)}")
        event(f"pinned: {min(stats.pinned, 2)}, store full: {min(full, 1)}")
        store.close()
