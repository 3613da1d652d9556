"""The index stores' contract (kvsp_moq/control/index/store.py, redis_store.py): the same
tests run on the embedded store and on Redis (a real redis-server), both on an injected clock:
TTLs, refresh, withdrawal, bulk purge and the prefix read of §6.2. The memory store's own
reclamation is tested at the end."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from kvsp_moq.control.common.clock import ManualClock
from kvsp_moq.control.common.store import parse_store
from kvsp_moq.control.index.redis_store import PURGE_STEP, PUT_CHUNK, RedisIndexStore
from kvsp_moq.control.index.store import BlockRef, IndexStore, MemoryIndexStore, ReplicaId, StoredReplica
from redis_support import RedisServer
from test_index_support import COMPAT, H1, H2, RELAY, SCOPE_A, SCOPE_B, key, replica


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One redis-server for the module; each test flushes it first."""
    server = RedisServer(Path(tmp_path_factory.mktemp("redis")))
    server.start()
    try:
        yield server.url
    finally:
        server.close()


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(100)


@pytest.fixture(params=["memory", "redis"])
async def store(request: pytest.FixtureRequest, clock: ManualClock) -> AsyncIterator[IndexStore]:
    if request.param == "memory":
        yield MemoryIndexStore(clock)
        return
    # The test's clock, passed to the scripts instead of Redis TIME (test_index_redis.py
    # covers TIME).
    fresh = RedisIndexStore.open(parse_store("index", request.getfixturevalue("redis_url")), clock=clock)
    await fresh.redis.flushdb()
    try:
        yield fresh
    finally:
        await fresh.close()


@pytest.fixture
def memory(clock: ManualClock) -> MemoryIndexStore:
    return MemoryIndexStore(clock)


def ref(i: int, scope: bytes = SCOPE_A) -> BlockRef:
    return BlockRef(COMPAT, scope, key(i))


async def test_put_get_and_remaining_ttl(store: IndexStore, clock: ManualClock) -> None:
    record = replica(key(0), holder=H2)
    assert await store.put(record, 500) is True
    assert await store.put(replica(key(0), holder=H1), 800) is True
    clock.advance(100)
    assert await store.get(ref(0)) == [StoredReplica(replica(key(0), holder=H1), 700), StoredReplica(record, 400)]
    assert await store.get(ref(1)) == []
    assert await store.get(ref(0, SCOPE_B)) == []


async def test_expiry_is_exact_to_the_millisecond(store: IndexStore, clock: ManualClock) -> None:
    await store.put(replica(key(0)), 500)
    clock.advance(499)
    assert [s.remaining_ms for s in await store.get(ref(0))] == [1]
    clock.advance(1)
    assert await store.get(ref(0)) == []
    assert await store.count() == 0


async def test_refresh_restarts_the_ttl_and_is_not_new(store: IndexStore, clock: ManualClock) -> None:
    record = replica(key(0))
    assert await store.put(record, 500) is True
    clock.advance(400)
    assert await store.put(record, 500) is False
    clock.advance(400)  # past the first expiry: the stale heap entry must not drop the record
    assert await store.purge() == 0
    assert [s.remaining_ms for s in await store.get(ref(0))] == [100]
    clock.advance(100)
    assert await store.put(record, 500) is True  # expired: a new replica again


async def test_purge_drops_expired_records_in_bulk(store: IndexStore, clock: ManualClock) -> None:
    for i in range(10):
        await store.put(replica(key(i)), 100 * (i + 1))
    clock.advance(350)
    assert await store.purge() == 3
    assert await store.count() == 7
    assert await store.purge() == 0
    clock.advance(10_000)
    assert await store.purge() == 7
    assert await store.count() == 0


async def test_memory_purge_reclaims_everything(memory: MemoryIndexStore, clock: ManualClock) -> None:
    for i in range(10):
        await memory.put(replica(key(i)), 100 * (i + 1))
    clock.advance(10_000)
    assert await memory.purge() == 10
    assert memory._blocks == {} and memory._expiries == []


