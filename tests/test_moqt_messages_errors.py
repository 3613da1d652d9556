"""MOQT control messages: every malformed input gives the error the draft names, the limits
(32 fields, empty field, 4096-byte full name, 1024-byte reason, 8192-byte URI, 65535-byte
message) are enforced both ways, hostile lengths allocate nothing, and the session-side
checks (precise parameter lists, Track Properties in REQUEST_OK, Redirect) work.

Input bytes are written by hand; sections are those of draft-20 (editor's copy) / draft-18.
"""

from __future__ import annotations

import tracemalloc
from typing import Any

import pytest

from kvsp_moq.moqt.messages import (
    MAX_MESSAGE_LENGTH,
    ControlStreamReader,
    Fetch,
    GoAway,
    Location,
    LocationFilter,
    MessageParameters,
    Namespace,
    ParamContext,
    ParameterType,
    PublishDone,
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
    Token,
    allowed_parameter_types,
    check_parameters,
    check_redirect,
    check_request_ok,
    check_request_update,
    decode_message,
    defined_parameter_types,
    encode_message,
)
from kvsp_moq.moqt.objects import GroupOrder
from kvsp_moq.moqt.version import Version
from kvsp_moq.wire import KeyValuePair, SessionErrorCode, WireError, encode_vi64

V18, V20, V21, V22 = Version.DRAFT_18, Version.DRAFT_20, Version.DRAFT_21, Version.DRAFT_22
ALL = (V18, V20, V21, V22)
PV = SessionErrorCode.PROTOCOL_VIOLATION
KVFE = SessionErrorCode.KEY_VALUE_FORMATTING_ERROR
P = MessageParameters


def h(text: str) -> bytes:
    return bytes.fromhex(text.replace(" ", ""))


def frame(message_type: int, body: bytes) -> bytes:
    return encode_vi64(message_type) + len(body).to_bytes(2, "big") + body


def assert_error(version: Version, data: bytes, code: int) -> None:
    """Decoding whole, and through ControlStreamReader whole and byte by byte, gives ``code``."""
    with pytest.raises(WireError) as err:
        decode_message(version, data)
    assert err.value.code == code, err.value
    reader = ControlStreamReader(version)
    with pytest.raises(WireError) as err:
        reader.feed(data, end_stream=True)
    assert err.value.code == code
    with pytest.raises(WireError):  # the reader stays dead
        reader.feed(b"")
    reader = ControlStreamReader(version)
    with pytest.raises(WireError) as err:
        for i in range(len(data)):
            reader.feed(data[i : i + 1], end_stream=i == len(data) - 1)
    assert err.value.code == code


# Subscribe(0, ("a",), "t", <params>) body prefix: Request ID, namespace, name.
SUB = "00 010161 0174"


def subscribe(params_hex: str) -> bytes:
    return frame(0x03, h(SUB + params_hex))


# =============================================================================================
# Framing (§"Control Messages")
# =============================================================================================
@pytest.mark.parametrize("version", ALL)
@pytest.mark.parametrize(
    "message_type",
    [0x01, 0x40, 0x41, 0x20, 0x21, 0x1E, 0x11, 0x09, 0x7F, 0x2F01, 0x9D],
    ids=hex,
)
def test_unknown_message_type(version: Version, message_type: int) -> None:
    # reserved SETUPs (0x01, 0x40, 0x41, 0x20, 0x21), PUBLISH_OK (<= 17; draft 18's table still
    # lists it, so it is known there), 0x11 (the <= 17 SUBSCRIBE_NAMESPACE), unassigned,
    # GREASE-like
    if message_type == 0x1E and version is Version.DRAFT_18:
        assert decode_message(version, frame(0x1E, b"\x00")) is not None  # PUBLISH_OK in 18
        return
    data = frame(message_type, b"\x00")
    assert_error(version, data, PV)
    # Known to be unknown as soon as the type is read, without waiting for the body.
    with pytest.raises(WireError):
        decode_message(version, encode_vi64(message_type))


def test_message_types_of_other_versions_are_unknown() -> None:
    assert_error(V18, h("22 0001 00"), PV)  # PUBLISH_STATE_NOTIFY is 20+
    for version in (V20, V21, V22):
        # 0x16 FETCH with a draft-18 body: Request ID, Fetch Type 01, ... is a draft-20 FETCH
        # whose namespace has 1 field "\x01"... so use a joining shape that cannot parse.
        assert_error(version, h("16 0005 08 02 04 03 00"), PV)


