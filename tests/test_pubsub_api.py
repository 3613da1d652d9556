"""The pubsub public request API (docs/pubsub.md): Subscription.update (REQUEST_UPDATE and
its answer), request parameters on fetch / track_status, object datagrams, PUBLISH /
end_publish, SUBSCRIBE_TRACKS, the draft-18 joining FETCH. Real QUIC on 127.0.0.1, pubsub
on both ends (or a relay where the pubsub server does not serve the request); no sleeps."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from test_pubsub import NS, Pair, client_config, server_config, within
from test_relay import NS as RNS
from test_relay import Net, net  # noqa: F401 (fixture)

from kvsp_moq.moqt.errors import PublishDoneCode, RequestErrorCode
from kvsp_moq.moqt.messages import LocationFilter, Message, MessageParameters, Token
from kvsp_moq.pubsub import Catalog, MoqtError, MoqtSession, connect, serve
from kvsp_moq.pubsub.errors import DatagramTooLargeError

NSB = tuple(f.encode() for f in NS)


@pytest.fixture
async def pair() -> AsyncIterator[Pair]:
    p = await Pair().start()
    try:
        yield p
    finally:
        await p.stop()


async def test_update_forward_and_priority_answered_with_largest(pair: Pair) -> None:
    track = pair.catalog.create(NS, "t")
    sub = await within(pair.client.subscribe(NS, "t"))
    await within(track.subscribed.wait())
    await within(track.write_object(0, 0, b"a"))
    assert bytes((await within(sub.__anext__())).payload) == b"a"
    ok = await within(sub.update(forward=False, subscriber_priority=9))
    assert ok.NAME == "REQUEST_OK" and tuple(ok.parameters.largest_object) == (0, 0)
    out = track.outgoing(pair.server_session, sub.request_id)
    assert out is not None and out.forward is False and out.subscriber_priority == 9
    await within(track.write_object(0, 1, b"not sent"))
    await within(sub.update(forward=True))
    await within(track.write_object(0, 2, b"c"))
    got = await within(sub.__anext__())
    assert (got.object_id, bytes(got.payload)) == (2, b"c")


async def test_update_filter_narrows_and_failed_update_ends_update_failed(pair: Pair) -> None:
    track = pair.catalog.create(NS, "f")
    sub = await within(pair.client.subscribe(NS, "f"))
    await within(track.subscribed.wait())
    await within(track.write_object(1, 0, b"x"))
    await within(sub.__anext__())
    # narrow to {1,0}..{2,0}: objects after it end the subscription SUBSCRIPTION_ENDED
    ok = await within(sub.update(location_filter=LocationFilter.absolute((1, 0), 2, 0)))
    assert tuple(ok.parameters.largest_object) == (1, 0)
    other = await within(pair.client.subscribe(NS, "f"))
    bad = LocationFilter.absolute((3, 5), 3, 1)  # end precedes start
    with pytest.raises(MoqtError) as e:
        await within(other.update(location_filter=bad))
    assert e.value.code == RequestErrorCode.INVALID_RANGE
    await within(other.collect())
    assert other.publish_done.status_code == PublishDoneCode.UPDATE_FAILED
    await within(track.write_object(2, 0, b"last"))
    await within(track.write_object(2, 1, b"outside"))
    got = [bytes(o.payload) for o in await within(sub.collect())]
    assert got == [b"last"]
    assert sub.publish_done.status_code == PublishDoneCode.SUBSCRIPTION_ENDED


class _Recorder:
    """A RequestGate that allows everything and keeps every request message."""

    def __init__(self) -> None:
        self.seen: list[Message] = []

    def allows(self, session: MoqtSession, message: Message) -> bool:
        self.seen.append(message)
        return True

    def shows(self, session: MoqtSession, message: Message, namespace: tuple[bytes, ...]) -> bool:
        return True


async def test_fetch_and_track_status_carry_parameters() -> None:
    gate = _Recorder()
    catalog = Catalog()
    track = catalog.create(NS, "p")
    server = await serve("127.0.0.1", 0, server_config(), catalog=catalog, gate=gate)
    client = await within(connect(f"moqt://127.0.0.1:{server.port}/moq", client_config()))
    try:
        await within(track.write_object(0, 0, b"stored"))
        token = Token.use_value(0, b"fetch-token")
        f = await within(client.fetch(NS, "p", subscriber_priority=17,
                                      parameters=MessageParameters(authorization_tokens=(token,))))
        assert [bytes(o.payload) for o in await within(f.collect())] == [b"stored"]
        ts = await within(client.track_status(NS, "p", parameters=MessageParameters(
            authorization_tokens=(Token.use_value(0, b"ts-token"),))))
        assert tuple(ts.parameters.largest_object) == (0, 0)
        fetch_msg, status_msg = gate.seen[-2:]
        assert fetch_msg.parameters.subscriber_priority == 17
        assert fetch_msg.parameters.authorization_tokens[0].token_value == b"fetch-token"
        assert status_msg.parameters.authorization_tokens[0].token_value == b"ts-token"
    finally:
        await within(client.close())
        server.close()
        await within(server.wait_closed())


async def test_datagrams_end_to_end_and_size_limit(pair: Pair) -> None:
    track = pair.catalog.create(NS, "dg")
    sub = await within(pair.client.subscribe(NS, "dg"))
    await within(track.subscribed.wait())
    limit = pair.server_session.max_datagram_size
    assert 1000 < limit <= 1452
    await within(track.write_datagram(3, 0, b"d0", properties=[(0x3800, 1)], priority=7))
    await within(track.write_datagram(3, 1, b"d1", end_of_group=True))
    got = sorted([await within(sub.__anext__()) for _ in range(2)], key=lambda o: o.object_id)
    assert [(o.group_id, o.object_id, o.subgroup_id, bytes(o.payload)) for o in got] == \
        [(3, 0, None, b"d0"), (3, 1, None, b"d1")]
    assert got[0].publisher_priority == 7 and got[0].properties[0].value == 1
    assert got[1].end_of_group and not got[0].end_of_group
    with pytest.raises(DatagramTooLargeError):
        await within(track.write_datagram(3, 2, bytes(limit)))
    assert track.largest == (3, 1)
    f = await within(pair.client.fetch(NS, "dg", start=(3, 0)))
    assert [(o.object_id, o.subgroup_id) for o in await within(f.collect())] == \
        [(0, None), (1, None)]  # kept for FETCH, with the datagram flag


async def test_publish_end_publish_and_subscribe_tracks_via_relay(net: Net) -> None:  # noqa: F811
    relay = await net.relay()
    catalog = Catalog()
    pub = await net.client(relay, catalog)
    track = catalog.create(NS + ("a",), "cam")
    watcher = await within(connect(relay.url, _relay_client(), accept_publish=True))
    net.sessions.append(watcher)
    await within(watcher.subscribe_tracks(NS))
    rid = await within(pub.publish(track, track_alias=5))
    incoming = await within(watcher.incoming_publishes.get())
    assert (incoming.namespace, incoming.name) == (NSB + (b"a",), b"cam")
    await within(track.write_object(0, 0, b"pushed"))
    assert bytes((await within(incoming.subscription.__anext__())).payload) == b"pushed"
    pub.end_publish(rid, PublishDoneCode.TRACK_ENDED, "done")
    await within(incoming.subscription.collect())
    done = incoming.subscription.publish_done
    assert done.status_code == PublishDoneCode.TRACK_ENDED and done.stream_count == 1
    with pytest.raises(ValueError):
        await within(pub.subscribe_tracks(NS))  # pub does not accept PUBLISH


def _relay_client():
    from test_relay import client_config as relay_client_config

    return relay_client_config()


async def test_joining_fetch_draft18_via_relay(net: Net) -> None:  # noqa: F811
    from test_relay import client_config as relay_client_config

    relay = await net.relay()
    pub, catalog = await net.publisher(relay)
    track = catalog.create(RNS, "j")
    s = await within(connect(relay.url, relay_client_config(alpn_protocols=["moqt-18"])))
    net.sessions.append(s)
    sub = await within(s.subscribe(RNS, "j"))
    await within(track.subscribed.wait())
    for g in range(2):
        await within(track.write_object(g, 0, bytes([g]) * 10))
    for _ in range(2):
        await within(sub.__anext__())
    sub2 = await within(s.subscribe(RNS, "j"))  # Joining Location: {1, 0}
    f = await within(s.joining_fetch(sub2, 1))
    got = [(o.group_id, o.object_id) for o in await within(f.collect())]
    assert got == [(0, 0), (1, 0)]
