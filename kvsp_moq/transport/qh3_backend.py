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
* A fixed stream credit: qh3 grants a peer 100 bidirectional and 103 unidirectional streams
  (literals in ``QuicConnection._create_core``, passed to the Rust core, and in its transport
  parameters; no configuration field, no core setter), so ``max_streams_bidi`` is not applied:
  a qh3 endpoint holds at most 100 of a peer's MOQT requests open at once.
* Path-MTU discovery (``probe_datagram_size``) is on by default in qh3; it is off here so
  that ``max_datagram_size`` means what it means on aioquic. ``TransportConfig.extra``
  ``{"probe_datagram_size": True}`` turns it on.
* A qh3 client announces max_udp_payload_size 1472, capping what a server sends it;
  :class:`_ClientConnection` announces 65527 instead (see there).
* A client given ``max_datagram_frame_size=None`` still advertises 65536; to turn DATAGRAM
  off (``TransportConfig.datagrams=False``) it is given 0.
* Two qh3 faults (2.1.0) made a qh3 *server* slow or stuck with aioquic clients; both are
  worked around here (docs/transport.md, "qh3 server and aioquic clients"):

  - Anti-amplification credit (RFC 9000 §8.1). qh3's Python layer feeds a datagram to the
    core one packet at a time, and the core credits only the bytes of each slice it
    authenticates, so bytes after the last packet are never counted. aioquic (1.x) pads a
    client's Initial datagram to 1200 bytes with zero bytes *after* the packet (a ~530-byte
    Initial + ~670 bytes of padding), so the server may send 3 x 530 instead of 3 x 1200
    bytes: its padded 1200-byte Initial leaves no room for the certificate, and the core
    fails every ``poll_transmit`` ("packet builder capacity exhausted") until the client's
    PTO. :class:`_ServerConnection` hands trailing zero padding to the core with the packet
    before it, so the whole datagram is credited.
  - Lost datagrams. ``datagrams_to_send`` calls the core until it has nothing more; when a
    call fails, the datagrams already built in that round (which the core counts as sent)
    were dropped with the exception — here the server's ServerHello, so the handshake only
    went on after retransmission timers (~0.2-1.4 s, sometimes past a 10 s timeout).
    :class:`_Qh3Connection.datagrams_to_send` returns what was built and leaves the error
    to the next call.

  A qh3 server's connections are made by qh3's ``QuicServer``, which names qh3's own
  class; :class:`_Server` turns each into a :class:`_ServerConnection` before its first
  datagram.
* A client's receive bursts go to ``receive_many_datagrams`` in one call.
* On STOP_SENDING the core is asked to reset the send side with the same code unless it can
  no longer send on it (RFC 9000 §3.5).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from qh3._hazmat import Buffer
from qh3.asyncio.server import QuicServer
from qh3.quic import events
from qh3.quic.configuration import QuicConfiguration
from qh3.quic.connection import QuicConnection, QuicConnectionError
from qh3.quic.logger import QLOG_VERSION, QuicLoggerTrace
from qh3.quic.packet import pull_quic_transport_parameters, push_quic_transport_parameters
from qh3.tls import ExtensionType, load_pem_private_key, load_pem_x509_certificates

from .config import MAX_UDP_PAYLOAD, TransportConfig
from .endpoints import EngineBackend
from .library import QuicLibrary

__all__ = ["BACKEND", "LIBRARY", "Qh3Library", "connect", "serve"]


logger = logging.getLogger(__name__)


class _Qh3Connection(QuicConnection):
    """qh3's connection, keeping the datagrams a failed transmission round already built."""

    def datagrams_to_send(self, now: float) -> list[tuple[bytes, Any]]:
        # qh3's own loop, except that an error of the core after some datagrams were built
        # returns those (the core has counted them as sent: dropping them loses packets,
        # here a server's first flight) and leaves the error to the next call.
        core = self._core
        if core is None:
            return []
        datagrams: list[tuple[bytes, Any]] = []
        while True:
            try:
                transmit = self._call_core(core.poll_transmit, now)
            except QuicConnectionError as exc:
                if not datagrams:
                    raise
                logger.debug("qh3 transmission stopped after %d datagrams: %s",
                             len(datagrams), exc)
                break
            if transmit is None:
                break
            self._log_datagram("datagrams_sent", transmit[0])
            self._log_packets("packet_sent", transmit[0])
            datagrams.append((transmit[0], transmit[1]))
        return datagrams


class _ServerConnection(_Qh3Connection):
    """qh3's server connection, credited for a datagram's trailing padding.

    Before the client's address is validated a server may send three times what it received
    (RFC 9000 §8.1), padding included. qh3 hands the core one packet of a datagram at a
    time (``receive_datagram``), and the core credits what it authenticates, so zero bytes
    after the last packet — how aioquic pads its Initial datagrams — earn nothing. While the
    handshake is in progress, the packet before such padding is handed over with it (the
    core reads the packet and drops the rest, crediting all of it)."""

    _rx_datagram: bytes | None = None
    _rx_offset = 0

    def receive_datagram(self, data: bytes, addr: Any, now: float) -> None:
        if self._handshake_complete:
            super().receive_datagram(data, addr, now)
            return
        self._rx_datagram, self._rx_offset = data, 0
        try:
            super().receive_datagram(data, addr, now)
        finally:
            self._rx_datagram = None

    def _call_core(self, operation: Callable[..., Any], *args: Any) -> Any:
        datagram = self._rx_datagram
        if datagram is not None and self._core is not None \
                and operation == self._core.receive_datagram:
            # qh3 passes the datagram's packets in order: (packet, addr, now, size).
            start = self._rx_offset
            end = start + len(args[0])
            self._rx_offset = end
            if start < end < len(datagram) and not datagram[end:].strip(b"\x00"):
                args = (datagram[start:], *args[1:])
        return super()._call_core(operation, *args)


class _Server(QuicServer):
    """qh3's server demultiplexer, making :class:`_ServerConnection` connections."""

    def __init__(self, *, create_protocol: Callable[..., Any], **kwargs: Any) -> None:
        def create(quic: QuicConnection, **kw: Any) -> Any:
            if type(quic) is QuicConnection:
                quic.__class__ = _ServerConnection  # before its first datagram
            return create_protocol(quic, **kw)

        super().__init__(create_protocol=create, **kwargs)


class _ClientConnection(_Qh3Connection):
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
    QuicLoggerTrace = QuicLoggerTrace
    qlog_version = QLOG_VERSION
    QuicServer = _Server
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
BACKEND = EngineBackend(LIBRARY)
connect = BACKEND.connect
serve = BACKEND.serve
