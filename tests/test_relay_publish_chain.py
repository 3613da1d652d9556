"""PUBLISH up a relay chain, object datagrams through the relay, and REQUEST_UPDATEs that
arrive while the relay still waits upstream (relay/subscribe/publish_out.py, relay/subscribe/datagrams.py,
relay/session/peer.py), over real QUIC on 127.0.0.1:

    publisher ─PUBLISH─▶ rack relay A ─PUBLISH─▶ datacenter relay D ◀── rack relay B
                                                        ▲                  ▲
                                                   subscriber          subscriber

No sleeps: every wait is on a protocol event, a relay observer or an iterator
(``within`` only turns a hang into a failure).
"""

from __future__ import annotations

import asyncio

import pytest
from test_relay import NS, Net, client_config, net, payload, within  # noqa: F401 (fixture)

from kvsp_moq.moqt.errors import PublishDoneCode, RequestErrorCode
from kvsp_moq.moqt.messages import LocationFilter, MessageParameters
from kvsp_moq.moqt.session import events as ev
from kvsp_moq.pubsub import Catalog, MoqtError, MoqtSession, connect
from kvsp_moq.pubsub.errors import DatagramTooLargeError
from relay import Relay
from relay.subscribe.fanout import Subscriber

NSB = tuple(f.encode() for f in NS)


def spy_updates(s: MoqtSession) -> asyncio.Queue:
    """REQUEST_UPDATEs the peer sends on ``s``'s requests (seen before pubsub answers)."""
    q: asyncio.Queue = asyncio.Queue()
    orig = s.dispatch

    def spy(e: ev.Event) -> None:
        orig(e)
        if isinstance(e, ev.UpdateReceived):
            q.put_nowait(e)

    s.dispatch = spy  # type: ignore[method-assign]
    return q


def observed(relay: Relay, kind: str) -> asyncio.Future:
    """Resolves with the first ``kind`` event the relay reports to its observers."""
    fut = asyncio.get_running_loop().create_future()
    relay.observers.append(
        lambda k, obj: k == kind and not fut.done() and fut.set_result(obj))
    return fut


async def test_publish_chained_to_the_upstream_relay(net: Net) -> None:
    d = await net.relay()
    a = await net.relay(upstream=d.url)
    b = await net.relay(upstream=d.url)
    catalog = Catalog()
    pub = await net.client(a, catalog)
    track = catalog.create(NS, "cam")
    track.track_properties = ((0x3800, 42),)
    at_d = observed(d, "publish")
    rid = await within(pub.publish(track))
    assert rid is not None
    await within(at_d)  # A forwarded the PUBLISH up to D
    assert a.stats.upstream_publishes == 1 and a.stats.upstream_subscribes == 0
    sd = await within((await net.client(d)).subscribe(NS, "cam"))
    sa = await within((await net.client(a)).subscribe(NS, "cam"))
    sb = await within((await net.client(b)).subscribe(NS, "cam"))  # B → D → A → publisher
    assert tuple(sd.response.track_properties) == ((0x3800, 42),)
    assert track.subscriber_count == 1  # only the PUBLISH: A and D fan out
    sent = {}
    for g in range(2):
        for o in range(3):
            sent[(g, o)] = payload(g, o, 1500 + o)
            await within(track.write_object(g, o, sent[(g, o)], properties=[(0x3802, o)]))
    await within(track.finish())
    for sub in (sd, sa, sb):
        objs = await within(sub.collect())
        assert {(x.group_id, x.object_id): bytes(x.payload) for x in objs} == sent
        assert all(x.properties[0].value == x.object_id for x in objs)
        assert sub.publish_done is not None
        assert sub.publish_done.status_code == PublishDoneCode.TRACK_ENDED
        assert sub.publish_done.stream_count == sub.stats.data_streams == 2
    assert d.publishes.tracks == {} and a.publishes.tracks == {}


async def test_chained_publish_forward0_asks_the_publisher_when_d_gets_a_subscriber(
        net: Net) -> None:
    """FORWARD=0 goes up with the PUBLISH; D's first subscriber (Forward State 1) makes D
    send REQUEST_UPDATE FORWARD=1 to A, which passes it on to the publisher (§"Forward
    Handling"); the publisher's objects then reach D's subscriber."""
    d = await net.relay()
    a = await net.relay(upstream=d.url)
    catalog = Catalog()
    pub = await net.client(a, catalog)
    updates = spy_updates(pub)
    track = catalog.create(NS, "paused")
    at_d = observed(d, "publish")
    rid = await within(pub.publish(track, forward=False))
    assert (await within(at_d)).forwarding is False
    out = track.outgoing(pub, rid)
    assert out is not None and out.forward is False and not track.forwarding.is_set()
    await within(track.write_object(0, 0, b"before anyone asked"))  # sent nowhere
    s = await within((await net.client(d)).subscribe(NS, "paused"))
    await within(track.forwarding.wait())  # the publisher learns it is wanted
    upd = await within(updates.get())  # D → A → publisher
    assert upd.request_id == rid and upd.message.parameters.forward is True
    assert out.forward is True  # pubsub applied it (and answered REQUEST_OK)
    await within(track.write_object(0, 1, b"now"))
    got = await within(s.__anext__())
    assert (got.group_id, got.object_id, bytes(got.payload)) == (0, 1, b"now")


