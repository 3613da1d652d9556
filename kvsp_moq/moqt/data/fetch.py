"""Fetch streams (draft-20 / draft-18 §"Fetch Header", §"Flags", §"End of Range"):
FETCH_HEADER, delta-coded fetch objects and End of Range markers. Also the fill fetch streams
of draft 20+ (§"Fill Semantics"), which use the same bytes.

Public API re-exported by :mod:`kvsp_moq.moqt.data`, which documents the event model.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from ...wire.buffer import Buffer, Reader, Writer
from ...wire.varint import VI64_MAX, encode_vi64
from .common import (
    DEFAULT_MAX_PROPERTIES_LENGTH,
    NORMAL,
    Properties,
    check_priority,
    check_vi64,
    decode_properties,
    properties_bytes,
    pull_properties,
    violation,
)
from .incremental import IncrementalParser
from ..objects import (
    FETCH_FLAG_DATAGRAM,
    FETCH_FLAG_GROUP_ID,
    FETCH_FLAG_OBJECT_ID,
    FETCH_FLAG_PRIORITY,
    FETCH_FLAG_PROPERTIES,
    FETCH_HEADER_TYPE,
    FETCH_SUBGROUP_MASK,
    EndOfRange,
    EndOfRangeKind,
    FetchHeader,
    GroupOrder,
    ObjectBegin,
    ObjectEnd,
)
from ..version import DEFAULT_VERSION, Version

__all__ = ["FetchStreamEncoder", "FetchStreamParser", "GroupOrderSource", "encode_fetch_header"]


def encode_fetch_header(request_id: int, version: Version = DEFAULT_VERSION) -> bytes:
    """FETCH_HEADER: type 0x05 and the Request ID."""
    check_vi64("request id", request_id)
    return b"\x05" + encode_vi64(request_id, seven_byte=version.vi64_seven_byte)


class _FetchObjectUnit(NamedTuple):
    flags: int
    group_delta: int | None
    subgroup_id: int | None
    object_delta: int | None
    priority: int | None
    raw_properties: bytes
    payload_length: int


class _EndOfRangeUnit(NamedTuple):
    kind: EndOfRangeKind
    group_id: int
    object_id: int
    payload_length: int


GroupOrderSource = GroupOrder | Callable[[int], GroupOrder]


class FetchStreamParser(IncrementalParser):
    """Incremental parser of a fetch stream (FETCH_HEADER included).

    Group ID deltas depend on the FETCH's Group Order, which is not on the stream: pass it,
    or a function from the Request ID in the header to the order (called once, when the
    header is parsed). The receiver knows it from its own FETCH (GROUP_ORDER parameter,
    ASCENDING when omitted — §"GROUP ORDER Parameter") or from the FILL_PARAMETERS of its
    SUBSCRIBE for a fill fetch stream.
    """

    __slots__ = ("version", "max_properties_length", "header", "group_order", "_order_source",
                 "_prior_group", "_prior_object", "_prior_subgroup", "_prior_priority")

    def __init__(
        self,
        version: Version = DEFAULT_VERSION,
        *,
        group_order: GroupOrderSource = GroupOrder.ASCENDING,
        max_properties_length: int = DEFAULT_MAX_PROPERTIES_LENGTH,
    ) -> None:
        super().__init__(seven_byte=version.vi64_seven_byte)
        self.version = version
        self.max_properties_length = max_properties_length
        self.header: FetchHeader | None = None
        self._order_source = group_order
        #: Group order used to resolve Group ID deltas (resolved when the header arrives).
        self.group_order: GroupOrder | None = (
            GroupOrder(group_order) if isinstance(group_order, GroupOrder | int) else None
        )
        self._prior_group: int | None = None
        self._prior_object: int | None = None
        self._prior_subgroup: int | None = None
        self._prior_priority: int | None = None

    def _unit_complete(self) -> bool:
        return self.header is not None

    def _parse_unit(self, r: Reader) -> object:
        if self.header is None:
            t = r.pull_vi64()
            if t != FETCH_HEADER_TYPE:
                raise violation(f"not a FETCH_HEADER: stream type {t:#x}")
            return FetchHeader(r.pull_vi64())
        flags = r.pull_vi64()
        if flags >= 0x80:
            # §"Fetch Header": 0x8C, 0x10C, 0x20C (20+) are End of Range; others invalid.
            if flags == EndOfRangeKind.NON_EXISTENT or flags == EndOfRangeKind.UNKNOWN or (
                flags == EndOfRangeKind.TIMED_OUT and self.version.end_of_timed_out_range
            ):
                # §"End of Range": the Group ID and Object ID fields are present, then the
                # Object Payload Length of every fetch object (it must be 0). See
                # docs/moqt-wire.md for reading both IDs as absolute.
                group_id = r.pull_vi64()
                object_id = r.pull_vi64()
                return _EndOfRangeUnit(EndOfRangeKind(flags), group_id, object_id, r.pull_vi64())
            raise violation(f"invalid fetch Serialization Flags {flags:#x}")
        group_delta = r.pull_vi64() if flags & FETCH_FLAG_GROUP_ID else None
        subgroup_id = None
        if not flags & FETCH_FLAG_DATAGRAM and flags & FETCH_SUBGROUP_MASK == 0x03:
            subgroup_id = r.pull_vi64()
        object_delta = r.pull_vi64() if flags & FETCH_FLAG_OBJECT_ID else None
        priority = r.pull_uint8() if flags & FETCH_FLAG_PRIORITY else None
        raw = (
            pull_properties(r, self.max_properties_length)
            if flags & FETCH_FLAG_PROPERTIES
            else b""
        )
        return _FetchObjectUnit(
            flags, group_delta, subgroup_id, object_delta, priority, raw, r.pull_vi64()
        )

    def _apply_unit(self, unit: object, events: list[object]) -> int:
        if isinstance(unit, FetchHeader):
            self.header = unit
            if self.group_order is None:
                source = self._order_source
                assert callable(source)
                self.group_order = GroupOrder(source(unit.request_id))
            events.append(unit)
            return 0
        if isinstance(unit, _EndOfRangeUnit):
            if unit.payload_length:
                raise violation("End of Range with a non-zero Object Payload Length")
            # Prior Group/Object become the marker's; prior Subgroup and Priority stay those
            # of the last actual object (§"End of Range").
            self._prior_group = unit.group_id
            self._prior_object = unit.object_id
            events.append(EndOfRange(unit.kind, unit.group_id, unit.object_id))
            return 0
        assert isinstance(unit, _FetchObjectUnit)
        group_id, object_id = self._resolve_location(unit)
        subgroup_id = self._resolve_subgroup(unit)
        priority = unit.priority if unit.priority is not None else self._prior_priority
        if priority is None:
            raise violation("fetch object inherits the Priority of no prior object")
        props = decode_properties(unit.raw_properties, self._seven_byte)
        self._prior_group = group_id
        self._prior_object = object_id
        if subgroup_id is not None:
            self._prior_subgroup = subgroup_id
        self._prior_priority = priority
        events.append(
            ObjectBegin(
                group_id=group_id,
                subgroup_id=subgroup_id,
                object_id=object_id,
                publisher_priority=priority,
                status=NORMAL,  # fetch objects carry no Object Status (§"Object Status")
                payload_length=unit.payload_length,
                properties=props,
                raw_properties=unit.raw_properties,
            )
        )
        self._end_event = ObjectEnd(group_id, object_id)
        return unit.payload_length

    def _resolve_location(self, unit: _FetchObjectUnit) -> tuple[int, int]:
        prior_group = self._prior_group
        prior_object = self._prior_object
        gd = unit.group_delta
        od = unit.object_delta
        if prior_group is None or prior_object is None:
            # The first object MUST carry both, as absolute values.
            if gd is None or od is None:
                raise violation("first fetch object must carry Group ID and Object ID")
            return gd, od
        if gd is None:
            group_id = prior_group
        elif self.group_order is GroupOrder.DESCENDING:
            group_id = prior_group - gd - 1
            if group_id < 0:
                raise violation("Group ID delta goes below 0")
        else:
            group_id = prior_group + gd + 1
            if group_id > VI64_MAX:
                raise violation("Group ID exceeds 2**64-1")
        if od is None:
            object_id = prior_object + 1  # "regardless of which group it belongs to"
        elif gd is not None:
            object_id = od
        else:
            object_id = prior_object + od  # no +1 here, unlike subgroup streams
        if object_id > VI64_MAX:
            raise violation("Object ID exceeds 2**64-1")
        return group_id, object_id

    def _resolve_subgroup(self, unit: _FetchObjectUnit) -> int | None:
        flags = unit.flags
        if flags & FETCH_FLAG_DATAGRAM:
            return None  # forwarding preference Datagram: no Subgroup ID, low bits ignored
        mode = flags & FETCH_SUBGROUP_MASK
        if mode == 0:
            return 0
        if mode == 3:
            return unit.subgroup_id
        prior = self._prior_subgroup
        if prior is None:
            raise violation("fetch object references the Subgroup ID of no prior object")
        subgroup_id = prior + mode - 1  # 1: prior, 2: prior + 1
        if subgroup_id > VI64_MAX:
            raise violation("Subgroup ID exceeds 2**64-1")
        return subgroup_id


class FetchStreamEncoder:
    """Serializes one fetch stream: :meth:`header`, then objects / End of Range markers in
    the stream's group order, each with the shortest Serialization Flags."""

    __slots__ = ("version", "request_id", "group_order", "_seven_byte", "_prior_group",
                 "_prior_object", "_prior_subgroup", "_prior_priority")

    def __init__(
        self,
        request_id: int,
        version: Version = DEFAULT_VERSION,
        group_order: GroupOrder = GroupOrder.ASCENDING,
    ) -> None:
        check_vi64("request id", request_id)
        self.version = version
        self.request_id = request_id
        self.group_order = GroupOrder(group_order)
        self._seven_byte = version.vi64_seven_byte
        self._prior_group: int | None = None
        self._prior_object: int | None = None
        self._prior_subgroup: int | None = None
        self._prior_priority: int | None = None

    def header(self) -> bytes:
        return encode_fetch_header(self.request_id, self.version)

    def object_header(
        self,
        group_id: int,
        object_id: int,
        payload_length: int,
        *,
        subgroup_id: int | None,
        publisher_priority: int,
        properties: Properties = (),
    ) -> bytes:
        """The object's fields up to its payload. ``subgroup_id=None`` marks an object whose
        forwarding preference is Datagram."""
        w = Writer(seven_byte=self._seven_byte)
        self._write_object_header(
            w, group_id, object_id, payload_length, subgroup_id, publisher_priority, properties
        )
        return w.getvalue()

    def object(
        self,
        group_id: int,
        object_id: int,
        payload: Buffer = b"",
        *,
        subgroup_id: int | None,
        publisher_priority: int,
        properties: Properties = (),
    ) -> bytes:
        w = Writer(seven_byte=self._seven_byte)
        self._write_object_header(
            w, group_id, object_id, len(payload), subgroup_id, publisher_priority, properties
        )
        w.push_bytes(payload)
        return w.getvalue()

    def end_of_range(self, kind: EndOfRangeKind, group_id: int, object_id: int) -> bytes:
        """An End of Range marker for ``{group_id, object_id}`` (absolute IDs)."""
        kind = EndOfRangeKind(kind)
        if kind is EndOfRangeKind.TIMED_OUT and not self.version.end_of_timed_out_range:
            raise ValueError(f"End of Timed-Out Range does not exist in draft {self.version}")
        check_vi64("group id", group_id)
        check_vi64("object id", object_id)
        self._check_order(group_id, object_id)
        w = Writer(seven_byte=self._seven_byte)
        w.push_vi64(kind)
        w.push_vi64(group_id)
        w.push_vi64(object_id)
        w.push_vi64(0)  # Object Payload Length
        self._prior_group = group_id
        self._prior_object = object_id
        return w.getvalue()

    def _check_order(self, group_id: int, object_id: int) -> None:
        pg = self._prior_group
        if pg is None:
            return
        if group_id != pg and (group_id < pg) != (self.group_order is GroupOrder.DESCENDING):
            raise ValueError(f"group {group_id} after {pg} breaks {self.group_order.name} order")
        if group_id == pg and self._prior_object is not None and object_id <= self._prior_object:
            raise ValueError(f"object {object_id} after {self._prior_object} in group {pg}")

    def _write_object_header(
        self,
        w: Writer,
        group_id: int,
        object_id: int,
        payload_length: int,
        subgroup_id: int | None,
        priority: int,
        properties: Properties,
    ) -> None:
        check_vi64("group id", group_id)
        check_vi64("object id", object_id)
        check_vi64("payload length", payload_length)
        check_priority(priority)
        if subgroup_id is not None:
            check_vi64("subgroup id", subgroup_id)
        self._check_order(group_id, object_id)
        raw = properties_bytes(properties, self._seven_byte)
        pg, po, ps = self._prior_group, self._prior_object, self._prior_subgroup
        flags = 0
        group_field = object_field = subgroup_field = None
        if pg is None or po is None:
            flags |= FETCH_FLAG_GROUP_ID | FETCH_FLAG_OBJECT_ID
            group_field, object_field = group_id, object_id
        else:
            if group_id != pg:
                flags |= FETCH_FLAG_GROUP_ID
                group_field = (
                    pg - group_id - 1
                    if self.group_order is GroupOrder.DESCENDING
                    else group_id - pg - 1
                )
            if object_id != po + 1:
                flags |= FETCH_FLAG_OBJECT_ID
                object_field = object_id if group_id != pg else object_id - po
        if subgroup_id is None:
            flags |= FETCH_FLAG_DATAGRAM
        elif subgroup_id == 0:
            pass
        elif ps is not None and subgroup_id == ps:
            flags |= 0x01
        elif ps is not None and subgroup_id == ps + 1:
            flags |= 0x02
        else:
            flags |= 0x03
            subgroup_field = subgroup_id
        if priority != self._prior_priority:
            flags |= FETCH_FLAG_PRIORITY
        if raw:
            flags |= FETCH_FLAG_PROPERTIES
        w.push_vi64(flags)
        if group_field is not None:
            w.push_vi64(group_field)
        if subgroup_field is not None:
            w.push_vi64(subgroup_field)
        if object_field is not None:
            w.push_vi64(object_field)
        if flags & FETCH_FLAG_PRIORITY:
            w.push_uint8(priority)
        if raw:
            w.push_vi64(len(raw))
            w.push_bytes(raw)
        w.push_vi64(payload_length)
        self._prior_group = group_id
        self._prior_object = object_id
        # After a Datagram-preference object, never refer back to a Subgroup ID: peers differ
        # on whether "the prior Object's Subgroup ID" then exists.
        self._prior_subgroup = subgroup_id
        self._prior_priority = priority
