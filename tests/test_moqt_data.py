"""MOQT data plane (drafts 18, 20, 21, 22): subgroup streams, fetch streams, datagrams, padding.

Pinned bytes are written out by hand from the draft text (draft-20 / draft-18 §"Data Streams
and Datagrams"). Every stream vector is parsed whole, byte by byte, and with trailing bytes
(the start of another object: same events, and the stream may not end there). Hypothesis
round-trips the encoders through the parsers under random chunking, and random or mutated
input may only raise WireError.
"""

from __future__ import annotations

import tracemalloc
from collections.abc import Callable

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvsp_moq.moqt.data import (
    DataStreamParser,
    EndOfRange,
    EndOfRangeKind,
    FetchHeader,
    FetchStreamEncoder,
    FetchStreamParser,
    GroupOrder,
    ObjectBegin,
    ObjectDatagram,
    ObjectEnd,
    ObjectPayload,
    ObjectStatus,
    PaddingDatagram,
    PaddingStreamHeader,
    PaddingStreamParser,
    StreamKind,
    SubgroupHeader,
    SubgroupIdMode,
    SubgroupStreamEncoder,
    SubgroupStreamParser,
    classify_stream_type,
    encode_datagram,
    encode_fetch_header,
    encode_padding_datagram,
    encode_padding_stream_header,
    encode_subgroup_header,
    parse_datagram,
    peek_stream_type,
)
from kvsp_moq.moqt.version import SUPPORTED_ALPNS, Version
from kvsp_moq.wire import (
    KeyValuePair,
    LimitExceeded,
    SessionErrorCode,
    StreamResetCode,
    WireError,
)

PV = SessionErrorCode.PROTOCOL_VIOLATION
VERSIONS = list(Version)
N, EOG, EOT = ObjectStatus.NORMAL, ObjectStatus.END_OF_GROUP, ObjectStatus.END_OF_TRACK
KVP = KeyValuePair

# One SUBGROUP_HEADER per valid Type Flags value: Track Alias 2, Group ID 0x45, Subgroup ID
# 0x1234 (vi64 92 34) when SUBGROUP_ID_MODE is 0b10, Publisher Priority 0x80 unless
# DEFAULT_PRIORITY (0x20). Byte layout per draft-20 / draft-18 §"Subgroup Header".
SUBGROUP_HEADERS: dict[int, bytes] = {
    0x10: b"\x10\x02\x45\x80",
    0x11: b"\x11\x02\x45\x80",
    0x12: b"\x12\x02\x45\x80",
    0x13: b"\x13\x02\x45\x80",
    0x14: b"\x14\x02\x45\x92\x34\x80",
    0x15: b"\x15\x02\x45\x92\x34\x80",
    0x18: b"\x18\x02\x45\x80",
    0x19: b"\x19\x02\x45\x80",
    0x1A: b"\x1a\x02\x45\x80",
    0x1B: b"\x1b\x02\x45\x80",
    0x1C: b"\x1c\x02\x45\x92\x34\x80",
    0x1D: b"\x1d\x02\x45\x92\x34\x80",
    0x30: b"\x30\x02\x45",
    0x31: b"\x31\x02\x45",
    0x32: b"\x32\x02\x45",
    0x33: b"\x33\x02\x45",
    0x34: b"\x34\x02\x45\x92\x34",
    0x35: b"\x35\x02\x45\x92\x34",
    0x38: b"\x38\x02\x45",
    0x39: b"\x39\x02\x45",
    0x3A: b"\x3a\x02\x45",
    0x3B: b"\x3b\x02\x45",
    0x3C: b"\x3c\x02\x45\x92\x34",
    0x3D: b"\x3d\x02\x45\x92\x34",
    0x50: b"\x50\x02\x45\x80",
    0x51: b"\x51\x02\x45\x80",
    0x52: b"\x52\x02\x45\x80",
    0x53: b"\x53\x02\x45\x80",
    0x54: b"\x54\x02\x45\x92\x34\x80",
    0x55: b"\x55\x02\x45\x92\x34\x80",
    0x58: b"\x58\x02\x45\x80",
    0x59: b"\x59\x02\x45\x80",
    0x5A: b"\x5a\x02\x45\x80",
    0x5B: b"\x5b\x02\x45\x80",
    0x5C: b"\x5c\x02\x45\x92\x34\x80",
    0x5D: b"\x5d\x02\x45\x92\x34\x80",
    0x70: b"\x70\x02\x45",
    0x71: b"\x71\x02\x45",
    0x72: b"\x72\x02\x45",
    0x73: b"\x73\x02\x45",
    0x74: b"\x74\x02\x45\x92\x34",
    0x75: b"\x75\x02\x45\x92\x34",
    0x78: b"\x78\x02\x45",
    0x79: b"\x79\x02\x45",
    0x7A: b"\x7a\x02\x45",
    0x7B: b"\x7b\x02\x45",
    0x7C: b"\x7c\x02\x45\x92\x34",
    0x7D: b"\x7d\x02\x45\x92\x34",
}

# One OBJECT_DATAGRAM per valid Type Flags value: Track Alias 2, Group 3, Object ID 5 unless
# ZERO_OBJECT_ID (0x04), Priority 0x40 unless DEFAULT_PRIORITY (0x08), Properties
# {0x10: 15} (02 10 0f) if PROPERTIES (0x01), then Object Status (0x00 with properties,
# else 0x03 End of Group) if STATUS (0x20), else the payload "pq" (draft-20 §"Object Datagram").
DATAGRAMS: dict[int, bytes] = {
    0x00: b"\x00\x02\x03\x05\x40\x70\x71",
    0x01: b"\x01\x02\x03\x05\x40\x02\x10\x0f\x70\x71",
    0x02: b"\x02\x02\x03\x05\x40\x70\x71",
    0x03: b"\x03\x02\x03\x05\x40\x02\x10\x0f\x70\x71",
    0x04: b"\x04\x02\x03\x40\x70\x71",
    0x05: b"\x05\x02\x03\x40\x02\x10\x0f\x70\x71",
    0x06: b"\x06\x02\x03\x40\x70\x71",
    0x07: b"\x07\x02\x03\x40\x02\x10\x0f\x70\x71",
    0x08: b"\x08\x02\x03\x05\x70\x71",
    0x09: b"\x09\x02\x03\x05\x02\x10\x0f\x70\x71",
    0x0A: b"\x0a\x02\x03\x05\x70\x71",
    0x0B: b"\x0b\x02\x03\x05\x02\x10\x0f\x70\x71",
    0x0C: b"\x0c\x02\x03\x70\x71",
    0x0D: b"\x0d\x02\x03\x02\x10\x0f\x70\x71",
    0x0E: b"\x0e\x02\x03\x70\x71",
    0x0F: b"\x0f\x02\x03\x02\x10\x0f\x70\x71",
    0x20: b"\x20\x02\x03\x05\x40\x03",
    0x21: b"\x21\x02\x03\x05\x40\x02\x10\x0f\x00",
    0x24: b"\x24\x02\x03\x40\x03",
    0x25: b"\x25\x02\x03\x40\x02\x10\x0f\x00",
    0x28: b"\x28\x02\x03\x05\x03",
    0x29: b"\x29\x02\x03\x05\x02\x10\x0f\x00",
    0x2C: b"\x2c\x02\x03\x03",
    0x2D: b"\x2d\x02\x03\x02\x10\x0f\x00",
}

