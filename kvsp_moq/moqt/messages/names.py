"""Track Namespace and Full Track Name (draft-20 §"Track Naming"; same text and bytes in 18).

::

    Track Namespace {
      Number of Track Namespace Fields (vi64),
      Track Namespace Field { Length (vi64), Value (..) } ...
    }
    Full Track Name = Track Namespace, Track Name Length (vi64), Track Name (..)

Limits, each a PROTOCOL_VIOLATION when received (§"Track Naming"):

* more than 32 Track Namespace Fields;
* a Track Namespace Field of length 0 ("MUST contain at least one byte");
* a Track Namespace, or a Full Track Name (sum of the field lengths plus the Track Name
  length), longer than 4096 bytes.

All are checked *before* the bytes they announce are taken, so a hostile count or length
allocates nothing. The Track Name may be empty. Namespaces of 0 fields are allowed (the draft
says "between 0 and 32"); a Track Namespace Prefix / Suffix uses the same structure.

The draft's reserved first field ``.`` (DOES_NOT_EXIST) and ``.session`` are request-level
semantics for the session, not wire errors.
"""

from __future__ import annotations

from collections.abc import Sequence

from ...wire.buffer import Buffer, Reader, Writer
from ._fields import violation

__all__ = [
    "MAX_FULL_TRACK_NAME_LENGTH",
    "MAX_NAMESPACE_FIELDS",
    "TrackNamespace",
    "check_full_track_name",
    "check_track_namespace",
    "read_full_track_name",
    "read_track_name",
    "read_track_namespace",
    "write_full_track_name",
    "write_track_namespace",
]

MAX_NAMESPACE_FIELDS = 32
MAX_FULL_TRACK_NAME_LENGTH = 4096

#: A Track Namespace: its fields, in order.
TrackNamespace = tuple[bytes, ...]


def read_track_namespace(r: Reader) -> TrackNamespace:
    """Read a Track Namespace and enforce the field count, empty field and size limits."""
    count = r.pull_vi64()
    if count > MAX_NAMESPACE_FIELDS:
        raise violation(f"Track Namespace of {count} fields exceeds {MAX_NAMESPACE_FIELDS}")
    fields: list[bytes] = []
    total = 0
    for _ in range(count):
        length = r.pull_vi64()
        if length == 0:
            raise violation("empty Track Namespace Field")
        total += length
        if total > MAX_FULL_TRACK_NAME_LENGTH:
            raise violation(f"Track Namespace exceeds {MAX_FULL_TRACK_NAME_LENGTH} bytes")
        fields.append(bytes(r.pull_bytes(length)))
    return tuple(fields)


def read_track_name(r: Reader, namespace: TrackNamespace) -> bytes:
    """Read ``Track Name Length, Track Name`` completing a Full Track Name of ``namespace``."""
    length = r.pull_vi64()
    used = sum(len(f) for f in namespace)
    if used + length > MAX_FULL_TRACK_NAME_LENGTH:
        raise violation(f"Full Track Name exceeds {MAX_FULL_TRACK_NAME_LENGTH} bytes")
    return bytes(r.pull_bytes(length))


def read_full_track_name(r: Reader) -> tuple[TrackNamespace, bytes]:
    namespace = read_track_namespace(r)
    return namespace, read_track_name(r, namespace)


# -- encoding ---------------------------------------------------------------------------------
def check_track_namespace(namespace: Sequence[Buffer]) -> TrackNamespace:
    """The namespace as a tuple of ``bytes``; ``ValueError`` if a peer would reject it."""
    if isinstance(namespace, bytes | bytearray | memoryview | str):
        raise TypeError("a Track Namespace is a sequence of fields, not one byte string")
    fields = tuple(bytes(f) for f in namespace)
    if len(fields) > MAX_NAMESPACE_FIELDS:
        raise ValueError(f"Track Namespace of {len(fields)} fields exceeds {MAX_NAMESPACE_FIELDS}")
    if any(not f for f in fields):
        raise ValueError("empty Track Namespace Field")
    if sum(map(len, fields)) > MAX_FULL_TRACK_NAME_LENGTH:
        raise ValueError(f"Track Namespace exceeds {MAX_FULL_TRACK_NAME_LENGTH} bytes")
    return fields


def check_full_track_name(namespace: Sequence[Buffer], name: Buffer) -> None:
    fields = check_track_namespace(namespace)
    if sum(map(len, fields)) + len(name) > MAX_FULL_TRACK_NAME_LENGTH:
        raise ValueError(f"Full Track Name exceeds {MAX_FULL_TRACK_NAME_LENGTH} bytes")


def write_track_namespace(w: Writer, namespace: Sequence[Buffer]) -> None:
    fields = check_track_namespace(namespace)
    w.push_vi64(len(fields))
    for f in fields:
        w.push_vi64(len(f))
        w.push_bytes(f)


def write_full_track_name(w: Writer, namespace: Sequence[Buffer], name: Buffer) -> None:
    check_full_track_name(namespace, name)
    write_track_namespace(w, namespace)
    w.push_vi64(len(name))
    w.push_bytes(name)
