"""The front end's delivery contract (kvsp-draft §6.8) over both stores, memory and a real
``redis-server``: every index delivered exactly once and in order, duplicates dropped by index,
lower epochs refused (MUST), out-of-order tokens buffered up to max_ahead, the PC's failure
notice, max_sessions. The same tests run on both (``store`` is parametrized)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from kvsp_moq.control.common.auth import Grant, Principal
from kvsp_moq.control.common.config import FrontEndConfig
from kvsp_moq.control.common.errors import Forbidden, NotActive, NotFound, StaleEpoch
from kvsp_moq.control.common.session_records import OutputToken, OutputTokens, SessionFailed, StreamEnd, StreamFailed
from kvsp_moq.control.common.store import parse_store
from kvsp_moq.control.frontend.delivery import DeliveryStore, MemoryDeliveryStore
from kvsp_moq.control.frontend.delivery_redis import RedisDeliveryStore
from kvsp_moq.control.frontend.service import FrontEnd
from kvsp_moq.kvsp.errors import RecordError
from redis_support import RedisServer

GUARD = 30.0  # a safety net against hangs, never a way to wait for something
SCOPE = bytes.fromhex("a7" * 16)
OTHER = bytes.fromhex("b7" * 16)
ALL = Principal("all", scopes=Grant(everything=True))
ONE = Principal("one", scopes=Grant(frozenset({OTHER})))


@pytest.fixture(params=["memory", "redis"])
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[DeliveryStore]:
    if request.param == "memory":
        yield MemoryDeliveryStore()
        return
    server = RedisServer(tmp_path / "redis")
    server.start()
    try:
        redis_store = RedisDeliveryStore(parse_store("frontend", server.url), poll_s=0.2)
        try:
            yield redis_store
        finally:
            await redis_store.close()
    finally:
        server.close()


def batch(sid: uuid.UUID, epoch: int, tokens: dict[int, int], end: int | None = None) -> OutputTokens:
    return OutputTokens(session=sid, epoch=epoch, tokens=tuple(OutputToken(index=i, token=t) for i, t in tokens.items()),
                        end=end)


async def collect(fe: FrontEnd, sid: uuid.UUID, start: int = 0) -> list[Any]:
    items = await fe.stream(ALL, sid, start)
    return [item async for item in items]


def answer(a: Any) -> tuple[int, int, int]:
    return a.accepted, a.duplicates, a.next


async def test_exactly_once_out_of_order_and_epochs(store: DeliveryStore) -> None:
    fe = FrontEnd(config=FrontEndConfig(), store=store)
    sid = uuid.uuid4()
    await fe.register(sid, SCOPE, 16)
    reader = asyncio.create_task(collect(fe, sid))  # a live stream, from before the first token
    assert answer(await fe.deliver(ALL, sid, batch(sid, 1, {0: 100, 1: 101, 2: 102}))) == (3, 0, 3)
    assert answer(await fe.deliver(ALL, sid, batch(sid, 1, {1: 101, 2: 102, 3: 103}))) == (1, 2, 4)
    assert answer(await fe.deliver(ALL, sid, batch(sid, 1, {6: 106}))) == (1, 0, 4)  # buffered
    assert answer(await fe.deliver(ALL, sid, batch(sid, 1, {6: 106}))) == (0, 1, 4)
    # epoch 2 re-sends what its checkpoint covers; the buffered epoch-1 token 6 is dropped
    assert answer(await fe.deliver(ALL, sid, batch(sid, 2, {0: 100, 1: 101, 2: 102}))) == (0, 3, 4)
    with pytest.raises(StaleEpoch):  # §6.8 MUST discard a lower epoch
        await fe.deliver(ALL, sid, batch(sid, 1, {4: 999, 5: 999}))
    assert answer(await fe.deliver(ALL, sid, batch(sid, 2, {5: 205, 4: 204, 3: 103}))) == (2, 1, 6)
    assert answer(await fe.deliver(ALL, sid, batch(sid, 2, {6: 206, 7: 207}, end=8))) == (2, 0, 8)
    expected = [100, 101, 102, 103, 204, 205, 206, 207]
    items = await asyncio.wait_for(reader, GUARD)
    assert items == [OutputToken(index=i, token=t) for i, t in enumerate(expected)] + [StreamEnd(end=8)]
    assert await collect(fe, sid, 6) == [OutputToken(index=6, token=206), OutputToken(index=7, token=207), StreamEnd(end=8)]
    snap = await fe.snapshot(sid)
    assert snap is not None and list(snap.tokens) == expected and snap.epoch == 2 and snap.end == 8
    tally = fe.tally(sid)
    assert tally is not None and tally.accepted == {1: 5, 2: 4} and tally.duplicates == 7 and tally.stale_batches == 1


async def test_limits_refuse_the_whole_batch_and_change_nothing(store: DeliveryStore) -> None:
    fe = FrontEnd(config=FrontEndConfig(max_ahead=4), store=store)
    sid = uuid.uuid4()
    await fe.register(sid, SCOPE, 10)
    await fe.deliver(ALL, sid, batch(sid, 1, {0: 1, 1: 2}))
    cases = [
        (batch(sid, 1, {2: 3, 10: 4}), "tokens[1].index", "max_tokens"),
        (batch(sid, 1, {2: 3, 6: 4}), "tokens[1].index", "beyond the next index (2)"),  # max_ahead
        (batch(sid, 1, {}, end=1), "end", "below the 2 tokens"),
        (batch(sid, 2, {2: 3}, end=11), "end", "beyond max_tokens"),
    ]
    for body, member, why in cases:
        with pytest.raises(RecordError) as refused:
            await fe.deliver(ALL, sid, body)
        assert refused.value.member == member and why in str(refused.value), (member, refused.value)
    snap = await fe.snapshot(sid)
    assert snap is not None and snap.tokens == (1, 2) and snap.epoch == 1  # the epoch-2 batch changed nothing
    assert answer(await fe.deliver(ALL, sid, batch(sid, 1, {5: 6}))) == (1, 0, 2)  # within max_ahead: buffered
    assert answer(await fe.deliver(ALL, sid, batch(sid, 1, {2: 3, 3: 4, 4: 5}, end=6))) == (3, 0, 6)
    with pytest.raises(RecordError) as beyond:  # nothing exists at or beyond the end
        await fe.deliver(ALL, sid, batch(sid, 1, {7: 8}))
    assert beyond.value.member == "tokens[0].index" and "end" in str(beyond.value)
    with pytest.raises(RecordError):
        await fe.deliver(ALL, uuid.uuid4(), batch(sid, 1, {6: 1}))  # the path's session
    with pytest.raises(NotFound):
        await fe.deliver(ALL, (other := uuid.uuid4()), batch(other, 1, {0: 1}))
    with pytest.raises(Forbidden):
        await fe.deliver(ONE, sid, batch(sid, 1, {6: 1}))
    with pytest.raises(Forbidden):
        await fe.stream(ONE, sid)
    assert [getattr(i, "token", None) for i in await collect(fe, sid)] == [1, 2, 3, 4, 5, 6, None]


async def test_failure_notice_closes_the_output(store: DeliveryStore) -> None:
    fe = FrontEnd(config=FrontEndConfig(), store=store)
    sid, done = uuid.uuid4(), uuid.uuid4()
    await fe.register(sid, SCOPE, 10)
    await fe.deliver(ALL, sid, batch(sid, 2, {0: 5, 1: 6, 3: 8}))  # 3 waits behind a gap
    reader = asyncio.create_task(collect(fe, sid))
    with pytest.raises(StaleEpoch):
        await fe.fail(ALL, sid, SessionFailed(epoch=1, reason="old news"))
    await fe.fail(ALL, sid, SessionFailed(epoch=3, reason="every instance refused it"))
    await fe.fail(ALL, sid, SessionFailed(epoch=3, reason="again"))  # a repeated notice changes nothing
    items = await asyncio.wait_for(reader, GUARD)
    assert items == [OutputToken(index=0, token=5), OutputToken(index=1, token=6),
                     StreamFailed(reason="every instance refused it", next=2)]
    with pytest.raises(StaleEpoch):  # no instance may add to a failed session's output
        await fe.deliver(ALL, sid, batch(sid, 4, {2: 7}))
    snap = await fe.snapshot(sid)
    assert snap is not None and snap.failed == "every instance refused it" and snap.tokens == (5, 6) and snap.epoch == 3
    # a complete session ignores the notice: its stream ends normally
    await fe.register(done, SCOPE, 2)
    await fe.deliver(ALL, done, batch(done, 1, {0: 1, 1: 2}, end=2))
    await fe.fail(ALL, done, SessionFailed(epoch=5, reason="late"))
    assert (await collect(fe, done))[-1] == StreamEnd(end=2)
    with pytest.raises(NotFound):
        await fe.fail(ALL, uuid.uuid4(), SessionFailed(epoch=1, reason="x"))


async def test_max_sessions_and_forget(store: DeliveryStore) -> None:
    fe = FrontEnd(config=FrontEndConfig(max_sessions=2), store=store)
    a, b = uuid.uuid4(), uuid.uuid4()
    await fe.register(a, SCOPE, 4)
    await fe.register(b, SCOPE, 4)
    await fe.register(a, SCOPE, 4)  # registered already: nothing
    with pytest.raises(NotActive):
        await fe.register(uuid.uuid4(), SCOPE, 4)
    items = await fe.stream(ALL, a)
    await fe.deliver(ALL, a, batch(a, 1, {0: 9}))
    assert await asyncio.wait_for(anext(items), GUARD) == OutputToken(index=0, token=9)
    waiting = asyncio.create_task(anext(items, None))
    await fe.forget(a)  # the live stream ends (forgotten: no end line)
    assert await asyncio.wait_for(waiting, GUARD) is None
    with pytest.raises(NotFound):
        await fe.deliver(ALL, a, batch(a, 1, {1: 1}))
    await fe.register(uuid.uuid4(), SCOPE, 4)  # a slot is free again


async def test_a_long_output_streams_in_several_reads(store: DeliveryStore) -> None:
    fe = FrontEnd(config=FrontEndConfig(max_ahead=4096), store=store)
    sid = uuid.uuid4()
    n = 3000  # beyond one read (READ_CHUNK)
    await fe.register(sid, SCOPE, n)
    for at in range(0, n, 1000):
        await fe.deliver(ALL, sid, batch(sid, 1, {i: i % 7 for i in range(at, at + 1000)}, end=n if at + 1000 == n else None))
    items = await collect(fe, sid)
    assert [i.index for i in items[:-1]] == list(range(n)) and items[-1] == StreamEnd(end=n)
