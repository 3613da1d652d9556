"""Forward State at a pubsub publisher (§"Subscriptions": "The publisher does not send
Objects if the Forward State is 0"): ``TrackPublisher.forwarding`` follows the subscribers'
Forward States both ways, and a REQUEST_UPDATE FORWARD=0 sent right behind the REQUEST_OK
(PUBLISH_OK) of our PUBLISH — what aiomoqt's relay does to park a PUBLISH nobody subscribes
to yet — is applied, not just answered. Real QUIC on 127.0.0.1; no sleeps."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from test_pubsub import NS, Pair, client_config, server_config, within

from kvsp_moq.moqt.messages import Message, MessageParameters, Publish
from kvsp_moq.moqt.session import events as ev
from kvsp_moq.pubsub import Catalog, MoqtSession, connect, serve
from kvsp_moq.pubsub.receive import Subscription
from kvsp_moq.pubsub.session import IncomingPublish


@pytest.fixture
async def pair() -> AsyncIterator[Pair]:
    p = await Pair().start()
    try:
        yield p
    finally:
        await p.stop()


async def test_forwarding_is_cleared_when_no_subscriber_forwards(pair: Pair) -> None:
    track = pair.catalog.create(NS, "fw")
    assert not track.forwarding.is_set()
    sub = await within(pair.client.subscribe(NS, "fw"))
    await within(track.subscribed.wait())
    assert track.forwarding.is_set()
    await within(sub.update(forward=False))  # answered: the publisher has applied it
    assert not track.forwarding.is_set()
    await within(sub.update(forward=True))
    assert track.forwarding.is_set()
    await within(sub.cancel())
    await within(track.unsubscribed.wait())
    assert not track.forwarding.is_set()


def _spy_updates(s: MoqtSession) -> asyncio.Queue[ev.UpdateReceived]:
    """REQUEST_UPDATEs the peer sends on ``s``'s requests, once pubsub has answered them."""
    q: asyncio.Queue[ev.UpdateReceived] = asyncio.Queue()
    orig = s.dispatch

    def spy(e: ev.Event) -> None:
        orig(e)
        if isinstance(e, ev.UpdateReceived):
            q.put_nowait(e)

    s.dispatch = spy  # type: ignore[method-assign]
    return q


async def test_pause_right_behind_publish_ok_is_applied(monkeypatch: pytest.MonkeyPatch) -> None:
    """The peer answers our PUBLISH (FORWARD=1) with REQUEST_OK and, in the same flight,
    REQUEST_UPDATE FORWARD=0 (§"Publisher Interactions": a relay MAY pause it until it has
    subscribers). Both are dispatched before ``publish()`` resumes; the pause must find the
    subscription, so nothing is sent until the peer raises FORWARD again."""

    def pausing(self: MoqtSession, rid: int, msg: Message) -> None:
        assert isinstance(msg, Publish) and self.moqt is not None
        sub = Subscription(self, rid)
        self._streams[rid] = sub
        self.moqt.request_ok(rid)
        self.moqt.request_update(rid, MessageParameters(forward=False))  # same pump
        self.incoming_publishes.put_nowait(
            IncomingPublish(msg.track_namespace, msg.track_name, msg.track_alias, sub))

    monkeypatch.setattr(MoqtSession, "_accept_publish", pausing)
    sessions: asyncio.Queue[MoqtSession] = asyncio.Queue()
    server = await serve("127.0.0.1", 0, server_config(), accept_publish=True,
                         on_session=sessions.put_nowait)
    catalog = Catalog()
    track = catalog.create(NS, "parked")
    pub = await within(connect(f"moqt://127.0.0.1:{server.port}/moq", client_config(),
                               catalog=catalog))
    try:
        updates = _spy_updates(pub)
        peer = await within(sessions.get())
        rid = await within(pub.publish(track))
        upd = await within(updates.get())
        assert upd.request_id == rid and upd.message.parameters.forward is False
        out = track.outgoing(pub, rid)
        assert out is not None and out.forward is False
        assert not track.forwarding.is_set()
        incoming = await within(peer.incoming_publishes.get())
        await within(track.write_object(0, 0, b"while paused"))  # Forward State 0: not sent
        await within(incoming.subscription.update(forward=True))
        await within(track.forwarding.wait())
        await within(track.write_object(0, 1, b"forwarded"))
        got = await within(incoming.subscription.__anext__())
        assert (got.group_id, got.object_id, bytes(got.payload)) == (0, 1, b"forwarded")
    finally:
        await within(pub.close())
        server.close()
        await within(server.wait_closed())
