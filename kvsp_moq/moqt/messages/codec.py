"""Control message framing and the per-version registry (draft-20 §"Control Messages";
draft-18 the same section).

::

    MOQT Control Message {
      Message Type (vi64),
      Message Length (16),     -- bytes in the Message Body, at most 65535
      Message Body (..),
    }

* "An endpoint that receives an unknown message type MUST close the session" — with
  PROTOCOL_VIOLATION (the draft names no code; moqt-reference §2.4). A type defined only in
  another version (PUBLISH_STATE_NOTIFY in 18; 0x1E in 20+, which list it as "RESERVED
  (PUBLISH_OK in <= 17)") is unknown. Draft 18's table still lists 0x1E PUBLISH_OK: accepted
  there (:class:`~.request.PublishOk`).
* "If the length does not match the length of the Message Body, the receiver MUST close the
  session with a PROTOCOL_VIOLATION": a body that ends inside a field, or leaves bytes over.
* Every other error is the one the message codecs name (``WireError.code``).

:func:`decode_message` returns ``None`` while the message is incomplete (it never waits for a
body when the type is already unknown), :class:`ControlStreamReader` takes a stream's bytes
in chunks of any size, keeping at most one incomplete message (<= 65546 bytes) buffered.
The control stream's first bytes are SETUP's type ``af 00``, which is also the stream type
(§"Unidirectional Stream Types"): feed the whole stream, including them.
"""

from __future__ import annotations

from ...wire.buffer import Buffer, Reader, Writer
from ...wire.errors import BufferUnderflow, WireError
from ...wire.varint import read_vi64
from ..version import Version
from ._base import Message
from ._fields import violation
from .fetch import Fetch, FetchOk, FetchWithType, JoiningFetch, StandaloneFetch
from .namespace import (
    Namespace,
    NamespaceDone,
    PublishNamespace,
    PublishSkipped,
    SubscribeNamespace,
    SubscribeTracks,
)
from .publish import Publish, PublishDone, PublishStateNotify
from .request import PublishOk, RequestError, RequestOk
from .setup import GoAway, Setup
from .subscribe import RequestUpdate, Subscribe, SubscribeOk
from .track_status import TrackStatus

__all__ = [
    "MAX_MESSAGE_LENGTH",
    "ControlStreamReader",
    "decode_message",
    "encode_message",
    "message_class",
    "message_classes",
]

MAX_MESSAGE_LENGTH = 0xFFFF

#: Every message class; the registry below is derived from TYPE and VERSIONS.
_CLASSES: tuple[type[Message], ...] = (
    Setup, GoAway, Subscribe, SubscribeOk, RequestUpdate, RequestOk, PublishOk, RequestError,
    Publish,
    PublishDone, PublishStateNotify, Fetch, FetchWithType, FetchOk, TrackStatus,
    PublishNamespace, SubscribeNamespace, SubscribeTracks, Namespace, NamespaceDone,
    PublishSkipped,
)


def _registry(version: Version) -> dict[int, type[Message]]:
    table: dict[int, type[Message]] = {}
    for cls in _CLASSES:
        if version in cls.VERSIONS:
            assert cls.TYPE not in table, f"two messages with type {cls.TYPE:#x}"
            table[cls.TYPE] = cls
    return table


_REGISTRY = {v: _registry(v) for v in (Version.DRAFT_18, Version.DRAFT_20, Version.DRAFT_22)}
# Classes that encode in a version but are decoded through another registry entry.
_ENCODABLE: dict[Version, set[type[Message]]] = {}
for _version, _table in _REGISTRY.items():
    _ENCODABLE[_version] = set(_table.values())
    if FetchWithType in _ENCODABLE[_version]:  # draft 18 encodes its two FETCH shapes
        _ENCODABLE[_version] |= {StandaloneFetch, JoiningFetch}


def message_classes(version: Version) -> dict[int, type[Message]]:
    """Message Type → class decoding it, in ``version``."""
    return dict(_REGISTRY[version.wire_version])


def message_class(version: Version, message_type: int) -> type[Message]:
    """The class of ``message_type`` in ``version``; PROTOCOL_VIOLATION if there is none."""
    cls = _REGISTRY[version.wire_version].get(message_type)
    if cls is None:
        raise violation(f"unknown message type {message_type:#x} in draft {int(version)}")
    return cls


