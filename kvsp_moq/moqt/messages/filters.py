"""Filter parameter values: LOCATION_FILTER (0x21) in each version's shape, and the Range
filters 0x25-0x29 (20+).

LOCATION_FILTER — one model, three encodings
--------------------------------------------
:class:`LocationFilter` is version-neutral; its :class:`LocationFilterType` values are the
draft-22 type codes. The per-version encodings (moqt-reference §2.7):

* **18** — SUBSCRIPTION_FILTER (draft-18 §"SUBSCRIPTION FILTER Parameter", §"Subscription
  Filters"), length-prefixed ``{Filter Type (vi64), [Start Location], [End Group Delta]}``:
  0x1 Next Group Start, 0x2 Largest Object, 0x3 AbsoluteStart (+Start), 0x4 AbsoluteRange
  (+Start, +End Group Delta; the whole End Group passes). Other types → PROTOCOL_VIOLATION.
  Mapped exactly: Next Group Start = RELATIVE_START_GROUP 0 (``{Largest.Group+1, 0}``),
  Largest Object = NEXT_OBJECT (``{Largest.Group, Largest.Object+1}``), AbsoluteStart =
  ABSOLUTE_START, AbsoluteRange = ABSOLUTE_RANGE.
* **20/21** — length-prefixed ``[StartGroup] [StartObject] [EndGroupDelta] [EndObject]``, the
  field count implied by the length (editor's copy §"Location Filters"): 0 fields = no filter;
  1 = relative StartGroup; 2 both 0 = Next Object, otherwise absolute start; 3 = + end group;
  4 = + end object. A length that does not hold whole vi64s, or more than 4 of them →
  PROTOCOL_VIOLATION. Absolute start {0, 0} without an end cannot be expressed (the draft
  says to omit the filter instead).
* **22** — typed, no length: ``Location Filter Type (vi64)`` then its fields; 0x00 none,
  0x01 StartGroup, 0x02 +StartObject, 0x03 +EndGroupDelta, 0x04 +EndObject, 0x05 Next Object;
  other types → PROTOCOL_VIOLATION (moqt-reference §2.7, verified against moq-rs).

In every version StartGroup + EndGroupDelta > 2^64-1 → PROTOCOL_VIOLATION. A filter that a
version cannot express raises ``ValueError`` when encoded for it.

Range filters (20+; editor's copy §"Range Filters")
--------------------------------------------------
Length-prefixed ``{[SetID (8)], [Property Type (vi64)], Range...}`` with
``Range {Start (vi64, delta from the previous End or 0), [End (vi64, delta from Start)]}``;
only the last End may be omitted (open range). Length 0 removes the filter in REQUEST_UPDATE.
Property Type is present in OBJECT_PROPERTY_FILTER (0x28) and TRACK_PROPERTY_FILTER (0x29).
Semantic faults — a delta sum past 2^64-1, a priority above 255, an odd or missing Property
Type, a repeated (type, SetID, Property Type) — are answered with REQUEST_ERROR
INVALID_FILTER, not a session close, so decoding keeps them and :func:`range_filter_problem`
reports them for the session to answer.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import IntEnum
from typing import NamedTuple

from ...wire.buffer import Reader, Writer
from ...wire.varint import VI64_MAX
from ..version import Version
from ._fields import Location, check_uint8, check_vi64, violation

__all__ = [
    "LocationFilter",
    "LocationFilterType",
    "Range",
    "RangeFilter",
    "range_filter_problem",
    "read_location_filter",
    "read_range_filter",
    "write_location_filter",
    "write_range_filter",
]


class LocationFilterType(IntEnum):
    """The kinds of Location filter; values are the draft-22 Location Filter Type codes."""

    NONE = 0x00
    RELATIVE_START_GROUP = 0x01
    ABSOLUTE_START = 0x02
    ABSOLUTE_RANGE = 0x03
    ABSOLUTE_RANGE_END_OBJECT = 0x04
    NEXT_OBJECT = 0x05


_T = LocationFilterType
# Fields each type carries, in wire order.
_FIELDS: dict[LocationFilterType, tuple[str, ...]] = {
    _T.NONE: (),
    _T.RELATIVE_START_GROUP: ("start_group",),
    _T.ABSOLUTE_START: ("start_group", "start_object"),
    _T.ABSOLUTE_RANGE: ("start_group", "start_object", "end_group_delta"),
    _T.ABSOLUTE_RANGE_END_OBJECT: ("start_group", "start_object", "end_group_delta", "end_object"),
    _T.NEXT_OBJECT: (),
}
_ALL_FIELDS = ("start_group", "start_object", "end_group_delta", "end_object")


@dataclass(frozen=True, slots=True)
class LocationFilter:
    """A Location filter. Fields a type does not carry must be 0.

    * RELATIVE_START_GROUP: start ``{Largest.Group + 1 - start_group, 0}`` (0 = next group,
      1 = the current group), open-ended.
    * ABSOLUTE_START: start ``{start_group, start_object}``, open-ended.
    * ABSOLUTE_RANGE: ... to the whole group ``start_group + end_group_delta``.
    * ABSOLUTE_RANGE_END_OBJECT: ... to ``{start_group + end_group_delta, end_object}``.
    * NEXT_OBJECT: start ``{Largest.Group, Largest.Object + 1}``.
    * NONE: no filter (removes the filter in REQUEST_UPDATE).
    """

    filter_type: LocationFilterType
    start_group: int = 0
    start_object: int = 0
    end_group_delta: int = 0
    end_object: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "filter_type", LocationFilterType(self.filter_type))
        used = _FIELDS[self.filter_type]
        for name in _ALL_FIELDS:
            value = check_vi64(name, getattr(self, name))
            if value and name not in used:
                raise ValueError(f"{self.filter_type.name} has no {name}")
        if self.start_group + self.end_group_delta > VI64_MAX:
            raise ValueError("StartGroup + EndGroupDelta exceeds 2^64-1")

    # -- constructors ---------------------------------------------------------------------
    @classmethod
    def none(cls) -> LocationFilter:
        return cls(_T.NONE)

    @classmethod
    def next_object(cls) -> LocationFilter:
        return cls(_T.NEXT_OBJECT)

    @classmethod
    def relative_start(cls, groups_back: int) -> LocationFilter:
        """Start ``groups_back`` groups before the next group (0 = next group)."""
        return cls(_T.RELATIVE_START_GROUP, groups_back)

    @classmethod
    def absolute(
        cls, start: Location, end_group: int | None = None, end_object: int | None = None
    ) -> LocationFilter:
        if end_group is None:
            if end_object is not None:
                raise ValueError("an End Object needs an End Group")
            return cls(_T.ABSOLUTE_START, start[0], start[1])
        if end_group < start[0]:
            raise ValueError("End Group before Start Group")
        if end_object is None:
            return cls(_T.ABSOLUTE_RANGE, start[0], start[1], end_group - start[0])
        return cls(
            _T.ABSOLUTE_RANGE_END_OBJECT, start[0], start[1], end_group - start[0], end_object
        )

    # -- views ----------------------------------------------------------------------------
    @property
    def start_location(self) -> Location | None:
        """The absolute start, for the absolute types."""
        if self.filter_type in (_T.ABSOLUTE_START, _T.ABSOLUTE_RANGE, _T.ABSOLUTE_RANGE_END_OBJECT):
            return Location(self.start_group, self.start_object)
        return None

    @property
    def end_group(self) -> int | None:
        if self.filter_type in (_T.ABSOLUTE_RANGE, _T.ABSOLUTE_RANGE_END_OBJECT):
            return self.start_group + self.end_group_delta
        return None

    def _values(self) -> list[int]:
        return [getattr(self, name) for name in _FIELDS[self.filter_type]]


def _from_fields(filter_type: LocationFilterType, values: list[int]) -> LocationFilter:
    if len(values) >= 3 and values[0] + values[2] > VI64_MAX:
        raise violation("StartGroup + EndGroupDelta exceeds 2^64-1")
    return LocationFilter(filter_type, *values)


# Draft 18 Filter Type codes (draft-18 §"Subscription Filters").
_D18_NEXT_GROUP_START, _D18_LARGEST_OBJECT, _D18_ABSOLUTE_START, _D18_ABSOLUTE_RANGE = 1, 2, 3, 4
_D18_TO_TYPE = {
    _D18_NEXT_GROUP_START: _T.RELATIVE_START_GROUP,
    _D18_LARGEST_OBJECT: _T.NEXT_OBJECT,
    _D18_ABSOLUTE_START: _T.ABSOLUTE_START,
    _D18_ABSOLUTE_RANGE: _T.ABSOLUTE_RANGE,
}
# Draft 20/21: the field count selects the type (two zero fields = Next Object).
_D20_BY_COUNT = (
    _T.NONE,
    _T.RELATIVE_START_GROUP,
    _T.ABSOLUTE_START,
    _T.ABSOLUTE_RANGE,
    _T.ABSOLUTE_RANGE_END_OBJECT,
)


def _subscription_filter_shape(version: Version) -> bool:
    """0x21 is draft 18's SUBSCRIPTION_FILTER (typed, length-prefixed); 20+ reshaped it."""
    return version < Version.DRAFT_20


