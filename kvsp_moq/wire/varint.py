"""Variable-length integers: MOQT ``vi64`` and QUIC ``(i)`` varints.

vi64 (draft-ietf-moq-transport-17+, draft-18 and draft-20 §"Variable-Length Integers")
------------------------------------------------------------------------------------
The number of leading 1-bits of the first byte gives the length; the bits after the first 0
and the following bytes hold the value, big-endian::

    0xxxxxxx                      1 byte   7 bits
    10xxxxxx +1                   2 bytes 14 bits
    110xxxxx +2                   3 bytes 21 bits
    1110xxxx +3                   4 bytes 28 bits
    11110xxx +4                   5 bytes 35 bits
    111110xx +5                   6 bytes 42 bits
    1111110x +6                   7 bytes 49 bits   (invalid in draft-17; valid in 18 and later)
    11111110 +7                   8 bytes 56 bits
    11111111 +8                   9 bytes 64 bits

Any length that can hold the value is valid on receipt ("do not need to be encoded using the
minimum number of bytes"); we always send the shortest legal one. The 7-byte form exists in
every version this project speaks (18, 20, 21, 22); the ``seven_byte`` switch is there for
draft 17, where it was invalid (moqt-reference §2.2) — with ``seven_byte=False`` a 7-byte
encoding is a PROTOCOL_VIOLATION and values that would need it are sent in 8 bytes.

QUIC varint (RFC 9000 §16)
--------------------------
Two-bit length prefix, 1/2/4/8 bytes, values up to 2**62-1. Used by drafts <= 16 and by the
QUIC/HTTP-3 layers; non-minimal encodings are accepted on receipt.

Readers take a bytes-like object (``bytes``, ``bytearray`` or a ``memoryview`` of bytes) and an
offset, return ``(value, consumed)`` and raise :class:`BufferUnderflow` when the input ends
inside the integer.
"""

from __future__ import annotations

from typing import Final

from .errors import BufferUnderflow, SessionErrorCode, WireError

__all__ = [
    "QUIC_VARINT_MAX",
    "VI64_MAX",
    "encode_quic_varint",
    "encode_vi64",
    "quic_varint_size",
    "read_quic_varint",
    "read_vi64",
    "vi64_length",
    "vi64_size",
]

Buffer = bytes | bytearray | memoryview

VI64_MAX: Final = (1 << 64) - 1
QUIC_VARINT_MAX: Final = (1 << 62) - 1

# Length of a vi64 indexed by its first byte: the number of leading 1-bits plus one, or 9.
_VI64_LEN: Final = bytes(
    next((i + 1 for i in range(8) if not (b << i) & 0x80), 9) for b in range(256)
)
# Value mask of an n-byte vi64 (n <= 8): the low 7n bits.
_VI64_MASK: Final = tuple((1 << (7 * n)) - 1 for n in range(9))
# Length prefix of an n-byte vi64 (n <= 8), placed above the 7n value bits: n-1 ones then a zero.
_VI64_PREFIX: Final = tuple(((1 << n) - 2) << (7 * n) for n in range(9))
_SMALL: Final = tuple(bytes((i,)) for i in range(128))


def vi64_length(first_byte: int) -> int:
    """Total encoded length (1..9) of the vi64 that starts with ``first_byte``."""
    return _VI64_LEN[first_byte]


def vi64_size(value: int, *, seven_byte: bool = True) -> int:
    """Length of the shortest legal vi64 encoding of ``value``."""
    if value < 0:
        raise ValueError(f"vi64 cannot encode negative value {value}")
    if value < 0x80:
        return 1
    bits = value.bit_length()
    if bits > 64:
        raise ValueError(f"vi64 cannot encode {value} (> 2**64-1)")
    if bits > 56:
        return 9
    n = (bits + 6) // 7
    if n == 7 and not seven_byte:
        return 8
    return n


def encode_vi64(value: int, *, seven_byte: bool = True, length: int | None = None) -> bytes:
    """Encode ``value`` as a vi64.

    The shortest legal form is used unless ``length`` asks for a longer (non-minimal, still
    valid) one; ``seven_byte=False`` (draft 17) never produces the 7-byte form.
    """
    if length is None:
        if 0 <= value < 0x80:
            return _SMALL[value]
        n = vi64_size(value, seven_byte=seven_byte)
    else:
        n = length
        if not 1 <= n <= 9 or (n == 7 and not seven_byte):
            raise ValueError(f"invalid vi64 length {n}")
        if value < 0 or (n < 9 and value > _VI64_MASK[n]) or value > VI64_MAX:
            raise ValueError(f"{value} does not fit a {n}-byte vi64")
    if n == 9:
        return b"\xff" + value.to_bytes(8, "big")
    return (_VI64_PREFIX[n] | value).to_bytes(n, "big")


def read_vi64(
    data: Buffer, offset: int = 0, *, seven_byte: bool = True, end: int | None = None
) -> tuple[int, int]:
    """Decode the vi64 at ``data[offset:]`` (bounded by ``end``). Returns ``(value, consumed)``."""
    if end is None:
        end = len(data)
    if offset >= end:
        raise BufferUnderflow(1)
    b0 = data[offset]
    if b0 < 0x80:
        return b0, 1
    n = _VI64_LEN[b0]
    if offset + n > end:
        raise BufferUnderflow(offset + n - end)
    if n == 9:
        return int.from_bytes(data[offset + 1 : offset + 9], "big"), 9
    if n == 7 and not seven_byte:
        raise WireError(
            SessionErrorCode.PROTOCOL_VIOLATION, "7-byte vi64 is invalid in this version"
        )
    return int.from_bytes(data[offset : offset + n], "big") & _VI64_MASK[n], n


def quic_varint_size(value: int) -> int:
    """Length of the minimal QUIC varint encoding of ``value`` (RFC 9000 §16)."""
    if value < 0:
        raise ValueError(f"QUIC varint cannot encode negative value {value}")
    if value < 0x40:
        return 1
    if value < 0x4000:
        return 2
    if value < 0x4000_0000:
        return 4
    if value <= QUIC_VARINT_MAX:
        return 8
    raise ValueError(f"QUIC varint cannot encode {value} (> 2**62-1)")


_QUIC_PREFIX: Final = {1: 0, 2: 0x4000, 4: 0x8000_0000, 8: 0xC000_0000_0000_0000}


def encode_quic_varint(value: int, *, length: int | None = None) -> bytes:
    """Encode ``value`` as a QUIC varint, minimal unless ``length`` (1, 2, 4, 8) is given."""
    n = quic_varint_size(value) if length is None else length
    if n not in _QUIC_PREFIX:
        raise ValueError(f"invalid QUIC varint length {n}")
    if value < 0 or value >= 1 << (8 * n - 2):
        raise ValueError(f"{value} does not fit a {n}-byte QUIC varint")
    return (_QUIC_PREFIX[n] | value).to_bytes(n, "big")


def read_quic_varint(data: Buffer, offset: int = 0, *, end: int | None = None) -> tuple[int, int]:
    """Decode the QUIC varint at ``data[offset:]``. Returns ``(value, consumed)``."""
    if end is None:
        end = len(data)
    if offset >= end:
        raise BufferUnderflow(1)
    b0 = data[offset]
    n = 1 << (b0 >> 6)
    if n == 1:
        return b0, 1
    if offset + n > end:
        raise BufferUnderflow(offset + n - end)
    return int.from_bytes(data[offset : offset + n], "big") & ((1 << (8 * n - 2)) - 1), n