@pytest.mark.parametrize("version", ALL)
@pytest.mark.parametrize(
    "data",
    [
        "07 0000",  # REQUEST_OK without Number of Parameters
        "0b 0002 02 03",  # PUBLISH_DONE without Error Reason
        "0b 0004 02 03 00 00",  # PUBLISH_DONE with a byte over
        "05 0003 34 00 00",  # REDIRECT without the Redirect structure
        "05 0004 10 00 00 00",  # REQUEST_ERROR with a byte over
        "10 0004 00 00 00 00",  # GOAWAY with a byte over (after 18's Request ID)
        "08 0003 01 02 6a",  # NAMESPACE field runs past the body
        "04 0003 00 01 09",  # SUBSCRIBE_OK: LARGEST_OBJECT cut off
        "18 0002 01 02",  # FETCH_OK cut inside End Location
    ],
)
def test_length_mismatch(version: Version, data: str) -> None:
    assert_error(version, h(data), PV)


def test_goaway_request_id_only_in_18() -> None:
    data = h("10 0003 00 00 04")
    assert decode_message(V18, data) == (GoAway("", 0, 4), 6)
    for version in (V20, V21, V22):
        assert_error(version, data, PV)


def test_incomplete_is_none_and_fin_inside_is_violation() -> None:
    data = encode_message(V22, Subscribe(1, (b"ns",), b"name"))
    for cut in range(1, len(data)):
        assert decode_message(V22, data[:cut]) is None
        reader = ControlStreamReader(V22)
        with pytest.raises(WireError) as err:
            reader.feed(data[:cut], end_stream=True)
        assert err.value.code == PV
    assert ControlStreamReader(V22).feed(b"", end_stream=True) == []
    reader = ControlStreamReader(V22)
    reader.feed(b"", end_stream=True)
    with pytest.raises(ValueError):
        reader.feed(b"\x07")


# =============================================================================================
# Names (§"Track Naming")
# =============================================================================================
def _namespace_hex(fields: list[bytes]) -> str:
    return (encode_vi64(len(fields)) + b"".join(encode_vi64(len(f)) + f for f in fields)).hex()


@pytest.mark.parametrize("version", ALL)
def test_namespace_limits(version: Version) -> None:
    def sub(fields: list[bytes], name: bytes) -> bytes:
        body = "00" + _namespace_hex(fields) + (encode_vi64(len(name)) + name).hex() + "00"
        return frame(0x03, h(body))

    ok32 = sub([b"a"] * 32, b"t")
    assert decode_message(version, ok32)[0].track_namespace == (b"a",) * 32
    assert_error(version, sub([b"a"] * 33, b"t"), PV)  # > 32 fields
    assert_error(version, sub([b"a", b"", b"b"], b"t"), PV)  # empty field
    assert decode_message(version, sub([b"x" * 4000], b"y" * 96)) is not None  # 4096: fine
    assert_error(version, sub([b"x" * 4000], b"y" * 97), PV)  # Full Track Name 4097
    assert_error(version, sub([b"x" * 2048, b"y" * 2049], b""), PV)  # Track Namespace 4097
    # Hostile counts and lengths are rejected before anything is read or allocated.
    assert_error(version, frame(0x03, h("00") + encode_vi64(1 << 60) + h("01 61")), PV)
    assert_error(version, frame(0x03, h("00 01") + encode_vi64(1 << 62) + h("61")), PV)
    assert_error(version, frame(0x03, h("00 00") + encode_vi64(1 << 62) + h("74")), PV)
    # The same structure everywhere: a suffix, a prefix, a Redirect, a parameter.
    assert_error(version, frame(0x08, h(_namespace_hex([b"a"] * 33))), PV)
    assert_error(version, frame(0x50, h("01" + _namespace_hex([b"a"] * 33) + "00")), PV)
    assert_error(version, frame(0x0F, h(_namespace_hex([b"x" * 4000]) + "8061" + "79" * 97)), PV)
    assert_error(
        version, frame(0x05, h("34 00 00 00" + _namespace_hex([b"a", b""]) + "00")), PV
    )
    assert_error(version, frame(0x02, h("06 01 34" + _namespace_hex([b"a"] * 33))), PV)