async def test_datagrams_fanned_out_cached_and_dropped_when_too_large(net: Net) -> None:
    relay = await net.relay()
    pub, catalog = await net.publisher(relay)
    track = catalog.create(NS, "dg")
    s1, s2 = await net.client(relay), await net.client(relay)
    small = await within(connect(relay.url, client_config(max_datagram_frame_size=600)))
    net.sessions.append(small)
    subs = [await within(s.subscribe(NS, "dg")) for s in (s1, s2, small)]
    await within(track.subscribed.wait())
    sent = {}
    for o in range(5):
        sent[o] = payload(0, o, 900)  # > 600: too large for ``small``'s session
        await within(track.write_datagram(0, o, sent[o], properties=[(0x3800, o)],
                                          priority=3, end_of_group=o == 4))
    for sub in subs[:2]:
        got = [await within(sub.__anext__()) for _ in range(5)]
        assert {x.object_id: bytes(x.payload) for x in got} == sent
        assert all(x.subgroup_id is None and x.publisher_priority == 3 for x in got)
        assert [x.end_of_group for x in sorted(got, key=lambda x: x.object_id)] == \
            [False] * 4 + [True]
        assert all(x.properties[0].value == x.object_id for x in got)
    assert relay.stats.datagrams_dropped == 5  # the small session's five, silently
    small_obj = payload(0, 9, 100)
    await within(track.write_datagram(0, 9, small_obj))
    assert bytes((await within(subs[2].__anext__())).payload) == small_obj
    # cached like any object: FETCH from the publisher stores them with the datagram flag
    f = await within(s1.fetch(NS, "dg", start=(0, 0), end=(0, 4)))
    got = await within(f.collect())
    assert [(x.object_id, x.subgroup_id) for x in got] == [(o, None) for o in range(5)]
    assert [bytes(x.payload) for x in got] == [sent[o] for o in range(5)]
    assert relay.cache.get((NSB, b"dg"), 0, 3) is not None


async def test_datagram_too_large_for_a_subscriber_raises(net: Net) -> None:
    relay = await net.relay()
    pub, catalog = await net.publisher(relay)
    track = catalog.create(NS, "big")
    await within((await net.client(relay)).subscribe(NS, "big"))
    await within(track.subscribed.wait())
    with pytest.raises(DatagramTooLargeError) as e:
        await within(track.write_datagram(0, 0, b"x" * (pub.max_datagram_size + 1)))
    assert e.value.limit == pub.max_datagram_size and e.value.size > e.value.limit
    assert track.largest is None  # nothing was published


async def test_update_while_subscribe_waits_is_applied_after_subscribe_ok(
        net: Net) -> None:
    """A REQUEST_UPDATE sent before SUBSCRIBE_OK (the relay holds the SUBSCRIBE for a
    publisher, then waits for its upstream subscription) is held, applied once the
    subscription is Established, and answered REQUEST_OK after SUBSCRIBE_OK."""
    relay = await net.relay()
    s = await net.client(relay)
    held = observed(relay, "rendezvous_hold")
    sub_task = asyncio.ensure_future(s.subscribe(
        NS, "late", parameters=MessageParameters(rendezvous_timeout=20_000)))
    await within(held)  # the relay has the SUBSCRIBE, and holds it
    assert s.moqt is not None
    [rid] = [r for r, req in s.moqt.requests.items() if req.message.NAME == "SUBSCRIBE"]
    upd = s.update_request(rid, MessageParameters(subscriber_priority=5, forward=False))
    upd2 = s.update_request(rid, MessageParameters(subscriber_priority=6))
    catalog = Catalog()
    track = catalog.create(NS, "late")
    pub = await net.client(relay, catalog)
    await within(pub.publish_namespace(NS))  # the held SUBSCRIBE now goes to it
    sub = await within(sub_task)
    assert (await within(upd)).NAME == "REQUEST_OK"  # one answer per update
    assert (await within(upd2)).NAME == "REQUEST_OK"
    [h] = [h for p in relay.sessions for h in p.served.values() if isinstance(h, Subscriber)]
    assert h.priority == 6 and h.forward is False  # coalesced: the later value wins
    await within(track.subscribed.wait())
    await within(track.write_object(0, 0, b"paused"))
    assert (await within(sub.update(forward=True))).NAME == "REQUEST_OK"
    await within(track.write_object(0, 1, b"resumed"))
    got = await within(sub.__anext__())
    assert (got.object_id, bytes(got.payload)) == (1, b"resumed")


async def test_failed_update_gets_request_error_then_publish_done_update_failed(
        net: Net) -> None:
    relay = await net.relay()
    pub, catalog = await net.publisher(relay)
    track = catalog.create(NS, "upd")
    s = await net.client(relay)
    sub = await within(s.subscribe(NS, "upd"))
    await within(track.write_object(5, 0, b"x"))
    await within(sub.__anext__())
    bad = LocationFilter.absolute((5, 3), 5, 1)  # end (5,1) precedes start (5,3)
    with pytest.raises(MoqtError) as e:
        await within(sub.update(location_filter=bad))
    assert e.value.code == RequestErrorCode.INVALID_RANGE
    await within(sub.collect())  # the subscription then ends
    assert sub.publish_done is not None
    assert sub.publish_done.status_code == PublishDoneCode.UPDATE_FAILED
    assert sub.publish_done.stream_count == sub.stats.data_streams == 1