async def test_put_reclaims_expired_records_without_a_purge(memory: MemoryIndexStore, clock: ManualClock) -> None:
    await memory.put(replica(key(0)), 10)
    clock.advance(10)
    await memory.put(replica(key(1)), 10)
    assert ref(0) not in memory._blocks


async def test_delete(store: IndexStore, clock: ManualClock) -> None:
    await store.put(replica(key(0), holder=H1), 100)
    await store.put(replica(key(0), holder=H2), 100)
    assert await store.delete(ref(0), ReplicaId(H1)) is True
    assert await store.delete(ref(0), ReplicaId(H1)) is False
    assert [s.record.holder for s in await store.get(ref(0))] == [H2]
    clock.advance(100)
    assert await store.delete(ref(0), ReplicaId(H2)) is False  # expired: nothing withdrawn
    assert await store.delete(ref(5), ReplicaId(H2)) is False
    assert await store.purge() == 0  # the heap entries of deleted records are skipped


async def test_moqt_replicas_are_keyed_by_namespace(store: IndexStore) -> None:
    one = replica(key(0), holder=RELAY, replica_id=b"\x01" * 16)
    two = replica(key(0), holder=RELAY, replica_id=b"\x02" * 16)
    assert await store.put(one, 100) and await store.put(two, 100)
    assert len(await store.get(ref(0))) == 2
    assert await store.delete(ref(0), ReplicaId(RELAY)) is False  # the namespace is part of the id
    assert await store.delete(ref(0), ReplicaId.of(one)) is True


async def test_get_prefix_stops_at_the_first_key_without_a_replica(store: IndexStore, clock: ManualClock) -> None:
    for i, ttl in ((0, 100), (1, 50), (2, 100), (4, 100)):
        await store.put(replica(key(i)), ttl)
    keys = [key(i) for i in range(5)]
    assert [len(r) for r in await store.get_prefix(COMPAT, SCOPE_A, keys)] == [1, 1, 1]
    clock.advance(50)
    assert [len(r) for r in await store.get_prefix(COMPAT, SCOPE_A, keys)] == [1]
    assert await store.get_prefix(COMPAT, SCOPE_B, keys) == []


async def test_ttl_must_be_positive(store: IndexStore) -> None:
    with pytest.raises(ValueError):
        await store.put(replica(key(0)), 0)


def test_the_interface_is_abstract() -> None:
    with pytest.raises(TypeError):
        IndexStore()  # type: ignore[abstract]


async def test_put_many_is_put_of_each(store: IndexStore, clock: ManualClock) -> None:
    """A batch larger than one script call: created vs refresh per record, TTL per record."""
    count = PUT_CHUNK + 3
    first = [(replica(key(i)), 1_000 + i) for i in range(count)]
    assert await store.put_many(first[:5]) == [True] * 5
    clock.advance(10)
    assert await store.put_many(first) == [False] * 5 + [True] * (count - 5)
    assert [s.remaining_ms for s in await store.get(ref(count - 1))] == [1_000 + count - 1]
    assert await store.count() == count
    assert await store.put_many([]) == []


async def test_get_prefix_of_a_long_prompt(store: IndexStore, clock: ManualClock) -> None:
    keys = [key(i) for i in range(300)]
    await store.put_many([(replica(k, holder=h), 500) for k in keys[:250] for h in (H2, H1)])
    found = await store.get_prefix(COMPAT, SCOPE_A, keys)
    assert len(found) == 250
    assert all([s.record.holder for s in replicas] == [H1, H2] for replicas in found)
    assert found[7] == await store.get(ref(7))
    assert await store.get_prefix(COMPAT, SCOPE_A, []) == []


async def test_purge_of_more_than_one_step(store: IndexStore, clock: ManualClock) -> None:
    await store.put_many([(replica(key(i)), 10) for i in range(PURGE_STEP + 5)])
    await store.put(replica(key(0), holder=H2), 1_000)
    clock.advance(10)
    assert await store.purge() == PURGE_STEP + 5
    assert await store.count() == 1
    assert [s.record.holder for s in await store.get(ref(0))] == [H2]
