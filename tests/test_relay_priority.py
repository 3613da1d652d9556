"""Priority scheduling of one subscriber's queued streams (relay.schedule, OutQueue):
draft §"Priorities" — subscriber priority, then publisher priority, then the
subscription's group order (ascending: lower group first; descending: higher group first),
then Subgroup ID; bytes within a stream stay in order.

The ordering tests drive the relay's own :class:`OutQueue` over a fake connection whose
streams are held unwritable until the test lets go (real QUIC on loopback rarely queues
deterministically); the end-to-end test checks that with priorities and GROUP_ORDER set
everything still arrives byte-exact over real QUIC. No sleeps.
"""

from __future__ import annotations

import asyncio

import pytest

from kvsp_moq.moqt.errors import PublishDoneCode
from kvsp_moq.moqt.messages import MessageParameters
from kvsp_moq.moqt.objects import GroupOrder
from relay import fanout
from relay.fanout import OutQueue
from relay.schedule import ReadyHeap, stream_key

from test_relay import NS, Net, net, payload, within  # noqa: F401

ASC, DESC = GroupOrder.ASCENDING, GroupOrder.DESCENDING


class FakeConn:
    send_buffer_high_water = 100

    def __init__(self) -> None:
        self.blocked = True
        self.sent: list[tuple[int, bytes, bool]] = []
        self.resets: list[tuple[int, int]] = []
        self.waiting: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self.writable: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def stream_send_buffered(self, sid: int) -> int:
        return 1000 if self.blocked else 0

    def send(self, sid: int, data, end_stream: bool = False) -> None:
        self.sent.append((sid, bytes(data), end_stream))

    def reset_stream(self, sid: int, code: int) -> None:
        self.resets.append((sid, code))

    async def wait_writable(self, sid: int, threshold: int | None = None) -> None:
        if not self.waiting.done():
            self.waiting.set_result(sid)
        await self.writable

    def release(self) -> None:
        self.blocked = False
        if not self.writable.done():
            self.writable.set_result(None)


class FakePeer:
    def __init__(self, conn: FakeConn) -> None:
        self.connection = conn
        self.moqt = None

    def flush(self) -> None:
        pass


def make_queue(budget: int = 1 << 20):
    conn = FakeConn()
    overflow: list[int] = []
    q = OutQueue(FakePeer(conn), budget, lambda: overflow.append(1))  # type: ignore[arg-type]
    return conn, q, overflow


async def drained(q: OutQueue) -> None:
    done = asyncio.get_running_loop().create_future()
    q.call(lambda: done.set_result(None))
    await within(done)


def stream_order(sent) -> list[int]:
    order: list[int] = []
    for sid, _data, _fin in sent:
        if not order or order[-1] != sid:
            order.append(sid)
    return order


def test_stream_key_orders_priority_then_group_order() -> None:
    keys = {
        "sub-hi": stream_key(1, 200, ASC, 9, 9),
        "pub-hi": stream_key(5, 0, ASC, 9, 9),
        "g1": stream_key(5, 7, ASC, 1, 3),
        "g2": stream_key(5, 7, ASC, 2, 0),
        "g1-sg0": stream_key(5, 7, ASC, 1, 0),
    }
    assert sorted(keys, key=keys.get) == ["sub-hi", "pub-hi", "g1-sg0", "g1", "g2"]
    assert stream_key(5, 7, DESC, 2, 0) < stream_key(5, 7, DESC, 1, 0)
    h = ReadyHeap()
    for sid, k in enumerate(keys.values()):
        h.push(sid, k)
    h.push(0, keys["sub-hi"])  # at most once
    assert len(h) == 5
    h.discard(1)
    assert [h.pop() for _ in range(4)] == [0, 4, 2, 3] and h.pop() is None


