"""The batch publish route of the Index Service (ours: ``POST {is}replicas:batch``, a holder's
batched §6.1 refresh) against a real IS on 127.0.0.1: what it stores and answers, hostile
input (``_hostile_support.attack_json_route``), all-or-nothing authorization; and the holder
side, ``ReplicaPublisher.refresh`` in batches through ``HttpIndexClient.publish_many``, with
its fallback to single PUTs against an IS without the route."""

from __future__ import annotations

import json
from typing import Any

import aiohttp

from _hostile_support import Findings, JsonRoute, attack_json_route, send
from kvsp_moq.control.client.http import HttpIndexClient
from kvsp_moq.control.client.publisher import ReplicaPublisher
from kvsp_moq.control.common.clock import ManualClock
from kvsp_moq.control.common.config import IndexConfig
from kvsp_moq.control.http.server import build_app, serve_app
from kvsp_moq.control.index.routes import IndexRoutes
from kvsp_moq.control.index.service import IndexService
from kvsp_moq.control.index.store import BlockRef
from kvsp_moq.storage import BlockStore, HostTier, RecordKey
from test_index_support import AUTH, COMPAT, H1, H2, SCOPE_A, SCOPE_B, TOKENS, Ix, key, replica, running_index

MAX_BODY = 64 * 1024
CONFIG = IndexConfig(purge_interval_ms=0, max_body_octets=MAX_BODY, max_batch_records=8, max_ttl_ms=30_000)


def batch(*records: Any) -> dict[str, Any]:
    return {"records": [r.to_json() if hasattr(r, "to_json") else r for r in records]}


async def post(ix: Ix, body: Any, who: str = "holder1") -> Any:
    return await ix.request("POST", "replicas:batch", who=who, body=body)


async def test_a_batch_is_a_put_of_each_record() -> None:
    async with running_index(CONFIG) as ix:
        assert (await ix.put(replica(key(0)))).status == 201
        reply = await post(ix, batch(replica(key(0)), replica(key(1), ttl_ms=90_000), replica(key(2), ttl_ms=500)),
                           who="delegate")
        assert reply.status == 200 and reply.content_type == "application/kvsp+json"
        assert reply.json == {"results": [{"created": False, "ttl_ms": 30_000}, {"created": True, "ttl_ms": 30_000},
                                          {"created": True, "ttl_ms": 500}]}
        ix.clock.advance(400)
        found = await ix.service.store.get_prefix(COMPAT, SCOPE_A, [key(0), key(1), key(2), key(3)])
        assert [[s.remaining_ms for s in r] for r in found] == [[29_600], [29_600], [100]]
        assert (await post(ix, batch())).json == {"results": []}


async def test_one_refusal_refuses_the_batch_and_stores_nothing() -> None:
    async with running_index(CONFIG) as ix:
        for records, who, status, problem in (
            ((replica(key(0)), replica(key(1), scope=SCOPE_B)), "holder1", 403, "kvsp-forbidden"),  # other scope
            ((replica(key(0)), replica(key(1), holder=H2)), "holder1", 403, "kvsp-forbidden"),  # not its holder
            ((replica(key(0)),) * 9, "holder1", 400, "kvsp-bad-record"),  # over max_batch_records
        ):
            reply = await post(ix, batch(*records), who=who)
            assert (reply.status, reply.problem) == (status, problem), reply.body
        bad = replica(key(1)).to_json() | {"holder": "not a url"}
        reply = await post(ix, batch(replica(key(0)), bad))
        assert (reply.status, reply.problem) == (400, "kvsp-bad-record")
        assert reply.json["member"] == "records[1].holder"
        assert await ix.service.store.count() == 0


async def test_hostile_input() -> None:
    async with running_index(CONFIG) as ix:
        found = Findings()
        route = JsonRoute("POST", f"{ix.url}replicas:batch", batch(replica(key(0))), "holder1", MAX_BODY, "tenant-b")
        await attack_json_route(ix.session, route, TOKENS, found)
        many = json.dumps(batch(*[replica(key(0))] * 9)).encode()
        found.check("9 records", await send(ix.session, "POST", route.url, token=TOKENS["holder1"], body=many),
                    400, "kvsp-bad-record", "records")
        found.assert_clean()
        # the route attacked is intact: a valid batch still works and nothing hostile was stored
        assert [[s.record.holder for s in r] for r in await ix.service.store.get_prefix(COMPAT, SCOPE_A, [key(0)])] \
            in ([], [[H1]])
        assert (await post(ix, batch(replica(key(5))))).status == 200


def _publisher(session: aiohttp.ClientSession, index_url: str, count: int) -> ReplicaPublisher:
    store = BlockStore([HostTier(1 << 24)])
    for i in range(count):
        store.put_layers(RecordKey(COMPAT, SCOPE_A, key(i)), [(b"k" * 64, b"v" * 64)] * 4, token_count=1)
    client = HttpIndexClient(index_url, TOKENS["holder1"], session=session)
    return ReplicaPublisher(store, client, holder_url=H1, clock=ManualClock(0), batch_size=4)


async def test_refresh_goes_in_batches() -> None:
    async with running_index(CONFIG) as ix, aiohttp.ClientSession() as session:
        publisher = _publisher(session, ix.url, 10)
        assert await publisher.refresh() == 10 and await ix.service.store.count() == 10
        one = RecordKey(COMPAT, SCOPE_A, key(3))
        info = publisher.store.get(one)
        assert info is not None and publisher.remaining_ms(one, info.replica_id) == 30_000  # as granted
        assert await publisher.refresh() == 0  # nothing due


async def test_refresh_falls_back_to_single_puts_without_the_route() -> None:
    service = IndexService.in_memory(CONFIG, clock=ManualClock(0))
    routes = [r for r in IndexRoutes(service).routes() if not r.path.endswith(":batch")]  # an older IS
    async with await serve_app(build_app(auth=AUTH, routes=routes)) as server, aiohttp.ClientSession() as session:
        publisher = _publisher(session, server.url, 10)
        assert await publisher.refresh() == 10 and await service.store.count() == 10
        assert [s.record.holder for s in await service.store.get(BlockRef(COMPAT, SCOPE_A, key(9)))] == [H1]
        publisher.store.put_layers(RecordKey(COMPAT, SCOPE_A, key(10)), [(b"k" * 64, b"v" * 64)] * 4, token_count=1)
        assert await publisher.refresh() == 1 and await service.store.count() == 11
