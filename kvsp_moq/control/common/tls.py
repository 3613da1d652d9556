"""TLS of a control-plane process: the shared ``[tls]`` section (docs/http-api.md
"Configuration", docs/security.md).

```toml
[tls]                        # every key optional
ca_file = "ca.pem"           # trust anchors of every client of the process, HTTPS and MOQT
                             # (none: the system trust store)
cert = "server.crt"          # with key: the HTTP role serves HTTPS (TLS 1.2 or later)
key = "server.key"
insecure = false             # clients skip certificate verification (logged once; dev only)
allow_plain_http = false     # tokens may go to http:// URLs other than loopback (logged)
allow_insecure_remote = false  # with insecure: tokens may go to hosts other than loopback

[transport]                  # every key optional
congestion_control = "bbr"   # QUIC congestion control of the process's MOQT connections
                             # (aioquic: reno, cubic, bbr; none: the backend's default)
max_datagram_size = 1200     # QUIC datagrams they send, octets (1200..65527; default 1200:
                             # any path; jumbo frames or loopback inside a datacenter: larger)
```

One section for the whole process, used by every HTTP client (:meth:`TlsConfig.client_ssl_context`),
every MOQT client (:meth:`TlsConfig.transport`; ``[instance.engine] ca_file`` / ``insecure``
override it for the engine's relay and holders) and the HTTP server
(:meth:`TlsConfig.server_ssl_context`). The ``[transport]`` section's ``congestion_control``
(:func:`with_transport_section`) rides on the same object: every MOQT client of the process
gets it from :meth:`TlsConfig.transport` (docs/transport.md "Congestion control"). A bearer token never leaves over an unverified channel
by default: ``http://`` is for loopback (127.0.0.0/8, ``::1``, ``localhost``) unless
``allow_plain_http``, and ``insecure`` to another host needs ``allow_insecure_remote``.
"""

from __future__ import annotations

import logging
import ssl
from dataclasses import dataclass, replace
from functools import cached_property
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from ...transport import TransportConfig
from ...transport.config import MAX_UDP_PAYLOAD, MIN_QUIC_DATAGRAM_SIZE
from ...transport.tls import is_loopback_host, warn_unverified
from .errors import ConfigError

__all__ = ["TlsConfig", "is_loopback_url", "tls_config_from_mapping", "with_transport_section"]

log = logging.getLogger(__name__)

_KEYS = ("ca_file", "cert", "key", "insecure", "allow_plain_http", "allow_insecure_remote")


def is_loopback_url(url: str) -> bool:
    """Whether ``url``'s host is loopback (127.0.0.0/8, ``::1``, ``localhost``)."""
    try:
        host = urlsplit(url).hostname
    except ValueError:
        return False
    return host is not None and is_loopback_host(host)


