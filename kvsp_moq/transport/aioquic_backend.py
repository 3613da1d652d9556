"""The aioquic backend: :class:`AioquicLibrary` for the shared engine (``library.py``).

aioquic internals read here (checked against aioquic 1.7.2; each in one method, so an upgrade
is checked in one place):

* ``QuicConnection._remote_max_datagram_frame_size`` (read by the engine) — the peer's
  max_datagram_frame_size transport parameter; no public accessor.
* ``QuicConnection._streams[sid].sender._buffer`` — a stream's send buffer: unsent plus
  unacknowledged bytes (freed on ACK), the backpressure metric; on the streams we open it is
  replaced by a :class:`~.stream_buffer.SendBuffer` (the bytearray operations aioquic uses,
  without its copies).
* ``QuicConnection._close_event`` / ``._state`` — a close that has begun (sent or received)
  whose ConnectionTerminated event only comes after the closing period (3 PTO); reading it
  lets the upper layer learn of a peer's CONNECTION_CLOSE at once.
* ``aioquic.quic.congestion.base._factories`` — the congestion-control names it knows.
* ``QuicConnection._loss`` (its ``QuicPacketRecovery``), ``._loss._cc`` and ``._loss._pacer``
  — the controller of a connection, and the pacer that :class:`BbrPacer` replaces for
  ``"bbr"`` (:meth:`AioquicLibrary.prepare_connection`): aioquic's pacer derives its rate
  from cwnd / smoothed RTT, BBR paces at its own estimate (``transport.bbr``).

* ``QuicConnection._local_max_streams_bidi`` — the bidi stream credit we grant the peer (a
  ``Limit``: ``value`` advertised as initial_max_streams_bidi, then raised by one per stream
  that ends; aioquic fixes it at 128, no configuration field): set to
  ``TransportConfig.max_streams_bidi`` before the transport parameters are written
  (:meth:`AioquicLibrary.prepare_connection`).

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
from aioquic.quic.congestion.base import QuicCongestionControl
from aioquic.quic.connection import QuicConnection, QuicConnectionState
from aioquic.quic.logger import QLOG_VERSION, QuicLoggerTrace
from aioquic.quic.packet_builder import PACKET_NUMBER_SEND_SIZE
from aioquic.quic.recovery import QuicPacketPacer
from aioquic.tls import load_pem_private_key, load_pem_x509_certificates

from .bbr import BbrCongestionControl
from .config import TransportConfig
from .endpoints import EngineBackend
from .library import QuicLibrary
from .stream_buffer import SendBuffer

__all__ = ["BACKEND", "DEFAULT_CONGESTION_CONTROL", "LIBRARY", "MAX_DATAGRAM_SIZE", "AioquicBbr",
           "AioquicLibrary", "BbrPacer", "connect", "serve"]

#: The largest ``max_datagram_size`` aioquic sends correctly: a short-header packet of 16384
#: octets leaves under 16384 - 1 - 8 - 16 octets for a frame's data, within two-octet Length.
MAX_DATAGRAM_SIZE = 16384


class AioquicBbr(BbrCongestionControl, QuicCongestionControl):
    """:class:`~.bbr.BbrCongestionControl` as an aioquic controller (registered as ``"bbr"``)."""


_congestion.register_congestion_control("bbr", AioquicBbr)

#: What ``TransportConfig.congestion_control_algorithm`` None means on aioquic: our BBR, which
#: holds its rate through random loss (aioquic's own default, Reno, falls to the Reno bound
#: MSS / RTT x 1.22 / sqrt(p): 0.6 MB/s at 40 ms and 0.5 % loss; docs/transport.md
#: "Congestion control", docs/benchmarks.md "kvsp bench wan").
DEFAULT_CONGESTION_CONTROL = "bbr"


#: The BBR pacer's bucket holds up to this many seconds of sending at the pacing rate (at least
#: aioquic's 16 packets, at most a quarter of cwnd): after the event loop ran late (another
#: task, or the process not scheduled on a loaded machine) the sender catches up with one
#: burst instead of losing the time; the bottleneck's queue absorbs it.
PACING_BURST_S = 0.004


class BbrPacer(QuicPacketPacer):
    """aioquic's token-bucket pacer at BBR's pacing rate instead of cwnd / smoothed RTT, its
    bucket :data:`PACING_BURST_S` deep; aioquic's own pacing until BBR has a rate (its first
    RTT sample)."""

    def __init__(self, cc: BbrCongestionControl, max_datagram_size: int) -> None:
        super().__init__(max_datagram_size=max_datagram_size)
        self._cc = cc
        self._mds = max_datagram_size

    def update_rate(self, congestion_window: int, smoothed_rtt: float) -> None:
        rate = self._cc.pacing_rate
        if rate <= 0:
            super().update_rate(congestion_window, smoothed_rtt)
            return
        mds = self._mds
        self.packet_time = max(1e-6, min(mds / rate, 1.0))
        burst = max(16 * mds, rate * PACING_BURST_S)
        self.bucket_max = max(2 * mds, min(congestion_window // 4, burst)) / rate
        if self.bucket_time > self.bucket_max:
            self.bucket_time = self.bucket_max


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
        algorithm = config.congestion_control_algorithm or DEFAULT_CONGESTION_CONTROL
        if algorithm not in _congestion._factories:
            raise ValueError(f"unknown congestion control algorithm {algorithm!r}; aioquic has"
                             f" {sorted(_congestion._factories)}")
        qc.congestion_control_algorithm = algorithm

    def prepare_connection(self, quic: Any, config: TransportConfig | None = None) -> None:
        loss = quic._loss
        if isinstance(loss._cc, BbrCongestionControl):
            loss._pacer = BbrPacer(loss._cc, quic.configuration.max_datagram_size)
        if config is not None:
            # Before the transport parameters (client: connect; server: the first Initial).
            limit = quic._local_max_streams_bidi
            limit.value = limit.sent = config.max_streams_bidi

    def congestion_state(self, quic: Any) -> dict[str, Any] | None:
        cc = quic._loss._cc
        if isinstance(cc, BbrCongestionControl):
            return cc.snapshot()
        return {"algorithm": quic.configuration.congestion_control_algorithm,
                "congestion_window": cc.congestion_window,
                "bytes_in_flight": cc.bytes_in_flight, "ssthresh": cc.ssthresh}

    def open_stream(self, quic: Any, unidirectional: bool) -> int:
        stream_id = quic.get_next_available_stream_id(is_unidirectional=unidirectional)
        # Writing nothing creates the stream, so the next call returns another ID.
        quic.send_stream_data(stream_id, b"", end_stream=False)
        # Our streams carry the bulk data: a chunked send buffer, each byte copied once on
        # write (aioquic's bytearray recopies its live bytes as it grows; stream_buffer.py).
        quic._streams[stream_id].sender._buffer = SendBuffer()
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
