"""Every store on a real Redis Cluster (``store = "redis+cluster://..."``; DESIGN.md §8,
docs/deploy.md "Redis Cluster" and "Durability"): 3 primaries + 3 replicas on loopback
(tests/redis_cluster.py).

- the ``store`` key's cluster URLs and their errors;
- each store works on the cluster: its keys carry hash tags, so each script stays in one slot;
- what an acknowledged write survives: records, leases, sessions with their checkpoints, and
  delivered tokens written with ``store_wait_replicas = 1`` are all there after the primary
  that held them is SIGKILLed and its replica promoted; while the promoted primary has no
  replica, a write is refused (503), not acknowledged;
- two ``kvsp index`` processes over the cluster see each other's records, through a failover;
- instance statuses (with their links) reported to one IS are every IS's;
- ``kvsp bench index --store cluster`` on this cluster prints its rows for 1 and 2 IS processes.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import aiohttp
import pytest
from redis_cluster import healthy_cluster, redis_cluster  # noqa: F401
from test_index_redis_processes import call, index_processes, lookup, publish, write_config
from test_cli import kvsp
from test_index_support import AUTH, COMPAT, H1, H2, II7, SCOPE_A, SCOPE_B, key, lookup_body, replica, status

from kvsp_moq.bench.redis_cluster import RedisClusterProcess
from kvsp_moq.control.common.config import ControlConfig, IndexConfig
from kvsp_moq.control.common.errors import ConfigError, StaleEpoch, StoreUnavailable
from kvsp_moq.control.common.session_records import OutputToken, OutputTokens, SessionOpen
from kvsp_moq.control.common.store import StoreSpec, parse_store
from kvsp_moq.control.frontend.delivery import Registration
from kvsp_moq.control.frontend.delivery_redis import RedisDeliveryStore
from kvsp_moq.control.holder.lease_redis import RedisLeaseStore
from kvsp_moq.control.holder.lease_store import Lease, LeaseLimits
from kvsp_moq.control.index.redis_store import RedisIndexStore
from kvsp_moq.control.index.serve import INDEX_SERVICE, serve_index
from kvsp_moq.control.index.status_table import SharedStatusTable
from kvsp_moq.control.index.store import BlockRef, ReplicaId
from kvsp_moq.control.pc.store import RedisPcStore, StoredSession
from kvsp_moq.storage import RecordKey

#: A key in the slot of scope A's records (the index's hash tag is the scope).
SCOPE_A_SLOT = "{" + (COMPAT + SCOPE_A).hex() + "}"
LIMITS = LeaseLimits(max_leases=10, max_octets=1 << 30)
NOW = 1_000_000  # the lease clock of these tests (ms)


# -- configuration -------------------------------------------------------------------------------


def test_cluster_urls_and_their_errors() -> None:
    spec = parse_store("index", "redis+cluster://10.0.0.1:7000,[::1]:7001")
    assert spec.nodes == (("10.0.0.1", 7000), ("::1", 7001)) and spec.is_cluster
    assert spec.wait_replicas == 1  # the cluster default: acknowledged once a replica has it
    assert parse_store("index", "redis://127.0.0.1:6379/0").wait_replicas == 0
    assert parse_store("pc", "rediss+cluster://u:pw@h:7000", wait_replicas=0).wait_replicas == 0
    assert parse_store("pc", "rediss+cluster://u:pw@h:7000/0").redacted == "rediss+cluster://***@h:7000/0"
    for value, message in [
        ("redis+cluster://", "HOST:PORT"),
        ("redis+cluster://h", "is not HOST:PORT"),
        ("redis+cluster://h:7000,h2", "'h2' is not HOST:PORT"),
        ("redis+cluster://h:70000", "is not HOST:PORT"),
        ("redis+cluster://h:7000/2", "only database 0"),
        ("redis+cluster://h:7000?x=1", "no query"),
        ("cluster://h:7000", "redis+cluster://"),
    ]:
        with pytest.raises(ConfigError, match="index.store") as raised:
            parse_store("index", value)
        assert message in str(raised.value), (value, str(raised.value))
    with pytest.raises(ConfigError, match="index.store_wait_replicas"):
        parse_store("index", "redis+cluster://h:7000", wait_replicas=-1)


# -- the stores on the cluster ---------------------------------------------------------------------


def spec_of(cluster: RedisClusterProcess, prefix: str, **kw: object) -> StoreSpec:
    return parse_store("test", cluster.url, key_prefix=prefix, timeout_ms=2_000, **kw)  # type: ignore[arg-type]


def colocated(cluster: RedisClusterProcess, port: int, role: str) -> str:
    """A key prefix whose ``{prefix + role}`` tag is served by the primary on ``port``."""
    for i in range(10_000):
        prefix = f"t{uuid.uuid4().hex[:6]}{i}:"
        if cluster.primary_for(f"{{{prefix}{role}}}").port == port:
            return prefix
    raise AssertionError("no prefix found")


def session_on(cluster: RedisClusterProcess, port: int, prefix: str) -> uuid.UUID:
    """A session id whose front-end keys are served by the primary on ``port``."""
    while True:
        session = uuid.uuid4()
        if cluster.primary_for(f"{prefix}frontend:{{{session}}}:meta").port == port:
            return session


def lease(i: int, owner: str = "ii7") -> Lease:
    return Lease(f"lease-{i}", owner, {RecordKey(COMPAT, SCOPE_A, key(i)): bytes(16)}, 1000, NOW + 60_000, SCOPE_A)


def pc_session() -> tuple[StoredSession, SessionCheckpoint]:
    opened = SessionOpen.from_json({
        "session": str(uuid.uuid4()), "compat_id": COMPAT.hex(), "scope_id": SCOPE_A.hex(), "prompt_blocks": [],
        "prompt_tail": [1, 2, 3], "tokens": 3, "max_tokens": 64, "front_end": "https://fe.example/kvsp/",
        "sampler": {"method": "greedy", "params": {}, "seed": 1, "step": 0, "deterministic": True}})
    return StoredSession(opened, 0), opened.initial_checkpoint()


@pytest.fixture
async def stores(healthy_cluster: RedisClusterProcess) -> AsyncIterator[tuple[RedisIndexStore, RedisLeaseStore, RedisPcStore, RedisDeliveryStore]]:
    """One store of each role over the cluster, with a prefix of this test's own; the holder's
    and the PC's hash tags on the primary that serves the index's scope A."""
    target = healthy_cluster.primary_for(SCOPE_A_SLOT).port
    prefix = colocated(healthy_cluster, target, "holder")
    pc_prefix = colocated(healthy_cluster, target, "pc")
    index = RedisIndexStore.open(spec_of(healthy_cluster, prefix))
    leases = RedisLeaseStore(spec_of(healthy_cluster, prefix))
    pc = RedisPcStore(spec_of(healthy_cluster, pc_prefix))
    delivery = RedisDeliveryStore(spec_of(healthy_cluster, prefix), poll_s=0.2)
    try:
        yield index, leases, pc, delivery
    finally:
        for store in (index, leases, pc, delivery):
            await store.close()


async def test_every_store_works_on_the_cluster(stores: tuple[RedisIndexStore, RedisLeaseStore, RedisPcStore, RedisDeliveryStore]) -> None:
    index, leases, pc, delivery = stores
    # index: two scopes (two hash tags: two slots), one batch; a prefix lookup is one script
    created = await index.put_many([(replica(key(i)), 60_000) for i in range(4)]
                                   + [(replica(key(0), scope=SCOPE_B), 60_000)])
    assert created == [True] * 5
    assert [len(r) for r in await index.get_prefix(COMPAT, SCOPE_A, [key(i) for i in range(6)])] == [1, 1, 1, 1]
    assert (await index.get(BlockRef(COMPAT, SCOPE_B, key(0))))[0].record == replica(key(0), scope=SCOPE_B)
    assert await index.count() == 5
    assert await index.delete(BlockRef(COMPAT, SCOPE_A, key(3)), ReplicaId.of(replica(key(3)))) is True
    # holder leases: the quota is checked over the owner's leases in one script
    assert (await leases.grant(lease(1), LIMITS, NOW)).granted
    assert (await leases.usage("ii7", NOW)).leases == 1
    assert (await leases.renew("ii7", "lease-1", NOW + 90_000, NOW)) is not None
    assert [x.id for x in await leases.live(NOW)] == ["lease-1"]
    assert [x.id for x in await leases.purge(NOW + 100_000)] == ["lease-1"]
    # PC: the leader lock fences every write, all in the PC's slot
    assert await pc.acquire("pc-a", 10_000) and not await pc.acquire("pc-b", 10_000)
    session, checkpoint = pc_session()
    assert await pc.create_session("pc-a", session, checkpoint)
    snapshot = await pc.load()
    assert snapshot.sessions[session.session] == session and snapshot.checkpoints[session.session] == checkpoint
    # front end: one session's keys in its slot; the claim in another
    sid = uuid.uuid4()
    await delivery.register(sid, Registration(SCOPE_A, 8), max_sessions=10)
    outcome = await delivery.accept(sid, OutputTokens(session=sid, epoch=1, tokens=(OutputToken(index=0, token=7),)), max_ahead=8)
    assert outcome.code == "ok" and outcome.accepted == 1
    snap = await delivery.read(sid, 0, 8)
    assert snap is not None and snap.tokens == (7,)
    await delivery.forget(sid)
    assert await delivery.read(sid, 0, 8) is None


async def test_acknowledged_writes_survive_a_primary_sigkill_and_failover(
        healthy_cluster: RedisClusterProcess,
        stores: tuple[RedisIndexStore, RedisLeaseStore, RedisPcStore, RedisDeliveryStore]) -> None:
    index, leases, pc, delivery = stores
    records = [(replica(key(i), holder=h), 60_000) for i in range(64) for h in (H1, H2)]
    assert all(await index.put_many(records))
    for i in range(5):
        assert (await leases.grant(lease(i), LIMITS, NOW)).granted
    assert await pc.acquire("pc-a", 60_000)
    session, checkpoint = pc_session()
    assert await pc.create_session("pc-a", session, checkpoint)
    later = replace(checkpoint, generated=(5, 6), output_offset=2)
    assert await pc.put_checkpoint("pc-a", later) == 2
    target = healthy_cluster.primary_for(SCOPE_A_SLOT)
    sid = session_on(healthy_cluster, target.port, delivery.spec.key_prefix)
    await delivery.register(sid, Registration(SCOPE_A, 8), max_sessions=10)
    batch = OutputTokens(session=sid, epoch=1, tokens=tuple(OutputToken(index=i, token=100 + i) for i in range(3)))
    assert (await delivery.accept(sid, batch, max_ahead=8)).accepted == 3

    killed = healthy_cluster.kill_primary(SCOPE_A_SLOT)
    assert killed.port == target.port
    assert healthy_cluster.primary_for(leases.prefix + "expiry").port != target.port  # moved with the scope

    # Every acknowledged write is on the promoted replica.
    found = await index.get_prefix(COMPAT, SCOPE_A, [key(i) for i in range(64)])
    assert [len(r) for r in found] == [2] * 64
    assert sorted(x.id for x in await leases.live(NOW)) == [f"lease-{i}" for i in range(5)]
    assert (await leases.get("ii7", "lease-4", NOW)) == lease(4)
    snapshot = await pc.load()
    assert snapshot.sessions[session.session] == session and snapshot.checkpoints[session.session] == later
    assert await pc.holder() == "pc-a"
    snap = await delivery.read(sid, 0, 8)
    assert snap is not None and snap.tokens == (100, 101, 102)

    # The promoted primary has no replica yet: a write is refused, never acknowledged.
    with pytest.raises(StoreUnavailable, match="reached 0 of 1 replicas"):
        await index.put(replica(key(99)), 60_000)
    healthy_cluster.restart(killed)  # back as the replica of the promoted node
    assert await index.put(replica(key(100)), 60_000) is True
    assert (await delivery.accept(sid, OutputTokens(session=sid, epoch=1, tokens=(OutputToken(index=3, token=103),)),
                                  max_ahead=8)).accepted == 1


async def test_two_is_processes_over_the_cluster_see_each_others_records_through_a_failover(
        tmp_path: Path, healthy_cluster: RedisClusterProcess) -> None:
    config = write_config(tmp_path, healthy_cluster.url)
    keys = [key(i) for i in range(10)]
    async with aiohttp.ClientSession() as http, index_processes(config, 2) as (a, b):
        await publish(http, a.url)
        before = await lookup(http, b.url, keys)
        assert before["matched"] == 8 and before == await lookup(http, a.url, keys)
        healthy_cluster.kill_primary(SCOPE_A_SLOT)
        # The IS processes' clients find the promoted replica (a first call may meet the dead
        # node: 503, which a client retries).
        for _ in range(3):
            status, answer = await call(http, "POST", b.url + "lookup", lookup_body(keys))
            if status == 200:
                break
            assert status == 503, answer
        assert await lookup(http, b.url, keys) == before
        assert await lookup(http, a.url, keys) == before


async def test_instance_statuses_and_links_are_shared_by_the_is_processes(
        healthy_cluster: RedisClusterProcess) -> None:
    """§6.3 statuses (and their links, for ``fetch_us``) reported to one IS are every IS's
    after a sync, and the highest epoch is the store's: a lower one is refused everywhere."""
    spec = spec_of(healthy_cluster, f"t{uuid.uuid4().hex[:8]}:")
    config = ControlConfig(auth=AUTH, index=IndexConfig(store=healthy_cluster.url, store_key_prefix=spec.key_prefix))
    async with await serve_index(config) as a, await serve_index(config) as b:
        table_a, table_b = a.app[INDEX_SERVICE].statuses, b.app[INDEX_SERVICE].statuses
        assert isinstance(table_a, SharedStatusTable) and isinstance(table_b, SharedStatusTable)
        reported = status(II7, {H1: (800.0, 200.0)}, epoch=5, ttl_ms=30_000)
        assert table_a.update(reported) == reported
        await table_a.close()  # its write to the store is done
        await table_b.sync()
        assert table_b.get(II7) == reported
        with pytest.raises(StaleEpoch):
            table_b.update(status(II7, epoch=4, ttl_ms=30_000))