def test_namespace_limits_on_encode() -> None:
    with pytest.raises(ValueError):
        Subscribe(0, (b"a",) * 33, b"t")
    with pytest.raises(ValueError):
        Namespace((b"a", b""))
    with pytest.raises(ValueError):
        encode_message(V22, Subscribe(0, (b"x" * 4000,), b"y" * 97))
    with pytest.raises(TypeError):
        Subscribe(0, b"abc", b"t")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        encode_message(V22, RequestUpdate(0, P(track_namespace_prefix=(b"a",) * 33)))


# =============================================================================================
# Reason Phrase and URIs
# =============================================================================================
@pytest.mark.parametrize("version", ALL)
def test_reason_phrase_limit(version: Version) -> None:
    ok = frame(0x0B, h("02 03") + encode_vi64(1024) + b"r" * 1024)
    assert decode_message(version, ok)[0] == PublishDone(2, 3, "r" * 1024)
    assert_error(version, frame(0x0B, h("02 03") + encode_vi64(1025) + b"r" * 1025), PV)
    assert_error(version, frame(0x05, h("10 00") + encode_vi64(1 << 62)), PV)
    with pytest.raises(ValueError):
        encode_message(version, PublishDone(2, 3, "r" * 1025))
    # Not UTF-8: diagnostic text, replaced rather than rejected.
    got = decode_message(version, frame(0x05, h("10 00 01 ff")))[0]
    assert got == RequestError(0x10, 0, "\ufffd")


@pytest.mark.parametrize("version", ALL)
def test_uri_limits(version: Version) -> None:
    ok = frame(0x10, encode_vi64(8192) + b"u" * 8192 + h("00"))
    assert decode_message(version, ok)[0] == GoAway("u" * 8192)
    assert_error(version, frame(0x10, encode_vi64(8193) + b"u" * 8193 + h("00")), PV)
    with pytest.raises(ValueError):
        encode_message(version, GoAway("u" * 8193))
    assert_error(version, frame(0x10, h("01 ff 00")), PV)  # not UTF-8
    assert_error(version, frame(0x05, h("34 00 00 01 ff 00 00")), PV)  # Redirect URI


# =============================================================================================
# Parameters (§"Message Parameters")
# =============================================================================================
@pytest.mark.parametrize("version", ALL)
@pytest.mark.parametrize(
    ("params", "why"),
    [
        ("01 05 00", "unknown type 0x05"),
        ("01 01 00", "unknown type 0x01"),
        ("01 24 00", "unknown type 0x24"),
        ("01 3600", "unknown type 0x36"),
        ("01 08 80", "EXPIRES not listed for SUBSCRIBE, and its value ends early"),
        ("02 1001 0002", "FORWARD 2 in a second, ignored, FORWARD... repeated first"),
        ("02 1001 0001", "FORWARD repeated"),
        ("02 2080 0080", "SUBSCRIBER_PRIORITY repeated"),
        ("01 1002", "FORWARD 2"),
        ("01 22 00", "GROUP_ORDER 0"),
        ("01 22 03", "GROUP_ORDER 3"),
        ("02 02 00" + "ffffffffffffffffff 00", "type overflows 2^64-1"),
        ("02 1001", "count says 2, one present"),
        ("01 03 09 0300", "AUTHORIZATION_TOKEN runs past the message"),
    ],
)
def test_parameter_errors(version: Version, params: str, why: str) -> None:
    assert_error(version, subscribe(params), PV)


def decoded(version: Version, data: bytes) -> Any:
    """The message ``data`` decodes to (typed loosely: tests read message-specific fields)."""
    got = decode_message(version, data)
    assert got is not None
    return got[0]


def assert_ignored(version: Version, data: bytes) -> Any:
    """``data`` decodes (whole, and through ControlStreamReader byte by byte) to a message
    whose parameters are empty: the known parameter its message does not list was ignored
    (draft-22 §"Message Parameters" names a close only for unknown and duplicate ones)."""
    got = decode_message(version, data)
    assert got is not None and got[1] == len(data)
    assert got[0].parameters == P(), got[0]  # type: ignore[attr-defined]
    reader = ControlStreamReader(version)
    msgs = [m for i in range(len(data)) for m in reader.feed(data[i:i + 1])]
    assert msgs == [got[0]]
    return got[0]


