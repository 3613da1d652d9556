"""Writes of the PC's store that were applied but not acknowledged (issue 30).

A real ``redis-server`` primary with one real replica, and the PC configured with
``store_wait_replicas = 1`` (every write ends with ``WAIT 1``, docs/deploy.md "Durability").
With the replica SIGSTOPped, ``WAIT`` times out while the primary still applies every write:
the PC answers 503 ``kvsp-unavailable`` for a change that *is* stored. The PC must not be left
behind by it (``pc/sessions.py``, "A write not acknowledged"):

- an instance's ``POST sessions/{id}/failed`` in that window: the epoch raise is stored but
  not acknowledged; once the replica answers again, the session is resumed on another instance
  and the client's stream has every token once, in order (before the fix, the PC's cache kept
  the old epoch, every later compare-and-set was refused as stale, and the session stayed on
  the instance that had given it up, for good);
- ``POST sessions`` in that window: the session is created but not acknowledged; the front
  end's client retries the same open (same session id), which starts it (before the fix: 400,
  "names a session the store holds already");
- the front end's registration of a session (``POST {fe}sessions``) in that window: it is
  withdrawn, so it does not hold a place of ``max_sessions`` for ``retain_s`` (before the fix,
  with ``max_sessions = 1``, the client's next open was refused with 409);
- ``PUT shard-maps/{map}`` (a reshard, §6.9) in that window: its *begin* is stored but not
  acknowledged; the same ``PUT`` retried resumes the stored reshard and commits it (before the
  fix: 412 "a reshard ... is in progress" until another PC took over).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from redis_support import RedisServer

from kvsp_moq.control.common.config import PcConfig
from kvsp_moq.control.common.store import parse_store
from kvsp_moq.control.pc.serve import PC_SERVICE
from kvsp_moq.control.pc.store import RedisPcStore
from test_instance_support import TOKENS, call
from test_reshard import MAP, group, kv
from test_sessions import start_session
from test_sessions_support import (CountingEngine, client_request, expect_output, guarded, read_stream, session_id,
                                   session_world)

TIMEOUT_MS = 500  # WAIT gives up after half of it


class Primary(RedisServer):
    """A ``redis-server`` that serves a new replica at once (no diskless-sync delay, 5 s by default)."""

    def _args(self) -> list[str]:
        return super()._args() + ["--repl-diskless-sync-delay", "0"]


class Replica(RedisServer):
    """A ``redis-server`` replicating ``primary``."""

    def __init__(self, folder: Path, primary: RedisServer) -> None:
        super().__init__(folder)
        self.primary = primary

    def _args(self) -> list[str]:
        return super()._args() + ["--replicaof", "127.0.0.1", str(self.primary.port)]


@pytest.fixture(scope="module")
def replicated(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RedisServer, Replica]]:
    folder = tmp_path_factory.mktemp("replicated")
    primary = Primary(folder / "primary")
    replica = Replica(folder / "replica", primary)
    primary.start()
    try:
        replica.start()
        try:
            yield primary, replica
        finally:
            replica.close()
    finally:
        primary.close()


async def linked(primary: RedisServer) -> None:
    """Wait, bounded, until the replica has the primary's writes (``WAIT`` blocks until it acks)."""
    client = aioredis.Redis.from_url(primary.url, socket_timeout=15)
    try:
        await client.set("linked", "1")
        assert await client.wait(1, 10_000) == 1, "the replica did not link within 10 s"
    finally:
        await client.aclose()


def pc_config(primary: RedisServer, prefix: str) -> PcConfig:
    return PcConfig(instance_token=TOKENS["pc"], store=primary.url, store_timeout_ms=TIMEOUT_MS,
                    store_wait_replicas=1, store_key_prefix=prefix)


async def stored_epoch(primary: RedisServer, prefix: str, sid: uuid.UUID) -> int | None:
    reader = RedisPcStore(parse_store("pc", primary.url, key_prefix=prefix))
    try:
        held = await reader.get_session(sid)
    finally:
        await reader.close()
    return None if held is None else held[0].epoch


