"""A SUBSCRIBE_NAMESPACE a pubsub publisher answers stays live (draft-22 §"SUBSCRIBE_NAMESPACE":
"When there are changes to the namespaces being published and the subscriber is subscribed
to them, the publisher sends the corresponding NAMESPACE or NAMESPACE_DONE messages"; "The
publisher MUST NOT send NAMESPACE_DONE for a namespace suffix before the corresponding
NAMESPACE"): kvsp_moq/pubsub/catalog_server.py ``Listing``, over loopback QUIC.

Before, only the namespaces present when the request came were listed: a relay that had
solicited a holder (relay/subscribe/solicit.py) kept routing an evicted replica's namespace
(tests/test_bridge_streaming.py::test_eviction_withdraws_the_namespace_at_the_relay failed
whenever the solicitation reached the holder after its PUBLISH_NAMESPACE)."""

from __future__ import annotations

import asyncio
import dataclasses
import threading

from hostile_support import GUARD, client_config, within
from kvsp_moq.pubsub import Catalog, MoqtSession, connect
from kvsp_moq.pubsub.catalog_server import NAMESPACE_LIVE_BUFFER, NAMESPACE_PAGE, Listing
from kvsp_moq.moqt.messages import SubscribeNamespace

from test_pubsub_limits import started, stopped


async def test_namespaces_that_come_and_go_after_the_listing_are_told() -> None:
    catalog = Catalog()
    catalog.create(("p", "a"), "t")
    server, url, _ = await started(catalog=catalog)
    client = await within(connect(url, client_config()))
    try:
        await within(client.subscribe_namespace(("p",)))
        assert await within(client.namespace_updates.get()) == ("namespace", (b"a",))
        catalog.create(("p", "b"), "t1")
        assert await within(client.namespace_updates.get()) == ("namespace", (b"b",))
        catalog.create(("p", "b"), "t2")  # not a new namespace
        catalog.create(("q", "x"), "t")  # not under the prefix
        catalog.remove(("p", "b"), b"t1")  # b still has a track
        catalog.remove(("q", "x"), b"t")
        catalog.remove(("p", "a"), b"t")  # a's last track: NAMESPACE_DONE, the next update
        assert await within(client.namespace_updates.get()) == ("namespace_done", (b"a",))
        catalog.remove(("p", "b"), b"t2")
        assert await within(client.namespace_updates.get()) == ("namespace_done", (b"b",))
        catalog.create(("p", "a"), "again")
        assert await within(client.namespace_updates.get()) == ("namespace", (b"a",))
        assert client.namespace_updates.empty()
    finally:
        await stopped(server, client)


async def _converge(client: MoqtSession, expected: set[bytes]) -> None:
    """Read updates until the client's view is ``expected``, checking the draft's rules on
    the way: no NAMESPACE_DONE before its NAMESPACE, no second NAMESPACE while present."""
    view: set[bytes] = set()
    while view != expected:
        kind, suffix = await within(client.namespace_updates.get())
        (name,) = suffix
        if kind == "namespace":
            assert name not in view, f"NAMESPACE {name!r} twice"
            view.add(name)
        else:
            assert kind == "namespace_done" and name in view, f"{kind} {name!r} before NAMESPACE"
            view.discard(name)


async def test_changes_while_the_listing_is_paged_converge_and_keep_the_order() -> None:
    """Namespaces removed, added and re-added while the first listing is still being
    written in pages, wherever the pages are: the subscriber ends with exactly the catalog's
    namespaces, and no NAMESPACE_DONE ever precedes its NAMESPACE."""
    catalog = Catalog()
    count = NAMESPACE_PAGE * 6
    # ~1 KiB each: a page fills the 64 KiB the pager lets wait in the stream's send buffer,
    # so the next pages wait for acknowledgements while the catalog changes.
    names = [f"{i:05}" + "-" * 1000 for i in range(count)]
    for n in names:
        catalog.create(("p", n), "t")
    server, url, _ = await started(catalog=catalog)
    client = await within(connect(url, client_config()))
    try:
        await within(client.subscribe_namespace(("p",)))
        for n in names[::7]:  # early, middle and late pages
            catalog.remove(("p", n), b"t")
        for n in (names[14], names[-7]):  # removed above: back again
            catalog.create(("p", n), "t")
        for i in range(5):
            catalog.create(("p", f"new{i}"), "t")
        catalog.remove(("p", "new0"), b"t")
        expected = {ns[1] for ns in catalog.namespaces()}
        await _converge(client, expected)
        catalog.remove(("p", names[1]), b"t")  # the listing is over: plain updates now
        assert await within(client.namespace_updates.get()) == ("namespace_done",
                                                                (names[1].encode(),))
    finally:
        await stopped(server, client)


def test_a_listing_tells_what_its_pages_passed_and_what_went_live() -> None:
    listing = Listing(SubscribeNamespace(request_id=0, track_namespace_prefix=(b"p",)))
    assert not listing.told((b"p", b"a"))
    listing.cursor = (b"p", b"m")
    assert listing.told((b"p", b"a")) and listing.told((b"p", b"m"))
    assert not listing.told((b"p", b"z"))
    listing.live.add((b"p", b"z"))
    assert listing.told((b"p", b"z"))
    listing.paged = True
    assert listing.told((b"p", b"zz"))


async def test_a_subscriber_that_stops_reading_has_its_request_reset_not_buffered() -> None:
    """Changes told to a peer whose loop stopped (4 KiB windows: nothing more is taken in)
    pile up in the request stream's send buffer only up to NAMESPACE_LIVE_BUFFER; the next
    change resets the request (draft-22 §"SUBSCRIBE_NAMESPACE": the publisher "MAY reset the
    SUBSCRIBE_NAMESPACE response stream")."""
    catalog = Catalog()
    server, url, sessions = await started(catalog=catalog)
    stalled, release = threading.Event(), threading.Event()

    def stalled_client() -> None:
        async def main() -> None:
            config = dataclasses.replace(client_config(), max_stream_data=4096,
                                         max_data=64 << 10)
            c = await connect(url, config)
            await c.subscribe_namespace(("p",))
            stalled.set()
            release.wait(GUARD)  # the whole loop stops: no reads, no credit
            await c.close()
        asyncio.run(main())

    thread = threading.Thread(target=stalled_client, daemon=True)
    thread.start()
    try:
        assert await within(asyncio.to_thread(stalled.wait, GUARD))
        session = await within(sessions.get())
        assert session.moqt is not None
        (req,) = [r for r in session.moqt.requests.values()
                  if isinstance(r.message, SubscribeNamespace)]
        largest = 0
        for i in range(NAMESPACE_LIVE_BUFFER // 1000 + NAMESPACE_PAGE):  # ~1 KiB each
            catalog.create(("p", f"{i:05}" + "-" * 1000), "t")
            if req.request_id not in session.moqt.requests:
                break
            largest = max(largest, session.connection.stream_send_buffered(req.stream_id))
        assert req.request_id not in session.moqt.requests  # reset
        assert largest <= NAMESPACE_LIVE_BUFFER + 2048  # one message past the bound at most
    finally:
        release.set()
        await within(asyncio.to_thread(thread.join, GUARD))
        await stopped(server)
