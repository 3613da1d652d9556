"""PUBLISH into the relay, SUBSCRIBE_TRACKS and RENDEZVOUS_TIMEOUT (relay/subscribe/publish_in.py,
relay/subscribe/rendezvous.py) over real QUIC on 127.0.0.1. No sleeps: every wait is on a future,
queue or iterator the protocol completes (``within`` turns a hang into a failure)."""

from __future__ import annotations

import asyncio

import pytest

from interop.client_support import publish_done_now, publish_track, subscribe_tracks
from kvsp_moq.moqt.errors import PublishDoneCode, RequestErrorCode
from kvsp_moq.moqt.messages import MessageParameters
from kvsp_moq.moqt.session import events as ev
from kvsp_moq.pubsub import Catalog, MoqtError, MoqtSession, connect
from tests.test_relay import Net, client_config, net, within  # noqa: F401 (fixture)

NS = ("pub-test", "live")
BNS = tuple(f.encode() for f in NS)


async def accepting(net: Net, relay) -> MoqtSession:  # noqa: ANN001
    s = await within(connect(relay.url, client_config(), accept_publish=True))
    net.sessions.append(s)
    return s


def spy_updates(s: MoqtSession) -> asyncio.Queue:
    """REQUEST_UPDATEs the peer sends on our requests (pubsub does not surface them)."""
    q: asyncio.Queue = asyncio.Queue()
    orig = s.dispatch

    def spy(e: ev.Event) -> None:
        if isinstance(e, ev.UpdateReceived):
            q.put_nowait(e)
        orig(e)

    s.dispatch = spy  # type: ignore[method-assign]
    return q


def on_hold(relay) -> asyncio.Future:  # noqa: ANN001
    fut = asyncio.get_running_loop().create_future()
    relay.observers.append(
        lambda kind, obj: kind == "rendezvous_hold" and not fut.done() and fut.set_result(obj))
    return fut


async def test_publish_fans_out_like_a_subscription(net: Net) -> None:
    relay = await net.relay()
    catalog = Catalog()
    pub = await net.client(relay, catalog)
    track = catalog.create(NS, "cam")
    await within(publish_track(pub, track, alias=7))
    a, b = await net.client(relay), await net.client(relay)
    sa = await within(a.subscribe(NS, "cam"))
    sb = await within(b.subscribe(NS, "cam"))
    assert relay.stats.upstream_subscribes == 0  # the PUBLISH is the one upstream
    assert len(relay.upstreams.tracks) == 1
    sent = {}
    for g in range(2):
        for o in range(3):
            sent[(g, o)] = bytes([g, o]) * 500
            await within(track.write_object(g, o, sent[(g, o)]))
    await within(track.finish())
    for sub in (sa, sb):
        got = {(x.group_id, x.object_id): bytes(x.payload) for x in await within(sub.collect())}
        assert got == sent
        assert sub.publish_done is not None
        assert sub.publish_done.status_code == PublishDoneCode.TRACK_ENDED
        assert sub.publish_done.stream_count == sub.stats.data_streams == 2
    assert relay.upstreams.tracks == {} and relay.publishes.tracks == {}


async def test_publish_forward0_gets_request_update_when_a_subscriber_appears(net: Net) -> None:
    relay = await net.relay()
    catalog = Catalog()
    pub = await net.client(relay, catalog)
    updates = spy_updates(pub)
    track = catalog.create(NS, "paused")
    rid = await within(publish_track(pub, track, alias=1, forward=False))
    assert updates.empty()
    sub = await net.client(relay)
    s = await within(sub.subscribe(NS, "paused"))
    upd = await within(updates.get())
    assert upd.request_id == rid and upd.message.parameters.forward is True
    await within(track.write_object(0, 0, b"now"))
    assert bytes((await within(s.__anext__())).payload) == b"now"


