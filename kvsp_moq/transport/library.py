"""What the engine needs from a QUIC library: :class:`QuicLibrary`.

aioquic and qh3 share a sans-IO API (``QuicConnection``: ``connect``, ``receive_datagram``,
``datagrams_to_send``, ``get_timer``/``handle_timer``, ``next_event``, ``send_stream_data``,
``reset_stream``, ``stop_stream``, ``send_datagram_frame``, ``send_ping``, ``close``; the same
event classes and ``QuicConfiguration`` fields) and an asyncio server demultiplexer
(``QuicServer``). The engine (``engine.py``, ``endpoints.py``) drives that API; what differs
between the libraries — the internals behind backpressure and close detection, stream
opening, library-only options — is behind this class, which ``aioquic_backend.py`` and
``qh3_backend.py`` implement. A backend module is then ``LIBRARY = XLibrary()`` plus the
``connect`` and ``serve`` of ``endpoints.EngineBackend(LIBRARY)`` (the :class:`~.api.Backend`
shape). This module imports no QUIC library, and nothing of the engine.
"""

from __future__ import annotations

import abc
import ssl
from collections.abc import Callable
from typing import Any

from .config import TransportConfig
from .qlog import QlogDirectory

__all__ = ["QuicLibrary"]


class QuicLibrary(abc.ABC):
    """A QUIC library with aioquic's sans-IO API, and its differences, in one object."""

    #: The backend name (``TransportConfig.backend``).
    name: str
    #: ``QuicConnection``, ``QuicConfiguration`` and the asyncio ``QuicServer`` classes.
    QuicConnection: Any
    QuicConfiguration: Any
    QuicServer: Any
    #: The ``quic.events`` module (same class names in both libraries).
    events: Any
    #: ``quic.logger.QuicLoggerTrace`` and ``quic.logger.QLOG_VERSION`` (``qlog_dir``).
    QuicLoggerTrace: Any
    qlog_version: str
    #: ``tls.load_pem_private_key`` / ``tls.load_pem_x509_certificates``.
    load_pem_private_key: Callable[..., Any]
    load_pem_x509_certificates: Callable[[bytes], list[Any]]
    #: The longest packet number the library writes in a short header (RFC 9000 §17.3.1).
    packet_number_size: int = 4
    #: Exceptions the library raises for a stream operation it refuses (after FIN, unknown).
    stream_errors: tuple[type[BaseException], ...] = (ValueError, RuntimeError)
    #: Exceptions ``datagrams_to_send`` may raise for a transmission it could not build now
    #: (the connection goes on; the next transmission tries again).
    transmit_errors: tuple[type[BaseException], ...] = ()

    # -- configuration ----------------------------------------------------------------------
    def configuration(self, config: TransportConfig, *, is_client: bool,
                      server_name: str | None = None) -> Any:
        """The library's ``QuicConfiguration`` for ``config`` (fields named alike in both)."""
        qc = self.QuicConfiguration(
            alpn_protocols=list(config.alpn_protocols),
            is_client=is_client,
            idle_timeout=config.idle_timeout,
            max_data=config.max_data,
            max_stream_data=config.max_stream_data,
            max_datagram_size=config.max_datagram_size,
            max_datagram_frame_size=config.max_datagram_frame_size if config.datagrams else None,
            initial_rtt=config.initial_rtt,
            server_name=server_name,
        )
        self.configure(qc, config)
        if is_client:
            if config.insecure:
                qc.verify_mode = ssl.CERT_NONE
            if config.ca_file is not None or config.ca_data is not None:
                qc.load_verify_locations(
                    cafile=None if config.ca_file is None else str(config.ca_file),
                    cadata=config.ca_data)
        if config.certificate_file is not None:
            qc.load_cert_chain(config.certificate_file, config.private_key_file)
        elif config.certificate_pem is not None and config.private_key_pem is not None:
            chain = self.load_pem_x509_certificates(config.certificate_pem)
            if not chain:
                raise ValueError("certificate_pem holds no certificate")
            qc.certificate, qc.certificate_chain = chain[0], chain[1:]
            qc.private_key = self.load_pem_private_key(config.private_key_pem)
        elif not is_client:
            raise ValueError("a server needs a certificate: set certificate_file/"
                             "private_key_file or certificate_pem/private_key_pem (see "
                             "transport.tls for a dev one)")
        if config.keylog_file is not None:
            qc.secrets_log_file = open(config.keylog_file, "a")  # noqa: SIM115
        if config.qlog_dir is not None:
            qc.quic_logger = QlogDirectory(config.qlog_dir, self.QuicLoggerTrace, self.qlog_version)
        return qc

    @abc.abstractmethod
    def configure(self, qc: Any, config: TransportConfig) -> None:
        """Library-only settings (congestion control, path-MTU probing); ``ValueError`` for
        what the library cannot honour."""

    def prepare_connection(self, quic: Any, config: TransportConfig | None = None) -> None:
        """Called once per connection before it sends or reads its peer's first packet
        (client and server side): where a library's connection needs wiring its configuration
        cannot express (aioquic: the BBR pacer, ``config.max_streams_bidi``). ``config``: the
        connection's :class:`TransportConfig` (None: only what needs none). Default: nothing."""

    def congestion_state(self, quic: Any) -> dict[str, Any] | None:
        """The congestion controller's state (algorithm, window, BBR's model), or None where
        the library does not expose it."""
        return None

    # -- internals the interface needs --------------------------------------------------------
    def peer_max_datagram_frame_size(self, quic: Any) -> int | None:
        """The peer's max_datagram_frame_size transport parameter (RFC 9221 §3), or None.
        Neither library has a public accessor; both keep it under this name."""
        return quic._remote_max_datagram_frame_size

    @abc.abstractmethod
    def open_stream(self, quic: Any, unidirectional: bool) -> int:
        """Open a local stream and return its ID (RFC 9000 §2.1 numbering)."""

    @abc.abstractmethod
    def stream_buffered(self, quic: Any, stream_id: int) -> int:
        """Bytes of the stream the library holds: unsent plus sent-but-unacknowledged."""

    @abc.abstractmethod
    def unacknowledged(self, quic: Any) -> int:
        """Stream bytes of the whole connection not yet acknowledged (0: drained)."""

    @abc.abstractmethod
    def pending_close(self, quic: Any) -> tuple[Any, bool] | None:
        """The close in progress (a ``ConnectionTerminated``-like event whose event only comes
        after the closing period) and whether this endpoint began it; None while open."""

    def receive_many(self, quic: Any, datagrams: list[bytes], addr: Any, now: float) -> None:
        """Feed several datagrams from one address (default: one by one)."""
        for data in datagrams:
            quic.receive_datagram(data, addr, now=now)

    def has_stream(self, quic: Any, stream_id: int) -> bool:
        """False for a stream that is unknown or finished and forgotten."""
        return True

    def after_stop_sending(self, quic: Any, stream_id: int, error_code: int) -> None:
        """Reset our send side after STOP_SENDING (RFC 9000 §3.5) if the library did not."""