def read_location_filter(r: Reader, version: Version) -> LocationFilter:
    """Read the value of a LOCATION_FILTER (SUBSCRIPTION_FILTER in 18) parameter."""
    if version.location_filter_typed:
        raw = r.pull_vi64()
        try:
            filter_type = LocationFilterType(raw)
        except ValueError:
            raise violation(f"unknown Location Filter Type {raw:#x}") from None
        return _from_fields(filter_type, [r.pull_vi64() for _ in _FIELDS[filter_type]])
    value = r.bounded(r.pull_vi64())
    if _subscription_filter_shape(version):  # draft 18: Filter Type + fields, length-prefixed
        raw = value.pull_vi64()
        if raw not in _D18_TO_TYPE:
            raise violation(f"unknown Subscription Filter Type {raw:#x}")
        filter_type = _D18_TO_TYPE[raw]
        if filter_type is _T.RELATIVE_START_GROUP:
            values = [0]
        else:
            values = [value.pull_vi64() for _ in _FIELDS[filter_type]]
        if not value.at_end():
            raise violation("bytes left after the Subscription Filter")
        return _from_fields(filter_type, values)
    values = []  # draft 20/21: fields until the length runs out
    while not value.at_end():
        if len(values) == 4:
            raise violation("LOCATION_FILTER has more than 4 fields")
        values.append(value.pull_vi64())
    if len(values) == 2 and values == [0, 0]:
        return LocationFilter(_T.NEXT_OBJECT)
    return _from_fields(_D20_BY_COUNT[len(values)], values)


