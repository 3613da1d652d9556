"""Sequence-sharded caches and resharding (kvsp-draft §6.9) over real HTTP on 127.0.0.1: a PC
and three instances holding KV by token range. Plans (retain / fetch with from / release),
3 → 2 instances moving exactly the octets that change hands, commit, and aborts (deadline,
a refusing member) that leave version v intact and discard what was fetched."""

from __future__ import annotations

import asyncio
import struct
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from kvsp_moq.control.common.config import ControlConfig, InstanceConfig, PcConfig, TierConfig
from kvsp_moq.control.common.shard_store import MemoryShardStore, RangeNotHeld, ShardSlice, TokenRange
from kvsp_moq.control.http.server import RunningServer
from kvsp_moq.control.instance.serve import serve_instance
from kvsp_moq.control.instance.service import InstanceService
from kvsp_moq.control.pc.reshard_plan import reshard_plans
from kvsp_moq.kvsp.records import ShardMap
from test_instance_support import AUTH, TOKENS, World, call, instance_service, world
from test_sessions_support import guarded

LAYERS = 3
OCTETS_PER_TOKEN = LAYERS * (8 + 8)  # K and V of every layer
MAP = "ctx-1"


def kv(a: int, b: int) -> ShardSlice:
    """Deterministic KV of tokens [a, b): K and V of token t, layer l name (t, l)."""
    return ShardSlice((a, b), tuple(
        (b"".join(struct.pack(">II", t, l) for t in range(a, b)), b"".join(struct.pack(">II", t, l | 1 << 31) for t in range(a, b)))
        for l in range(LAYERS)
    ))


def shard_map(version: int, *shards: tuple[int, int, str]) -> dict[str, Any]:
    return {"map": MAP, "version": version, "shards": [{"tokens": [a, b], "instance": i} for a, b, i in shards]}


