"""Holder leases in Redis across faults (kvsp-draft §6.6 "While a lease is valid the holder MUST
NOT evict the leased replicas"; DESIGN.md §8), each with a real ``redis-server``:

- a real ``kvsp holder`` process with a disk tier, SIGKILLed and restarted: its leases are
  still there (GET, renew), still pin their replicas under eviction pressure while an unleased
  one goes, and the quota usage is the same;
- two ``kvsp holder`` processes over one Redis, racing lease requests at a quota edge: exactly
  the quota is granted;
- Redis with the append-only file SIGKILLed and restarted: the leases survive (and without
  it they are gone, which the holder reports as 404, never as a 500);
- Redis stopped (SIGSTOP): a lease request answers 503 ``kvsp-unavailable`` within a bound,
  while block GETs and PUTs keep answering;
- a holder started while Redis is down serves GETs, refuses PUTs (503) until it has reloaded
  its leases, and reloads them once Redis is back.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from kvsp_moq.control.common.config import TierConfig
from kvsp_moq.kvsp.records import LeaseGrant
from redis_support import SLACK_S, RedisServer, redis_aof, redis_server  # noqa: F401
from test_holder_support import BLOCK_SIZE, COMPAT, CONTAINER_SIZE, PRINCIPALS, SCOPE_A, bkey, block_path, container, rkey, running_holder

TOKEN = "tok-redis-restart-client-xxxxxxxx"
START_TIMEOUT_S = 30


@dataclass
class HolderProcess:
    proc: asyncio.subprocess.Process
    url: str
    log: Path


@asynccontextmanager
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {TOKEN}"}) as session:
        yield session


async def call(session: aiohttp.ClientSession, method: str, url: str, body: object = None) -> tuple[int, dict[str, object] | None]:
    kwargs: dict[str, object] = {}
    if isinstance(body, bytes):
        kwargs = {"data": body, "headers": {"Content-Type": "application/kvsp-block", "If-None-Match": "*"}}
    elif body is not None:
        kwargs = {"json": body, "headers": {"Content-Type": "application/kvsp+json"}}
    async with session.request(method, url, **kwargs) as resp:  # type: ignore[arg-type]
        data = await resp.read()
        is_json = resp.content_type.endswith("json") and data
        return resp.status, (await resp.json(content_type=None)) if is_json else None


def lease_body(keys: list[int], ttl_ms: int = 60_000) -> dict[str, object]:
    return {"block_keys": [bkey(i).hex() for i in keys], "compat_id": COMPAT.hex(), "scope_id": SCOPE_A.hex(), "ttl_ms": ttl_ms}


def holder_toml(path: Path, store: str, *, max_leased_octets: int, tier: str) -> Path:
    path.write_text(f"""
[holder]
store = "{store}"
store_timeout_ms = 2000
max_lease_ttl_ms = 60000
max_leased_octets = {max_leased_octets}
tiers = [{tier}]