# The draft-18 text enumerates the valid values explicitly; the tables above must match.
DRAFT18_SUBGROUP_TYPES = [
    *range(0x10, 0x16), *range(0x18, 0x1E), *range(0x30, 0x36), *range(0x38, 0x3E),
    *range(0x50, 0x56), *range(0x58, 0x5E), *range(0x70, 0x76), *range(0x78, 0x7E),
]
DRAFT18_DATAGRAM_TYPES = [*range(0x00, 0x10), 0x20, 0x21, 0x24, 0x25, 0x28, 0x29, 0x2C, 0x2D]


# -- helpers ----------------------------------------------------------------------------------
def collapse(events: list[object]) -> list[object]:
    """Merge consecutive payload chunks into ("payload", bytes) so chunkings compare equal."""
    out: list[object] = []
    for ev in events:
        if isinstance(ev, ObjectPayload):
            assert len(ev.data) > 0
            if out and isinstance(out[-1], tuple) and out[-1][0] == "payload":
                out[-1] = ("payload", out[-1][1] + bytes(ev.data))
            else:
                out.append(("payload", bytes(ev.data)))
        else:
            out.append(ev)
    return out


def feed_chunks(parser, data: bytes, sizes: list[int] | None = None) -> list[object]:
    events: list[object] = []
    pos = 0
    for size in sizes or []:
        events += parser.feed(data[pos : pos + size])
        pos += size
    events += parser.feed(data[pos:], end_stream=True)
    return events


def check_stream(factory: Callable[[], object], data: bytes, expected: list[object],
                 trailing: bytes | None = b"\x00") -> None:
    # Whole, in one chunk with the FIN; payload chunks are views of the input.
    p = factory()
    events = p.feed(data, end_stream=True)
    assert collapse(events) == expected
    for ev in events:
        if isinstance(ev, ObjectPayload):
            assert ev.data.obj is data
    # Byte by byte, then an empty chunk with the FIN.
    p = factory()
    events = []
    for i in range(len(data)):
        events += p.feed(data[i : i + 1])
    events += p.feed(b"", end_stream=True)
    assert collapse(events) == expected
    # With trailing bytes: the beginning of another object. Same events; ending there is a
    # protocol violation (FIN inside an object). (Padding streams have no units: None.)
    if trailing is None:
        return
    p = factory()
    assert collapse(p.feed(data + trailing)) == expected
    with pytest.raises(WireError) as info:
        p.feed(b"", end_stream=True)
    assert info.value.code == PV


def check_violation(factory: Callable[[], object], data: bytes,
                    code: int = PV, end_stream: bool = True) -> WireError:
    p = factory()
    with pytest.raises(WireError) as whole:
        p.feed(data, end_stream=end_stream)
    assert whole.value.code == code
    with pytest.raises(WireError):  # a dead parser stays dead
        p.feed(b"")
    p = factory()
    with pytest.raises(WireError) as bytewise:
        for i in range(len(data)):
            p.feed(data[i : i + 1])
        p.feed(b"", end_stream=end_stream)
    assert bytewise.value.code == code
    return whole.value


def subgroup_parser(
    version: Version = Version.DRAFT_22, **kw
) -> Callable[[], SubgroupStreamParser]:
    return lambda: SubgroupStreamParser(version, **kw)


def fetch_parser(version: Version = Version.DRAFT_22, **kw) -> Callable[[], FetchStreamParser]:
    return lambda: FetchStreamParser(version, **kw)


def begin(group, subgroup, obj, prio, length, status=N, props=()) -> ObjectBegin:
    return ObjectBegin(group, subgroup, obj, prio, status, length, tuple(props))


# =============================================================================================
# Versions
# =============================================================================================
def test_versions_and_alpn() -> None:
    assert [v.alpn for v in VERSIONS] == ["moqt-18", "moqt-20", "moqt-21", "moqt-22"]
    assert SUPPORTED_ALPNS == ("moqt-22", "moqt-21", "moqt-20", "moqt-18")
    for v in VERSIONS:
        assert Version.from_alpn(v.alpn) is v
        assert Version.from_alpn(v.alpn.encode()) is v
    for bad in ("moqt-17", "moqt-23", "moq-00", "h3", "moqt-", "moqt-2x"):
        with pytest.raises(ValueError):
            Version.from_alpn(bad)
    assert Version.DRAFT_21.wire_version is Version.DRAFT_20
    assert Version.DRAFT_22.wire_version is Version.DRAFT_22
    assert not Version.DRAFT_18.end_of_timed_out_range
    assert all(v.end_of_timed_out_range for v in VERSIONS[1:])


# =============================================================================================
# Stream types
# =============================================================================================
@pytest.mark.parametrize("version", VERSIONS)
def test_stream_types(version: Version) -> None:
    assert peek_stream_type(b"\x05\x00", version) == (StreamKind.FETCH, 5)
    assert peek_stream_type(b"\x10", version) == (StreamKind.SUBGROUP, 0x10)
    assert peek_stream_type(b"\x80\x10", version) == (StreamKind.SUBGROUP, 0x10)  # non-minimal
    assert peek_stream_type(b"\xaf\x00\x00\x00", version) == (StreamKind.CONTROL, 0x2F00)
    assert peek_stream_type(b"\xf0\x13\x2b\x3e\x28", version) == (StreamKind.PADDING, 0x132B3E28)
    assert peek_stream_type(b"", version) is None
    assert peek_stream_type(b"\xaf", version) is None
    assert peek_stream_type(b"\xf0\x13\x2b\x3e", version) is None
    assert sorted(SUBGROUP_HEADERS) == DRAFT18_SUBGROUP_TYPES
    for t in range(0x80):
        if t == 0x05 or t in SUBGROUP_HEADERS:
            continue
        with pytest.raises(WireError) as info:
            classify_stream_type(t)
        assert info.value.code == PV
    for t in (0x80, 0x90, 0x2F01, 0x132B3E29, 2**64 - 1):
        with pytest.raises(WireError):
            classify_stream_type(t)


# =============================================================================================
# Subgroup streams
# =============================================================================================
def _header_of(t: int) -> SubgroupHeader:
    mode = SubgroupIdMode((t >> 1) & 3)
    return SubgroupHeader(
        track_alias=2,
        group_id=0x45,
        subgroup_id={SubgroupIdMode.ZERO: 0, SubgroupIdMode.FIRST_OBJECT_ID: None,
                     SubgroupIdMode.EXPLICIT: 0x1234}[mode],
        publisher_priority=None if t & 0x20 else 0x80,
        subgroup_id_mode=mode,
        has_properties=bool(t & 0x01),
        end_of_group=bool(t & 0x08),
        first_object=bool(t & 0x40),
    )


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("t", sorted(SUBGROUP_HEADERS), ids=hex)
def test_subgroup_header_every_type(version: Version, t: int) -> None:
    data = SUBGROUP_HEADERS[t]
    header = _header_of(t)
    assert header.type_flags == t
    assert encode_subgroup_header(header, version) == data
    # The header alone (FIN right after it: a subgroup with no objects is valid).
    check_stream(subgroup_parser(version), data, [header])
    # Plus one object 9 with payload "hi" (Object ID Delta 9; Properties Length 0 if the
    # PROPERTIES flag is set). FIRST_OBJECT_ID mode: Subgroup ID becomes 9.
    obj = b"\x09" + (b"\x00" if t & 0x01 else b"") + b"\x02hi"
    sg = 9 if header.subgroup_id is None else header.subgroup_id
    check_stream(subgroup_parser(version), data + obj, [
        header, begin(0x45, sg, 9, header.publisher_priority, 2), ("payload", b"hi"),
        ObjectEnd(0x45, 9),
    ])
    enc = SubgroupStreamEncoder(header, version)
    assert enc.header() + enc.object(9, b"hi") == data + obj


