"""The PC's state store (``control/pc/store``, DESIGN.md §8): one contract, run against the
memory store and against a real ``redis-server`` on a free loopback port.

Every rule of ``store/base.py``: the leader lock and its fencing (a deposed leader cannot
write), §6.3 the highest instance epoch, §6.8 the session-epoch compare-and-set and the
checkpoint with the highest output_offset per epoch, §6.9 map versions, and each race between
two store clients with exactly one winner (two PC processes over one Redis: two clients; the
memory store: two tasks of one process). A "lapsed" lease is made so directly (the memory
store's clock moves; Redis's key is deleted, which is what its expiry does), not waited for.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from typing import Any

import pytest

from kvsp_moq.control.common.clock import ManualClock
from kvsp_moq.control.common.errors import NotFound, NotLeader, PreconditionFailed, StaleEpoch
from kvsp_moq.control.common.session_records import SessionOpen
from kvsp_moq.control.common.store import parse_store
from kvsp_moq.control.pc.store import (
    ABORT, COMMIT, IssuedDirective, MemoryPcStore, PcStore, RedisPcStore, StoredInstance, StoredReshard, StoredSession)
from kvsp_moq.kvsp.errors import RecordError
from kvsp_moq.kvsp.records import InstanceStatusRecord, PrefetchBlock, PrefetchDirective, SessionCheckpoint, ShardMap
from redis_support import RedisServer, redis_server  # noqa: F401

COMPAT = bytes(range(32))
SCOPE = bytes(range(16))
IX = "https://ix.example/kvsp/"
FE = "https://fe.example/kvsp/"
LEASE = 60_000


@dataclass
class Pair:
    """Two clients of one store, and how to make its lock's lease lapse."""

    a: PcStore
    b: PcStore
    lapse: Callable[[], Any]
    kind: str


@pytest.fixture(params=["memory", "redis"])
async def pair(request: pytest.FixtureRequest) -> AsyncIterator[Pair]:
    if request.param == "memory":
        clock = ManualClock()
        store = MemoryPcStore(clock)
        yield Pair(store, store, lambda: clock.advance(LEASE), "memory")
        return
    server: RedisServer = request.getfixturevalue("redis_server")
    spec = parse_store("pc", server.url, timeout_ms=2_000)
    a, b = RedisPcStore(spec), RedisPcStore(spec)

    async def lapse() -> None:
        await a.redis.delete(a.k_leader)  # what the PX expiry does when the lease runs out

    try:
        yield Pair(a, b, lapse, "redis")
    finally:
        await a.close()
        await b.close()


async def lapse(p: Pair) -> None:
    result = p.lapse()
    if asyncio.iscoroutine(result):
        await result


def status(epoch: int, instance: str = IX) -> InstanceStatusRecord:
    return InstanceStatusRecord(instance=instance, epoch=epoch, state="active", running=0, queued=0, batch_size=8,
                                kv_utilization=0.1, prefill_tokens_per_s=1e4, decode_tokens_per_s=100, links=(),
                                requested_state=None, ttl_ms=3_000)


def opened(session: uuid.UUID | None = None) -> SessionOpen:
    return SessionOpen.from_json({
        "session": str(session or uuid.uuid4()), "compat_id": COMPAT.hex(), "scope_id": SCOPE.hex(), "prompt_blocks": [],
        "prompt_tail": [1, 2, 3], "tokens": 3, "max_tokens": 64, "front_end": FE,
        "sampler": {"method": "greedy", "params": {}, "seed": 1, "step": 0, "deterministic": True}})


def cp(body: SessionOpen, epoch: int, n: int) -> SessionCheckpoint:
    return replace(body.initial_checkpoint(), epoch=epoch, generated=tuple(range(n)), output_offset=n)


async def leader(p: Pair) -> str:
    token = uuid.uuid4().hex
    assert await p.a.acquire(token, LEASE)
    return token


async def new_session(p: Pair, token: str, epoch: int = 1) -> SessionOpen:
    body = opened()
    assert await p.a.create_session(token, StoredSession(body, 0), body.initial_checkpoint())
    if epoch:
        await p.a.save_session(token, StoredSession(body, epoch), expected_epoch=0)
    return body


