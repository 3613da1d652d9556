"""A PC taking over keeps what the PC before it was doing (issue 30; docs/deploy.md "What
survives a takeover"): real ``kvsp pc`` processes over a real ``redis-server`` (and over a
real Redis Cluster, tests/redis_cluster.py), the active one
SIGKILLed mid-work, and real instances on 127.0.0.1 (HTTP servers in this process, so that the
tests await the instant each one acts).

- a reshard in flight (§6.9), its PC SIGKILLed or stopped (SIGTERM): the standby that takes
  over sends the same plans again, waits for the member still fetching, commits, and every
  range moved exactly once;
- a prefetch directive (§6.5) sent before the takeover is honoured after it: the request it
  was sent for is placed where it loads, and no second directive is sent.

Nothing sleeps: each wait is on an event of an instance, a process's exit, or (for the standby
to take the lock, a condition in another process) a bounded poll.
"""

from __future__ import annotations

import asyncio
import signal
import uuid
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from redis_cluster import healthy_cluster, redis_cluster  # noqa: F401
from redis_support import RedisServer, redis_server  # noqa: F401
from test_instance_support import COMPAT, SCOPE_A, TOKENS, bkey, container, instance_service, record_for, slow_holder, world
from test_migration_support import TOKEN, guarded
from test_pc_failover import STOP_S, pc_processes, put_status, status_record, until_active
from test_reshard import MAP, OCTETS_PER_TOKEN, group, kv

from kvsp_moq.bench.redis_cluster import RedisClusterProcess

AUTH = {"Authorization": f"Bearer {TOKEN}"}


async def send(http: aiohttp.ClientSession, method: str, url: str, body: Any) -> tuple[int, Any]:
    async with http.request(method, url, json=body, headers=AUTH) as resp:
        return resp.status, await resp.json(content_type=None)


def store_url(request: pytest.FixtureRequest, store: str) -> tuple[str, str]:
    """The store's URL and ``[pc]`` lines for it: one redis-server, or the session's cluster
    (3 primaries + 3 replicas, tests/redis_cluster.py) under a key prefix of this test's own."""
    if store == "redis":
        server: RedisServer = request.getfixturevalue("redis_server")
        return server.url, ""
    cluster: RedisClusterProcess = request.getfixturevalue("healthy_cluster")
    return cluster.url, f'store_key_prefix = "t{uuid.uuid4().hex[:8]}:"\n'


