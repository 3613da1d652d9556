"""The PC over a real ``redis-server`` (``[pc] store = "redis://..."``): its faults.

A PC, a front end and instances with a small real engine on 127.0.0.1 (tests/test_sessions_support.py),
the PC's state in Redis:

- Redis with the append-only file SIGKILLed and restarted mid-session: the session, its
  epoch, its checkpoint and the instance's highest epoch are all there (read back by a
  separate store client), and the running PC carries on with them (its client reconnects);
- Redis SIGSTOPped (a hung store): a PC request that must write answers 503
  ``kvsp-unavailable`` within a bound (< 3x ``store_timeout_ms``), never hangs; once Redis
  answers again, so does the PC;
- the same session flow as the memory store's (tests/test_sessions.py), over Redis: the
  checkpoint rules and a migration after a reported failure.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

from kvsp_moq.control.common.config import PcConfig
from kvsp_moq.control.common.store import parse_store
from kvsp_moq.control.pc.serve import PC_SERVICE
from kvsp_moq.control.pc.store import RedisPcStore
from redis_support import SLACK_S, RedisServer, redis_aof, redis_server  # noqa: F401
from test_instance_support import TOKENS, call, instance_service
from test_sessions import checkpoint, start_session
from test_sessions_support import CountingEngine, SessionWorld, guarded, read_stream, session_id, session_world, status, token_at

TIMEOUT_MS = 500


def redis_pc(url: str) -> PcConfig:
    return PcConfig(instance_token=TOKENS["pc"], store=url, store_timeout_ms=TIMEOUT_MS)


async def put_checkpoint(sw: SessionWorld, sid: uuid.UUID, epoch: int, n: int) -> Any:
    return await call(sw.session, "PUT", f"{sw.w.pc.url}sessions/{sid}/checkpoint", who="inst", body=checkpoint(sid, epoch, n))


async def test_redis_aof_killed_and_restarted_keeps_sessions_and_checkpoints(redis_aof: RedisServer) -> None:
    engine = CountingEngine("a", hang_at=0)  # takes the session and produces nothing itself
    async with session_world({"a": engine}, pc=redis_pc(redis_aof.url)) as sw:
        await sw.report("a")
        started = await start_session(sw)
        sid = session_id(started)
        await guarded(engine.reached.wait())
        assert (await put_checkpoint(sw, sid, 1, 5)).json["output_offset"] == 5

        redis_aof.restart()  # SIGKILL, then the AOF is replayed
        reader = RedisPcStore(parse_store("pc", redis_aof.url))
        try:
            snapshot = await reader.load()
        finally:
            await reader.close()
        a = sw.instances["a"].url
        assert snapshot.sessions[sid].epoch == 1 and snapshot.sessions[sid].instance == a
        assert snapshot.checkpoints[sid].output_offset == 5
        assert snapshot.epochs == {a: 1}

        # the PC goes on: the rules hold against what Redis kept
        assert (await put_checkpoint(sw, sid, 1, 7)).json["output_offset"] == 7
        stale = await put_checkpoint(sw, sid, 0, 8)
        assert stale.status == 409 and stale.problem == "kvsp-stale-epoch"
        view = await call(sw.session, "GET", f"{sw.w.pc.url}sessions/{sid}", who="client-a")
        assert view.json == {"session": str(sid), "instance": a, "epoch": 1, "output_offset": 7}


async def test_redis_paused_answers_503_within_a_bound(redis_server: RedisServer) -> None:
    engine = CountingEngine("a", hang_at=0)
    async with session_world({"a": engine}, pc=redis_pc(redis_server.url)) as sw:
        await sw.report("a")
        started = await start_session(sw)
        sid = session_id(started)
        await guarded(engine.reached.wait())
        redis_server.pause()
        try:
            for attempt in (lambda: put_checkpoint(sw, sid, 1, 3),
                            lambda: call(sw.session, "PUT", f"{sw.w.pc.url}instance-status", who="inst",
                                         body=status(sw.instances["a"].url))):
                began = time.monotonic()
                reply = await guarded(attempt())
                elapsed = time.monotonic() - began
                assert reply.status == 503 and reply.problem == "kvsp-unavailable", reply.body
                assert reply.headers.get("Retry-After") == "1"
                assert elapsed < TIMEOUT_MS / 1000 + SLACK_S, elapsed  # bounded by the store's timeout, no hang
        finally:
            redis_server.resume()
        assert (await put_checkpoint(sw, sid, 1, 3)).json["output_offset"] == 3  # Redis answers: so does the PC


async def test_the_session_rules_and_a_migration_over_redis(redis_server: RedisServer) -> None:
    a = CountingEngine("a", hang_at=6)
    b = CountingEngine("b")
    async with session_world({"a": a, "b": b}, checkpoint_every=4, pc=redis_pc(redis_server.url)) as sw:
        await sw.report("a", prefill=50_000)  # the cheaper instance (§6.4): the session starts there
        await sw.report("b", prefill=10_000)
        started = await start_session(sw, max_tokens=12)
        sid = session_id(started)
        assert started["instance"] == sw.instances["a"].url
        stream = asyncio.create_task(read_stream(sw.session, started["tokens_url"]))
        await guarded(a.reached.wait())  # tokens 0..5 delivered, checkpoint at 4 acknowledged
        assert sw.w.pc.app[PC_SERVICE].sessions.entry(sid).checkpoint.output_offset == 4
        reply = await call(sw.session, "POST", f"{sw.w.pc.url}failures", who="pc", body={"instance": sw.instances["a"].url})
        assert reply.status == 200, reply.body
        assert reply.json == {"sessions": [{"session": str(sid), "instance": sw.instances["b"].url, "epoch": 2, "output_offset": 4}]}
        stale = await put_checkpoint(sw, sid, 1, 6)  # the failed run's epoch, refused by the store's rule
        assert stale.status == 409 and stale.problem == "kvsp-stale-epoch"
        lines = await guarded(stream)
        assert lines[-1] == {"end": 12}
        assert [(l["index"], l["token"]) for l in lines[:-1]] == [(i, token_at(7, i)) for i in range(12)]
        a.unhang.set()
        await guarded(instance_service(sw.instances["b"]).sessions.wait(sid))  # its run ended: done was sent
        gone = await call(sw.session, "GET", f"{sw.w.pc.url}sessions/{sid}", who="client-a")
        assert gone.status == 404  # done at epoch 2: forgotten, in Redis too
        reader = RedisPcStore(parse_store("pc", redis_server.url))
        try:
            assert (await reader.load()).sessions == {}
        finally:
            await reader.close()


def free_url() -> str:
    """A loopback URL nothing listens on (a PC that died)."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}/"


