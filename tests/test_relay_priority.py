"""Priority scheduling of everything the relay sends on one downstream session
(relay.session.schedule, relay.session.sender): draft-22 §"Priorities" / §"Scheduling Algorithm" —
subscriber priority first (across the session's subscriptions AND fetch responses), then
publisher priority, then the subscription's group order, fill before subscription objects
of the same group, then Subgroup ID; REQUEST_UPDATE re-ranks what waits.

The scheduler itself is pure (relay.session.schedule) and is driven directly. End to end, over real
QUIC on loopback: the subscriber runs on its own event loop in a thread and blocks that loop
inside its first object (no reads, no ACKs, like a stalled process), so everything else the
relay has for it waits in the relay; a witness session on the main loop receiving every
object proves the relay has it all; then the subscriber is released and the order in which
its objects complete is the order the relay handed them out. The relay keeps at most
``send_buffer_high_water`` (4 KiB here) in QUIC per session and objects are 32 KiB, so the
one object begun before the block cannot complete before the others. No sleeps, no timing.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable

import pytest

from kvsp_moq.moqt.errors import PublishDoneCode
from kvsp_moq.moqt.messages import MessageParameters
from kvsp_moq.moqt.objects import GroupOrder
from kvsp_moq.pubsub import MoqtSession, connect
from kvsp_moq.transport import TransportConfig
from relay.session.schedule import LazyHeap, Piece, Schedule, stream_key

from test_relay import GUARD, NS, Net, client_config, net, payload, within  # noqa: F401

ASC, DESC = GroupOrder.ASCENDING, GroupOrder.DESCENDING
SIZE = 32 << 10  # per object; the relay's per-session QUIC budget is 4 KiB
N = 4


# ==========================================================================================
# the pure scheduler
def drain(s: Schedule, room: int = 1 << 30) -> list[tuple[int, bytes, bool]]:
    out = []
    while (got := s.next(room)) is not None:
        _flow, sid, data, fin = got
        out.append((sid, bytes(data), fin))
    return out


def stream_order(sent) -> list[int]:
    order: list[int] = []
    for sid, _data, _fin in sent:
        if not order or order[-1] != sid:
            order.append(sid)
    return order


def test_stream_key_rules_2_to_4() -> None:
    keys = {
        "pub-hi": stream_key(0, ASC, 9, 9),
        "g1-sg3": stream_key(7, ASC, 1, 3),
        "g2": stream_key(7, ASC, 2, 0),
        "g1-sg0": stream_key(7, ASC, 1, 0),
        "g1-fill": stream_key(7, ASC, 1, 5, fill=True),
    }
    assert sorted(keys, key=keys.get) == ["pub-hi", "g1-fill", "g1-sg0", "g1-sg3", "g2"]
    assert stream_key(7, DESC, 2, 0) < stream_key(7, DESC, 1, 0)


def test_lazy_heap_rekey_discard_and_compaction() -> None:
    h: LazyHeap[str, int] = LazyHeap()
    for i, name in enumerate("abcde"):
        h.push(name, i)
    h.push("e", -1)  # re-keyed: one entry per item
    h.discard("b")
    assert len(h) == 4 and "b" not in h and h.peek_key() == -1
    for k in range(500):  # many re-keys keep the heap compact
        h.push("a", 1000 + k)
    assert len(h._heap) <= 2 * len(h) + 64
    assert [h.pop() for _ in range(5)] == ["e", "c", "d", "a", None]


def test_subscriber_priority_beats_publisher_priority_across_requests() -> None:
    s = Schedule()
    low = s.flow(priority=200)
    high = s.flow(priority=10)
    s.open_stream(low, 4, publisher_priority=0, group_id=0)
    s.open_stream(high, 8, publisher_priority=255, group_id=0)
    for part in range(3):
        s.push(4, b"L%d" % part)
        s.push(8, b"H%d" % part)
    s.push(4, b"", fin=True)
    s.push(8, b"", fin=True)
    assert low.queued == high.queued == 6
    assert stream_order(drain(s)) == [8, 4]
    assert low.queued == high.queued == 0 and low.idle and high.idle


@pytest.mark.parametrize("order", [ASC, DESC])
def test_within_a_request_publisher_priority_group_order_subgroup(order) -> None:
    s = Schedule()
    f = s.flow(priority=128, group_order=order)
    # (stream id, publisher priority, group, subgroup)
    streams = [(4, 128, 1, 0), (8, 128, 3, 0), (12, 128, 2, 1), (16, 128, 2, 0),
               (20, 64, 0, 0), (24, 200, 5, 0)]
    for sid, pub, g, sg in streams:
        s.open_stream(f, sid, pub, g, sg)
    for part in range(3):  # interleaved arrival: header then payload, per stream
        for sid, *_ in reversed(streams):
            s.push(sid, b"%d:h%d" % (sid, part))
            s.push(sid, memoryview(b"%d:p%d" % (sid, part)))
    for sid, *_ in streams:
        s.push(sid, b"", fin=True)
    sent = drain(s)
    assert stream_order(sent) == ([20, 4, 16, 12, 8, 24] if order == ASC
                                  else [20, 8, 16, 12, 4, 24])
    for sid, *_ in streams:  # per stream: the bytes in order, FIN last
        mine = [(d, fin) for s_, d, fin in sent if s_ == sid]
        assert mine == [(b"%d:%s%d" % (sid, k, p), False) for p in range(3)
                        for k in (b"h", b"p")] + [(b"", True)]


def test_fill_before_subscription_objects_of_the_same_group() -> None:
    s = Schedule()
    f = s.flow()
    s.open_stream(f, 4, 128, group_id=5, subgroup_id=0)
    s.open_stream(f, 8, 128, group_id=5, fill=True)
    s.push(4, b"live")
    s.attach(8, iter([Piece(b"fill", publisher_priority=128, group_id=5), Piece(b"", fin=True)]))
    assert stream_order(drain(s)) == [8, 4]


def test_equal_requests_take_turns() -> None:
    s = Schedule()
    a, b = s.flow(), s.flow()
    s.open_stream(a, 4, 128, 0)
    s.open_stream(b, 8, 128, 0)
    for i in range(3):
        s.push(4, b"a%d" % i)
        s.push(8, b"b%d" % i)
    assert [sid for sid, _d, _f in drain(s)] == [4, 8, 4, 8, 4, 8]


def test_set_priority_reranks_what_waits() -> None:
    s = Schedule()
    a, b = s.flow(priority=10), s.flow(priority=20)
    s.open_stream(a, 4, 128, 0)
    s.open_stream(b, 8, 128, 0)
    for i in range(2):
        s.push(4, b"a%d" % i)
        s.push(8, b"b%d" % i)
    assert s.next(100)[1] == 4
    s.set_priority(b, 1)  # REQUEST_UPDATE mid-stream
    assert [sid for sid, _d, _f in drain(s)] == [8, 8, 4]


def test_pull_stream_reranked_per_object_and_split_by_room() -> None:
    """A fetch stream's rank is its next object's publisher priority; pieces larger than
    the room are split (as views), not copied; pull bytes are not counted as queued."""
    s = Schedule()
    fetch, sub = s.flow(), s.flow()
    s.open_stream(fetch, 4, 0, 0)
    s.open_stream(sub, 8, 100, 0)
    s.push(8, b"S" * 4)
    big = memoryview(b"x" * 10)
    s.attach(4, iter([Piece(b"h0", publisher_priority=0, group_id=0), Piece(big),
                      Piece(b"h1", publisher_priority=200, group_id=0), Piece(b"y"),
                      Piece(b"", fin=True)]))
    assert fetch.queued == 0 and sub.queued == 4
    got = drain(s, room=4)
    assert [(sid, d) for sid, d, _ in got] == [
        (4, b"h0"), (4, b"xxxx"), (4, b"xxxx"), (4, b"xx"),  # priority 0: first, split by 4
        (8, b"SSSS"),  # priority 100 before the next fetch object's 200
        (4, b"h1"), (4, b"y"), (4, b"")]
    assert got[-1][2] is True


def test_drop_stream_and_flow_forget_queued_bytes() -> None:
    s = Schedule()
    f = s.flow(budget=10)
    s.open_stream(f, 4, 128, 0)
    s.open_stream(f, 8, 128, 1)
    s.push(4, b"x" * 8)
    s.push(8, b"y" * 8)
    assert f.over_budget
    s.drop_stream(4)
    assert f.queued == 8 and not f.over_budget and s.backlog
    assert s.drop_flow(f) == [8]
    assert f.queued == 0 and not s.backlog and s.next(100) is None


# ==========================================================================================
# end to end: one stalled downstream session
#: The stalled subscriber's receive window per stream (one packet's worth).
STALL_WINDOW = 4096


class StalledSubscriber(threading.Thread):
    """A session on its own event loop (thread) that blocks that loop inside the first
    object it begins, until :attr:`release` is set; ``on_release`` then runs on that loop
    before any further byte is read (e.g. to send a REQUEST_UPDATE). ``completed`` lists
    (label, group, object) in the order objects completed.

    Its receive windows are small (:data:`STALL_WINDOW` per stream): a backend that receives
    on a thread of its own (native, aiopquic) keeps taking in bytes while the loop is
    blocked, up to the windows, and the order under test is decided by what is still queued
    in the relay, not by what the windows took in first (docs/transport.md, native gaps)."""

    def __init__(self, url: str, main: asyncio.AbstractEventLoop,
                 script: Callable[[MoqtSession, StalledSubscriber], Awaitable[object]]) -> None:
        super().__init__(daemon=True)
        self.url, self.main, self.script = url, main, script
        self.release = threading.Event()
        self.on_release: Callable[[], None] | None = None
        self.ready: asyncio.Future[None] = main.create_future()
        self.blocked: asyncio.Future[None] = main.create_future()
        self.result: asyncio.Future[object] = main.create_future()
        self.completed: list[tuple[str, int, int]] = []
        self._first = True

    def tell(self, fut: asyncio.Future, value: object = None) -> None:
        self.main.call_soon_threadsafe(lambda: fut.done() or fut.set_result(value))

    def run(self) -> None:
        asyncio.run(self._main())

    async def _main(self) -> None:
        s = await connect(self.url, client_config(max_stream_data=STALL_WINDOW,
                                                  max_data=16 * STALL_WINDOW))
        try:
            self.tell(self.result, await self.script(s, self))
        except BaseException as exc:  # hand any failure to the test
            self.main.call_soon_threadsafe(
                lambda: self.result.done() or self.result.set_exception(exc))
            self.tell(self.blocked)
        finally:
            await s.close()

    def begin(self, info) -> None:
        if self._first:
            self._first = False
            self.tell(self.blocked)
            self.release.wait(GUARD)  # the whole loop stops: no reads, no ACKs
            if self.on_release is not None:
                self.on_release()
        return None

    def progress(self, label: str) -> Callable[[object, int], None]:
        got: dict[tuple[int, int], int] = {}

        def on_progress(info, n: int) -> None:
            key = (info.group_id, info.object_id)
            got[key] = got.get(key, 0) + n
            if got[key] == info.payload_length:
                self.completed.append((label, *key))

        return on_progress


def labels(completed) -> list[str]:
    return [label for label, _g, _o in completed]


async def write_burst(track, tag: int) -> dict[tuple[int, int], bytes]:
    sent = {}
    for o in range(N):
        data = payload(tag, o, SIZE)
        await within(track.write_object(0, o, data))
        sent[(0, o)] = data
    return sent


async def collect_all(*streams) -> None:
    for st in streams:
        await within(st.collect())


@pytest.mark.parametrize("update", [False, True])
async def test_subscriber_priority_across_subscriptions_and_request_update(
        net: Net, update: bool) -> None:  # noqa: F811
    """Two subscriptions on one session: A (priority 10), B (priority 200). B's objects
    reach the relay first and the subscriber stalls inside B's first object. Released:
    A's objects all complete before B's — unless a REQUEST_UPDATE, sent on release, gave B
    priority 1: then the bytes that waited in the relay under the old priority go B first."""
    if not update and TransportConfig().backend == "native":
        pytest.skip("native receives on a thread of its own: a stalled subscriber loop still "
                    "takes in each stream's window of B before A is written, so B's objects "
                    "complete first whatever the relay's order (docs/transport.md, native gaps)")
    relay = await net.relay(high_water=4096)
    pub, catalog = await net.publisher(relay)
    ta, tb = catalog.create(NS, "a"), catalog.create(NS, "b")
    witness = await net.client(relay)
    wa, wb = [await within(witness.subscribe(NS, n)) for n in ("a", "b")]

    async def script(s: MoqtSession, c: StalledSubscriber):
        a = await s.subscribe(NS, "a", parameters=MessageParameters(subscriber_priority=10),
                              on_object_begin=c.begin, on_object_progress=c.progress("a"))
        b = await s.subscribe(NS, "b", parameters=MessageParameters(subscriber_priority=200),
                              on_object_begin=c.begin, on_object_progress=c.progress("b"))
        if update:
            def send_update() -> None:  # sent at once, before any further byte is read
                b.update(subscriber_priority=1)
            c.on_release = send_update
        c.tell(c.ready)
        got_a, got_b = await a.collect(), await b.collect()
        return ({(o.group_id, o.object_id): bytes(o.payload) for o in got_a},
                {(o.group_id, o.object_id): bytes(o.payload) for o in got_b},
                a.publish_done, b.publish_done)

    c = StalledSubscriber(relay.url, asyncio.get_running_loop(), script)
    c.start()
    await within(c.ready)
    sent_b = await write_burst(tb, 2)  # B first: without priorities it would go first
    await within(c.blocked)
    sent_a = await write_burst(ta, 1)
    await within(ta.finish())
    await within(tb.finish())
    await collect_all(wa, wb)  # the relay has received (and queued) everything
    c.release.set()
    got_a, got_b, done_a, done_b = await within(c.result)
    assert got_a == sent_a and got_b == sent_b
    assert done_a.status_code == done_b.status_code == PublishDoneCode.TRACK_ENDED
    first, second = ("b", "a") if update else ("a", "b")
    assert labels(c.completed) == [first] * N + [second] * N
    c.join(GUARD)


@pytest.mark.parametrize("sub_priority", [10, 250])
async def test_subscription_vs_fetch_on_one_session(net: Net, sub_priority: int) -> None:  # noqa: F811
    """A FETCH answered from the cache (subscriber priority 128, the default) and a
    subscription on the same session: the subscriber stalls inside the fetch's first object,
    then a burst for the subscription arrives. Released: with subscription priority 10 the
    live objects overtake the fetch response that was there first; with 250 they wait."""
    relay = await net.relay(high_water=4096)
    pub, catalog = await net.publisher(relay)
    old, live = catalog.create(NS, "old"), catalog.create(NS, "live")
    sent_old = await write_burst(old, 3)
    witness = await net.client(relay)
    # An upstream FETCH makes the range complete in the relay's cache.
    first = await within(witness.fetch(NS, "old", start=(0, 0), end=(0, N - 1)))
    assert len(await within(first.collect())) == N
    wl = await within(witness.subscribe(NS, "live"))

    async def script(s: MoqtSession, c: StalledSubscriber):
        sub = await s.subscribe(NS, "live", on_object_begin=c.begin,
                                on_object_progress=c.progress("live"),
                                parameters=MessageParameters(subscriber_priority=sub_priority))
        fetch = await s.fetch(NS, "old", start=(0, 0), end=(0, N - 1),
                              on_object_begin=c.begin, on_object_progress=c.progress("fetch"))
        c.tell(c.ready)
        got_f, got_s = await fetch.collect(), await sub.collect()
        return ({(o.group_id, o.object_id): bytes(o.payload) for o in got_f},
                {(o.group_id, o.object_id): bytes(o.payload) for o in got_s})

    c = StalledSubscriber(relay.url, asyncio.get_running_loop(), script)
    c.start()
    await within(c.blocked)  # inside the fetch's first object (from the cache)
    assert relay.stats.cache_hits == 1
    sent_live = await write_burst(live, 4)
    await within(live.finish())
    await collect_all(wl)
    c.release.set()
    got_f, got_s = await within(c.result)
    assert got_f == sent_old and got_s == sent_live
    first, second = ("live", "fetch") if sub_priority < 128 else ("fetch", "live")
    assert labels(c.completed) == [first] * N + [second] * N
    c.join(GUARD)


async def test_end_to_end_descending_group_order_byte_exact(net: Net, monkeypatch) -> None:  # noqa: F811
    """With subscriber priority and GROUP_ORDER descending everything still arrives
    byte-exact; each stream is registered with its publisher priority and group."""
    from relay.session import sender

    keys: list[tuple] = []
    real = sender.RequestOut.open_stream

    def spy(self, sid, publisher_priority, group_id, subgroup_id=0, *, fill=False):
        keys.append((self.priority, self.flow.group_order, publisher_priority, group_id))
        return real(self, sid, publisher_priority, group_id, subgroup_id, fill=fill)

    monkeypatch.setattr(sender.RequestOut, "open_stream", spy)
    relay = await net.relay(high_water=4096)
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
    assert sorted(keys) == [(3, DESC, 100 - g, g) for g in (3, 2, 1, 0)]


async def test_request_update_answered_and_forward_0_pauses(net: Net) -> None:  # noqa: F811
    """REQUEST_UPDATE is answered REQUEST_OK with LARGEST_OBJECT (§"REQUEST_UPDATE") and
    its SUBSCRIBER_PRIORITY is in force; a subscription with Forward State 0 gets no objects
    until an update sets it to 1."""
    from relay.subscribe.fanout import Subscriber

    relay = await net.relay()
    pub, catalog = await net.publisher(relay)
    track = catalog.create(NS, "fwd")
    witness = await within((await net.client(relay)).subscribe(NS, "fwd"))
    s = await net.client(relay)
    sub = await within(s.subscribe(NS, "fwd", parameters=MessageParameters(forward=False)))
    await within(track.write_object(0, 0, payload(0, 0)))
    assert (await within(witness.__anext__())).object_id == 0  # the relay has object 0
    ok = await within(sub.update(subscriber_priority=7))
    assert ok.NAME == "REQUEST_OK" and tuple(ok.parameters.largest_object) == (0, 0)
    mine = [h for p in relay.sessions for h in p.served.values()
            if isinstance(h, Subscriber) and not h.forward]
    assert len(mine) == 1 and mine[0].priority == 7
    assert (await within(sub.update(forward=True))).NAME == "REQUEST_OK"
    await within(track.write_object(0, 1, payload(0, 1)))
    await within(track.finish())
    got = [(o.group_id, o.object_id) for o in await within(sub.collect())]
    assert got == [(0, 1)]  # object 0 came while Forward State was 0