def encode_message(version: Version, msg: Message) -> bytes:
    """The framed bytes of ``msg`` in ``version``. ``ValueError`` if the message does not
    exist in that version, a field cannot be encoded, or the body exceeds 65535 bytes."""
    wire = version.wire_version
    if type(msg) not in _ENCODABLE[wire]:
        raise ValueError(f"{type(msg).__name__} does not exist in draft {int(version)}")
    w = Writer(seven_byte=version.vi64_seven_byte)
    w.push_vi64(msg.TYPE)
    at = w.reserve_uint16()
    msg.encode_body(w, wire)
    length = len(w) - at - 2
    if length > MAX_MESSAGE_LENGTH:
        raise ValueError(f"{msg.NAME} body of {length} bytes exceeds {MAX_MESSAGE_LENGTH}")
    w.patch_uint16(at, length)
    return w.getvalue()


def _decode_framed(
    cls: type[Message], data: Buffer, start: int, end: int, version: Version
) -> Message:
    r = Reader(data, start, end, seven_byte=version.vi64_seven_byte)
    try:
        msg: Message = cls.decode_body(r, version.wire_version)
    except BufferUnderflow:
        raise violation(f"{cls.NAME} body ends inside a field (Message Length mismatch)") from None
    if not r.at_end():
        raise violation(f"{r.remaining} bytes after the {cls.NAME} body (Message Length mismatch)")
    return msg


def decode_message(version: Version, data: Buffer, offset: int = 0) -> tuple[Message, int] | None:
    """Decode the message at ``data[offset:]``: ``(message, bytes consumed)``, or ``None`` if
    more bytes are needed. Raises :class:`WireError` with the code the draft names."""
    try:
        message_type, n = read_vi64(data, offset, seven_byte=version.vi64_seven_byte)
    except BufferUnderflow:
        return None
    cls = message_class(version, message_type)
    header = offset + n
    if len(data) < header + 2:
        return None
    length = int.from_bytes(data[header : header + 2], "big")
    end = header + 2 + length
    if len(data) < end:
        return None
    return _decode_framed(cls, data, header + 2, end, version), end - offset


class ControlStreamReader:
    """Incremental reader of the control messages on one stream (control or request).

    ``feed(chunk)`` returns the messages the chunk completes; ``feed(b"", end_stream=True)``
    (or the last chunk with ``end_stream``) reports the FIN: ending inside a message is a
    PROTOCOL_VIOLATION. After a :class:`WireError` the reader is dead and raises it again.
    """

    __slots__ = ("version", "_buf", "_error", "_finished")

    def __init__(self, version: Version) -> None:
        self.version = version
        self._buf = bytearray()
        self._error: WireError | None = None
        self._finished = False

    @property
    def buffered(self) -> int:
        """Bytes of an incomplete message held."""
        return len(self._buf)

    def feed(self, data: Buffer, end_stream: bool = False) -> list[Message]:
        if self._error is not None:
            raise self._error
        if self._finished:
            raise ValueError("data fed after the end of the stream")
        buf = self._buf
        buf += data
        out: list[Message] = []
        pos = 0
        try:
            while pos < len(buf):
                # Slices are copies: no view of the bytearray outlives the loop, so it can be
                # trimmed below.
                size = _frame_size(self.version, bytes(buf[pos : pos + 11]))
                if size is None or len(buf) - pos < size:
                    break
                got = decode_message(self.version, bytes(buf[pos : pos + size]))
                assert got is not None and got[1] == size
                out.append(got[0])
                pos += size
            del buf[:pos]
            if end_stream:
                self._finished = True
                if buf:
                    raise violation("stream ended inside a control message")
        except WireError as exc:
            self._error = exc
            raise
        return out


def _frame_size(version: Version, head: bytes) -> int | None:
    """Total size of the message whose first bytes (up to 11: type and length) are ``head``,
    or ``None`` if they are too few to tell. An unknown type raises PROTOCOL_VIOLATION as
    soon as it is read."""
    try:
        message_type, n = read_vi64(head, 0, seven_byte=version.vi64_seven_byte)
    except BufferUnderflow:
        return None
    message_class(version, message_type)
    if len(head) < n + 2:
        return None
    return n + 2 + int.from_bytes(head[n : n + 2], "big")