async def test_the_pc_client_fails_over_to_the_active_pc_and_gives_up_in_bounded_time(redis_server: RedisServer) -> None:
    """Two PCs in this process over one Redis: the first to start is active, the other a
    standby. ``HttpPcClient`` with several URLs skips a dead one and the standby's 503
    kvsp-not-leader, sticks to the PC that answered, and gives up after ``failover_ms``."""
    from contextlib import AsyncExitStack

    from kvsp_moq.control.client.http import HttpPcClient, PcRefused
    from kvsp_moq.control.common.config import ControlConfig
    from kvsp_moq.control.pc.serve import serve_pc
    from test_instance_support import AUTH

    config = ControlConfig(auth=AUTH, pc=redis_pc(redis_server.url))
    async with AsyncExitStack() as stack:
        active = await stack.enter_async_context(await serve_pc(config))
        standby = await stack.enter_async_context(await serve_pc(config))
        assert active.app[PC_SERVICE].leader.leading and not standby.app[PC_SERVICE].leader.leading
        record = status("http://127.0.0.1:9/ix/")
        client = HttpPcClient([free_url(), standby.url, active.url], TOKENS["inst"], failover_ms=5_000)
        try:
            assert (await client.report(record)).state == "active"
            assert client.pc_url == active.url  # the next call goes there first
            assert (await client.report(record)).state == "active"
        finally:
            await client.close()
        hopeless = HttpPcClient([free_url(), standby.url], TOKENS["inst"], failover_ms=300)
        try:
            began = time.monotonic()
            try:
                await hopeless.report(record)
                raise AssertionError("a standby answered")
            except PcRefused as exc:
                assert exc.status == 503 and exc.problem == "kvsp-not-leader"
            assert time.monotonic() - began < 0.3 + SLACK_S  # rounds until failover_ms, then the last answer
        finally:
            await hopeless.close()
