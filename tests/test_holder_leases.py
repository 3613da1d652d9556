"""Holder leases over HTTP (kvsp-draft §6.6): grant, renew, release, quotas (also under
concurrency), scope checks, expiry on a manual clock, and the store never evicting a leased
replica while it evicts unleased ones.

The lease contract: every test runs twice, with ``[holder] store = "memory"`` and with a real
``redis-server`` (``store = "redis://..."``), and must pass the same way on both."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from kvsp_moq.control.common.config import TierConfig
from kvsp_moq.kvsp.records import LeaseGrant
from kvsp_moq.storage import ReplicaPinned
from redis_support import RedisServer
from test_holder_support import PRINCIPALS, BLOCK_SIZE, CONTAINER_SIZE, COMPAT, SCOPE_A, H, bkey, rkey, running_holder


@pytest.fixture(params=["memory", "redis"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """The ``[holder] store`` setting of the test's holder: memory, or a fresh redis-server."""
    if request.param == "memory":
        yield "memory"
        return
    server = RedisServer(tmp_path / "redis")
    server.start()
    try:
        yield server.url
    finally:
        server.close()


@pytest.fixture
async def h(store: str) -> AsyncIterator[H]:
    async with running_holder(max_lease_ttl_ms=30_000, max_leased_octets=3 * CONTAINER_SIZE, max_leases=8, store=store) as h:
        for i in range(6):
            assert (await h.put_block(i)).status == 201
        yield h


async def test_grant_renew_release(h: H) -> None:
    reply = await h.lease([0, 1], ttl_ms=10_000)
    assert reply.status == 201 and reply.content_type == "application/kvsp+json"
    grant = LeaseGrant.from_json(reply.json)
    assert grant.ttl_ms == 10_000
    assert reply.headers["Location"] == f"/leases/{grant.lease}"
    assert h.service.store.is_pinned(rkey(0)) and h.service.store.is_pinned(rkey(1))
    assert h.service.store.pin_owners(rkey(0)) == (grant.lease,)

    h.clock.advance(6_000)
    renewed = await h.request("PUT", f"leases/{grant.lease}", body={"ttl_ms": 20_000})
    assert renewed.status == 200 and LeaseGrant.from_json(renewed.json) == LeaseGrant(lease=grant.lease, ttl_ms=20_000)
    h.clock.advance(15_000)  # past the first TTL, within the renewed one
    assert h.service.store.is_pinned(rkey(0))

    assert (await h.request("DELETE", f"leases/{grant.lease}")).status == 204
    assert not h.service.store.is_pinned(rkey(0))
    reply = await h.request("DELETE", f"leases/{grant.lease}", who="client-a2")
    assert (reply.status, reply.problem) == (404, "kvsp-not-found")  # not its lease: nothing revealed
    assert (await h.request("DELETE", f"leases/{grant.lease}")).status == 204  # a repeat: released
    reply = await h.request("PUT", f"leases/{grant.lease}", body={"ttl_ms": 20_000})
    assert (reply.status, reply.problem) == (404, "kvsp-not-found")


async def test_lease_expires_on_the_clock(h: H) -> None:
    grant = LeaseGrant.from_json((await h.lease([0], ttl_ms=5_000)).json)
    h.clock.advance(5_000)
    assert not h.service.store.is_pinned(rkey(0))
    reply = await h.request("PUT", f"leases/{grant.lease}", body={"ttl_ms": 5_000})
    assert (reply.status, reply.problem) == (404, "kvsp-not-found")
    assert await h.service.leases.usage(PRINCIPALS["client-a"]) == (0, 0)


async def test_unknown_keys_are_404_and_pin_nothing(h: H) -> None:
    reply = await h.lease([0, 42])
    assert (reply.status, reply.problem) == (404, "kvsp-not-found")
    assert bkey(42).hex() in reply.json["detail"]
    assert not h.service.store.is_pinned(rkey(0))


async def test_leases_require_the_scope(h: H) -> None:
    reply = await h.lease([0], who="client-b")
    assert (reply.status, reply.problem) == (403, "kvsp-forbidden")
    assert not h.service.store.is_pinned(rkey(0))


