"""Message Parameters (draft-20 §"Message Parameters"; draft-18 same section).

::

    Number of Parameters (vi64),
    Message Parameter { Type Delta (vi64), Value (..) } ...

* Types are delta coded (first from 0) and so ascend; a sum past 2^64-1 → PROTOCOL_VIOLATION.
* The Value encoding is defined per parameter: uint8 (one byte), varint (vi64), Location
  (two vi64) or length-prefixed (vi64 length + bytes); TRACK_NAMESPACE_PREFIX uses the Track
  Namespace encoding.
* Unknown parameter (not defined in the negotiated version) → PROTOCOL_VIOLATION; a repeated
  type that its definition does not allow to repeat → PROTOCOL_VIOLATION. Repeatable:
  AUTHORIZATION_TOKEN and the Range filters.
* A known parameter in a message its definition does not list ("It MAY appear in ...") is
  read (its value must still be well formed), ignored and logged: the draft names no close
  for it (draft-ietf-moq-transport-22 §"Message Parameters" closes the session only for an
  unknown parameter and for a duplicate; the same in draft 18), and a peer that sends, e.g.,
  FORWARD in SUBSCRIBE_NAMESPACE loses nothing by our ignoring it. docs/interop.md,
  "Leniency". We never send one (:func:`write_parameters` raises ``ValueError``).
* Enumerated uint8 values out of range (FORWARD, GROUP_ORDER, INCLUDE_PROPERTIES) →
  PROTOCOL_VIOLATION; a malformed Token → KEY_VALUE_FORMATTING_ERROR (see ``token``).

:class:`MessageParameters` holds every parameter as a typed field (``None`` / ``()`` when
absent); one declarative table, :data:`PARAMETER_SPECS`, drives both directions.

Allow-lists per version and message (:func:`allowed_parameter_types`)
----------------------------------------------------------------------
Built from each parameter's "MAY appear in" sentence, draft-18 §"Message Parameters" and the
draft-20 editor's copy plus moqt-reference §2.4 (draft-20/22 PUBLISH per the interop runner:
02,03,06,08,09,10,20,21,22). REQUEST_OK and REQUEST_UPDATE have one context per request they
answer or update (e.g. PUBLISH_OK vs TRACK_STATUS_OK); the message codec, which does not know
the request, checks the union (:attr:`ParamContext.REQUEST_OK`,
:attr:`ParamContext.REQUEST_UPDATE`) and the session checks the precise one with
:func:`check_parameters`. Decisions where the text is silent or inconsistent are listed in
``docs/moqt-messages.md``.

FILL_PARAMETERS (20+)
---------------------
Length-prefixed; inside, parameters are delta coded and encoded as Message Parameters, with no
count (the length bounds them) — our reading of PR #1673 ("a block of Key-Value Pairs") that
stays consistent with draft 22's typed, length-less LOCATION_FILTER "everywhere incl. inside
FILL_PARAMETERS" (moqt-reference §2.7). Allowed inside: 0x0A, 0x20, 0x21, 0x22 (20/21,
PR #1673); draft 22 lists eight, which we take to add the four Object filters 0x25-0x28
(unverified). The block is its own scope: a type may appear both outside and inside.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator
from dataclasses import dataclass, fields
from enum import Enum, IntEnum
from typing import Any

from ...wire.buffer import Reader, Writer
from ...wire.varint import VI64_MAX
from ..objects import GroupOrder
from ..version import Version
from ._fields import Location, check_uint8, check_vi64, read_location, violation, write_location
from .filters import (
    LocationFilter,
    RangeFilter,
    range_filter_problem,
    read_location_filter,
    read_range_filter,
    write_location_filter,
    write_range_filter,
)
from .names import TrackNamespace, read_track_namespace, write_track_namespace
from .token import Token, decode_token, encode_token

__all__ = [
    "PARAMETER_SPECS",
    "MessageParameters",
    "ParamContext",
    "ParameterSpec",
    "ParameterType",
    "allowed_parameter_types",
    "check_parameters",
    "defined_parameter_types",
    "read_parameters",
    "write_parameters",
]


class ParameterType(IntEnum):
    """Message Parameter types (IANA "Message Parameters"; draft 18 defines the first 13)."""

    OBJECT_DELIVERY_TIMEOUT = 0x02
    AUTHORIZATION_TOKEN = 0x03
    RENDEZVOUS_TIMEOUT = 0x04
    SUBGROUP_DELIVERY_TIMEOUT = 0x06
    EXPIRES = 0x08
    LARGEST_OBJECT = 0x09
    FILL_TIMEOUT = 0x0A
    FORWARD = 0x10
    SUBSCRIBER_PRIORITY = 0x20
    #: SUBSCRIPTION_FILTER in draft 18 (another value shape, see ``filters``).
    LOCATION_FILTER = 0x21
    GROUP_ORDER = 0x22
    FILL_PARAMETERS = 0x23  # 20+
    SUBGROUP_FILTER = 0x25  # 20+ (19+)
    OBJECTID_FILTER = 0x26  # 20+
    PRIORITY_FILTER = 0x27  # 20+
    OBJECT_PROPERTY_FILTER = 0x28  # 20+
    TRACK_PROPERTY_FILTER = 0x29  # 20+
    NEW_GROUP_REQUEST = 0x32
    TRACK_NAMESPACE_PREFIX = 0x34
    INCLUDE_PROPERTIES = 0x35  # 20+


class ParamContext(Enum):
    """Where a parameter block sits: a message, or the request a REQUEST_OK / REQUEST_UPDATE
    answers or updates (the draft's aliases PUBLISH_OK, TRACK_STATUS_OK, ...)."""

    SUBSCRIBE = "SUBSCRIBE"
    SUBSCRIBE_OK = "SUBSCRIBE_OK"
    PUBLISH = "PUBLISH"
    PUBLISH_OK = "PUBLISH_OK"
    PUBLISH_STATE_NOTIFY = "PUBLISH_STATE_NOTIFY"
    FETCH = "FETCH"
    FETCH_OK = "FETCH_OK"
    TRACK_STATUS = "TRACK_STATUS"
    TRACK_STATUS_OK = "TRACK_STATUS_OK"
    PUBLISH_NAMESPACE = "PUBLISH_NAMESPACE"
    PUBLISH_NAMESPACE_OK = "PUBLISH_NAMESPACE_OK"
    SUBSCRIBE_NAMESPACE = "SUBSCRIBE_NAMESPACE"
    SUBSCRIBE_NAMESPACE_OK = "SUBSCRIBE_NAMESPACE_OK"
    SUBSCRIBE_TRACKS = "SUBSCRIBE_TRACKS"
    SUBSCRIBE_TRACKS_OK = "SUBSCRIBE_TRACKS_OK"
    REQUEST_UPDATE_SUBSCRIPTION = "REQUEST_UPDATE for SUBSCRIBE/PUBLISH"
    REQUEST_UPDATE_FETCH = "REQUEST_UPDATE for FETCH"
    REQUEST_UPDATE_PUBLISH_NAMESPACE = "REQUEST_UPDATE for PUBLISH_NAMESPACE"
    REQUEST_UPDATE_SUBSCRIBE_NAMESPACE = "REQUEST_UPDATE for SUBSCRIBE_NAMESPACE"
    REQUEST_UPDATE_SUBSCRIBE_TRACKS = "REQUEST_UPDATE for SUBSCRIBE_TRACKS"
    REQUEST_UPDATE_OK = "REQUEST_UPDATE_OK"
    FILL_PARAMETERS = "inside FILL_PARAMETERS"
    #: Unions checked by the codec, which does not know the request being answered/updated.
    REQUEST_UPDATE = "REQUEST_UPDATE (any request)"
    REQUEST_OK = "REQUEST_OK (any request)"
    #: Messages without parameters (for completeness of the API).
    NONE = "no parameters"


# =============================================================================================
# Value codecs, one per encoding
# =============================================================================================
class _VarInt:
    def read(self, r: Reader, version: Version) -> int:
        return r.pull_vi64()

    def write(self, w: Writer, version: Version, value: int) -> None:
        w.push_vi64(check_vi64("parameter", value))


class _Uint8:
    """A uint8, optionally restricted to ``allowed`` (else PROTOCOL_VIOLATION) and converted."""

    def __init__(self, name: str, allowed: frozenset[int] | None = None, kind: Any = int) -> None:
        self.name, self.allowed, self.kind = name, allowed, kind

    def read(self, r: Reader, version: Version) -> Any:
        value = r.pull_uint8()
        if self.allowed is not None and value not in self.allowed:
            raise violation(f"{self.name} value {value} not allowed")
        return self.kind(value)

    def write(self, w: Writer, version: Version, value: Any) -> None:
        raw = int(value)
        if self.allowed is not None and raw not in self.allowed:
            raise ValueError(f"{self.name} value {raw} not allowed")
        w.push_uint8(check_uint8(self.name, raw))


class _LocationValue:
    def read(self, r: Reader, version: Version) -> Location:
        return read_location(r)

    def write(self, w: Writer, version: Version, value: Location) -> None:
        write_location(w, value)


class _TokenValue:
    """Length-prefixed Token."""

    def read(self, r: Reader, version: Version) -> Token:
        return decode_token(r.bounded(r.pull_vi64()))

    def write(self, w: Writer, version: Version, value: Token) -> None:
        inner = Writer(seven_byte=w.seven_byte)
        encode_token(inner, value)
        w.push_vi64(len(inner))
        w.push_bytes(inner.view())


class _LocationFilterValue:
    def read(self, r: Reader, version: Version) -> LocationFilter:
        return read_location_filter(r, version)

    def write(self, w: Writer, version: Version, value: LocationFilter) -> None:
        write_location_filter(w, version, value)


class _RangeFilterValue:
    def __init__(self, has_property_type: bool) -> None:
        self.has_property_type = has_property_type

    def read(self, r: Reader, version: Version) -> RangeFilter:
        return read_range_filter(r, self.has_property_type)

    def write(self, w: Writer, version: Version, value: RangeFilter) -> None:
        write_range_filter(w, value, self.has_property_type)


class _NamespaceValue:
    def read(self, r: Reader, version: Version) -> TrackNamespace:
        return read_track_namespace(r)

    def write(self, w: Writer, version: Version, value: TrackNamespace) -> None:
        write_track_namespace(w, value)


class _FillParametersValue:
    """Length-prefixed block holding Number of Parameters and the parameters, like every
    parameter block of the drafts. Both draft-20+ peers we test against (moq-rs, aiomoqt)
    write the count (docs/interop.md); bytes after the last counted parameter are a
    PROTOCOL_VIOLATION."""

    def read(self, r: Reader, version: Version) -> MessageParameters:
        block = r.bounded(r.pull_vi64())
        value = read_parameters(block, version, ParamContext.FILL_PARAMETERS)
        if not block.at_end():
            raise violation("bytes after the last parameter of FILL_PARAMETERS")
        return value

    def write(self, w: Writer, version: Version, value: MessageParameters) -> None:
        inner = Writer(seven_byte=w.seven_byte)
        write_parameters(inner, version, ParamContext.FILL_PARAMETERS, value)
        w.push_vi64(len(inner))
        w.push_bytes(inner.view())


@dataclass(frozen=True, slots=True)
class ParameterSpec:
    """One row of the parameter table: its type, the :class:`MessageParameters` field it
    fills, its value codec, whether it may repeat, and the first version defining it."""

    type: ParameterType
    field: str
    codec: Any
    repeatable: bool = False
    since: Version = Version.DRAFT_18


_T = ParameterType
_V20 = Version.DRAFT_20
_BOOL01 = frozenset({0, 1})

#: The parameter table, in ascending type order.
PARAMETER_SPECS: tuple[ParameterSpec, ...] = (
    ParameterSpec(_T.OBJECT_DELIVERY_TIMEOUT, "object_delivery_timeout", _VarInt()),
    ParameterSpec(_T.AUTHORIZATION_TOKEN, "authorization_tokens", _TokenValue(), repeatable=True),
    ParameterSpec(_T.RENDEZVOUS_TIMEOUT, "rendezvous_timeout", _VarInt()),  # encoding unstated
    ParameterSpec(_T.SUBGROUP_DELIVERY_TIMEOUT, "subgroup_delivery_timeout", _VarInt()),
    ParameterSpec(_T.EXPIRES, "expires", _VarInt()),
    ParameterSpec(_T.LARGEST_OBJECT, "largest_object", _LocationValue()),
    ParameterSpec(_T.FILL_TIMEOUT, "fill_timeout", _VarInt()),  # encoding unstated
    ParameterSpec(_T.FORWARD, "forward", _Uint8("FORWARD", _BOOL01, bool)),
    ParameterSpec(_T.SUBSCRIBER_PRIORITY, "subscriber_priority", _Uint8("SUBSCRIBER_PRIORITY")),
    ParameterSpec(_T.LOCATION_FILTER, "location_filter", _LocationFilterValue()),
    ParameterSpec(
        _T.GROUP_ORDER, "group_order", _Uint8("GROUP_ORDER", frozenset({1, 2}), GroupOrder)
    ),
    ParameterSpec(_T.FILL_PARAMETERS, "fill_parameters", _FillParametersValue(), since=_V20),
    ParameterSpec(_T.SUBGROUP_FILTER, "subgroup_filters", _RangeFilterValue(False), True, _V20),
    ParameterSpec(_T.OBJECTID_FILTER, "objectid_filters", _RangeFilterValue(False), True, _V20),
    ParameterSpec(_T.PRIORITY_FILTER, "priority_filters", _RangeFilterValue(False), True, _V20),
    ParameterSpec(
        _T.OBJECT_PROPERTY_FILTER, "object_property_filters", _RangeFilterValue(True), True, _V20
    ),
    ParameterSpec(
        _T.TRACK_PROPERTY_FILTER, "track_property_filters", _RangeFilterValue(True), True, _V20
    ),
    ParameterSpec(_T.NEW_GROUP_REQUEST, "new_group_request", _VarInt()),
    ParameterSpec(_T.TRACK_NAMESPACE_PREFIX, "track_namespace_prefix", _NamespaceValue()),
    ParameterSpec(
        _T.INCLUDE_PROPERTIES,
        "include_properties",
        _Uint8("INCLUDE_PROPERTIES", _BOOL01, bool),
        since=_V20,
    ),
)
_SPEC_BY_TYPE = {spec.type: spec for spec in PARAMETER_SPECS}


@dataclass(frozen=True, slots=True, repr=False)
class MessageParameters:
    """The parameters of one message, by name; absent ones are ``None`` (``()`` for the
    repeatable ones). Defaults apply where the draft gives them (e.g. FORWARD 1,
    SUBSCRIBER_PRIORITY 128), but they are *not* filled in here: absent stays absent, since
    absence also means "unchanged" in REQUEST_UPDATE."""

    object_delivery_timeout: int | None = None
    authorization_tokens: tuple[Token, ...] = ()
    rendezvous_timeout: int | None = None
    subgroup_delivery_timeout: int | None = None
    expires: int | None = None
    largest_object: Location | None = None
    fill_timeout: int | None = None
    forward: bool | None = None
    subscriber_priority: int | None = None
    location_filter: LocationFilter | None = None
    group_order: GroupOrder | None = None
    fill_parameters: MessageParameters | None = None
    subgroup_filters: tuple[RangeFilter, ...] = ()
    objectid_filters: tuple[RangeFilter, ...] = ()
    priority_filters: tuple[RangeFilter, ...] = ()
    object_property_filters: tuple[RangeFilter, ...] = ()
    track_property_filters: tuple[RangeFilter, ...] = ()
    new_group_request: int | None = None
    track_namespace_prefix: TrackNamespace | None = None
    include_properties: bool | None = None

    def __post_init__(self) -> None:
        for spec in PARAMETER_SPECS:
            if spec.repeatable:
                object.__setattr__(self, spec.field, tuple(getattr(self, spec.field)))
        if self.largest_object is not None:
            object.__setattr__(self, "largest_object", Location(*self.largest_object))
        if self.group_order is not None:
            object.__setattr__(self, "group_order", GroupOrder(self.group_order))
        if self.track_namespace_prefix is not None:
            object.__setattr__(
                self, "track_namespace_prefix", tuple(bytes(f) for f in self.track_namespace_prefix)
            )

    def __repr__(self) -> str:
        shown = []
        for spec in PARAMETER_SPECS:
            value = getattr(self, spec.field)
            if value is not None and value != ():
                shown.append(f"{spec.field}={value!r}")
        return f"MessageParameters({', '.join(shown)})"

    def present(self) -> Iterator[tuple[ParameterSpec, Any]]:
        """``(spec, value)`` for every parameter instance, in wire (ascending type) order."""
        for spec in PARAMETER_SPECS:
            value = getattr(self, spec.field)
            if spec.repeatable:
                for item in value:
                    yield spec, item
            elif value is not None:
                yield spec, value

    def types(self) -> frozenset[int]:
        return frozenset(spec.type for spec, _ in self.present())

    # -- Range filter helpers for the session (§"Range Filters") ----------------------------
    def range_filters(self) -> Iterator[tuple[ParameterType, RangeFilter]]:
        for spec, value in self.present():
            if isinstance(value, RangeFilter):
                yield spec.type, value

    def range_count(self) -> int:
        """Ranges in all Range filters, to compare with the peer's MAX_FILTER_RANGES."""
        return sum(len(f.ranges) for _, f in self.range_filters())

    def range_filter_problem(self) -> str | None:
        """Why the request must get REQUEST_ERROR INVALID_FILTER, or ``None``."""
        return range_filter_problem(
            self.range_filters(),
            priority_type=_T.PRIORITY_FILTER,
            property_types=(_T.OBJECT_PROPERTY_FILTER, _T.TRACK_PROPERTY_FILTER),
        )


assert [f.name for f in fields(MessageParameters)] == [s.field for s in PARAMETER_SPECS]

# =============================================================================================
# Allow-lists
# =============================================================================================
_C = ParamContext


def _types(*values: int) -> frozenset[int]:
    return frozenset(values)


# Draft 18 (draft-18 §"Message Parameters", each parameter's "MAY appear in").
_D18: dict[ParamContext, frozenset[int]] = {
    _C.SUBSCRIBE: _types(0x02, 0x03, 0x04, 0x06, 0x10, 0x20, 0x21, 0x22, 0x32),
    _C.SUBSCRIBE_OK: _types(0x08, 0x09),
    _C.PUBLISH: _types(0x03, 0x08, 0x09, 0x10),
    _C.PUBLISH_OK: _types(0x02, 0x06, 0x08, 0x10, 0x20, 0x21, 0x22, 0x32),
    _C.FETCH: _types(0x03, 0x0A, 0x20, 0x22),
    _C.TRACK_STATUS: _types(0x03),
    _C.TRACK_STATUS_OK: _types(0x09),
    _C.PUBLISH_NAMESPACE: _types(0x03),
    _C.SUBSCRIBE_NAMESPACE: _types(0x03),
    _C.SUBSCRIBE_TRACKS: _types(0x03, 0x10),
    _C.REQUEST_UPDATE_SUBSCRIPTION: _types(0x02, 0x03, 0x06, 0x10, 0x20, 0x21, 0x32),
    _C.REQUEST_UPDATE_FETCH: _types(0x03, 0x20),
    _C.REQUEST_UPDATE_PUBLISH_NAMESPACE: _types(0x03),
    _C.REQUEST_UPDATE_SUBSCRIBE_NAMESPACE: _types(0x03, 0x34),
    _C.REQUEST_UPDATE_SUBSCRIBE_TRACKS: _types(0x03, 0x34),
    _C.REQUEST_UPDATE_OK: _types(0x08, 0x09),
}

# Draft 20/21 (editor's copy + PR #1673 + moqt-reference §2.4).
_OBJECT_FILTERS = (0x25, 0x26, 0x27, 0x28)
_D20_SUBSCRIBE = _types(0x02, 0x03, 0x04, 0x06, 0x10, 0x20, 0x21, 0x22, 0x23, *_OBJECT_FILTERS,
                        0x32, 0x35)
_D20: dict[ParamContext, frozenset[int]] = {
    _C.SUBSCRIBE: _D20_SUBSCRIBE,
    _C.SUBSCRIBE_OK: _types(0x08, 0x09),
    _C.PUBLISH: _types(0x02, 0x03, 0x06, 0x08, 0x09, 0x10, 0x20, 0x21, 0x22),
    # EXPIRES; FORWARD too, as §"FILL PARAMETERS" tells a subscriber to answer PUBLISH "with
    # PUBLISH_OK with Forward State 0" (the FORWARD definition omits PUBLISH_OK).
    _C.PUBLISH_OK: _types(0x08, 0x10),
    _C.PUBLISH_STATE_NOTIFY: _types(0x09, 0x10, 0x21),
    _C.FETCH: _types(0x03, 0x0A, 0x20, 0x21, 0x22, *_OBJECT_FILTERS, 0x35),
    _C.TRACK_STATUS: _types(0x03, 0x35),
    _C.TRACK_STATUS_OK: _types(0x09),
    _C.PUBLISH_NAMESPACE: _types(0x03),
    _C.PUBLISH_NAMESPACE_OK: _types(0x08),
    _C.SUBSCRIBE_NAMESPACE: _types(0x03),
    _C.SUBSCRIBE_NAMESPACE_OK: _types(0x08),
    # §"Parameters on SUBSCRIBE_TRACKS": any SUBSCRIBE parameter, plus TRACK_PROPERTY_FILTER.
    _C.SUBSCRIBE_TRACKS: _D20_SUBSCRIBE | {0x29},
    _C.SUBSCRIBE_TRACKS_OK: _types(0x08),
    _C.REQUEST_UPDATE_SUBSCRIPTION: _types(0x02, 0x03, 0x06, 0x10, 0x20, 0x21, 0x23,
                                           *_OBJECT_FILTERS, 0x32),
    _C.REQUEST_UPDATE_FETCH: _types(0x03, 0x20),
    _C.REQUEST_UPDATE_PUBLISH_NAMESPACE: _types(0x03),
    _C.REQUEST_UPDATE_SUBSCRIBE_NAMESPACE: _types(0x03, 0x34),
    _C.REQUEST_UPDATE_SUBSCRIBE_TRACKS: _types(0x03, 0x10, 0x29, 0x34),
    _C.REQUEST_UPDATE_OK: _types(0x08, 0x09),
    _C.FILL_PARAMETERS: _types(0x0A, 0x20, 0x21, 0x22),
}
# Draft 22: as 20, but FILL_PARAMETERS lists eight parameters (our guess: + object filters).
_D22 = dict(_D20)
_D22[_C.FILL_PARAMETERS] = _D20[_C.FILL_PARAMETERS] | set(_OBJECT_FILTERS)

_UNIONS = {
    _C.REQUEST_OK: (
        _C.PUBLISH_OK, _C.TRACK_STATUS_OK, _C.PUBLISH_NAMESPACE_OK, _C.SUBSCRIBE_NAMESPACE_OK,
        _C.SUBSCRIBE_TRACKS_OK, _C.REQUEST_UPDATE_OK,
    ),
    _C.REQUEST_UPDATE: (
        _C.REQUEST_UPDATE_SUBSCRIPTION, _C.REQUEST_UPDATE_FETCH,
        _C.REQUEST_UPDATE_PUBLISH_NAMESPACE, _C.REQUEST_UPDATE_SUBSCRIBE_NAMESPACE,
        _C.REQUEST_UPDATE_SUBSCRIBE_TRACKS,
    ),
}


def _complete(table: dict[ParamContext, frozenset[int]]) -> dict[ParamContext, frozenset[int]]:
    out = {ctx: table.get(ctx, frozenset()) for ctx in ParamContext}
    for union, parts in _UNIONS.items():
        out[union] = frozenset().union(*(out[p] for p in parts))
    return out


_ALLOWED: dict[Version, dict[ParamContext, frozenset[int]]] = {
    Version.DRAFT_18: _complete(_D18),
    Version.DRAFT_20: _complete(_D20),
    Version.DRAFT_22: _complete(_D22),
}
_DEFINED = {
    v: frozenset(s.type for s in PARAMETER_SPECS if v >= s.since) for v in _ALLOWED
}


def defined_parameter_types(version: Version) -> frozenset[int]:
    """The Message Parameter types ``version`` defines (others are unknown)."""
    return _DEFINED[version.wire_version]


def allowed_parameter_types(version: Version, context: ParamContext) -> frozenset[int]:
    """The parameter types that may appear in ``context`` in ``version``."""
    return _ALLOWED[version.wire_version][context]


_log = logging.getLogger(__name__)


def check_parameters(version: Version, context: ParamContext, params: MessageParameters, *,
                     strict: bool = False) -> MessageParameters:
    """``params`` without the parameters ``context`` does not list (for the session: e.g. a
    REQUEST_OK that answers TRACK_STATUS, or a REQUEST_UPDATE of a FETCH): each is ignored
    and logged (module docstring). ``strict`` (checking a message of ours): PROTOCOL_VIOLATION
    instead."""
    extra = sorted(params.types() - allowed_parameter_types(version, context))
    if not extra:
        return params
    names = ", ".join(_T(t).name for t in extra)
    if strict:
        raise violation(f"parameter {names} not allowed in {context.value}")
    _log.info("ignoring parameter %s: not allowed in %s", names, context.value)
    cleared = {spec.field: () if spec.repeatable else None
               for spec in (_SPEC_BY_TYPE[_T(t)] for t in extra)}
    return dataclasses.replace(params, **cleared)  # type: ignore[arg-type]


# =============================================================================================
# Codec
# =============================================================================================
def read_parameters(
    r: Reader, version: Version, context: ParamContext, *, counted: bool = True
) -> MessageParameters:
    """Read ``Number of Parameters`` and the parameters (``counted``), or parameters up to the
    end of ``r`` (inside FILL_PARAMETERS), enforcing the allow-list of ``context``."""
    wire = version.wire_version
    allowed = _ALLOWED[wire][context]
    defined = _DEFINED[wire]
    values: dict[str, Any] = {}
    ignored: list[str] = []
    remaining = r.pull_vi64() if counted else 0
    ptype = 0
    while (remaining > 0) if counted else not r.at_end():
        remaining -= 1
        ptype += r.pull_vi64()
        if ptype > VI64_MAX:
            raise violation("parameter type exceeds 2^64-1")
        if ptype not in defined:
            raise violation(f"unknown parameter type {ptype:#x}")
        spec = _SPEC_BY_TYPE[ParameterType(ptype)]
        value = spec.codec.read(r, version)
        if ptype not in allowed:
            ignored.append(spec.type.name)  # known, not listed for this message: ignored
            continue
        if spec.repeatable:
            values.setdefault(spec.field, []).append(value)
        elif spec.field in values:
            raise violation(f"parameter {spec.type.name} repeated")
        else:
            values[spec.field] = value
    if ignored:
        _log.info("ignoring parameter %s: not allowed in %s", ", ".join(ignored), context.value)
    return MessageParameters(**values)


def write_parameters(
    w: Writer,
    version: Version,
    context: ParamContext,
    params: MessageParameters,
    *,
    counted: bool = True,
) -> None:
    """Append ``params`` (``ValueError`` if one is not defined in ``version`` or not allowed
    in ``context``)."""
    wire = version.wire_version
    allowed = _ALLOWED[wire][context]
    present = list(params.present())
    for spec, _ in present:
        if spec.type not in _DEFINED[wire]:
            raise ValueError(f"parameter {spec.type.name} does not exist in draft {int(wire)}")
        if spec.type not in allowed:
            raise ValueError(f"parameter {spec.type.name} not allowed in {context.value}")
    if counted:
        w.push_vi64(len(present))
    prev = 0
    for spec, value in present:
        w.push_vi64(spec.type - prev)
        spec.codec.write(w, version, value)
        prev = spec.type
