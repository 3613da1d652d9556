"""vi64 (draft-18/20 §"Variable-Length Integers") and QUIC varints (RFC 9000 §16, §A.1).

Every vector is parsed whole, byte by byte (BufferUnderflow with the exact shortfall until it
is complete) and with trailing bytes (consumed count unchanged).
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvsp_moq.moqt.version import Version
from kvsp_moq.wire import (
    BufferUnderflow,
    Reader,
    SessionErrorCode,
    WireError,
    Writer,
    encode_quic_varint,
    encode_vi64,
    quic_varint_size,
    read_quic_varint,
    read_vi64,
    vi64_length,
    vi64_size,
)

# The "Example Integer Encodings" table of draft-18 / draft-20 §"Variable-Length Integers".
DRAFT_VI64_EXAMPLES = [
    (b"\x25", 37),
    (b"\x80\x25", 37),
    (b"\xbb\xbd", 15_293),
    (b"\xed\x7f\x3e\x7d", 226_442_877),
    (b"\xfa\xa1\xa0\xe4\x03\xd8", 2_893_212_287_960),
    (b"\xfc\x89\x98\xab\xc6\x6b\xc0", 151_288_809_941_952),
    (b"\xfe\xfa\x31\x8f\xa8\xe3\xca\x11", 70_423_237_261_249_041),
    (b"\xff\xff\xff\xff\xff\xff\xff\xff\xff", 18_446_744_073_709_551_615),
]

# The smallest and largest value of every length (prefix bits worked out by hand).
VI64_BOUNDARIES = [
    (b"\x00", 0),
    (b"\x7f", 127),
    (b"\x80\x80", 128),
    (b"\xbf\xff", 16_383),
    (b"\xc0\x40\x00", 16_384),
    (b"\xdf\xff\xff", 2_097_151),
    (b"\xe0\x20\x00\x00", 2_097_152),
    (b"\xef\xff\xff\xff", 268_435_455),
    (b"\xf0\x10\x00\x00\x00", 268_435_456),
    (b"\xf7\xff\xff\xff\xff", 34_359_738_367),
    (b"\xf8\x08\x00\x00\x00\x00", 34_359_738_368),
    (b"\xfb\xff\xff\xff\xff\xff", 4_398_046_511_103),
    (b"\xfc\x04\x00\x00\x00\x00\x00", 4_398_046_511_104),
    (b"\xfd\xff\xff\xff\xff\xff\xff", 562_949_953_421_311),
    (b"\xfe\x02\x00\x00\x00\x00\x00\x00", 562_949_953_421_312),
    (b"\xfe\xff\xff\xff\xff\xff\xff\xff", 72_057_594_037_927_935),
    (b"\xff\x01\x00\x00\x00\x00\x00\x00\x00", 72_057_594_037_927_936),
]

# Zero in every length: "0x00, 0x8000, 0xc00000, or any longer form".
VI64_ZEROS = [
    b"\x00",
    b"\x80\x00",
    b"\xc0\x00\x00",
    b"\xe0\x00\x00\x00",
    b"\xf0\x00\x00\x00\x00",
    b"\xf8\x00\x00\x00\x00\x00",
    b"\xfc\x00\x00\x00\x00\x00\x00",
    b"\xfe\x00\x00\x00\x00\x00\x00\x00",
    b"\xff\x00\x00\x00\x00\x00\x00\x00\x00",
]

# RFC 9000 §A.1 sample encodings (plus a non-minimal form).
QUIC_EXAMPLES = [
    (b"\xc2\x19\x7c\x5e\xff\x14\xe8\x8c", 151_288_809_941_952_652),
    (b"\x9d\x7f\x3e\x7d", 494_878_333),
    (b"\x7b\xbd", 15_293),
    (b"\x25", 37),
    (b"\x40\x25", 37),
    (b"\x3f", 63),
    (b"\x40\x40", 64),
    (b"\xbf\xff\xff\xff", 1_073_741_823),
    (b"\xff\xff\xff\xff\xff\xff\xff\xff", 2**62 - 1),
]

ALL_VI64 = DRAFT_VI64_EXAMPLES + VI64_BOUNDARIES + [(z, 0) for z in VI64_ZEROS]


def _check_whole_bytewise_trailing(read, data: bytes, value: int) -> None:
    assert read(data) == (value, len(data))
    for cut in range(len(data)):
        with pytest.raises(BufferUnderflow) as info:
            read(data[:cut])
        assert info.value.needed == (len(data) - cut if cut else 1)
    assert read(data + b"\x00\xff\x25") == (value, len(data))
    # At an offset inside a larger buffer, as codecs call it.
    assert read(b"\xaa\xbb" + data + b"\xcc", 2) == (value, len(data))


@pytest.mark.parametrize(
    ("data", "value"), ALL_VI64, ids=lambda x: x.hex() if isinstance(x, bytes) else None
)
def test_vi64_vectors(data: bytes, value: int) -> None:
    _check_whole_bytewise_trailing(read_vi64, data, value)
    assert vi64_length(data[0]) == len(data)
    # Also through a memoryview and a bytearray.
    assert read_vi64(memoryview(data)) == (value, len(data))
    assert read_vi64(bytearray(data)) == (value, len(data))


@pytest.mark.parametrize(("data", "value"), DRAFT_VI64_EXAMPLES[:1] + DRAFT_VI64_EXAMPLES[2:])
def test_vi64_encoding_of_draft_examples_is_minimal(data: bytes, value: int) -> None:
    # Every example except 0x8025 is the shortest form of its value.
    assert encode_vi64(value) == data
    assert vi64_size(value) == len(data)


@pytest.mark.parametrize(("data", "value"), VI64_BOUNDARIES)
def test_vi64_boundaries_encode_minimal(data: bytes, value: int) -> None:
    assert encode_vi64(value) == data


def test_vi64_non_minimal_forms_accepted_and_producible() -> None:
    assert read_vi64(b"\x80\x25") == (37, 2)
    for n, data in enumerate(VI64_ZEROS, start=1):
        assert encode_vi64(0, length=n) == data
    assert encode_vi64(37, length=9) == b"\xff" + (37).to_bytes(8, "big")
    with pytest.raises(ValueError):
        encode_vi64(128, length=1)
    with pytest.raises(ValueError):
        encode_vi64(1, length=7, seven_byte=False)


@pytest.mark.parametrize("version", list(Version))
def test_seven_byte_form_in_every_supported_version(version: Version) -> None:
    # draft-18 added the 7-byte form; 20, 21 and 22 keep it.
    assert version.vi64_seven_byte
    data = b"\xfc\x89\x98\xab\xc6\x6b\xc0"
    r = Reader(data, seven_byte=version.vi64_seven_byte)
    assert r.pull_vi64() == 151_288_809_941_952
    w = Writer(seven_byte=version.vi64_seven_byte)
    w.push_vi64(151_288_809_941_952)
    assert w.getvalue() == data


def test_seven_byte_form_invalid_without_it() -> None:
    # draft-17 had no 7-byte form: it is a protocol violation and values go in 8 bytes.
    for data in (b"\xfc\x89\x98\xab\xc6\x6b\xc0", b"\xfc\x00\x00\x00\x00\x00\x00"):
        with pytest.raises(WireError) as info:
            read_vi64(data, seven_byte=False)
        assert info.value.code == SessionErrorCode.PROTOCOL_VIOLATION
    assert encode_vi64(151_288_809_941_952, seven_byte=False) == b"\xfe\x00\x89\x98\xab\xc6\x6b\xc0"
    assert vi64_size(2**42, seven_byte=False) == 8
    assert vi64_size(2**42 - 1, seven_byte=False) == 6
    # Other lengths are unaffected.
    eight = b"\xfe\xfa\x31\x8f\xa8\xe3\xca\x11"
    assert read_vi64(eight, seven_byte=False) == (70_423_237_261_249_041, 8)


def test_vi64_range_errors() -> None:
    with pytest.raises(ValueError):
        encode_vi64(-1)
    with pytest.raises(ValueError):
        encode_vi64(2**64)
    with pytest.raises(BufferUnderflow):
        read_vi64(b"")
    with pytest.raises(BufferUnderflow):
        read_vi64(b"\x25", 1)


@given(st.integers(0, 2**64 - 1), st.booleans())
def test_vi64_round_trip(value: int, seven_byte: bool) -> None:
    data = encode_vi64(value, seven_byte=seven_byte)
    assert len(data) == vi64_size(value, seven_byte=seven_byte)
    assert read_vi64(data, seven_byte=seven_byte) == (value, len(data))
    # Minimal: one byte shorter cannot hold the value.
    n = len(data)
    if n > 1:
        shorter = n - 1 if not (n == 8 and not seven_byte) else 6
        with pytest.raises(ValueError):
            encode_vi64(value, length=shorter, seven_byte=seven_byte)


@given(st.integers(0, 2**64 - 1), st.integers(1, 9), st.binary(max_size=4))
def test_vi64_any_length_decodes(value: int, length: int, trailing: bytes) -> None:
    if length < vi64_size(value):
        return
    data = encode_vi64(value, length=length)
    assert len(data) == length
    assert read_vi64(data + trailing) == (value, length)


@pytest.mark.parametrize(("data", "value"), QUIC_EXAMPLES)
def test_quic_varint_vectors(data: bytes, value: int) -> None:
    _check_whole_bytewise_trailing(read_quic_varint, data, value)


@pytest.mark.parametrize(("data", "value"), [q for q in QUIC_EXAMPLES if q[0] != b"\x40\x25"])
def test_quic_varint_encode_minimal(data: bytes, value: int) -> None:
    assert encode_quic_varint(value) == data
    assert quic_varint_size(value) == len(data)


def test_quic_varint_limits() -> None:
    assert encode_quic_varint(37, length=2) == b"\x40\x25"
    with pytest.raises(ValueError):
        encode_quic_varint(2**62)
    with pytest.raises(ValueError):
        encode_quic_varint(64, length=1)
    with pytest.raises(ValueError):
        encode_quic_varint(1, length=3)


@given(st.integers(0, 2**62 - 1))
def test_quic_varint_round_trip(value: int) -> None:
    data = encode_quic_varint(value)
    assert read_quic_varint(data) == (value, len(data))
    w = Writer()
    w.push_quic_varint(value)
    assert Reader(w.getvalue()).pull_quic_varint() == value


@given(st.binary(max_size=12))
def test_readers_on_random_bytes(data: bytes) -> None:
    # Only a value or BufferUnderflow; never another exception.
    for read in (read_vi64, read_quic_varint):
        try:
            value, n = read(data)
        except BufferUnderflow:
            continue
        assert 1 <= n <= len(data) and 0 <= value < 2**64