async def test_a_refusal_whose_epoch_raise_was_not_acknowledged_still_resumes_the_session(
        replicated: tuple[RedisServer, Replica]) -> None:
    primary, replica = replicated
    await linked(primary)
    a = CountingEngine("a", hang_at=6)  # delivers 0..5 (checkpoint at 4), then hangs
    b = CountingEngine("b")
    async with session_world({"a": a, "b": b}, checkpoint_every=4, pc=pc_config(primary, "unack-failed:")) as sw:
        await sw.report("a", prefill=50_000)  # the cheaper instance (§6.4): the session starts there
        await sw.report("b", prefill=10_000)
        started = await start_session(sw, max_tokens=12)
        sid = session_id(started)
        assert started["instance"] == sw.instances["a"].url
        stream = asyncio.create_task(read_stream(sw.session, started["tokens_url"]))
        await guarded(a.reached.wait())
        failed_url = f"{sw.w.pc.url}sessions/{sid}/failed"
        replica.pause()  # WAIT 1 now times out; the primary still applies the writes
        try:
            refused = await call(sw.session, "POST", failed_url, who="inst", body={"epoch": 1, "reason": "cannot"})
            assert refused.status == 503 and refused.problem == "kvsp-unavailable", refused.body
            assert await stored_epoch(primary, "unack-failed:", sid) == 2  # applied all the same
        finally:
            replica.resume()
        await linked(primary)
        # the instance retries its report: the session moved on already (epoch 2 is stored)
        again = await call(sw.session, "POST", failed_url, who="inst", body={"epoch": 1, "reason": "cannot"})
        assert again.status == 409 and again.problem == "kvsp-stale-epoch", again.body
        pc = sw.w.pc.app[PC_SERVICE]
        await sw.report("b", prefill=10_000)  # a live instance reports: pending sessions are placed (§6.8)
        await guarded(pc.settle())
        view = await call(sw.session, "GET", f"{sw.w.pc.url}sessions/{sid}", who="client-a")
        assert view.json == {"session": str(sid), "instance": sw.instances["b"].url, "epoch": 2, "output_offset": 4}
        expect_output(await guarded(stream), 12)  # every index once, in order: nothing lost or repeated
        assert [kind for kind, _ in b.orders] == ["resume"]
        a.unhang.set()  # its stale run ends: its output is refused (a lower epoch)
        await guarded(a.ended.wait())


async def test_an_open_whose_create_was_not_acknowledged_starts_when_retried(
        replicated: tuple[RedisServer, Replica]) -> None:
    primary, replica = replicated
    await linked(primary)
    a = CountingEngine("a", hang_at=0)
    async with session_world({"a": a}, pc=pc_config(primary, "unack-open:")) as sw:
        await sw.report("a")
        sid = uuid.uuid4()
        body = client_request(8) | {"session": str(sid), "front_end": sw.fe.url}
        replica.pause()
        try:
            first = await call(sw.session, "POST", f"{sw.w.pc.url}sessions", who="pc", body=body)
            assert first.status == 503 and first.problem == "kvsp-unavailable", first.body
            assert await stored_epoch(primary, "unack-open:", sid) == 0  # created all the same
        finally:
            replica.resume()
        await linked(primary)
        retried = await call(sw.session, "POST", f"{sw.w.pc.url}sessions", who="pc", body=body)  # the same open
        assert retried.status == 201, retried.body
        assert retried.json == {"session": str(sid), "instance": sw.instances["a"].url, "epoch": 1, "output_offset": 0}
        await guarded(a.reached.wait())
        assert [kind for kind, _ in a.orders] == ["start"]
        other = await call(sw.session, "POST", f"{sw.w.pc.url}sessions", who="pc",
                           body=body | {"max_tokens": 9})  # another session under that id
        assert other.status == 400, other.body


async def test_a_reshard_whose_begin_was_not_acknowledged_commits_when_retried(
        replicated: tuple[RedisServer, Replica]) -> None:
    primary, replica = replicated
    await linked(primary)
    async with group(pc=pc_config(primary, "unack-reshard:")) as g:
        assert (await g.put_map(g.v4())).json["state"] == "installed"
        replica.pause()
        try:
            first = await g.put_map(g.v5(), "?deadline_ms=60000")
            assert first.status == 503 and first.problem == "kvsp-unavailable", first.body
        finally:
            replica.resume()
        await linked(primary)
        retry = await g.put_map(g.v5(), "?deadline_ms=60000")  # the client retries the same step
        assert retry.status == 200 and retry.json["state"] == "committed", retry.body
        assert g.stores[1].read_now(MAP, (45, 90)) == kv(45, 90)
        assert [g.service(i).shards.versions[MAP] for i in range(3)] == [5, 5, 5]


async def test_a_registration_not_acknowledged_holds_no_place_at_the_front_end(
        replicated: tuple[RedisServer, Replica]) -> None:
    primary, replica = replicated
    await linked(primary)
    a = CountingEngine("a", hang_at=0)
    fe = {"store": primary.url, "store_timeout_ms": TIMEOUT_MS, "store_wait_replicas": 1,
          "store_key_prefix": "unack-fe:", "max_sessions": 1}
    async with session_world({"a": a}, fe=fe) as sw:
        await sw.report("a")
        replica.pause()
        try:
            first = await call(sw.session, "POST", f"{sw.fe.url}sessions", who="client-a", body=client_request(8))
            assert first.status == 503 and first.problem == "kvsp-unavailable", first.body
        finally:
            replica.resume()
        await linked(primary)
        started = await start_session(sw, max_tokens=8)  # the only place is free
        assert started["instance"] == sw.instances["a"].url
