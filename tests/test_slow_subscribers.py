"""Issue 19: one subscriber that does not read, beside others, on a relay and on a
publisher (``pubsub``'s ``TrackPublisher`` serving several subscribers directly).

The slow subscriber (``test_relay_slow.SlowSubscriber``) blocks its own event loop in its
first ``on_object_begin``: no reads, no ACKs, so the sender's QUIC send buffer for it fills
(a real connection whose reader is paused). The publisher then writes as fast as it may
(not paced by the test): the criterion is deterministic, not timed: the fast subscribers
receive every one of the objects, exact, while the slow one is still blocked having
received one; then the slow one is ended with PUBLISH_DONE TOO_FAR_BEHIND (0x5) and its
Stream Count (draft-22 §"Delivery Timeouts"), its stream reset with TOO_FAR_BEHIND.
Before the fix, ``TrackPublisher`` awaited its subscribers in turn: the writes stalled
behind the slow one and the fast ones received nothing more (the test timed out).
"""

from __future__ import annotations

import asyncio

import pytest

from kvsp_moq.moqt.errors import PublishDoneCode
from kvsp_moq.pubsub import Catalog, MoqtSession, Subscription, connect, serve
from kvsp_moq.transport import TransportConfig
from kvsp_moq.transport.tls import make_self_signed

from test_relay import DGRAM, NS, Net, client_config, net, payload, within  # noqa: F401
from test_relay_slow import SlowSubscriber

CHUNK = 64 << 10
OBJECTS = 48  # 3 MiB after the first object: 12 times the queue bound below
HIGH_WATER = 64 << 10
QUEUE = 256 << 10
CERT = make_self_signed()
WINDOW = 2  # objects the relay's publisher may be ahead of the fast subscribers


class Progress:
    """Objects each fast subscriber has read; the writer may wait for the slowest."""

    def __init__(self, n: int) -> None:
        self.read = [0] * n
        self.changed = asyncio.Event()

    async def read_all(self, i: int, sub: Subscription, count: int) -> list[bytes]:
        out = []
        async for obj in sub:
            out.append(bytes(obj.payload))
            self.read[i] = len(out)
            self.changed.set()
            if len(out) == count:
                break
        return out

    async def at_least(self, n: int) -> None:
        while min(self.read) < n:
            self.changed.clear()
            await self.changed.wait()


@pytest.mark.parametrize("where", ["publisher", "relay"])
async def test_slow_subscriber_does_not_slow_the_others(net: Net, where: str) -> None:  # noqa: F811
    catalog = Catalog()
    server = None
    sessions: list[MoqtSession] = []
    if where == "relay":
        relay = await net.relay(high_water=HIGH_WATER, subscriber_queue_bytes=QUEUE)
        catalog = (await net.publisher(relay))[1]
        url = relay.url
    else:
        server = await serve("127.0.0.1", 0, TransportConfig(
            certificate_pem=CERT.cert_pem, private_key_pem=CERT.key_pem,
            max_datagram_size=DGRAM, send_buffer_high_water=HIGH_WATER), catalog=catalog)
        url = f"moqt://127.0.0.1:{server.port}/moq"
    track = catalog.create(NS, "slow", keep=False, subscriber_queue_bytes=QUEUE)
    slow = SlowSubscriber(url, asyncio.get_running_loop(), track="slow")
    try:
        for _ in range(2):
            sessions.append(await within(connect(url, client_config())))
        fast = [await within(s.subscribe(NS, "slow")) for s in sessions]
        slow.start()
        await within(slow.subscribed)
        await within(track.write_object(0, 0, b"first"))
        await within(slow.blocked)
        for sub in fast:
            assert bytes((await within(sub.__anext__())).payload) == b"first"
        progress = Progress(len(fast))
        readers = [asyncio.ensure_future(progress.read_all(i, sub, OBJECTS))
                   for i, sub in enumerate(fast)]
        for o in range(1, OBJECTS + 1):
            if where == "relay":
                # The relay reads its upstream at full speed (no receive backpressure):
                # the publisher goes at the fast subscribers' pace, at most WINDOW objects
                # (under the queue bound) ahead of the slower of them.
                await within(progress.at_least(o - WINDOW))
            # A direct publisher is paced by its fastest subscriber by itself: it writes
            # as fast as it may.
            await within(track.write_object(0, o, payload(0, o, CHUNK)))
        got = await within(asyncio.gather(*readers))
        # Every fast subscriber has all 48 objects (3 MiB) while the slow one, still
        # blocked, has received one object (5 bytes).
        assert not slow.release.is_set()
        for objs in got:
            assert objs == [payload(0, o, CHUNK) for o in range(1, OBJECTS + 1)]
        await within(track.finish())
        for sub in fast:
            assert await within(sub.collect()) == []
            assert sub.publish_done is not None
            assert sub.publish_done.status_code == PublishDoneCode.TRACK_ENDED
        if where == "publisher":
            assert track.too_far_behind == 1
        else:
            assert relay.stats.too_far_behind == 1
    finally:
        slow.release.set()
        for s in sessions:
            await within(s.close())
        if server is not None:
            server.close()
            await within(server.wait_closed())
    status, count, n = await within(slow.result)
    assert status == PublishDoneCode.TOO_FAR_BEHIND and count == 1 and n < OBJECTS
    slow.join(10)


async def test_a_lone_slow_subscriber_is_backpressure_not_dropped() -> None:
    """With one subscriber the publisher waits for it (paced by the fastest = the only
    one): its backlog never holds more than the chunk being written, it is not dropped, and
    once it reads again it gets every object and TRACK_ENDED."""
    catalog = Catalog()
    server = await serve("127.0.0.1", 0, TransportConfig(
        certificate_pem=CERT.cert_pem, private_key_pem=CERT.key_pem,
        max_datagram_size=DGRAM, send_buffer_high_water=HIGH_WATER), catalog=catalog)
    track = catalog.create(NS, "lone", keep=False, subscriber_queue_bytes=QUEUE)
    slow = SlowSubscriber(f"moqt://127.0.0.1:{server.port}/moq", asyncio.get_running_loop(),
                          track="lone")
    try:
        slow.start()
        await within(slow.subscribed)
        await within(track.write_object(0, 0, b"first"))
        await within(slow.blocked)

        async def write_all() -> None:
            for o in range(1, OBJECTS + 1):
                await track.write_object(0, o, payload(0, o, CHUNK))
            await track.finish()

        writer = asyncio.ensure_future(write_all())
        (out,) = track.subscriptions()
        assert out.backlog is not None
        for _ in range(400):  # until QUIC's buffer for it is full and bytes wait here
            if out.backlog.blocked:
                break
            await asyncio.wait([writer], timeout=0.05)
            assert not writer.done(), "the writer ran ahead of a stalled lone subscriber"
        else:
            pytest.fail("the stalled subscriber's backlog never filled")
        assert not writer.done()
        slow.release.set()
        await within(writer)
        assert track.too_far_behind == 0
        assert out.backlog.peak <= CHUNK + 64
        # the subscriber's result before the server closes: the writer is done when the last
        # object is queued, not when it has arrived (paced by BBR, it may still be on its way)
        status, count, n = await within(slow.result)
    finally:
        slow.release.set()
        server.close()
        await within(server.wait_closed())
    assert status == PublishDoneCode.TRACK_ENDED and n == OBJECTS + 1 and count == 1
    slow.join(10)
