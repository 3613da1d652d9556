"""MOQT data-plane model: code points, headers and the events the stream parsers yield.

Section names below are those of draft-20 (the editor's copy in ``shared/spec``); draft-18
has the same sections and the same bytes except where noted, and drafts 21/22 do not change
the data plane (moqt-reference §3).

Stream types (§"Unidirectional Stream Types")::

    0x05          FETCH_HEADER (also fill fetch streams, 20+)
    0b0XX1XXXX    SUBGROUP_HEADER (the type is the Type Flags byte)
    0x2F00        SETUP (control stream; not a data stream)
    0x132B3E28    PADDING stream (§"Padding Streams")

Datagram types: OBJECT_DATAGRAM Type Flags 0b00X0XXXX (§"Object Datagram") and the padding
datagram 0x132B3E29 (§"Padding Datagrams").

Events (what :mod:`kvsp_moq.moqt.data` parsers return, in stream order):

* :class:`SubgroupHeader` / :class:`FetchHeader` / :class:`PaddingStreamHeader` — once, first;
* per object: :class:`ObjectBegin`, zero or more :class:`ObjectPayload` (memoryview slices of
  the fed chunks, never copied, never buffered whole), then :class:`ObjectEnd`;
* on fetch streams also :class:`EndOfRange` (§"End of Range").
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum, IntEnum

from ..wire.kvp import KeyValuePair

__all__ = [
    "DATAGRAM_FLAG_DEFAULT_PRIORITY",
    "DATAGRAM_FLAG_END_OF_GROUP",
    "DATAGRAM_FLAG_PROPERTIES",
    "DATAGRAM_FLAG_STATUS",
    "DATAGRAM_FLAG_ZERO_OBJECT_ID",
    "FETCH_FLAG_DATAGRAM",
    "FETCH_FLAG_GROUP_ID",
    "FETCH_FLAG_OBJECT_ID",
    "FETCH_FLAG_PRIORITY",
    "FETCH_FLAG_PROPERTIES",
    "FETCH_HEADER_TYPE",
    "FETCH_SUBGROUP_MASK",
    "PADDING_DATAGRAM_TYPE",
    "PADDING_STREAM_TYPE",
    "SETUP_STREAM_TYPE",
    "SUBGROUP_FLAG_DEFAULT_PRIORITY",
    "SUBGROUP_FLAG_END_OF_GROUP",
    "SUBGROUP_FLAG_FIRST_OBJECT",
    "SUBGROUP_FLAG_PROPERTIES",
    "SUBGROUP_FLAG_SUBGROUP_HEADER",
    "SUBGROUP_ID_MODE_MASK",
    "EndOfRange",
    "EndOfRangeKind",
    "FetchHeader",
    "GroupOrder",
    "ObjectBegin",
    "ObjectDatagram",
    "ObjectEnd",
    "ObjectPayload",
    "ObjectStatus",
    "PaddingDatagram",
    "PaddingStreamHeader",
    "StreamKind",
    "SubgroupHeader",
    "SubgroupIdMode",
    "is_datagram_type",
    "is_subgroup_type",
]

# -- stream and datagram types (§"Unidirectional Stream Types", §"Padding") -------------------
FETCH_HEADER_TYPE = 0x05
SETUP_STREAM_TYPE = 0x2F00
PADDING_STREAM_TYPE = 0x132B3E28
PADDING_DATAGRAM_TYPE = 0x132B3E29

# -- SUBGROUP_HEADER Type Flags (§"Subgroup Header") ------------------------------------------
SUBGROUP_FLAG_PROPERTIES = 0x01
# (flags & 0x06) >> 1: 0 Subgroup ID 0, 1 first Object ID, 2 field present, 3 reserved.
SUBGROUP_ID_MODE_MASK = 0x06
SUBGROUP_FLAG_END_OF_GROUP = 0x08
SUBGROUP_FLAG_SUBGROUP_HEADER = 0x10  # bit 4, always 1
SUBGROUP_FLAG_DEFAULT_PRIORITY = 0x20
SUBGROUP_FLAG_FIRST_OBJECT = 0x40  # draft 18+

# -- fetch object Serialization Flags (§"Fetch Header", §"Flags") ----------------------------
FETCH_SUBGROUP_MASK = 0x03  # 0 zero, 1 prior, 2 prior + 1, 3 field present
FETCH_FLAG_OBJECT_ID = 0x04
FETCH_FLAG_GROUP_ID = 0x08
FETCH_FLAG_PRIORITY = 0x10
FETCH_FLAG_PROPERTIES = 0x20
FETCH_FLAG_DATAGRAM = 0x40

# -- OBJECT_DATAGRAM Type Flags (§"Object Datagram") ------------------------------------------
DATAGRAM_FLAG_PROPERTIES = 0x01
DATAGRAM_FLAG_END_OF_GROUP = 0x02
DATAGRAM_FLAG_ZERO_OBJECT_ID = 0x04
DATAGRAM_FLAG_DEFAULT_PRIORITY = 0x08
# 0x10 is reserved and MUST be zero.
DATAGRAM_FLAG_STATUS = 0x20


def is_subgroup_type(t: int) -> bool:
    """A valid SUBGROUP_HEADER Type Flags value: < 0x80, bit 4 set, Subgroup ID mode != 0b11."""
    return t < 0x80 and bool(t & SUBGROUP_FLAG_SUBGROUP_HEADER) and (t & 0x06) != 0x06


def is_datagram_type(t: int) -> bool:
    """A valid OBJECT_DATAGRAM Type Flags value: only bits 0-3 and 5 set, and not STATUS
    together with END_OF_GROUP."""
    return (t & ~0x2F) == 0 and not (t & DATAGRAM_FLAG_STATUS and t & DATAGRAM_FLAG_END_OF_GROUP)


class StreamKind(Enum):
    """What a unidirectional stream carries, from its first vi64."""

    SUBGROUP = "subgroup"
    FETCH = "fetch"
    CONTROL = "control"
    PADDING = "padding"


class ObjectStatus(IntEnum):
    """Object Status (§"Object Status"; registry §"Object Status"). Only NORMAL has a payload."""

    NORMAL = 0x0
    END_OF_GROUP = 0x3
    END_OF_TRACK = 0x4


class GroupOrder(IntEnum):
    """GROUP_ORDER parameter values (§"GROUP ORDER Parameter"); FETCH defaults to ASCENDING."""

    ASCENDING = 0x1
    DESCENDING = 0x2


class SubgroupIdMode(IntEnum):
    """SUBGROUP_ID_MODE of a SUBGROUP_HEADER (§"Subgroup Header")."""

    ZERO = 0  # field absent, Subgroup ID 0
    FIRST_OBJECT_ID = 1  # field absent, Subgroup ID = Object ID of the first object on the stream
    EXPLICIT = 2  # field present


class EndOfRangeKind(IntEnum):
    """Special fetch Serialization Flags values (§"End of Range")."""

    NON_EXISTENT = 0x8C
    UNKNOWN = 0x10C
    #: Draft 20+ (fill fetch; End of Timed-Out Range).
    TIMED_OUT = 0x20C


# -- stream headers ---------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class SubgroupHeader:
    """SUBGROUP_HEADER (§"Subgroup Header").

    ``subgroup_id`` is ``None`` exactly when ``subgroup_id_mode`` is FIRST_OBJECT_ID (the ID is
    then the first object's, reported in each :class:`ObjectBegin`); it is 0 in mode ZERO.
    ``publisher_priority`` ``None`` means DEFAULT_PRIORITY: inherit the priority of the
    control message that established the subscription.
    """

    track_alias: int
    group_id: int
    subgroup_id: int | None = 0
    publisher_priority: int | None = None
    subgroup_id_mode: SubgroupIdMode = SubgroupIdMode.EXPLICIT
    has_properties: bool = False
    end_of_group: bool = False
    first_object: bool = False

    def __post_init__(self) -> None:
        mode = self.subgroup_id_mode
        if mode is SubgroupIdMode.FIRST_OBJECT_ID:
            if self.subgroup_id is not None:
                raise ValueError("subgroup_id must be None in FIRST_OBJECT_ID mode")
        elif mode is SubgroupIdMode.ZERO:
            if self.subgroup_id != 0:
                raise ValueError("subgroup_id must be 0 in ZERO mode")
        elif self.subgroup_id is None:
            raise ValueError("EXPLICIT mode needs a subgroup_id")
        if self.publisher_priority is not None and not 0 <= self.publisher_priority <= 0xFF:
            raise ValueError(f"publisher priority {self.publisher_priority} not in 0..255")

    @property
    def type_flags(self) -> int:
        """The Type Flags byte (the stream type)."""
        t = SUBGROUP_FLAG_SUBGROUP_HEADER | (int(self.subgroup_id_mode) << 1)
        if self.has_properties:
            t |= SUBGROUP_FLAG_PROPERTIES
        if self.end_of_group:
            t |= SUBGROUP_FLAG_END_OF_GROUP
        if self.publisher_priority is None:
            t |= SUBGROUP_FLAG_DEFAULT_PRIORITY
        if self.first_object:
            t |= SUBGROUP_FLAG_FIRST_OBJECT
        return t


@dataclass(frozen=True, slots=True)
class FetchHeader:
    """FETCH_HEADER (§"Fetch Header"): the FETCH's Request ID, or (20+) the SUBSCRIBE /
    REQUEST_UPDATE whose FILL_PARAMETERS opened this fill fetch stream."""

    request_id: int


@dataclass(frozen=True, slots=True)
class PaddingStreamHeader:
    """A padding stream began (§"Padding Streams"); everything after it is discarded."""


# -- object events ----------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class ObjectBegin:
    """The header of one object; its payload follows as :class:`ObjectPayload` events.

    ``subgroup_id`` is ``None`` for an object whose forwarding preference is Datagram (fetch
    streams only). ``publisher_priority`` is ``None`` when inherited from the subscription.
    ``properties`` are the parsed Object Properties; ``raw_properties`` their exact wire
    bytes, to forward unchanged (§"Properties": relays MUST NOT modify them); it is not
    compared by ``==``.
    """

    group_id: int
    subgroup_id: int | None
    object_id: int
    publisher_priority: int | None
    status: ObjectStatus
    payload_length: int
    properties: tuple[KeyValuePair, ...] = ()
    raw_properties: bytes = field(default=b"", compare=False)


@dataclass(frozen=True, slots=True)
class ObjectPayload:
    """A chunk of the current object's payload: a memoryview of the data passed to ``feed``.

    Valid until that buffer is mutated or released; copy it (or write it to its destination)
    before then. (Equality compares contents, as memoryview equality does.)
    """

    data: memoryview


@dataclass(frozen=True, slots=True)
class ObjectEnd:
    """The current object's payload is complete."""

    group_id: int
    object_id: int


@dataclass(frozen=True, slots=True)
class EndOfRange:
    """A fetch End of Range marker (§"End of Range"): objects after the previous one up to and
    including ``{group_id, object_id}`` do not exist / are unknown / timed out."""

    kind: EndOfRangeKind
    group_id: int
    object_id: int


# -- datagrams --------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class ObjectDatagram:
    """OBJECT_DATAGRAM (§"Object Datagram"), type flags resolved.

    ``payload`` is a memoryview of the received datagram when parsed. An object whose status
    is not NORMAL is sent with the STATUS flag and has no payload. When encoding, non-empty
    ``raw_properties`` (e.g. from a parsed datagram being forwarded) are sent as they are;
    otherwise ``properties`` are encoded. ``raw_properties`` is not compared by ``==``.
    """

    track_alias: int
    group_id: int
    object_id: int
    publisher_priority: int | None = None
    status: ObjectStatus = ObjectStatus.NORMAL
    payload: bytes | memoryview = b""
    end_of_group: bool = False
    properties: tuple[KeyValuePair, ...] = ()
    raw_properties: bytes = field(default=b"", compare=False)


@dataclass(frozen=True, slots=True)
class PaddingDatagram:
    """A padding datagram (§"Padding Datagrams") of ``length`` bytes after its type."""

    length: int