BENCH_FIGURES = {  # name: (unit, baseline); the 1-IS rows in the bench's process, then 1 and 2 `kvsp index`
    "is_lookup_http_cluster": ("lookups/s", "is_lookup_http"),
    "is_refresh_vs_ttl_cluster": ("records/s", "refresh_needed"),
    "is_lookup_p50_ms_cluster": ("ms", "is_lookup_p50_ms_memory"),
    "is_lookup_p99_ms_cluster": ("ms", "is_lookup_p99_ms_memory"),
    "is_lookup_http_cluster_1is": ("lookups/s", "is_lookup_http"),
    "is_lookup_http_cluster_2is": ("lookups/s", "is_lookup_http"),
    "is_lookup_p50_ms_cluster_2is": ("ms", "is_lookup_p50_ms_memory"),
    "is_lookup_p99_ms_cluster_2is": ("ms", "is_lookup_p99_ms_memory"),
    "is_refresh_vs_ttl_cluster_1is": ("records/s", "refresh_needed"),
    "is_refresh_vs_ttl_cluster_2is": ("records/s", "refresh_needed"),
    "is_refresh_batched_cluster_2is": ("records/s", "is_refresh_batched_cluster_1is"),
}


def test_bench_index_on_the_cluster_prints_1_and_2_is_processes(healthy_cluster: RedisClusterProcess) -> None:
    """``--store cluster`` on the tests' cluster: lookups/s, p50/p99 and the refresh against
    the TTL's need on one IS in the bench's process and on 1 and 2 ``kvsp index`` processes,
    beside the memory store's figures of the same run."""
    proc = kvsp("bench", "index", "--store", "cluster", "--redis-url", healthy_cluster.url, "--records", "2000",
                "--block-mib", "2", "--lookups", "10", "--repeat", "1", "--refresh-records", "600",
                "--single-puts", "20")
    figures = {f["name"]: f for f in map(json.loads, proc.stdout.splitlines())}
    memory = figures["is_lookup_http"]
    for name, (unit, baseline) in BENCH_FIGURES.items():
        fig = figures[name]
        assert (fig["unit"], fig["baseline_name"]) == (unit, baseline)
        assert fig["value"] > 0 and fig["baseline_value"] > 0
        assert fig["ratio"] == pytest.approx(fig["value"] / fig["baseline_value"], rel=1e-3)
    assert figures["is_lookup_http_cluster_2is"]["baseline_value"] == memory["value"]
    assert figures["is_refresh_vs_ttl_cluster_2is"]["baseline_value"] == pytest.approx(600 / 20)
    assert figures["is_refresh_batched_cluster_2is"]["baseline_value"] == figures["is_refresh_vs_ttl_cluster_1is"]["value"]