@pytest.mark.parametrize("version", VERSIONS)
def test_subgroup_invalid_types(version: Version) -> None:
    for t in range(0x80):
        if t in SUBGROUP_HEADERS:
            continue
        check_violation(subgroup_parser(version), bytes([t]) + b"\x02\x45\x80")
    # Type values of 128 or more (two-byte vi64), even with the subgroup bits set.
    for data in (b"\x80\x90\x02\x45\x80", b"\x80\x80\x02\x45", b"\xaf\x00"):
        check_violation(subgroup_parser(version), data)


SUBGROUP_VECTORS = [
    pytest.param(
        # draft-20 §"Examples", first example: Type Flags 0x14, Track Alias 2, Group 0,
        # Subgroup 0, Priority 0; objects 0 "abcd" and 1 "efgh".
        b"\x14\x02\x00\x00\x00" b"\x00\x04abcd" b"\x00\x04efgh",
        [SubgroupHeader(2, 0, 0, 0), begin(0, 0, 0, 0, 4), ("payload", b"abcd"), ObjectEnd(0, 0),
         begin(0, 0, 1, 0, 4), ("payload", b"efgh"), ObjectEnd(0, 1)],
        id="draft-example-1",
    ),
    pytest.param(
        # draft-20 §"Examples", second example, with its property bytes made consistent:
        # Type Flags 0x35 (PROPERTIES, Subgroup ID present, DEFAULT_PRIORITY); object 0 has
        # Properties Length 22: {type 4 = 2186796243 (f0 82 57 dc d3)}, {type 77 (delta 73 =
        # 0x49), 14 bytes "traceID:123456"}; object 1 has Properties Length 0.
        b"\x35\x02\x00\x00"
        b"\x00\x16\x04\xf0\x82\x57\xdc\xd3\x49\x0etraceID:123456\x04abcd"
        b"\x00\x00\x04efgh",
        [SubgroupHeader(2, 0, 0, None, has_properties=True),
         begin(0, 0, 0, None, 4, props=[KVP(4, 2_186_796_243), KVP(77, b"traceID:123456")]),
         ("payload", b"abcd"), ObjectEnd(0, 0),
         begin(0, 0, 1, None, 4), ("payload", b"efgh"), ObjectEnd(0, 1)],
        id="draft-example-2",
    ),
    pytest.param(
        # Bytes a draft-22 peer (moq-rs) sent (moqt-reference §2.11): 0x59 = FIRST_OBJECT |
        # 0x10 | END_OF_GROUP | PROPERTIES, Subgroup ID 0 (mode 0b00), alias 0, group 15,
        # priority 0x80; object 0 with properties {0x10 TIMESTAMP: 15}, 10-byte payload.
        b"\x59\x00\x0f\x80\x00\x02\x10\x0f\x0axxxxxxxxxx",
        [SubgroupHeader(0, 15, 0, 0x80, SubgroupIdMode.ZERO, True, True, True),
         begin(15, 0, 0, 0x80, 10, props=[KVP(0x10, 15)]), ("payload", b"x" * 10),
         ObjectEnd(15, 0)],
        id="moq-rs-draft22",
    ),
    pytest.param(
        # 0x12: Subgroup ID = first Object ID (mode 0b01), priority 0x40; objects 7 and 8.
        b"\x12\x01\x05\x40\x07\x03abc\x00\x03def",
        [SubgroupHeader(1, 5, None, 0x40, SubgroupIdMode.FIRST_OBJECT_ID),
         begin(5, 7, 7, 0x40, 3), ("payload", b"abc"), ObjectEnd(5, 7),
         begin(5, 7, 8, 0x40, 3), ("payload", b"def"), ObjectEnd(5, 8)],
        id="first-object-id-mode",
    ),
    pytest.param(
        # 0x38: mode 0, END_OF_GROUP, default priority. Object 5 "a"; delta 2 -> object 8,
        # empty Normal object (length 0, status 0x00); object 9 with status End of Group.
        b"\x38\x01\x02\x05\x01a\x02\x00\x00\x00\x00\x03",
        [SubgroupHeader(1, 2, 0, None, SubgroupIdMode.ZERO, end_of_group=True),
         begin(2, 0, 5, None, 1), ("payload", b"a"), ObjectEnd(2, 5),
         begin(2, 0, 8, None, 0), ObjectEnd(2, 8),
         begin(2, 0, 9, None, 0, EOG), ObjectEnd(2, 9)],
        id="gaps-empty-end-of-group",
    ),
    pytest.param(
        # 0x31 (PROPERTIES): an End of Track status object with Properties Length 0.
        b"\x31\x01\x02\x00\x00\x00\x04",
        [SubgroupHeader(1, 2, 0, None, SubgroupIdMode.ZERO, has_properties=True),
         begin(2, 0, 0, None, 0, EOT), ObjectEnd(2, 0)],
        id="end-of-track",
    ),
    pytest.param(
        # Extreme values: alias 2**64-1 (9-byte vi64), group 2**56 (ff 01 00..), subgroup 2**42
        # (7-byte vi64 fc 04 00..), priority 9; Object ID Delta 2**64-1, payload "z".
        b"\x14" + b"\xff" * 9 + b"\xff\x01" + b"\x00" * 7 + b"\xfc\x04" + b"\x00" * 5 + b"\x09"
        + b"\xff" * 9 + b"\x01z",
        [SubgroupHeader(2**64 - 1, 2**56, 2**42, 9),
         begin(2**56, 2**42, 2**64 - 1, 9, 1), ("payload", b"z"), ObjectEnd(2**56, 2**64 - 1)],
        id="extreme-values",
    ),
]


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize(("data", "expected"), SUBGROUP_VECTORS)
def test_subgroup_vectors(version: Version, data: bytes, expected: list[object]) -> None:
    check_stream(subgroup_parser(version), data, expected)
    check_stream(lambda: DataStreamParser(version), data, expected)