def write_location_filter(w: Writer, version: Version, f: LocationFilter) -> None:
    """Append the parameter value of ``f`` in ``version``'s shape (``ValueError`` if it has
    none)."""
    if version.location_filter_typed:
        w.push_vi64(f.filter_type)
        for v in f._values():
            w.push_vi64(v)
        return
    inner = Writer(seven_byte=w.seven_byte)
    if _subscription_filter_shape(version):  # draft 18
        t = f.filter_type
        if t is _T.RELATIVE_START_GROUP and f.start_group == 0:
            inner.push_vi64(_D18_NEXT_GROUP_START)
        elif t is _T.NEXT_OBJECT:
            inner.push_vi64(_D18_LARGEST_OBJECT)
        elif t is _T.ABSOLUTE_START:
            inner.push_vi64(_D18_ABSOLUTE_START)
        elif t is _T.ABSOLUTE_RANGE:
            inner.push_vi64(_D18_ABSOLUTE_RANGE)
        else:
            raise ValueError(f"draft 18 has no Subscription Filter for {f}")
        if t in (_T.ABSOLUTE_START, _T.ABSOLUTE_RANGE):
            for v in f._values():
                inner.push_vi64(v)
    else:  # draft 20/21
        if f.filter_type is _T.NEXT_OBJECT:
            values = [0, 0]
        elif f.filter_type is _T.ABSOLUTE_START and f.start_group == f.start_object == 0:
            raise ValueError("draft 20/21 cannot express an absolute start {0, 0}: omit the filter")
        else:
            values = f._values()
        for v in values:
            inner.push_vi64(v)
    w.push_vi64(len(inner))
    w.push_bytes(inner.view())


