"""``moqt://`` and ``https://`` URLs (MOQT §"MOQT URI Scheme", §"WebTransport").

``moqt-URI = "moqt" "://" authority path-abempty [ "?" query ]``; the authority must not have
an empty host; the port defaults to 443. On native QUIC the client connects to host:port and
the MOQT layer sends the authority and ``path-abempty [?query]`` in the SETUP options
AUTHORITY and PATH (:attr:`MoqtUrl.authority`, :attr:`MoqtUrl.path_and_query`). A fragment is
kept for local use and never sent.

An ``https://`` URL names the same server over WebTransport (MOQT §"WebTransport": the
client replaces the scheme): the client sends an extended CONNECT for the authority and
path, and the MOQT layer sends neither AUTHORITY nor PATH (§"AUTHORITY", §"PATH": not used
when WebTransport is). :attr:`MoqtUrl.scheme` says which; :attr:`MoqtUrl.is_webtransport`.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit

__all__ = ["DEFAULT_PORT", "MoqtUrl", "WEBTRANSPORT_SCHEME", "parse_moqt_url"]

DEFAULT_PORT = 443
SCHEME = "moqt"
#: The scheme of a WebTransport URL (MOQT §"WebTransport").
WEBTRANSPORT_SCHEME = "https"
_SCHEMES = (SCHEME, WEBTRANSPORT_SCHEME)


@dataclass(frozen=True, slots=True)
class MoqtUrl:
    """A parsed ``moqt://`` URL."""

    host: str
    """Host to resolve: a name (lower-cased), an IPv4 address, or an IPv6 address without
    brackets."""
    port: int
    """UDP port (443 when the URL has none)."""
    authority: str
    """The authority exactly as written (userinfo, host, port), for the AUTHORITY option."""
    path: str
    """``path-abempty``: empty or starting with ``/``, percent-encoding kept."""
    query: str | None = None
    """The query without ``?``, or None when the URL has no ``?``."""
    fragment: str | None = None
    """The fragment without ``#`` (local only), or None."""
    scheme: str = SCHEME
    """``"moqt"`` (raw QUIC) or ``"https"`` (WebTransport)."""

    @property
    def is_webtransport(self) -> bool:
        """True for an ``https://`` URL: MOQT over a WebTransport session."""
        return self.scheme == WEBTRANSPORT_SCHEME

    def with_scheme(self, scheme: str) -> MoqtUrl:
        """The same server and path under another scheme (``moqt`` <-> ``https``)."""
        if scheme not in _SCHEMES:
            raise ValueError(f"unsupported URL scheme {scheme!r}")
        return MoqtUrl(self.host, self.port, self.authority, self.path, self.query,
                       self.fragment, scheme)

    @property
    def path_and_query(self) -> str:
        """The PATH setup option value: ``path-abempty [ "?" query ]``."""
        return self.path if self.query is None else f"{self.path}?{self.query}"

    def __str__(self) -> str:
        text = f"{self.scheme}://{self.authority}{self.path_and_query}"
        return text if self.fragment is None else f"{text}#{self.fragment}"


def parse_moqt_url(url: str) -> MoqtUrl:
    """Parse ``moqt://host[:port][/path][?query][#fragment]`` or the same with
    ``https://`` (WebTransport).

    Raises :class:`ValueError` for another scheme, an empty host, or a bad port.
    """
    if not isinstance(url, str):
        raise TypeError(f"URL must be a str, got {type(url).__name__}")
    if any(c.isspace() for c in url):
        raise ValueError(f"invalid moqt URL {url!r}: contains whitespace")
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in _SCHEMES:
        raise ValueError(
            f"unsupported URL scheme {parts.scheme!r} in {url!r}: expected moqt://host:port/path"
            f" (raw QUIC) or https://host:port/path (WebTransport)")
    if not url[len(parts.scheme):].startswith("://"):
        raise ValueError(f"invalid moqt URL {url!r}: expected {scheme}://authority")
    try:
        host = parts.hostname
        port = parts.port
    except ValueError as exc:  # bad port, unbalanced brackets
        raise ValueError(f"invalid moqt URL {url!r}: {exc}") from None
    if not host:
        raise ValueError(f"invalid moqt URL {url!r}: empty host")
    if port is None:
        if parts.netloc.endswith(":"):
            raise ValueError(f"invalid moqt URL {url!r}: empty port")
        port = DEFAULT_PORT
    elif port == 0:
        raise ValueError(f"invalid moqt URL {url!r}: port 0")
    query = parts.query if (parts.query or "?" in url.split("#", 1)[0]) else None
    fragment = parts.fragment if (parts.fragment or "#" in url) else None
    return MoqtUrl(host=host, port=port, authority=parts.netloc, path=parts.path,
                   query=query, fragment=fragment, scheme=scheme)