def test_subgroup_encoder_reproduces_vectors() -> None:
    enc = SubgroupStreamEncoder(SubgroupHeader(2, 0, 0, None, has_properties=True))
    out = enc.header()
    out += enc.object(0, b"abcd", properties=[(4, 2_186_796_243), (77, b"traceID:123456")])
    out += enc.object(1, b"efgh")
    assert out == SUBGROUP_VECTORS[1].values[0]
    enc = SubgroupStreamEncoder(SubgroupHeader(1, 2, 0, None, SubgroupIdMode.ZERO,
                                               end_of_group=True))
    out = enc.header() + enc.object(5, b"a") + enc.object(8) + enc.object(9, status=EOG)
    assert out == SUBGROUP_VECTORS[4].values[0]
    # object_header + payload written separately gives the same bytes.
    enc = SubgroupStreamEncoder(SubgroupHeader(0, 15, 0, 0x80, SubgroupIdMode.ZERO, True, True,
                                               True))
    out = enc.header() + enc.object_header(0, 10, properties=b"\x10\x0f") + b"x" * 10
    assert out == SUBGROUP_VECTORS[2].values[0]


def test_subgroup_encoder_rejects() -> None:
    enc = SubgroupStreamEncoder(SubgroupHeader(1, 2))
    enc.object(3, b"a")
    with pytest.raises(ValueError):
        enc.object(3, b"a")  # IDs must increase
    with pytest.raises(ValueError):
        enc.object(4, properties=[(2, 1)])  # no PROPERTIES flag
    with pytest.raises(ValueError):
        enc.object(4, b"x", status=EOG)  # status objects carry no payload
    enc.object(4, status=EOT)
    with pytest.raises(ValueError):
        enc.object(5, b"a")  # nothing after End of Track
    with pytest.raises(ValueError):
        SubgroupHeader(1, 2, None)  # EXPLICIT needs an ID
    with pytest.raises(ValueError):
        SubgroupHeader(1, 2, 3, subgroup_id_mode=SubgroupIdMode.ZERO)
    with pytest.raises(ValueError):
        SubgroupHeader(1, 2, 0, subgroup_id_mode=SubgroupIdMode.FIRST_OBJECT_ID)
    with pytest.raises(ValueError):
        SubgroupHeader(1, 2, 0, 256)


# Type 0x30 (mode 0b00, DEFAULT_PRIORITY): header = 30 01 00 (alias 1, group 0); 0x31 adds
# PROPERTIES (every object then carries a Properties Length).
SUBGROUP_VIOLATIONS = [
    pytest.param(b"\x30\x01\x00" b"\x00\x00\x01", id="unknown-status-1"),
    pytest.param(b"\x30\x01\x00" b"\x00\x00\x05", id="unknown-status-5"),
    pytest.param(b"\x31\x01\x00" b"\x00\x02\x10\x0f\x00\x03", id="properties-on-end-of-group"),
    pytest.param(b"\x30\x01\x00" b"\x00\x00\x04" b"\x00\x01x", id="object-after-end-of-track"),
    pytest.param(b"\x30\x01\x00" b"\x00\x00\x03" b"\x00\x00\x00", id="object-after-end-of-group"),
    # Object 2**64-1 (empty), then Object ID Delta 0: 2**64.
    pytest.param(b"\x30\x01\x00" + b"\xff" * 9 + b"\x00\x00" + b"\x00\x01x",
                 id="object-id-overflow"),
    # Properties 01 05: odd type 1 announcing 5 bytes inside a 2-byte Properties field.
    pytest.param(b"\x31\x01\x00" b"\x00\x02\x01\x05" b"\x00\x00", id="truncated-property"),
    # Properties Length 65540 (c1 00 04) holding one odd KVP of length 65536 (c1 00 00).
    pytest.param(b"\x31\x01\x00\x00\xc1\x00\x04\x01\xc1\x00\x00" + b"p" * 65536 + b"\x00\x00",
                 id="property-value-over-65535"),
    # Properties Length 12: type 2**64-2 (ff ff..fe) = 0, then Delta Type 2 overflows.
    pytest.param(b"\x31\x01\x00\x00\x0c" + b"\xff" * 8 + b"\xfe\x00\x02\x00" + b"\x00\x00",
                 id="property-type-overflow"),
    pytest.param(b"\x14\x02\x00", id="fin-inside-header"),
    pytest.param(b"\x30\x01\x00" b"\x00\x05ab", id="fin-inside-payload"),
    pytest.param(b"\x31\x01\x00" b"\x00\x05\x01", id="fin-inside-properties"),
    pytest.param(b"\x30\x01\x00" b"\x00", id="fin-inside-object-header"),
    pytest.param(b"\x30\x01\x00" b"\x00\x00", id="fin-before-status"),
    pytest.param(b"", id="empty-stream"),
]


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("data", SUBGROUP_VIOLATIONS)
def test_subgroup_violations(version: Version, data: bytes) -> None:
    check_violation(subgroup_parser(version), data)


def test_subgroup_properties_local_limit() -> None:
    # Properties Length 17 (0x11): one odd KVP {1: 15 bytes}.
    data = b"\x31\x01\x00" b"\x00\x11" + b"\x01\x0f" + b"p" * 15 + b"\x00\x00"
    ok = SubgroupStreamParser(max_properties_length=17).feed(data, end_stream=True)
    assert ok[1].properties == (KVP(1, b"p" * 15),)
    err = check_violation(subgroup_parser(max_properties_length=16), data,
                          code=SessionErrorCode.INTERNAL_ERROR)
    assert isinstance(err, LimitExceeded) and err.stream_code == StreamResetCode.EXCESSIVE_LOAD


def test_subgroup_huge_payload_is_streamed_not_buffered() -> None:
    # Object Payload Length 2**60 (9-byte vi64 ff 10 00 ..): nothing may be allocated for it.
    header = b"\x30\x01\x00" b"\x00" + b"\xff\x10" + b"\x00" * 7
    chunk = bytes(64 * 1024)
    p = SubgroupStreamParser()
    tracemalloc.start()
    try:
        events = p.feed(header + chunk)
        total = sum(len(e.data) for e in events if isinstance(e, ObjectPayload))
        for _ in range(64):
            for ev in p.feed(chunk):
                assert isinstance(ev, ObjectPayload) and ev.data.obj is chunk
                total += len(ev.data)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert events[1].payload_length == 2**60
    assert total == 65 * len(chunk)
    assert peak < 256 * 1024  # far below one chunk copy per feed, let alone 2**60
    assert p.in_payload
    with pytest.raises(WireError):
        p.feed(b"", end_stream=True)


def test_split_header_is_carried_over_exactly() -> None:
    # A header split inside a vi64 and inside the properties; the payload that follows in the
    # same chunk is still handed out as a view of that chunk.
    # 0x11: PROPERTIES, mode 0b00, priority 5 | object delta 4, Properties Length 3 {1: "x"},
    # payload "abc".
    data = b"\x11\x01\x00\x05" b"\x04\x03\x01\x01x\x03abc"
    p = SubgroupStreamParser()
    assert p.feed(data[:5]) == [SubgroupHeader(1, 0, 0, 0x05, SubgroupIdMode.ZERO, True)]
    assert p.feed(data[5:7]) == []
    second = bytearray(data[7:])
    events = p.feed(second, end_stream=True)
    assert events[0] == begin(0, 0, 4, 5, 3, props=[KVP(1, b"x")])
    assert events[1].data.obj is second and bytes(events[1].data) == b"abc"
    assert events[2] == ObjectEnd(0, 4)
    assert p.subgroup_id == 0 and p.last_object_id == 4


