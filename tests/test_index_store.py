"""The embedded index store (kvsp_moq/control/index/store.py): TTLs on an injected clock, lazy
and bulk purge, refresh, withdrawal, and the prefix read of §6.2."""

from __future__ import annotations

import pytest

from kvsp_moq.control.common.clock import ManualClock
from kvsp_moq.control.index.store import BlockRef, IndexStore, MemoryIndexStore, ReplicaId, StoredReplica
from test_index_support import COMPAT, H1, H2, RELAY, SCOPE_A, SCOPE_B, key, replica


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(100)


@pytest.fixture
def store(clock: ManualClock) -> MemoryIndexStore:
    return MemoryIndexStore(clock)


def ref(i: int, scope: bytes = SCOPE_A) -> BlockRef:
    return BlockRef(COMPAT, scope, key(i))


async def test_put_get_and_remaining_ttl(store: MemoryIndexStore, clock: ManualClock) -> None:
    record = replica(key(0), holder=H2)
    assert await store.put(record, 500) is True
    assert await store.put(replica(key(0), holder=H1), 800) is True
    clock.advance(100)
    assert await store.get(ref(0)) == [StoredReplica(replica(key(0), holder=H1), 700), StoredReplica(record, 400)]
    assert await store.get(ref(1)) == []
    assert await store.get(ref(0, SCOPE_B)) == []


async def test_expiry_is_exact_to_the_millisecond(store: MemoryIndexStore, clock: ManualClock) -> None:
    await store.put(replica(key(0)), 500)
    clock.advance(499)
    assert [s.remaining_ms for s in await store.get(ref(0))] == [1]
    clock.advance(1)
    assert await store.get(ref(0)) == []
    assert await store.count() == 0


async def test_refresh_restarts_the_ttl_and_is_not_new(store: MemoryIndexStore, clock: ManualClock) -> None:
    record = replica(key(0))
    assert await store.put(record, 500) is True
    clock.advance(400)
    assert await store.put(record, 500) is False
    clock.advance(400)  # past the first expiry: the stale heap entry must not drop the record
    assert await store.purge() == 0
    assert [s.remaining_ms for s in await store.get(ref(0))] == [100]
    clock.advance(100)
    assert await store.put(record, 500) is True  # expired: a new replica again


async def test_purge_drops_expired_records_in_bulk(store: MemoryIndexStore, clock: ManualClock) -> None:
    for i in range(10):
        await store.put(replica(key(i)), 100 * (i + 1))
    clock.advance(350)
    assert await store.purge() == 3
    assert await store.count() == 7
    assert await store.purge() == 0
    clock.advance(10_000)
    assert await store.purge() == 7
    assert store._blocks == {} and store._expiries == []


async def test_put_reclaims_expired_records_without_a_purge(store: MemoryIndexStore, clock: ManualClock) -> None:
    await store.put(replica(key(0)), 10)
    clock.advance(10)
    await store.put(replica(key(1)), 10)
    assert ref(0) not in store._blocks


async def test_delete(store: MemoryIndexStore, clock: ManualClock) -> None:
    await store.put(replica(key(0), holder=H1), 100)
    await store.put(replica(key(0), holder=H2), 100)
    assert await store.delete(ref(0), ReplicaId(H1)) is True
    assert await store.delete(ref(0), ReplicaId(H1)) is False
    assert [s.record.holder for s in await store.get(ref(0))] == [H2]
    clock.advance(100)
    assert await store.delete(ref(0), ReplicaId(H2)) is False  # expired: nothing withdrawn
    assert await store.delete(ref(5), ReplicaId(H2)) is False
    assert await store.purge() == 0  # the heap entries of deleted records are skipped


async def test_moqt_replicas_are_keyed_by_namespace(store: MemoryIndexStore) -> None:
    one = replica(key(0), holder=RELAY, replica_id=b"\x01" * 16)
    two = replica(key(0), holder=RELAY, replica_id=b"\x02" * 16)
    assert await store.put(one, 100) and await store.put(two, 100)
    assert len(await store.get(ref(0))) == 2
    assert await store.delete(ref(0), ReplicaId(RELAY)) is False  # the namespace is part of the id
    assert await store.delete(ref(0), ReplicaId.of(one)) is True


async def test_get_prefix_stops_at_the_first_key_without_a_replica(store: MemoryIndexStore, clock: ManualClock) -> None:
    for i, ttl in ((0, 100), (1, 50), (2, 100), (4, 100)):
        await store.put(replica(key(i)), ttl)
    keys = [key(i) for i in range(5)]
    assert [len(r) for r in await store.get_prefix(COMPAT, SCOPE_A, keys)] == [1, 1, 1]
    clock.advance(50)
    assert [len(r) for r in await store.get_prefix(COMPAT, SCOPE_A, keys)] == [1]
    assert await store.get_prefix(COMPAT, SCOPE_B, keys) == []


async def test_ttl_must_be_positive(store: MemoryIndexStore) -> None:
    with pytest.raises(ValueError):
        await store.put(replica(key(0)), 0)


def test_the_interface_is_abstract() -> None:
    with pytest.raises(TypeError):
        IndexStore()  # type: ignore[abstract]