async def test_another_principals_lease_is_not_found(h: H) -> None:
    grant = LeaseGrant.from_json((await h.lease([0])).json)
    for method, body in (("PUT", {"ttl_ms": 1000}), ("DELETE", None)):
        reply = await h.request(method, f"leases/{grant.lease}", who="client-a2", body=body)
        assert (reply.status, reply.problem) == (404, "kvsp-not-found")
    assert h.service.store.is_pinned(rkey(0))


async def test_ttl_quota(h: H) -> None:
    reply = await h.lease([0], ttl_ms=30_001)
    assert (reply.status, reply.problem) == (429, "kvsp-lease-quota")
    assert not h.service.store.is_pinned(rkey(0))
    grant = LeaseGrant.from_json((await h.lease([0], ttl_ms=30_000)).json)
    reply = await h.request("PUT", f"leases/{grant.lease}", body={"ttl_ms": 60_000})
    assert (reply.status, reply.problem) == (429, "kvsp-lease-quota")


async def test_octet_quota_is_per_client(h: H) -> None:
    assert (await h.lease([0, 1])).status == 201
    reply = await h.lease([2, 3])  # 4 blocks > 3
    assert (reply.status, reply.problem) == (429, "kvsp-lease-quota")
    assert not h.service.store.is_pinned(rkey(2))
    grant = LeaseGrant.from_json((await h.lease([2])).json)  # exactly 3
    assert (await h.lease([3])).status == 429
    assert (await h.lease([3, 4, 5], who="client-a2")).status == 201  # another client's quota
    assert (await h.request("DELETE", f"leases/{grant.lease}")).status == 204
    assert (await h.lease([3])).status == 201


async def test_concurrent_requests_at_the_quota_edge_never_exceed_it(h: H) -> None:
    replies = await asyncio.gather(*(h.lease([i % 6]) for i in range(12)))
    statuses = sorted(r.status for r in replies)
    assert statuses == [201] * 3 + [429] * 9
    octets, count = await h.service.leases.usage(PRINCIPALS["client-a"])
    assert (octets, count) == (3 * CONTAINER_SIZE, 3)


async def test_lease_count_quota(store: str) -> None:
    async with running_holder(max_leases=2, store=store) as h:
        await h.put_block(0)
        assert (await h.lease([0])).status == 201
        assert (await h.lease([0])).status == 201
        reply = await h.lease([0])
        assert (reply.status, reply.problem) == (429, "kvsp-lease-quota")


async def test_leased_replica_is_never_evicted_under_pressure(store: str) -> None:
    async with running_holder(tiers=(TierConfig("host", 3 * BLOCK_SIZE),), store=store) as h:
        for i in range(3):
            await h.put_block(i)
        assert (await h.lease([0], ttl_ms=20_000)).status == 201  # block 0 is the LRU
        assert (await h.put_block(3)).status == 201  # room from block 1 (the LRU unleased)
        assert (await h.get_block(0)).status == 200
        assert (await h.get_block(1)).status == 404
        assert (await h.put_block(4)).status == 201  # block 2 goes, block 0 stays
        assert [e for e in h.events if e[0] == "evict"] == [("evict", bkey(1).hex()), ("evict", bkey(2).hex())]
        assert (await h.get_block(0)).status == 200
        assert [r.holder for r in await h.index_replicas(0)] == [h.url]
        assert await h.index_replicas(1) == []

        # Everything leased: a new block does not fit, nothing is evicted.
        assert (await h.lease([3, 4], ttl_ms=20_000)).status == 201
        reply = await h.put_block(5)
        assert reply.status == 507
        for i in (0, 3, 4):
            assert (await h.get_block(i)).status == 200

        # Deliberate eviction of a leased replica is refused.
        with pytest.raises(ReplicaPinned):
            await h.service.evict(rkey(0))

        h.clock.advance(20_000)  # the leases expire: block 0 (LRU) is evictable again
        assert (await h.put_block(5)).status == 201
        assert (await h.get_block(0)).status == 404


