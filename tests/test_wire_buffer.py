"""Reader / Writer: zero-copy reads, exact underflow, bounded windows, back-filled lengths."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvsp_moq.wire import BufferUnderflow, Reader, Writer


def test_pull_bytes_is_a_view_not_a_copy() -> None:
    data = bytearray(b"\x05hello world")
    r = Reader(data)
    assert r.pull_uint8() == 5
    view = r.pull_bytes(5)
    assert isinstance(view, memoryview)
    assert view.obj is data  # a slice of the caller's buffer
    data[1] = ord("j")
    assert bytes(view) == b"jello"
    del view


def test_underflow_is_exact_and_leaves_position() -> None:
    r = Reader(b"\x01\x02\x03")
    r.pull_uint8()
    for pull, missing in ((r.pull_uint32, 2), (r.pull_uint64, 6), (lambda: r.pull_bytes(7), 5)):
        with pytest.raises(BufferUnderflow) as info:
            pull()
        assert info.value.needed == missing
        assert r.position == 1
    assert r.pull_uint16() == 0x0203
    assert r.at_end()
    with pytest.raises(BufferUnderflow) as info:
        r.pull_vi64()
    assert info.value.needed == 1
    # A vi64 whose first byte announces 4 bytes, 2 present.
    r = Reader(b"\xe1\x02")
    with pytest.raises(BufferUnderflow) as info:
        r.pull_vi64()
    assert info.value.needed == 2 and r.position == 0


def test_bounded_reader() -> None:
    r = Reader(b"\x02\xaa\xbb\xcc")
    n = r.pull_uint8()
    sub = r.bounded(n)
    assert r.position == 3 and r.pull_uint8() == 0xCC
    assert sub.remaining == 2 and bytes(sub.pull_rest()) == b"\xaa\xbb"
    with pytest.raises(BufferUnderflow):
        sub.pull_uint8()
    with pytest.raises(BufferUnderflow):
        Reader(b"\x01").bounded(2)


def test_window_and_seek() -> None:
    r = Reader(b"abcdef", 1, 4)
    assert r.remaining == 3
    assert bytes(r.pull_bytes(3)) == b"bcd"
    with pytest.raises(BufferUnderflow):
        r.peek_uint8()
    r.seek(2)
    assert r.peek_uint8() == ord("c")
    r.skip(1)
    assert r.position == 3
    with pytest.raises(ValueError):
        Reader(b"ab", 3)
    with pytest.raises(ValueError):
        r.seek(5)
    with pytest.raises(ValueError):
        r.pull_bytes(-1)


def test_non_byte_memoryview_is_flattened() -> None:
    import array

    a = array.array("H", [0x0102, 0x0304])
    r = Reader(memoryview(a))
    assert r.remaining == 4


def test_writer() -> None:
    w = Writer()
    w.push_uint8(0x10)
    at = w.reserve_uint16()
    w.push_vi64(37)
    w.push_vi64(15_293)
    w.push_bytes(memoryview(b"xy"))
    w.push_uint32(0x01020304)
    w.push_uint64(5)
    w.push_uint16(0xBEEF)
    w.patch_uint16(at, len(w) - at - 2)
    assert w.getvalue() == (
        b"\x10\x00\x13\x25\xbb\xbdxy\x01\x02\x03\x04" + b"\x00" * 7 + b"\x05\xbe\xef"
    )
    assert bytes(w.view()) == w.getvalue() and w.tell() == len(w)
    with pytest.raises(ValueError):
        w.push_uint8(256)
    with pytest.raises(ValueError):
        w.patch_uint16(at, 0x10000)
    w.clear()
    assert len(w) == 0


@given(st.lists(st.tuples(st.sampled_from(["u8", "u16", "u32", "u64", "vi", "qv", "b"]),
                          st.integers(0, 2**64 - 1), st.binary(max_size=8))))
def test_writer_reader_round_trip(fields: list[tuple[str, int, bytes]]) -> None:
    w = Writer()
    expected = []
    for kind, value, blob in fields:
        if kind == "u8":
            value &= 0xFF
            w.push_uint8(value)
        elif kind == "u16":
            value &= 0xFFFF
            w.push_uint16(value)
        elif kind == "u32":
            value &= 0xFFFF_FFFF
            w.push_uint32(value)
        elif kind == "u64":
            w.push_uint64(value)
        elif kind == "vi":
            w.push_vi64(value)
        elif kind == "qv":
            value &= 2**62 - 1
            w.push_quic_varint(value)
        else:
            w.push_vi64(len(blob))
            w.push_bytes(blob)
            value = blob
        expected.append((kind, value))
    r = Reader(w.getvalue())
    for kind, value in expected:
        got = {
            "u8": r.pull_uint8, "u16": r.pull_uint16, "u32": r.pull_uint32,
            "u64": r.pull_uint64, "vi": r.pull_vi64, "qv": r.pull_quic_varint,
            "b": lambda: bytes(r.pull_bytes(r.pull_vi64())),
        }[kind]()
        assert got == value
    assert r.at_end()
