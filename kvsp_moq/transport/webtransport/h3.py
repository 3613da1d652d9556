"""HTTP/3 and WebTransport framing, sans-IO: the codes, frames, SETTINGS, capsules, the
WebTransport error-code mapping and the header fields a WebTransport session needs.

What is here is what a WebTransport endpoint (``endpoint.py``) needs of RFC 9114 (HTTP/3),
RFC 9220 (extended CONNECT), RFC 9297 (HTTP datagrams and capsules) and
draft-ietf-webtrans-http3 (WebTransport over HTTP/3), nothing more: no request bodies, no
server push, no QPACK dynamic table (we advertise a capacity of 0; ``pylsqpack`` encodes and
decodes the static table and literals). Every parser is bounded: a frame longer than the
limit it is given raises :class:`H3Error` with ``H3_EXCESSIVE_LOAD`` before it is buffered.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from enum import IntEnum

from ...wire.errors import BufferUnderflow
from ...wire.varint import encode_quic_varint, quic_varint_size, read_quic_varint

__all__ = [
    "CapsuleType",
    "FrameReader",
    "FrameType",
    "H3Error",
    "H3ErrorCode",
    "Setting",
    "StreamType",
    "WT_APPLICATION_ERROR_FIRST",
    "WT_APPLICATION_ERROR_LAST",
    "decode_settings",
    "encode_capsule",
    "encode_frame",
    "encode_settings",
    "encode_sf_string_list",
    "h3_code_to_wt",
    "parse_capsules",
    "parse_sf_string",
    "parse_sf_string_list",
    "quarter_stream_id_size",
    "request_pseudo_headers",
    "stream_prefix",
    "wt_code_to_h3",
    "decode_close_capsule",
    "encode_close_capsule",
    "encode_sf_string",
    "header_value",
]


class H3ErrorCode(IntEnum):
    """RFC 9114 §8.1, RFC 9204 §6, RFC 9297 §5.2, draft-ietf-webtrans-http3 §9.5."""

    H3_NO_ERROR = 0x100
    H3_GENERAL_PROTOCOL_ERROR = 0x101
    H3_INTERNAL_ERROR = 0x102
    H3_STREAM_CREATION_ERROR = 0x103
    H3_CLOSED_CRITICAL_STREAM = 0x104
    H3_FRAME_UNEXPECTED = 0x105
    H3_FRAME_ERROR = 0x106
    H3_EXCESSIVE_LOAD = 0x107
    H3_ID_ERROR = 0x108
    H3_SETTINGS_ERROR = 0x109
    H3_MISSING_SETTINGS = 0x10A
    H3_REQUEST_REJECTED = 0x10B
    H3_REQUEST_CANCELLED = 0x10C
    H3_REQUEST_INCOMPLETE = 0x10D
    H3_MESSAGE_ERROR = 0x10E
    H3_CONNECT_ERROR = 0x10F
    H3_VERSION_FALLBACK = 0x110
    QPACK_DECOMPRESSION_FAILED = 0x200
    QPACK_ENCODER_STREAM_ERROR = 0x201
    QPACK_DECODER_STREAM_ERROR = 0x202
    H3_DATAGRAM_ERROR = 0x33
    WT_BUFFERED_STREAM_REJECTED = 0x3994BD84
    WT_SESSION_GONE = 0x170D7B68


class H3Error(Exception):
    """A connection error of HTTP/3 (RFC 9114 §8): close the QUIC connection with ``code``."""

    def __init__(self, code: int, reason: str) -> None:
        super().__init__(f"{reason} (0x{code:x})")
        self.code = code
        self.reason = reason


class FrameType(IntEnum):
    """RFC 9114 §7.2; WEBTRANSPORT_STREAM: draft-ietf-webtrans-http3 §4.2."""

    DATA = 0x0
    HEADERS = 0x1
    CANCEL_PUSH = 0x3
    SETTINGS = 0x4
    PUSH_PROMISE = 0x5
    GOAWAY = 0x7
    MAX_PUSH_ID = 0xD
    WEBTRANSPORT_STREAM = 0x41


#: HTTP/2 frame types with no HTTP/3 meaning: receiving one is H3_FRAME_UNEXPECTED (§7.2.8).
RESERVED_H2_FRAMES = frozenset({0x2, 0x6, 0x8, 0x9})


class StreamType(IntEnum):
    """Unidirectional stream types: RFC 9114 §6.2, RFC 9204 §4.2, WebTransport §4.1."""

    CONTROL = 0x0
    PUSH = 0x1
    QPACK_ENCODER = 0x2
    QPACK_DECODER = 0x3
    WEBTRANSPORT = 0x54


class Setting(IntEnum):
    """SETTINGS identifiers we send or read. The WebTransport ones are every draft's that
    browsers and MOQT stacks still speak: draft-02's ENABLE_WEBTRANSPORT, draft-07's
    WEBTRANSPORT_MAX_SESSIONS; H3_DATAGRAM of RFC 9297 and of its draft-04."""

    QPACK_MAX_TABLE_CAPACITY = 0x1
    MAX_FIELD_SECTION_SIZE = 0x6
    QPACK_BLOCKED_STREAMS = 0x7
    ENABLE_CONNECT_PROTOCOL = 0x8
    H3_DATAGRAM = 0x33
    H3_DATAGRAM_DRAFT04 = 0xFFD277
    ENABLE_WEBTRANSPORT = 0x2B603742
    WEBTRANSPORT_MAX_SESSIONS_DRAFT07 = 0xC671706A
    WT_MAX_SESSIONS = 0x14E9CD29


#: HTTP/2 settings with no HTTP/3 meaning: receiving one is H3_SETTINGS_ERROR (§7.2.4.1).
RESERVED_H2_SETTINGS = frozenset({0x2, 0x3, 0x4, 0x5})


class CapsuleType(IntEnum):
    """RFC 9297 §3.5; draft-ietf-webtrans-http3 §6 (close), §4.6 (drain)."""

    DATAGRAM = 0x0
    CLOSE_WEBTRANSPORT_SESSION = 0x2843
    DRAIN_WEBTRANSPORT_SESSION = 0x78AE


#: The CLOSE_WEBTRANSPORT_SESSION message is at most 1024 bytes (draft §6).
MAX_CLOSE_MESSAGE = 1024

# draft-ietf-webtrans-http3 §4.4: a 32-bit WebTransport application error code travels in
# RESET_STREAM / STOP_SENDING as first + code + floor(code / 0x1e), skipping the reserved
# (GREASE) codepoints 0x1f * N + 0x21.
WT_APPLICATION_ERROR_FIRST = 0x52E4A40FA8DB
WT_APPLICATION_ERROR_LAST = 0x52E5AC983162


def wt_code_to_h3(code: int) -> int:
    """The HTTP/3 error code carrying the WebTransport application error ``code`` (a code
    over 32 bits is sent as 0xffffffff)."""
    code = min(max(code, 0), 0xFFFFFFFF)
    return WT_APPLICATION_ERROR_FIRST + code + code // 0x1E


def h3_code_to_wt(h3_code: int) -> int | None:
    """The WebTransport application error code an HTTP/3 error code carries; None for a code
    outside the range or a reserved one."""
    if not WT_APPLICATION_ERROR_FIRST <= h3_code <= WT_APPLICATION_ERROR_LAST:
        return None
    if (h3_code - 0x21) % 0x1F == 0:
        return None
    shifted = h3_code - WT_APPLICATION_ERROR_FIRST
    return shifted - shifted // 0x1F


# ------------------------------------------------------------------------------------------
# frames


def encode_frame(frame_type: int, payload: bytes) -> bytes:
    """One HTTP/3 frame: Type (i), Length (i), Frame Payload (RFC 9114 §7.1)."""
    return encode_quic_varint(frame_type) + encode_quic_varint(len(payload)) + payload


def encode_settings(settings: dict[int, int]) -> bytes:
    """A SETTINGS frame's payload (RFC 9114 §7.2.4)."""
    return b"".join(encode_quic_varint(k) + encode_quic_varint(v) for k, v in settings.items())