[[principals]]
name = "client"
token = "{TOKEN}"
scopes = ["{SCOPE_A.hex()}"]
""")
    return path


async def stop(holder: HolderProcess) -> None:
    if holder.proc.returncode is None:
        holder.proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(holder.proc.wait(), START_TIMEOUT_S) == 0, holder.log.read_text()[-4000:]


async def start_holder(config: Path, log: Path) -> HolderProcess:
    """``python -m kvsp_moq holder``; it prints its URL once it has reloaded its leases and serves."""
    with open(log, "ab") as err:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "kvsp_moq", "holder", "--listen", "127.0.0.1:0", "--config", str(config),
            stdout=asyncio.subprocess.PIPE, stderr=err, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.stdout is not None
    line = (await asyncio.wait_for(proc.stdout.readline(), START_TIMEOUT_S)).decode()
    prefix = "kvsp holder: listening on "
    assert line.startswith(prefix), (line, log.read_text()[-4000:])
    return HolderProcess(proc, line[len(prefix):].strip(), log)


async def test_sigkilled_holder_comes_back_with_its_leases_pinning(tmp_path: Path, redis_server: RedisServer) -> None:  # noqa: F811
    config = holder_toml(tmp_path / "holder.toml", redis_server.url, max_leased_octets=2 * CONTAINER_SIZE,
                         tier=f'{{kind = "disk", path = "blocks", capacity = {3 * BLOCK_SIZE}}}')
    log = tmp_path / "holder.log"
    holder = await start_holder(config, log)
    try:
        async with http() as s:
            for i in range(3):  # the disk tier is now full
                assert (await call(s, "PUT", holder.url + block_path(i), container(i)))[0] == 201
            status, grant_json = await call(s, "POST", holder.url + "leases", lease_body([0]))
            assert status == 201 and grant_json is not None
            lease = LeaseGrant.from_json(grant_json).lease
            assert (await call(s, "POST", holder.url + "leases", lease_body([1, 2])))[0] == 429  # 3 > 2 containers

            holder.proc.send_signal(signal.SIGKILL)  # mid-whatever: no goodbye, no flush
            assert await asyncio.wait_for(holder.proc.wait(), START_TIMEOUT_S) == -signal.SIGKILL
            holder = await start_holder(config, log)

            status, got = await call(s, "GET", holder.url + f"leases/{lease}")
            assert status == 200 and got is not None and 0 < LeaseGrant.from_json(got).ttl_ms <= 60_000

            # The recovered replicas are least recently used in creation order (0 first);
            # reading 1 then 2 makes the order 0, 1, 2 for sure (and only the reload has pinned
            # anything: no renewal yet). A new block needs one slot:
            # the evictor would take 0, but it is leased, so 1 goes (§6.6 MUST NOT).
            for i in (1, 2):
                assert (await call(s, "GET", holder.url + block_path(i)))[0] == 200
            assert (await call(s, "PUT", holder.url + block_path(3), container(3)))[0] == 201
            assert [(await call(s, "GET", holder.url + block_path(i)))[0] for i in range(4)] == [200, 404, 200, 200]
            status, renewed = await call(s, "PUT", holder.url + f"leases/{lease}", {"ttl_ms": 60_000})
            assert status == 200 and renewed is not None and LeaseGrant.from_json(renewed).lease == lease

            # The quota usage is what it was: one container leased, room for one more.
            assert (await call(s, "POST", holder.url + "leases", lease_body([2, 3])))[0] == 429
            assert (await call(s, "POST", holder.url + "leases", lease_body([2])))[0] == 201
            assert (await call(s, "POST", holder.url + "leases", lease_body([3])))[0] == 429
            assert (await call(s, "DELETE", holder.url + f"leases/{lease}"))[0] == 204
            assert (await call(s, "POST", holder.url + "leases", lease_body([3])))[0] == 201
    finally:
        await stop(holder)


async def test_two_holder_processes_over_one_redis_never_both_pass_a_quota(tmp_path: Path, redis_server: RedisServer) -> None:  # noqa: F811
    """§6.6 quota, atomic in Redis: two ``kvsp holder`` processes sharing one Redis and key
    prefix (one holder's leases served by two processes) get 12 concurrent lease requests for a
    client whose quota admits 3 blocks: exactly 3 are granted, whichever process answers."""
    config = holder_toml(tmp_path / "pair.toml", redis_server.url, max_leased_octets=3 * CONTAINER_SIZE,
                         tier=f'{{kind = "host", capacity = {8 * BLOCK_SIZE}}}')
    holders = [await start_holder(config, tmp_path / f"holder{n}.log") for n in range(2)]
    try:
        async with http() as s:
            for holder in holders:
                assert (await call(s, "PUT", holder.url + block_path(0), container(0)))[0] == 201
            replies = await asyncio.gather(*(call(s, "POST", holders[i % 2].url + "leases", lease_body([0]))
                                             for i in range(12)))
            assert sorted(status for status, _ in replies) == [201] * 3 + [429] * 9
            granted = [LeaseGrant.from_json(body).lease for status, body in replies if status == 201 and body]
            # Either process knows every lease (the state is Redis's, not the process's).
            for lease in granted:
                for holder in holders:
                    assert (await call(s, "GET", holder.url + f"leases/{lease}"))[0] == 200
    finally:
        for holder in holders:
            await stop(holder)


async def test_leases_survive_a_redis_restart_with_aof(redis_aof: RedisServer) -> None:  # noqa: F811
    async with running_holder(store=redis_aof.url, max_leased_octets=2 * CONTAINER_SIZE) as h:
        for i in range(3):
            await h.put_block(i)
        grant = LeaseGrant.from_json((await h.lease([0, 1])).json)
        redis_aof.restart()  # SIGKILL, then the AOF is replayed
        reply = await h.request("GET", f"leases/{grant.lease}")
        assert reply.status == 200, reply.body
        assert (await h.request("PUT", f"leases/{grant.lease}", body={"ttl_ms": 20_000})).status == 200
        assert await h.service.leases.usage(PRINCIPALS["client-a"]) == (2 * CONTAINER_SIZE, 1)
        assert (await h.lease([2])).status == 429
        assert h.service.store.is_pinned(rkey(0)) and h.service.store.is_pinned(rkey(1))


async def test_without_aof_a_redis_restart_loses_the_leases(redis_server: RedisServer) -> None:  # noqa: F811
    """What docs/deploy.md warns about: no AOF, no leases after a Redis crash. The holder says
    404 (the lease is unknown), never 500; the local pins still last their TTL."""
    async with running_holder(store=redis_server.url) as h:
        await h.put_block(0)
        grant = LeaseGrant.from_json((await h.lease([0])).json)
        redis_server.restart()
        reply = await h.request("PUT", f"leases/{grant.lease}", body={"ttl_ms": 5_000})
        assert (reply.status, reply.problem) == (404, "kvsp-not-found")
        assert h.service.store.is_pinned(rkey(0))
        assert (await h.lease([0])).status == 201


async def test_a_stopped_redis_is_503_in_bounded_time_while_blocks_serve(redis_server: RedisServer) -> None:  # noqa: F811
    timeout_ms = 500
    async with running_holder(store=redis_server.url, store_timeout_ms=timeout_ms) as h:
        await h.put_block(0)
        grant = LeaseGrant.from_json((await h.lease([0])).json)
        redis_server.pause()  # SIGSTOP: the socket stays open, nothing answers
        try:
            for method, path, body in (("POST", "leases", None), ("PUT", f"leases/{grant.lease}", {"ttl_ms": 5_000}),
                                       ("GET", f"leases/{grant.lease}", None), ("DELETE", f"leases/{grant.lease}", None)):
                started = time.monotonic()
                if body is None and method == "POST":
                    reply = await h.lease([0])
                else:
                    reply = await h.request(method, path, body=body)
                elapsed = time.monotonic() - started
                assert (reply.status, reply.problem) == (503, "kvsp-unavailable"), (method, reply.body)
                assert reply.headers["Retry-After"] == "1"
                assert elapsed < timeout_ms / 1000 + SLACK_S, (method, elapsed)  # a bound, never a hang
            # The data path does not need the store: reads and writes of blocks go on.
            reply = await h.get_block(0)
            assert reply.status == 200 and reply.body == container(0)
            assert (await h.put_block(1)).status == 201
            assert h.service.store.is_pinned(rkey(0))  # the lease still pins
        finally:
            redis_server.resume()
        assert (await h.request("PUT", f"leases/{grant.lease}", body={"ttl_ms": 5_000})).status == 200
        assert (await h.lease([1])).status == 201


async def test_a_holder_started_without_redis_serves_reads_and_reloads_later(tmp_path: Path) -> None:
    server = RedisServer(tmp_path / "redis", appendonly=True)
    server.start()
    tiers = (TierConfig("disk", 8 * BLOCK_SIZE, path=str(tmp_path / "blocks")),)
    settings = dict(store=server.url, store_timeout_ms=500, tiers=tiers, refresh_interval_ms=200)
    try:
        async with running_holder(**settings) as h:
            await h.put_block(0)
            grant = LeaseGrant.from_json((await h.lease([0])).json)
        server.kill()
        async with running_holder(**settings) as h:
            assert not h.service.leases.loaded
            assert (await h.get_block(0)).status == 200  # recovered from the disk tier
            reply = await h.put_block(1)
            assert (reply.status, reply.problem) == (503, "kvsp-unavailable")  # it might evict a leased replica
            assert (await h.lease([0])).status == 503
            assert not h.service.store.is_pinned(rkey(0))
            server.start()
            # The reload is retried by the holder's background loop once Redis (another
            # process) answers: poll for it, bounded.
            for _ in range(200):
                if h.service.leases.loaded:
                    break
                await asyncio.sleep(0.05)
            assert h.service.leases.loaded
            assert h.service.store.is_pinned(rkey(0))
            assert (await h.request("GET", f"leases/{grant.lease}")).status == 200
            assert (await h.put_block(1)).status == 201
    finally:
        server.close()
