"""The Index Service over HTTP (kvsp-draft §6.1, §6.2; docs/http-api.md): a real aiohttp server
on 127.0.0.1 port 0, a real aiohttp client, a manual clock for every TTL. No mocks, no sleeps."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import AsyncIterator
from urllib.parse import unquote

import aiohttp
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvsp_moq.control.common.config import ControlConfig, IndexConfig
from kvsp_moq.control.index.serve import serve_index
from kvsp_moq.control.index.store import BlockRef, MemoryIndexStore, StoredReplica
from kvsp_moq.kvsp.records import LookupRequest, LookupResponse, MatchedBlock, ReplicaRecord
from test_index_support import (
    AUTH,
    COMPAT,
    DESCRIPTOR,
    H1,
    H2,
    II7,
    OTHER_COMPAT,
    RELAY,
    SCOPE_A,
    SCOPE_B,
    TOKENS,
    Ix,
    block_path,
    key,
    lookup_body,
    replica,
    running_index,
    status,
)


@pytest.fixture
async def ix() -> AsyncIterator[Ix]:
    async with running_index(IndexConfig(max_ttl_ms=600_000, max_body_octets=64 * 1024, max_block_keys=100, purge_interval_ms=0)) as ix:
        yield ix


def holders(reply_json: dict, block: int = 0) -> list[str]:
    return [r["holder"] for r in reply_json["blocks"][block]["replicas"]]


# ---------------------------------------------------------------------------------------------
# §6.1 publishing


async def test_put_creates_a_replica_and_lookup_finds_it(ix: Ix) -> None:
    record = replica(key(0))
    reply = await ix.put(record)
    assert reply.status == 201
    assert reply.content_type == "application/kvsp+json"
    assert ReplicaRecord.from_json(reply.json) == record
    assert unquote(reply.headers["Location"]) == f"/{block_path(key(0))}?holder={H1}"

    found = await ix.lookup([key(0)])
    assert found.status == 200 and found.content_type == "application/kvsp+json"
    response = LookupResponse.from_json(found.json)
    assert response.matched == 1 and response.blocks[0].replicas == (record,)
    assert "targets" not in found.json

    got = await ix.request("GET", block_path(key(0)))
    assert got.status == 200 and MatchedBlock.from_json(got.json).replicas == (record,)


async def test_put_requires_the_holder_or_a_delegate(ix: Ix) -> None:
    for_h2 = replica(key(0), holder=H2)
    reply = await ix.put(for_h2, who="holder1")  # holder1 is not h2 and not its delegate
    assert (reply.status, reply.problem) == (403, "kvsp-forbidden")
    assert (await ix.lookup([key(0)], who="delegate")).json["matched"] == 0

    assert (await ix.put(for_h2, who="holder2")).status == 201  # the holder itself
    assert (await ix.put(replica(key(0), holder=H1), who="delegate")).status == 201  # a delegate of h1
    assert holders((await ix.lookup([key(0)])).json) == [H1, H2]


async def test_put_requires_the_scope(ix: Ix) -> None:
    reply = await ix.put(replica(key(0), scope=SCOPE_B), who="holder1")  # holder1: scope A only
    assert (reply.status, reply.problem) == (403, "kvsp-forbidden")
    assert (await ix.lookup([key(0)], who="tenant-b", scope=SCOPE_B)).json["matched"] == 0
    assert (await ix.put(replica(key(0), scope=SCOPE_B), who="tenant-b")).status == 201


async def test_ttl_is_capped_at_the_configured_maximum() -> None:
    async with running_index(IndexConfig(max_ttl_ms=10_000, purge_interval_ms=0)) as ix:
        reply = await ix.put(replica(key(0), ttl_ms=60_000))
        assert reply.status == 201 and reply.json["ttl_ms"] == 10_000
        ix.clock.advance(9_999)
        found = (await ix.lookup([key(0)])).json
        assert found["matched"] == 1 and found["blocks"][0]["replicas"][0]["ttl_ms"] == 1
        ix.clock.advance(1)
        assert (await ix.lookup([key(0)])).json["matched"] == 0
        # A TTL under the cap is kept as asked.
        assert (await ix.put(replica(key(1), ttl_ms=5))).json["ttl_ms"] == 5


async def test_the_same_put_again_is_an_idempotent_refresh(ix: Ix) -> None:
    record = replica(key(0), ttl_ms=1_000)
    assert (await ix.put(record)).status == 201
    ix.clock.advance(700)
    again = await ix.put(record)
    assert again.status == 200 and "Location" not in again.headers
    assert ReplicaRecord.from_json(again.json) == record
    ix.clock.advance(700)  # past the first expiry, within the refreshed one
    found = (await ix.lookup([key(0)])).json
    assert found["matched"] == 1
    assert found["blocks"][0]["replicas"] == [dataclasses.replace(record, ttl_ms=300).to_json()]
    assert await ix.service.store.count() == 1


async def test_a_replica_expires_after_its_ttl_and_can_be_published_anew(ix: Ix) -> None:
    assert (await ix.put(replica(key(0), ttl_ms=1_000))).status == 201
    ix.clock.advance(999)
    assert (await ix.lookup([key(0)])).json["matched"] == 1
    ix.clock.advance(1)
    assert (await ix.lookup([key(0)])).json["matched"] == 0
    assert (await ix.request("GET", block_path(key(0)))).status == 404
    assert (await ix.delete(replica(key(0)))).status == 404  # nothing left to withdraw
    assert (await ix.put(replica(key(0), ttl_ms=1_000))).status == 201  # new, not a refresh


async def test_a_changed_record_replaces_the_holders_previous_one(ix: Ix) -> None:
    await ix.put(replica(key(0), residency=[("device", 0, 3, None)]))
    moved = replica(key(0), residency=[("host", 0, 3, 400_000.0)])
    assert (await ix.put(moved)).status == 200
    assert (await ix.lookup([key(0)])).json["blocks"][0]["replicas"] == [moved.to_json()]


async def test_concurrent_puts_of_the_same_record_leave_one_replica(ix: Ix) -> None:
    record = replica(key(0))
    replies = await asyncio.gather(*(ix.put(record) for _ in range(20)))
    assert sorted(r.status for r in replies) == [200] * 19 + [201]
    assert await ix.service.store.count() == 1
    assert holders((await ix.lookup([key(0)])).json) == [H1]


async def test_moqt_replicas_are_told_apart_by_namespace(ix: Ix) -> None:
    one = replica(key(0), holder=RELAY, replica_id=b"\x01" * 16)
    two = replica(key(0), holder=RELAY, replica_id=b"\x02" * 16)
    assert (await ix.put(one, who="delegate")).status == 201
    created = await ix.put(two, who="delegate")
    assert created.status == 201 and "moqt_namespace=" in created.headers["Location"]
    namespaces = sorted(str(r.moqt_namespace) for r in (one, two))
    assert [r["moqt_namespace"] for r in (await ix.lookup([key(0)])).json["blocks"][0]["replicas"]] == namespaces
    assert (await ix.delete(one, who="delegate")).status == 204
    assert [r["moqt_namespace"] for r in (await ix.lookup([key(0)])).json["blocks"][0]["replicas"]] == [two.moqt_namespace]


# ---------------------------------------------------------------------------------------------
# §6.1 withdrawing


async def test_delete_withdraws_the_holders_replica_only(ix: Ix) -> None:
    await ix.put(replica(key(0), holder=H1))
    await ix.put(replica(key(0), holder=H2), who="holder2")
    reply = await ix.delete(replica(key(0), holder=H1))
    assert reply.status == 204 and reply.body == b""
    assert holders((await ix.lookup([key(0)])).json) == [H2]
    again = await ix.delete(replica(key(0), holder=H1))
    assert (again.status, again.problem) == (404, "kvsp-not-found")


async def test_delete_has_the_same_authorization_as_put(ix: Ix) -> None:
    await ix.put(replica(key(0), holder=H1))
    other = await ix.delete(replica(key(0), holder=H1), who="holder2")  # not h1's holder or delegate
    assert (other.status, other.problem) == (403, "kvsp-forbidden")
    wrong_scope = await ix.delete(replica(key(0), holder=H1, scope=SCOPE_B), who="holder1")
    assert (wrong_scope.status, wrong_scope.problem) == (403, "kvsp-forbidden")
    assert holders((await ix.lookup([key(0)])).json) == [H1]
    assert (await ix.delete(replica(key(0), holder=H1), who="delegate")).status == 204


async def test_delete_needs_the_holder_parameter(ix: Ix) -> None:
    reply = await ix.request("DELETE", block_path(key(0)))
    assert (reply.status, reply.problem) == (400, "kvsp-bad-record")
    assert reply.json["member"] == "holder"


# ---------------------------------------------------------------------------------------------
# §6.2 lookup


async def test_lookup_stops_at_the_first_key_without_a_replica(ix: Ix) -> None:
    for i in (0, 1, 3, 4):
        await ix.put(replica(key(i)))
    reply = (await ix.lookup([key(i) for i in range(5)])).json
    assert reply["matched"] == 2
    assert [b["block_key"] for b in reply["blocks"]] == [key(0).hex(), key(1).hex()]
    # A missing first key matches nothing, whatever follows.
    assert (await ix.lookup([key(2), key(3), key(4)])).json == {"matched": 0, "blocks": []}


async def test_an_expired_key_stops_the_match(ix: Ix) -> None:
    await ix.put(replica(key(0), ttl_ms=10_000))
    await ix.put(replica(key(1), ttl_ms=1_000))
    await ix.put(replica(key(2), ttl_ms=10_000))
    assert (await ix.lookup([key(0), key(1), key(2)])).json["matched"] == 3
    ix.clock.advance(1_000)
    assert (await ix.lookup([key(0), key(1), key(2)])).json["matched"] == 1


async def test_lookup_never_returns_replicas_of_another_scope_or_compat(ix: Ix) -> None:
    in_a = replica(key(0), holder=H1, scope=SCOPE_A)
    in_b = replica(key(0), holder=H1, scope=SCOPE_B)
    other_compat = replica(key(0), holder=H2, scope=SCOPE_A, compat=OTHER_COMPAT)
    assert (await ix.put(in_a, who="holder1")).status == 201
    assert (await ix.put(in_b, who="tenant-b")).status == 201
    assert (await ix.put(other_compat, who="holder2")).status == 201

    a = LookupResponse.from_json((await ix.lookup([key(0)], who="holder2", scope=SCOPE_A)).json)
    assert a.blocks[0].replicas == (in_a,)
    b = LookupResponse.from_json((await ix.lookup([key(0)], who="holder2", scope=SCOPE_B)).json)
    assert b.blocks[0].replicas == (in_b,)
    # Not authorized for scope B: refused, nothing returned.
    refused = await ix.lookup([key(0)], who="holder1", scope=SCOPE_B)
    assert (refused.status, refused.problem) == (403, "kvsp-forbidden")
    assert "blocks" not in refused.json
    refused_get = await ix.request("GET", block_path(key(0), scope=SCOPE_B), who="holder1")
    assert (refused_get.status, refused_get.problem) == (403, "kvsp-forbidden")


async def test_lookup_returns_every_replica_of_each_matched_key(ix: Ix) -> None:
    await ix.put(replica(key(0), holder=H2), who="holder2")
    await ix.put(replica(key(0), holder=H1))
    await ix.put(replica(key(1), holder=H2), who="holder2")
    reply = await ix.lookup([key(0), key(1)])
    response = LookupResponse.from_json(reply.json)
    assert response.matched == 2
    assert response.answers(LookupRequest.from_json(lookup_body([key(0), key(1)])))
    assert holders(reply.json, 0) == [H1, H2] and holders(reply.json, 1) == [H2]


async def test_unknown_members_are_ignored(ix: Ix) -> None:
    body = replica(key(0)).to_json()
    body["x-future"] = {"nested": [1, 2]}
    body["residency"][0]["x-tier-note"] = "fast"
    reply = await ix.request("PUT", block_path(key(0)), body=body)
    assert reply.status == 201
    assert "x-future" not in reply.json and "x-tier-note" not in reply.json["residency"][0]
    lookup = lookup_body([key(0)]) | {"x-hint": True}
    found = await ix.request("POST", "lookup", body=lookup)
    assert found.status == 200 and found.json["matched"] == 1
    assert "x-future" not in found.json["blocks"][0]["replicas"][0]


async def test_application_json_is_accepted_too(ix: Ix) -> None:
    reply = await ix.request("PUT", block_path(key(0)), body=replica(key(0)), content_type="application/json; charset=utf-8")
    assert reply.status == 201


# ---------------------------------------------------------------------------------------------
# Problems


async def test_401_without_or_with_a_bad_token(ix: Ix) -> None:
    missing = await ix.request("POST", "lookup", who=None, body=lookup_body([key(0)]))
    assert (missing.status, missing.problem) == (401, "kvsp-unauthorized")
    assert missing.headers["WWW-Authenticate"] == 'Bearer realm="kvsp"'

    unknown = await ix.request("POST", "lookup", who=None, body=lookup_body([key(0)]),
                               headers={"Authorization": "Bearer " + "z" * 32})
    assert (unknown.status, unknown.problem) == (401, "kvsp-unauthorized")
    assert unknown.headers["WWW-Authenticate"] == 'Bearer realm="kvsp", error="invalid_token"'

    basic = await ix.request("PUT", block_path(key(0)), who=None, body=replica(key(0)),
                             headers={"Authorization": "Basic dXNlcjpwYXNz"})
    assert (basic.status, basic.problem) == (401, "kvsp-unauthorized")
    assert "error=" not in basic.headers["WWW-Authenticate"]

    for method, path in (("DELETE", block_path(key(0))), ("GET", block_path(key(0))),
                         ("PUT", "instance-status"), ("PUT", f"descriptors/{COMPAT.hex()}")):
        reply = await ix.request(method, path, who=None, params={"holder": H1})
        assert (reply.status, reply.problem) == (401, "kvsp-unauthorized"), (method, path)


async def test_a_principal_without_grants_is_forbidden(ix: Ix) -> None:
    for reply in (
        await ix.put(replica(key(0)), who="nobody"),
        await ix.lookup([key(0)], who="nobody"),
        await ix.request("PUT", "instance-status", who="nobody", body=status(II7)),
    ):
        assert (reply.status, reply.problem) == (403, "kvsp-forbidden")


async def test_415_for_other_media_types(ix: Ix) -> None:
    body = replica(key(0))
    for content_type in ("text/plain", "application/octet-stream", "application/kvsp+json; charset=latin-1", None):
        reply = await ix.request("PUT", block_path(key(0)), body=body, content_type=content_type)
        assert reply.status == 415, content_type
        assert reply.problem == "about:blank" and reply.json["title"] == "Unsupported Media Type"
    reply = await ix.request("POST", "lookup", body=lookup_body([key(0)]), content_type="text/json")
    assert reply.status == 415


async def test_413_for_bodies_over_the_cap(ix: Ix) -> None:
    big = replica(key(0)).to_json() | {"padding": "x" * (64 * 1024)}
    reply = await ix.request("PUT", block_path(key(0)), body=big)
    assert (reply.status, reply.problem) == (413, "about:blank")

    async def chunks():  # no Content-Length: the cap is enforced while reading
        for _ in range(20):
            yield b" " * 4096

    async with ix.session.post(ix.url + "lookup", data=chunks(), headers={
        "Authorization": f"Bearer {TOKENS['holder1']}",
        "Content-Type": "application/kvsp+json",
    }) as resp:
        assert resp.status == 413
        assert (await resp.json(content_type=None))["status"] == 413


async def test_400_names_the_member_at_fault(ix: Ix) -> None:
    bad_json = await ix.request("PUT", block_path(key(0)), body=b"{not json")
    assert (bad_json.status, bad_json.problem, bad_json.json["member"]) == (400, "kvsp-bad-record", "$")

    overlapping = replica(key(0)).to_json()
    overlapping["residency"] = [{"tier": "device", "layers": [0, 2]}, {"tier": "host", "layers": [2, 3]}]
    reply = await ix.request("PUT", block_path(key(0)), body=overlapping)
    assert (reply.status, reply.problem, reply.json["member"]) == (400, "kvsp-bad-record", "residency[1].layers")

    missing = replica(key(0)).to_json()
    del missing["ttl_ms"]
    assert (await ix.request("PUT", block_path(key(0)), body=missing)).json["member"] == "ttl_ms"

    elsewhere = await ix.request("PUT", block_path(key(0), scope=SCOPE_B), body=replica(key(0)))
    assert (elsewhere.status, elsewhere.json["member"]) == (400, "scope_id")
    wrong_key = await ix.request("PUT", block_path(key(1)), body=replica(key(0)))
    assert (wrong_key.status, wrong_key.json["member"]) == (400, "block_key")

    upper = lookup_body([key(0)]) | {"scope_id": SCOPE_A.hex().upper()}
    assert (await ix.request("POST", "lookup", body=upper)).json["member"] == "scope_id"
    too_many = await ix.lookup([key(i) for i in range(101)])
    assert (too_many.status, too_many.json["member"]) == (400, "block_keys")
    not_object = await ix.request("POST", "lookup", body=b"[]")
    assert (not_object.status, not_object.json["member"]) == (400, "$")


async def test_404_for_unknown_paths_and_blocks(ix: Ix) -> None:
    for path in ("nothing-here", f"replicas/{COMPAT.hex()}/{SCOPE_A.hex()}/{key(0).hex().upper()}",
                 f"replicas/{COMPAT.hex()}/{SCOPE_A.hex()}", block_path(key(0))):
        reply = await ix.request("GET", path)
        assert (reply.status, reply.problem) == (404, "kvsp-not-found"), path


async def test_405_carries_allow(ix: Ix) -> None:
    reply = await ix.request("POST", block_path(key(0)), body=replica(key(0)))
    assert (reply.status, reply.problem) == (405, "about:blank")
    assert {m.strip() for m in reply.headers["Allow"].split(",")} == {"PUT", "DELETE", "GET"}


# ---------------------------------------------------------------------------------------------
# Ours: instance status and descriptors (inputs of the estimates)


async def test_instance_status_put(ix: Ix) -> None:
    reply = await ix.request("PUT", "instance-status", who="pc", body=status(II7, ttl_ms=10**9))
    assert reply.status == 200 and reply.json["ttl_ms"] == 60_000  # capped
    assert ix.service.statuses.get(II7) is not None
    stale = await ix.request("PUT", "instance-status", who="pc", body=status(II7, epoch=0))
    assert (stale.status, stale.problem) == (409, "kvsp-stale-epoch")
    forbidden = await ix.request("PUT", "instance-status", who="holder1", body=status(II7))
    assert (forbidden.status, forbidden.problem) == (403, "kvsp-forbidden")
    ix.clock.advance(60_000)
    assert ix.service.statuses.get(II7) is None


async def test_descriptor_put(ix: Ix) -> None:
    path = f"descriptors/{COMPAT.hex()}"
    assert (await ix.request("PUT", path, body=DESCRIPTOR)).status == 201
    assert (await ix.request("PUT", path, body=DESCRIPTOR)).status == 204
    wrong = await ix.request("PUT", f"descriptors/{OTHER_COMPAT.hex()}", body=DESCRIPTOR)
    assert (wrong.status, wrong.problem, wrong.json["member"]) == (400, "kvsp-bad-record", "$")
    invalid = await ix.request("PUT", path, body=DESCRIPTOR | {"layers": 0})
    assert (invalid.status, invalid.json["member"]) == (400, "layers")


async def test_base_path() -> None:
    async with running_index(IndexConfig(base_path="/kvsp/is/", purge_interval_ms=0)) as ix:
        assert ix.url.endswith("/kvsp/is/")
        assert (await ix.put(replica(key(0)))).status == 201
        assert (await ix.lookup([key(0)])).json["matched"] == 1
        outside = await ix.session.post(ix.url.removesuffix("kvsp/is/") + "lookup")
        assert outside.status == 404
        outside.release()


# ---------------------------------------------------------------------------------------------
# Robustness


class BrokenStore(MemoryIndexStore):
    """A store whose reads fail, as a networked store's might."""

    async def get(self, block: BlockRef) -> list[StoredReplica]:
        raise RuntimeError("secret internal detail")