def decode_settings(payload: bytes) -> dict[int, int]:
    """A SETTINGS frame's payload; H3_SETTINGS_ERROR for a repeated or HTTP/2-only
    identifier, H3_FRAME_ERROR for a truncated one (RFC 9114 §7.2.4)."""
    out: dict[int, int] = {}
    pos = 0
    try:
        while pos < len(payload):
            key, n = read_quic_varint(payload, pos)
            pos += n
            value, n = read_quic_varint(payload, pos)
            pos += n
            if key in out:
                raise H3Error(H3ErrorCode.H3_SETTINGS_ERROR, f"setting 0x{key:x} repeated")
            if key in RESERVED_H2_SETTINGS:
                raise H3Error(H3ErrorCode.H3_SETTINGS_ERROR, f"HTTP/2 setting 0x{key:x}")
            out[key] = value
    except BufferUnderflow:
        raise H3Error(H3ErrorCode.H3_FRAME_ERROR, "truncated SETTINGS") from None
    return out


class FrameReader:
    """Frames of one stream, parsed as bytes arrive. :meth:`feed` returns the complete
    frames (type, payload); a frame whose declared length exceeds ``max_payload`` raises
    H3_EXCESSIVE_LOAD before anything of it is buffered, so a peer's length never sizes our
    memory. ``pending`` is the count of buffered bytes of an incomplete frame."""

    def __init__(self, max_payload: int) -> None:
        self._max = max_payload
        self._buf = bytearray()

    @property
    def pending(self) -> int:
        return len(self._buf)

    def feed(self, data: bytes | memoryview) -> list[tuple[int, bytes]]:
        self._buf += data
        return take_tlvs(self._buf, self._max, "frame")


