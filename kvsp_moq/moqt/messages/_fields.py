"""Field encodings shared by the control messages (drafts 18, 20/21, 22).

Section names are those of the draft-20 editor's copy (``shared/spec``); draft 18 has the same
structures under the same names (§"Notational Conventions"):

* :class:`Location` — ``{Group (vi64), Object (vi64)}``, ordered lexicographically
  (§"Location Structure"); a ``NamedTuple``, so Python's tuple order is the draft's order.
* Reason Phrase — ``Length (vi64) <= 1024, Value (..)`` UTF-8 (§"Reason Phrase Structure");
  a longer length → PROTOCOL_VIOLATION.
* Length-prefixed byte strings with a maximum (URIs): the maximum is checked before a byte is
  taken, so a hostile length allocates nothing.
* Track Properties — Key-Value-Pairs to the end of the message (§"Properties").

Decoders take a :class:`Reader` bounded to the message body; running out of bytes raises
:class:`BufferUnderflow`, which the framing (``codec``) turns into PROTOCOL_VIOLATION because
the body is complete by then. Encoders raise ``ValueError``/``TypeError`` for values that
cannot be sent.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

from ...wire.buffer import Buffer, Reader, Writer
from ...wire.errors import SessionErrorCode, WireError
from ...wire.kvp import KeyValuePair, read_kvps, write_kvps
from ...wire.varint import VI64_MAX

__all__ = [
    "MAX_REASON_PHRASE_LENGTH",
    "Location",
    "TrackProperties",
    "check_uint8",
    "check_vi64",
    "read_bytes",
    "read_location",
    "read_reason_phrase",
    "read_track_properties",
    "read_uri",
    "violation",
    "write_bytes",
    "write_location",
    "write_reason_phrase",
    "write_track_properties",
    "write_uri",
]

#: §"Reason Phrase Structure": "The reason phrase length has a maximum value of 1024 bytes."
MAX_REASON_PHRASE_LENGTH = 1024

#: Track Properties as carried in SUBSCRIBE_OK, PUBLISH, FETCH_OK, REQUEST_OK.
TrackProperties = tuple[KeyValuePair, ...]

_PV = SessionErrorCode.PROTOCOL_VIOLATION


def violation(reason: str, code: int = _PV) -> WireError:
    """The error that closes the session (PROTOCOL_VIOLATION unless ``code`` says otherwise)."""
    return WireError(code, reason)


class Location(NamedTuple):
    """§"Location Structure": ``{Group, Object}``; compares as the draft orders Locations."""

    group: int
    object: int


# -- integers ---------------------------------------------------------------------------------
def check_vi64(name: str, value: int) -> int:
    """``value`` if it fits a vi64, else ``ValueError`` (for encoders)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, not {type(value).__name__}")
    if not 0 <= value <= VI64_MAX:
        raise ValueError(f"{name} {value} is not a 64-bit unsigned integer")
    return value


def check_uint8(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, not {type(value).__name__}")
    if not 0 <= value <= 0xFF:
        raise ValueError(f"{name} {value} not in 0..255")
    return value


# -- Location ---------------------------------------------------------------------------------
def read_location(r: Reader) -> Location:
    group = r.pull_vi64()
    return Location(group, r.pull_vi64())


def write_location(w: Writer, loc: Location) -> None:
    w.push_vi64(check_vi64("Location.Group", loc[0]))
    w.push_vi64(check_vi64("Location.Object", loc[1]))


# -- length-prefixed bytes --------------------------------------------------------------------
def read_bytes(r: Reader, limit: int, what: str) -> bytes:
    """``Length (vi64), Value (..)`` with ``Length <= limit`` (else PROTOCOL_VIOLATION)."""
    length = r.pull_vi64()
    if length > limit:
        raise violation(f"{what} of {length} bytes exceeds {limit}")
    return bytes(r.pull_bytes(length))


def write_bytes(w: Writer, value: Buffer, limit: int, what: str) -> None:
    if len(value) > limit:
        raise ValueError(f"{what} of {len(value)} bytes exceeds {limit}")
    w.push_vi64(len(value))
    w.push_bytes(value)


def read_reason_phrase(r: Reader) -> str:
    """§"Reason Phrase Structure". The value is diagnostic text only, so bytes that are not
    UTF-8 are replaced rather than rejected (the draft names no error for them)."""
    return read_bytes(r, MAX_REASON_PHRASE_LENGTH, "Reason Phrase").decode("utf-8", "replace")


def write_reason_phrase(w: Writer, text: str) -> None:
    write_bytes(w, text.encode("utf-8"), MAX_REASON_PHRASE_LENGTH, "Reason Phrase")


def read_uri(r: Reader, limit: int, what: str) -> str:
    """A URI (GOAWAY New Session URI, Redirect Connect URI). A URI (RFC 3986) is text; bytes
    that are not UTF-8 cannot be one, so they are a PROTOCOL_VIOLATION (our decision: the draft
    names no error, and a URI is not diagnostic text that may be mangled)."""
    raw = read_bytes(r, limit, what)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise violation(f"{what} is not UTF-8") from None


def write_uri(w: Writer, uri: str, limit: int, what: str) -> None:
    write_bytes(w, uri.encode("utf-8"), limit, what)


# -- Track Properties -------------------------------------------------------------------------
def read_track_properties(r: Reader) -> TrackProperties:
    """§"Properties": KVPs filling the rest of the message (bounded by Message Length)."""
    return tuple(read_kvps(r))


def write_track_properties(w: Writer, props: Iterable[tuple[int, int | Buffer]]) -> None:
    write_kvps(w, props)