def test_feed_after_end_is_an_error() -> None:
    p = SubgroupStreamParser()
    p.feed(b"\x10\x01\x00\x00", end_stream=True)
    with pytest.raises(ValueError):
        p.feed(b"\x00")


# =============================================================================================
# Fetch streams
# =============================================================================================
FETCH_VECTORS = [
    pytest.param(
        GroupOrder.ASCENDING,
        # FETCH_HEADER, Request ID 7.
        b"\x05\x07"
        # flags 0x1c: Group ID 5, Object ID 0 (both present, absolute on the first object),
        # priority 3; subgroup mode 0 -> Subgroup 0. Payload "ab".
        b"\x1c\x05\x00\x03\x02ab"
        # flags 0x00: same group, Subgroup 0, Object ID prior + 1, priority prior. "cd".
        b"\x00\x02cd"
        # End of Unknown Range (0x10C = vi64 81 0c) at {5, 9}; Object Payload Length 0.
        b"\x81\x0c\x05\x09\x00"
        # flags 0x6c: DATAGRAM | PROPERTIES | Group ID Delta 0 (-> 6) | Object ID 0 (absolute
        # because the group changed); priority inherited; properties {0x3c: 1}; empty payload.
        b"\x6c\x00\x00\x02\x3c\x01\x00",
        [FetchHeader(7), begin(5, 0, 0, 3, 2), ("payload", b"ab"), ObjectEnd(5, 0),
         begin(5, 0, 1, 3, 2), ("payload", b"cd"), ObjectEnd(5, 1),
         EndOfRange(EndOfRangeKind.UNKNOWN, 5, 9),
         begin(6, None, 0, 3, 0, props=[KVP(0x3C, 1)]), ObjectEnd(6, 0)],
        id="basic",
    ),
    pytest.param(
        GroupOrder.ASCENDING,
        b"\x05\x00"
        # 0x1f: group 1, Subgroup ID field 3, object 0, priority 0x40. "a"
        b"\x1f\x01\x03\x00\x40\x01a"
        # 0x01: Subgroup = prior (3); object 1; "b"
        b"\x01\x01b"
        # 0x06: Subgroup = prior + 1 (4); Object ID Delta 2 without Group: 1 + 2 = 3. "c"
        b"\x06\x02\x01c"
        # 0x0c: Group ID Delta 0 -> 2; Subgroup 0; Object ID 0; empty.
        b"\x0c\x00\x00\x00"
        # 0x10: new priority 0x41; group 2 object 1; empty.
        b"\x10\x41\x00",
        [FetchHeader(0), begin(1, 3, 0, 0x40, 1), ("payload", b"a"), ObjectEnd(1, 0),
         begin(1, 3, 1, 0x40, 1), ("payload", b"b"), ObjectEnd(1, 1),
         begin(1, 4, 3, 0x40, 1), ("payload", b"c"), ObjectEnd(1, 3),
         begin(2, 0, 0, 0x40, 0), ObjectEnd(2, 0),
         begin(2, 0, 1, 0x41, 0), ObjectEnd(2, 1)],
        id="subgroup-modes",
    ),
    pytest.param(
        GroupOrder.DESCENDING,
        # Descending: Group ID = prior - (delta + 1).
        b"\x05\x04"
        b"\x1c\x0a\x00\x80\x01a"  # group 10, object 0
        b"\x08\x02\x01b"  # group 10 - 3 = 7, object prior + 1 = 1 (regardless of group)
        b"\x0c\x06\x05\x00",  # group 7 - 7 = 0, object 5
        [FetchHeader(4), begin(10, 0, 0, 0x80, 1), ("payload", b"a"), ObjectEnd(10, 0),
         begin(7, 0, 1, 0x80, 1), ("payload", b"b"), ObjectEnd(7, 1),
         begin(0, 0, 5, 0x80, 0), ObjectEnd(0, 5)],
        id="descending",
    ),
    pytest.param(
        GroupOrder.ASCENDING,
        b"\x05\x02"
        # End of Non-Existent Range first: {0, 4}; then an object referring to it: flags 0x10
        # -> group 0, object 5, priority 7 (it must carry priority: no prior object).
        b"\x80\x8c\x00\x04\x00"
        b"\x10\x07\x00",
        [FetchHeader(2), EndOfRange(EndOfRangeKind.NON_EXISTENT, 0, 4),
         begin(0, 0, 5, 7, 0), ObjectEnd(0, 5)],
        id="end-of-range-first",
    ),
]


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize(("order", "data", "expected"), FETCH_VECTORS)
def test_fetch_vectors(version: Version, order: GroupOrder, data: bytes,
                       expected: list[object]) -> None:
    check_stream(fetch_parser(version, group_order=order), data, expected)
    # The order may also come from a lookup by Request ID.
    check_stream(fetch_parser(version, group_order=lambda rid: order), data, expected)
    check_stream(lambda: DataStreamParser(version, group_order=order), data, expected)


def test_fetch_encoder_reproduces_vectors() -> None:
    enc = FetchStreamEncoder(7)
    out = enc.header()
    out += enc.object(5, 0, b"ab", subgroup_id=0, publisher_priority=3)
    out += enc.object(5, 1, b"cd", subgroup_id=0, publisher_priority=3)
    out += enc.end_of_range(EndOfRangeKind.UNKNOWN, 5, 9)
    out += enc.object(6, 0, subgroup_id=None, publisher_priority=3, properties=[(0x3C, 1)])
    assert out == FETCH_VECTORS[0].values[1]
    enc = FetchStreamEncoder(0)
    out = enc.header() + enc.object(1, 0, b"a", subgroup_id=3, publisher_priority=0x40)
    out += enc.object(1, 1, b"b", subgroup_id=3, publisher_priority=0x40)
    out += enc.object(1, 3, b"c", subgroup_id=4, publisher_priority=0x40)
    out += enc.object(2, 0, subgroup_id=0, publisher_priority=0x40)
    out += enc.object_header(2, 1, 0, subgroup_id=0, publisher_priority=0x41)
    assert out == FETCH_VECTORS[1].values[1]
    enc = FetchStreamEncoder(4, group_order=GroupOrder.DESCENDING)
    out = enc.header() + enc.object(10, 0, b"a", subgroup_id=0, publisher_priority=0x80)
    out += enc.object(7, 1, b"b", subgroup_id=0, publisher_priority=0x80)
    out += enc.object(0, 5, subgroup_id=0, publisher_priority=0x80)
    assert out == FETCH_VECTORS[2].values[1]


