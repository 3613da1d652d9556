"""``moqt://`` URLs (MOQT §"MOQT URI Scheme").

``moqt-URI = "moqt" "://" authority path-abempty [ "?" query ]``; the authority must not have
an empty host; the port defaults to 443. On native QUIC the client connects to host:port and
the MOQT layer sends the authority and ``path-abempty [?query]`` in the SETUP options
AUTHORITY and PATH (:attr:`MoqtUrl.authority`, :attr:`MoqtUrl.path_and_query`). A fragment is
kept for local use and never sent.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit

__all__ = ["DEFAULT_PORT", "MoqtUrl", "parse_moqt_url"]

DEFAULT_PORT = 443
SCHEME = "moqt"


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

    @property
    def path_and_query(self) -> str:
        """The PATH setup option value: ``path-abempty [ "?" query ]``."""
        return self.path if self.query is None else f"{self.path}?{self.query}"

    def __str__(self) -> str:
        text = f"{SCHEME}://{self.authority}{self.path_and_query}"
        return text if self.fragment is None else f"{text}#{self.fragment}"


def parse_moqt_url(url: str) -> MoqtUrl:
    """Parse ``moqt://host[:port][/path][?query][#fragment]``.

    Raises :class:`ValueError` for another scheme, an empty host, or a bad port.
    """
    if not isinstance(url, str):
        raise TypeError(f"URL must be a str, got {type(url).__name__}")
    if any(c.isspace() for c in url):
        raise ValueError(f"invalid moqt URL {url!r}: contains whitespace")
    parts = urlsplit(url)
    if parts.scheme.lower() != SCHEME:
        raise ValueError(
            f"unsupported URL scheme {parts.scheme!r} in {url!r}: expected moqt://host:port/path")
    if not url[len(parts.scheme):].startswith("://"):
        raise ValueError(f"invalid moqt URL {url!r}: expected moqt://authority")
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
                   query=query, fragment=fragment)