# -- the leader lock and fencing ------------------------------------------------------------------

async def test_one_leader_at_a_time_and_a_deposed_one_cannot_write(pair: Pair) -> None:
    first, second = uuid.uuid4().hex, uuid.uuid4().hex
    assert await pair.a.acquire(first, LEASE) and not await pair.b.acquire(second, LEASE)
    assert await pair.b.holder() == first
    assert await pair.a.renew(first, LEASE) and not await pair.b.renew(second, LEASE)
    await pair.a.put_instance(first, StoredInstance(status(1)))
    with pytest.raises(NotLeader):
        await pair.b.put_instance(second, StoredInstance(status(2)))
    await lapse(pair)  # the first leader stopped renewing (it died, or hangs)
    assert await pair.b.acquire(second, LEASE)
    assert not await pair.a.renew(first, LEASE)  # it finds out at its next renewal ...
    writes = [
        pair.a.put_instance(first, StoredInstance(status(3))),
        pair.a.put_shard_map(first, ShardMap.from_json({"map": "m", "version": 1, "shards": [{"tokens": [0, 8], "instance": IX}]})),
        pair.a.create_session(first, StoredSession(opened(), 0), opened().initial_checkpoint()),
    ]
    for write in writes:  # ... but each write it tries meanwhile is refused by the store
        with pytest.raises(NotLeader):
            await write
    assert (await pair.b.load()).epochs == {IX: 1}
    await pair.a.release(first)  # not the holder: nothing happens
    assert await pair.b.holder() == second
    await pair.b.release(second)
    assert await pair.b.holder() is None


async def test_racing_for_the_lock_one_wins(pair: Pair) -> None:
    tokens = [uuid.uuid4().hex for _ in range(8)]
    stores = [pair.a if i % 2 else pair.b for i in range(8)]
    won = await asyncio.gather(*(s.acquire(t, LEASE) for s, t in zip(stores, tokens)))
    assert sum(won) == 1 and await pair.a.holder() == tokens[won.index(True)]


# -- §6.3 instance epochs -------------------------------------------------------------------------

async def test_a_lower_instance_epoch_is_refused_and_the_highest_outlives_the_record(pair: Pair) -> None:
    token = await leader(pair)
    await pair.a.put_instance(token, StoredInstance(status(5)))
    await pair.a.put_instance(token, StoredInstance(status(5), assigned="draining"))  # same epoch: kept
    with pytest.raises(StaleEpoch):
        await pair.b.put_instance(token, StoredInstance(status(4)))
    await pair.b.put_instance(token, StoredInstance(status(6), failed=True))
    snapshot = await pair.a.load()
    assert snapshot.epochs == {IX: 6}
    assert snapshot.instances[IX] == StoredInstance(status(6), failed=True)


async def test_racing_instance_reports_keep_the_highest_epoch(pair: Pair) -> None:
    token = await leader(pair)
    results = await asyncio.gather(*(s.put_instance(token, StoredInstance(status(e))) for e, s in
                                     ((3, pair.a), (9, pair.b), (5, pair.a), (7, pair.b))), return_exceptions=True)
    assert all(r is None or isinstance(r, StaleEpoch) for r in results)
    snapshot = await pair.a.load()
    assert snapshot.epochs == {IX: 9} and snapshot.instances[IX].epoch == 9


# -- §6.8 sessions and checkpoints ----------------------------------------------------------------

async def test_session_epoch_compare_and_set(pair: Pair) -> None:
    token = await leader(pair)
    body = await new_session(pair, token, epoch=2)
    assert not await pair.b.create_session(token, StoredSession(body, 0), body.initial_checkpoint())  # taken
    with pytest.raises(StaleEpoch):  # expected 1, stored 2
        await pair.a.save_session(token, StoredSession(body, 3), expected_epoch=1)
    with pytest.raises(StaleEpoch):  # never lower
        await pair.a.save_session(token, StoredSession(body, 1), expected_epoch=2)
    await pair.a.save_session(token, StoredSession(body, 2, instance=IX, refused=frozenset({"https://x.example/"})),
                              expected_epoch=2)
    with pytest.raises(NotFound):
        await pair.a.save_session(token, StoredSession(opened(), 1), expected_epoch=0)
    stored = (await pair.b.load()).sessions[body.session]
    assert stored == StoredSession(body, 2, instance=IX, refused=frozenset({"https://x.example/"}))