@pytest.mark.parametrize("version", VERSIONS)
def test_fetch_end_of_range_kinds(version: Version) -> None:
    stream = b"\x05\x01" b"\x80\x8c\x02\x03\x00" b"\x81\x0c\x04\x00\x00"
    expected = [FetchHeader(1), EndOfRange(EndOfRangeKind.NON_EXISTENT, 2, 3),
                EndOfRange(EndOfRangeKind.UNKNOWN, 4, 0)]
    timed_out = b"\x82\x0c\x05\x01\x00"  # 0x20C, draft 20+
    then_object = b"\x14\x01\x80\x01z"  # group 5 (prior), object 1 + 1, priority 0x80, "z"
    if version.end_of_timed_out_range:
        check_stream(fetch_parser(version), stream + timed_out + then_object, [
            *expected, EndOfRange(EndOfRangeKind.TIMED_OUT, 5, 1), begin(5, 0, 2, 0x80, 1),
            ("payload", b"z"), ObjectEnd(5, 2)])
        assert FetchStreamEncoder(1, version).end_of_range(EndOfRangeKind.TIMED_OUT, 5, 1) \
            == timed_out
    else:
        check_stream(fetch_parser(version), stream, expected)
        check_violation(fetch_parser(version), stream + timed_out)
        with pytest.raises(ValueError):
            FetchStreamEncoder(1, version).end_of_range(EndOfRangeKind.TIMED_OUT, 5, 1)


FETCH_VIOLATIONS = [
    pytest.param(GroupOrder.ASCENDING, b"\x05\x00\x14\x00\x01\x00", id="first-without-group"),
    pytest.param(GroupOrder.ASCENDING, b"\x05\x00\x18\x00\x01\x00", id="first-without-object"),
    pytest.param(GroupOrder.ASCENDING, b"\x05\x00\x0c\x00\x00\x00", id="first-without-priority"),
    pytest.param(GroupOrder.ASCENDING, b"\x05\x00\x1d\x00\x00\x01\x00",
                 id="first-refers-to-prior-subgroup"),
    pytest.param(GroupOrder.ASCENDING, b"\x05\x00\x1e\x00\x00\x01\x00",
                 id="first-refers-to-prior-subgroup-plus-one"),
    pytest.param(GroupOrder.ASCENDING, b"\x05\x02\x80\x8c\x00\x04\x00\x00\x00",
                 id="after-end-of-range-no-priority"),
    pytest.param(GroupOrder.ASCENDING, b"\x05\x02\x80\x8c\x00\x04\x00\x11\x07\x00",
                 id="after-end-of-range-no-subgroup"),
    pytest.param(GroupOrder.ASCENDING, b"\x05\x00\x80\x80\x00\x00\x00", id="flags-0x80"),
    pytest.param(GroupOrder.ASCENDING, b"\x05\x00\x80\x8d\x00\x00\x00", id="flags-0x8d"),
    pytest.param(GroupOrder.ASCENDING, b"\x05\x00\x81\x8c\x00\x00\x00", id="flags-0x18c"),
    pytest.param(GroupOrder.ASCENDING, b"\x05\x00\x80\x8c\x00\x00\x01a",
                 id="end-of-range-with-payload"),
    pytest.param(GroupOrder.DESCENDING, b"\x05\x00\x1c\x01\x00\x00\x00\x08\x01\x00",
                 id="descending-below-zero"),
    pytest.param(GroupOrder.ASCENDING, b"\x05\x00\x1c" + b"\xff" * 9 + b"\x00\x00\x00\x08\x00\x00",
                 id="group-overflow"),
    pytest.param(GroupOrder.ASCENDING, b"\x05\x00\x1c\x00" + b"\xff" * 9 + b"\x00\x00\x00\x00",
                 id="object-overflow"),
    pytest.param(GroupOrder.ASCENDING, b"\x05\x00\x1c\x00\x01\x00\x00\x04" + b"\xff" * 9 + b"\x00",
                 id="object-delta-overflow"),
    pytest.param(GroupOrder.ASCENDING, b"\x05\x00\x1f\x00" + b"\xff" * 9 + b"\x00\x00\x00\x02\x00",
                 id="subgroup-overflow"),
    pytest.param(GroupOrder.ASCENDING, b"\x10\x00\x00\x00", id="not-a-fetch-header"),
    pytest.param(GroupOrder.ASCENDING, b"\x05", id="fin-inside-header"),
    pytest.param(GroupOrder.ASCENDING, b"\x05\x00\x1c\x00\x00\x00\x05ab", id="fin-inside-payload"),
    pytest.param(GroupOrder.ASCENDING, b"\x05\x00\x3c\x00\x00\x00\x03\x01", id="fin-inside-props"),
    pytest.param(GroupOrder.ASCENDING, b"\x05\x00\x3c\x00\x00\x00\x02\x01\x05\x00",
                 id="truncated-property"),
]


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize(("order", "data"), FETCH_VIOLATIONS)
def test_fetch_violations(version: Version, order: GroupOrder, data: bytes) -> None:
    check_violation(fetch_parser(version, group_order=order), data)


def test_fetch_datagram_object_then_subgroup_reference() -> None:
    # After a Datagram-preference object, "prior Subgroup ID" is taken from the last object that
    # had one (a lenient reading; our encoder never relies on it).
    data = b"\x05\x00" b"\x1f\x00\x02\x00\x01\x00" b"\x40\x00" b"\x01\x00"
    events = FetchStreamParser().feed(data, end_stream=True)
    assert [e.subgroup_id for e in events if isinstance(e, ObjectBegin)] == [2, None, 2]
    enc = FetchStreamEncoder(0)
    out = enc.header() + enc.object(0, 0, subgroup_id=2, publisher_priority=1)
    out += enc.object(0, 1, subgroup_id=None, publisher_priority=1)
    out += enc.object(0, 2, subgroup_id=2, publisher_priority=1)
    assert out.endswith(b"\x03\x02\x00")  # explicit Subgroup ID after the datagram object


def test_fetch_encoder_rejects() -> None:
    enc = FetchStreamEncoder(0)
    enc.object(5, 5, subgroup_id=0, publisher_priority=1)
    with pytest.raises(ValueError):
        enc.object(4, 0, subgroup_id=0, publisher_priority=1)  # against ascending order
    with pytest.raises(ValueError):
        enc.object(5, 5, subgroup_id=0, publisher_priority=1)  # not after the prior object
    with pytest.raises(ValueError):
        enc.object(6, 0, subgroup_id=0, publisher_priority=256)
    enc = FetchStreamEncoder(0, group_order=GroupOrder.DESCENDING)
    enc.object(5, 5, subgroup_id=0, publisher_priority=1)
    with pytest.raises(ValueError):
        enc.end_of_range(EndOfRangeKind.UNKNOWN, 6, 0)
    assert encode_fetch_header(2**64 - 1) == b"\x05" + b"\xff" * 9