@dataclass(frozen=True)
class TlsConfig:
    """The ``[tls]`` section (module notes). Paths are as given (``tls_config_from_mapping``
    makes them relative to the configuration file)."""

    ca_file: str | None = None
    cert: str | None = None
    key: str | None = None
    insecure: bool = False
    allow_plain_http: bool = False
    allow_insecure_remote: bool = False
    #: ``[transport] congestion_control``: ``TransportConfig.congestion_control_algorithm`` of
    #: every MOQT client config :meth:`transport` makes (None: the backend's default).
    congestion_control: str | None = None
    #: ``[transport] max_datagram_size``: ``TransportConfig.max_datagram_size`` of every MOQT
    #: client config :meth:`transport` makes (None: the transport's default, 1200).
    max_datagram_size: int | None = None

    def __post_init__(self) -> None:
        for name in ("insecure", "allow_plain_http", "allow_insecure_remote"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"tls.{name}", "must be true or false")
        for name in ("ca_file", "cert", "key"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise ConfigError(f"tls.{name}", "must be a file name")
        if (self.cert is None) != (self.key is None):
            raise ConfigError("tls.cert" if self.cert is None else "tls.key", "cert and key go together")
        if self.congestion_control is not None and (
                not isinstance(self.congestion_control, str) or not self.congestion_control):
            raise ConfigError("transport.congestion_control", "must be a name (reno, cubic, bbr)")
        size = self.max_datagram_size
        if size is not None and (isinstance(size, bool) or not isinstance(size, int)
                                 or not MIN_QUIC_DATAGRAM_SIZE <= size <= MAX_UDP_PAYLOAD):
            raise ConfigError("transport.max_datagram_size",
                              f"must be an integer in [{MIN_QUIC_DATAGRAM_SIZE}, {MAX_UDP_PAYLOAD}]")

    # -- clients ----------------------------------------------------------------------------

    @cached_property
    def client_ssl(self) -> ssl.SSLContext:
        """The ``ssl.SSLContext`` of every HTTPS client: the server certificate and name are
        verified against ``ca_file`` (or the system store), TLS 1.2 or later; with ``insecure``
        nothing is verified (logged once)."""
        try:
            ctx = ssl.create_default_context(cafile=self.ca_file)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError("tls.ca_file", f"{self.ca_file}: {getattr(exc, 'strerror', None) or exc}") from None
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        if self.insecure:
            warn_unverified("HTTPS clients ([tls] insecure)")
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
        return ctx

    def transport(self, *, ca_file: str | None = None, insecure: bool | None = None,
                  purpose: str = "MOQT clients", **changes: Any) -> TransportConfig:
        """A MOQT client's :class:`TransportConfig`: verified against ``ca_file`` (default:
        this section's, else the system store) unless ``insecure`` (default: this section's;
        logged once per ``purpose``)."""
        unverified = self.insecure if insecure is None else insecure
        if unverified:
            warn_unverified(purpose)
        changes.setdefault("congestion_control_algorithm", self.congestion_control)
        if self.max_datagram_size is not None:
            changes.setdefault("max_datagram_size", self.max_datagram_size)
        return TransportConfig(ca_file=ca_file or self.ca_file, insecure=unverified,
                               allow_insecure_remote=self.allow_insecure_remote, **changes)

    def check_token_url(self, key: str, url: str | None, token: str | None) -> None:
        """Config time: a ``token`` may go to ``url`` (named ``key`` in errors): https://, or
        http:// to loopback, or ``allow_plain_http`` (logged). :class:`ConfigError` otherwise."""
        if url is None or not token or self.token_url_allowed(url):
            return
        raise ConfigError(key, f"{url}: a bearer token would cross plain HTTP to a host other than "
                               "loopback; use https:// (or set [tls] allow_plain_http = true)")

    def check_moqt_token(self, key: str, url: str | None, token: str | None, insecure: bool | None) -> None:
        """Config time: a ``token`` may go over MOQT to ``url`` unless the connection is
        unverified (``insecure``, default this section's) to a host other than loopback
        without ``allow_insecure_remote``: :class:`ConfigError` naming ``key`` then."""
        unverified = self.insecure if insecure is None else insecure
        if url is None or not token or not unverified or self.allow_insecure_remote or is_loopback_url(url):
            return
        raise ConfigError(key, f"{url}: the token would cross MOQT without TLS verification to a host "
                               "other than loopback; set a CA file (or [tls] allow_insecure_remote = true)")

    def token_url_allowed(self, url: str) -> bool:
        """Whether a bearer token may be sent to ``url`` (see :meth:`check_token_url`)."""
        scheme = url.split(":", 1)[0].lower()
        if scheme != "http" or is_loopback_url(url):
            return True
        if self.allow_plain_http:
            warn_unverified(f"plain HTTP to {urlsplit(url).netloc} ([tls] allow_plain_http)")
            return True
        return False

    # -- server -----------------------------------------------------------------------------

    def server_ssl_context(self) -> ssl.SSLContext | None:
        """HTTPS for the role's server when ``cert`` and ``key`` are set (TLS 1.2 or later);
        None: plain HTTP."""
        if self.cert is None or self.key is None:
            return None
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        try:
            ctx.load_cert_chain(self.cert, self.key)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError("tls.cert", f"{self.cert} / {self.key}: {getattr(exc, 'strerror', None) or exc}") from None
        return ctx


def tls_config_from_mapping(section: object, base_dir: Path) -> TlsConfig:
    """``[tls]`` as decoded from TOML; file names are relative to ``base_dir``."""
    if not isinstance(section, dict):
        raise ConfigError("tls", "must be a table")
    unknown = set(section) - set(_KEYS)
    if unknown:
        raise ConfigError(f"tls.{sorted(unknown)[0]}", "unknown key")
    values = dict(section)
    for name in ("ca_file", "cert", "key"):
        if isinstance(values.get(name), str):
            values[name] = str(base_dir / values[name])
    tls = TlsConfig(**values)
    if tls.ca_file is not None and not Path(tls.ca_file).is_file():
        raise ConfigError("tls.ca_file", f"{tls.ca_file}: no such file")
    tls.server_ssl_context()  # a bad certificate or key fails here, naming the key
    return tls


def with_transport_section(tls: TlsConfig, section: object) -> TlsConfig:
    """``tls`` with the ``[transport]`` section (keys: ``congestion_control``, ``max_datagram_size``) as decoded from
    TOML. A name the backend does not know fails when a connection is made (ValueError)."""
    if not isinstance(section, dict):
        raise ConfigError("transport", "must be a table")
    unknown = set(section) - {"congestion_control", "max_datagram_size"}
    if unknown:
        raise ConfigError(f"transport.{sorted(unknown)[0]}", "unknown key")
    return replace(tls, **section) if section else tls