@pytest.mark.parametrize("version", ALL)
@pytest.mark.parametrize(
    ("params", "why"),
    [
        ("01 08 00", "EXPIRES is not listed for SUBSCRIBE"),
        ("01 09 0000", "LARGEST_OBJECT is not listed for SUBSCRIBE"),
        ("01 0a 00", "FILL_TIMEOUT is not listed for SUBSCRIBE"),
        ("01 34 00", "TRACK_NAMESPACE_PREFIX is not listed for SUBSCRIBE"),
        ("02 08 00 00 01", "two of them, the second repeated: ignored too"),
    ],
)
def test_parameter_not_listed_is_ignored(version: Version, params: str, why: str) -> None:
    assert assert_ignored(version, subscribe(params)) == decoded(version, subscribe("00"))


@pytest.mark.parametrize("version", ALL)
def test_parameters_per_message(version: Version) -> None:
    # A known parameter in a message that does not list it is ignored (docs/interop.md,
    # "Leniency"); its value must still be well formed.
    # FETCH_OK: no parameter is listed for it.
    assert_ignored(version, frame(0x18, h("00 0000 01 09 0000")))
    assert_ignored(version, frame(0x18, h("00 0000 01 08 00")))
    # SUBSCRIBE_OK: EXPIRES and LARGEST_OBJECT only.
    assert_ignored(version, frame(0x04, h("00 01 10 01")))
    assert_error(version, frame(0x04, h("00 01 10 02")), PV)  # FORWARD 2: malformed anyway
    # PUBLISH_NAMESPACE / SUBSCRIBE_NAMESPACE: AUTHORIZATION_TOKEN only (FORWARD in
    # SUBSCRIBE_NAMESPACE was seen from another stack, issue 18).
    assert_ignored(version, frame(0x06, h("00 00 01 1001")))
    assert_ignored(version, frame(0x50, h("00 00 01 2001")))
    assert_ignored(version, frame(0x50, h("00 00 01 1001")))
    # TRACK_STATUS: "subscriber parameters related to Track delivery ... are not included".
    assert_ignored(version, frame(0x0D, h(SUB + "01 2001")))
    # REQUEST_OK: never AUTHORIZATION_TOKEN.
    assert_ignored(version, frame(0x07, h("01 0302 0205")))


def test_parameters_per_version() -> None:
    # In draft 18 these are unknown types.
    for params in ("01 35 00", "01 23 00", "01 25 00", "01 2900"):
        assert_error(V18, subscribe(params), PV)
    # GROUP_ORDER in PUBLISH: 20+ only (ignored in 18).
    publish = frame(0x1D, h("01 01026b76 0174 07 01 2201"))
    assert_ignored(V18, publish)
    assert decoded(V22, publish).parameters == P(group_order=GroupOrder(1))
    # PUBLISH_OK (REQUEST_OK) could carry SUBSCRIBER_PRIORITY in 18, not in 20+ (ignored).
    ok = frame(0x07, h("01 2005"))
    assert decoded(V18, ok) == RequestOk(P(subscriber_priority=5))
    for version in (V20, V21, V22):
        assert assert_ignored(version, ok) == RequestOk()
    # INCLUDE_PROPERTIES 2 → PROTOCOL_VIOLATION.
    assert_error(V22, subscribe("01 3502"), PV)
    assert set(defined_parameter_types(V18)) == {
        0x02, 0x03, 0x04, 0x06, 0x08, 0x09, 0x0A, 0x10, 0x20, 0x21, 0x22, 0x32, 0x34}
    assert set(defined_parameter_types(V22)) == set(ParameterType)


def test_parameter_errors_on_encode() -> None:
    with pytest.raises(ValueError):
        encode_message(V22, Subscribe(0, (), b"", P(expires=1)))
    with pytest.raises(ValueError):
        encode_message(V18, Subscribe(0, (), b"", P(include_properties=True)))
    with pytest.raises(ValueError):
        encode_message(V22, Subscribe(0, (), b"", P(subscriber_priority=256)))
    with pytest.raises(ValueError):
        encode_message(V22, Subscribe(0, (), b"", P(fill_parameters=P(forward=True))))


