"""The HTTP/3 side of a QUIC connection carrying WebTransport sessions: :class:`H3Endpoint`.

It is the :class:`~kvsp_moq.transport.api.ConnectionHandler` of a QUIC connection whose ALPN
is ``h3``, on any backend (it speaks only the ``Connection`` interface). It opens the control
stream with our SETTINGS and the two QPACK streams (RFC 9114 §6.2, RFC 9204 §4.2), reads the
peer's, and routes every stream and datagram: a WebTransport stream (bidirectional signal
0x41, unidirectional type 0x54, then the session ID; draft-ietf-webtrans-http3 §4) and a
datagram (Quarter Stream ID, RFC 9297 §2.1) go to their :class:`~.session.WebTransportSession`;
the CONNECT stream carries the request, the response and then capsules (RFC 9297 §3).

A server endpoint answers extended CONNECT requests (RFC 9220) with ``:protocol``
``webtransport``: it picks the protocol from the client's WT-Available-Protocols by its own
order (``TransportConfig.alpn_protocols``, the MOQT versions) and sends it in WT-Protocol,
then hands the session to a handler from its factory. A client endpoint sends the request
(:meth:`H3Endpoint.open_session`) once the server's SETTINGS say it speaks WebTransport.

Hostile input: HTTP/3 connection errors close the connection with their RFC 9114 code (a
frame over the bound is H3_EXCESSIVE_LOAD before it is buffered); a malformed request is a
stream error (H3_MESSAGE_ERROR); streams that name an unknown session are buffered within
``webtransport_max_pending_streams`` / ``webtransport_max_pending_bytes``, beyond which
they are refused with WT_BUFFERED_STREAM_REJECTED; sessions per connection are bounded by
``webtransport_max_sessions`` (a CONNECT over it is answered 429).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

import pylsqpack

from ..api import (
    BaseConnectionHandler,
    CloseInfo,
    ConnectError,
    Connection,
    ConnectionHandler,
    HandlerFactory,
    TransportError,
    is_client_initiated,
    is_locally_initiated,
    is_unidirectional,
)
from ..config import TransportConfig
from ..url import MoqtUrl
from ...wire.errors import BufferUnderflow
from ...wire.varint import encode_quic_varint, read_quic_varint
from .h3 import (
    RESERVED_H2_FRAMES,
    CapsuleType,
    FrameReader,
    FrameType,
    H3Error,
    H3ErrorCode,
    Setting,
    StreamType,
    decode_close_capsule,
    decode_settings,
    encode_close_capsule,
    encode_frame,
    encode_settings,
    encode_sf_string,
    encode_sf_string_list,
    h3_code_to_wt,
    header_value,
    parse_capsules,
    parse_sf_string,
    parse_sf_string_list,
    request_pseudo_headers,
)
from .session import WebTransportSession

__all__ = ["H3Endpoint", "WEBTRANSPORT_PROTOCOLS"]

logger = logging.getLogger(__name__)

#: ``:protocol`` values of a WebTransport CONNECT (drafts 02-07 and later drafts).
WEBTRANSPORT_PROTOCOLS = (b"webtransport", b"webtransport-h3")
_PREFIX_MAX = 16  # two QUIC varints: a stream's signal/type and its session ID
_CAPSULE_MAX = 4 + 1024 + 16  # CLOSE_WEBTRANSPORT_SESSION at its largest, with slack


@dataclass
class _Stream:
    """A peer-opened stream (or our CONNECT stream) until it is a session's."""

    kind: str  # "prefix", "control", "qpack-enc", "qpack-dec", "request", "connect", "wt"
    #            (a session's, about to be bound), "pending" (a WT stream whose session
    #            is not known yet), "ignored"
    buf: bytearray = field(default_factory=bytearray)
    reader: FrameReader | None = None
    session_id: int | None = None
    chunks: list[tuple[bytes, bool]] = field(default_factory=list)
    headers_done: bool = False
    capsules: bytearray = field(default_factory=bytearray)
    finished: bool = False  # the peer ended the CONNECT stream before its session began


