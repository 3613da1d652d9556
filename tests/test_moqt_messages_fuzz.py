"""MOQT control messages, property tests (DESIGN.md §7).

* Every message shape of every version round-trips: ``decode(encode(m)) == m``, whole and
  through ControlStreamReader under random chunking, with another message behind it.
* Random bytes, random bodies behind real message types, and mutations of valid messages
  (byte flips, insertions, deletions, truncation, wrong lengths) give a message or the
  WireError the draft names — never another exception; whatever decodes re-encodes and
  decodes to the same message.
"""

from __future__ import annotations

import pytest
from _moqt_message_strategies import message_strategies, messages
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvsp_moq.moqt.messages import (
    ControlStreamReader,
    Message,
    RequestOk,
    decode_message,
    encode_message,
    message_classes,
)
from kvsp_moq.moqt.version import Version
from kvsp_moq.wire import SessionErrorCode, WireError, encode_vi64

VERSIONS = list(Version)
NAMED_CODES = {
    SessionErrorCode.PROTOCOL_VIOLATION,
    SessionErrorCode.KEY_VALUE_FORMATTING_ERROR,
    SessionErrorCode.MALFORMED_PATH,
    SessionErrorCode.MALFORMED_AUTHORITY,
}
FAST = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
FUZZ = settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])

SHAPES = [(v, name) for v in VERSIONS for name in message_strategies(v)]


def _chunks(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts})
    return [data[a:b] for a, b in zip([0, *points], [*points, len(data)])]


@pytest.mark.parametrize(("version", "shape"), SHAPES, ids=[f"{n}@{int(v)}" for v, n in SHAPES])
@FAST
@given(data=st.data())
def test_round_trip(version: Version, shape: str, data: st.DataObject) -> None:
    msg = data.draw(message_strategies(version)[shape])
    encoded = encode_message(version, msg)
    assert decode_message(version, encoded) == (msg, len(encoded))
    follow = encode_message(version, RequestOk())
    stream = encoded + follow
    reader = ControlStreamReader(version)
    got: list[Message] = []
    for chunk in _chunks(stream, data.draw(st.lists(st.integers(0, 1 << 16), max_size=6))):
        got += reader.feed(chunk)
    got += reader.feed(b"", end_stream=True)
    assert got == [msg, RequestOk()]


def _decode_or_named_error(version: Version, data: bytes) -> None:
    try:
        got = decode_message(version, data)
    except WireError as exc:
        assert exc.code in NAMED_CODES, exc
        return
    if got is not None:
        msg, n = got
        assert 0 < n <= len(data)
        again = encode_message(version, msg)
        assert decode_message(version, again) == (msg, len(again))


def _reader_or_named_error(version: Version, data: bytes, cuts: list[int]) -> None:
    reader = ControlStreamReader(version)
    try:
        for chunk in _chunks(data, cuts):
            reader.feed(chunk)
        reader.feed(b"", end_stream=True)
    except WireError as exc:
        assert exc.code in NAMED_CODES, exc


@pytest.mark.parametrize("version", VERSIONS)
@FUZZ
@given(data=st.binary(max_size=64), cuts=st.lists(st.integers(0, 64), max_size=4))
def test_random_bytes(version: Version, data: bytes, cuts: list[int]) -> None:
    _decode_or_named_error(version, data)
    _reader_or_named_error(version, data, cuts)


# Bodies built from bytes that matter (small types, lengths, counts, 0xff, 0x80).
_BODY_BYTES = st.sampled_from(
    [0, 1, 2, 3, 4, 5, 6, 8, 9, 0x0A, 0x10, 0x20, 0x21, 0x22, 0x23, 0x25, 0x28, 0x29, 0x32,
     0x34, 0x35, 0x7F, 0x80, 0xC0, 0xFE, 0xFF]
)


@pytest.mark.parametrize("version", VERSIONS)
@FUZZ
@given(data=st.data())
def test_random_bodies_of_real_types(version: Version, data: st.DataObject) -> None:
    message_type = data.draw(st.sampled_from(sorted(message_classes(version))))
    body = bytes(data.draw(st.lists(st.one_of(_BODY_BYTES, st.integers(0, 255)), max_size=40)))
    framed = encode_vi64(message_type) + len(body).to_bytes(2, "big") + body
    _decode_or_named_error(version, framed)
    _reader_or_named_error(version, framed, data.draw(st.lists(st.integers(0, 64), max_size=3)))


@st.composite
def _mutated(draw: st.DrawFn, version: Version) -> bytes:
    data = bytearray(encode_message(version, draw(messages(version))))
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(["flip", "set", "insert", "delete", "truncate", "length"]))
        at = draw(st.integers(0, max(len(data) - 1, 0)))
        if kind == "flip" and data:
            data[at] ^= 1 << draw(st.integers(0, 7))
        elif kind == "set" and data:
            data[at] = draw(_BODY_BYTES)
        elif kind == "insert":
            data[at:at] = bytes([draw(_BODY_BYTES)])
        elif kind == "delete" and data:
            del data[at]
        elif kind == "truncate":
            del data[at:]
        elif kind == "length":
            # Rewrite Message Length (after a 1- or 2-byte type) to any value.
            pos = 1 if data and data[0] < 0x80 else 2
            if len(data) >= pos + 2:
                data[pos : pos + 2] = draw(st.integers(0, 0xFFFF)).to_bytes(2, "big")
    return bytes(data)


@pytest.mark.parametrize("version", VERSIONS)
@FUZZ
@given(data=st.data())
def test_mutated_messages(version: Version, data: st.DataObject) -> None:
    mutated = data.draw(_mutated(version))
    _decode_or_named_error(version, mutated)
    _reader_or_named_error(version, mutated, data.draw(st.lists(st.integers(0, 64), max_size=3)))
