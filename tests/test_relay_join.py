"""Joining a live track through the relay with its recent past, over real QUIC on 127.0.0.1:
the draft-18 Joining FETCH (Relative 0x2 / Absolute 0x3) and the draft-20+ fill fetch stream
of a SUBSCRIBE with FILL_PARAMETERS (relay/fetch/fill.py). No sleeps: every wait is on something
the protocol completes; ``within`` only turns a hang into a failure.
"""

from __future__ import annotations

import pytest

from interop.client_support import joining_fetch
from kvsp_moq.moqt.errors import PublishDoneCode, RequestErrorCode
from kvsp_moq.moqt.messages import LocationFilter, MessageParameters
from kvsp_moq.moqt.messages.fetch import FetchType, JoiningFetch
from kvsp_moq.pubsub import MoqtError, MoqtSession, connect
from kvsp_moq.pubsub.receive import FetchStream
from relay.fetch.service import WHOLE_GROUP
from relay.fetch.fill import fill_range, joining_range
from test_relay import (  # noqa: F401  (net is a fixture)
    NS,
    Net,
    client_config,
    count_fetches,
    net,
    payload,
    within,
)


async def draft_client(net: Net, relay, draft: int) -> MoqtSession:
    s = await within(connect(relay.url, client_config(alpn_protocols=[f"moqt-{draft}"])))
    net.sessions.append(s)
    return s


def expected(g: int, o: int) -> tuple[bytes, list, int]:
    # one priority per group: a subgroup stream carries one priority for all its objects
    return payload(g, o, 1200 + 100 * o), [(0x3805, b"j%d.%d" % (g, o))], 20 + g


async def live_track(net: Net, draft: int, name: str, groups: int = 3):
    """A track whose ``groups`` groups of 5 objects went through the relay to a first
    subscriber (so the relay's Largest Object is {groups-1, 4})."""
    relay = await net.relay()
    pub, catalog = await net.publisher(relay)
    track = catalog.create(NS, name)
    first = await within((await draft_client(net, relay, draft)).subscribe(NS, name))
    await within(track.subscribed.wait())
    for g in range(groups):
        for o in range(5):
            data, props, prio = expected(g, o)
            await within(track.write_object(g, o, data, properties=props, priority=prio))
    seen = 0
    async for _obj in first:
        seen += 1
        if seen == 5 * groups:
            break
    return relay, track


def as_map(objs) -> dict:
    return {(o.group_id, o.object_id): (bytes(o.payload), [tuple(p) for p in o.properties],
                                        o.publisher_priority) for o in objs}


def want(groups) -> dict:
    return {(g, o): expected(g, o) for g in groups for o in range(5)}


async def raw_joining_fetch(s: MoqtSession, fetch_type: FetchType, joining_rid: int,
                            start: int) -> FetchStream:
    _, _, stream = await s._request(
        lambda m: m._request(lambda r: JoiningFetch(r, fetch_type, joining_rid, start,
                                                    MessageParameters())),
        lambda rid: FetchStream(s, rid))
    return stream


# -- draft 18: Joining FETCH ------------------------------------------------------------------
async def test_relative_joining_fetch_exact_then_cached(net: Net) -> None:
    relay, track = await live_track(net, 18, "rj")
    calls = count_fetches(track)
    s = await draft_client(net, relay, 18)
    sub = await within(s.subscribe(NS, "rj"))
    stream = await within(joining_fetch(s, sub, 1))
    objs = await within(stream.collect())
    # §"Joining Fetch Range Calculation": {2 - 1, 0} .. the Joining Location {2, 4}
    assert as_map(objs) == want([1, 2])
    assert stream.end_location == (2, 4)
    # The relay held groups 1 and 2 from the first subscription: only what lies between
    # {1, 4} and {2, 0} (unknown: no End of Group was seen) went upstream, found empty.
    assert calls[0] == 1 and relay.stats.upstream_fetches == 1 and relay.stats.cache_hits == 1
    # a second joiner: the same range is now known whole in the cache
    s2 = await draft_client(net, relay, 18)
    sub2 = await within(s2.subscribe(NS, "rj"))
    objs2 = await within((await within(joining_fetch(s2, sub2, 1))).collect())
    assert as_map(objs2) == want([1, 2])
    assert calls[0] == 1 and relay.stats.upstream_fetches == 1 and relay.stats.cache_hits == 2
    # the subscriptions themselves go on with the live objects
    data, props, prio = expected(3, 0)
    await within(track.write_object(3, 0, data, properties=props, priority=prio))
    got = await within(sub.__anext__())
    assert (got.group_id, got.object_id, bytes(got.payload)) == (3, 0, data)


async def test_relative_joining_start_clamped_at_group_zero(net: Net) -> None:
    relay, _track = await live_track(net, 18, "clamp", groups=2)
    s = await draft_client(net, relay, 18)
    sub = await within(s.subscribe(NS, "clamp"))
    objs = await within((await within(joining_fetch(s, sub, 9))).collect())
    assert as_map(objs) == want([0, 1])


async def test_absolute_joining_fetch_and_errors(net: Net) -> None:
    relay, _track = await live_track(net, 18, "abs")
    s = await draft_client(net, relay, 18)
    sub = await within(s.subscribe(NS, "abs"))
    stream = await within(raw_joining_fetch(s, FetchType.ABSOLUTE_JOINING, sub.request_id, 2))
    assert as_map(await within(stream.collect())) == want([2])
    with pytest.raises(MoqtError) as e:  # start past the Joining Location
        await within(raw_joining_fetch(s, FetchType.ABSOLUTE_JOINING, sub.request_id, 3))
    assert e.value.code == RequestErrorCode.INVALID_RANGE
    with pytest.raises(MoqtError) as e:  # not a subscription of this session
        await within(raw_joining_fetch(s, FetchType.RELATIVE_JOINING, sub.request_id + 40, 1))
    assert e.value.code == RequestErrorCode.INVALID_JOINING_REQUEST_ID