# -- AUTHORIZATION TOKEN (§"AUTHORIZATION TOKEN Parameter") ----------------------------------
@pytest.mark.parametrize("version", ALL)
@pytest.mark.parametrize(
    "token",
    [
        "04 0000",  # Alias Type 4 does not exist
        "00",  # DELETE without its alias
        "02 0501",  # USE_ALIAS with a byte over
        "01 05",  # REGISTER without Token Type
        "",  # no Alias Type at all
        "03",  # USE_VALUE without Token Type
    ],
)
def test_malformed_token(version: Version, token: str) -> None:
    raw = h(token)
    params = "01 03" + encode_vi64(len(raw)).hex() + token
    assert_error(version, subscribe(params), KVFE)
    setup = frame(0x2F00, h("03") + encode_vi64(len(raw)) + raw)
    assert_error(version, setup, KVFE)


# -- LOCATION_FILTER in its three shapes (filters.py) -----------------------------------------
@pytest.mark.parametrize(
    ("versions", "value"),
    [
        ((V22,), "06"),  # no Location Filter Type 6
        ((V22,), "02 00"),  # type 2 needs StartGroup and StartObject (moq-rs: "short buffer")
        ((V22,), "03 ffffffffffffffffff 00 01"),  # StartGroup + EndGroupDelta > 2^64-1
        ((V20, V21), "05 0000000000"),  # more than 4 fields
        ((V20, V21), "01 80"),  # a vi64 cut by the length
        ((V20, V21), "05"),  # draft-22 Next Object bytes on draft 20: length 5, no bytes
        ((V20, V21), "0b ffffffffffffffffff 00 01"),  # end group overflow
        ((V18,), "00"),  # empty: no Filter Type
        ((V18,), "01 05"),  # Filter Type 5
        ((V18,), "01 00"),  # Filter Type 0
        ((V18,), "02 02 00"),  # bytes after Largest Object
        ((V18,), "02 03 00"),  # AbsoluteStart cut
        ((V18,), "0c 04 ffffffffffffffffff 00 01"),  # AbsoluteRange end overflow
    ],
)
def test_location_filter_errors(versions: tuple[Version, ...], value: str) -> None:
    for version in versions:
        assert_error(version, subscribe("01 21" + value), PV)


def test_location_filter_field_sizes_20() -> None:
    # Draft 20/21 counts fields, not bytes: len 02 holding one 2-byte vi64 is StartGroup 0.
    got = decode_message(V20, subscribe("01 21 02 8000"))[0]
    assert got.parameters.location_filter == LocationFilter.relative_start(0)


def test_location_filters_not_expressible() -> None:
    def sub(f: LocationFilter) -> Subscribe:
        return Subscribe(0, (), b"", P(location_filter=f))

    none, relative, zero = (
        LocationFilter.none(), LocationFilter.relative_start(1), LocationFilter.absolute((0, 0)))
    for version, f in ((V18, none), (V18, relative), (V20, zero), (V21, zero)):
        with pytest.raises(ValueError):
            encode_message(version, sub(f))
    for f in (none, relative, zero):  # all fine in draft 22
        encode_message(V22, sub(f))


# -- FILL_PARAMETERS (20+) ----------------------------------------------------------------------
@pytest.mark.parametrize("version", (V20, V21, V22))
def test_fill_parameters_errors(version: Version) -> None:
    # FORWARD is not listed inside FILL_PARAMETERS: ignored (the block itself stays).
    assert decoded(version, subscribe("01 23 03 01 1001")).parameters == P(fill_parameters=P())
    # FILL_PARAMETERS is not listed inside FILL_PARAMETERS: ignored too.
    assert decoded(version, subscribe("01 23 04 01 2301 00")).parameters == P(
        fill_parameters=P())
    assert_error(version, subscribe("01 23 05 02 2001 0002"), PV)  # repeated inside
    assert_error(version, subscribe("01 23 04 01 20"), PV)  # runs past the message
    # The block bounds its parameters: a GROUP_ORDER whose value lies outside it.
    assert_error(version, subscribe("01 23 02 01 22 01"), PV)
    assert_error(version, frame(0x02, h("00 01 2302 01 22 01")), PV)
    # The block holds Number of Parameters and exactly that many: a byte after them is an error.
    assert_error(version, subscribe("01 23 04 01 0a05 00"), PV)
    # Its scope is its own: FILL_TIMEOUT inside is fine although SUBSCRIBE may not carry it.
    got = decode_message(version, subscribe("01 23 03 01 0a05"))[0]
    assert got.parameters.fill_parameters == P(fill_timeout=5)
    # Range filters inside: draft 22 only (our reading of its eight nested parameters).
    nested = subscribe("01 23 04 01 25 01 00")  # SUBGROUP_FILTER len 01 {SetID 00}
    if version is V22:
        assert decode_message(version, nested)[0].parameters.fill_parameters == P(
            subgroup_filters=(RangeFilter(0),))
    else:  # not listed there in 20/21: ignored
        assert decoded(version, nested).parameters.fill_parameters == P()


