"""Holder leases whose store write was applied but not acknowledged (issue 30; kvsp-draft §6.6;
``holder/leases.py`` module notes).

A real holder over a real ``redis-server`` primary with one real replica, configured with
``store_wait_replicas = 1``; the replica SIGSTOPped makes ``WAIT`` time out while the primary
applies every write, so the holder answers 503 ``kvsp-unavailable`` for a change that *is*
stored (the fixture and helpers of ``tests/test_unacknowledged_writes.py``). Before the fix:

- a grant answered 503 stayed stored, held a place of the client's quota and pinned its
  replicas until its TTL, and the client's retry was a second lease (with ``max_leases = 1``:
  429 ``kvsp-lease-quota``);
- a release answered 503 and retried got 404;
- a renewal answered 503 left the pins at the old expiry while the store held the new one (a
  replica the store counts as leased could be evicted).

The client library (``HttpLeaseClient``) retries both calls after the 503 itself.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import pytest
from redis_support import RedisServer
from test_holder_support import COMPAT, CONTAINER_SIZE, PRINCIPALS, SCOPE_A, TOKENS, H, bkey, rkey, running_holder
from test_unacknowledged_writes import TIMEOUT_MS, Replica, linked, replicated

from kvsp_moq.control.client.http_leases import HttpLeaseClient
from kvsp_moq.kvsp.records import LeaseGrant, LeaseRequest

__all__ = ["replicated"]  # the module's fixture, shared with test_unacknowledged_writes

BODY = {"block_keys": [bkey(0).hex()], "compat_id": COMPAT.hex(), "scope_id": SCOPE_A.hex(), "ttl_ms": 10_000}
CLIENT = PRINCIPALS["client-a"]


@pytest.fixture
async def held(replicated: tuple[RedisServer, Replica]) -> AsyncIterator[tuple[H, Replica]]:
    """A holder over the replicated Redis (its own key prefix), one lease per client at most, with
    block 0 stored."""
    primary, replica = replicated
    await linked(primary)
    async with running_holder(store=primary.url, store_timeout_ms=TIMEOUT_MS, store_wait_replicas=1,
                              store_key_prefix=f"unack-lease-{uuid.uuid4().hex[:8]}:", max_leases=1) as h:
        assert (await h.put_block(0)).status == 201
        yield h, replica


async def test_a_grant_answered_503_holds_no_quota_and_its_retry_is_one_lease(
        replicated: tuple[RedisServer, Replica], held: tuple[H, Replica]) -> None:
    primary, _ = replicated
    h, replica = held
    key = {"Idempotency-Key": '"grant-1"'}
    replica.pause()  # WAIT 1 now times out; the primary still applies the writes
    try:
        first = await h.request("POST", "leases", body=BODY, headers=key)
        assert (first.status, first.problem) == (503, "kvsp-unavailable"), first.body
        plain = await h.request("POST", "leases", body=BODY)  # a client without a key
        assert (plain.status, plain.problem) == (503, "kvsp-unavailable"), plain.body
    finally:
        replica.resume()
    await linked(primary)
    assert await h.service.leases.usage(CLIENT) == (0, 0)  # both withdrawn: no quota held
    assert not h.service.store.is_pinned(rkey(0))
    retried = await h.request("POST", "leases", body=BODY, headers=key)  # max_leases = 1: not a 429
    assert retried.status == 201, retried.body
    grant = LeaseGrant.from_json(retried.json)
    again = await h.request("POST", "leases", body=BODY, headers=key)  # as if the 201 were lost
    assert again.status == 201 and LeaseGrant.from_json(again.json).lease == grant.lease
    assert await h.service.leases.usage(CLIENT) == (CONTAINER_SIZE, 1)
    assert h.service.store.pin_owners(rkey(0)) == (grant.lease,)


async def test_a_release_answered_503_succeeds_when_retried(
        replicated: tuple[RedisServer, Replica], held: tuple[H, Replica]) -> None:
    primary, _ = replicated
    h, replica = held
    grant = LeaseGrant.from_json((await h.request("POST", "leases", body=BODY)).json)
    replica.pause()
    try:
        first = await h.request("DELETE", f"leases/{grant.lease}")
        assert (first.status, first.problem) == (503, "kvsp-unavailable"), first.body
    finally:
        replica.resume()
    await linked(primary)
    assert h.service.store.is_pinned(rkey(0))  # not known released when answered: still pinned
    retried = await h.request("DELETE", f"leases/{grant.lease}")
    assert retried.status == 204, retried.body
    assert not h.service.store.is_pinned(rkey(0))
    assert await h.service.leases.usage(CLIENT) == (0, 0)
    assert (await h.request("POST", "leases", body=BODY)).status == 201  # the place is free


async def test_a_renewal_answered_503_still_pins_to_the_stored_expiry(
        replicated: tuple[RedisServer, Replica], held: tuple[H, Replica]) -> None:
    primary, _ = replicated
    h, replica = held
    grant = LeaseGrant.from_json((await h.request("POST", "leases", body=BODY)).json)  # 10 s
    replica.pause()
    try:
        first = await h.request("PUT", f"leases/{grant.lease}", body={"ttl_ms": 30_000})
        assert (first.status, first.problem) == (503, "kvsp-unavailable"), first.body
    finally:
        replica.resume()
    await linked(primary)
    h.clock.advance(15_000)  # past the first expiry: the store holds the renewed one (applied)
    assert h.service.store.is_pinned(rkey(0))
    view = await h.request("GET", f"leases/{grant.lease}")
    assert view.status == 200 and LeaseGrant.from_json(view.json).ttl_ms == 15_000
    retried = await h.request("PUT", f"leases/{grant.lease}", body={"ttl_ms": 30_000})
    assert retried.status == 200 and LeaseGrant.from_json(retried.json).ttl_ms == 30_000


async def test_the_client_library_retries_grant_and_release_after_a_503(
        replicated: tuple[RedisServer, Replica], held: tuple[H, Replica]) -> None:
    primary, _ = replicated
    h, replica = held
    pauses: list[float] = []

    async def replica_back(seconds: float) -> None:
        """The client's wait before its retry: the replica answers again meanwhile."""
        pauses.append(seconds)
        replica.resume()
        await linked(primary)

    client = HttpLeaseClient(TOKENS["client-a"], pause=replica_back)
    request = LeaseRequest(block_keys=(bkey(0),), compat_id=COMPAT, scope_id=SCOPE_A, ttl_ms=10_000)
    try:
        replica.pause()
        try:
            grant = await client.lease(h.url, request)  # 503, then the retry with the same key
        finally:
            replica.resume()
        assert pauses == [1.0]
        assert await h.service.leases.usage(CLIENT) == (CONTAINER_SIZE, 1)  # one lease
        assert h.service.store.pin_owners(rkey(0)) == (grant.lease,)
        replica.pause()
        try:
            await client.release(h.url, grant.lease)  # 503 (applied), then 204
        finally:
            replica.resume()
        assert pauses == [1.0, 1.0]
        assert await h.service.leases.usage(CLIENT) == (0, 0)
        assert not h.service.store.is_pinned(rkey(0))
    finally:
        await client.close()