async def test_joining_fetch_before_any_object_is_invalid_range(net: Net) -> None:
    relay = await net.relay()
    _pub, catalog = await net.publisher(relay)
    catalog.create(NS, "empty")
    s = await draft_client(net, relay, 18)
    sub = await within(s.subscribe(NS, "empty"))
    with pytest.raises(MoqtError) as e:
        await within(joining_fetch(s, sub, 1))
    assert e.value.code == RequestErrorCode.INVALID_RANGE


# -- drafts 20+: FILL_PARAMETERS --------------------------------------------------------------
def fill(flt: LocationFilter | None) -> MessageParameters:
    return MessageParameters(fill_parameters=MessageParameters(location_filter=flt))


@pytest.mark.parametrize("draft", [22, 20])
async def test_fill_current_group_then_live_stream_count(net: Net, draft: int) -> None:
    relay, track = await live_track(net, draft, "fill")
    s = await draft_client(net, relay, draft)
    # §"Joining a Track": Next Object + FILL_PARAMETERS StartGroup=1 = the current group
    sub = await within(s.subscribe(NS, "fill", parameters=MessageParameters(
        location_filter=LocationFilter.next_object(),
        fill_parameters=MessageParameters(location_filter=LocationFilter.relative_start(1)))))
    for o in range(5):
        data, props, prio = expected(3, o)
        await within(track.write_object(3, o, data, properties=props, priority=prio))
    await within(track.finish())
    objs = [o async for o in sub]
    assert as_map(objs) == want([2, 3])  # group 2 by the fill, group 3 live
    done = sub.publish_done
    assert done is not None and done.status_code == PublishDoneCode.TRACK_ENDED
    # the fill fetch stream is counted: 1 fill + 1 subgroup stream
    assert done.stream_count == sub.stats.data_streams == 2
    # Group 2 came through the first subscriber's SUBSCRIBE: the fill is the relay's own.
    assert relay.stats.upstream_fetches == 0


async def test_fill_absolute_range_from_cache_second_time(net: Net) -> None:
    relay, track = await live_track(net, 22, "fabs")
    calls = count_fetches(track)
    flt = LocationFilter.absolute((0, 2), 1, 3)  # {0,2} .. {1,3}
    subs = []
    for _ in range(2):
        s = await draft_client(net, relay, 22)
        subs.append(await within(s.subscribe(NS, "fabs", parameters=fill(flt))))
    await within(track.finish())
    for sub in subs:
        objs = [o async for o in sub]
        assert as_map(objs) == {k: v for k, v in want([0, 1]).items() if (0, 2) <= k <= (1, 3)}
        assert sub.publish_done.stream_count == sub.stats.data_streams == 1
    # Held from the first subscription but for what lies after {0, 4} in group 0 (no End of
    # Group seen): that gap alone went upstream, once; then the range is known whole.
    assert calls[0] == 1 and relay.stats.upstream_fetches == 1 and relay.stats.cache_hits == 2


async def test_fill_empty_range_opens_no_stream(net: Net) -> None:
    relay, track = await live_track(net, 22, "fnone")
    s = await draft_client(net, relay, 22)
    # StartGroup=0: the next group, past the Largest Object → an empty fill range
    sub = await within(s.subscribe(NS, "fnone", parameters=fill(LocationFilter.relative_start(0))))
    await within(track.finish())
    assert [o async for o in sub] == []
    assert sub.publish_done.stream_count == sub.stats.data_streams == 0
    assert relay.stats.upstream_fetches == 0


# -- range arithmetic -------------------------------------------------------------------------
def test_joining_range() -> None:
    rel = JoiningFetch(1, FetchType.RELATIVE_JOINING, 0, 1)
    assert joining_range(rel, (2, 4)) == ((1, 0), (2, 4))
    assert joining_range(JoiningFetch(1, FetchType.RELATIVE_JOINING, 0, 0), (2, 4)) == \
        ((2, 0), (2, 4))
    assert joining_range(JoiningFetch(1, FetchType.RELATIVE_JOINING, 0, 7), (2, 4)) == \
        ((0, 0), (2, 4))
    assert joining_range(JoiningFetch(1, FetchType.ABSOLUTE_JOINING, 0, 2), (2, 4)) == \
        ((2, 0), (2, 4))
    assert joining_range(JoiningFetch(1, FetchType.ABSOLUTE_JOINING, 0, 3), (2, 4)) is None


def test_fill_range() -> None:
    L = (5, 3)
    assert fill_range(None, L) == ((0, 0), L)
    assert fill_range(LocationFilter.none(), L) == ((0, 0), L)
    assert fill_range(LocationFilter.relative_start(1), L) == ((5, 0), L)
    assert fill_range(LocationFilter.relative_start(3), L) == ((3, 0), L)
    assert fill_range(LocationFilter.relative_start(0), L) is None
    assert fill_range(LocationFilter.next_object(), L) is None
    assert fill_range(LocationFilter.absolute((2, 1)), L) == ((2, 1), L)
    assert fill_range(LocationFilter.absolute((2, 1), 3), L) == ((2, 1), (3, WHOLE_GROUP))
    assert fill_range(LocationFilter.absolute((2, 1), 9, 2), L) == ((2, 1), L)
    assert fill_range(LocationFilter.absolute((6, 0)), L) is None
    assert fill_range(LocationFilter.relative_start(1), None) is None
