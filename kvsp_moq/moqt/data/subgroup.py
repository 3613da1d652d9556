"""Subgroup streams (draft-20 / draft-18 §"Subgroup Header", §"Object Status", §"Object
Properties", §"Closing Subgroup Streams"): SUBGROUP_HEADER and subgroup objects.

Public API re-exported by :mod:`kvsp_moq.moqt.data`, which documents the event model.
"""

from __future__ import annotations

from typing import NamedTuple

from ...wire.buffer import Buffer, Reader, Writer
from ...wire.varint import VI64_MAX
from .common import (
    DEFAULT_MAX_PROPERTIES_LENGTH,
    NORMAL,
    Properties,
    check_vi64,
    decode_properties,
    object_status,
    properties_bytes,
    pull_properties,
    violation,
)
from .incremental import IncrementalParser
from ..objects import (
    SUBGROUP_FLAG_DEFAULT_PRIORITY,
    SUBGROUP_FLAG_END_OF_GROUP,
    SUBGROUP_FLAG_FIRST_OBJECT,
    SUBGROUP_FLAG_PROPERTIES,
    ObjectBegin,
    ObjectEnd,
    ObjectStatus,
    SubgroupHeader,
    SubgroupIdMode,
    is_subgroup_type,
)
from ..version import DEFAULT_VERSION, Version

__all__ = ["SubgroupStreamEncoder", "SubgroupStreamParser", "encode_subgroup_header"]


def _read_subgroup_header(r: Reader) -> SubgroupHeader:
    t = r.pull_vi64()
    if not is_subgroup_type(t):
        raise violation(f"invalid SUBGROUP_HEADER type {t:#x}")
    track_alias = r.pull_vi64()
    group_id = r.pull_vi64()
    mode = SubgroupIdMode((t >> 1) & 0x03)
    if mode is SubgroupIdMode.EXPLICIT:
        subgroup_id: int | None = r.pull_vi64()
    elif mode is SubgroupIdMode.ZERO:
        subgroup_id = 0
    else:
        subgroup_id = None
    priority = None if t & SUBGROUP_FLAG_DEFAULT_PRIORITY else r.pull_uint8()
    return SubgroupHeader(
        track_alias=track_alias,
        group_id=group_id,
        subgroup_id=subgroup_id,
        publisher_priority=priority,
        subgroup_id_mode=mode,
        has_properties=bool(t & SUBGROUP_FLAG_PROPERTIES),
        end_of_group=bool(t & SUBGROUP_FLAG_END_OF_GROUP),
        first_object=bool(t & SUBGROUP_FLAG_FIRST_OBJECT),
    )


def _write_subgroup_header(w: Writer, header: SubgroupHeader) -> None:
    check_vi64("track alias", header.track_alias)
    check_vi64("group id", header.group_id)
    w.push_vi64(header.type_flags)
    w.push_vi64(header.track_alias)
    w.push_vi64(header.group_id)
    if header.subgroup_id_mode is SubgroupIdMode.EXPLICIT:
        assert header.subgroup_id is not None
        check_vi64("subgroup id", header.subgroup_id)
        w.push_vi64(header.subgroup_id)
    if header.publisher_priority is not None:
        w.push_uint8(header.publisher_priority)


def encode_subgroup_header(header: SubgroupHeader, version: Version = DEFAULT_VERSION) -> bytes:
    """The SUBGROUP_HEADER bytes that open a subgroup stream."""
    w = Writer(seven_byte=version.vi64_seven_byte)
    _write_subgroup_header(w, header)
    return w.getvalue()


class _SubgroupObjectUnit(NamedTuple):
    object_id_delta: int
    raw_properties: bytes
    payload_length: int
    status: ObjectStatus