# -- Range filters (20+; request-level problems stay decodable) --------------------------------
@pytest.mark.parametrize("version", (V20, V21, V22))
def test_range_filter_framing_errors(version: Version) -> None:
    assert_error(version, subscribe("01 25 02 00 80"), PV)  # vi64 cut by the length
    assert_error(version, subscribe("01 25 05 00 01"), PV)  # length past the message


def test_range_filter_problems_are_request_errors() -> None:
    def problem(**kw: object) -> str | None:
        return P(**kw).range_filter_problem()  # type: ignore[arg-type]

    assert problem(subgroup_filters=(RangeFilter(0, None, (Range(1, 2),)),)) is None
    assert "repeats" in problem(subgroup_filters=(RangeFilter(0, None, (Range(1, 2),)),) * 2)
    two_sets = (RangeFilter(0, None, (Range(1, 2),)), RangeFilter(1, None, (Range(1, 2),)))
    assert problem(subgroup_filters=two_sets) is None
    assert "255" in problem(priority_filters=(RangeFilter(0, None, (Range(200, 256),)),))
    assert "even" in problem(object_property_filters=(RangeFilter(0, 3, (Range(1, 2),)),))
    assert "even" in problem(track_property_filters=(RangeFilter(0, None, ()),))
    assert "no Range" in problem(objectid_filters=(RangeFilter(3),))
    assert problem(objectid_filters=(RangeFilter(),)) is None  # the empty value (removal)
    # A delta sum beyond 2^64-1 decodes (it is not a session error) and is reported.
    # OBJECTID_FILTER len 19 {SetID 00, Start 2^64-1, End delta 2^64-1}
    data = subscribe("01 26 13 00 ffffffffffffffffff ffffffffffffffffff")
    got = decode_message(V22, data)[0]
    assert got.parameters.objectid_filters[0].ranges == (Range((1 << 64) - 1, (1 << 65) - 2),)
    assert "exceeds" in got.parameters.range_filter_problem()
    assert got.parameters.range_count() == 1
    assert encode_message(V22, got) == data  # and forwards unchanged


# =============================================================================================
# SETUP (§"SETUP")
# =============================================================================================
@pytest.mark.parametrize("version", ALL)
def test_setup_errors(version: Version) -> None:
    assert_error(version, frame(0x2F00, h("03 02 0001")), PV)  # DELETE token
    assert_error(version, frame(0x2F00, h("03 02 0201")), PV)  # USE_ALIAS token
    assert_error(version, frame(0x2F00, h("01 01 ff")), SessionErrorCode.MALFORMED_PATH)
    assert_error(version, frame(0x2F00, h("05 02 c328")), SessionErrorCode.MALFORMED_AUTHORITY)
    assert_error(version, frame(0x2F00, h("01 01 2f 00 01 61")), PV)  # PATH twice
    assert_error(version, frame(0x2F00, h("04 01 00 02")), PV)  # MAX_AUTH_TOKEN_CACHE_SIZE twice
    assert_error(version, frame(0x2F00, h("07 05 61")), PV)  # KVP runs past the message
    assert_error(version, frame(0x2F00, h("07") + encode_vi64(0x10000)), PV)  # KVP > 65535
    # Tokens may repeat; unknown options may repeat; a bad MOQT_IMPLEMENTATION is text.
    got = decode_message(version, frame(0x2F00, h("03 03 03 00 61 00 03 03 00 62 04 01 ff")))[0]
    assert got.authorization_tokens == (Token.use_value(0, b"a"), Token.use_value(0, b"b"))
    assert got.moqt_implementation == "\ufffd"