def take_tlvs(buf: bytearray, max_value: int, what: str) -> list[tuple[int, bytes]]:
    """The complete Type (i), Length (i), Value units at the start of ``buf`` (removed from
    it): HTTP/3 frames (RFC 9114 §7.1) and capsules (RFC 9297 §3.2) alike. One whose
    declared length exceeds ``max_value`` raises H3_EXCESSIVE_LOAD before it is buffered."""
    out: list[tuple[int, bytes]] = []
    pos = 0
    while True:
        try:
            utype, n1 = read_quic_varint(buf, pos)
            length, n2 = read_quic_varint(buf, pos + n1)
        except BufferUnderflow:
            break
        if length > max_value:
            raise H3Error(H3ErrorCode.H3_EXCESSIVE_LOAD,
                          f"{what} 0x{utype:x} of {length} bytes (limit {max_value})")
        start = pos + n1 + n2
        if start + length > len(buf):
            break
        out.append((utype, bytes(buf[start:start + length])))
        pos = start + length
    if pos:
        del buf[:pos]
    return out


# ------------------------------------------------------------------------------------------
# capsules (RFC 9297 §3.2: carried in the DATA frames of the CONNECT stream)


def encode_capsule(capsule_type: int, value: bytes) -> bytes:
    """Capsule Type (i), Capsule Length (i), Capsule Value."""
    return encode_quic_varint(capsule_type) + encode_quic_varint(len(value)) + value


def encode_close_capsule(code: int, message: str) -> bytes:
    """CLOSE_WEBTRANSPORT_SESSION: Application Error Code (32), Application Error Message
    (at most 1024 bytes of UTF-8, cut on a character boundary)."""
    raw = message.encode("utf-8")
    if len(raw) > MAX_CLOSE_MESSAGE:
        raw = raw[:MAX_CLOSE_MESSAGE].decode("utf-8", "ignore").encode("utf-8")
    return encode_capsule(CapsuleType.CLOSE_WEBTRANSPORT_SESSION,
                          min(max(code, 0), 0xFFFFFFFF).to_bytes(4, "big") + raw)


def parse_capsules(buf: bytearray, max_value: int) -> list[tuple[int, bytes]]:
    """The complete capsules at the start of ``buf`` (removed from it); a capsule longer
    than ``max_value`` raises H3_EXCESSIVE_LOAD before it is buffered."""
    return take_tlvs(buf, max_value, "capsule")