class SubgroupStreamParser(IncrementalParser):
    """Incremental parser of a subgroup stream (header included)."""

    __slots__ = ("version", "max_properties_length", "header", "_prev_object_id",
                 "_subgroup_id", "_terminal")

    def __init__(
        self,
        version: Version = DEFAULT_VERSION,
        *,
        max_properties_length: int = DEFAULT_MAX_PROPERTIES_LENGTH,
    ) -> None:
        super().__init__(seven_byte=version.vi64_seven_byte)
        self.version = version
        self.max_properties_length = max_properties_length
        #: The SUBGROUP_HEADER once parsed.
        self.header: SubgroupHeader | None = None
        self._prev_object_id: int | None = None
        self._subgroup_id: int | None = None
        self._terminal: ObjectStatus | None = None

    @property
    def subgroup_id(self) -> int | None:
        """The Subgroup ID, once known (mode FIRST_OBJECT_ID: after the first object)."""
        return self._subgroup_id

    @property
    def last_object_id(self) -> int | None:
        return self._prev_object_id

    def _unit_complete(self) -> bool:
        return self.header is not None

    def _parse_unit(self, r: Reader) -> object:
        header = self.header
        if header is None:
            return _read_subgroup_header(r)
        # §"Subgroup Header", Subgroup Object Fields.
        delta = r.pull_vi64()
        raw = pull_properties(r, self.max_properties_length) if header.has_properties else b""
        length = r.pull_vi64()
        # The Object Status field is only sent if the Object Payload Length is zero.
        status = object_status(r.pull_vi64()) if length == 0 else NORMAL
        return _SubgroupObjectUnit(delta, raw, length, status)

    def _apply_unit(self, unit: object, events: list[object]) -> int:
        if isinstance(unit, SubgroupHeader):
            self.header = unit
            self._subgroup_id = unit.subgroup_id
            events.append(unit)
            return 0
        assert isinstance(unit, _SubgroupObjectUnit) and self.header is not None
        if self._terminal is not None:
            # §"Closing Subgroup Streams": objects after EndOfGroup/EndOfTrack are a violation.
            raise violation(f"object after {self._terminal.name} on the same subgroup stream")
        prev = self._prev_object_id
        object_id = unit.object_id_delta if prev is None else prev + unit.object_id_delta + 1
        if object_id > VI64_MAX:
            raise violation("Object ID exceeds 2**64-1")
        status = unit.status
        if unit.raw_properties and status is not NORMAL:
            # §"Object Properties": properties on a non-Normal object.
            raise violation(f"properties on an object with status {status.name}")
        props = decode_properties(unit.raw_properties, self._seven_byte)
        if self._subgroup_id is None:  # SUBGROUP_ID_MODE 0b01: the first Object ID
            self._subgroup_id = object_id
        self._prev_object_id = object_id
        if status is not NORMAL:
            self._terminal = status
        header = self.header
        events.append(
            ObjectBegin(
                group_id=header.group_id,
                subgroup_id=self._subgroup_id,
                object_id=object_id,
                publisher_priority=header.publisher_priority,
                status=status,
                payload_length=unit.payload_length,
                properties=props,
                raw_properties=unit.raw_properties,
            )
        )
        self._end_event = ObjectEnd(header.group_id, object_id)
        return unit.payload_length


class SubgroupStreamEncoder:
    """Serializes one subgroup stream: :meth:`header`, then objects in ascending ID order."""

    __slots__ = ("version", "header_fields", "_seven_byte", "_prev_object_id", "_terminal")

    def __init__(self, header: SubgroupHeader, version: Version = DEFAULT_VERSION) -> None:
        self.version = version
        self.header_fields = header
        self._seven_byte = version.vi64_seven_byte
        self._prev_object_id: int | None = None
        self._terminal = False

    def header(self) -> bytes:
        return encode_subgroup_header(self.header_fields, self.version)

    def object_header(
        self,
        object_id: int,
        payload_length: int,
        *,
        properties: Properties = (),
        status: ObjectStatus = NORMAL,
    ) -> bytes:
        """The object's fields up to (not including) its payload; advances the Object ID."""
        w = Writer(seven_byte=self._seven_byte)
        self._write_object_header(w, object_id, payload_length, properties, status)
        return w.getvalue()

    def object(
        self,
        object_id: int,
        payload: Buffer = b"",
        *,
        properties: Properties = (),
        status: ObjectStatus = NORMAL,
    ) -> bytes:
        """A whole object (fields and payload)."""
        w = Writer(seven_byte=self._seven_byte)
        self._write_object_header(w, object_id, len(payload), properties, status)
        w.push_bytes(payload)
        return w.getvalue()

    def _write_object_header(
        self,
        w: Writer,
        object_id: int,
        payload_length: int,
        properties: Properties,
        status: ObjectStatus,
    ) -> None:
        check_vi64("object id", object_id)
        check_vi64("payload length", payload_length)
        status = ObjectStatus(status)
        if self._terminal:
            raise ValueError("no object may follow an End of Group/Track status object")
        prev = self._prev_object_id
        if prev is not None and object_id <= prev:
            raise ValueError(f"Object IDs must increase on a stream: {object_id} after {prev}")
        raw = properties_bytes(properties, self._seven_byte)
        if raw and not self.header_fields.has_properties:
            raise ValueError("properties need a SUBGROUP_HEADER with the PROPERTIES flag")
        if status is not NORMAL and (payload_length or raw):
            raise ValueError(f"an object with status {status.name} has no payload or properties")
        # Object ID Delta: the ID for the first object, else ID - previous - 1.
        w.push_vi64(object_id if prev is None else object_id - prev - 1)
        if self.header_fields.has_properties:
            w.push_vi64(len(raw))
            w.push_bytes(raw)
        w.push_vi64(payload_length)
        if payload_length == 0:
            w.push_vi64(status)
        self._prev_object_id = object_id
        self._terminal = status is not NORMAL
