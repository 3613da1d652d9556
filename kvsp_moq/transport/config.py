"""Transport configuration, backend-neutral (no QUIC library is imported here).

Every knob DESIGN.md §6 asks for is a field: QUIC packet size (jumbo frames inside a
datacenter, 1200 on the internet), flow-control windows, congestion control, plus the
backpressure marks of the send path and the TLS material. A backend maps the fields onto its
library (see ``library.QuicLibrary.configuration`` and each backend's ``configure``) and
rejects what it cannot honour with a ``ValueError`` when a connection or server is created.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = [
    "BACKENDS",
    "BACKEND_ENV",
    "DEFAULT_ALPNS",
    "MAX_UDP_PAYLOAD",
    "MIN_QUIC_DATAGRAM_SIZE",
    "TransportConfig",
]

#: MOQT versions in preference order; kept equal to ``kvsp_moq.moqt.version.SUPPORTED_ALPNS``
#: (a test checks it) without the transport depending on MOQT for it.
DEFAULT_ALPNS: tuple[str, ...] = ("moqt-22", "moqt-21", "moqt-20", "moqt-18")
#: RFC 9000 §14: a QUIC endpoint must be able to send and receive 1200-byte UDP payloads.
MIN_QUIC_DATAGRAM_SIZE = 1200
#: The largest UDP payload over IPv4/IPv6 without jumbograms (RFC 9000 max_udp_payload_size).
MAX_UDP_PAYLOAD = 65527
#: Backends that ``connect``/``serve`` know. ``aioquic`` is a dependency; ``qh3`` is the
#: optional extra ``kvsp-moq[qh3]`` (aioquic's API over a Rust QUIC core).
BACKENDS: tuple[str, ...] = ("aioquic", "qh3")


def _aiopquic_importable() -> bool:
    """Whether the ``aiopquic`` package (picoquic through Cython; wheels for CPython >= 3.12
    only) can be imported here, found without importing it."""
    if sys.version_info < (3, 12):
        return False
    try:
        return importlib.util.find_spec("aiopquic") is not None
    except (ImportError, ValueError):
        return False


#: ``aiopquic`` (the extra ``kvsp-moq[aiopquic]``, Python >= 3.12) is a backend only where it
#: can be imported: it runs picoquic in its own network thread, behind its own asyncio API.
if _aiopquic_importable():
    BACKENDS += ("aiopquic",)


def _native_available() -> bool:
    """Whether the native backend's C extension (``kvsp_moq.transport.native._ngtcp2``) is
    built here and its libraries load (importing it loads libngtcp2 and GnuTLS, ~4 ms)."""
    from .native import available

    return available()


#: ``native`` (QUIC on ngtcp2 and GnuTLS in a C extension with its own network thread,
#: built by setup.py where Debian's libngtcp2-dev, libngtcp2-crypto-gnutls-dev and
#: libgnutls28-dev are installed) is a backend only where its extension is built.
if _native_available():
    BACKENDS += ("native",)

#: Environment variable naming the default backend when ``TransportConfig.backend`` is not
#: given (unset or empty: ``"aioquic"``).
BACKEND_ENV = "KVSP_QUIC_BACKEND"

_MiB = 1 << 20

PathLike = str | os.PathLike[str]


@dataclass
class TransportConfig:
    """How to set up QUIC connections. One instance may serve many connections."""

    #: QUIC library behind the interface: ``"aioquic"``, ``"qh3"``, on Python >= 3.12 with
    #: aiopquic installed ``"aiopquic"``, and where its C extension is built ``"native"``
    #: (ngtcp2; elsewhere the name raises ``native.unavailable.NativeUnavailableError``, a
    #: ValueError and a BackendUnavailableError naming the packages; see :data:`BACKENDS`).
    #: Default: ``$KVSP_QUIC_BACKEND`` if set, else ``"aioquic"``. The single switch: the
    #: CLI and benchmarks set this field. A backend whose package is missing fails in
    #: ``connect``/``serve`` with :class:`~kvsp_moq.transport.api.BackendUnavailableError`.
    backend: str = field(default_factory=lambda: os.environ.get(BACKEND_ENV) or "aioquic")

    # -- negotiation ----------------------------------------------------------------------
    #: ALPN tokens in preference order. A client offers them all; a server picks, by *its*
    #: order, the first one the client offered. No common token fails the handshake
    #: (TLS alert no_application_protocol, QUIC error 0x178).
    alpn_protocols: Sequence[str] = DEFAULT_ALPNS
    #: Advertise the QUIC DATAGRAM extension (RFC 9221) and require the peer to: MOQT says it
    #: MUST be negotiated. A peer that does not advertise it is closed with
    #: ``datagram_required_error_code``. False only for tests and non-MOQT uses.
    datagrams: bool = True
    #: ``max_datagram_frame_size`` transport parameter we advertise (the largest DATAGRAM
    #: frame we accept). 65536 means "any frame that fits a packet".
    max_datagram_frame_size: int = 65536

    # -- TLS ------------------------------------------------------------------------------
    #: PEM certificate (chain) and private key files; a server needs one of these pairs.
    certificate_file: PathLike | None = None
    private_key_file: PathLike | None = None
    #: The same, in memory (e.g. from ``transport.tls.make_self_signed``).
    certificate_pem: bytes | None = None
    private_key_pem: bytes | None = None
    #: Trust anchors for verifying the server (client side): a PEM file and/or PEM bytes.
    #: Neither: the system/certifi roots.
    ca_file: PathLike | None = None
    ca_data: bytes | None = None
    #: Skip certificate verification (tests, loopback benchmarks and dev only). A client that
    #: sends credentials (MOQT AUTHORIZATION_TOKEN) over such a connection is refused for a
    #: host other than loopback unless ``allow_insecure_remote`` (``transport.tls.
    #: check_credentials``; docs/security.md).
    insecure: bool = False
    #: With ``insecure``: let credentials go to a host other than loopback anyway (an
    #: explicit, logged opt-in: an on-path attacker can harvest them).
    allow_insecure_remote: bool = False
    #: Name to verify the server certificate against and to send in SNI; default: the URL host.
    server_name: str | None = None
    #: Append TLS secrets in NSS key log format here (Wireshark); None: off.
    keylog_file: PathLike | None = None
    #: Write one qlog file per connection here (``{ODCID}_{client|server}.qlog``, created if
    #: missing; ``transport.qlog``, docs/tracing.md); None: off. aioquic and qh3; aiopquic
    #: refuses it (ValueError).
    qlog_dir: PathLike | None = None

    # -- packets, windows, congestion -----------------------------------------------------
    #: Largest UDP payload we send, IP/UDP headers excluded. 1200 works on any path; on
    #: loopback or a jumbo-frame LAN raise it (1452 for a 1500 MTU over IPv4 without
    #: options, ~8952 for 9000-byte jumbo frames, up to 65527 on loopback). The client pads
    #: its first Initial to this size, so the path (and the peer's socket) must carry it or
    #: the handshake fails; aioquic does no path-MTU discovery and does not read the peer's
    #: max_udp_payload_size, so set the same value on both ends.
    max_datagram_size: int = MIN_QUIC_DATAGRAM_SIZE
    #: Initial connection-level receive window (MAX_DATA) we grant the peer.
    max_data: int = 16 * _MiB
    #: Initial per-stream receive window (MAX_STREAM_DATA) we grant the peer. aioquic doubles
    #: both windows as they fill (receive-side auto-tuning), so they are starting points.
    max_stream_data: int = 4 * _MiB
    #: None: the backend's default, a controller that holds its rate under random loss
    #: wherever the backend takes one (docs/transport.md "Congestion control"). aioquic:
    #: ``"bbr"`` (the default: ``transport.bbr``, a model of the path's bandwidth and RTT,
    #: paced, random loss below 2 % per round trip not read as congestion), ``"cubic"`` or
    #: ``"reno"``. qh3's Rust core has one built-in controller that cannot be chosen: leave
    #: None (a name is rejected). aiopquic: picoquic's names (None: ``"bbr1"``). native:
    #: ngtcp2's ``"reno"``, ``"cubic"``, ``"bbr"`` or ``"bbr2"`` (None: ``"bbr"``).
    congestion_control_algorithm: str | None = None
    #: Bidirectional streams the peer may have open at once on a connection: the
    #: initial_max_streams_bidi transport parameter (RFC 9000 §4.6, §18.2), kept at that many
    #: open at once by MAX_STREAMS as streams end. MOQT (draft 17+) keeps one bidi stream open
    #: per request — each PUBLISH_NAMESPACE, SUBSCRIBE, SUBSCRIBE_NAMESPACE while it lasts — so
    #: this caps the requests a peer holds open on one session (a holder's announced replicas
    #: per relay session; docs/transport.md "Stream limits"). Each open stream costs the QUIC
    #: library about 1 KiB (aioquic 1.7.2, idle) plus the request's state; credit alone costs
    #: nothing. aioquic (its own default: 128) and aiopquic (512) apply it; qh3 2.1 cannot
    #: (it grants 100, hard-coded in its Rust core and transport parameters).
    max_streams_bidi: int = 4096
    #: Initial RTT estimate, seconds (RFC 9002 uses 0.333; aioquic 0.1).
    initial_rtt: float = 0.1
    #: Close the connection after this many seconds without traffic.
    idle_timeout: float = 60.0
    #: ``connect`` gives up after this many seconds without a completed handshake.
    handshake_timeout: float = 10.0
    #: SO_RCVBUF / SO_SNDBUF asked for the UDP socket (bulk transfers drop packets with the
    #: kernel's ~200 KiB default). None: leave the kernel default.
    udp_buffer_size: int | None = 4 * _MiB
    #: Send the packets of one transmission that go to one address with one size in a
    #: single ``sendmsg`` with UDP_SEGMENT (Linux UDP GSO), where the kernel has it (probed
    #: once per address family; a send the kernel rejects turns it off for the socket).
    #: False: one ``sendto`` per packet. Either way the bytes on the wire are the same.
    udp_gso: bool = True
    #: Let the kernel coalesce received packets (Linux UDP_GRO) and split them by the
    #: segment size it reports. Receiving is batched either way (up to 64 packets per
    #: readiness callback, one transmission after them).
    udp_gro: bool = True
    #: Server: bind the listening socket with SO_REUSEPORT, so several processes may listen
    #: on one UDP port (the kernel spreads peers over them by address; ``relay --workers``).
    reuse_port: bool = False

    # -- send-side backpressure -----------------------------------------------------------
    #: ``Connection.write`` keeps at most this many bytes of one stream buffered in the QUIC
    #: library (unsent + unacknowledged). Bounds memory; must exceed the bandwidth-delay
    #: product for full speed.
    send_buffer_high_water: int = 4 * _MiB
    #: ``Connection.wait_writable`` returns once a stream's buffered bytes are at most this.
    #: None: half the high-water mark.
    send_buffer_low_water: int | None = None

    # -- WebTransport (docs/transport.md "WebTransport") ----------------------------------
    #: Server: accept WebTransport sessions (HTTP/3 extended CONNECT, ALPN ``h3``, offered
    #: after the ``moqt-NN`` tokens) on the same port as raw MOQT. A client uses
    #: WebTransport for an ``https://`` URL whatever this says.
    webtransport: bool = False
    #: WebTransport sessions one HTTP/3 connection may hold at once (advertised in
    #: SETTINGS; a CONNECT beyond it is answered 429).
    webtransport_max_sessions: int = 4
    #: Peer streams that name a session not (yet) established are buffered, at most this
    #: many per connection and ``webtransport_max_pending_bytes`` bytes in all; beyond, a
    #: stream is refused with WT_BUFFERED_STREAM_REJECTED.
    webtransport_max_pending_streams: int = 16
    webtransport_max_pending_bytes: int = 256 * 1024
    #: The largest HTTP/3 field section (HEADERS) and control-stream frame we accept
    #: (SETTINGS_MAX_FIELD_SECTION_SIZE); a longer frame is H3_EXCESSIVE_LOAD.
    h3_max_field_section_size: int = 16 * 1024
    #: A closed session's CLOSE_WEBTRANSPORT_SESSION capsule gets this many seconds to be
    #: acknowledged before the QUIC connection under it (holding no other session) closes.
    webtransport_close_timeout: float = 2.0

    # -- close codes the transport itself uses --------------------------------------------
    #: Application close code when the peer did not negotiate DATAGRAM (MOQT
    #: PROTOCOL_VIOLATION, 0x3).
    datagram_required_error_code: int = 0x3
    #: Application close code when a handler callback raised (MOQT INTERNAL_ERROR, 0x1).
    internal_error_code: int = 0x1

    # -- event loop -----------------------------------------------------------------------
    #: Whether ``transport.run`` / ``transport.new_event_loop`` use uvloop when it is
    #: installed. Nothing is installed globally; a running loop is used as it is.
    use_uvloop: bool = True

    extra: dict[str, object] = field(default_factory=dict)
    """Backend-specific options, passed through untouched. aioquic reads none; qh3 reads
    ``probe_datagram_size`` (bool, default False: its path-MTU discovery, client only);
    aiopquic reads ``pmtud`` (``"basic"``, ``"delayed"`` or ``"blocked"``: picoquic's path-MTU
    discovery, which sets its packet size) and ``stream_ring_cap`` (bytes of one stream's
    send ring, default 1 MiB); see docs/transport.md "aiopquic". native reads
    ``max_connections`` (a server's bound, default 1024; docs/transport.md "native")."""

    def __post_init__(self) -> None:
        if self.backend == "native" and self.backend not in BACKENDS:
            from .native import unavailable_reason
            from .native.unavailable import NativeUnavailableError

            raise NativeUnavailableError(unavailable_reason() or "not built")
        if self.backend not in BACKENDS:
            hint = ("; 'aiopquic' needs Python >= 3.12 and pip install 'kvsp-moq[aiopquic]'"
                    if self.backend == "aiopquic" else "")
            raise ValueError(
                f"unknown transport backend {self.backend!r}; known: {BACKENDS}{hint}")
        if isinstance(self.alpn_protocols, str):
            raise ValueError("alpn_protocols must be a sequence of tokens, not one string")
        self.alpn_protocols = tuple(self.alpn_protocols)
        if not self.alpn_protocols:
            raise ValueError("alpn_protocols must not be empty")
        for token in self.alpn_protocols:
            if not token or len(token.encode("ascii", "strict")) > 255:
                raise ValueError(f"invalid ALPN token {token!r}")
        if not MIN_QUIC_DATAGRAM_SIZE <= self.max_datagram_size <= MAX_UDP_PAYLOAD:
            raise ValueError(
                f"max_datagram_size must be in [{MIN_QUIC_DATAGRAM_SIZE}, {MAX_UDP_PAYLOAD}],"
                f" got {self.max_datagram_size}")
        for name in ("max_data", "max_stream_data", "send_buffer_high_water",
                     "max_datagram_frame_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        if not 1 <= self.max_streams_bidi <= 1 << 60:  # RFC 9000 §4.6: at most 2^60
            raise ValueError(f"max_streams_bidi must be in [1, 2^60], got {self.max_streams_bidi}")
        if self.send_buffer_low_water is not None and not (
                0 <= self.send_buffer_low_water <= self.send_buffer_high_water):
            raise ValueError("send_buffer_low_water must be in [0, send_buffer_high_water]")
        if self.idle_timeout <= 0 or self.handshake_timeout <= 0 or self.initial_rtt <= 0:
            raise ValueError("timeouts and initial_rtt must be positive")
        for name in ("webtransport_max_sessions", "webtransport_max_pending_bytes",
                     "h3_max_field_section_size", "webtransport_close_timeout"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        if self.webtransport_max_pending_streams < 0:
            raise ValueError("webtransport_max_pending_streams must be >= 0")
        if (self.certificate_pem is None) != (self.private_key_pem is None):
            raise ValueError("certificate_pem and private_key_pem go together")

    @property
    def low_water(self) -> int:
        """The effective low-water mark."""
        if self.send_buffer_low_water is None:
            return self.send_buffer_high_water // 2
        return self.send_buffer_low_water

    def replace(self, **changes: object) -> TransportConfig:
        """A copy with some fields changed (``dataclasses.replace``, validated again)."""
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]