# Both stops and both stores, in two runs (the cluster is started once per test session).
@pytest.mark.parametrize(("stop", "store"), [("SIGKILL", "redis"), ("SIGTERM", "cluster")])
async def test_a_reshard_in_flight_is_finished_by_the_pc_that_takes_over(
        tmp_path: Path, request: pytest.FixtureRequest, stop: str, store: str) -> None:
    """SIGKILL: the PC dies mid-reshard. SIGTERM: it stops without waiting for the reshard's
    deadline (the server's graceful stop would wait up to 60 s for the PUT), answers the PUT
    503 ``kvsp-not-leader`` and leaves the reshard to the standby."""
    url, extra = store_url(request, store)
    async with group() as g, pc_processes(tmp_path, url, instance_token=TOKENS["pc"], extra=extra) as pcs:
        first = await pcs.start("pc1")
        second = await pcs.start("pc2")
        http = g.w.session
        assert (await send(http, "PUT", f"{first.url}shard-maps/{MAP}", g.v4()))[1]["state"] == "installed"
        g.stores[2].gate = True  # ii3 serves [60, 90) to ii2 only when released
        put = asyncio.ensure_future(send(http, "PUT", f"{first.url}shard-maps/{MAP}?deadline_ms=120000", g.v5()))
        await guarded(g.stores[2].entered.wait())  # mid-reshard: ii2's fetch waits at ii3
        await guarded(g.stores[0].staged_event.wait())  # ii1 has fetched [30, 45): it acknowledged
        if stop == "SIGKILL":
            first.kill()
            assert await guarded(first.proc.wait()) == -signal.SIGKILL
            with pytest.raises(aiohttp.ClientError):
                await guarded(put)
        else:
            first.proc.send_signal(signal.SIGTERM)
            assert await asyncio.wait_for(first.proc.wait(), STOP_S) == 0  # a bound against the 60 s wait, not a speed
            status, refused = await guarded(put)
            assert status == 503 and refused["type"].endswith("kvsp-not-leader"), refused

        await until_active(http, second)  # it loaded the reshard and asks the members again
        g.stores[2].release.set()
        await guarded(asyncio.gather(*(store.committed.wait() for store in g.stores)))
        status, current = await send(http, "GET", f"{second.url}shard-maps/{MAP}", None)
        assert status == 200 and current == g.v5()
        assert [g.service(i).shards.versions[MAP] for i in range(3)] == [5, 5, 5]
        # nothing done twice: each range moved once (the same plan again awaited the fetch in flight)
        assert [g.service(i).shards.fetched_octets for i in range(3)] == [15 * OCTETS_PER_TOKEN, 30 * OCTETS_PER_TOKEN, 0]
        assert [g.service(i).shards.served_octets for i in range(3)] == [0, 15 * OCTETS_PER_TOKEN, 30 * OCTETS_PER_TOKEN]
        assert g.stores[0].read_now(MAP, (0, 45)) == kv(0, 45) and g.stores[1].read_now(MAP, (45, 90)) == kv(45, 90)
        assert g.stores[2].held(MAP) == ()  # released after the commit
        status, again = await send(http, "PUT", f"{second.url}shard-maps/{MAP}", g.v5())  # the client retries
        assert status == 200 and again["state"] == "committed" and again["version"] == 5


def linked_status(instance: str, holder: str) -> dict[str, Any]:
    return status_record(instance, 1) | {"links": [{"holder": holder, "mbit_per_s": 8000.0, "rtt_us": 100.0}]}


async def test_a_directive_sent_before_a_takeover_is_honoured_after_it(tmp_path: Path, redis_server: RedisServer) -> None:
    extra = (f'index_url = "{{index}}"\nindex_token = "{TOKENS["pc"]}"\n'
             "prefetch_deadline_ms = 120000\nprefetch_lease_ms = 120000\n")  # live through the takeover
    async with world(holders=0) as w, slow_holder({bkey(0): container(0)}) as slow:
        await w.publish(record_for(0, slow.url))
        instances = {ii.url: ii for ii in [await w.start_instance(), await w.start_instance()]}
        async with pc_processes(tmp_path, redis_server.url, instance_token=TOKENS["pc"],
                                extra=extra.replace("{index}", w.index.url)) as pcs:
            first = await pcs.start("pc1")
            second = await pcs.start("pc2")
            for url in instances:
                assert (await put_status(w.session, first, linked_status(url, slow.url)))[0] == 200
            request = {"scope_id": SCOPE_A.hex(), "compat_id": COMPAT.hex(), "block_keys": [bkey(0).hex()],
                       "tokens": 10_000, "prefetch": True, "request_ref": "req-7"}
            status, placed = await send(w.session, "POST", f"{first.url}placements", request)
            assert status == 200 and placed.get("directive"), placed
            run = instance_service(instances[placed["instance"]]).prefetch.get(uuid.UUID(placed["directive"]))
            assert run is not None and not run.done.is_set()  # loading: its source stalls
            first.kill()
            assert await guarded(first.proc.wait()) == -signal.SIGKILL

            await until_active(w.session, second)
            status, again = await send(w.session, "POST", f"{second.url}placements", request)  # the client retries
            assert status == 200
            assert {k: again.get(k) for k in ("instance", "directive", "directive_status")} == \
                {k: placed[k] for k in ("instance", "directive", "directive_status")}
            sent = {url: len(instance_service(ii).prefetch.by_request_ref("req-7")) for url, ii in instances.items()}
            assert sent == {url: int(url == placed["instance"]) for url in instances}  # one directive, never two
            slow.release.set()
            await guarded(run.done.wait())
            assert run.status().state == "complete"