@pytest.mark.parametrize("order", [ASC, DESC])
async def test_queued_streams_released_by_priority_then_group_order(order) -> None:
    conn, q, overflow = make_queue()
    # (stream id, publisher priority, group, subgroup); subscriber priority is the queue's.
    streams = [(4, 128, 1, 0), (8, 128, 3, 0), (12, 128, 2, 1), (16, 128, 2, 0),
               (20, 64, 0, 0), (24, 200, 5, 0)]
    for sid, pub, g, sg in streams:
        q.open_stream(sid, stream_key(128, pub, order, g, sg))
    # Objects arrive interleaved across streams: header, payload chunks, then FIN.
    for part in range(3):
        for sid, *_ in reversed(streams):
            q.send(sid, b"%d:h%d" % (sid, part))
            q.send(sid, memoryview(b"%d:p%d" % (sid, part)))
    for sid, *_ in streams:
        q.send(sid, b"", fin=True)
    assert conn.sent == [] and q.queued > 0
    conn.release()
    await drained(q)
    assert q.queued == 0 and not overflow
    same = [20, 4, 16, 12, 8, 24] if order == ASC else [20, 8, 16, 12, 4, 24]
    assert stream_order(conn.sent) == same
    for sid, *_ in streams:  # per stream: every header before its payload, in order, FIN last
        mine = [(d, fin) for s, d, fin in conn.sent if s == sid]
        assert mine == [(b"%d:%s%d" % (sid, k, p), False) for p in range(3) for k in (b"h", b"p")
                        ] + [(b"", True)]


async def test_better_stream_arriving_while_waiting_goes_next() -> None:
    conn, q, _ = make_queue()
    q.open_stream(4, stream_key(128, 128, DESC, 1, 0))
    q.open_stream(8, stream_key(128, 128, DESC, 2, 0))
    q.open_stream(12, stream_key(10, 255, DESC, 0, 0))
    q.send(4, b"a")
    q.send(4, b"b", fin=True)
    assert await within(conn.waiting) == 4  # the drain waits on the only stream
    q.send(8, b"c")  # a later group: first in descending order
    q.send(12, b"d")  # higher subscriber priority beats everything
    conn.release()
    await drained(q)
    assert [(s, d) for s, d, _ in conn.sent] == [(12, b"d"), (8, b"c"), (4, b"a"), (4, b"b")]


async def test_publish_done_call_waits_for_every_stream_and_reset_drops() -> None:
    conn, q, _ = make_queue()
    q.open_stream(4, stream_key(128, 1, ASC, 0, 0))
    q.open_stream(8, stream_key(128, 2, ASC, 0, 0))
    q.send(4, b"x" * 10)
    q.send(8, b"y" * 10)
    q.send(8, b"", fin=True)
    log: list[str] = []
    q.call(lambda: log.append("done"))
    q.reset(4, 5)
    assert conn.resets == [(4, 5)] and q.queued == 10 and log == []
    q.send(4, b"late")  # dead stream: ignored
    conn.release()
    await drained(q)
    assert log == ["done"] and [s for s, _, _ in conn.sent] == [8, 8]


async def test_budget_overflow_still_fires() -> None:
    conn, q, overflow = make_queue(budget=25)
    q.open_stream(4, stream_key(128, 1, ASC, 0, 0))
    q.open_stream(8, stream_key(128, 0, ASC, 1, 0))
    q.send(4, b"x" * 20)
    assert not overflow
    q.send(8, b"y" * 20)
    assert overflow == [1]
    q.abort()
    assert q.queued == 0 and not q.streams and len(q.ready) == 0


async def test_end_to_end_priorities_and_descending_group_order_byte_exact(
        net: Net, monkeypatch) -> None:  # noqa: F811
    keys: list[tuple] = []
    real = fanout.OutQueue.open_stream

    def spy(self, sid, key):
        keys.append(key)
        return real(self, sid, key)

    monkeypatch.setattr(fanout.OutQueue, "open_stream", spy)
    relay = await net.relay(high_water=4096)  # small: the relay queues
    pub, catalog = await net.publisher(relay)
    track = catalog.create(NS, "prio")
    s = await net.client(relay)
    sub = await within(s.subscribe(NS, "prio", parameters=MessageParameters(
        subscriber_priority=3, group_order=GroupOrder.DESCENDING)))
    await within(track.subscribed.wait())
    sent = {}
    for g in range(4):
        for o in range(3):
            data = payload(g, o, 20000 + 1000 * o)
            await within(track.write_object(g, o, data, priority=100 - g))
            sent[(g, o)] = data
    await within(track.finish())
    got = {}
    async for obj in sub:
        got[(obj.group_id, obj.object_id)] = bytes(obj.payload)
    assert got == sent
    assert sub.publish_done is not None
    assert sub.publish_done.status_code == PublishDoneCode.TRACK_ENDED
    assert sub.publish_done.stream_count == sub.stats.data_streams == 4
    assert sorted(keys) == [(3, 100 - g, -g, 0) for g in (3, 2, 1, 0)]