async def test_an_unexpected_error_is_a_500_problem_without_details() -> None:
    config = ControlConfig(auth=AUTH, index=IndexConfig(purge_interval_ms=0))
    async with await serve_index(config, store=BrokenStore()) as server, aiohttp.ClientSession() as session:
        async with session.post(server.url + "lookup", json=lookup_body([key(0)]),
                                headers={"Authorization": f"Bearer {TOKENS['holder1']}"}) as resp:
            body = await resp.read()
            assert resp.status == 500 and resp.content_type == "application/problem+json"
            assert json.loads(body)["type"] == "about:blank" and b"secret" not in body


class WatchedStore(MemoryIndexStore):
    """A store that tells when it was purged."""

    def __init__(self) -> None:
        super().__init__()
        self.purged = asyncio.Event()

    async def purge(self) -> int:
        self.purged.set()
        return await super().purge()


async def test_expired_records_are_purged_in_the_background() -> None:
    store = WatchedStore()
    config = ControlConfig(auth=AUTH, index=IndexConfig(purge_interval_ms=1))
    async with await serve_index(config, store=store):
        await asyncio.wait_for(store.purged.wait(), 30)  # a guard, not a wait for time to pass


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4),
    max_leaves=20,
)
valid = replica(key(0)).to_json()
bodies = st.one_of(
    st.binary(max_size=200),
    json_values.map(lambda v: json.dumps(v).encode()),
    # A valid record with one member replaced by an arbitrary value.
    st.tuples(st.sampled_from(sorted(valid)), json_values).map(lambda kv: json.dumps(valid | {kv[0]: kv[1]}).encode()),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(bodies, st.sampled_from(["PUT", "POST"]))
def test_any_body_gets_a_record_or_a_problem(body: bytes, method: str) -> None:
    async def run() -> None:
        async with running_index() as ix:
            path = block_path(key(0)) if method == "PUT" else "lookup"
            reply = await ix.request(method, path, body=body)
            assert reply.status in (200, 201, 400), reply.body
            if reply.status == 400:
                assert reply.problem == "kvsp-bad-record" and isinstance(reply.json["member"], str)

    asyncio.run(run())