class H3Endpoint(BaseConnectionHandler):
    """HTTP/3 with WebTransport on one QUIC connection. A server endpoint makes a session
    handler with ``handler_factory`` for each accepted CONNECT."""

    def __init__(self, config: TransportConfig, *, is_client: bool,
                 handler_factory: HandlerFactory | None = None) -> None:
        self._config = config
        self._is_client = is_client
        self._factory = handler_factory
        self._streams: dict[int, _Stream] = {}
        self._wt: dict[int, WebTransportSession] = {}  # stream -> session (the fast path)
        self._wt_open: dict[int, list[bool]] = {}  # stream -> [send side open, recv open]
        self._sessions: dict[int, WebTransportSession] = {}  # CONNECT stream -> session
        self._peer_settings: dict[int, int] | None = None
        self._settings_ready: asyncio.Future[dict[int, int]] | None = None
        self._responses: dict[int, asyncio.Future[list[tuple[bytes, bytes]]]] = {}
        self._deferred: list[tuple[int, list[tuple[bytes, bytes]]]] = []
        self._pending_bytes = 0
        self._pending_streams = 0
        self._peer_control: int | None = None
        self._encoder = pylsqpack.Encoder()
        self._decoder = pylsqpack.Decoder(0, 0)
        self._closing_tasks: set[asyncio.Task[None]] = set()
        self.dropped_datagrams = 0

    # -- the QUIC connection's callbacks ----------------------------------------------------
    def connection_made(self, conn: Connection, alpn: str) -> None:
        self.conn = conn
        self._settings_ready = asyncio.get_running_loop().create_future()
        max_sessions = self._config.webtransport_max_sessions
        settings: dict[int, int] = {
            Setting.QPACK_MAX_TABLE_CAPACITY: 0,
            Setting.QPACK_BLOCKED_STREAMS: 0,
            Setting.MAX_FIELD_SECTION_SIZE: self._config.h3_max_field_section_size,
            Setting.ENABLE_CONNECT_PROTOCOL: 1,
            Setting.H3_DATAGRAM: 1,
            Setting.H3_DATAGRAM_DRAFT04: 1,
            Setting.ENABLE_WEBTRANSPORT: 1,
            Setting.WEBTRANSPORT_MAX_SESSIONS_DRAFT07: max_sessions,
        }
        control = conn.open_uni()
        conn.send(control, encode_quic_varint(StreamType.CONTROL)
                  + encode_frame(FrameType.SETTINGS, encode_settings(settings)))
        for kind in (StreamType.QPACK_ENCODER, StreamType.QPACK_DECODER):
            conn.send(conn.open_uni(), encode_quic_varint(kind))

    def stream_data(self, stream_id: int, data: bytes | memoryview, end_stream: bool) -> None:
        session = self._wt.get(stream_id)
        if session is not None:  # the fast path: a session's stream
            if end_stream:
                self._recv_side_done(stream_id)
            session.deliver("stream_data", stream_id, data, end_stream)
            return
        try:
            self._stream_data(stream_id, data, end_stream)
        except H3Error as exc:
            self._fail(exc)

    def stream_reset(self, stream_id: int, error_code: int) -> None:
        session = self._wt.get(stream_id)
        if session is not None:
            self._recv_side_done(stream_id)
            if error_code != H3ErrorCode.WT_SESSION_GONE:
                # WT_SESSION_GONE: the peer closed the session; its CLOSE capsule (or the
                # CONNECT stream's end) says how, and may arrive after this reset (§6)
                session.deliver("stream_reset", stream_id, _app_code(error_code))
            return
        st = self._streams.get(stream_id)
        if st is None:
            return
        if st.kind == "connect" or (st.kind == "request" and st.session_id is not None):
            self._session_stream_ended(stream_id, "CONNECT stream reset")
        elif st.kind in ("control", "qpack-enc", "qpack-dec"):
            self._fail(H3Error(H3ErrorCode.H3_CLOSED_CRITICAL_STREAM,
                               f"critical stream {stream_id} reset"))
        else:
            self._drop_pending(stream_id, st)  # a no-op unless it waited for its session
            self._streams.pop(stream_id, None)

    def stop_sending(self, stream_id: int, error_code: int) -> None:
        session = self._wt.get(stream_id)
        if session is not None:
            self.send_side_done(stream_id)
            if error_code != H3ErrorCode.WT_SESSION_GONE:
                session.deliver("stop_sending", stream_id, _app_code(error_code))

    def datagram_received(self, data: bytes | memoryview) -> None:
        try:
            quarter, n = read_quic_varint(data)
        except BufferUnderflow:
            self._fail(H3Error(H3ErrorCode.H3_DATAGRAM_ERROR, "datagram without a Quarter "
                               "Stream ID"))
            return
        session = self._sessions.get(quarter * 4)
        if session is None:  # unknown or not yet established: dropped (RFC 9297 §2.1)
            self.dropped_datagrams += 1
            return
        session.deliver("datagram_received", data[n:])

    def connection_lost(self, error_code: int, reason: str) -> None:
        info = self.conn.close_info if self.conn is not None else None
        info = info or CloseInfo(error_code, reason, application=True, local=False)
        for session in list(self._sessions.values()):
            session.mark_closed(info)
        if self._settings_ready is not None and not self._settings_ready.done():
            self._settings_ready.set_exception(ConnectError(f"connection closed: {info}"))
            self._settings_ready.exception()
        for fut in self._responses.values():
            if not fut.done():
                fut.set_exception(ConnectError(f"connection closed: {info}"))
                fut.exception()
        self._responses.clear()
        if self.conn is not None:
            task = asyncio.ensure_future(self._end_all())
            self._closing_tasks.add(task)
            task.add_done_callback(self._closing_tasks.discard)

    async def _end_all(self) -> None:
        assert self.conn is not None
        await self.conn.wait_closed()
        for session in list(self._sessions.values()):
            session.ended()
        self._sessions.clear()
        self._wt.clear()

    # -- incoming streams -------------------------------------------------------------------
    def _stream_data(self, sid: int, data: bytes | memoryview, end: bool) -> None:
        st = self._streams.get(sid)
        if st is None:
            if is_locally_initiated(sid, self._is_client):
                return  # one of ours, finished and forgotten
            st = self._streams[sid] = _Stream("prefix")
        if st.kind == "prefix":
            st.buf += data
            data = b""
            if not self._parse_prefix(sid, st, end):
                return
            data, st.buf = bytes(st.buf), bytearray()
            if st.kind in ("wt", "pending"):
                self._route_wt(sid, st, data, end)
                return
        kind = st.kind
        if kind == "pending":
            self._buffer_pending(sid, st, bytes(data), end)
        elif kind == "control":
            if end:
                raise H3Error(H3ErrorCode.H3_CLOSED_CRITICAL_STREAM, "control stream closed")
            assert st.reader is not None
            for ftype, payload in st.reader.feed(data):
                self._control_frame(ftype, payload)
        elif kind == "qpack-enc":
            if end:
                raise H3Error(H3ErrorCode.H3_CLOSED_CRITICAL_STREAM, "QPACK stream closed")
            if data:
                try:
                    self._decoder.feed_encoder(bytes(data))
                except pylsqpack.EncoderStreamError:
                    raise H3Error(H3ErrorCode.QPACK_ENCODER_STREAM_ERROR,
                                  "bad QPACK encoder stream") from None
        elif kind == "qpack-dec":
            if end:
                raise H3Error(H3ErrorCode.H3_CLOSED_CRITICAL_STREAM, "QPACK stream closed")
            if data:
                try:
                    self._encoder.feed_decoder(bytes(data))
                except pylsqpack.DecoderStreamError:
                    raise H3Error(H3ErrorCode.QPACK_DECODER_STREAM_ERROR,
                                  "bad QPACK decoder stream") from None
        elif kind in ("request", "connect"):
            self._message_data(sid, st, data, end)
        elif end:  # "ignored": its bytes dropped; forgotten once it ends
            self._streams.pop(sid, None)

    def _parse_prefix(self, sid: int, st: _Stream, end: bool) -> bool:
        """Read the stream's type (and a WebTransport stream's session ID); True once its
        kind is known. Bytes after the prefix stay in ``st.buf``."""
        buf = st.buf
        try:
            first, n1 = read_quic_varint(buf)
            if (is_unidirectional(sid) and first == StreamType.WEBTRANSPORT) or (
                    not is_unidirectional(sid) and first == FrameType.WEBTRANSPORT_STREAM):
                session_id, n2 = read_quic_varint(buf, n1)
                del buf[:n1 + n2]
                self._wt_stream_opened(sid, st, session_id)
                return True
        except BufferUnderflow:
            if end or len(buf) > _PREFIX_MAX:
                self._streams.pop(sid, None)  # ended before its type: nothing to do
                if not end:
                    raise H3Error(H3ErrorCode.H3_FRAME_ERROR, "bad stream prefix") from None
            return False
        if not is_unidirectional(sid):
            if not is_client_initiated(sid) or self._is_client:
                # RFC 9114 §6.1: a server opens no request stream.
                raise H3Error(H3ErrorCode.H3_STREAM_CREATION_ERROR,
                              f"server-opened bidirectional stream {sid} is no WebTransport "
                              f"stream")
            st.kind = "request"
            st.reader = FrameReader(self._config.h3_max_field_section_size)
            return True  # the bytes are the first frame's: keep them in buf
        del buf[:n1]
        if first == StreamType.CONTROL:
            if self._peer_control is not None:
                raise H3Error(H3ErrorCode.H3_STREAM_CREATION_ERROR, "second control stream")
            self._peer_control = sid
            st.kind = "control"
            st.reader = FrameReader(self._config.h3_max_field_section_size)
        elif first == StreamType.QPACK_ENCODER:
            st.kind = "qpack-enc"
        elif first == StreamType.QPACK_DECODER:
            st.kind = "qpack-dec"
        elif first == StreamType.PUSH:
            # We never send MAX_PUSH_ID, so no push ID is valid (RFC 9114 §4.6); a client
            # opening a push stream is H3_STREAM_CREATION_ERROR (§6.2.2).
            raise H3Error(H3ErrorCode.H3_ID_ERROR if self._is_client
                          else H3ErrorCode.H3_STREAM_CREATION_ERROR, "push stream")
        else:  # unknown type: abort reading (RFC 9114 §6.2)
            st.kind = "ignored"
            st.buf = bytearray()
            self._stop(sid, H3ErrorCode.H3_STREAM_CREATION_ERROR)
        return True

    def _stop(self, sid: int, code: int) -> None:
        try:
            assert self.conn is not None
            self.conn.stop_sending(sid, code)
        except (TransportError, ValueError):
            pass

    # -- control stream ---------------------------------------------------------------------
    def _control_frame(self, ftype: int, payload: bytes) -> None:
        if self._peer_settings is None:
            if ftype != FrameType.SETTINGS:
                raise H3Error(H3ErrorCode.H3_MISSING_SETTINGS,
                              f"control stream began with frame 0x{ftype:x}")
            settings = decode_settings(payload)
            if settings.get(Setting.H3_DATAGRAM, 0) > 1:
                raise H3Error(H3ErrorCode.H3_SETTINGS_ERROR, "H3_DATAGRAM is not 0 or 1")
            self._peer_settings = settings
            if self._settings_ready is not None and not self._settings_ready.done():
                self._settings_ready.set_result(settings)
            deferred, self._deferred = self._deferred, []
            for sid, headers in deferred:
                self._handle_request(sid, headers)
            return
        if ftype in (FrameType.SETTINGS, FrameType.DATA, FrameType.HEADERS,
                     FrameType.PUSH_PROMISE, FrameType.WEBTRANSPORT_STREAM) \
                or ftype in RESERVED_H2_FRAMES:
            raise H3Error(H3ErrorCode.H3_FRAME_UNEXPECTED,
                          f"frame 0x{ftype:x} on the control stream")
        if ftype == FrameType.MAX_PUSH_ID and self._is_client:
            raise H3Error(H3ErrorCode.H3_FRAME_UNEXPECTED, "MAX_PUSH_ID from a server")
        # GOAWAY, CANCEL_PUSH, MAX_PUSH_ID and unknown frames: nothing to do for sessions
        # (a GOAWAY ends no established WebTransport session, draft §4.6)

    def peer_speaks_webtransport(self) -> bool:
        """Whether the peer's SETTINGS announce WebTransport in any draft we speak."""
        s = self._peer_settings or {}
        return bool(s.get(Setting.ENABLE_WEBTRANSPORT) == 1
                    or s.get(Setting.WEBTRANSPORT_MAX_SESSIONS_DRAFT07, 0) > 0
                    or s.get(Setting.WT_MAX_SESSIONS, 0) > 0)

    # -- requests and responses -------------------------------------------------------------
    def _message_data(self, sid: int, st: _Stream, data: bytes | memoryview, end: bool) -> None:
        assert st.reader is not None
        for ftype, payload in st.reader.feed(data):
            if ftype in RESERVED_H2_FRAMES or ftype in (
                    FrameType.SETTINGS, FrameType.GOAWAY, FrameType.MAX_PUSH_ID,
                    FrameType.CANCEL_PUSH, FrameType.WEBTRANSPORT_STREAM):
                raise H3Error(H3ErrorCode.H3_FRAME_UNEXPECTED,
                              f"frame 0x{ftype:x} on request stream {sid}")
            if ftype == FrameType.HEADERS:
                if st.headers_done:
                    if st.kind == "request" and st.session_id is None:
                        self._reject_stream(sid, H3ErrorCode.H3_MESSAGE_ERROR)
                        return
                    continue  # trailers of a session's stream: nothing for us
                st.headers_done = True
                headers = self._decode_headers(sid, payload)
                if st.kind == "request":
                    if self._peer_settings is None:
                        if len(self._deferred) >= self._config.webtransport_max_sessions:
                            self._respond(sid, 429)  # more than a session's worth waiting
                            return
                        self._deferred.append((sid, headers))  # §3.1: wait for SETTINGS
                    else:
                        self._handle_request(sid, headers)
                else:
                    fut = self._responses.pop(sid, None)
                    if fut is not None and not fut.done():
                        fut.set_result(headers)
            elif ftype == FrameType.DATA:
                if not st.headers_done:
                    raise H3Error(H3ErrorCode.H3_FRAME_UNEXPECTED, "DATA before HEADERS")
                st.capsules += payload  # held until the session exists (a quick close)
                if st.session_id is not None:
                    self._capsules(sid, st)
                elif len(st.capsules) > _CAPSULE_MAX + 16:
                    raise H3Error(H3ErrorCode.H3_EXCESSIVE_LOAD,
                                  "capsules before the session over their bound")
            elif ftype == FrameType.PUSH_PROMISE:
                raise H3Error(H3ErrorCode.H3_FRAME_UNEXPECTED if not self._is_client
                              else H3ErrorCode.H3_ID_ERROR, "PUSH_PROMISE")
            # unknown frame types are ignored (RFC 9114 §9)
        if end:
            if st.session_id is not None:
                self._session_stream_ended(sid, "")
            elif st.headers_done and st.kind == "connect" and sid not in self._responses:
                st.finished = True  # after the response: the session starts, then ends
            else:
                fut = self._responses.pop(sid, None)
                if fut is not None and not fut.done():
                    fut.set_exception(ConnectError("the server ended the CONNECT stream "
                                                   "without a response"))
                self._streams.pop(sid, None)

    def _decode_headers(self, sid: int, payload: bytes) -> list[tuple[bytes, bytes]]:
        try:
            _, headers = self._decoder.feed_header(sid, payload)
        except (pylsqpack.DecompressionFailed, pylsqpack.StreamBlocked):
            raise H3Error(H3ErrorCode.QPACK_DECOMPRESSION_FAILED,
                          f"undecodable field section on stream {sid}") from None
        return list(headers)

    def _send_headers(self, sid: int, headers: list[tuple[bytes, bytes]],
                      end: bool = False) -> None:
        assert self.conn is not None
        _, block = self._encoder.encode(sid, headers)
        self.conn.send(sid, encode_frame(FrameType.HEADERS, block), end)

    def _respond(self, sid: int, status: int) -> None:
        self._send_headers(sid, [(b":status", str(status).encode())], end=True)
        self._streams.pop(sid, None)
        self._reject_buffered(sid)

    def _reject_stream(self, sid: int, code: int) -> None:
        assert self.conn is not None
        try:
            self.conn.reset_stream(sid, code)
        except (TransportError, ValueError):
            pass
        self._stop(sid, code)
        self._streams.pop(sid, None)
        self._reject_buffered(sid)

    def _handle_request(self, sid: int, headers: list[tuple[bytes, bytes]]) -> None:
        """A client's request: accept it as a WebTransport session or answer it."""
        if sid not in self._streams or self.conn is None or self.conn.is_closed:
            return
        pseudo = request_pseudo_headers(headers)
        if pseudo is None:  # malformed (RFC 9114 §4.1.2): stream error H3_MESSAGE_ERROR
            self._reject_stream(sid, H3ErrorCode.H3_MESSAGE_ERROR)
            return
        if pseudo.get(b":method") != b"CONNECT" or b":protocol" not in pseudo:
            self._respond(sid, 404 if pseudo.get(b":method") != b"CONNECT" else 400)
            return
        if pseudo[b":protocol"] not in WEBTRANSPORT_PROTOCOLS:
            self._respond(sid, 501)
            return
        if sum(1 for s in self._sessions.values() if not s.is_closed) >= \
                self._config.webtransport_max_sessions:
            self._respond(sid, 429)
            return
        ours = [p for p in self._config.alpn_protocols if p != "h3"]
        offer = header_value(headers, b"wt-available-protocols")
        if offer is None:
            protocol, answer = ours[0], None  # a client that offers nothing: our preference
        else:
            offered = parse_sf_string_list(offer.decode("latin-1"))
            common = [p for p in ours if offered is not None and p in offered]
            if not common:
                self._respond(sid, 400)
                return
            protocol, answer = common[0], common[0]
        response = [(b":status", b"200")]
        if answer is not None:
            response.append((b"wt-protocol", encode_sf_string(answer).encode()))
        if header_value(headers, b"sec-webtransport-http3-draft02") is not None:
            response.append((b"sec-webtransport-http3-draft", b"draft02"))
        self._send_headers(sid, response)
        path = pseudo[b":path"].decode("utf-8", "replace")
        session = WebTransportSession(self, self.conn, sid, protocol, None, path,
                                      self._config.internal_error_code)
        st = self._streams[sid]
        st.session_id = sid
        self._sessions[sid] = session
        assert self._factory is not None
        try:
            handler = self._factory()
        except Exception:
            logger.exception("handler factory failed")
            self.close_session(session, self._config.internal_error_code, "no handler")
            return
        self._start(session, handler)

    async def open_session(self, url: MoqtUrl, handler_factory: HandlerFactory
                           ) -> WebTransportSession:
        """Client: send the extended CONNECT for ``url`` once the server's SETTINGS allow
        it, offering ``TransportConfig.alpn_protocols`` in WT-Available-Protocols; return
        the established session (its handler's ``connection_made`` run). Raises
        :class:`~kvsp_moq.transport.api.ConnectError` when the server refuses."""
        assert self.conn is not None and self._settings_ready is not None
        await asyncio.shield(self._settings_ready)
        if not self.peer_speaks_webtransport():
            raise ConnectError(f"{url.host}:{url.port} speaks HTTP/3 without WebTransport "
                               f"(SETTINGS {sorted(hex(k) for k in self._peer_settings or {})})")
        offered = [p for p in self._config.alpn_protocols if p != "h3"]
        sid = self.conn.open_bidi()
        self._streams[sid] = _Stream("connect",
                                     reader=FrameReader(self._config.h3_max_field_section_size))
        fut: asyncio.Future[list[tuple[bytes, bytes]]] = asyncio.get_running_loop().create_future()
        self._responses[sid] = fut
        self._send_headers(sid, [
            (b":method", b"CONNECT"), (b":protocol", b"webtransport"), (b":scheme", b"https"),
            (b":authority", url.authority.encode()),
            (b":path", (url.path_and_query or "/").encode()),
            (b"sec-webtransport-http3-draft02", b"1"),
            (b"wt-available-protocols", encode_sf_string_list(offered).encode()),
        ])
        headers = await asyncio.shield(fut)
        status = header_value(headers, b":status")
        if status is None or not status.startswith(b"2") or len(status) != 3:
            self._reject_stream(sid, H3ErrorCode.H3_REQUEST_CANCELLED)
            raise ConnectError(f"WebTransport CONNECT to {url} answered with status "
                               f"{(status or b'none').decode('latin-1')}")
        chosen = header_value(headers, b"wt-protocol")
        protocol = parse_sf_string(chosen.decode("latin-1")) if chosen is not None else (
            offered[0] if len(offered) == 1 else None)
        if protocol is None or protocol not in offered:
            self._reject_stream(sid, H3ErrorCode.H3_REQUEST_CANCELLED)
            raise ConnectError(f"WebTransport server chose protocol {chosen!r}, not one of "
                               f"{offered}")
        session = WebTransportSession(self, self.conn, sid, protocol, url,
                                      url.path_and_query, self._config.internal_error_code)
        self._streams[sid].session_id = sid
        self._sessions[sid] = session
        self._start(session, handler_factory())
        return session

    def _start(self, session: WebTransportSession, handler: ConnectionHandler) -> None:
        session.start(handler)
        for sid, st in list(self._streams.items()):
            if st.kind == "pending" and st.session_id == session.session_id:
                self._bind_pending(sid, st, session)
        connect = self._streams.get(session.session_id)
        if connect is None:
            return
        try:  # what came on the CONNECT stream before the session existed
            if connect.capsules:
                self._capsules(session.session_id, connect)
            if connect.finished:
                self._session_stream_ended(session.session_id, "")
        except H3Error as exc:
            self._fail(exc)

    # -- WebTransport streams ---------------------------------------------------------------
    def _wt_stream_opened(self, sid: int, st: _Stream, session_id: int) -> None:
        st.session_id = session_id
        session = self._sessions.get(session_id)
        st.kind = "wt" if session is not None else "pending"
        if session is None:
            if not self._may_be_session(session_id):
                raise H3Error(H3ErrorCode.H3_ID_ERROR,
                              f"stream {sid} names session {session_id}, not a client "
                              f"bidirectional stream")
            if self._pending_streams >= self._config.webtransport_max_pending_streams:
                self._refuse_buffered(sid)
                st.kind = "ignored"
                return
            self._pending_streams += 1

    def _may_be_session(self, session_id: int) -> bool:
        return is_client_initiated(session_id) and not is_unidirectional(session_id)

    def _route_wt(self, sid: int, st: _Stream, data: bytes, end: bool) -> None:
        session = self._sessions.get(st.session_id if st.session_id is not None else -1)
        if st.kind == "wt" and session is not None:
            self._streams.pop(sid, None)
            if session.is_closed:
                self._refuse_gone(sid)
                return
            self.bind_stream(sid, session, local=False)
            if end:
                self._recv_side_done(sid)
            if data or end:  # the prefix alone: the session learns of it with its bytes
                session.deliver("stream_data", sid, data, end)
        elif st.kind == "pending":
            self._buffer_pending(sid, st, data, end)

    def _buffer_pending(self, sid: int, st: _Stream, data: bytes, end: bool) -> None:
        if self._pending_bytes + len(data) > self._config.webtransport_max_pending_bytes:
            self._drop_pending(sid, st)
            self._refuse_buffered(sid)
            return
        self._pending_bytes += len(data)
        st.chunks.append((data, end))

    def _drop_pending(self, sid: int, st: _Stream) -> None:
        if st.kind == "pending":
            self._pending_streams -= 1
            self._pending_bytes -= sum(len(d) for d, _ in st.chunks)
        st.chunks = []
        st.kind = "ignored"

    def _bind_pending(self, sid: int, st: _Stream, session: WebTransportSession) -> None:
        chunks = st.chunks
        self._drop_pending(sid, st)
        self._streams.pop(sid, None)
        self.bind_stream(sid, session, local=False)
        for data, end in chunks:
            if end:
                self._recv_side_done(sid)
            if data or end:
                session.deliver("stream_data", sid, data, end)

    def _reject_buffered(self, session_id: int) -> None:
        """The request on ``session_id`` is no session: refuse the streams waiting for it."""
        for sid, st in list(self._streams.items()):
            if st.kind == "pending" and st.session_id == session_id:
                self._drop_pending(sid, st)
                self._refuse_buffered(sid)

    def _refuse_buffered(self, sid: int) -> None:
        self._refuse(sid, H3ErrorCode.WT_BUFFERED_STREAM_REJECTED)

    def _refuse_gone(self, sid: int) -> None:
        self._refuse(sid, H3ErrorCode.WT_SESSION_GONE)

    def _refuse(self, sid: int, code: int) -> None:
        assert self.conn is not None
        self._stop(sid, code)
        if not is_unidirectional(sid):
            try:
                self.conn.reset_stream(sid, code)
            except (TransportError, ValueError):
                pass

    def bind_stream(self, sid: int, session: WebTransportSession, *, local: bool) -> None:
        """Session-internal: ``sid`` is one of ``session``'s streams from now on."""
        self._wt[sid] = session
        uni = is_unidirectional(sid)
        # [our send side open, the peer's send side open]
        self._wt_open[sid] = [local or not uni, not (uni and local)]

    def send_side_done(self, sid: int) -> None:
        """Session-internal: our send side of ``sid`` finished (FIN, reset, stopped)."""
        sides = self._wt_open.get(sid)
        if sides is not None:
            sides[0] = False
            if not sides[1]:
                self._forget(sid)

    def _recv_side_done(self, sid: int) -> None:
        sides = self._wt_open.get(sid)
        if sides is not None:
            sides[1] = False
            if not sides[0]:
                self._forget(sid)

    def _forget(self, sid: int) -> None:
        # The event being delivered still reaches the session: it was looked up already.
        self._wt_open.pop(sid, None)
        self._wt.pop(sid, None)

    # -- capsules and closing ---------------------------------------------------------------
    def _capsules(self, sid: int, st: _Stream) -> None:
        for ctype, value in parse_capsules(st.capsules, _CAPSULE_MAX):
            session = self._sessions.get(sid)
            if ctype == CapsuleType.CLOSE_WEBTRANSPORT_SESSION and session is not None:
                code, message = decode_close_capsule(value)
                self._session_closed_by_peer(session, code, message)
            # DRAIN_WEBTRANSPORT_SESSION: MOQT has its own GOAWAY; others are ignored
            # (RFC 9297 §3.2)
        if len(st.capsules) > _CAPSULE_MAX + 16:
            raise H3Error(H3ErrorCode.H3_EXCESSIVE_LOAD, "capsule buffer over its bound")

    def _session_stream_ended(self, sid: int, reason: str) -> None:
        """The peer finished (or reset) the CONNECT stream: the session is closed with code
        0 when no CLOSE_WEBTRANSPORT_SESSION came first (draft §6)."""
        session = self._sessions.get(sid)
        if session is not None and not session.is_closed:
            self._session_closed_by_peer(session, 0, reason)

    def _session_closed_by_peer(self, session: WebTransportSession, code: int,
                                message: str) -> None:
        if session.is_closed:
            return
        self._end_streams(session)
        try:
            assert self.conn is not None
            self.conn.send(session.session_id, b"", end_stream=True)
        except (TransportError, ValueError):
            pass
        session.mark_closed(CloseInfo(code, message, application=True, local=False))
        self._after_close(session)

    def close_session(self, session: WebTransportSession, code: int, reason: str) -> None:
        """Session-internal: close ``session`` with CLOSE_WEBTRANSPORT_SESSION (draft §6)."""
        if session.is_closed:
            return
        assert self.conn is not None
        raw = reason.encode("utf-8")[:1024].decode("utf-8", "ignore")
        try:
            self.conn.send(session.session_id,
                           encode_frame(FrameType.DATA, encode_close_capsule(code, raw)),
                           end_stream=True)
        except (TransportError, ValueError):
            pass
        self._end_streams(session)
        session.mark_closed(CloseInfo(code, raw, application=True, local=True),
                            notify_soon=True)
        self._after_close(session)

    def _end_streams(self, session: WebTransportSession) -> None:
        """Draft §6: reset and stop every stream of a closed session (WT_SESSION_GONE)."""
        for sid, owner in list(self._wt.items()):
            if owner is session:
                self._refuse_gone(sid)
                if is_unidirectional(sid) and is_locally_initiated(sid, self._is_client):
                    try:
                        assert self.conn is not None
                        self.conn.reset_stream(sid, H3ErrorCode.WT_SESSION_GONE)
                    except (TransportError, ValueError):
                        pass
                self._forget(sid)
        self._reject_buffered(session.session_id)

    def _after_close(self, session: WebTransportSession) -> None:
        """A session closed: with no other session left, close the QUIC connection once
        the CONNECT stream's bytes are acknowledged (within ``webtransport_close_timeout``);
        else the session is over at once."""
        if any(not s.is_closed for s in self._sessions.values()) or self.conn is None:
            self._sessions.pop(session.session_id, None)
            self._streams.pop(session.session_id, None)
            session.ended()
            return
        task = asyncio.ensure_future(self._linger_and_close(session.session_id))
        self._closing_tasks.add(task)
        task.add_done_callback(self._closing_tasks.discard)

    async def _linger_and_close(self, connect_sid: int) -> None:
        conn = self.conn
        assert conn is not None
        try:
            await asyncio.wait_for(conn.wait_writable(connect_sid, 0),
                                   self._config.webtransport_close_timeout)
        except (asyncio.TimeoutError, TransportError):
            pass
        conn.close(H3ErrorCode.H3_NO_ERROR, "WebTransport session closed")

    def _fail(self, exc: H3Error) -> None:
        logger.info("HTTP/3 connection error: %s", exc)
        if self.conn is not None and not self.conn.is_closed:
            self.conn.close(exc.code, exc.reason)


def _app_code(h3_code: int) -> int:
    """The WebTransport application code of a reset / STOP_SENDING (draft §4.4); a code
    outside the WebTransport range is passed on as it is."""
    code = h3_code_to_wt(h3_code)
    return h3_code if code is None else code
