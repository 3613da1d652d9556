"""Hostile HTTP/3 / WebTransport input against our server (``TransportConfig.webtransport``):
a real QUIC client with ALPN ``h3`` writes malformed framing and must get the RFC 9114 /
draft-ietf-webtrans-http3 error the spec names (a connection close, a stream reset, a refused
stream, a status), never a crash or a hang; the bounds (sessions per connection, streams
waiting for a session, frame sizes) hold; and after every attack the server still serves a
real MOQT session over WebTransport. Plus the framing helpers on their own: the WebTransport
error-code mapping, structured-field lists, SETTINGS and the bounded frame reader.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator

import pylsqpack
import pytest

from kvsp_moq.moqt.messages import Setup
from kvsp_moq.moqt.session import SessionConfig
from kvsp_moq.moqt.session.setup import build_setup, check_peer_setup
from kvsp_moq.moqt.version import Version
from kvsp_moq.pubsub import connect, serve
from kvsp_moq.wire.errors import SessionErrorCode, WireError
from kvsp_moq.pubsub.endpoints import MoqtServer
from kvsp_moq.transport import (
    BaseConnectionHandler,
    Connection,
    ConnectionClosedError,
    TransportConfig,
)
from kvsp_moq.transport import connect as transport_connect
from kvsp_moq.transport.tls import make_self_signed
from kvsp_moq.transport.webtransport.h3 import (
    WT_APPLICATION_ERROR_FIRST,
    FrameReader,
    FrameType,
    H3Error,
    H3ErrorCode,
    Setting,
    StreamType,
    decode_settings,
    encode_frame,
    encode_settings,
    encode_sf_string_list,
    h3_code_to_wt,
    parse_sf_string_list,
    wt_code_to_h3,
)
from kvsp_moq.wire.varint import encode_quic_varint as v

GUARD = 20.0
_CERT = make_self_signed()
MAX_SESSIONS, MAX_PENDING = 2, 2
CODES = {int(c) for c in H3ErrorCode}


async def within(aw, timeout: float = GUARD):
    return await asyncio.wait_for(aw, timeout)


class RawH3(BaseConnectionHandler):
    """A client that speaks HTTP/3 by hand: it records what the server sends back."""

    def __init__(self) -> None:
        self.data: dict[int, bytearray] = {}
        self.resets: asyncio.Queue[tuple[int, int]] = asyncio.Queue()
        self.stops: asyncio.Queue[tuple[int, int]] = asyncio.Queue()
        self.ended: set[int] = set()
        self.changed: dict[int, asyncio.Event] = {}
        self.encoder = pylsqpack.Encoder()

    def stream_data(self, stream_id: int, data, end_stream: bool) -> None:
        self.data.setdefault(stream_id, bytearray()).extend(data)
        if end_stream:
            self.ended.add(stream_id)
        self.changed.setdefault(stream_id, asyncio.Event()).set()

    def stream_reset(self, stream_id: int, error_code: int) -> None:
        self.resets.put_nowait((stream_id, error_code))

    def stop_sending(self, stream_id: int, error_code: int) -> None:
        self.stops.put_nowait((stream_id, error_code))

    # -- what a well-behaved client sends first ----------------------------------------------
    def settings(self, conn: Connection, **extra: int) -> int:
        sid = conn.open_uni()
        settings = {Setting.ENABLE_CONNECT_PROTOCOL: 1, Setting.H3_DATAGRAM: 1,
                    Setting.ENABLE_WEBTRANSPORT: 1, **{int(k, 16): x for k, x in extra.items()}}
        conn.send(sid, v(StreamType.CONTROL) + encode_frame(FrameType.SETTINGS,
                                                            encode_settings(settings)))
        return sid

    def headers(self, sid: int, fields: list[tuple[bytes, bytes]]) -> bytes:
        return encode_frame(FrameType.HEADERS, self.encoder.encode(sid, fields)[1])

    def connect_request(self, conn: Connection, path: bytes = b"/moq",
                        drop: bytes = b"") -> int:
        sid = conn.open_bidi()
        fields = [(b":method", b"CONNECT"), (b":protocol", b"webtransport"),
                  (b":scheme", b"https"), (b":authority", b"127.0.0.1"), (b":path", path),
                  (b"wt-available-protocols", encode_sf_string_list(["moqt-22"]).encode())]
        conn.send(sid, self.headers(sid, [f for f in fields if f[0] != drop]))
        return sid

    async def status(self, sid: int) -> bytes:
        """The :status of the response on ``sid`` (waits for its HEADERS frame)."""
        decoder = pylsqpack.Decoder(0, 0)
        changed = self.changed.setdefault(sid, asyncio.Event())
        while True:
            changed.clear()
            for ftype, payload in FrameReader(1 << 16).feed(bytes(self.data.get(sid, b""))):
                if ftype == FrameType.HEADERS:
                    return dict(decoder.feed_header(sid, payload)[1])[b":status"]
            if sid in self.ended:
                raise AssertionError(f"stream {sid} ended without HEADERS")
            await changed.wait()  # set by stream_data; bounded by the caller's within()


@pytest.fixture
async def server() -> AsyncIterator[MoqtServer]:
    srv = await serve("127.0.0.1", 0, TransportConfig(
        certificate_pem=_CERT.cert_pem, private_key_pem=_CERT.key_pem, webtransport=True,
        webtransport_max_sessions=MAX_SESSIONS, webtransport_max_pending_streams=MAX_PENDING,
        h3_max_field_section_size=4096))
    try:
        yield srv
        # after whatever the test did, a real MOQT session over WebTransport still works
        session = await within(connect(f"https://127.0.0.1:{srv.port}/moq",
                                       TransportConfig(insecure=True)))
        await within(session.close())
    finally:
        srv.close()
        await within(srv.wait_closed())


async def raw_h3(server: MoqtServer) -> tuple[Connection, RawH3]:
    handler = RawH3()
    conn = await within(transport_connect(f"moqt://127.0.0.1:{server.port}/", lambda: handler,
                                          TransportConfig(insecure=True,
                                                          alpn_protocols=("h3",))))
    assert conn.alpn == "h3"
    return conn, handler


async def closed_with(conn: Connection) -> int:
    info = await within(conn.wait_closed())
    assert not info.local, info
    return info.error_code


# ------------------------------------------------------------------------------------------
# connection errors


@pytest.mark.parametrize("name, control_bytes, code", [
    ("frame before SETTINGS", encode_frame(FrameType.GOAWAY, v(0)),
     H3ErrorCode.H3_MISSING_SETTINGS),
    ("second SETTINGS", encode_frame(FrameType.SETTINGS, b"") * 2,
     H3ErrorCode.H3_FRAME_UNEXPECTED),
    ("DATA on the control stream", encode_frame(FrameType.SETTINGS, b"")
     + encode_frame(FrameType.DATA, b"x"), H3ErrorCode.H3_FRAME_UNEXPECTED),
    ("HTTP/2 frame type", encode_frame(FrameType.SETTINGS, b"") + encode_frame(0x6, b""),
     H3ErrorCode.H3_FRAME_UNEXPECTED),
    ("HTTP/2 setting", encode_frame(FrameType.SETTINGS, v(0x2) + v(1)),
     H3ErrorCode.H3_SETTINGS_ERROR),
    ("repeated setting", encode_frame(FrameType.SETTINGS, v(0x6) + v(1) + v(0x6) + v(2)),
     H3ErrorCode.H3_SETTINGS_ERROR),
    ("truncated setting", encode_frame(FrameType.SETTINGS, v(0x6)), H3ErrorCode.H3_FRAME_ERROR),
    # a declared length far over the bound: refused before a byte of it is buffered
    ("oversized frame", v(FrameType.SETTINGS) + v(1 << 40), H3ErrorCode.H3_EXCESSIVE_LOAD),
])
async def test_control_stream_errors_close_the_connection(server: MoqtServer, name: str,
                                                          control_bytes: bytes,
                                                          code: int) -> None:
    conn, _ = await raw_h3(server)
    conn.send(conn.open_uni(), v(StreamType.CONTROL) + control_bytes)
    assert await closed_with(conn) == code, name


async def test_critical_streams_and_push(server: MoqtServer) -> None:
    conn, h = await raw_h3(server)
    h.settings(conn)
    h.settings(conn)  # a second control stream
    assert await closed_with(conn) == H3ErrorCode.H3_STREAM_CREATION_ERROR
    conn, h = await raw_h3(server)
    conn.send(h.settings(conn), b"", end_stream=True)  # the control stream closed
    assert await closed_with(conn) == H3ErrorCode.H3_CLOSED_CRITICAL_STREAM
    conn, h = await raw_h3(server)
    conn.send(conn.open_uni(), v(StreamType.PUSH) + v(0))  # a client may not push
    assert await closed_with(conn) == H3ErrorCode.H3_STREAM_CREATION_ERROR


async def test_undecodable_field_section(server: MoqtServer) -> None:
    conn, h = await raw_h3(server)
    h.settings(conn)
    sid = conn.open_bidi()
    conn.send(sid, encode_frame(FrameType.HEADERS, b"\xff\xff\xff\xff\xff"))
    assert await closed_with(conn) == H3ErrorCode.QPACK_DECOMPRESSION_FAILED


async def test_bad_datagram_and_frames_on_a_request_stream(server: MoqtServer) -> None:
    conn, h = await raw_h3(server)
    h.settings(conn)
    conn.send_datagram(b"")  # no Quarter Stream ID
    assert await closed_with(conn) == H3ErrorCode.H3_DATAGRAM_ERROR
    conn, h = await raw_h3(server)
    h.settings(conn)
    sid = conn.open_bidi()
    conn.send(sid, encode_frame(FrameType.DATA, b"body before headers"))
    assert await closed_with(conn) == H3ErrorCode.H3_FRAME_UNEXPECTED
    conn, h = await raw_h3(server)
    h.settings(conn)
    sid = h.connect_request(conn)
    assert await within(h.status(sid)) == b"200"
    conn.send(sid, encode_frame(FrameType.DATA, v(0x2843) + v(2) + b"\x00\x00"))  # short CLOSE
    assert await closed_with(conn) == H3ErrorCode.H3_MESSAGE_ERROR


# ------------------------------------------------------------------------------------------
# stream errors and refusals


async def test_malformed_and_refused_requests(server: MoqtServer) -> None:
    conn, h = await raw_h3(server)
    h.settings(conn)
    sid = h.connect_request(conn, drop=b":path")  # extended CONNECT without :path
    assert await within(h.resets.get()) == (sid, H3ErrorCode.H3_MESSAGE_ERROR)
    sid = conn.open_bidi()
    conn.send(sid, h.headers(sid, [(b":method", b"GET"), (b":scheme", b"https"),
                                   (b":authority", b"x"), (b":path", b"/")]), end_stream=True)
    assert await within(h.status(sid)) == b"404"  # we serve WebTransport only
    sid = conn.open_bidi()
    conn.send(sid, h.headers(sid, [(b":method", b"CONNECT"), (b":protocol", b"websocket"),
                                   (b":scheme", b"https"), (b":authority", b"x"),
                                   (b":path", b"/")]))
    assert await within(h.status(sid)) == b"501"
    sid = conn.open_bidi()
    conn.send(sid, h.headers(sid, [
        (b":method", b"CONNECT"), (b":protocol", b"webtransport"), (b":scheme", b"https"),
        (b":authority", b"x"), (b":path", b"/"),
        (b"wt-available-protocols", b'"moqt-99"')]))
    assert await within(h.status(sid)) == b"400"  # no MOQT version in common
    # sessions per connection: MAX_SESSIONS accepted, the next answered 429
    accepted = [h.connect_request(conn) for _ in range(MAX_SESSIONS)]
    assert [await within(h.status(s)) for s in accepted] == [b"200"] * MAX_SESSIONS
    extra = h.connect_request(conn)
    assert await within(h.status(extra)) == b"429"
    assert not conn.is_closed


async def test_request_waits_for_the_clients_settings(server: MoqtServer) -> None:
    conn, h = await raw_h3(server)
    # before our SETTINGS: held (draft §3.1), as many as the session bound, then answered
    held = [h.connect_request(conn) for _ in range(MAX_SESSIONS)]
    extra = h.connect_request(conn)
    assert await within(h.status(extra)) == b"429"
    h.settings(conn)
    assert [await within(h.status(sid)) for sid in held] == [b"200"] * MAX_SESSIONS


async def test_unknown_stream_types_are_stopped(server: MoqtServer) -> None:
    conn, h = await raw_h3(server)
    h.settings(conn)
    sid = conn.open_uni()
    conn.send(sid, v(0x21) + b"a reserved stream type")  # RFC 9114 §6.2.3: ignored
    assert await within(h.stops.get()) == (sid, H3ErrorCode.H3_STREAM_CREATION_ERROR)
    assert not conn.is_closed


async def test_streams_for_unknown_sessions_are_bounded(server: MoqtServer) -> None:
    conn, h = await raw_h3(server)
    h.settings(conn)
    # WebTransport streams naming session 400 (a client bidi ID never opened): MAX_PENDING
    # are held for it, the next ones are refused with WT_BUFFERED_STREAM_REJECTED.
    uni = [conn.open_uni() for _ in range(MAX_PENDING + 2)]
    for sid in uni:
        conn.send(sid, v(StreamType.WEBTRANSPORT) + v(400) + b"early bytes")
    refused = {await within(h.stops.get()) for _ in range(2)}
    assert refused == {(sid, H3ErrorCode.WT_BUFFERED_STREAM_REJECTED) for sid in uni[-2:]}
    # a stream naming a server-initiated ID as its session is an H3_ID_ERROR
    conn.send(conn.open_uni(), v(StreamType.WEBTRANSPORT) + v(1) + b"x")
    assert await closed_with(conn) == H3ErrorCode.H3_ID_ERROR


async def test_random_bytes_never_crash_the_server(server: MoqtServer) -> None:
    rng = random.Random(20)
    for _ in range(16):
        conn, h = await raw_h3(server)
        h.settings(conn)
        junk = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 300)))
        if rng.random() < 0.5:
            conn.send(conn.open_bidi(), junk, end_stream=rng.random() < 0.5)
        else:
            conn.send(conn.open_uni(), junk, end_stream=rng.random() < 0.5)
        try:
            await within(conn.ping())  # the server answered after handling the junk...
        except ConnectionClosedError:
            pass
        info = conn.close_info  # ...or closed the connection with an HTTP/3 error
        assert info is None or (not info.local and info.error_code in CODES), info
        await within(conn.aclose())


# ------------------------------------------------------------------------------------------
# framing helpers


def test_wt_error_code_mapping() -> None:
    assert wt_code_to_h3(0) == WT_APPLICATION_ERROR_FIRST
    assert wt_code_to_h3(0x1D) == WT_APPLICATION_ERROR_FIRST + 0x1D
    assert wt_code_to_h3(0x1E) == WT_APPLICATION_ERROR_FIRST + 0x1F  # skips a GREASE point
    for code in (0, 1, 0x1D, 0x1E, 0x1F, 0x3C, 12345, 0xFFFFFFFF):
        assert h3_code_to_wt(wt_code_to_h3(code)) == code
    assert h3_code_to_wt(0x100) is None
    assert h3_code_to_wt(WT_APPLICATION_ERROR_FIRST + 0x1E) is None  # a reserved codepoint


def test_sf_lists_and_settings() -> None:
    assert parse_sf_string_list('"moqt-22", "moqt-20";q=1') == ["moqt-22", "moqt-20"]
    assert parse_sf_string_list('moqt-22') is None
    assert parse_sf_string_list(encode_sf_string_list(['a"b', "c\\d"])) == ['a"b', "c\\d"]
    assert decode_settings(encode_settings({0x33: 1, 0x2B603742: 1})) == {0x33: 1,
                                                                          0x2B603742: 1}


def test_frame_reader_is_bounded_and_incremental() -> None:
    reader = FrameReader(16)
    frame = encode_frame(FrameType.HEADERS, b"0123456789")
    got = []
    for i in range(len(frame)):  # one byte at a time
        got += reader.feed(frame[i:i + 1])
    assert got == [(FrameType.HEADERS, b"0123456789")] and reader.pending == 0
    with pytest.raises(H3Error) as info:
        FrameReader(16).feed(v(FrameType.DATA) + v(17))
    assert info.value.code == H3ErrorCode.H3_EXCESSIVE_LOAD


def test_no_path_or_authority_over_webtransport() -> None:
    """MOQT §"PATH", §"AUTHORITY": not sent over WebTransport; received there, the session
    is closed with INVALID_PATH / INVALID_AUTHORITY (the drivers set ``webtransport`` from
    ``Connection.is_webtransport``)."""
    wt = SessionConfig(path="/moq", authority="h:1", webtransport=True)
    ours = build_setup(wt, Version.from_alpn("moqt-22"), is_client=True)
    assert ours.path is None and ours.authority is None
    for peer, code in ((Setup(path="/moq"), SessionErrorCode.INVALID_PATH),
                       (Setup(authority="h:1"), SessionErrorCode.INVALID_AUTHORITY)):
        with pytest.raises(WireError) as info:
            check_peer_setup(peer, SessionConfig(webtransport=True), is_client=False)
        assert info.value.code == code
    check_peer_setup(Setup(path="/moq"), SessionConfig(), is_client=False)  # native QUIC
