"""MOQT data plane codec (drafts 18, 20, 21, 22): subgroup and fetch streams, object
datagrams, padding. Pure and sans-IO.

Sections cited are those of draft-20 (``shared/spec/moq-transport-editors-copy-*``), §"Data
Streams and Datagrams"; draft-18 has the same sections and bytes except that End of
Timed-Out Range (0x20C) is new in 20. Drafts 21 and 22 do not change the data plane
(moqt-reference §3). Per-version switches come from :class:`Version`.

Receiving
---------
Find what a unidirectional stream is with :func:`peek_stream_type` (``None`` until its first
vi64 is complete), then feed the stream's bytes, from the first, to a parser:

* :class:`SubgroupStreamParser` — SUBGROUP_HEADER then subgroup objects;
* :class:`FetchStreamParser` — FETCH_HEADER then fetch objects and End of Range markers
  (it needs the FETCH's Group Order to resolve Group ID deltas);
* :class:`PaddingStreamParser` — discards everything;
* :class:`DataStreamParser` — any of the three, chosen from the stream type.

``parser.feed(chunk, end_stream=False) -> list[event]`` accepts chunks of any size and
returns events (see :mod:`kvsp_moq.moqt.objects`): the header, then per object
``ObjectBegin``, ``ObjectPayload`` chunks (memoryviews of ``chunk``; a payload is never
buffered or copied, so a 2**60-byte declared length costs nothing) and ``ObjectEnd``. Malformed
input raises :class:`WireError` with the code the draft names (PROTOCOL_VIOLATION for
everything on the data plane); Object Properties longer than ``max_properties_length`` raise
:class:`LimitExceeded`.

Datagrams: :func:`parse_datagram` returns :class:`ObjectDatagram` (payload a memoryview of the
datagram) or :class:`PaddingDatagram`.

Layout: this package's ``__init__`` is the public face of the data plane (stream-type
dispatch and :class:`DataStreamParser` live here); the codecs are in ``subgroup``, ``fetch``,
``datagram`` and ``padding``, the helpers they share in ``common``, the event and header
types in :mod:`kvsp_moq.moqt.objects`, the chunk-driving machinery in ``incremental``.
Import from here.

Sending
-------
:class:`SubgroupStreamEncoder` and :class:`FetchStreamEncoder` produce the header and, per
object, the bytes before its payload (``object_header``) — the caller then writes the payload
itself, from wherever it lives — or header and payload together (``object``). They keep the
delta state and always choose the shortest encoding. :func:`encode_datagram`,
:func:`encode_subgroup_header`, :func:`encode_fetch_header`,
:func:`encode_padding_stream_header`, :func:`encode_padding_datagram` do the rest. Encoders
raise ``ValueError`` for input that cannot be sent.
"""

from __future__ import annotations

from ...wire.buffer import Buffer, as_byte_view
from ...wire.errors import BufferUnderflow
from ...wire.varint import read_vi64
from .common import DEFAULT_MAX_PROPERTIES_LENGTH, Properties, violation
from .datagram import encode_datagram, parse_datagram
from .fetch import FetchStreamEncoder, FetchStreamParser, GroupOrderSource, encode_fetch_header
from .padding import (
    PaddingStreamParser,
    encode_padding_datagram,
    encode_padding_stream_header,
)
from .subgroup import SubgroupStreamEncoder, SubgroupStreamParser, encode_subgroup_header
from ..objects import (
    FETCH_HEADER_TYPE,
    PADDING_STREAM_TYPE,
    SETUP_STREAM_TYPE,
    EndOfRange,
    EndOfRangeKind,
    FetchHeader,
    GroupOrder,
    ObjectBegin,
    ObjectDatagram,
    ObjectEnd,
    ObjectPayload,
    ObjectStatus,
    PaddingDatagram,
    PaddingStreamHeader,
    StreamKind,
    SubgroupHeader,
    SubgroupIdMode,
    is_subgroup_type,
)
from ..version import DEFAULT_VERSION, Version

