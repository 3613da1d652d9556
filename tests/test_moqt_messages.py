"""MOQT control messages, drafts 18, 20/21 and 22: pinned bytes.

Every vector below is written out by hand from the draft text (draft-18 and the draft-20
editor's copy, §"Control Messages"; the draft-22 LOCATION_FILTER from moqt-reference §2.7),
field by field in the comments; the moq-rs vectors are the bytes moqt-reference §2.11 captured
from a real draft-22 peer. Each vector is decoded whole, fed byte by byte through
ControlStreamReader, decoded with trailing bytes, and (unless captured with non-minimal
integers) re-encoded to the same bytes. Draft 21 is checked against every draft-20 vector.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from kvsp_moq.moqt.messages import (
    ControlStreamReader,
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
    Publish,
    PublishBlocked,
    PublishDone,
    PublishNamespace,
    PublishSkipped,
    PublishStateNotify,
    Range,
    RangeFilter,
    Redirect,
    RequestError,
    PublishOk,
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
    decode_message,
    encode_message,
)
from kvsp_moq.moqt.objects import GroupOrder
from kvsp_moq.moqt.version import Version
from kvsp_moq.wire import KeyValuePair, SessionErrorCode, WireError

V18, V20, V21, V22 = Version.DRAFT_18, Version.DRAFT_20, Version.DRAFT_21, Version.DRAFT_22
ALL = (V18, V20, V21, V22)
D20 = (V20, V21)  # byte-identical drafts
D20P = (V20, V21, V22)
P = MessageParameters
LF = LocationFilter
KV = KeyValuePair


@dataclass(frozen=True)
class Vector:
    name: str
    versions: tuple[Version, ...]
    hex: str
    message: Message
    canonical: bool = True  # our encoder produces exactly these bytes

    @property
    def data(self) -> bytes:
        return bytes.fromhex(self.hex.replace(" ", ""))


VECTORS: list[Vector] = [
    # ---------------------------------------------------------------- SETUP (§"SETUP")
    # af00 type 0x2F00 | 0018 length 24 | 01 PATH, 04, "/moq" | 03 (+3 = 0x04)
    # MAX_AUTH_TOKEN_CACHE_SIZE 4096 = 9000 | 01 (0x05) AUTHORITY, 03, "r:1" |
    # 02 (0x07) MOQT_IMPLEMENTATION, 08, "kvsp/0.1"
    Vector(
        "setup-client",
        ALL,
        "af00 0018 0104 2f6d6f71 039000 0103 723a31 0208 6b7673702f302e31",
        Setup(path="/moq", max_auth_token_cache_size=4096, authority="r:1",
              moqt_implementation="kvsp/0.1"),
    ),
    # 03 AUTHORIZATION_TOKEN, 04, Token{03 USE_VALUE, type 01, "tk"} | 03 (0x06)
    # MAX_FILTER_RANGES 8 | 02 (0x08) MAX_REQUEST_UPDATES 2
    Vector(
        "setup-server-20",
        D20P,
        "af00 000a 0304 0301746b 0308 0202",
        Setup(authorization_tokens=(Token.use_value(1, b"tk"),), max_filter_ranges=8,
              max_request_updates=2),
    ),
    # The same bytes in draft 18, where 0x06 and 0x08 are unknown options (ignored, kept).
    Vector(
        "setup-server-18",
        (V18,),
        "af00 000a 0304 0301746b 0308 0202",
        Setup(authorization_tokens=(Token.use_value(1, b"tk"),),
              unknown_options=(KV(6, 8), KV(8, 2))),
    ),
    # GREASE option 0x9D (odd: 809d = 2-byte vi64, len 01 "x"), repeated (delta 00, len 00).
    Vector(
        "setup-grease-repeated",
        ALL,
        "af00 0006 809d 0178 0000",
        Setup(unknown_options=(KV(0x9D, b"x"), KV(0x9D, b""))),
    ),
    # Empty SETUP (what moqt-reference §6 sends to moq-rs).
    Vector("setup-empty", ALL, "af00 0000", Setup()),
    # moq-rs (draft-22) server SETUP, moqt-reference §2.11: 07 MOQT_IMPLEMENTATION
    # "moq-lite-rs"; c40b4d (+265037) an unknown even option whose random 8-byte vi64 value
    # (fe + 7 bytes; the captured random bytes replaced by 01..07) we re-encode shorter;
    # 0601 0201 two more unknown even options under running-delta rules.
    Vector(
        "setup-moq-rs",
        ALL,
        "af00 001c 070b 6d6f712d6c6974652d7273 c40b4d fe01020304050607 0601 0201",
        Setup(moqt_implementation="moq-lite-rs",
              unknown_options=(KV(265044, 0x01020304050607), KV(265050, 1), KV(265052, 1))),
        canonical=False,
    ),
    # ---------------------------------------------------------------- GOAWAY (§"GOAWAY")
    # 10 | 000b | 08 "moqt://b" | Timeout 5000 = 9388
    Vector("goaway", ALL, "10 000b 08 6d6f71743a2f2f62 9388", GoAway("moqt://b", 5000)),
    # draft 18: trailing Request ID 4 (control stream)
    Vector("goaway-request-id-18", (V18,), "10 000c 08 6d6f71743a2f2f62 9388 04",
           GoAway("moqt://b", 5000, 4)),
    Vector("goaway-client", ALL, "10 0002 00 00", GoAway()),
    # ---------------------------------------------------------------- SUBSCRIBE
    # moq-rs client SUBSCRIBE (draft 22, moqt-reference §2.11): Request ID 0, ("kv"),
    # "layer0", 1 parameter: 21 LOCATION_FILTER type 05 Next Object.
    Vector(
        "subscribe-moq-rs",
        (V22,),
        "03 000f 00 01026b76 066c6179657230 01 2105",
        Subscribe(0, (b"kv",), b"layer0", P(location_filter=LF.next_object())),
    ),
    # Request ID 2, ("kvsp-1"), "raw", 5 parameters: 03 AUTHORIZATION_TOKEN len 04
    # {03 USE_VALUE, type 00, "ab"} | 0d (0x10) FORWARD 00 | 10 (0x20) SUBSCRIBER_PRIORITY c8 |
    # 01 (0x21) LOCATION_FILTER len 01 {StartGroup 01: current group} | 01 (0x22) GROUP_ORDER 02
    Vector(
        "subscribe-20",
        D20,
        "03 001d 02 01066b7673702d31 03726177 05 0304 03006162 0d00 10c8 010101 0102",
        Subscribe(2, (b"kvsp-1",), b"raw", P(
            authorization_tokens=(Token.use_value(0, b"ab"),), forward=False,
            subscriber_priority=200, location_filter=LF.relative_start(1),
            group_order=GroupOrder.DESCENDING)),
    ),
    # draft 22: the same, LOCATION_FILTER typed: 01 (0x21) type 01 StartGroup 01 — the same
    # bytes as draft 20 here (one 1-byte field: length 1 = type 1).
    Vector(
        "subscribe-22",
        (V22,),
        "03 001d 02 01066b7673702d31 03726177 05 0304 03006162 0d00 10c8 010101 0102",
        Subscribe(2, (b"kvsp-1",), b"raw", P(
            authorization_tokens=(Token.use_value(0, b"ab"),), forward=False,
            subscriber_priority=200, location_filter=LF.relative_start(1),
            group_order=GroupOrder.DESCENDING)),
    ),
    # draft 18: 04 (0x04) RENDEZVOUS_TIMEOUT 5000 = 9388 | 02 (0x06) SUBGROUP_DELIVERY_TIMEOUT
    # 1000 = 83e8 | 1b (0x21) SUBSCRIPTION_FILTER len 01 {Filter Type 01 Next Group Start} |
    # 11 (0x32) NEW_GROUP_REQUEST 00
    Vector(
        "subscribe-18",
        (V18,),
        "03 0012 00 0101 61 0174 04 049388 0283e8 1b0101 1100",
        Subscribe(0, (b"a",), b"t", P(rendezvous_timeout=5000, subgroup_delivery_timeout=1000,
                                      location_filter=LF.relative_start(0),
                                      new_group_request=0)),
    ),
    # ---------------------------------------------------------------- SUBSCRIBE_OK
    # moq-rs SUBSCRIBE_OK (moqt-reference §2.11): alias 00, 1 param 09 LARGEST_OBJECT {2d, 00},
    # Track Properties 08 TIMESCALE 1000000 = cf4240 | 06 (0x0E) DEFAULT_PUBLISHER_PRIORITY
    # 128 = 8080 | 14 (0x22) DEFAULT_PUBLISHER_GROUP_ORDER 02. Same bytes in every version.
    Vector(
        "subscribe-ok-moq-rs",
        ALL,
        "04 000e 00 01 092d00 08cf4240 068080 1402",
        SubscribeOk(0, P(largest_object=Location(45, 0)),
                    (KV(0x08, 1000000), KV(0x0E, 128), KV(0x22, 2))),
    ),
    # alias 300 = 812c, 1 param 08 EXPIRES 30000 = c07530, no Track Properties
    Vector("subscribe-ok-expires", ALL, "04 0007 812c 01 08c07530",
           SubscribeOk(300, P(expires=30000))),
    # ---------------------------------------------------------------- REQUEST_UPDATE
    # draft 18: Request ID 4, 3 params: 10 FORWARD 01 | 10 (0x20) SUBSCRIBER_PRIORITY 0a |
    # 01 (0x21) SUBSCRIPTION_FILTER len 01 {02 Largest Object}
    Vector(
        "request-update-18",
        (V18,),
        "02 0009 04 03 1001 100a 010102",
        RequestUpdate(4, P(forward=True, subscriber_priority=10,
                           location_filter=LF.next_object())),
    ),
    # draft 20: Request ID 4, 3 params: 10 FORWARD 01 | 11 (0x21) LOCATION_FILTER len 02
    # {00 00: Next Object} | 02 (0x23) FILL_PARAMETERS len 06 {02 parameters: 20 SUBSCRIBER_PRIORITY 0a,
    # 01 (0x21) LOCATION_FILTER len 01 {StartGroup 01}}  ("join at the current group")
    Vector(
        "request-update-fill-20",
        D20,
        "02 0010 04 03 1001 11020000 0206 02 200a 010101",
        RequestUpdate(4, P(forward=True, location_filter=LF.next_object(),
                           fill_parameters=P(subscriber_priority=10,
                                             location_filter=LF.relative_start(1)))),
    ),
    # draft 22: the same with typed filters: 11 (0x21) type 05 Next Object; inside
    # FILL_PARAMETERS 01 (0x21) type 01 StartGroup 01.
    Vector(
        "request-update-fill-22",
        (V22,),
        "02 000e 04 03 1001 1105 0206 02 200a 010101",
        RequestUpdate(4, P(forward=True, location_filter=LF.next_object(),
                           fill_parameters=P(subscriber_priority=10,
                                             location_filter=LF.relative_start(1)))),
    ),
    # Namespace update: Request ID 6, 34 TRACK_NAMESPACE_PREFIX (Track Namespace: 01 field
    # 02 "kv")
    Vector("request-update-prefix", ALL, "02 0007 06 01 34 01026b76",
           RequestUpdate(6, P(track_namespace_prefix=(b"kv",)))),
    # draft 20: Range filters. 25 SUBGROUP_FILTER len 04 {SetID 00, Range 3..5 = 03 02,
    # Range 10.. open = 05} ("ranges 3-5 and 10-": a Start is a delta from the prior End) |
    # 03 (0x28) OBJECT_PROPERTY_FILTER len 03 {SetID 01, Property Type 3c, Range 7.. open} |
    # 00 (0x28 again) len 00 (empty: remove)
    Vector(
        "request-update-range-filters-20",
        D20P,
        "02 000f 08 03 2504 00030205 0303 013c07 0000",
        RequestUpdate(8, P(
            subgroup_filters=(RangeFilter(0, None, (Range(3, 5), Range(10, None))),),
            object_property_filters=(RangeFilter(1, 0x3C, (Range(7, None),)), RangeFilter()))),
    ),
    # ---------------------------------------------------------------- REQUEST_OK
    Vector("request-ok-empty", ALL, "07 0001 00", RequestOk()),
    # TRACK_STATUS_OK: 09 LARGEST_OBJECT {03, 07}; Track Properties 0e
    # DEFAULT_PUBLISHER_PRIORITY 40
    Vector("request-ok-track-status", ALL, "07 0006 01 090307 0e40",
           RequestOk(P(largest_object=Location(3, 7)), (KV(0x0E, 64),))),
    # 08 EXPIRES 30000 = c07530 (PUBLISH_OK in 18; any of the namespace OKs in 20+)
    Vector("request-ok-expires", ALL, "07 0005 01 08c07530", RequestOk(P(expires=30000))),
    # Draft 18's table lists 0x1E PUBLISH_OK ({{message-request-ok}}): REQUEST_OK's body under
    # the old type; 20+ reserve 0x1E (test_moqt_messages_errors: unknown there).
    Vector("publish-ok-18", (V18,), "1e 0005 01 08c07530", PublishOk(P(expires=30000))),
    # ---------------------------------------------------------------- REQUEST_ERROR
    # DOES_NOT_EXIST 10, Retry Interval 00, Reason 02 "no"
    Vector("request-error", ALL, "05 0005 10 00 026e6f", RequestError(0x10, 0, "no")),
    # REDIRECT 34, Retry 1001 = 83e9, Reason 00, Redirect {08 "moqt://b", (01 "x"), 01 "y"}
    Vector(
        "request-error-redirect",
        ALL,
        "05 0012 34 83e9 00 08 6d6f71743a2f2f62 01 0178 0179",
        RequestError(0x34, 1001, "", Redirect("moqt://b", (b"x",), b"y")),
    ),
    # Unknown code 0x77 is kept (and reads as INTERNAL_ERROR).
    Vector("request-error-unknown-code", ALL, "05 0003 77 01 00", RequestError(0x77, 1)),
    # ---------------------------------------------------------------- PUBLISH
    # Request 01, ("kv"), "layer0", alias 07, 3 params: 09 LARGEST_OBJECT {00, 05} |
    # 07 (0x10) FORWARD 00 | 12 (0x22) GROUP_ORDER 01; Track Property b800 (0x3800, private) 1c
    Vector(
        "publish-20",
        D20P,
        "1d 0018 01 01026b76 066c6179657230 07 03 090005 0700 1201 b8001c",
        Publish(1, (b"kv",), b"layer0", 7,
                P(largest_object=Location(0, 5), forward=False, group_order=GroupOrder.ASCENDING),
                (KV(0x3800, 28),)),
    ),
    # draft 18 (GROUP_ORDER may not appear in PUBLISH there)
    Vector(
        "publish-18",
        (V18,),
        "1d 0016 01 01026b76 066c6179657230 07 02 090005 0700 b8001c",
        Publish(1, (b"kv",), b"layer0", 7, P(largest_object=Location(0, 5), forward=False),
                (KV(0x3800, 28),)),
    ),
    # ---------------------------------------------------------------- PUBLISH_DONE
    # TRACK_ENDED 02, Stream Count 03, Reason 00
    Vector("publish-done", ALL, "0b 0003 02 03 00", PublishDone(2, 3)),
    # Stream Count unknown: 2^64-1 (9-byte vi64 ff + 8 x ff) in 20+, 2^62-1 in 18
    Vector("publish-done-unknown-20", D20P, "0b 000b 02 ffffffffffffffffff 00",
           PublishDone(2, (1 << 64) - 1)),
    Vector("publish-done-unknown-18", (V18,), "0b 000b 02 ff3fffffffffffffff 00",
           PublishDone(2, (1 << 62) - 1)),
    # ---------------------------------------------------------------- PUBLISH_STATE_NOTIFY
    # 02 params: 09 LARGEST_OBJECT {0a, 04} | 07 (0x10) FORWARD 00
    Vector("publish-state-notify", D20P, "22 0006 02 090a04 0700",
           PublishStateNotify(P(largest_object=Location(10, 4), forward=False))),
    # ---------------------------------------------------------------- FETCH
    # draft 20: Request 06, ("kvsp-1"), "raw", 02 params: 21 LOCATION_FILTER len 05
    # {StartGroup 00, StartObject 00, EndGroupDelta 00, EndObject 300 = 812c} | 01 (0x22) 01
    Vector(
        "fetch-20",
        D20,
        "16 0017 06 01066b7673702d31 03726177 02 2105 000000812c 0101",
        Fetch(6, (b"kvsp-1",), b"raw", P(
            location_filter=LF.absolute(Location(0, 0), 0, 300),
            group_order=GroupOrder.ASCENDING)),
    ),
    # draft 22: 21 type 04 {00, 00, 00, 812c}
    Vector(
        "fetch-22",
        (V22,),
        "16 0017 06 01066b7673702d31 03726177 02 2104 000000812c 0101",
        Fetch(6, (b"kvsp-1",), b"raw", P(
            location_filter=LF.absolute(Location(0, 0), 0, 300),
            group_order=GroupOrder.ASCENDING)),
    ),
    # draft 18 Standalone: Request 06, Fetch Type 01, ("kvsp-1"), "raw", Start {00, 00},
    # End {01, 00} (whole group 0), 01 param 22 GROUP_ORDER 02
    Vector(
        "fetch-standalone-18",
        (V18,),
        "16 0015 06 01 01066b7673702d31 03726177 0000 0100 01 2202",
        StandaloneFetch(6, (b"kvsp-1",), b"raw", Location(0, 0), Location(1, 0),
                        P(group_order=GroupOrder.DESCENDING)),
    ),
    # draft 18 Joining: Request 08, Fetch Type 02 / 03, Joining Request ID 04, Joining Start
    # 03, 00 params
    Vector("fetch-relative-joining-18", (V18,), "16 0005 08 02 04 03 00",
           JoiningFetch(8, FetchType.RELATIVE_JOINING, 4, 3)),
    # ... 01 param 20 SUBSCRIBER_PRIORITY 80
    Vector("fetch-absolute-joining-18", (V18,), "16 0007 08 03 04 03 01 2080",
           JoiningFetch(8, FetchType.ABSOLUTE_JOINING, 4, 3, P(subscriber_priority=0x80))),
    # ---------------------------------------------------------------- FETCH_OK
    # End Of Track 01, End {02, 05}, 00 params, Track Property 04 MAX_CACHE_DURATION
    # 60000 = c0ea60
    Vector("fetch-ok", ALL, "18 0008 01 0205 00 04c0ea60",
           FetchOk(True, Location(2, 5), P(), (KV(0x04, 60000),))),
    # ---------------------------------------------------------------- TRACK_STATUS
    # Request 0a, ("a", "b"), "" , 01 param 03 AUTHORIZATION_TOKEN len 02 {02 USE_ALIAS, 05}
    Vector("track-status", ALL, "0d 000c 0a 02 0161 0162 00 01 0302 0205",
           TrackStatus(10, (b"a", b"b"), b"", P(authorization_tokens=(Token.use_alias(5),)))),
    # 20+: + 32 (0x35) INCLUDE_PROPERTIES 00
    Vector("track-status-20", D20P, "0d 000e 0a 02 0161 0162 00 02 0302 0205 3200",
           TrackStatus(10, (b"a", b"b"), b"", P(authorization_tokens=(Token.use_alias(5),),
                                                 include_properties=False))),
    # ---------------------------------------------------------------- PUBLISH_NAMESPACE
    # moq-rs server (moqt-reference §2.11): Request 03, ("kv"), 00 params
    Vector("publish-namespace-moq-rs", ALL, "06 0006 03 01026b76 00",
           PublishNamespace(3, (b"kv",))),
    # 03 AUTHORIZATION_TOKEN len 05 {01 REGISTER, alias 01, type 02, "kv"}
    Vector("publish-namespace-token", ALL, "06 000d 05 01026b76 01 0305 0101026b76",
           PublishNamespace(5, (b"kv",), P(authorization_tokens=(Token.register(1, 2, b"kv"),)))),
    # ---------------------------------------------------------------- SUBSCRIBE_NAMESPACE
    # moq-rs server: Request 01, empty prefix, 00 params
    Vector("subscribe-namespace-moq-rs", ALL, "50 0003 01 00 00", SubscribeNamespace(1, ())),
    # Two AUTHORIZATION_TOKENs (repeatable): 03 len 02 {00 DELETE, alias 09},
    # 00 (0x03 again) len 02 {02 USE_ALIAS, alias 09}
    Vector("subscribe-namespace-two-tokens", ALL, "50 000d 07 01 0178 02 0302 0009 0002 0209",
           SubscribeNamespace(7, (b"x",), P(authorization_tokens=(Token.delete(9),
                                                                  Token.use_alias(9))))),
    # ---------------------------------------------------------------- SUBSCRIBE_TRACKS
    # Request 03, ("a"), 01 param 10 FORWARD 00
    Vector("subscribe-tracks", ALL, "51 0007 03 010161 01 1000",
           SubscribeTracks(3, (b"a",), P(forward=False))),
    # 20+: + 12 (0x22) GROUP_ORDER 02 | 07 (0x29) TRACK_PROPERTY_FILTER len 03 {SetID 00,
    # Property Type 30 (DYNAMIC_GROUPS), Range 01 open}
    Vector(
        "subscribe-tracks-20",
        D20P,
        "51 000e 03 010161 03 1000 1202 0703 003001",
        SubscribeTracks(3, (b"a",), P(
            forward=False, group_order=GroupOrder.DESCENDING,
            track_property_filters=(RangeFilter(0, 0x30, (Range(1, None),)),))),
    ),
    # ---------------------------------------------------------------- NAMESPACE etc.
    Vector("namespace", ALL, "08 0004 01 026a6b", Namespace((b"jk",))),
    Vector("namespace-empty-suffix", ALL, "08 0001 00", Namespace(())),
    Vector("namespace-done", ALL, "0e 0004 01 026a6b", NamespaceDone((b"jk",))),
    # PUBLISH_SKIPPED (PUBLISH_BLOCKED in 18): suffix ("s"), name "t"
    Vector("publish-skipped", ALL, "0f 0005 01 0173 0174", PublishSkipped((b"s",), b"t")),
    # Non-minimal integers are valid (§"Variable-Length Integers"): type 03 as 8003,
    # Request ID 0 as c00000, 1 field as 4-byte e0000001.
    Vector("subscribe-non-minimal", ALL, "8003 000c c00000 e0000001 0161 0174 00",
           Subscribe(0, (b"a",), b"t"), canonical=False),
]

# LOCATION_FILTER in each version's shape, as the only parameter of SUBSCRIBE
# (Request 00, ("a"), "t"): body "00 010161 0174 01 21" + value.
_LOCATION_FILTERS: list[tuple[str, LocationFilter, dict[Version, str | None]]] = [
    # draft 18: len + {Filter Type, ...}; 20/21: len + 0-4 fields; 22: type + fields
    ("next-object", LF.next_object(), {V18: "0102", V20: "020000", V22: "05"}),
    ("next-group", LF.relative_start(0), {V18: "0101", V20: "0100", V22: "0100"}),
    ("relative-2", LF.relative_start(2), {V18: None, V20: "0102", V22: "0102"}),
    ("absolute-start", LF.absolute(Location(300, 0)),
     {V18: "0403812c00", V20: "03812c00", V22: "02812c00"}),
    ("absolute-start-0-0", LF.absolute(Location(0, 0)),
     {V18: "03030000", V20: None, V22: "020000"}),
    ("absolute-range", LF.absolute(Location(5, 0), 7),
     {V18: "0404050002", V20: "03050002", V22: "03050002"}),
    ("absolute-range-end-object", LF.absolute(Location(5, 1), 7, 9),
     {V18: None, V20: "0405010209", V22: "0405010209"}),
    ("none", LF.none(), {V18: None, V20: "00", V22: "00"}),
]


def _lf_vectors() -> list[Vector]:
    out = []
    for name, f, shapes in _LOCATION_FILTERS:
        for version, value in shapes.items():
            if value is None:
                continue
            body = "00 010161 0174 01 21" + value
            data = bytes.fromhex(body.replace(" ", ""))
            versions = D20 if version is V20 else (version,)
            out.append(Vector(f"subscribe-location-filter-{name}-{int(version)}", versions,
                              f"03 {len(data):04x} {body}", Subscribe(0, (b"a",), b"t",
                                                                      P(location_filter=f))))
    return out


VECTORS += _lf_vectors()
CASES = [(v, version) for v in VECTORS for version in v.versions]
IDS = [f"{v.name}@{int(version)}" for v, version in CASES]


def test_vector_names_unique() -> None:
    assert len({v.name for v in VECTORS}) == len(VECTORS)


def test_every_message_class_has_a_vector_in_every_version_it_exists_in() -> None:
    from kvsp_moq.moqt.messages import message_classes

    for version in ALL:
        pinned = {type(v.message).TYPE for v in VECTORS if version in v.versions}
        assert set(message_classes(version)) <= pinned, version


@pytest.mark.parametrize(("vec", "version"), CASES, ids=IDS)
def test_decode_whole(vec: Vector, version: Version) -> None:
    assert decode_message(version, vec.data) == (vec.message, len(vec.data))


@pytest.mark.parametrize(("vec", "version"), CASES, ids=IDS)
def test_encode(vec: Vector, version: Version) -> None:
    encoded = encode_message(version, vec.message)
    if vec.canonical:
        assert encoded.hex() == vec.data.hex()
    assert decode_message(version, encoded) == (vec.message, len(encoded))


@pytest.mark.parametrize(("vec", "version"), CASES, ids=IDS)
def test_byte_by_byte(vec: Vector, version: Version) -> None:
    reader = ControlStreamReader(version)
    data = vec.data
    for i in range(len(data) - 1):
        assert reader.feed(data[i : i + 1]) == []
        assert decode_message(version, data[: i + 1]) is None
    assert reader.feed(data[-1:], end_stream=True) == [vec.message]
    assert reader.buffered == 0


@pytest.mark.parametrize(("vec", "version"), CASES, ids=IDS)
def test_trailing_bytes(vec: Vector, version: Version) -> None:
    data = vec.data
    follow = bytes.fromhex("070001 00")  # an empty REQUEST_OK, then the start of another
    assert decode_message(version, data + follow + b"\x07") == (vec.message, len(data))
    reader = ControlStreamReader(version)
    assert reader.feed(data + follow + b"\x07\x00") == [vec.message, RequestOk()]
    assert reader.buffered == 2
    with pytest.raises(WireError) as err:
        reader.feed(b"", end_stream=True)  # the FIN lands inside a message
    assert err.value.code == SessionErrorCode.PROTOCOL_VIOLATION


@pytest.mark.parametrize(("vec", "version"), CASES, ids=IDS)
def test_decode_at_offset(vec: Vector, version: Version) -> None:
    data = b"\xaa\xbb" + vec.data
    assert decode_message(version, data, 2) == (vec.message, len(vec.data))
    assert decode_message(version, memoryview(bytearray(data)), 2) == (vec.message, len(vec.data))


def test_many_messages_in_one_chunk_and_split_everywhere() -> None:
    for version in ALL:
        vectors = [v for v in VECTORS if version in v.versions]
        stream = b"".join(v.data for v in vectors)
        expected = [v.message for v in vectors]
        assert ControlStreamReader(version).feed(stream, end_stream=True) == expected
        for cut in range(0, len(stream), 7):
            reader = ControlStreamReader(version)
            got = reader.feed(stream[:cut]) + reader.feed(stream[cut:], end_stream=True)
            assert got == expected


# -- message-specific semantics ---------------------------------------------------------------
def test_draft_21_is_draft_20() -> None:
    for vec in VECTORS:
        if V20 in vec.versions:
            assert decode_message(V21, vec.data) == decode_message(V20, vec.data)
            assert encode_message(V21, vec.message) == encode_message(V20, vec.message)


def test_publish_blocked_is_publish_skipped() -> None:
    assert PublishBlocked is PublishSkipped


def test_codes_read_unknown_as_internal_error() -> None:
    from kvsp_moq.moqt.errors import PublishDoneCode, RequestErrorCode

    assert RequestError(0x77).code is RequestErrorCode.INTERNAL_ERROR
    assert RequestError(0x10).code is RequestErrorCode.DOES_NOT_EXIST
    assert PublishDone(0x2, 0).code is PublishDoneCode.TRACK_ENDED
    assert PublishDone(0x99, 0).code is PublishDoneCode.INTERNAL_ERROR


def test_location_filter_views() -> None:
    f = LF.absolute(Location(5, 1), 7, 9)
    assert f.filter_type is LocationFilterType.ABSOLUTE_RANGE_END_OBJECT
    assert (f.start_location, f.end_group, f.end_object) == (Location(5, 1), 7, 9)
    assert LF.next_object().start_location is None and LF.next_object().end_group is None
    with pytest.raises(ValueError):
        LF(LocationFilterType.NEXT_OBJECT, start_group=1)
    with pytest.raises(ValueError):
        LF.absolute(Location(5, 0), 4)


def test_stream_rules_are_declared() -> None:
    from kvsp_moq.moqt.messages import REQUEST_TYPES, Sender, StreamUse, message_classes

    firsts = {c.TYPE for c in message_classes(V22).values() if c.FIRST}
    assert firsts == {0x2F00, *REQUEST_TYPES}
    assert Setup.STREAM is StreamUse.CONTROL and GoAway.STREAM is StreamUse.CONTROL_OR_REQUEST
    assert SubscribeOk.ON_REQUESTS == {0x03: Sender.RESPONDER}
    assert PublishDone.ON_REQUESTS == {0x03: Sender.RESPONDER, 0x1D: Sender.REQUESTER}
    assert RequestUpdate.ON_REQUESTS[0x1D] is Sender.RESPONDER
    assert 0x0D not in RequestUpdate.ON_REQUESTS  # TRACK_STATUS cannot be updated
    assert Namespace.ON_REQUESTS == {0x50: Sender.RESPONDER}
    assert PublishSkipped.ON_REQUESTS == {0x51: Sender.RESPONDER}
    for cls in message_classes(V22).values():
        assert cls.FIRST or cls.ON_REQUESTS or cls.STREAM is StreamUse.CONTROL, cls