# =============================================================================================
# Datagrams
# =============================================================================================
def _datagram_of(t: int) -> ObjectDatagram:
    props = (KVP(0x10, 15),) if t & 0x01 else ()
    status = (N if t & 0x01 else EOG) if t & 0x20 else N
    return ObjectDatagram(
        track_alias=2, group_id=3, object_id=0 if t & 0x04 else 5,
        publisher_priority=None if t & 0x08 else 0x40, status=status,
        payload=b"" if t & 0x20 else b"pq", end_of_group=bool(t & 0x02), properties=props,
    )


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("t", sorted(DATAGRAMS), ids=hex)
def test_datagram_every_type(version: Version, t: int) -> None:
    data = DATAGRAMS[t]
    expected = _datagram_of(t)
    got = parse_datagram(version, data)
    assert got == expected
    assert isinstance(got, ObjectDatagram)
    if not t & 0x20:
        assert got.payload.obj is data
    if t & 0x01:
        assert got.raw_properties == b"\x10\x0f"
    # Truncations are violations (a datagram is always whole) unless the cut only shortens
    # the payload.
    for cut in range(len(data)):
        try:
            short = parse_datagram(version, data[:cut])
        except WireError as e:
            assert e.code == PV
        else:
            assert not t & 0x20 and bytes(short.payload) == b"pq"[: cut - (len(data) - 2)]
    # Trailing bytes: more payload for payload datagrams, a violation after a status.
    if t & 0x20:
        with pytest.raises(WireError):
            parse_datagram(version, data + b"\x00")
    else:
        assert bytes(parse_datagram(version, data + b"r").payload) == b"pqr"
    # Encoding picks the same (shortest) type, except that an empty Normal object is sent
    # in payload form and a status datagram with properties cannot exist in other forms.
    if t & 0x20 and expected.status is N:
        assert encode_datagram(expected, version)[0] == t & ~0x20
    else:
        assert encode_datagram(expected, version) == data


@pytest.mark.parametrize("version", VERSIONS)
def test_datagram_invalid(version: Version) -> None:
    assert sorted(DATAGRAMS) == DRAFT18_DATAGRAM_TYPES
    for t in range(0x80):
        if t in DATAGRAMS:
            continue
        with pytest.raises(WireError) as info:
            parse_datagram(version, bytes([t]) + b"\x02\x03\x05\x40\x00")
        assert info.value.code == PV
    bad = [
        b"\x80\x30\x02\x03",  # type 0x30 (bit 4) as a two-byte vi64
        b"\x01\x02\x03\x05\x40\x00pq",  # PROPERTIES with Properties Length 0
        b"\x21\x02\x03\x05\x40\x02\x10\x0f\x03",  # properties on an End of Group status
        b"\x20\x02\x03\x05\x40\x01",  # unknown status
        b"\x20\x02\x03\x05\x40",  # status missing
        b"\x00\x02",  # truncated header
        b"",  # empty
        b"\x01\x02\x03\x05\x40\x05\x01",  # properties longer than the datagram
        b"\x01\x02\x03\x05\x40\x02\x01\x05",  # property value past the end of the properties
    ]
    for data in bad:
        with pytest.raises(WireError) as info:
            parse_datagram(version, data)
        assert info.value.code == PV


def test_padding() -> None:
    for version in VERSIONS:
        pad = b"\xf0\x13\x2b\x3e\x29\x00\x00\x00"
        assert parse_datagram(version, pad) == PaddingDatagram(3)
        assert encode_padding_datagram(3, version) == pad
        assert encode_padding_stream_header(version) == b"\xf0\x13\x2b\x3e\x28"
        stream = b"\xf0\x13\x2b\x3e\x28" + bytes(5)
        p = PaddingStreamParser(version)
        check_stream(lambda v=version: PaddingStreamParser(v), stream, [PaddingStreamHeader()],
                     trailing=None)
        assert p.feed(stream, end_stream=True) == [PaddingStreamHeader()] and p.discarded == 5
        check_stream(lambda v=version: DataStreamParser(v), stream, [PaddingStreamHeader()],
                     trailing=None)
        check_violation(lambda v=version: PaddingStreamParser(v, check_zero=True), stream + b"\x01")
        assert PaddingStreamParser(version).feed(stream + b"\x01", True) == [PaddingStreamHeader()]
        check_violation(lambda v=version: PaddingStreamParser(v), b"\xf0\x13\x2b\x3e\x29")
        check_violation(lambda v=version: PaddingStreamParser(v), b"\xf0\x13")


def test_data_stream_parser_dispatch() -> None:
    p = DataStreamParser()
    assert p.feed(b"\xf0\x13") == [] and p.kind is None
    assert p.feed(b"\x2b\x3e\x28\x00") == [PaddingStreamHeader()]
    assert p.kind is StreamKind.PADDING
    assert DataStreamParser().feed(b"\x05\x01") == [FetchHeader(1)]
    for bad in (b"\xaf\x00", b"\x06", b"\x17"):
        with pytest.raises(WireError):
            DataStreamParser().feed(bad)
    with pytest.raises(WireError):
        DataStreamParser().feed(b"\xaf", end_stream=True)


# =============================================================================================
# Hypothesis: round trips under random chunking
# =============================================================================================
_vi = st.integers(0, 2**64 - 1)
_small = st.integers(0, 300)
_prio = st.integers(0, 255)
_props = st.lists(
    st.one_of(
        st.tuples(st.integers(0, 2**20).map(lambda t: 2 * t), _vi),
        st.tuples(st.integers(0, 2**20).map(lambda t: 2 * t + 1), st.binary(max_size=20)),
    ),
    max_size=4,
).map(lambda ps: tuple(KVP(*p) for p in sorted(ps, key=lambda p: p[0])))


@st.composite
def subgroup_streams(draw):
    mode = draw(st.sampled_from(list(SubgroupIdMode)))
    header = SubgroupHeader(
        track_alias=draw(_vi), group_id=draw(_vi),
        subgroup_id={SubgroupIdMode.ZERO: 0, SubgroupIdMode.FIRST_OBJECT_ID: None}.get(
            mode, draw(_vi)),
        publisher_priority=draw(st.one_of(st.none(), _prio)), subgroup_id_mode=mode,
        has_properties=draw(st.booleans()), end_of_group=draw(st.booleans()),
        first_object=draw(st.booleans()),
    )
    objects = []
    oid = draw(st.integers(0, 2**64 - 40))
    for i in range(draw(st.integers(0, 6))):
        oid += draw(st.integers(0 if i == 0 else 1, 5))
        objects.append((oid, draw(st.binary(max_size=40)),
                        draw(_props) if header.has_properties else ()))
    status = draw(st.sampled_from([None, EOG, EOT]))
    return header, objects, status


def chunked(data: bytes, cuts: list[int]) -> list[int]:
    sizes, total = [], 0
    for c in cuts:
        if total + c >= len(data):
            break
        sizes.append(c)
        total += c
    return sizes


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(subgroup_streams(), st.sampled_from(VERSIONS), st.lists(st.integers(1, 13), max_size=30))
def test_subgroup_round_trip(stream, version: Version, cuts: list[int]) -> None:
    header, objects, status = stream
    enc = SubgroupStreamEncoder(header, version)
    data = enc.header()
    expected: list[object] = [header]
    sg = header.subgroup_id
    last = objects[-1][0] if objects else -1
    for oid, payload, props in objects:
        data += enc.object(oid, payload, properties=props)
        sg = oid if sg is None else sg
        expected.append(begin(header.group_id, sg, oid, header.publisher_priority, len(payload),
                              props=props))
        if payload:
            expected.append(("payload", payload))
        expected.append(ObjectEnd(header.group_id, oid))
    if status is not None and last < 2**64 - 1:
        data += enc.object(last + 1, status=status)
        sg = last + 1 if sg is None else sg
        expected += [begin(header.group_id, sg, last + 1, header.publisher_priority, 0, status),
                     ObjectEnd(header.group_id, last + 1)]
    events = feed_chunks(SubgroupStreamParser(version), data, chunked(data, cuts))
    assert collapse(events) == expected