def test_setup_errors_on_encode() -> None:
    with pytest.raises(ValueError):
        encode_message(V18, Setup(max_filter_ranges=1))
    with pytest.raises(ValueError):
        encode_message(V22, Setup(authorization_tokens=(Token.delete(1),)))
    with pytest.raises(ValueError):
        encode_message(V22, Setup(unknown_options=(KeyValuePair(0x01, b"/"),)))
    encode_message(V18, Setup(unknown_options=(KeyValuePair(0x06, 1),)))  # unknown in 18
    with pytest.raises(ValueError):  # body > 65535
        encode_message(V22, Setup(unknown_options=(KeyValuePair(0x9D, b"x" * 0xFFFF),)))


# =============================================================================================
# FETCH, FETCH_OK, REQUEST_ERROR, messages of other versions
# =============================================================================================
def test_fetch_type_errors() -> None:
    assert_error(V18, frame(0x16, h("00 00 00")), PV)
    assert_error(V18, frame(0x16, h("00 04 00 00 00")), PV)


@pytest.mark.parametrize("version", ALL)
def test_end_of_track_is_0_or_1(version: Version) -> None:
    assert_error(version, frame(0x18, h("02 0000 00")), PV)


def test_messages_of_other_versions_do_not_encode() -> None:
    with pytest.raises(ValueError):
        encode_message(V18, PublishStateNotify())
    with pytest.raises(ValueError):
        encode_message(V18, Fetch(0, (), b""))
    with pytest.raises(ValueError):
        encode_message(V22, StandaloneFetch(0, (), b"", Location(0, 0), Location(1, 0)))
    with pytest.raises(ValueError):
        encode_message(V20, GoAway("", 0, 1))
    with pytest.raises(ValueError):
        RequestError(0x34)  # REDIRECT needs its Redirect
    with pytest.raises(ValueError):
        RequestError(0x10, redirect=Redirect())


def test_message_length_limit_on_encode() -> None:
    props = tuple(KeyValuePair(0x3801, b"p" * 60000) for _ in range(2))
    with pytest.raises(ValueError):
        encode_message(V22, RequestOk(track_properties=props))
    assert MAX_MESSAGE_LENGTH == 0xFFFF


# =============================================================================================
# Session-side checks
# =============================================================================================
def test_check_request_ok() -> None:
    status_ok = RequestOk(P(largest_object=Location(1, 2)), (KeyValuePair(0x0E, 1),))
    check_request_ok(V22, status_ok, ParamContext.TRACK_STATUS_OK)
    for context in (ParamContext.PUBLISH_OK, ParamContext.REQUEST_UPDATE_OK,
                    ParamContext.SUBSCRIBE_NAMESPACE_OK, ParamContext.PUBLISH_NAMESPACE_OK):
        with pytest.raises(WireError) as err:
            check_request_ok(V22, RequestOk(track_properties=status_ok.track_properties), context)
        assert err.value.code == PV
    # A parameter the answered request does not list: dropped (strict, for ours: an error).
    lo = RequestOk(P(largest_object=Location(1, 2)))
    assert check_request_ok(V22, lo, ParamContext.PUBLISH_OK) == RequestOk()
    with pytest.raises(WireError):
        check_request_ok(V22, lo, ParamContext.PUBLISH_OK, strict=True)
    expires = RequestOk(P(expires=1, largest_object=Location(1, 2)))  # EXPIRES in TRACK_STATUS_OK
    assert check_request_ok(V22, expires, ParamContext.TRACK_STATUS_OK) == lo
    with pytest.raises(WireError):
        check_request_ok(V22, expires, ParamContext.TRACK_STATUS_OK, strict=True)
    assert check_request_ok(V22, lo, ParamContext.TRACK_STATUS_OK) is lo


