"""The lease store contract (holder/lease_store.py, kvsp-draft §6.6), run over both
implementations: in memory, and Redis (a real ``redis-server``). Each test gets two stores over
the same state: for memory one object twice; for Redis two clients, as two holder processes
sharing one Redis would be. Times are plain integers passed in (the store reads no clock)."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from kvsp_moq.control.common.errors import StoreUnavailable
from kvsp_moq.control.common.store import parse_store
from kvsp_moq.control.holder.lease_redis import PURGE_BATCH, RedisLeaseStore
from kvsp_moq.control.holder.lease_store import Lease, LeaseLimits, LeaseStore, MemoryLeaseStore, ReleaseOutcome, Usage
from kvsp_moq.storage import RecordKey
from redis_support import RedisServer

COMPAT = hashlib.sha256(b"lease store compat").digest()
SCOPE = bytes.fromhex("c1" * 16)
NOW = 1_700_000_000_000  # a wall-clock-like origin (ms)
LIMITS = LeaseLimits(max_ttl_ms=60_000, max_octets=1_000, max_leases=5)


def key(i: int) -> RecordKey:
    return RecordKey(COMPAT, SCOPE, hashlib.sha256(f"block {i}".encode()).digest())


def lease(lease_id: str, owner: str = "alice", *, keys: tuple[int, ...] = (0,), octets: int = 100,
          ttl_ms: int = 10_000) -> Lease:
    replicas = {key(i): hashlib.sha256(f"replica {i}".encode()).digest()[:16] for i in keys}
    return Lease(lease_id, owner, replicas, octets, NOW + ttl_ms, SCOPE)


@pytest.fixture(params=["memory", "redis"])
async def stores(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[tuple[LeaseStore, LeaseStore]]:
    if request.param == "memory":
        store = MemoryLeaseStore()
        yield store, store
        return
    server = RedisServer(tmp_path / "redis")
    server.start()
    spec = parse_store("holder", server.url)
    first, second = RedisLeaseStore(spec), RedisLeaseStore(spec)
    try:
        yield first, second
    finally:
        await first.close()
        await second.close()
        server.close()


async def test_grant_get_usage(stores: tuple[LeaseStore, LeaseStore]) -> None:
    a, b = stores
    outcome = await a.grant(lease("L1", keys=(0, 1)), LIMITS, NOW)
    assert outcome.granted and outcome.usage == Usage(0, 0)
    assert await b.get("alice", "L1", NOW) == lease("L1", keys=(0, 1))  # the other process sees it
    assert await b.usage("alice", NOW) == Usage(100, 1)
    assert await b.usage("bob", NOW) == Usage(0, 0)
    assert await b.get("bob", "L1", NOW) is None  # another owner's: not found
    assert await a.get("alice", "nope", NOW) is None


async def test_quota_refusals_report_the_usage(stores: tuple[LeaseStore, LeaseStore]) -> None:
    a, b = stores
    assert (await a.grant(lease("L1", octets=900), LIMITS, NOW)).granted
    refused = await b.grant(lease("L2", octets=101), LIMITS, NOW)
    assert (refused.granted, refused.duplicate, refused.usage) == (False, False, Usage(900, 1))
    assert (await b.grant(lease("L2", octets=100), LIMITS, NOW)).granted  # exactly the quota
    taken = await a.grant(lease("L1", owner="bob"), LIMITS, NOW)
    assert taken.duplicate and not taken.granted
    for i in range(LIMITS.max_leases):
        assert (await a.grant(lease(f"B{i}", owner="bob", octets=1), LIMITS, NOW)).granted
    refused = await b.grant(lease("B9", owner="bob", octets=1), LIMITS, NOW)
    assert not refused.granted and refused.usage == Usage(LIMITS.max_leases, LIMITS.max_leases)
    assert await a.usage("alice", NOW) != await a.usage("bob", NOW)


async def test_renew_and_release_are_the_owners(stores: tuple[LeaseStore, LeaseStore]) -> None:
    a, b = stores
    await a.grant(lease("L1"), LIMITS, NOW)
    assert await b.renew("bob", "L1", NOW + 50_000, NOW) is None
    assert await b.release("bob", "L1", NOW) == ReleaseOutcome(False)
    renewed = await b.renew("alice", "L1", NOW + 50_000, NOW + 9_000)
    assert renewed is not None and renewed.expires_ms == NOW + 50_000 and renewed.replicas == lease("L1").replicas
    assert (await a.get("alice", "L1", NOW + 40_000)) == renewed  # past the first TTL
    released = await a.release("alice", "L1", NOW + 40_000)
    assert released == ReleaseOutcome(True, renewed)
    assert await b.get("alice", "L1", NOW + 40_000) is None
    assert await b.usage("alice", NOW + 40_000) == Usage(0, 0)
    # a repeat (after a 503 that was applied) is released, once more, by its owner only, until the expiry
    assert await b.release("alice", "L1", NOW + 41_000) == ReleaseOutcome(True, renewed)
    assert await b.release("bob", "L1", NOW + 41_000) == ReleaseOutcome(False)
    assert await a.release("alice", "L1", NOW + 50_000) == ReleaseOutcome(False)
    assert await b.usage("alice", NOW + 41_000) == Usage(0, 0)


async def test_a_repeated_grant_of_one_request_is_answered_once(stores: tuple[LeaseStore, LeaseStore]) -> None:
    a, b = stores
    first = dataclasses.replace(lease("K1", octets=600), request="fp-1")
    assert (await a.grant(first, LIMITS, NOW)).granted
    later = dataclasses.replace(first, expires_ms=NOW + 12_000)  # the repeat, 2 s later
    again = await b.grant(later, LIMITS, NOW + 2_000)
    assert again.granted and again.existing == first  # the lease of the first try, its expiry kept
    assert await b.usage("alice", NOW + 2_000) == Usage(600, 1)  # counted once
    other = await b.grant(dataclasses.replace(first, request="fp-2"), LIMITS, NOW + 2_000)
    assert not other.granted and other.conflict
    assert (await b.grant(dataclasses.replace(first, owner="bob"), LIMITS, NOW)).duplicate  # not bob's
    assert (await a.grant(lease("K1"), LIMITS, NOW)).duplicate  # without a request: the id is taken
    await a.release("alice", "K1", NOW + 3_000)
    anew = await b.grant(dataclasses.replace(later, expires_ms=NOW + 13_000), LIMITS, NOW + 3_000)
    assert anew.granted and anew.existing is None  # released: the repeat is a new lease
    assert await a.usage("alice", NOW + 3_000) == Usage(600, 1)


async def test_an_expired_lease_is_gone_before_the_purge(stores: tuple[LeaseStore, LeaseStore]) -> None:
    a, b = stores
    await a.grant(lease("L1", octets=1_000, ttl_ms=10_000), LIMITS, NOW)
    await a.grant(lease("L2", owner="bob", ttl_ms=20_000), LIMITS, NOW)
    at = NOW + 10_000  # expiry is inclusive: expires_ms <= now is expired
    assert await b.get("alice", "L1", at) is None
    assert await b.renew("alice", "L1", at + 10_000, at) is None
    assert await b.release("alice", "L1", at) == ReleaseOutcome(False)
    assert await b.usage("alice", at) == Usage(0, 0)
    assert [x.id for x in await b.live(at)] == ["L2"]
    assert (await b.grant(lease("L3", octets=1_000, ttl_ms=20_000), LIMITS, at)).granted  # the quota is free
    purged = await a.purge(NOW + 20_000)
    assert sorted(x.id for x in purged) == ["L2", "L3"]  # L1 went with alice's grant at `at`
    assert await a.purge(NOW + 20_000) == []
    assert await b.live(NOW) == []


async def test_purge_returns_the_leases_with_their_replicas(stores: tuple[LeaseStore, LeaseStore]) -> None:
    a, b = stores
    await a.grant(lease("L1", keys=(0, 1, 2), ttl_ms=1_000), LIMITS, NOW)
    await a.grant(lease("L2", keys=(3,), ttl_ms=5_000), LIMITS, NOW)
    (purged,) = await b.purge(NOW + 1_000)
    assert purged == lease("L1", keys=(0, 1, 2), ttl_ms=1_000)
    assert await b.usage("alice", NOW + 1_000) == Usage(100, 1)
    (alive,) = await a.live(NOW + 1_000)
    assert alive == lease("L2", keys=(3,), ttl_ms=5_000)


async def test_concurrent_grants_over_two_stores_never_exceed_the_quota(stores: tuple[LeaseStore, LeaseStore]) -> None:
    """§6.6 quota: 40 grants race (half through each store, as from two holder processes); the
    quota admits 7 of 130 octets: exactly 7 pass, whatever the interleaving."""
    a, b = stores
    limits = LeaseLimits(max_octets=7 * 130, max_leases=100)
    outcomes = await asyncio.gather(*((a if i % 2 else b).grant(lease(f"R{i}", octets=130), limits, NOW)
                                      for i in range(40)))
    assert sum(o.granted for o in outcomes) == 7
    assert await a.usage("alice", NOW) == Usage(7 * 130, 7)


async def test_a_long_backlog_is_purged_in_batches(stores: tuple[LeaseStore, LeaseStore]) -> None:
    a, _ = stores
    limits = LeaseLimits(max_octets=1 << 40, max_leases=10_000)
    count = PURGE_BATCH + 20
    for i in range(count):
        assert (await a.grant(lease(f"P{i}", ttl_ms=1 + i % 7), limits, NOW)).granted
    assert len(await a.purge(NOW + 10)) == count
    assert await a.usage("alice", NOW + 10) == Usage(0, 0)


async def test_two_key_prefixes_are_two_holders(tmp_path: Path) -> None:
    server = RedisServer(tmp_path / "redis")
    server.start()
    try:
        first = RedisLeaseStore(parse_store("holder", server.url, key_prefix="h1:"))
        second = RedisLeaseStore(parse_store("holder", server.url, key_prefix="h2:"))
        assert (await first.grant(lease("L1", octets=1_000), LIMITS, NOW)).granted
        assert (await second.grant(lease("L1", octets=1_000), LIMITS, NOW)).granted
        assert await second.usage("alice", NOW) == Usage(1_000, 1)
        keys = sorted(k.decode() if isinstance(k, bytes) else k for k in await first.client.keys("*"))
        assert all(k.startswith(("{h1:holder}:", "{h2:holder}:")) for k in keys), keys
        await first.close()
        await second.close()
    finally:
        server.close()


async def test_a_read_only_replica_is_unavailable_not_a_500(tmp_path: Path) -> None:
    """After a failover the old primary may be a replica: its READONLY refusal is a store that
    cannot take writes (503 kvsp-unavailable), while reads still answer."""
    primary, replica = RedisServer(tmp_path / "primary"), RedisServer(tmp_path / "replica")
    primary.start()
    replica.start()
    try:
        store = RedisLeaseStore(parse_store("holder", replica.url))
        await store.client.execute_command("REPLICAOF", "127.0.0.1", str(primary.port))
        with pytest.raises(StoreUnavailable, match="unavailable"):
            await store.grant(lease("L1"), LIMITS, NOW)
        assert await store.get("alice", "L1", NOW) is None
        await store.close()
    finally:
        replica.close()
        primary.close()