async def test_two_pcs_raising_one_epoch_only_one_wins(pair: Pair) -> None:
    """§6.8: an instance failed; two PCs (or two tasks) raise the session's epoch from 2 at once."""
    token = await leader(pair)
    body = await new_session(pair, token, epoch=2)
    contenders = [StoredSession(body, 3, instance=f"https://i{n}.example/") for n in range(6)]
    results = await asyncio.gather(*((pair.a if n % 2 else pair.b).save_session(token, s, expected_epoch=2)
                                     for n, s in enumerate(contenders)), return_exceptions=True)
    assert sum(r is None for r in results) == 1
    assert all(isinstance(r, StaleEpoch) for r in results if r is not None)
    winner = contenders[results.index(None)]
    assert (await pair.a.load()).sessions[body.session] == winner


async def test_checkpoints_keep_the_highest_offset_of_the_session_epoch(pair: Pair) -> None:
    token = await leader(pair)
    body = await new_session(pair, token, epoch=1)
    assert await pair.a.put_checkpoint(token, cp(body, 1, 8)) == 8
    assert await pair.b.put_checkpoint(token, cp(body, 1, 4)) == 8  # a retransmission: nothing changes
    with pytest.raises(RecordError, match="epoch"):
        await pair.a.put_checkpoint(token, cp(body, 2, 9))  # never assigned
    await pair.a.save_session(token, StoredSession(body, 2), expected_epoch=1)
    with pytest.raises(StaleEpoch):
        await pair.b.put_checkpoint(token, cp(body, 1, 12))  # the old run, after the epoch was raised
    assert (await pair.a.load()).checkpoints[body.session] == cp(body, 1, 8)
    assert await pair.a.put_checkpoint(token, cp(body, 2, 8)) == 8  # the resumed run, same offset
    with pytest.raises(NotFound):
        await pair.a.put_checkpoint(token, cp(opened(), 1, 1))
    assert (await pair.b.load()).checkpoints[body.session] == cp(body, 2, 8)


async def test_racing_checkpoints_keep_the_highest(pair: Pair) -> None:
    token = await leader(pair)
    body = await new_session(pair, token, epoch=1)
    offsets = [16, 3, 40, 24, 8, 32]
    kept = await asyncio.gather(*((pair.a if i % 2 else pair.b).put_checkpoint(token, cp(body, 1, n))
                                  for i, n in enumerate(offsets)))
    assert all(k >= n for k, n in zip(kept, offsets)) and max(kept) == 40
    assert (await pair.a.load()).checkpoints[body.session].output_offset == 40


async def test_a_session_is_deleted_only_at_its_epoch(pair: Pair) -> None:
    token = await leader(pair)
    body = await new_session(pair, token, epoch=3)
    with pytest.raises(StaleEpoch):
        await pair.a.delete_session(token, body.session, 2)
    await pair.b.delete_session(token, body.session, 3)
    with pytest.raises(NotFound):
        await pair.a.delete_session(token, body.session, 3)
    snapshot = await pair.a.load()
    assert body.session not in snapshot.sessions and body.session not in snapshot.checkpoints


# -- §6.9 shard maps, §6.5 directives -------------------------------------------------------------

def shard_map(version: int, end: int = 8) -> ShardMap:
    return ShardMap.from_json({"map": "m", "version": version, "shards": [{"tokens": [0, end], "instance": IX}]})


