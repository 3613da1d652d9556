"""The aioquic backend: :class:`AioquicLibrary` for the shared engine (``library.py``).

aioquic internals read here (checked against aioquic 1.7.2; each in one method, so an upgrade
is checked in one place):

* ``QuicConnection._remote_max_datagram_frame_size`` (read by the engine) — the peer's
  max_datagram_frame_size transport parameter; no public accessor.
* ``QuicConnection._streams[sid].sender._buffer`` — a stream's send buffer: unsent plus
  unacknowledged bytes (freed on ACK), the backpressure metric.
* ``QuicConnection._close_event`` / ``._state`` — a close that has begun (sent or received)
  whose ConnectionTerminated event only comes after the closing period (3 PTO); reading it
  lets the upper layer learn of a peer's CONNECTION_CLOSE at once.
* ``aioquic.quic.congestion.base._factories`` — the congestion-control names it knows.

aioquic resets the send side itself when STOP_SENDING arrives (RFC 9000 §3.5).

aioquic 1.7.2 writes the Length field of every STREAM and CRYPTO frame as a two-octet
variable-length integer (``push_uint16(len | 0x4000)``; RFC 9000 §16 caps that form at
16383), so with packets larger than :data:`MAX_DATAGRAM_SIZE` a frame can carry more data
than its Length says and the peer fails the packet (FRAME_ENCODING_ERROR / "Unknown frame
type"). :meth:`AioquicLibrary.configure` refuses such a ``max_datagram_size``.
"""

from __future__ import annotations

from typing import Any

from aioquic.asyncio.server import QuicServer
from aioquic.quic import events
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.congestion import base as _congestion
from aioquic.quic.connection import QuicConnection, QuicConnectionState
from aioquic.quic.logger import QLOG_VERSION, QuicLoggerTrace
from aioquic.quic.packet_builder import PACKET_NUMBER_SEND_SIZE
from aioquic.tls import load_pem_private_key, load_pem_x509_certificates

from .config import TransportConfig
from .endpoints import EngineBackend
from .library import QuicLibrary

__all__ = ["BACKEND", "LIBRARY", "MAX_DATAGRAM_SIZE", "AioquicLibrary", "connect", "serve"]

#: The largest ``max_datagram_size`` aioquic sends correctly: a short-header packet of 16384
#: octets leaves under 16384 - 1 - 8 - 16 octets for a frame's data, within two-octet Length.
MAX_DATAGRAM_SIZE = 16384


class AioquicLibrary(QuicLibrary):
    name = "aioquic"
    QuicConnection = QuicConnection
    QuicConfiguration = QuicConfiguration
    QuicLoggerTrace = QuicLoggerTrace
    qlog_version = QLOG_VERSION
    QuicServer = QuicServer
    events = events
    load_pem_private_key = staticmethod(load_pem_private_key)
    load_pem_x509_certificates = staticmethod(load_pem_x509_certificates)
    packet_number_size = PACKET_NUMBER_SEND_SIZE

    def configure(self, qc: Any, config: TransportConfig) -> None:
        if config.max_datagram_size > MAX_DATAGRAM_SIZE:
            raise ValueError(
                f"max_datagram_size {config.max_datagram_size} is over what aioquic sends "
                f"correctly ({MAX_DATAGRAM_SIZE}: it writes STREAM frame lengths in two "
                f"octets); use {MAX_DATAGRAM_SIZE} or less, or the qh3 backend")
        algorithm = config.congestion_control_algorithm or "reno"
        if algorithm not in _congestion._factories:
            raise ValueError(f"unknown congestion control algorithm {algorithm!r}; aioquic has"
                             f" {sorted(_congestion._factories)}")
        qc.congestion_control_algorithm = algorithm

    def open_stream(self, quic: Any, unidirectional: bool) -> int:
        stream_id = quic.get_next_available_stream_id(is_unidirectional=unidirectional)
        # Writing nothing creates the stream, so the next call returns another ID.
        quic.send_stream_data(stream_id, b"", end_stream=False)
        return int(stream_id)

    def stream_buffered(self, quic: Any, stream_id: int) -> int:
        stream = quic._streams.get(stream_id)
        if stream is None or stream.sender._reset_error_code is not None:
            return 0
        return len(stream.sender._buffer)

    def unacknowledged(self, quic: Any) -> int:
        return sum(len(s.sender._buffer) for s in list(quic._streams.values())
                   if s.sender._reset_error_code is None)

    def pending_close(self, quic: Any) -> tuple[Any, bool] | None:
        event = quic._close_event
        if event is None:
            return None
        return event, quic._state is not QuicConnectionState.DRAINING

    def has_stream(self, quic: Any, stream_id: int) -> bool:
        return stream_id in quic._streams


LIBRARY = AioquicLibrary()
BACKEND = EngineBackend(LIBRARY)
connect = BACKEND.connect
serve = BACKEND.serve