@st.composite
def fetch_streams(draw):
    order = draw(st.sampled_from(list(GroupOrder)))
    group = draw(st.integers(1000, 2**63))
    obj = draw(st.integers(0, 2**40))
    items = []
    for i in range(draw(st.integers(0, 8))):
        if i:
            if draw(st.booleans()):
                step = draw(st.integers(1, 5))
                group = group + step if order is GroupOrder.ASCENDING else group - step
                obj = draw(st.integers(0, 50))
            else:
                obj += draw(st.integers(1, 4))
        if draw(st.integers(0, 5)) == 0:
            items.append(("eor", draw(st.sampled_from(list(EndOfRangeKind))), group, obj))
        else:
            items.append(("obj", group, obj,
                          draw(st.one_of(st.none(), st.integers(0, 4), _vi)),
                          draw(st.sampled_from([0, 1, 2, 200])), draw(_props),
                          draw(st.binary(max_size=30))))
    return order, draw(_vi), items


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(fetch_streams(), st.sampled_from(VERSIONS), st.lists(st.integers(1, 13), max_size=30))
def test_fetch_round_trip(stream, version: Version, cuts: list[int]) -> None:
    order, request_id, items = stream
    enc = FetchStreamEncoder(request_id, version, order)
    data = enc.header()
    expected: list[object] = [FetchHeader(request_id)]
    for item in items:
        if item[0] == "eor":
            _, kind, group, obj = item
            if kind is EndOfRangeKind.TIMED_OUT and not version.end_of_timed_out_range:
                kind = EndOfRangeKind.UNKNOWN
            data += enc.end_of_range(kind, group, obj)
            expected.append(EndOfRange(kind, group, obj))
        else:
            _, group, obj, sg, prio, props, payload = item
            data += enc.object(group, obj, payload, subgroup_id=sg, publisher_priority=prio,
                               properties=props)
            expected.append(begin(group, sg, obj, prio, len(payload), props=props))
            if payload:
                expected.append(("payload", payload))
            expected.append(ObjectEnd(group, obj))
    events = feed_chunks(FetchStreamParser(version, group_order=order), data,
                         chunked(data, cuts))
    assert collapse(events) == expected


@given(
    st.builds(
        ObjectDatagram,
        track_alias=_vi, group_id=_vi, object_id=st.one_of(st.just(0), _vi),
        publisher_priority=st.one_of(st.none(), _prio),
        status=st.just(N), payload=st.binary(max_size=50), end_of_group=st.booleans(),
        properties=_props,
    ) | st.builds(
        ObjectDatagram,
        track_alias=_vi, group_id=_vi, object_id=_vi,
        publisher_priority=st.one_of(st.none(), _prio),
        status=st.sampled_from([EOG, EOT]),
    ),
    st.sampled_from(VERSIONS),
)
def test_datagram_round_trip(datagram: ObjectDatagram, version: Version) -> None:
    data = encode_datagram(datagram, version)
    assert parse_datagram(version, data) == datagram
    # Forwarding a parsed datagram keeps its property bytes as they were.
    parsed = parse_datagram(version, data)
    assert encode_datagram(parsed, version) == data


# =============================================================================================
# Fuzz: only WireError may escape, and nothing hangs
# =============================================================================================
_prefixes = st.sampled_from([b"", b"\x05", b"\x05\x00", b"\x10\x00\x00", b"\x11\x00\x00",
                             b"\x3d\x01\x02\x03", b"\x12\x00\x00\x80",
                             b"\xf0\x13\x2b\x3e\x28", b"\xaf\x00"])


def _fuzz_stream(data: bytes, sizes: list[int], end: bool) -> None:
    for factory in (SubgroupStreamParser, FetchStreamParser, PaddingStreamParser,
                    DataStreamParser,
                    lambda: FetchStreamParser(group_order=GroupOrder.DESCENDING),
                    lambda: SubgroupStreamParser(max_properties_length=8)):
        p = factory()
        pos = 0
        try:
            for size in sizes:
                for ev in p.feed(data[pos : pos + size]):
                    assert ev is not None
                pos += size
            p.feed(data[pos:], end_stream=end)
        except WireError:
            pass


@settings(max_examples=300, deadline=None)
@given(_prefixes, st.binary(max_size=80), st.lists(st.integers(1, 9), max_size=12),
       st.booleans())
def test_fuzz_streams_random_bytes(prefix: bytes, body: bytes, sizes: list[int],
                                   end: bool) -> None:
    _fuzz_stream(prefix + body, sizes, end)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(subgroup_streams(), fetch_streams(), st.lists(st.tuples(st.integers(0, 10**6),
                                                               st.integers(0, 255)),
                                                     min_size=1, max_size=4),
       st.lists(st.integers(1, 9), max_size=12))
def test_fuzz_streams_mutated(sub, fetch, flips, sizes) -> None:
    header, objects, _ = sub
    enc = SubgroupStreamEncoder(header)
    a = enc.header() + b"".join(enc.object(o, p, properties=pr) for o, p, pr in objects)
    order, rid, items = fetch
    fenc = FetchStreamEncoder(rid, Version.DRAFT_22, order)
    b = fenc.header()
    for item in items:
        if item[0] == "eor":
            b += fenc.end_of_range(item[1], item[2], item[3])
        else:
            _, g, o, sg, pr, props, payload = item
            b += fenc.object(g, o, payload, subgroup_id=sg, publisher_priority=pr,
                             properties=props)
    for data in (a, b):
        mutated = bytearray(data)
        for at, value in flips:
            mutated[at % len(mutated)] = value
        _fuzz_stream(bytes(mutated), sizes, True)
        _fuzz_stream(bytes(mutated[: len(mutated) // 2]), sizes, True)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=60), st.sampled_from(VERSIONS))
def test_fuzz_datagrams(data: bytes, version: Version) -> None:
    try:
        parse_datagram(version, data)
    except WireError as e:
        assert e.code == PV or isinstance(e, LimitExceeded)


def test_error_registries() -> None:
    from kvsp_moq.moqt.errors import (
        PublishDoneCode,
        RequestErrorCode,
        is_grease,
        publish_done_code,
        request_error_code,
        stream_reset_code,
    )

    assert SessionErrorCode.PROTOCOL_VIOLATION == 0x3
    assert SessionErrorCode.KEY_VALUE_FORMATTING_ERROR == 0x6
    assert RequestErrorCode.REDIRECT == 0x34 and PublishDoneCode.TRACK_ENDED == 0x2
    # Unknown codes received in REQUEST_ERROR / PUBLISH_DONE / resets read as INTERNAL_ERROR.
    assert request_error_code(0x9D) is RequestErrorCode.INTERNAL_ERROR
    assert publish_done_code(0x7) is PublishDoneCode.INTERNAL_ERROR
    assert stream_reset_code(0x12) is StreamResetCode.MALFORMED_TRACK
    assert is_grease(0x9D) and is_grease(0x7F * 3 + 0x9D) and not is_grease(0x9E)
    assert str(WireError(PV, "x")) == "PROTOCOL_VIOLATION: x"
