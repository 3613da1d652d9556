"""``TransportConfig`` → aiopquic's ``QuicConfiguration`` (checked against aiopquic 0.6.1).

picoquic reads its TLS material from files, once, when a ``TransportContext`` starts: PEM
given in memory (``certificate_pem``/``private_key_pem``, ``ca_data``) is written to a private
temporary directory (mode 0700, the key 0600) that :class:`TlsFiles` removes right after the
start. It loads one trust-anchor file, so ``ca_file`` and ``ca_data`` together are
concatenated into one.

What picoquic does not let us set, and what happens instead:

* ``max_datagram_size``: picoquic chooses its packet size itself (1252 octets over IPv4,
  1232 over IPv6 to begin with, then path-MTU discovery up to what the peer's
  max_udp_payload_size and picoquic's own limit allow; it announces 1440).
  ``TransportConfig.extra["pmtud"]`` (``"basic"``, ``"delayed"``, ``"blocked"``) chooses the
  discovery policy. Here the field only bounds ``Connection.max_datagram_payload`` (with
  aiopquic's own 1200-octet ceiling).
* ``initial_rtt``, ``udp_gso``/``udp_gro`` (picoquic uses GSO on Linux by itself):
  not settable; ignored.
* ``max_streams_bidi`` is aiopquic's ``max_streams_bidi`` (picoquic's
  initial_max_stream_id_bidir transport parameter; aiopquic's own default 512); the
  unidirectional credit stays aiopquic's 512.
* ``udp_buffer_size`` None means aiopquic's 64 MiB request, not the kernel default.
* ``congestion_control_algorithm`` None means aiopquic's default (``"bbr1"``); any name
  picoquic knows is accepted (``newreno``/``reno``, ``cubic``, ``dcubic``, ``fast``,
  ``bbr``, ``bbr1``, ``prague``, ``c4``), others raise ``ValueError``.
"""

from __future__ import annotations

import ssl
from pathlib import Path
from typing import Any

from .stack import QuicConfiguration
from ..config import TransportConfig
from ..tls_files import TlsFiles

__all__ = ["DATAGRAM_CEILING", "DEFAULT_STREAM_RING", "quic_configuration",
           "stream_ring_cap"]

#: aiopquic's per-datagram payload cap: the size picoquic admits without consulting the live
#: path MTU (its initial packets of 1232/1252 octets hold a DATAGRAM frame this large).
DATAGRAM_CEILING = 1200
#: Bytes of one stream's send ring (``TransportConfig.extra["stream_ring_cap"]``). A write
#: larger than the free room is queued by the backend and fed in as the ring drains.
DEFAULT_STREAM_RING = 1 << 20
#: The datagram send ring of a connection (records waiting for a packet). Full: the datagram
#: is dropped, as a full socket buffer would drop it (RFC 9221 §5: DATAGRAM is unreliable).
_DATAGRAM_RING = 256 * 1024


def stream_ring_cap(config: TransportConfig) -> int:
    """The per-stream send ring size (a power of two, as aiopquic rounds it)."""
    value = config.extra.get("stream_ring_cap", DEFAULT_STREAM_RING)
    if not isinstance(value, int) or value < 4096:
        raise ValueError(f"extra['stream_ring_cap'] must be an int >= 4096, got {value!r}")
    return 1 << (value - 1).bit_length()


def quic_configuration(config: TransportConfig, *, is_client: bool, files: TlsFiles,
                       server_name: str | None = None, family: int | None = None) -> Any:
    """aiopquic's ``QuicConfiguration`` for ``config``; in-memory PEM goes to ``files``.
    Raises ``ValueError`` for what picoquic cannot honour (an unknown congestion-control
    name or path-MTU policy, a server without a certificate)."""
    if config.qlog_dir is not None:
        raise ValueError("qlog_dir: the aiopquic backend does not write qlog files (not wired);"
                         " use the aioquic or qh3 backend")
    pmtud = config.extra.get("pmtud", "basic")
    qc = QuicConfiguration(
        alpn_protocols=list(config.alpn_protocols),
        is_client=is_client,
        idle_timeout=config.idle_timeout,
        max_data=config.max_data,
        max_stream_data=config.max_stream_data,
        max_datagram_frame_size=config.max_datagram_frame_size if config.datagrams else None,
        datagram_ring_bytes=_DATAGRAM_RING,
        datagram_max_payload=DATAGRAM_CEILING,
        socket_buffer_size=config.udp_buffer_size,
        stream_ring_cap=stream_ring_cap(config),
        max_streams_bidi=config.max_streams_bidi,
        server_name=server_name,
        ip_family=family,
        pmtud=pmtud,
        **({} if config.congestion_control_algorithm is None else
           {"congestion_control_algorithm": config.congestion_control_algorithm}),
    )
    if config.keylog_file is not None:
        qc.secrets_log_file = str(config.keylog_file)
    if is_client:
        _client_trust(qc, config, files)
    if config.certificate_file is not None:
        qc.certificate_file = str(config.certificate_file)
        # A combined PEM (certificate and key in one file) serves as both.
        qc.private_key_file = str(config.private_key_file or config.certificate_file)
    elif config.certificate_pem is not None and config.private_key_pem is not None:
        qc.certificate_file = files.write("cert.pem", config.certificate_pem)
        qc.private_key_file = files.write("key.pem", config.private_key_pem)
    elif not is_client:
        raise ValueError("a server needs a certificate: set certificate_file/private_key_file"
                         " or certificate_pem/private_key_pem (see transport.tls for a dev one)")
    return qc


def _client_trust(qc: Any, config: TransportConfig, files: TlsFiles) -> None:
    if config.insecure:
        qc.verify_mode = ssl.CERT_NONE
        return
    if config.ca_data is None:
        if config.ca_file is not None:
            qc.cafile = str(config.ca_file)
        return  # else certifi's roots (aiopquic's default)
    bundle = config.ca_data
    if config.ca_file is not None:
        bundle = Path(config.ca_file).read_bytes().rstrip(b"\n") + b"\n" + bundle
    qc.cafile = files.write("ca.pem", bundle)

