"""One WebTransport session as the layer above sees it: :class:`WebTransportSession`, a
:class:`~kvsp_moq.transport.api.Connection`.

MOQT runs on it unchanged (MOQT §"Session establishment": both transports "provide streams
and datagrams with similar semantics"). Its streams are QUIC streams of the HTTP/3 connection
under it, numbered by the QUIC library (RFC 9000 §2.1 IDs, so the stream-ID helpers of
``api.py`` hold); the session prefixes each stream it opens with the WebTransport signal and
its session ID, and each datagram with its Quarter Stream ID (draft-ietf-webtrans-http3 §4,
RFC 9297 §2.1). Error codes of resets and STOP_SENDING are mapped into HTTP/3's WebTransport
range both ways (§4.4). Closing sends CLOSE_WEBTRANSPORT_SESSION (§6) with the code and
reason; what happens on the wire is the endpoint's (``endpoint.py``), which made the session.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Protocol

from ..api import (
    Address,
    CloseInfo,
    Connection,
    ConnectionClosedError,
    ConnectionHandler,
    StreamClosedError,
)
from ..url import MoqtUrl
from .h3 import FrameType, StreamType, quarter_stream_id_size, stream_prefix, wt_code_to_h3
from ...wire.varint import encode_quic_varint

__all__ = ["SessionHost", "WebTransportSession"]

logger = logging.getLogger(__name__)


class SessionHost(Protocol):
    """What a session asks of the HTTP/3 endpoint that made it (``endpoint.H3Endpoint``)."""

    def bind_stream(self, sid: int, session: WebTransportSession, *, local: bool) -> None:
        """``sid`` is one of ``session``'s streams from now on."""

    def send_side_done(self, sid: int) -> None:
        """Our send side of ``sid`` finished (FIN or reset)."""

    def close_session(self, session: WebTransportSession, code: int, reason: str) -> None:
        """Close ``session`` on the wire (CLOSE_WEBTRANSPORT_SESSION)."""