async def test_lease_bodies_are_validated(h: H) -> None:
    reply = await h.request("POST", "leases", body=b"{not json", content_type="application/kvsp+json")
    assert (reply.status, reply.problem, reply.json["member"]) == (400, "kvsp-bad-record", "$")
    reply = await h.lease([0], extra_member={"x": 1})  # unknown members are ignored (§4.4)
    assert reply.status == 201
    body = {"block_keys": [bkey(0).hex()], "compat_id": COMPAT.hex(), "scope_id": SCOPE_A.hex()}
    reply = await h.request("POST", "leases", body=body)
    assert (reply.status, reply.json["member"]) == (400, "ttl_ms")
    reply = await h.request("POST", "leases", body={**body, "ttl_ms": 0})
    assert (reply.status, reply.json["member"]) == (400, "ttl_ms")
    reply = await h.request("POST", "leases", body={**body, "ttl_ms": 10, "block_keys": []})
    assert (reply.status, reply.json["member"]) == (400, "block_keys")
    reply = await h.request("POST", "leases", body=b"{}", content_type="text/plain")
    assert reply.status == 415
    reply = await h.request("POST", "leases", body=b" " * (2 << 20), content_type="application/kvsp+json")
    assert reply.status == 413
    reply = await h.request("PUT", "leases/bad%20id", body={"ttl_ms": 1})
    assert reply.status == 404
    reply = await h.request("POST", "leases", who=None, body=body)
    assert reply.status == 401


async def test_get_lease_tells_its_remaining_ttl(h: H) -> None:
    grant = LeaseGrant.from_json((await h.lease([0], ttl_ms=10_000)).json)
    h.clock.advance(4_000)
    reply = await h.request("GET", f"leases/{grant.lease}")
    assert reply.status == 200 and LeaseGrant.from_json(reply.json) == LeaseGrant(lease=grant.lease, ttl_ms=6_000)
    reply = await h.request("GET", f"leases/{grant.lease}", who="client-a2")  # not its lease
    assert (reply.status, reply.problem) == (404, "kvsp-not-found")
    h.clock.advance(6_000)
    reply = await h.request("GET", f"leases/{grant.lease}")
    assert (reply.status, reply.problem) == (404, "kvsp-not-found")


async def test_purge_frees_the_quota_and_unpins(h: H) -> None:
    assert (await h.lease([0, 1, 2], ttl_ms=5_000)).status == 201
    assert (await h.lease([3])).status == 429
    h.clock.advance(5_000)
    assert await h.service.leases.purge() == 1
    assert await h.service.leases.usage(PRINCIPALS["client-a"]) == (0, 0)
    assert await h.service.leases.purge() == 0
    assert not h.service.store.is_pinned(rkey(0))
    assert (await h.lease([3, 4, 5])).status == 201


async def test_a_grant_repeated_under_its_idempotency_key_is_one_lease(h: H) -> None:
    key = {"Idempotency-Key": '"prefetch-1"'}
    body = {"block_keys": [bkey(0).hex(), bkey(1).hex()], "compat_id": COMPAT.hex(), "scope_id": SCOPE_A.hex(),
            "ttl_ms": 10_000}
    first = await h.request("POST", "leases", body=body, headers=key)
    assert first.status == 201
    grant = LeaseGrant.from_json(first.json)
    h.clock.advance(3_000)
    again = await h.request("POST", "leases", body={**body, "block_keys": body["block_keys"][::-1]}, headers=key)
    assert again.status == 201 and again.headers["Location"] == f"/leases/{grant.lease}"
    assert LeaseGrant.from_json(again.json) == LeaseGrant(lease=grant.lease, ttl_ms=7_000)  # its expiry kept
    assert await h.service.leases.usage(PRINCIPALS["client-a"]) == (2 * CONTAINER_SIZE, 1)  # counted once
    assert h.service.store.pin_owners(rkey(0)) == (grant.lease,)
    other = await h.request("POST", "leases", body={**body, "ttl_ms": 9_000}, headers=key)
    assert other.status == 422  # the key of another request (draft-ietf-httpapi-idempotency-key-header)
    assert h.service.store.pin_owners(rkey(0)) == (grant.lease,)  # the lease keeps its pins
    theirs = await h.request("POST", "leases", body=body, headers=key, who="client-a2")
    assert theirs.status == 201 and LeaseGrant.from_json(theirs.json).lease != grant.lease  # keys are per client
    bad = await h.request("POST", "leases", body=body, headers={"Idempotency-Key": '"a\\"b"'})
    assert bad.status == 400
    assert (await h.request("DELETE", f"leases/{grant.lease}")).status == 204
    anew = await h.request("POST", "leases", body=body, headers=key)  # released: the key grants afresh
    assert anew.status == 201 and LeaseGrant.from_json(anew.json).ttl_ms == 10_000
