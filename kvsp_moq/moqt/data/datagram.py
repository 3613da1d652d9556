"""OBJECT_DATAGRAM (draft-20 / draft-18 §"Object Datagram"); padding datagrams are recognised
here too (§"Padding Datagrams"). Public API re-exported by :mod:`kvsp_moq.moqt.data`.
"""

from __future__ import annotations

from ...wire.buffer import Buffer, Reader, Writer
from ...wire.errors import BufferUnderflow
from .common import (
    DEFAULT_MAX_PROPERTIES_LENGTH,
    NORMAL,
    check_priority,
    check_vi64,
    decode_properties,
    object_status,
    properties_bytes,
    pull_properties,
    violation,
)
from ..objects import (
    DATAGRAM_FLAG_DEFAULT_PRIORITY,
    DATAGRAM_FLAG_END_OF_GROUP,
    DATAGRAM_FLAG_PROPERTIES,
    DATAGRAM_FLAG_STATUS,
    DATAGRAM_FLAG_ZERO_OBJECT_ID,
    PADDING_DATAGRAM_TYPE,
    ObjectDatagram,
    ObjectStatus,
    PaddingDatagram,
    is_datagram_type,
)
from ..version import DEFAULT_VERSION, Version

__all__ = ["encode_datagram", "parse_datagram"]


def parse_datagram(
    version: Version,
    data: Buffer,
    *,
    max_properties_length: int = DEFAULT_MAX_PROPERTIES_LENGTH,
) -> ObjectDatagram | PaddingDatagram:
    """Parse one QUIC datagram. The payload is a memoryview of ``data``."""
    r = Reader(data, seven_byte=version.vi64_seven_byte)
    try:
        t = r.pull_vi64()
        if t == PADDING_DATAGRAM_TYPE:
            return PaddingDatagram(r.remaining)
        if not is_datagram_type(t):
            # Unknown datagram type → close the session (no code named; PROTOCOL_VIOLATION).
            raise violation(f"invalid datagram type {t:#x}")
        track_alias = r.pull_vi64()
        group_id = r.pull_vi64()
        object_id = 0 if t & DATAGRAM_FLAG_ZERO_OBJECT_ID else r.pull_vi64()
        priority = None if t & DATAGRAM_FLAG_DEFAULT_PRIORITY else r.pull_uint8()
        raw = b""
        if t & DATAGRAM_FLAG_PROPERTIES:
            raw = pull_properties(r, max_properties_length)
            if not raw:
                raise violation("datagram with the PROPERTIES flag and Properties Length 0")
        if t & DATAGRAM_FLAG_STATUS:
            status = object_status(r.pull_vi64())
            if raw and status is not NORMAL:
                raise violation(f"properties on a datagram with status {status.name}")
            if not r.at_end():
                raise violation("bytes after the Object Status of a datagram")
            payload: memoryview = r.pull_rest()
        else:
            status = NORMAL
            payload = r.pull_rest()
    except BufferUnderflow:
        raise violation("truncated datagram") from None
    return ObjectDatagram(
        track_alias=track_alias,
        group_id=group_id,
        object_id=object_id,
        publisher_priority=priority,
        status=status,
        payload=payload,
        end_of_group=bool(t & DATAGRAM_FLAG_END_OF_GROUP),
        properties=decode_properties(raw, version.vi64_seven_byte),
        raw_properties=raw,
    )


def encode_datagram(datagram: ObjectDatagram, version: Version = DEFAULT_VERSION) -> bytes:
    """Serialize an OBJECT_DATAGRAM with the shortest Type Flags.

    A NORMAL object is sent with its payload (even when empty); any other status with the
    STATUS flag, which excludes END_OF_GROUP, payload and properties.
    """
    d = datagram
    seven_byte = version.vi64_seven_byte
    check_vi64("track alias", d.track_alias)
    check_vi64("group id", d.group_id)
    check_vi64("object id", d.object_id)
    raw = d.raw_properties or properties_bytes(d.properties, seven_byte)
    status = ObjectStatus(d.status)
    t = 0
    if raw:
        t |= DATAGRAM_FLAG_PROPERTIES
    if d.end_of_group:
        t |= DATAGRAM_FLAG_END_OF_GROUP
    if d.object_id == 0:
        t |= DATAGRAM_FLAG_ZERO_OBJECT_ID
    if d.publisher_priority is None:
        t |= DATAGRAM_FLAG_DEFAULT_PRIORITY
    else:
        check_priority(d.publisher_priority)
    if status is not NORMAL:
        if d.end_of_group or len(d.payload) or raw:
            raise ValueError(
                f"a {status.name} datagram has no payload, properties or END_OF_GROUP flag"
            )
        t |= DATAGRAM_FLAG_STATUS
    w = Writer(seven_byte=seven_byte)
    w.push_vi64(t)
    w.push_vi64(d.track_alias)
    w.push_vi64(d.group_id)
    if d.object_id:
        w.push_vi64(d.object_id)
    if d.publisher_priority is not None:
        w.push_uint8(d.publisher_priority)
    if raw:
        w.push_vi64(len(raw))
        w.push_bytes(raw)
    if status is not NORMAL:
        w.push_vi64(status)
    else:
        w.push_bytes(d.payload)
    return w.getvalue()
