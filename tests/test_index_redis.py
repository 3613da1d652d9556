"""The Index Service on Redis (``[index] store = "redis://..."``; index/redis_store.py) with a
real redis-server, in this process: Redis's own clock, two services over one Redis, a Redis
with AOF killed and restarted (nothing lost), and a Redis that is stopped (SIGSTOP) or killed:
503 ``kvsp-unavailable`` within a bound, and service again once it is back."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp

from kvsp_moq.control.common.config import ControlConfig, IndexConfig
from kvsp_moq.control.common.store import parse_store
from kvsp_moq.control.index.redis_store import RedisIndexStore
from kvsp_moq.control.index.serve import serve_index
from kvsp_moq.control.index.store import BlockRef
from redis_support import SLACK_S, RedisServer, redis_aof, redis_server  # noqa: F401
from test_index_support import AUTH, COMPAT, H1, H2, II7, SCOPE_A, SCOPE_B, Ix, key, replica, status

TIMEOUT_MS = 400  # store_timeout_ms of these services
BOUND_S = TIMEOUT_MS / 1000 + SLACK_S  # "answered within a bound", never a hang
GUARD = 30.0  # a safety net against hangs, never a way to wait for something


@asynccontextmanager
async def redis_index(url: str, **kw: Any) -> AsyncIterator[Ix]:
    """An IS process-alike on 127.0.0.1 whose store is the Redis at ``url`` (the clock of
    ``Ix`` is unused: Redis keeps the time)."""
    config = IndexConfig(purge_interval_ms=0, store=url, store_timeout_ms=TIMEOUT_MS, **kw)
    async with await serve_index(ControlConfig(auth=AUTH, index=config), "127.0.0.1", 0) as server:
        async with aiohttp.ClientSession() as session:
            yield Ix(server, None, session)  # type: ignore[arg-type]


def without_ttl(answer: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
    """A lookup answer without its remaining TTLs, and those TTLs."""
    ttls = [r.pop("ttl_ms") for block in answer["blocks"] for r in block["replicas"]]
    return answer, ttls


async def fill(ix: Ix) -> None:
    for i in range(6):
        assert (await ix.put(replica(key(i), ttl_ms=60_000))).status == 201
    assert (await ix.put(replica(key(1), holder=H2, ttl_ms=60_000), who="holder2")).status == 201
    assert (await ix.put(replica(key(0), scope=SCOPE_B), who="tenant-b")).status == 201


async def test_records_expire_by_the_redis_clock(redis_server: RedisServer) -> None:
    store = RedisIndexStore.open(parse_store("index", redis_server.url))
    try:
        before = await store.redis.time()
        assert await store.put(replica(key(0)), 60_000) is True
        after = await store.redis.time()
        (raw,) = (await store.redis.hgetall(store._key(BlockRef(COMPAT, SCOPE_A, key(0))))).values()
        expiry = int(raw.split(b" ", 1)[0])
        ms = [seconds * 1000 + micros // 1000 for seconds, micros in (before, after)]
        assert ms[0] + 60_000 <= expiry <= ms[1] + 60_000
        (stored,) = await store.get_prefix(COMPAT, SCOPE_A, [key(0)])
        assert 0 < stored[0].remaining_ms <= 60_000
        # the block's own key TTL (the safety net) covers its latest record, no more
        assert 0 < await store.redis.pttl(store._key(BlockRef(COMPAT, SCOPE_A, key(0)))) <= 60_000
    finally:
        await store.close()


async def test_two_services_over_one_redis_answer_alike(redis_server: RedisServer) -> None:
    async with redis_index(redis_server.url) as a, redis_index(redis_server.url) as b:
        await fill(a)
        keys = [key(i) for i in (0, 1, 2, 4, 3)]
        answers = [without_ttl((await ix.lookup(keys)).json) for ix in (a, b)]
        assert answers[0][0] == answers[1][0] and answers[0][0]["matched"] == 5
        assert all(0 < t <= 60_000 for _, ttls in answers for t in ttls)
        assert [r["holder"] for r in answers[1][0]["blocks"][1]["replicas"]] == [H1, H2]
        assert (await b.delete(replica(key(2)))).status == 204  # withdrawn through the other IS
        assert (await a.lookup(keys)).json["matched"] == 2  # §6.2: stops at the first key without one
        assert (await b.lookup([key(0)], who="tenant-b", scope=SCOPE_B)).json["blocks"][0]["replicas"][0]["scope_id"] == SCOPE_B.hex()
        assert (await a.lookup([key(1)], who="tenant-b", scope=SCOPE_B)).json["matched"] == 0  # scopes never cross


async def test_redis_with_aof_killed_and_restarted_loses_nothing(redis_aof: RedisServer) -> None:
    async with redis_index(redis_aof.url) as ix:
        await fill(ix)
        keys = [key(i) for i in range(7)]
        before, _ = without_ttl((await ix.lookup(keys)).json)
        redis_aof.restart()  # SIGKILL, then a new server replays the AOF
        after, ttls = without_ttl((await ix.lookup(keys)).json)  # the client reconnects once, at once
        assert after == before and before["matched"] == 6
        assert all(0 < t <= 60_000 for t in ttls)
        assert (await ix.put(replica(key(0)))).status == 200  # a refresh: the record survived


async def answered(ix: Ix, coro: Any) -> tuple[Any, float]:
    start = time.monotonic()
    reply = await asyncio.wait_for(coro, GUARD)
    return reply, time.monotonic() - start


async def test_a_stopped_redis_is_503_in_bounded_time(redis_server: RedisServer) -> None:
    async with redis_index(redis_server.url) as ix:
        await fill(ix)
        redis_server.pause()  # SIGSTOP: connections stay open, nothing is answered
        try:
            for call in (ix.lookup([key(0)]), ix.put(replica(key(9))), ix.delete(replica(key(0))),
                         ix.request("GET", f"replicas/{COMPAT.hex()}/{SCOPE_A.hex()}/{key(0).hex()}")):
                reply, took = await answered(ix, call)
                assert (reply.status, reply.problem) == (503, "kvsp-unavailable"), reply.body
                assert reply.headers["Retry-After"] == "1"
                assert took < BOUND_S, took
        finally:
            redis_server.resume()
        assert (await ix.lookup([key(0)])).json["matched"] == 1  # back once Redis answers


async def test_a_killed_redis_is_503_in_bounded_time(redis_server: RedisServer) -> None:
    async with redis_index(redis_server.url) as ix:
        await fill(ix)
        redis_server.kill()  # no AOF: what it held is gone
        for call in (ix.lookup([key(0)]), ix.put(replica(key(9)))):
            reply, took = await answered(ix, call)
            assert (reply.status, reply.problem) == (503, "kvsp-unavailable"), reply.body
            assert took < BOUND_S, took
        assert (await ix.request("PUT", "instance-status", who="pc", body=status(II7, {H1: (10_000, 100)}))).status == 200  # in memory
        redis_server.start()
        assert (await ix.lookup([key(0)])).json["matched"] == 0  # an empty Redis, but answering
        assert (await ix.put(replica(key(0)))).status == 201


async def test_a_password_from_a_file(tmp_path: Path) -> None:
    server = RedisServer(tmp_path / "redis-pw", password="s3cret-pw")
    server.start()
    try:
        (tmp_path / "pw").write_text("s3cret-pw\n")
        async with redis_index(server.url, store_password_file=str(tmp_path / "pw")) as ix:
            assert (await ix.put(replica(key(0)))).status == 201
            assert (await ix.lookup([key(0)])).json["matched"] == 1
        (tmp_path / "pw").write_text("wrong\n")
        async with redis_index(server.url, store_password_file=str(tmp_path / "pw")) as ix:
            reply, took = await answered(ix, ix.lookup([key(0)]))
            assert (reply.status, reply.problem) == (503, "kvsp-unavailable") and took < BOUND_S
    finally:
        server.close()
