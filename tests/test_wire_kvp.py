"""Key-Value-Pairs (draft-18/20 §"Key-Value-Pair Structure"): delta-coded types, even types
carry a vi64, odd types a length (<= 65535) and bytes; lists are externally bounded."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvsp_moq.wire import (
    KeyValuePair,
    LimitExceeded,
    Reader,
    SessionErrorCode,
    WireError,
    decode_kvps,
    encode_kvps,
    kvp_formatting_error,
    kvp_get,
    kvp_get_all,
    read_kvps,
)

PV = SessionErrorCode.PROTOCOL_VIOLATION

VECTORS: list[tuple[bytes, tuple[KeyValuePair, ...]]] = [
    (b"", ()),
    # The draft's example object properties, with the type deltas and the length the draft
    # example gets wrong corrected: {4: 2186796243 (0x8257dcd3, 5-byte vi64)},
    # {77 (delta 73 = 0x49): 14 bytes}.
    (
        b"\x04\xf0\x82\x57\xdc\xd3\x49\x0etraceID:123456",
        (KeyValuePair(4, 2_186_796_243), KeyValuePair(77, b"traceID:123456")),
    ),
    # Repeated odd type (delta 0), then an even type one above.
    (b"\x01\x02ab\x00\x01c\x01\x05", (KeyValuePair(1, b"ab"), KeyValuePair(1, b"c"),
                                      KeyValuePair(2, 5))),
    # Empty byte value; even type 0 with value 0.
    (b"\x00\x00\x03\x00", (KeyValuePair(0, 0), KeyValuePair(3, b""))),
    # Setup options as a draft-22 peer sent them (moqt-reference §2.11): MOQT_IMPLEMENTATION
    # (0x07, 11 bytes), then delta 0x40b4d (3-byte vi64 c4 0b 4d) to an even GREASE-like
    # type with an 8-byte (non-minimal) vi64 value, then deltas 6 and 2 to two more even
    # types.
    (
        b"\x07\x0bmoq-lite-rs\xc4\x0b\x4d\xfe\x01\x02\x03\x04\x05\x06\x07\x06\x01\x02\x01",
        (
            KeyValuePair(7, b"moq-lite-rs"),
            KeyValuePair(7 + 265_037, 0x01020304050607),
            KeyValuePair(7 + 265_037 + 6, 1),
            KeyValuePair(7 + 265_037 + 8, 1),
        ),
    ),
    # Largest type: 2**64-1 (odd) reached by one 9-byte delta, zero-length value.
    (b"\xff" + b"\xff" * 8 + b"\x00", (KeyValuePair(2**64 - 1, b""),)),
    # Non-minimal encodings are accepted: delta 2 as 80 02, value 1 as c0 00 01.
    (b"\x80\x02\xc0\x00\x01", (KeyValuePair(2, 1),)),
]


@pytest.mark.parametrize(("data", "pairs"), VECTORS)
def test_vectors_decode(data: bytes, pairs: tuple[KeyValuePair, ...]) -> None:
    assert decode_kvps(data) == pairs
    assert decode_kvps(memoryview(bytearray(data))) == pairs
    # Bounded inside a larger buffer, with trailing bytes that belong to something else.
    buf = b"\x99" + data + b"\x01\x7f"
    r = Reader(buf, 1, 1 + len(data))
    assert tuple(read_kvps(r)) == pairs
    assert r.position == 1 + len(data)


@pytest.mark.parametrize(("data", "pairs"), VECTORS[:4])
def test_vectors_encode_minimal(data: bytes, pairs: tuple[KeyValuePair, ...]) -> None:
    assert encode_kvps(pairs) == data


@pytest.mark.parametrize(("data", "pairs"), VECTORS[1:])
def test_truncated_list_is_a_protocol_violation(data: bytes, pairs: tuple) -> None:
    # The list is bounded; ending inside a pair is malformed (no "need more data").
    for cut in range(1, len(data)):
        try:
            got = decode_kvps(data[:cut])
        except WireError as e:
            assert e.code == PV
        else:  # the cut fell between pairs
            assert got == pairs[: len(got)]


def test_value_length_limit() -> None:
    ok = b"\x01\xc0\xff\xff" + b"x" * 65535  # 65535 = 3-byte vi64 c0 ff ff
    assert decode_kvps(ok) == (KeyValuePair(1, b"x" * 65535),)
    with pytest.raises(WireError) as info:
        decode_kvps(b"\x01\xc1\x00\x00" + b"x" * 65536)  # 65536: over the maximum
    assert info.value.code == PV
    with pytest.raises(ValueError):
        encode_kvps([(1, b"x" * 65536)])


def test_type_overflow() -> None:
    # 2**64-2 (even, value 0) then delta 2: past 2**64-1.
    data = b"\xff\xff\xff\xff\xff\xff\xff\xff\xfe\x00\x02\x00"
    with pytest.raises(WireError) as info:
        decode_kvps(data)
    assert info.value.code == PV


def test_max_pairs() -> None:
    assert len(decode_kvps(b"\x00\x00" * 4, max_pairs=4)) == 4
    with pytest.raises(LimitExceeded):
        decode_kvps(b"\x00\x00" * 5, max_pairs=4)


def test_encode_rejects_bad_pairs() -> None:
    with pytest.raises(ValueError):
        encode_kvps([(4, 1), (2, 1)])  # decreasing types cannot be delta coded
    with pytest.raises(TypeError):
        encode_kvps([(1, 5)])
    with pytest.raises(TypeError):
        encode_kvps([(2, b"x")])
    with pytest.raises(ValueError):
        encode_kvps([(2**64, 0)])


def test_helpers() -> None:
    pairs = decode_kvps(b"\x01\x02ab\x00\x01c\x01\x05")
    assert kvp_get(pairs, 1) == b"ab" and kvp_get(pairs, 9) is None
    assert kvp_get_all(pairs, 1) == [b"ab", b"c"]
    err = kvp_formatting_error(0x21, "bad filter")
    assert err.code == SessionErrorCode.KEY_VALUE_FORMATTING_ERROR


_pair = st.one_of(
    st.tuples(st.integers(0, 2**63 - 1).map(lambda t: 2 * t), st.integers(0, 2**64 - 1)),
    st.tuples(st.integers(0, 2**63 - 1).map(lambda t: 2 * t + 1), st.binary(max_size=70)),
)


@given(st.lists(_pair, max_size=12).map(lambda ps: sorted(ps, key=lambda p: p[0])),
       st.booleans())
def test_round_trip(pairs: list[tuple[int, int | bytes]], seven_byte: bool) -> None:
    data = encode_kvps(pairs, seven_byte=seven_byte)
    assert decode_kvps(data, seven_byte=seven_byte) == tuple(KeyValuePair(*p) for p in pairs)


@given(st.binary(max_size=64))
def test_random_bytes_only_wire_errors(data: bytes) -> None:
    try:
        pairs = decode_kvps(data, max_pairs=16)
    except WireError:
        return
    # Whatever parsed re-encodes to a list that parses the same.
    assert decode_kvps(encode_kvps(pairs)) == pairs