class GatedStore(MemoryShardStore):
    """A real store whose reads wait for ``release`` once ``gate`` is set (a slow or stuck
    peer), and fail when ``fail`` is set; ``staged_event`` is set when anything is staged,
    ``committed`` when a version is committed."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = False
        self.fail = False
        self.hidden = False  # held() answers nothing: every plan's retain ranges are "not held" here
        self.entered = asyncio.Event()
        self.release = asyncio.Event()
        self.staged_event = asyncio.Event()
        self.committed = asyncio.Event()

    async def read(self, map_id: str, tokens: TokenRange) -> ShardSlice:
        if self.gate:
            self.entered.set()
            await self.release.wait()
        if self.fail:
            raise RangeNotHeld("this peer lost its shard")
        return await super().read(map_id, tokens)

    def held(self, map_id: str) -> tuple[TokenRange, ...]:
        return () if self.hidden else super().held(map_id)

    async def stage(self, map_id: str, version: int, data: ShardSlice) -> None:
        await super().stage(map_id, version, data)
        self.staged_event.set()

    def commit(self, map_id: str, version: int, release: Sequence[TokenRange]) -> None:
        super().commit(map_id, version, release)
        self.committed.set()


@dataclass
class Group:
    w: World
    servers: list[RunningServer]
    stores: list[GatedStore]

    def url(self, i: int) -> str:
        return self.servers[i].url

    def service(self, i: int) -> InstanceService:
        return instance_service(self.servers[i])

    async def put_map(self, body: dict[str, Any], query: str = "", who: str = "pc") -> Any:
        return await call(self.w.session, "PUT", f"{self.w.pc.url}shard-maps/{MAP}{query}", who=who, body=body)

    def v4(self) -> dict[str, Any]:
        return shard_map(4, (0, 30, self.url(0)), (30, 60, self.url(1)), (60, 90, self.url(2)))

    def v5(self) -> dict[str, Any]:
        return shard_map(5, (0, 45, self.url(0)), (45, 90, self.url(1)))

    def assert_v4_intact(self) -> None:
        for i, (a, b) in enumerate([(0, 30), (30, 60), (60, 90)]):
            assert self.service(i).shards.versions[MAP] == 4
            assert self.stores[i].held(MAP) == ((a, b),)
            assert self.stores[i].read_now(MAP, (a, b)) == kv(a, b)
            assert self.stores[i].staged(MAP, 5) == ()


@asynccontextmanager
async def group(pc: PcConfig | None = None) -> AsyncIterator[Group]:
    async with world(holders=0, pc=pc) as w:
        servers, stores = [], []
        for _ in range(3):
            store = GatedStore()
            ic = InstanceConfig(token=TOKENS["inst"], tiers=(TierConfig("host", 1 << 16),))
            servers.append(await w.stack.enter_async_context(
                await serve_instance(ControlConfig(auth=AUTH, instance=ic), clock=w.clock, epoch=1, report=False, shard_store=store)))
            stores.append(store)
        g = Group(w, servers, stores)
        for i, (a, b) in enumerate([(0, 30), (30, 60), (60, 90)]):
            g.service(i).shards.install(MAP, 4, kv(a, b))  # the prefill computed them
        try:
            yield g
        finally:
            for store in stores:
                store.release.set()


def test_plans_retain_in_place_and_fetch_only_what_changes_hands() -> None:
    i1, i2, i3 = "http://i1/", "http://i2/", "http://i3/"
    old = ShardMap.from_json(shard_map(4, (0, 30, i1), (30, 60, i2), (60, 90, i3)))
    new = ShardMap.from_json(shard_map(5, (0, 45, i1), (45, 90, i2)))
    plans = {i: p.to_json() for i, p in reshard_plans(old, new, 200).items()}
    common = {"map": MAP, "from": 4, "to": 5, "deadline_ms": 200}
    assert plans == {
        i1: common | {"retain": [[0, 30]], "fetch": [{"tokens": [30, 45], "from": i2}], "release": []},
        i2: common | {"retain": [[45, 60]], "fetch": [{"tokens": [60, 90], "from": i3}], "release": [[30, 45]]},
        i3: common | {"retain": [], "fetch": [], "release": [[60, 90]]},
    }
    # 2 -> 3 back, and a swap: a range moving between instances is fetched from its holder in v
    swap = ShardMap.from_json(shard_map(5, (0, 30, i2), (30, 60, i1), (60, 90, i3)))
    p = reshard_plans(old, swap, 50)
    assert p[i3].retain == ((60, 90),) and not p[i3].fetch and not p[i3].release
    assert [(f.tokens, f.source) for f in p[i1].fetch] == [((30, 60), i2)]


async def test_three_to_two_moves_exactly_the_octets_that_change_hands() -> None:
    async with group() as g:
        installed = await g.put_map(g.v4())
        assert installed.json == {"map": MAP, "state": "installed", "version": 4, "members": []}
        reply = await g.put_map(g.v5())
        assert reply.status == 200, reply.body
        assert reply.json["state"] == "committed" and reply.json["version"] == 5
        fetched = {m["instance"]: m["fetched_octets"] for m in reply.json["members"]}
        assert fetched == {g.url(0): 15 * OCTETS_PER_TOKEN, g.url(1): 30 * OCTETS_PER_TOKEN, g.url(2): 0}
        # counted at both ends: retained ranges (ii1 [0,30), ii2 [45,60)) were never transferred
        assert [g.service(i).shards.fetched_octets for i in range(3)] == [15 * OCTETS_PER_TOKEN, 30 * OCTETS_PER_TOKEN, 0]
        assert [g.service(i).shards.served_octets for i in range(3)] == [0, 15 * OCTETS_PER_TOKEN, 30 * OCTETS_PER_TOKEN]
        assert g.stores[0].held(MAP) == ((0, 45),) and g.stores[0].read_now(MAP, (0, 45)) == kv(0, 45)
        assert g.stores[1].held(MAP) == ((45, 90),) and g.stores[1].read_now(MAP, (45, 90)) == kv(45, 90)
        assert g.stores[2].held(MAP) == ()  # released after the commit
        assert [g.service(i).shards.versions[MAP] for i in range(3)] == [5, 5, 5]
        current = await call(g.w.session, "GET", f"{g.w.pc.url}shard-maps/{MAP}")
        assert current.json == g.v5()
        again = await g.put_map(g.v5())  # the same version again: nothing moves
        assert again.json["state"] == "committed" and g.service(1).shards.fetched_octets == 30 * OCTETS_PER_TOKEN


async def test_deadline_aborts_and_version_v_stays_intact() -> None:
    async with group() as g:
        await g.put_map(g.v4())
        g.stores[2].gate = True  # ii3 serves [60, 90) to ii2 only when released
        put = asyncio.create_task(g.put_map(g.v5(), "?deadline_ms=200"))
        await guarded(g.stores[2].entered.wait())
        await guarded(g.stores[0].staged_event.wait())  # ii1 did fetch [30, 45) from ii2
        g.w.clock.advance(200)  # the PC's deadline passes (§6.9 "fails to acknowledge within deadline_ms")
        reply = await guarded(put)
        assert reply.json["state"] == "aborted" and reply.json["version"] == 4
        results = {m["instance"]: m["result"] for m in reply.json["members"]}
        assert results == {g.url(0): "acknowledged", g.url(1): "deadline", g.url(2): "acknowledged"}
        g.assert_v4_intact()  # ii1's fetched [30, 45) was discarded; nothing released
        assert (await call(g.w.session, "GET", f"{g.w.pc.url}shard-maps/{MAP}")).json == g.v4()
        # the stuck peer recovers: the same step succeeds
        g.stores[2].gate = False
        g.stores[2].release.set()
        retry = await g.put_map(g.v5())
        assert retry.json["state"] == "committed", retry.body
        assert g.stores[1].read_now(MAP, (45, 90)) == kv(45, 90)


async def test_a_refusing_member_aborts_and_fetched_ranges_are_discarded() -> None:
    async with group() as g:
        await g.put_map(g.v4())
        g.stores[2].gate = True
        g.stores[2].fail = True
        put = asyncio.create_task(g.put_map(g.v5()))
        await guarded(g.stores[2].entered.wait())
        await guarded(g.stores[0].staged_event.wait())
        assert g.stores[0].staged(MAP, 5) == ((30, 45),)
        g.stores[2].release.set()  # ii3 now fails the read: ii2 cannot load its fetch and refuses
        reply = await guarded(put)
        assert reply.json["state"] == "aborted"
        results = {m["instance"]: m["result"] for m in reply.json["members"]}
        assert results[g.url(1)] == "refused" and results[g.url(0)] == "acknowledged"
        g.assert_v4_intact()


async def test_the_abort_after_a_refused_plan_or_sent_twice_does_not_refuse_the_next_plan() -> None:
    """An abort that finds no plan to cancel overtook its plan only if no plan to that version
    reached the member: the abort of a plan it refused, or the same abort again, must not make
    it refuse the next plan to that version (each refusal aborts that try, and every retry of
    the version would fail there)."""
    async with group() as g:
        await g.put_map(g.v4())
        g.stores[0].hidden = True  # ii1 refuses its plan: its retain range [0, 30) is not held
        refused = await g.put_map(g.v5())
        assert refused.json["state"] == "aborted"
        assert {m["instance"]: m["result"] for m in refused.json["members"]}[g.url(0)] == "refused"
        g.stores[0].hidden = False  # ii1 holds it again: the same step now succeeds
        retry = await g.put_map(g.v5())
        assert retry.json["state"] == "committed", retry.body
        assert g.stores[0].read_now(MAP, (0, 45)) == kv(0, 45)

        # an abort reaching a member twice (a PC sends its decision again after a takeover)
        url = f"{g.url(2)}reshard"  # ii3 is in no shard of v5
        plan = {"map": MAP, "from": 5, "to": 6, "deadline_ms": 1000, "retain": [], "fetch": [], "release": []}
        for body in (plan, {"map": MAP, "abort": 6}, {"map": MAP, "abort": 6}, plan, {"map": MAP, "commit": 6}):
            reply = await call(g.w.session, "POST", url, who="pc", body=body)
            assert reply.status == 200, (body, reply.body)
        # an abort that did overtake its plan still refuses that plan, once
        for body, status in (({"map": MAP, "abort": 7}, 200), (plan | {"from": 6, "to": 7}, 409),
                             (plan | {"from": 6, "to": 7}, 200)):
            reply = await call(g.w.session, "POST", url, who="pc", body=body)
            assert reply.status == status, (body, reply.body)


async def test_a_pc_stopping_mid_reshard_with_the_memory_store_tells_the_members_abort() -> None:
    """With the memory store no PC takes over (issue 30): a PC stopping mid-reshard does not
    wait for the deadline; it answers the PUT 503 and sends the members abort, so none is left
    holding a plan nobody decides (which would refuse the next one) or its staged ranges."""
    async with group() as g:
        await g.put_map(g.v4())
        g.stores[2].gate = True
        put = asyncio.create_task(g.put_map(g.v5(), "?deadline_ms=120000"))
        await guarded(g.stores[2].entered.wait())
        await guarded(g.stores[0].staged_event.wait())
        await guarded(g.w.pc.close())
        reply = await guarded(put)
        assert reply.status == 503 and reply.problem == "kvsp-not-leader"
        g.assert_v4_intact()
        assert [g.service(i).shards.staged_maps() for i in range(3)] == [[], [], []]


async def test_hostile_reshard_messages_and_maps() -> None:
    async with group() as g:
        await g.put_map(g.v4())
        url = f"{g.url(0)}reshard"

        async def post(body: Any, who: str = "pc") -> Any:
            return await call(g.w.session, "POST", url, who=who, body=body)

        plan = {"map": MAP, "from": 4, "to": 5, "deadline_ms": 100, "retain": [[0, 30]]}
        for body, member in [
            ({"map": MAP, "commit": 5, "abort": 5}, "$"),
            (plan | {"to": 6}, "to"),
            (plan | {"retain": [[0, 30]], "release": [[10, 20]]}, "release[0]"),
            (plan | {"fetch": [{"tokens": [30, 40], "from": "ftp://x/"}]}, "fetch[0].from"),
            (plan | {"retain": [[5, 5]]}, "retain[0]"),
            (plan | {"deadline_ms": 0}, "deadline_ms"),
            (b"[1]", "$"),
        ]:
            reply = await post(body)
            assert reply.status == 400 and reply.json["member"] == member, (member, reply.body)
        stale = await post(plan | {"from": 3, "to": 4})
        assert stale.status == 409 and stale.problem == "kvsp-stale-epoch"
        not_held = await post(plan | {"retain": [[0, 31]]})
        assert not_held.status == 404
        assert (await post(plan, who="client-a")).problem == "kvsp-forbidden"
        assert (await post({"map": MAP, "commit": 9})).status == 404
        # the peer fetch endpoint
        base = f"{g.url(1)}shards/{MAP}"
        for query in ("?tokens=40-30", "?tokens=30", "?tokens=a-b", "", "?tokens=1-99999999999999999"):
            bad = await call(g.w.session, "GET", f"{base}/4{query}", who="inst")
            assert bad.status == 400 and bad.json["member"] == "tokens", (query, bad.body)
        assert (await call(g.w.session, "GET", f"{base}/3?tokens=30-40", who="inst")).status == 404
        assert (await call(g.w.session, "GET", f"{base}/4?tokens=0-40", who="inst")).status == 404
        ok = await call(g.w.session, "GET", f"{base}/4?tokens=30-40", who="inst")
        assert ok.status == 200 and ok.headers["Content-Type"] == "application/kvsp-block" and "Repr-Digest" in ok.headers
        # the PC's maps
        gap = shard_map(5, (0, 40, g.url(0)), (45, 90, g.url(1)))
        assert (await g.put_map(gap)).json["member"] == "shards[1].tokens"
        assert (await g.put_map(shard_map(5, (0, 80, g.url(0))))).json["member"] == "shards"  # not the same tokens
        assert (await g.put_map(g.v4() | {"version": 3})).problem == "kvsp-stale-epoch"
        assert (await g.put_map(g.v4() | {"version": 6})).json["member"] == "version"
        assert (await g.put_map(g.v4() | {"map": "other"})).json["member"] == "map"
        assert (await g.put_map(g.v5(), "?deadline_ms=x")).json["member"] == "deadline_ms"
        assert (await g.put_map(g.v5(), who="client-a")).problem == "kvsp-forbidden"
        assert (await call(g.w.session, "GET", f"{g.w.pc.url}shard-maps/nope")).status == 404
        g.assert_v4_intact()
