"""``TransportConfig`` → the keyword arguments of ``_ngtcp2.Endpoint`` (:func:`endpoint_options`).

GnuTLS reads its TLS material from files, once, when the endpoint is created: PEM given in
memory (``certificate_pem``/``private_key_pem``, ``ca_data``) is written to a private
temporary directory (mode 0700, files 0600) that :class:`TlsFiles` removes right after.
``ca_file`` and ``ca_data`` together are concatenated into one trust file.

The fields and where they go:

========================================  ===================================================
``alpn_protocols``                        ``alpns`` (a server picks by its own order)
``certificate_*``/``private_key_*``        ``cert_file``/``key_file`` (a combined PEM file
                                          serves as both)
``ca_file``/``ca_data``, ``insecure``     ``ca_file`` (None: the system's trust store),
                                          ``verify`` (on unless ``insecure``)
``server_name``                           SNI and the name verified (``Endpoint.connect``)
``congestion_control_algorithm``          ``cc``: ``reno``, ``cubic``, ``bbr``, ``bbr2``
                                          (ngtcp2's); None: ``bbr``
``max_datagram_size``                     ``max_udp_payload``: below 1452 ngtcp2 starts at
                                          1200 and probes the path (PMTUD, in its steps
                                          1232, 1342, 1406, 1444); from 1452 every packet
                                          has that size from the start (as elsewhere)
``idle_timeout``                          ``idle_timeout_ms``
``max_data``/``max_stream_data``          ``initial_max_data``/``initial_max_stream_data``
                                          (credit is extended as the upper layer is handed
                                          bytes: the windows stay that size, no auto-tuning)
``max_streams_bidi``                      ``initial_max_streams_bidi`` and, as
                                          TransportConfig has no field for it,
                                          ``initial_max_streams_uni`` too (kept at that many
                                          open at once: MAX_STREAMS as streams end)
``datagrams``/``max_datagram_frame_size`` ``max_datagram_frame_size`` (0: no DATAGRAM;
                                          at most 65535, the C limit)
``udp_gso``/``udp_gro``                   ``gso``/``gro``
``reuse_port``                            ``reuse_port`` (server: SO_REUSEPORT)
``extra["max_connections"]``              ``max_connections`` (server; default 1024)
========================================  ===================================================

``handshake_timeout`` is ours (``ConnectionCore.await_handshake``; ngtcp2 also gives up
after 10 s). Not applicable, ignored: ``initial_rtt`` (ngtcp2's own initial RTT, 333 ms,
RFC 9002) and ``udp_buffer_size`` (the extension asks for 8 MiB per socket buffer). Refused
with ``ValueError``: ``qlog_dir`` and ``keylog_file`` (the extension writes neither).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..config import TransportConfig
from ..tls_files import TlsFiles

__all__ = ["CONGESTION_CONTROLLERS", "DEFAULT_CC", "MAX_DATAGRAM_FRAME",
           "check_config", "endpoint_options"]

#: ngtcp2's controllers, by the names the extension takes.
CONGESTION_CONTROLLERS = ("reno", "cubic", "bbr", "bbr2")
#: What ``congestion_control_algorithm`` None means here.
DEFAULT_CC = "bbr"
#: The largest max_datagram_frame_size the extension advertises.
MAX_DATAGRAM_FRAME = 65535
_DEFAULT_MAX_CONNECTIONS = 1024


def congestion_controller(config: TransportConfig) -> str:
    """The ``cc`` name for ``config``; ValueError for one ngtcp2 does not have."""
    name = config.congestion_control_algorithm or DEFAULT_CC
    if name not in CONGESTION_CONTROLLERS:
        raise ValueError(f"unknown congestion control algorithm {name!r}; the native backend "
                         f"(ngtcp2) has {list(CONGESTION_CONTROLLERS)}")
    return name


def check_config(config: TransportConfig, *, is_client: bool) -> None:
    """Raise ValueError for what the native backend cannot honour (before anything starts)."""
    congestion_controller(config)
    if config.qlog_dir is not None:
        raise ValueError("qlog_dir: the native backend writes no qlog files; use the aioquic "
                         "or qh3 backend")
    if config.keylog_file is not None:
        raise ValueError("keylog_file: the native backend writes no TLS key log; use the "
                         "aioquic or qh3 backend")
    if not is_client:
        if config.certificate_file is None and (config.certificate_pem is None
                                                or config.private_key_pem is None):
            raise ValueError("a server needs a certificate: set certificate_file/"
                             "private_key_file or certificate_pem/private_key_pem (see "
                             "transport.tls for a dev one)")
    limit = config.extra.get("max_connections", _DEFAULT_MAX_CONNECTIONS)
    if not isinstance(limit, int) or not 1 <= limit <= 1 << 20:
        raise ValueError(f"extra['max_connections'] must be an int in 1..2^20, got {limit!r}")


def endpoint_options(config: TransportConfig, *, is_client: bool,
                     files: TlsFiles) -> dict[str, Any]:
    """``Endpoint(...)``'s keyword arguments for ``config`` (in-memory PEM written to
    ``files``, which the caller removes once the endpoint exists)."""
    check_config(config, is_client=is_client)
    streams = config.max_streams_bidi
    options: dict[str, Any] = dict(
        alpns=list(config.alpn_protocols),
        cc=congestion_controller(config),
        max_udp_payload=config.max_datagram_size,
        idle_timeout_ms=max(1, round(config.idle_timeout * 1000)),
        initial_max_data=config.max_data,
        initial_max_stream_data=config.max_stream_data,
        initial_max_streams_bidi=streams,
        initial_max_streams_uni=streams,
        max_datagram_frame_size=(min(config.max_datagram_frame_size, MAX_DATAGRAM_FRAME)
                                 if config.datagrams else 0),
        gso=config.udp_gso,
        gro=config.udp_gro,
    )
    if is_client:  # a client presents no certificate (the extension has no client auth)
        options["verify"] = not config.insecure
        if not config.insecure:
            options["ca_file"] = _trust_file(config, files)
        return options
    options["max_connections"] = config.extra.get("max_connections", _DEFAULT_MAX_CONNECTIONS)
    options["reuse_port"] = config.reuse_port
    if config.certificate_file is not None:
        options["cert_file"] = str(config.certificate_file)
        options["key_file"] = str(config.private_key_file or config.certificate_file)
    else:
        assert config.certificate_pem is not None and config.private_key_pem is not None
        options["cert_file"] = files.write("cert.pem", config.certificate_pem)
        options["key_file"] = files.write("key.pem", config.private_key_pem)
    return options


def _trust_file(config: TransportConfig, files: TlsFiles) -> str | None:
    """The trust anchors' file: ``ca_file``, ``ca_data`` written out, both in one, or None
    (the system's store)."""
    if config.ca_data is None:
        return None if config.ca_file is None else str(config.ca_file)
    bundle = config.ca_data
    if config.ca_file is not None:
        bundle = Path(config.ca_file).read_bytes().rstrip(b"\n") + b"\n" + bundle
    return files.write("ca.pem", bundle)
