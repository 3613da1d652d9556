"""Hypothesis strategies for the MOQT control messages of each version (shared by the
message tests). Every strategy draws only what the version can express and the message may
carry, so ``decode(encode(m)) == m`` must hold for every draw."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

from kvsp_moq.moqt.messages import (
    PARAMETER_SPECS,
    Fetch,
    FetchOk,
    FetchType,
    GoAway,
    JoiningFetch,
    Location,
    LocationFilter,
    LocationFilterType,
    Message,
    MessageParameters,
    Namespace,
    NamespaceDone,
    ParamContext,
    Publish,
    PublishDone,
    PublishNamespace,
    PublishSkipped,
    PublishStateNotify,
    Range,
    RangeFilter,
    Redirect,
    RequestError,
    RequestOk,
    RequestUpdate,
    Setup,
    StandaloneFetch,
    Subscribe,
    SubscribeNamespace,
    SubscribeOk,
    SubscribeTracks,
    Token,
    TrackStatus,
    allowed_parameter_types,
    known_setup_options,
)
from kvsp_moq.moqt.objects import GroupOrder
from kvsp_moq.moqt.version import Version
from kvsp_moq.wire import KeyValuePair

VI64_MAX = (1 << 64) - 1

# Small values mostly (1-3 byte vi64s), edges sometimes.
vi64 = st.one_of(
    st.integers(0, 300),
    st.integers(0, VI64_MAX),
    st.sampled_from([127, 128, 16383, 16384, (1 << 49) - 1, 1 << 49, VI64_MAX]),
)
uint8 = st.integers(0, 255)
field = st.binary(min_size=1, max_size=6)
namespace = st.lists(field, min_size=0, max_size=4).map(tuple)
name = st.binary(max_size=8)
text = st.text(max_size=12)
location = st.builds(Location, vi64, vi64)


def _kvps(draw: Any) -> tuple[KeyValuePair, ...]:
    types = sorted(draw(st.lists(st.integers(0, 0x4000), max_size=4)))
    return tuple(
        KeyValuePair(t, draw(st.binary(max_size=6)) if t & 1 else draw(vi64)) for t in types
    )


track_properties = st.composite(lambda draw: _kvps(draw))()

token = st.one_of(
    st.builds(Token.use_value, vi64, st.binary(max_size=8)),
    st.builds(Token.register, vi64, vi64, st.binary(max_size=8)),
    st.builds(Token.use_alias, vi64),
    st.builds(Token.delete, vi64),
)
setup_token = st.one_of(
    st.builds(Token.use_value, vi64, st.binary(max_size=8)),
    st.builds(Token.register, vi64, vi64, st.binary(max_size=8)),
)


@st.composite
def location_filter(draw: Any, version: Version) -> LocationFilter:
    wire = version.wire_version
    if wire is Version.DRAFT_18:
        kind = draw(st.sampled_from([0, 1, 2, 3]))
        if kind == 0:
            return LocationFilter.relative_start(0)
        if kind == 1:
            return LocationFilter.next_object()
        start = draw(location)
        if kind == 2:
            return LocationFilter.absolute(start)
        end_group = start.group + draw(st.integers(0, VI64_MAX - start.group))
        return LocationFilter.absolute(start, end_group)
    t = draw(st.sampled_from(list(LocationFilterType)))
    if t in (LocationFilterType.NONE, LocationFilterType.NEXT_OBJECT):
        return LocationFilter(t)
    if t is LocationFilterType.RELATIVE_START_GROUP:
        return LocationFilter.relative_start(draw(vi64))
    start = draw(location)
    if t is LocationFilterType.ABSOLUTE_START:
        if wire is Version.DRAFT_20 and start == (0, 0):
            start = Location(0, 1)  # {0,0} is not expressible in 20/21
        return LocationFilter.absolute(start)
    end_group = start.group + draw(st.integers(0, VI64_MAX - start.group))
    if t is LocationFilterType.ABSOLUTE_RANGE:
        return LocationFilter.absolute(start, end_group)
    return LocationFilter.absolute(start, end_group, draw(vi64))


@st.composite
def range_filter(draw: Any, has_property_type: bool) -> RangeFilter:
    if draw(st.integers(0, 9)) == 0:
        return RangeFilter()
    ranges = []
    prev = 0
    n = draw(st.integers(0, 3))
    for i in range(n):
        start = prev + draw(st.integers(0, 1000))
        end = None if i == n - 1 and draw(st.booleans()) else start + draw(st.integers(0, 1000))
        ranges.append(Range(start, end))
        prev = end if end is not None else start
    prop = draw(st.one_of(st.none(), vi64) if not ranges else vi64) if has_property_type else None
    return RangeFilter(draw(uint8), prop, tuple(ranges))


def _value(spec_field: str, version: Version) -> st.SearchStrategy[Any]:
    simple: dict[str, st.SearchStrategy[Any]] = {
        "object_delivery_timeout": vi64,
        "rendezvous_timeout": vi64,
        "subgroup_delivery_timeout": vi64,
        "expires": vi64,
        "largest_object": location,
        "fill_timeout": vi64,
        "forward": st.booleans(),
        "subscriber_priority": uint8,
        "location_filter": location_filter(version),
        "group_order": st.sampled_from(list(GroupOrder)),
        "fill_parameters": parameters(version, ParamContext.FILL_PARAMETERS),
        "new_group_request": vi64,
        "track_namespace_prefix": namespace,
        "include_properties": st.booleans(),
        "authorization_tokens": st.lists(token, max_size=2).map(tuple),
        "subgroup_filters": st.lists(range_filter(False), max_size=2).map(tuple),
        "objectid_filters": st.lists(range_filter(False), max_size=2).map(tuple),
        "priority_filters": st.lists(range_filter(False), max_size=2).map(tuple),
        "object_property_filters": st.lists(range_filter(True), max_size=2).map(tuple),
        "track_property_filters": st.lists(range_filter(True), max_size=2).map(tuple),
    }
    return simple[spec_field]


@st.composite
def parameters(draw: Any, version: Version, context: ParamContext) -> MessageParameters:
    allowed = allowed_parameter_types(version, context)
    chosen = {}
    for spec in PARAMETER_SPECS:
        if spec.type in allowed and draw(st.integers(0, 3)) == 0:
            chosen[spec.field] = draw(_value(spec.field, version))
    return MessageParameters(**chosen)


@st.composite
def setup(draw: Any, version: Version) -> Setup:
    known = known_setup_options(version)
    kwargs: dict[str, Any] = {}
    opt = lambda s: draw(st.one_of(st.none(), s))  # noqa: E731
    kwargs["path"] = opt(st.text(max_size=10))
    kwargs["authority"] = opt(st.text(max_size=10))
    kwargs["moqt_implementation"] = opt(st.text(max_size=10))
    kwargs["max_auth_token_cache_size"] = opt(vi64)
    if 0x06 in known:
        kwargs["max_filter_ranges"] = opt(vi64)
        kwargs["max_request_updates"] = opt(vi64)
    kwargs["authorization_tokens"] = tuple(draw(st.lists(setup_token, max_size=2)))
    unknown = [kv for kv in _kvps(draw) if kv.type not in known]
    grease = draw(st.lists(st.integers(0, 3), max_size=2))
    unknown += [KeyValuePair(t, b"g" if t & 1 else 7) for t in (0x7F * n + 0x9D for n in grease)]
    kwargs["unknown_options"] = tuple(sorted(unknown, key=lambda kv: kv.type))
    return Setup(**kwargs)


def message_strategies(version: Version) -> dict[str, st.SearchStrategy[Message]]:
    """One strategy per message shape ``version`` has, by name."""
    P = lambda ctx: parameters(version, ctx)  # noqa: E731
    C = ParamContext
    wire = version.wire_version
    out = [
        setup(version),
        st.builds(
            GoAway,
            st.text(max_size=12),
            vi64,
            st.one_of(st.none(), vi64) if wire is Version.DRAFT_18 else st.none(),
        ),
        st.builds(Subscribe, vi64, namespace, name, P(C.SUBSCRIBE)),
        st.builds(SubscribeOk, vi64, P(C.SUBSCRIBE_OK), track_properties),
        st.builds(RequestUpdate, vi64, P(C.REQUEST_UPDATE)),
        st.builds(RequestOk, P(C.REQUEST_OK), track_properties),
        st.one_of(
            st.builds(RequestError, vi64.filter(lambda c: c != 0x34), vi64, text),
            st.builds(
                RequestError, st.just(0x34), vi64, text, st.builds(Redirect, text, namespace, name)
            ),
        ),
        st.builds(Publish, vi64, namespace, name, vi64, P(C.PUBLISH), track_properties),
        st.builds(PublishDone, vi64, vi64, text),
        st.builds(FetchOk, st.booleans(), location, P(C.FETCH_OK), track_properties),
        st.builds(TrackStatus, vi64, namespace, name, P(C.TRACK_STATUS)),
        st.builds(PublishNamespace, vi64, namespace, P(C.PUBLISH_NAMESPACE)),
        st.builds(SubscribeNamespace, vi64, namespace, P(C.SUBSCRIBE_NAMESPACE)),
        st.builds(SubscribeTracks, vi64, namespace, P(C.SUBSCRIBE_TRACKS)),
        st.builds(Namespace, namespace),
        st.builds(NamespaceDone, namespace),
        st.builds(PublishSkipped, namespace, name),
    ]
    if wire is Version.DRAFT_18:
        out += [
            st.builds(StandaloneFetch, vi64, namespace, name, location, location, P(C.FETCH)),
            st.builds(
                JoiningFetch,
                vi64,
                st.sampled_from([FetchType.RELATIVE_JOINING, FetchType.ABSOLUTE_JOINING]),
                vi64,
                vi64,
                P(C.FETCH),
            ),
        ]
    else:
        out += [
            st.builds(Fetch, vi64, namespace, name, P(C.FETCH)),
            st.builds(PublishStateNotify, P(C.PUBLISH_STATE_NOTIFY)),
        ]
    names = [
        "SETUP", "GOAWAY", "SUBSCRIBE", "SUBSCRIBE_OK", "REQUEST_UPDATE", "REQUEST_OK",
        "REQUEST_ERROR", "PUBLISH", "PUBLISH_DONE", "FETCH_OK", "TRACK_STATUS",
        "PUBLISH_NAMESPACE", "SUBSCRIBE_NAMESPACE", "SUBSCRIBE_TRACKS", "NAMESPACE",
        "NAMESPACE_DONE", "PUBLISH_SKIPPED",
    ]
    names += (["FETCH standalone", "FETCH joining"] if wire is Version.DRAFT_18
              else ["FETCH", "PUBLISH_STATE_NOTIFY"])
    assert len(names) == len(out)
    return dict(zip(names, out))


def messages(version: Version) -> st.SearchStrategy[Message]:
    """Any message ``version`` has, with any content it can carry."""
    return st.one_of(list(message_strategies(version).values()))