async def test_shard_map_versions_only_go_up(pair: Pair) -> None:
    token = await leader(pair)
    await pair.a.put_shard_map(token, shard_map(1))
    for version in (1, 0):
        with pytest.raises(StaleEpoch):
            await pair.b.put_shard_map(token, shard_map(version, 16))
    results = await asyncio.gather(pair.a.put_shard_map(token, shard_map(2, 16)), pair.b.put_shard_map(token, shard_map(2, 24)),
                                   return_exceptions=True)
    assert sum(r is None for r in results) == 1
    assert (await pair.a.load()).shard_maps["m"].version == 2


async def test_issued_directives_are_kept_until_they_no_longer_matter(pair: Pair) -> None:
    import time
    token = await leader(pair)
    directive = PrefetchDirective(directive=uuid.uuid4(), request_ref="r", scope_id=SCOPE, compat_id=COMPAT,
                                  blocks=(PrefetchBlock(block_key=bytes(32), sources=(IX,)),), deadline_ms=1000, lease_ms=5000)
    now = int(time.time() * 1000)
    live = IssuedDirective(IX, directive, now + 60_000, location=f"{IX}prefetch/{directive.directive}")
    gone = IssuedDirective(IX, replace(directive, directive=uuid.uuid4()), now - 1)
    await pair.a.put_directive(token, gone)
    await pair.b.put_directive(token, live)
    assert (await pair.a.load()).directives == {directive.directive: live}


async def test_everything_loads_as_it_was_stored(pair: Pair) -> None:
    token = await leader(pair)
    body = await new_session(pair, token, epoch=1)
    await pair.a.put_checkpoint(token, cp(body, 1, 5))
    full = StoredSession(body, 1, instance=IX, instance_epoch=7, resumed=True, refused=frozenset({FE}),
                         directives=(uuid.uuid4(),))
    await pair.a.save_session(token, full, expected_epoch=1)
    await pair.a.put_instance(token, StoredInstance(status(7), assigned="sleeping"))
    await pair.a.put_shard_map(token, shard_map(4))
    snapshot = await pair.b.load()
    assert snapshot.sessions == {body.session: full} and snapshot.checkpoints == {body.session: cp(body, 1, 5)}
    assert snapshot.instances == {IX: StoredInstance(status(7), assigned="sleeping")} and snapshot.epochs == {IX: 7}
    assert snapshot.shard_maps == {"m": shard_map(4)}


async def test_a_reshard_in_flight_is_kept_decided_once_and_forgotten_at_its_end(pair: Pair) -> None:
    """§6.9 (issue 30): one undecided reshard per map, begun only from the stored version; its
    decision taken once (a commit stores v+1 in the same step); loaded until it ends; fenced."""
    token = await leader(pair)
    await pair.a.put_shard_map(token, shard_map(4))
    step = StoredReshard(shard_map(4), shard_map(5, 16), 200, 1_000)
    with pytest.raises(StaleEpoch):  # not from the authoritative version
        await pair.a.begin_reshard(token, replace(step, old=shard_map(3)))
    await pair.a.begin_reshard(token, step)
    with pytest.raises(PreconditionFailed):  # one in flight per map
        await pair.b.begin_reshard(token, replace(step, new=shard_map(5, 24)))
    assert (await pair.b.load()).reshards == {"m": step}
    with pytest.raises(NotFound):
        await pair.a.decide_reshard(token, replace(step, new=shard_map(6)), COMMIT)
    with pytest.raises(NotLeader):
        await pair.a.decide_reshard("not-the-leader", step, COMMIT)
    decided = await asyncio.gather(pair.a.decide_reshard(token, step, COMMIT), pair.b.decide_reshard(token, step, ABORT))
    assert decided[0] == decided[1]  # racing decisions: one stands, both are told it
    snapshot = await pair.b.load()
    assert snapshot.reshards == {"m": replace(step, decision=decided[0])}
    assert snapshot.shard_maps["m"] == (shard_map(5, 16) if decided[0] == COMMIT else shard_map(4))
    with pytest.raises(NotLeader):
        await pair.a.end_reshard("not-the-leader", step)
    await pair.a.end_reshard(token, replace(step, new=shard_map(6)))  # another one: nothing
    assert (await pair.a.load()).reshards != {}
    await pair.a.end_reshard(token, step)
    assert (await pair.a.load()).reshards == {}
