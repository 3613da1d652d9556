"""kvsp_moq.pubsub end to end over real QUIC (aioquic) on 127.0.0.1; no mocks, no sleeps.

Every wait is on a future/event/iterator that the protocol completes; ``within`` is only a
safety net that turns a hang into a failure.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator

import pytest

from kvsp_moq.moqt.errors import PublishDoneCode, RequestErrorCode, StreamResetCode
from kvsp_moq.moqt.session import events as ev
from kvsp_moq.moqt.version import Version
from kvsp_moq.pubsub import Catalog, MoqtError, MoqtSession, Refuse, connect, serve
from kvsp_moq.transport import TransportConfig
from kvsp_moq.transport.tls import make_self_signed

GUARD = 30.0
MiB = 1 << 20
NS = ("kvsp-test", "ns")
_CERT = make_self_signed()


async def within(aw, timeout: float = GUARD):
    return await asyncio.wait_for(aw, timeout)


def server_config(alpns=None) -> TransportConfig:
    kw = {"alpn_protocols": alpns} if alpns else {}
    return TransportConfig(certificate_pem=_CERT.cert_pem, private_key_pem=_CERT.key_pem,
                           max_datagram_size=1452, **kw)


def client_config(alpns=None) -> TransportConfig:
    kw = {"alpn_protocols": alpns} if alpns else {}
    return TransportConfig(insecure=True, max_datagram_size=1452, **kw)


class Pair:
    """A server (publisher, with a catalog) and a connected client (subscriber)."""

    def __init__(self) -> None:
        self.catalog = Catalog()
        self.server_sessions: asyncio.Queue[MoqtSession] = asyncio.Queue()

    async def start(self, alpns=None, server_alpns=None, path: str = "/moq") -> Pair:
        self.server = await serve("127.0.0.1", 0, server_config(server_alpns or alpns),
                                  catalog=self.catalog,
                                  on_session=self.server_sessions.put_nowait)
        self.client = await within(connect(f"moqt://127.0.0.1:{self.server.port}{path}",
                                           client_config(alpns)))
        self.server_session = await within(self.server_sessions.get())
        return self

    async def stop(self) -> None:
        await within(self.client.close())
        self.server.close()
        await within(self.server.wait_closed())


@pytest.fixture
async def pair() -> AsyncIterator[Pair]:
    p = await Pair().start()
    try:
        yield p
    finally:
        await p.stop()


async def test_publish_subscribe_exact_bytes(pair: Pair) -> None:
    track = pair.catalog.create(NS, "layers")
    sub = await within(pair.client.subscribe(NS, "layers"))
    await within(track.subscribed.wait())
    sent = {}
    for g in range(2):
        for o in range(3):
            payload = bytes([g * 16 + o]) * (1000 * (o + 1))
            sent[(g, o)] = payload
            await track.write_object(g, o, payload, properties=[(0x3800, g * 10 + o)])
    await track.finish()
    got = await within(sub.collect())
    # Two groups = two subgroup streams, which QUIC may interleave; order within a group holds.
    assert sorted((o.group_id, o.object_id) for o in got) == sorted(sent)
    for g in range(2):
        assert [o.object_id for o in got if o.group_id == g] == [0, 1, 2]
    for o in got:
        assert bytes(o.payload) == sent[(o.group_id, o.object_id)]
        assert o.properties == ((0x3800, o.group_id * 10 + o.object_id),)
    assert sub.publish_done is not None and sub.publish_done.stream_count == 2
    assert sub.stats.data_streams == 2


async def test_fetch_object_range(pair: Pair) -> None:
    track = pair.catalog.create(NS, "stored")
    for g in range(3):
        for o in range(4):
            await track.write_object(g, o, f"g{g}o{o}".encode() * 50)
    f = await within(pair.client.fetch(NS, "stored", start=(0, 2), end=(1, 1)))
    assert f.end_location == (1, 1)
    got = await within(f.collect())
    assert [(o.group_id, o.object_id) for o in got] == [(0, 2), (0, 3), (1, 0), (1, 1)]
    assert all(bytes(o.payload) == f"g{o.group_id}o{o.object_id}".encode() * 50 for o in got)
    # The whole track (no end): to the largest object.
    f2 = await within(pair.client.fetch(NS, "stored"))
    assert len(await within(f2.collect())) == 12


async def test_fetch_beyond_largest_is_invalid_range(pair: Pair) -> None:
    track = pair.catalog.create(NS, "small")
    await track.write_object(0, 0, b"x")
    with pytest.raises(MoqtError) as info:
        await within(pair.client.fetch(NS, "small", start=(5, 0)))
    assert info.value.code == RequestErrorCode.INVALID_RANGE


async def test_unknown_track_is_request_error(pair: Pair) -> None:
    with pytest.raises(MoqtError) as info:
        await within(pair.client.subscribe(("nonexistent", "namespace"), "test-track"))
    assert info.value.code == RequestErrorCode.DOES_NOT_EXIST


async def test_publish_namespace(pair: Pair) -> None:
    await within(pair.client.publish_namespace(("moq-test", "interop")))
    kind, ns = await within(pair.server_session.namespace_updates.get())
    assert kind == "publish_namespace" and ns == (b"moq-test", b"interop")


async def test_subscribe_namespace_lists_catalog(pair: Pair) -> None:
    pair.catalog.create(("kvsp-1", "scope", "a"), "raw")
    pair.catalog.create(("kvsp-1", "scope", "b"), "raw")
    await within(pair.client.subscribe_namespace(("kvsp-1", "scope")))
    got = {await within(pair.client.namespace_updates.get()) for _ in range(2)}
    assert got == {("namespace", (b"a",)), ("namespace", (b"b",))}


async def test_large_object_streamed_into_caller_buffer(pair: Pair) -> None:
    size = 64 * MiB
    track = pair.catalog.create(NS, "big", keep=False)
    dest = bytearray(size)
    begun = []

    def on_begin(info):
        begun.append(info)
        assert info.payload_length == size
        return memoryview(dest)

    sub = await within(pair.client.subscribe(NS, "big", on_object_begin=on_begin))
    await within(track.subscribed.wait())
    chunk = 1 * MiB
    digest = hashlib.sha256()
    block = bytearray(chunk)

    async def produce() -> None:
        w = await track.begin_object(0, 0, size)
        for i in range(size // chunk):
            block[:] = (i.to_bytes(4, "big") * (chunk // 4))  # generated, never held whole
            digest.update(block)
            await w.write(block)
        await w.close()
        await track.finish()

    await within(produce(), 120)
    got = await within(sub.collect(), 120)
    assert len(got) == 1 and len(begun) == 1
    assert hashlib.sha256(dest).digest() == digest.digest()
    # The payload went straight into `dest`: this layer held no payload bytes of its own.
    assert sub.stats.peak_buffered_bytes == 0
    assert sub.stats.payload_bytes == size
    # The object handed out is a view of the caller's buffer, not a copy.
    assert got[0].payload.obj is dest


async def test_subscription_cancellation(pair: Pair) -> None:
    track = pair.catalog.create(NS, "live")
    sub = await within(pair.client.subscribe(NS, "live"))
    await within(track.subscribed.wait())
    await track.write_object(0, 0, b"first")
    first = await within(sub.__anext__())
    assert bytes(first.payload) == b"first"
    await sub.cancel()
    assert await within(sub.collect()) == []
    # The publisher learns of it from the reset request stream (RESET_STREAM CANCELLED).
    await within(track.unsubscribed.wait())
    assert track.subscriber_count == 0
    await track.write_object(1, 0, b"nobody listens")  # no subscriber: nothing to send


async def test_goaway(pair: Pair) -> None:
    await within(pair.server_session.goaway("moqt://127.0.0.1:1/elsewhere"))
    uri = await within(pair.client.goaway_received)
    assert uri == "moqt://127.0.0.1:1/elsewhere"
    with pytest.raises(MoqtError) as info:
        await pair.client.subscribe(NS, "x")
    assert info.value.code == RequestErrorCode.GOING_AWAY


@pytest.mark.parametrize("version", [Version.DRAFT_18, Version.DRAFT_20, Version.DRAFT_21,
                                     Version.DRAFT_22])
async def test_each_version(version: Version) -> None:
    p = await Pair().start(alpns=[version.alpn])
    try:
        assert p.client.version is version and p.server_session.version is version
        track = p.catalog.create(NS, "v")
        for o in range(3):
            await track.write_object(0, o, bytes([o]) * 100)
        sub = await within(p.client.subscribe(NS, "v"))
        await within(track.subscribed.wait())
        await track.write_object(1, 0, b"live")
        await track.finish()
        live = await within(sub.collect())
        assert [(o.group_id, o.object_id, bytes(o.payload)) for o in live] == [(1, 0, b"live")]
        f = await within(p.client.fetch(NS, "v", start=(0, 1), end=(0, 2)))
        got = await within(f.collect())
        assert [(o.object_id, bytes(o.payload)) for o in got] == [(1, b"\1" * 100),
                                                                 (2, b"\2" * 100)]
        with pytest.raises(MoqtError) as info:
            await within(p.client.subscribe(NS, "missing"))
        assert info.value.code == RequestErrorCode.DOES_NOT_EXIST
    finally:
        await p.stop()



async def test_a_stopped_subgroup_stream_ends_only_that_stream(pair: Pair) -> None:
    """The subscriber refuses group 0's object (on_object_begin → Refuse: STOP_SENDING on
    that subgroup stream). The publisher, once it got the STOP_SENDING, skips the rest of
    group 0 for it, but the subscription stays: group 1 arrives on a new stream, then
    PUBLISH_DONE with a Stream Count of both streams."""
    track = pair.catalog.create(NS, "stop-one")
    stopped: asyncio.Future = asyncio.get_running_loop().create_future()
    server = pair.server_session
    orig = server.dispatch

    def spy(e: ev.Event) -> None:
        orig(e)
        if isinstance(e, ev.DataStreamStopped) and not stopped.done():
            stopped.set_result(e)

    server.dispatch = spy  # type: ignore[method-assign]

    def on_begin(info):
        return Refuse(StreamResetCode.CANCELLED, "not group 0") if info.group_id == 0 \
            else None

    sub = await within(pair.client.subscribe(NS, "stop-one", on_object_begin=on_begin))
    await within(track.subscribed.wait())
    await within(track.write_object(0, 0, b"refused"))
    e = await within(stopped)  # the publisher got the STOP_SENDING of group 0's stream
    assert e.error_code == StreamResetCode.CANCELLED
    assert track.subscriber_count == 1 and not track.unsubscribed.is_set()
    await within(track.write_object(0, 1, b"rest of group 0"))  # not sent: stream stopped
    await within(track.write_object(1, 0, b"g1o0"))
    await within(track.write_object(1, 1, b"g1o1"))
    await within(track.finish())
    got = await within(sub.collect())
    assert [(o.group_id, o.object_id, bytes(o.payload)) for o in got] == \
        [(1, 0, b"g1o0"), (1, 1, b"g1o1")]
    assert sub.stats.stopped_streams == 1
    assert sub.publish_done is not None
    assert sub.publish_done.status_code == PublishDoneCode.TRACK_ENDED
    assert sub.publish_done.stream_count == 2
