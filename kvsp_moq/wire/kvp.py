"""Key-Value-Pairs (draft-18 and draft-20 §"Key-Value-Pair Structure"; same in 22).

::

    Key-Value-Pair {
      Delta Type (vi64),
      [Length (vi64),]      -- only when Type is odd
      Value (..)            -- even Type: one vi64; odd Type: Length bytes
    }

* Type = previous Type + Delta Type (the first from 0). Types are therefore non-decreasing
  in a list; a repeated type is a delta of 0 (allowed where the type allows repeats).
  A sum above 2**64-1 → PROTOCOL_VIOLATION.
* Odd types: Length at most 2**16-1; larger → PROTOCOL_VIOLATION.
* A list of KVPs is always bounded by an external byte length (Properties Length, the rest
  of a message, ...). A pair that runs past that bound is malformed framing; we report
  PROTOCOL_VIOLATION, as the draft does for a Message Length that does not match its body.
* KEY_VALUE_FORMATTING_ERROR is for a *known* type whose value does not have the form that
  type defines; only the consumer that knows the type can tell (use
  :func:`kvp_formatting_error`).

Used for Setup Options, Track Properties and Object Properties (drafts 16+: delta coded).
Control-message *Parameters* are not KVPs since draft 17 and have their own codec.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

from .buffer import Buffer, Reader, Writer
from .errors import BufferUnderflow, LimitExceeded, SessionErrorCode, WireError
from .varint import VI64_MAX

__all__ = [
    "MAX_KVP_VALUE_LENGTH",
    "KeyValuePair",
    "decode_kvps",
    "encode_kvps",
    "kvp_formatting_error",
    "kvp_get",
    "kvp_get_all",
    "read_kvps",
    "write_kvps",
]

#: Maximum length of an odd-type value (draft-20 §"Key-Value-Pair Structure").
MAX_KVP_VALUE_LENGTH = 0xFFFF


class KeyValuePair(NamedTuple):
    """One pair with its absolute ``type``; ``value`` is an ``int`` (even) or ``bytes`` (odd)."""

    type: int
    value: int | bytes


def read_kvps(reader: Reader, *, max_pairs: int | None = None) -> list[KeyValuePair]:
    """Parse pairs until the end of ``reader``'s window, which must bound the list.

    Raises :class:`WireError` (PROTOCOL_VIOLATION) for a malformed list and
    :class:`LimitExceeded` if more than ``max_pairs`` pairs are present.
    """
    pairs: list[KeyValuePair] = []
    prev = 0
    try:
        while not reader.at_end():
            ktype = prev + reader.pull_vi64()
            if ktype > VI64_MAX:
                raise WireError(SessionErrorCode.PROTOCOL_VIOLATION, "KVP type exceeds 2**64-1")
            if ktype & 1:
                length = reader.pull_vi64()
                if length > MAX_KVP_VALUE_LENGTH:
                    raise WireError(
                        SessionErrorCode.PROTOCOL_VIOLATION,
                        f"KVP value length {length} > {MAX_KVP_VALUE_LENGTH}",
                    )
                value: int | bytes = bytes(reader.pull_bytes(length))
            else:
                value = reader.pull_vi64()
            pairs.append(KeyValuePair(ktype, value))
            if max_pairs is not None and len(pairs) > max_pairs:
                raise LimitExceeded(f"more than {max_pairs} key-value pairs")
            prev = ktype
    except BufferUnderflow:
        raise WireError(
            SessionErrorCode.PROTOCOL_VIOLATION, "key-value pair runs past the end of its list"
        ) from None
    return pairs


def decode_kvps(
    data: Buffer, *, seven_byte: bool = True, max_pairs: int | None = None
) -> tuple[KeyValuePair, ...]:
    """Parse a complete, externally bounded list of pairs."""
    return tuple(read_kvps(Reader(data, seven_byte=seven_byte), max_pairs=max_pairs))


def write_kvps(writer: Writer, pairs: Iterable[tuple[int, int | Buffer]]) -> None:
    """Append ``pairs`` (absolute types, non-decreasing) delta-coded to ``writer``.

    Raises ``ValueError``/``TypeError`` for pairs that cannot be encoded: a type below its
    predecessor, an even type without an integer value, an odd type without a bytes value or
    with one longer than 65535 bytes.
    """
    prev = 0
    for ktype, value in pairs:
        if not 0 <= ktype <= VI64_MAX:
            raise ValueError(f"KVP type {ktype} out of range")
        if ktype < prev:
            raise ValueError(f"KVP types must be non-decreasing ({ktype} after {prev})")
        writer.push_vi64(ktype - prev)
        if ktype & 1:
            if isinstance(value, int):
                raise TypeError(f"odd KVP type {ktype:#x} needs a bytes value")
            if len(value) > MAX_KVP_VALUE_LENGTH:
                raise ValueError(f"KVP value of {len(value)} bytes > {MAX_KVP_VALUE_LENGTH}")
            writer.push_vi64(len(value))
            writer.push_bytes(value)
        else:
            if not isinstance(value, int):
                raise TypeError(f"even KVP type {ktype:#x} needs an integer value")
            writer.push_vi64(value)
        prev = ktype


def encode_kvps(pairs: Iterable[tuple[int, int | Buffer]], *, seven_byte: bool = True) -> bytes:
    """Encode ``pairs`` (see :func:`write_kvps`)."""
    w = Writer(seven_byte=seven_byte)
    write_kvps(w, pairs)
    return w.getvalue()


def kvp_get(pairs: Iterable[KeyValuePair], ktype: int) -> int | bytes | None:
    """Value of the first pair of type ``ktype``, or ``None``."""
    for t, v in pairs:
        if t == ktype:
            return v
    return None


def kvp_get_all(pairs: Iterable[KeyValuePair], ktype: int) -> list[int | bytes]:
    """Values of every pair of type ``ktype``, in order."""
    return [v for t, v in pairs if t == ktype]


def kvp_formatting_error(ktype: int, reason: str) -> WireError:
    """The error for a known type whose value does not match its definition."""
    return WireError(SessionErrorCode.KEY_VALUE_FORMATTING_ERROR, f"type {ktype:#x}: {reason}")