async def test_publish_done_forwarded_and_publisher_leaving(net: Net) -> None:
    relay = await net.relay()
    catalog = Catalog()
    pub = await net.client(relay, catalog)
    t1, t2 = catalog.create(NS, "one"), catalog.create(NS, "two")
    r1 = await within(publish_track(pub, t1, alias=1))
    await within(publish_track(pub, t2, alias=2))
    sub = await net.client(relay)
    s1 = await within(sub.subscribe(NS, "one"))
    s2 = await within(sub.subscribe(NS, "two"))
    publish_done_now(pub, r1, PublishDoneCode.SUBSCRIPTION_ENDED, 0)
    await within(s1.collect())
    assert s1.publish_done is not None
    assert s1.publish_done.status_code == PublishDoneCode.SUBSCRIPTION_ENDED
    await within(pub.close())
    await within(s2.collect())
    assert s2.publish_done is not None
    assert s2.publish_done.status_code == PublishDoneCode.INTERNAL_ERROR
    with pytest.raises(MoqtError) as e:
        await within(sub.subscribe(NS, "two"))
    assert e.value.code == RequestErrorCode.DOES_NOT_EXIST
    assert relay.publishes.tracks == {}


async def test_subscribe_tracks_gets_a_publish_per_track(net: Net) -> None:
    relay = await net.relay()
    catalog = Catalog()
    pub = await net.client(relay, catalog)
    early = catalog.create(NS + ("a",), "early")
    other = catalog.create(("elsewhere",), "x")
    await within(publish_track(pub, early, alias=1))
    await within(publish_track(pub, other, alias=2))
    sub = await accepting(net, relay)
    await within(subscribe_tracks(sub, BNS))
    first = await within(sub.incoming_publishes.get())
    assert (first.namespace, first.name) == (BNS + (b"a",), b"early")
    late = catalog.create(NS, "late")
    await within(publish_track(pub, late, alias=3))
    second = await within(sub.incoming_publishes.get())
    assert second.name == b"late" and sub.incoming_publishes.empty()
    await within(late.write_object(0, 0, b"pushed"))
    assert bytes((await within(second.subscription.__anext__())).payload) == b"pushed"
    with pytest.raises(MoqtError) as e:  # overlaps the first SUBSCRIBE_TRACKS
        await within(subscribe_tracks(sub, BNS + (b"a",)))
    assert e.value.code == RequestErrorCode.PREFIX_OVERLAP


async def test_rendezvous_held_until_publish_namespace(net: Net) -> None:
    relay = await net.relay()
    sub = await net.client(relay)
    held = on_hold(relay)
    pending = asyncio.ensure_future(sub.subscribe(
        NS, "t", parameters=MessageParameters(rendezvous_timeout=20_000)))
    await within(held)  # the SUBSCRIBE reached the relay and is held
    catalog = Catalog()
    track = catalog.create(NS, "t")
    pub = await net.client(relay, catalog)
    await within(pub.publish_namespace(NS[:1]))
    s = await within(pending)
    assert relay.rendezvous.held == []
    await within(track.subscribed.wait())
    await within(track.write_object(0, 0, b"met"))
    assert bytes((await within(s.__anext__())).payload) == b"met"


async def test_rendezvous_held_until_publish(net: Net) -> None:
    relay = await net.relay()
    sub = await net.client(relay)
    held = on_hold(relay)
    pending = asyncio.ensure_future(sub.subscribe(
        NS, "p", parameters=MessageParameters(rendezvous_timeout=20_000)))
    await within(held)  # the SUBSCRIBE reached the relay and is held
    catalog = Catalog()
    pub = await net.client(relay, catalog)
    track = catalog.create(NS, "p")
    await within(publish_track(pub, track, alias=4))
    s = await within(pending)
    await within(track.write_object(0, 0, b"via publish"))
    assert bytes((await within(s.__anext__())).payload) == b"via publish"


async def test_rendezvous_timeout_and_zero(net: Net) -> None:
    relay = await net.relay()
    sub = await net.client(relay)
    with pytest.raises(MoqtError) as e:
        await within(sub.subscribe(NS, "none",
                                   parameters=MessageParameters(rendezvous_timeout=50)))
    assert e.value.code == RequestErrorCode.TIMEOUT
    assert relay.rendezvous.held == []
    with pytest.raises(MoqtError) as e:
        await within(sub.subscribe(NS, "none",
                                   parameters=MessageParameters(rendezvous_timeout=0)))
    assert e.value.code == RequestErrorCode.DOES_NOT_EXIST
