"""What a peer may make a pubsub session hold (kvsp_moq/pubsub/limits.py), over loopback
QUIC: the peer's PUBLISH_NAMESPACEs beyond max_peer_namespaces and PUBLISHes beyond
max_incoming_publishes unread get REQUEST_ERROR EXCESSIVE_LOAD (draft-ietf-moq-transport-22
§"REQUEST_ERROR Codes"); a withdrawn namespace leaves peer_namespaces; NAMESPACEs beyond
max_namespace_updates unread cancel the SUBSCRIBE_NAMESPACE with an ("overflow", prefix)
update; SUBSCRIBE_NAMESPACE over a large catalog is answered whole, in pages."""

from __future__ import annotations

import asyncio

import pytest

from hostile_support import CERT, client_config, within
from kvsp_moq.moqt.errors import RequestErrorCode
from kvsp_moq.pubsub import Catalog, MoqtError, MoqtSession, ReceiveLimits, connect, serve
from kvsp_moq.pubsub.catalog_server import NAMESPACE_PAGE
from kvsp_moq.transport import TransportConfig


def server_config() -> TransportConfig:
    return TransportConfig(certificate_pem=CERT.cert_pem, private_key_pem=CERT.key_pem)


async def started(limits: ReceiveLimits = ReceiveLimits(), catalog: Catalog | None = None,
                  accept_publish: bool = False):
    sessions: asyncio.Queue[MoqtSession] = asyncio.Queue()
    server = await serve("127.0.0.1", 0, server_config(), catalog=catalog,
                         receive_limits=limits, accept_publish=accept_publish,
                         on_session=sessions.put_nowait)
    return server, f"moqt://127.0.0.1:{server.port}/moq", sessions


async def stopped(server, *sessions: MoqtSession) -> None:
    for s in (*sessions, *server.sessions):
        await within(s.close())
    server.close()
    await within(server.wait_closed())


async def test_publish_namespace_flood_is_refused_past_the_bound_and_pruned_on_withdrawal() -> None:
    limits = ReceiveLimits(max_peer_namespaces=20)
    server, url, sessions = await started(limits)
    client = await within(connect(url, client_config()))
    try:
        peer = await within(sessions.get())
        results = await within(asyncio.gather(
            *(client.publish_namespace(("flood", str(i))) for i in range(30)),
            return_exceptions=True))
        refused = [r for r in results if isinstance(r, MoqtError)]
        assert len(refused) == 10 and {r.code for r in refused} == {RequestErrorCode.EXCESSIVE_LOAD}
        assert len(peer.peer_namespaces) == 20
        accepted = [i for i, r in enumerate(results) if not isinstance(r, BaseException)]
        for _ in accepted:
            kind, _ns = await within(peer.namespace_updates.get())
            assert kind == "publish_namespace"
        # Withdrawal (cancellation of the request) prunes peer_namespaces.
        for i in accepted[:5]:
            assert client.withdraw_namespace(("flood", str(i)))
        for _ in range(5):
            kind, ns = await within(peer.namespace_updates.get())
            assert kind == "publish_namespace_done" and ns[0] == b"flood"
        assert len(peer.peer_namespaces) == 15
        assert (b"flood", str(accepted[0]).encode()) not in peer.peer_namespaces
        await within(client.publish_namespace(("again",)))  # room again
        assert (b"again",) in peer.peer_namespaces
    finally:
        await stopped(server, client)


async def test_incoming_publishes_unread_past_the_bound_are_refused() -> None:
    limits = ReceiveLimits(max_incoming_publishes=3)
    server, url, sessions = await started(limits, accept_publish=True)
    client = await within(connect(url, client_config()))
    try:
        peer = await within(sessions.get())
        tracks = [client.create_track(("p",), f"t{i}") for i in range(5)]
        for track in tracks[:3]:
            await within(client.publish(track))
        with pytest.raises(MoqtError) as err:
            await within(client.publish(tracks[3]))
        assert err.value.code == RequestErrorCode.EXCESSIVE_LOAD
        first = await within(peer.incoming_publishes.get())  # the application reads one
        assert first.name == b"t0"
        await within(client.publish(tracks[4]))  # accepted again
        assert peer.incoming_publishes.qsize() == 3
    finally:
        await stopped(server, client)


async def test_namespace_updates_unread_past_the_bound_cancel_the_subscription() -> None:
    catalog = Catalog()
    for i in range(500):
        catalog.create(("cat", f"n{i:04}"), "t")
    server, url, _sessions = await started(catalog=catalog)
    client = await within(connect(url, client_config(),
                                  receive_limits=ReceiveLimits(max_namespace_updates=100)))
    try:
        await within(client.subscribe_namespace(("cat",)))
        got = [await within(client.namespace_updates.get()) for _ in range(101)]
        assert all(kind == "namespace" for kind, _ in got[:100])
        assert got[100] == ("overflow", (b"cat",))
        assert got[0] == ("namespace", (b"n0000",))
        assert client.namespace_updates.empty()  # nothing after the overflow marker
        # The session is fine; a client with the default bound gets every namespace.
        other = await within(connect(url, client_config()))
        try:
            await within(other.subscribe_namespace(("cat",)))
            seen = [await within(other.namespace_updates.get()) for _ in range(500)]
            assert seen == [("namespace", (f"n{i:04}".encode(),)) for i in range(500)]
        finally:
            await within(other.close())
        await within(client.track_status(("cat", "n0001"), "t"))
    finally:
        await stopped(server, client)


async def test_subscribe_namespace_answered_in_pages_in_order() -> None:
    """More namespaces than a page, under a prefix among others: all of them, in order, and
    only those."""
    catalog = Catalog()
    count = NAMESPACE_PAGE * 5 + 3
    for i in range(count):
        catalog.create(("a", f"{i:05}"), "t")
    catalog.create(("b", "x"), "t")
    catalog.create(("a",), "t")  # the prefix itself: an empty suffix
    server, url, _sessions = await started(catalog=catalog)
    client = await within(connect(url, client_config()))
    try:
        await within(client.subscribe_namespace(("a",)))
        got = [await within(client.namespace_updates.get()) for _ in range(count + 1)]
        assert got == [("namespace", ())] + [("namespace", (f"{i:05}".encode(),))
                                             for i in range(count)]
        assert client.namespace_updates.empty()
    finally:
        await stopped(server, client)
