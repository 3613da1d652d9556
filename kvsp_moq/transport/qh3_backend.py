"""The qh3 backend: :class:`Qh3Library` for the shared engine (``library.py``).

qh3 (>= 2.1, the Rust-core series; checked against 2.1.0) keeps aioquic's Python API —
``qh3.quic.connection``, ``qh3.quic.configuration``, ``qh3.quic.events``,
``qh3.asyncio.server.QuicServer``, the same event classes and configuration fields — over a
Rust packet core, so the engine drives it unchanged. Where it differs (read in the installed
sources), and what this module does:

* No per-stream send buffer object. ``QuicConnection.get_send_buffer_size(sid)`` counts only
  bytes not yet sent; the core's ``bytes_in_flight`` (connection-wide, ACK-eliciting packets)
  stands for the unacknowledged part. :meth:`Qh3Library.stream_buffered` reports their sum,
  an over-estimate when several streams send at once (backpressure then engages early, never
  late), and drain waits for both to be zero.
* Streams are opened with ``QuicConnection._open_stream`` (the native core allocates IDs).
* ``_close_event`` is set for a close in progress as in aioquic, but ``_state`` does not say
  who began it; the core's ``local_error`` does (set when this endpoint closed or failed).
* No selectable congestion controller (``congestion_control_algorithm`` must stay None).
* Path-MTU discovery (``probe_datagram_size``) is on by default in qh3; it is off here so
  that ``max_datagram_size`` means what it means on aioquic. ``TransportConfig.extra``
  ``{"probe_datagram_size": True}`` turns it on.
* A qh3 client announces max_udp_payload_size 1472, capping what a server sends it;
  :class:`_ClientConnection` announces 65527 instead (see there).
* A client given ``max_datagram_frame_size=None`` still advertises 65536; to turn DATAGRAM
  off (``TransportConfig.datagrams=False``) it is given 0.
* A qh3 server answering an aioquic client's first flight may fail to build a packet
  ("packet builder capacity exhausted", seen during the handshake under the 3x
  anti-amplification limit of RFC 9000 §8.1); the error is logged at debug level and the
  next transmission goes ahead (the handshake completes).
* A client's receive bursts go to ``receive_many_datagrams`` in one call.
* On STOP_SENDING the core is asked to reset the send side with the same code unless it can
  no longer send on it (RFC 9000 §3.5).
"""

from __future__ import annotations

from typing import Any

from qh3._hazmat import Buffer
from qh3.asyncio.server import QuicServer
from qh3.quic import events
from qh3.quic.configuration import QuicConfiguration
from qh3.quic.connection import QuicConnection, QuicConnectionError
from qh3.quic.packet import pull_quic_transport_parameters, push_quic_transport_parameters
from qh3.tls import ExtensionType, load_pem_private_key, load_pem_x509_certificates

from .config import MAX_UDP_PAYLOAD, TransportConfig
from .library import QuicLibrary

__all__ = ["LIBRARY", "Qh3Library", "connect", "serve"]


class _ClientConnection(QuicConnection):
    """qh3's client connection, advertising that it receives UDP payloads of any size.

    A qh3 client announces max_udp_payload_size 1472 (RFC 9000 §18.2), so a server may not
    send it larger packets whatever both ends' ``max_datagram_size``: a subscriber (the
    client) would get its objects in 1472-byte packets. We receive up to 65527 bytes (the
    UDP socket reads 64 KiB), so the parameter is rewritten to that before the ClientHello;
    what each end sends stays bounded by its own ``max_datagram_size``, as on aioquic."""

    def _create_tls(self, remote_source_cid: bytes | None) -> Any:
        bridge = super()._create_tls(remote_source_cid)
        params = pull_quic_transport_parameters(
            Buffer(data=bridge.serialize_transport_parameters()))
        params.max_udp_payload_size = MAX_UDP_PAYLOAD
        buf = Buffer(capacity=4096)
        push_quic_transport_parameters(buf, params)
        bridge.tls.handshake_extensions = [(ExtensionType.QUIC_TRANSPORT_PARAMETERS, buf.data)]
        return bridge


class Qh3Library(QuicLibrary):
    name = "qh3"
    QuicConnection = _ClientConnection  # the engine creates client connections only
    QuicConfiguration = QuicConfiguration
    QuicServer = QuicServer
    events = events
    load_pem_private_key = staticmethod(load_pem_private_key)
    load_pem_x509_certificates = staticmethod(load_pem_x509_certificates)
    stream_errors = (QuicConnectionError, ValueError, RuntimeError, AssertionError)
    transmit_errors = (QuicConnectionError,)

    def configure(self, qc: Any, config: TransportConfig) -> None:
        if config.congestion_control_algorithm is not None:
            raise ValueError(
                f"congestion control algorithm {config.congestion_control_algorithm!r}: qh3 "
                "has one built-in controller that cannot be chosen; leave it None")
        qc.probe_datagram_size = bool(config.extra.get("probe_datagram_size", False))
        if not config.datagrams and qc.is_client:
            # A qh3 client reads None as "advertise 65536"; 0 tells the peer it takes no
            # DATAGRAM frames (RFC 9221 §3), which is how the engine reads it too.
            qc.max_datagram_frame_size = 0

    def open_stream(self, quic: Any, unidirectional: bool) -> int:
        return int(quic._open_stream(is_unidirectional=unidirectional))

    def stream_buffered(self, quic: Any, stream_id: int) -> int:
        unsent = quic.get_send_buffer_size(stream_id)
        core = quic._core
        in_flight = 0 if core is None else core.bytes_in_flight
        return int(unsent + in_flight)

    def unacknowledged(self, quic: Any) -> int:
        core = quic._core
        if core is None or quic._close_event is not None:
            return 0
        return int(quic.get_send_buffer_size(None) + core.bytes_in_flight)

    def pending_close(self, quic: Any) -> tuple[Any, bool] | None:
        event = quic._close_event
        if event is None:
            return None
        core = quic._core
        return event, core is not None and core.local_error is not None

    def receive_many(self, quic: Any, datagrams: list[bytes], addr: Any, now: float) -> None:
        # One call into the Rust core for the burst (it falls back to one by one itself
        # until the handshake is complete).
        quic.receive_many_datagrams(datagrams, addr, now=now)

    def after_stop_sending(self, quic: Any, stream_id: int, error_code: int) -> None:
        if quic._stream_can_send(stream_id):
            quic.reset_stream(stream_id, error_code)


LIBRARY = Qh3Library()
connect = LIBRARY.connect
serve = LIBRARY.serve
