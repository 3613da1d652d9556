"""Subscription filters over real QUIC: a publisher sends only the objects inside the
requested range (draft-20 §"Location Filter": "A publisher MUST NOT send subscription-delivered
objects from outside the requested range") and ends a bounded subscription with PUBLISH_DONE."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from kvsp_moq.moqt.errors import PublishDoneCode
from kvsp_moq.moqt.messages import LocationFilter, MessageParameters
from kvsp_moq.moqt.version import Version
from kvsp_moq.pubsub import Catalog, MoqtError, MoqtSession, TrackPublisher, connect, serve
from kvsp_moq.pubsub.window import Window, subscription_window
from kvsp_moq.transport import TransportConfig
from kvsp_moq.transport.tls import make_self_signed

NS = ("kvsp-1", "filters")


@pytest.fixture(params=[Version.DRAFT_22, Version.DRAFT_20, Version.DRAFT_18], ids=lambda v: v.alpn)
async def pair(request: pytest.FixtureRequest) -> AsyncIterator[tuple[TrackPublisher, MoqtSession]]:
    cert = make_self_signed()
    catalog = Catalog()
    track = catalog.add(TrackPublisher(NS, "t"))
    server = await serve("127.0.0.1", 0, TransportConfig(certificate_pem=cert.cert_pem,
                                                         private_key_pem=cert.key_pem), catalog=catalog)
    client = await connect(f"moqt://127.0.0.1:{server.port}/",
                           TransportConfig(insecure=True, alpn_protocols=[request.param.alpn]))
    try:
        yield track, client
    finally:
        await client.close()
        server.close()
        await server.wait_closed()


async def _write(track: TrackPublisher, locations: list[tuple[int, int]]) -> None:
    for g, o in locations:
        await track.write_object(g, o, f"{g}/{o}".encode())


async def test_absolute_range_delivers_only_the_range_then_ends(pair: tuple[TrackPublisher, MoqtSession]) -> None:
    track, client = pair
    await _write(track, [(0, 0), (0, 1)])  # before the subscription: never subscription-delivered
    # Draft 18's AbsoluteRange ends with a whole group; 20+ can end at an object.
    end_object = None if client.version == Version.DRAFT_18 else 0
    sub = await client.subscribe(NS, "t", parameters=MessageParameters(
        location_filter=LocationFilter.absolute((1, 1), end_group=2, end_object=end_object)))
    await _write(track, [(1, 0), (1, 1), (1, 2), (2, 0), (2, 1), (3, 0)])
    got = [(o.group_id, o.object_id, bytes(o.payload)) async for o in sub]
    expected = [(1, 1, b"1/1"), (1, 2, b"1/2"), (2, 0, b"2/0")]
    assert got == (expected if end_object == 0 else expected + [(2, 1, b"2/1")])
    assert sub.done


async def test_next_object_skips_nothing_new(pair: tuple[TrackPublisher, MoqtSession]) -> None:
    track, client = pair
    await _write(track, [(0, 0), (0, 1)])
    sub = await client.subscribe(NS, "t", parameters=MessageParameters(
        location_filter=LocationFilter.next_object()))
    await _write(track, [(0, 2), (1, 0)])
    await track.finish()
    assert [(o.group_id, o.object_id) async for o in sub] == [(0, 2), (1, 0)]


async def test_end_before_start_is_invalid_range(pair: tuple[TrackPublisher, MoqtSession]) -> None:
    track, client = pair
    if client.version == Version.DRAFT_18:
        pytest.skip("draft 18 ranges end with a whole group (End Group >= Start Group): never empty")
    with pytest.raises(MoqtError) as exc:
        await client.subscribe(NS, "t", parameters=MessageParameters(
            location_filter=LocationFilter.absolute((5, 3), end_group=5, end_object=1)))
    assert exc.value.code == 0x11


@pytest.mark.parametrize(("filt", "largest", "window"), [
    (None, (4, 2), Window()),
    (LocationFilter.none(), None, Window()),
    (LocationFilter.next_object(), (4, 2), Window((4, 3))),
    (LocationFilter.next_object(), None, Window((0, 0))),
    (LocationFilter.relative_start(0), (4, 2), Window((5, 0))),
    (LocationFilter.relative_start(1), (4, 2), Window((4, 0))),
    (LocationFilter.relative_start(9), (4, 2), Window((0, 0))),
    (LocationFilter.absolute((2, 5)), (4, 2), Window((2, 5))),
    (LocationFilter.absolute((2, 5), end_group=3), None, Window((2, 5), 3, None)),
])
def test_windows_follow_the_draft(filt: LocationFilter | None, largest: tuple[int, int] | None,
                                  window: Window) -> None:
    assert subscription_window(filt, largest) == window


def test_window_membership() -> None:
    w = Window((1, 1), 2, 0)
    assert [w.admits(*loc) for loc in [(1, 0), (1, 1), (1, 9), (2, 0), (2, 1), (3, 0)]] == \
           [False, True, True, True, False, False]
    assert [w.passed(*loc) for loc in [(1, 0), (2, 0), (2, 1), (3, 0)]] == [False, False, True, True]
    assert Window((5, 3), 5, 1).empty and not Window((5, 3), 5, None).empty
    assert PublishDoneCode.SUBSCRIPTION_ENDED == 0x3


async def test_unencodable_properties_fail_at_write_time(pair: tuple[TrackPublisher, MoqtSession]) -> None:
    track, client = pair
    with pytest.raises(TypeError):
        await track.write_object(0, 0, b"x", properties=[(0x3800, b"bytes on an even type")])
    await track.write_object(0, 1, b"y", properties=[(0x3801, b"bytes on an odd type")])
    got = await (await client.fetch(NS, "t", start=(0, 0))).collect()
    assert [(o.object_id, bytes(o.payload)) for o in got] == [(1, b"y")]


async def test_fetch_in_descending_group_order(pair: tuple[TrackPublisher, MoqtSession]) -> None:
    from kvsp_moq.moqt.objects import GroupOrder

    track, client = pair
    await _write(track, [(0, 0), (0, 1), (1, 0), (2, 0), (2, 1)])
    down = await (await client.fetch(NS, "t", start=(0, 1), end=(2, 0),
                                     group_order=GroupOrder.DESCENDING)).collect()
    assert [(o.group_id, o.object_id, bytes(o.payload)) for o in down] == \
           [(2, 0, b"2/0"), (1, 0, b"1/0"), (0, 1, b"0/1")]
    up = await (await client.fetch(NS, "t", group_order=GroupOrder.ASCENDING)).collect()
    assert [(o.group_id, o.object_id) for o in up] == [(0, 0), (0, 1), (1, 0), (2, 0), (2, 1)]