def test_check_request_update() -> None:
    prefix = RequestUpdate(2, P(track_namespace_prefix=(b"a",)))
    check_request_update(V22, prefix, 0x50)
    check_request_update(V22, prefix, 0x51)
    for request_type in (0x03, 0x1D, 0x16, 0x06):  # not listed for these: dropped
        assert check_request_update(V22, prefix, request_type) == RequestUpdate(2)
        with pytest.raises(WireError):
            check_request_update(V22, prefix, request_type, strict=True)
    with pytest.raises(WireError):  # TRACK_STATUS cannot be updated
        check_request_update(V22, RequestUpdate(2), 0x0D)
    check_request_update(V22, RequestUpdate(2, P(subscriber_priority=1)), 0x16)
    # Only SUBSCRIBER_PRIORITY (and tokens) for a FETCH: FORWARD is dropped (strict: error).
    fwd = RequestUpdate(2, P(forward=True))
    assert check_request_update(V22, fwd, 0x16) == RequestUpdate(2)
    with pytest.raises(WireError):
        check_request_update(V22, fwd, 0x16, strict=True)
    assert check_request_update(V22, fwd, 0x51) is fwd
    assert check_request_update(V18, fwd, 0x51) == RequestUpdate(2)  # FORWARD there: 20+
    with pytest.raises(WireError):
        check_request_update(V18, fwd, 0x51, strict=True)


def test_check_redirect() -> None:
    err = RequestError(0x34, 0, "", Redirect("moqt://x", (b"a",), b"t"))
    check_redirect(V22, err, 0x03, receiver_is_server=False)
    with pytest.raises(WireError):
        check_redirect(V22, err, 0x03, receiver_is_server=True)
    for request_type in (0x06, 0x50, 0x51):
        with pytest.raises(WireError):
            check_redirect(V22, err, request_type, receiver_is_server=False)
    check_redirect(V18, err, 0x51, receiver_is_server=False)  # 18 lists only PNS and SNS
    check_redirect(V22, RequestError(0x10), 0x50, receiver_is_server=True)


def test_allow_lists_are_subsets_of_defined_types() -> None:
    for version in ALL:
        for context in ParamContext:
            assert allowed_parameter_types(version, context) <= defined_parameter_types(version)
    assert allowed_parameter_types(V22, ParamContext.FETCH_OK) == frozenset()
    assert check_parameters(V22, ParamContext.SUBSCRIBE, P(forward=True)) == P(forward=True)
    assert check_parameters(V22, ParamContext.SUBSCRIBE_OK, P(forward=True, expires=3)) == P(
        expires=3)
    with pytest.raises(WireError):
        check_parameters(V22, ParamContext.SUBSCRIBE_OK, P(forward=True), strict=True)


# =============================================================================================
# No allocation proportional to an untrusted length
# =============================================================================================
HOSTILE = [
    frame(0x03, h("00") + encode_vi64(1 << 62)),  # field count
    frame(0x03, h("00 01") + encode_vi64((1 << 64) - 1)),  # field length
    frame(0x0B, h("02 03") + encode_vi64(1 << 61)),  # reason length
    frame(0x10, encode_vi64(1 << 61) + h("00")),  # URI length
    subscribe("01 03" + encode_vi64(1 << 62).hex()),  # token length
    subscribe("01 23" + encode_vi64(1 << 62).hex()),  # FILL_PARAMETERS length
    subscribe("01 25" + encode_vi64(1 << 62).hex()),  # range filter length
    subscribe(encode_vi64(1 << 62).hex() + "1001"),  # parameter count
    frame(0x2F00, h("01") + encode_vi64(1 << 40)),  # option length
    frame(0x04, h("00 00 01") + encode_vi64(1 << 50)),  # track property length
]


@pytest.mark.parametrize("version", ALL)
def test_hostile_lengths_allocate_nothing(version: Version) -> None:
    tracemalloc.start()
    try:
        for data in HOSTILE:
            with pytest.raises(WireError):
                decode_message(version, data)
            reader = ControlStreamReader(version)
            with pytest.raises(WireError):
                reader.feed(data, end_stream=True)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 256 * 1024


def test_reader_buffers_at_most_one_message() -> None:
    reader = ControlStreamReader(V22)
    reader.feed(h("07 ffff"))  # a REQUEST_OK of 65535 bytes announced
    for _ in range(64):
        assert reader.feed(b"\x00" * 1000) == []
    assert reader.buffered == 3 + 64000
    with pytest.raises(WireError):  # the rest: 65535 zero bytes are not a valid REQUEST_OK
        reader.feed(b"\x00" * 2000)