# =============================================================================================
# Range filters
# =============================================================================================
class Range(NamedTuple):
    """An inclusive range of absolute values; ``end`` None = no end (last range only)."""

    start: int
    end: int | None


@dataclass(frozen=True, slots=True)
class RangeFilter:
    """One Range filter parameter value.

    ``set_id`` None is the empty value (Length 0), which removes the filter in REQUEST_UPDATE;
    ``property_type`` is for the Object/Track Property filters only. Decoded values may exceed
    2^64-1 (the delta sum is not bounded on the wire); :func:`range_filter_problem` says so.
    """

    set_id: int | None = None
    property_type: int | None = None
    ranges: tuple[Range, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "ranges", tuple(Range(*x) for x in self.ranges))
        if self.set_id is None:
            if self.property_type is not None or self.ranges:
                raise ValueError("an empty Range filter has no Property Type or ranges")
            return
        check_uint8("SetID", self.set_id)
        for i, (start, end) in enumerate(self.ranges):
            if end is None and i != len(self.ranges) - 1:
                raise ValueError("only the last Range may be open-ended")


def read_range_filter(r: Reader, has_property_type: bool) -> RangeFilter:
    value = r.bounded(r.pull_vi64())
    if value.at_end():
        return RangeFilter()
    set_id = value.pull_uint8()
    property_type = value.pull_vi64() if has_property_type and not value.at_end() else None
    ranges: list[Range] = []
    prev = 0
    while not value.at_end():
        start = prev + value.pull_vi64()
        end = None if value.at_end() else start + value.pull_vi64()
        ranges.append(Range(start, end))
        prev = end if end is not None else start
    return RangeFilter(set_id, property_type, tuple(ranges))


def write_range_filter(w: Writer, f: RangeFilter, has_property_type: bool) -> None:
    inner = Writer(seven_byte=w.seven_byte)
    if f.set_id is not None:
        inner.push_uint8(f.set_id)
        if f.property_type is not None:
            if not has_property_type:
                raise ValueError("this Range filter has no Property Type")
            inner.push_vi64(check_vi64("Property Type", f.property_type))
        elif has_property_type and f.ranges:
            raise ValueError("a Property filter with ranges needs its Property Type")
        prev = 0
        for start, end in f.ranges:
            if start < prev:
                raise ValueError("Range filter ranges must ascend and not overlap")
            inner.push_vi64(check_vi64("Range Start delta", start - prev))
            if end is not None:
                if end < start:
                    raise ValueError("Range End before its Start")
                inner.push_vi64(check_vi64("Range End delta", end - start))
            prev = end if end is not None else start
    w.push_vi64(len(inner))
    w.push_bytes(inner.view())


def range_filter_problem(
    filters: Iterable[tuple[int, RangeFilter]], *, priority_type: int, property_types: Iterable[int]
) -> str | None:
    """Why ``filters`` (``(parameter type, filter)`` pairs) must be answered with REQUEST_ERROR
    INVALID_FILTER, or ``None``."""
    seen: set[tuple[int, int | None, int | None]] = set()
    with_property = set(property_types)
    for ptype, f in filters:
        if f.set_id is None:
            continue
        key = (ptype, f.set_id, f.property_type)
        if key in seen:
            return f"filter {ptype:#x} repeats SetID {f.set_id} / Property Type {f.property_type}"
        seen.add(key)
        if ptype in with_property and (f.property_type is None or f.property_type & 1):
            return f"filter {ptype:#x} needs an even Property Type"
        if not f.ranges:
            return f"filter {ptype:#x} has no Range"
        limit = 0xFF if ptype == priority_type else VI64_MAX
        for start, end in f.ranges:
            if start > limit or (end is not None and end > limit):
                return f"filter {ptype:#x} value exceeds {limit}"
    return None