def decode_close_capsule(value: bytes) -> tuple[int, str]:
    """(code, message) of a CLOSE_WEBTRANSPORT_SESSION value; H3_MESSAGE_ERROR when it is
    shorter than its code or its message is over 1024 bytes (draft §6)."""
    if len(value) < 4 or len(value) - 4 > MAX_CLOSE_MESSAGE:
        raise H3Error(H3ErrorCode.H3_MESSAGE_ERROR,
                      f"CLOSE_WEBTRANSPORT_SESSION of {len(value)} bytes")
    return int.from_bytes(value[:4], "big"), value[4:].decode("utf-8", "replace")


def stream_prefix(kind: int, session_id: int) -> bytes:
    """The first bytes of a WebTransport stream: the signal (WEBTRANSPORT_STREAM 0x41 on a
    bidirectional stream, stream type 0x54 on a unidirectional one) and the session ID
    (draft-ietf-webtrans-http3 §4.1, §4.2)."""
    return encode_quic_varint(kind) + encode_quic_varint(session_id)


def quarter_stream_id_size(session_id: int) -> int:
    """Bytes of the Quarter Stream ID that prefixes a session's datagrams (RFC 9297 §2.1)."""
    return quic_varint_size(session_id // 4)


# ------------------------------------------------------------------------------------------
# structured fields (RFC 8941): the lists of strings of WT-Available-Protocols / WT-Protocol


def parse_sf_string(text: str) -> str | None:
    """An sf-string (``"moqt-22"``), or None when ``text`` is not one."""
    text = text.strip()
    if len(text) < 2 or text[0] != '"' or text[-1] != '"':
        return None
    out = []
    i = 1
    while i < len(text) - 1:
        c = text[i]
        if c == "\\":
            if i + 1 >= len(text) - 1 or text[i + 1] not in '"\\':
                return None
            out.append(text[i + 1])
            i += 2
            continue
        if c == '"' or not 0x20 <= ord(c) <= 0x7E:
            return None
        out.append(c)
        i += 1
    return "".join(out)


def parse_sf_string_list(text: str) -> list[str] | None:
    """The strings of an sf-list of sf-strings (parameters after ``;`` are dropped); None
    when a member is not an sf-string. Commas inside strings are not supported (MOQT's
    tokens have none)."""
    out = []
    for member in text.split(","):
        value = parse_sf_string(member.split(";", 1)[0])
        if value is None:
            return None
        out.append(value)
    return out


def encode_sf_string(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def encode_sf_string_list(values: Iterable[str]) -> str:
    return ", ".join(encode_sf_string(v) for v in values)


def header_value(headers: Sequence[tuple[bytes, bytes]], name: bytes) -> bytes | None:
    """The value of the first field called ``name`` (lower-case), or None."""
    for key, value in headers:
        if key == name:
            return value
    return None


_REQUEST_PSEUDO = (b":method", b":scheme", b":authority", b":path", b":protocol")


def request_pseudo_headers(headers: list[tuple[bytes, bytes]]) -> dict[bytes, bytes] | None:
    """The pseudo-header fields of a request, or None when it is malformed (RFC 9114
    §4.1.2, §4.3.1; RFC 9220 §3): an unknown or repeated pseudo-header, one after a regular
    field, an upper-case name, or an extended CONNECT without scheme, authority or path."""
    pseudo: dict[bytes, bytes] = {}
    regular = False
    for name, value in headers:
        if name != name.lower() or not name:
            return None
        if name.startswith(b":"):
            if regular or name not in _REQUEST_PSEUDO or name in pseudo:
                return None
            pseudo[name] = value
        else:
            regular = True
    if b":method" not in pseudo:
        return None
    if b":protocol" in pseudo:
        if pseudo[b":method"] != b"CONNECT" or not all(
                pseudo.get(k) for k in (b":scheme", b":authority", b":path")):
            return None
    return pseudo