class WebTransportSession(Connection):
    """A WebTransport session on an HTTP/3 connection; ``session_id`` is the ID of its
    CONNECT stream, ``alpn`` the protocol negotiated in WT-Available-Protocols /
    WT-Protocol (the MOQT version, ``moqt-NN``), ``path`` the request's ``:path``."""

    def __init__(self, endpoint: SessionHost, quic: Connection, session_id: int,
                 protocol: str, url: MoqtUrl | None, path: str,
                 internal_error_code: int) -> None:
        self._ep = endpoint
        self._quic = quic
        self.session_id = session_id
        self.path = path
        self._protocol = protocol
        self._url = url
        self._internal_error_code = internal_error_code
        self._handler: ConnectionHandler | None = None
        self._close_info: CloseInfo | None = None
        self._lost_notified = False
        self._terminated: asyncio.Future[CloseInfo] = asyncio.get_running_loop().create_future()
        self._uni_prefix = stream_prefix(StreamType.WEBTRANSPORT, session_id)
        self._bidi_prefix = stream_prefix(FrameType.WEBTRANSPORT_STREAM, session_id)
        self._dgram_prefix = encode_quic_varint(session_id // 4)
        self._dgram_room = quarter_stream_id_size(session_id)

    # -- identity ---------------------------------------------------------------------------
    @property
    def alpn(self) -> str:
        return self._protocol

    @property
    def is_client(self) -> bool:
        return self._quic.is_client

    @property
    def remote_address(self) -> Address:
        return self._quic.remote_address

    @property
    def url(self) -> MoqtUrl | None:
        return self._url

    @property
    def is_webtransport(self) -> bool:
        return True

    @property
    def quic(self) -> Connection:
        """The HTTP/3 connection under the session."""
        return self._quic

    @property
    def backend(self) -> str:
        return f"{getattr(self._quic, 'backend', '?')}+webtransport"

    @property
    def max_datagram_payload(self) -> int:
        return max(0, self._quic.max_datagram_payload - self._dgram_room)

    @property
    def close_info(self) -> CloseInfo | None:
        return self._close_info

    @property
    def handler(self) -> ConnectionHandler | None:
        return self._handler

    @property
    def send_buffer_high_water(self) -> int:
        return self._quic.send_buffer_high_water

    def __repr__(self) -> str:
        state = "closed" if self._close_info else "open"
        return f"<WebTransport session {self.session_id} {self._protocol} {state}>"

    # -- streams ----------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._close_info is not None:
            raise ConnectionClosedError(self._close_info)

    def open_bidi(self) -> int:
        self._check_open()
        sid = self._quic.open_bidi()
        self._quic.send(sid, self._bidi_prefix)
        self._ep.bind_stream(sid, self, local=True)
        return sid

    def open_uni(self) -> int:
        self._check_open()
        sid = self._quic.open_uni()
        self._quic.send(sid, self._uni_prefix)
        self._ep.bind_stream(sid, self, local=True)
        return sid

    def send(self, stream_id: int, data: bytes | bytearray | memoryview,
             end_stream: bool = False) -> None:
        self._check_open()
        self._quic.send(stream_id, data, end_stream)
        if end_stream:
            self._ep.send_side_done(stream_id)

    def reset_stream(self, stream_id: int, error_code: int) -> None:
        self._check_open()
        self._quic.reset_stream(stream_id, wt_code_to_h3(error_code))
        self._ep.send_side_done(stream_id)

    def stop_sending(self, stream_id: int, error_code: int) -> None:
        self._check_open()
        self._quic.stop_sending(stream_id, wt_code_to_h3(error_code))

    # -- backpressure -----------------------------------------------------------------------
    def stream_send_buffered(self, stream_id: int) -> int:
        return self._quic.stream_send_buffered(stream_id)

    async def wait_writable(self, stream_id: int, threshold: int | None = None) -> None:
        self._check_open()
        try:
            await self._quic.wait_writable(stream_id, threshold)
        except (StreamClosedError, ConnectionClosedError):
            self._check_open()  # the session's close resets its streams: say so
            raise

    async def drain(self) -> None:
        self._check_open()
        await self._quic.drain()

    # -- datagrams --------------------------------------------------------------------------
    def send_datagram(self, data: bytes | bytearray | memoryview) -> None:
        self._check_open()
        limit = self.max_datagram_payload
        if len(data) > limit:
            raise ValueError(f"datagram of {len(data)} bytes exceeds max_datagram_payload "
                             f"{limit}")
        self._quic.send_datagram(self._dgram_prefix + bytes(data))

    # -- lifetime ---------------------------------------------------------------------------
    def close(self, error_code: int = 0, reason: str = "") -> None:
        if self._close_info is not None:
            return
        self._ep.close_session(self, error_code, reason)

    async def wait_closed(self) -> CloseInfo:
        return await asyncio.shield(self._terminated)

    async def ping(self) -> None:
        self._check_open()
        await self._quic.ping()

    # -- what the endpoint calls ------------------------------------------------------------
    def start(self, handler: ConnectionHandler) -> None:
        """Endpoint-internal: the session is established; ``handler`` gets its events."""
        self._handler = handler
        self._call("connection_made", self, self._protocol)

    def deliver(self, name: str, *args: Any) -> None:
        """Endpoint-internal: one handler callback (``stream_data``, ``stream_reset``,
        ``stop_sending``, ``datagram_received``) while the session is open."""
        if self._close_info is None and self._handler is not None:
            self._call(name, *args)

    def mark_closed(self, info: CloseInfo, *, notify_soon: bool = False) -> None:
        """Endpoint-internal: the session is closing (``info`` says how): tell the handler,
        on the next loop pass if ``notify_soon`` (a local close, as ``close`` promises)."""
        if self._close_info is not None:
            return
        self._close_info = info
        if self._handler is None:
            return
        if notify_soon:
            asyncio.get_running_loop().call_soon(self._notify_lost)
        else:
            self._notify_lost()

    def ended(self) -> None:
        """Endpoint-internal: nothing of the session is left on the wire."""
        assert self._close_info is not None
        if not self._terminated.done():
            self._terminated.set_result(self._close_info)

    def _notify_lost(self) -> None:
        if self._lost_notified or self._handler is None or self._close_info is None:
            return
        self._lost_notified = True
        try:
            self._handler.connection_lost(self._close_info.error_code, self._close_info.reason)
        except Exception:
            logger.exception("%s.connection_lost raised", type(self._handler).__name__)

    def _call(self, name: str, *args: Any) -> None:
        try:
            getattr(self._handler, name)(*args)
        except Exception as exc:
            logger.exception("%s.%s raised; closing the WebTransport session",
                             type(self._handler).__name__, name)
            self.close(self._internal_error_code,
                       f"internal error in {name}: {type(exc).__name__}")
