"""Helpers shared by the data-plane codecs (the modules of this package); see
:mod:`kvsp_moq.moqt.data`."""

from __future__ import annotations

from collections.abc import Sequence

from ...wire.buffer import Buffer, Reader, Writer
from ...wire.errors import LimitExceeded, SessionErrorCode, WireError
from ...wire.kvp import KeyValuePair, read_kvps, write_kvps
from ...wire.varint import VI64_MAX
from ..objects import ObjectStatus

__all__ = [
    "DEFAULT_MAX_PROPERTIES_LENGTH",
    "NORMAL",
    "PV",
    "Properties",
    "check_priority",
    "check_vi64",
    "decode_properties",
    "object_status",
    "properties_bytes",
    "pull_properties",
    "violation",
]

#: Local limit on one object's Properties field. The draft sets none (each odd-type value is
#: at most 65535 bytes, but a list may hold many); this bounds what a parser buffers.
DEFAULT_MAX_PROPERTIES_LENGTH = 1 << 20

#: Object Properties to send: ``(type, value)`` pairs with non-decreasing types, or the
#: already-encoded KVP bytes (to forward received properties unchanged).
Properties = Sequence[tuple[int, int | Buffer]] | bytes | bytearray | memoryview

PV = SessionErrorCode.PROTOCOL_VIOLATION
NORMAL = ObjectStatus.NORMAL


def violation(reason: str) -> WireError:
    return WireError(PV, reason)


def object_status(value: int) -> ObjectStatus:
    # §"Object Status": values other than 0x0, 0x3, 0x4 → PROTOCOL_VIOLATION.
    try:
        return ObjectStatus(value)
    except ValueError:
        raise violation(f"unknown Object Status {value:#x}") from None


def pull_properties(r: Reader, limit: int) -> bytes:
    """Properties Length (vi64) + bytes (§"Object Properties"), copied out of the reader."""
    length = r.pull_vi64()
    if length > limit:
        raise LimitExceeded(f"Object Properties of {length} bytes > local limit {limit}")
    return bytes(r.pull_bytes(length))


def decode_properties(raw: bytes, seven_byte: bool) -> tuple[KeyValuePair, ...]:
    return tuple(read_kvps(Reader(raw, seven_byte=seven_byte))) if raw else ()


def properties_bytes(props: Properties, seven_byte: bool) -> Buffer:
    if isinstance(props, bytes | bytearray | memoryview):
        return props
    if not props:
        return b""
    w = Writer(seven_byte=seven_byte)
    write_kvps(w, props)
    return w.view()


def check_vi64(name: str, value: int) -> None:
    if not 0 <= value <= VI64_MAX:
        raise ValueError(f"{name} {value} is not a 64-bit unsigned integer")


def check_priority(value: int) -> None:
    if not 0 <= value <= 0xFF:
        raise ValueError(f"publisher priority {value} not in 0..255")