__all__ = [
    "DEFAULT_MAX_PROPERTIES_LENGTH",
    "DataStreamParser",
    "EndOfRange",
    "EndOfRangeKind",
    "FetchHeader",
    "FetchStreamEncoder",
    "FetchStreamParser",
    "GroupOrder",
    "ObjectBegin",
    "ObjectDatagram",
    "ObjectEnd",
    "ObjectPayload",
    "ObjectStatus",
    "PaddingDatagram",
    "PaddingStreamHeader",
    "PaddingStreamParser",
    "Properties",
    "StreamKind",
    "SubgroupHeader",
    "SubgroupIdMode",
    "SubgroupStreamEncoder",
    "SubgroupStreamParser",
    "classify_stream_type",
    "encode_datagram",
    "encode_fetch_header",
    "encode_padding_datagram",
    "encode_padding_stream_header",
    "encode_subgroup_header",
    "parse_datagram",
    "peek_stream_type",
]


# =============================================================================================
# Stream types (§"Unidirectional Stream Types")
# =============================================================================================
def classify_stream_type(stream_type: int) -> StreamKind:
    """The kind of a unidirectional stream; unknown types → PROTOCOL_VIOLATION (the draft says
    the session MUST be closed and names no code)."""
    if stream_type == FETCH_HEADER_TYPE:
        return StreamKind.FETCH
    if is_subgroup_type(stream_type):
        return StreamKind.SUBGROUP
    if stream_type == SETUP_STREAM_TYPE:
        return StreamKind.CONTROL
    if stream_type == PADDING_STREAM_TYPE:
        return StreamKind.PADDING
    raise violation(f"unknown stream type {stream_type:#x}")


def peek_stream_type(
    data: Buffer, version: Version = DEFAULT_VERSION
) -> tuple[StreamKind, int] | None:
    """``(kind, type value)`` from the first bytes of a stream, ``None`` if incomplete."""
    try:
        value, _ = read_vi64(as_byte_view(data), 0, seven_byte=version.vi64_seven_byte)
    except BufferUnderflow:
        return None
    return classify_stream_type(value), value


# =============================================================================================
# Any data stream
# =============================================================================================
class DataStreamParser:
    """A subgroup, fetch or padding stream, told apart by its type (first vi64).

    Control streams (SETUP, 0x2F00) are not data streams: route them with
    :func:`peek_stream_type` first; here they are a PROTOCOL_VIOLATION.
    """

    __slots__ = ("version", "_group_order", "_max_properties_length", "_head", "parser")

    def __init__(
        self,
        version: Version = DEFAULT_VERSION,
        *,
        group_order: GroupOrderSource = GroupOrder.ASCENDING,
        max_properties_length: int = DEFAULT_MAX_PROPERTIES_LENGTH,
    ) -> None:
        self.version = version
        self._group_order = group_order
        self._max_properties_length = max_properties_length
        self._head = bytearray()
        #: The parser chosen for this stream, once its type is known.
        self.parser: SubgroupStreamParser | FetchStreamParser | PaddingStreamParser | None = None

    @property
    def kind(self) -> StreamKind | None:
        p = self.parser
        if p is None:
            return None
        if isinstance(p, SubgroupStreamParser):
            return StreamKind.SUBGROUP
        if isinstance(p, FetchStreamParser):
            return StreamKind.FETCH
        return StreamKind.PADDING

    def feed(self, data: Buffer, end_stream: bool = False) -> list[object]:
        parser = self.parser
        if parser is not None:
            return parser.feed(data, end_stream)
        head = self._head
        if head:
            head += data  # the type is at most 9 bytes, so this is a few bytes at most
            data = head
        peeked = peek_stream_type(data, self.version)
        if peeked is None:
            if end_stream:
                raise violation("stream ended inside its type")
            if not head:
                head += data
            return []
        kind = peeked[0]
        if kind is StreamKind.SUBGROUP:
            parser = SubgroupStreamParser(
                self.version, max_properties_length=self._max_properties_length
            )
        elif kind is StreamKind.FETCH:
            parser = FetchStreamParser(
                self.version,
                group_order=self._group_order,
                max_properties_length=self._max_properties_length,
            )
        elif kind is StreamKind.PADDING:
            parser = PaddingStreamParser(self.version)
        else:
            raise violation("control stream type where a data stream was expected")
        self.parser = parser
        if head:
            data = bytes(head)
            head.clear()
        return parser.feed(data, end_stream)
