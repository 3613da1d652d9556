"""``--metrics HOST:PORT``: the relay's stats in the Prometheus text exposition format
(version 0.0.4) at ``GET /metrics``.

A deliberately small HTTP/1.1 responder on :func:`asyncio.start_server` (the web framework
is reserved to the control plane's HTTP modules): it reads one request head of at most
:data:`MAX_HEAD` bytes within :data:`READ_TIMEOUT` seconds, answers ``GET /metrics`` with
200 and anything else with 404 (an oversized or malformed head: 400), and closes the
connection after every response (``Connection: close``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping

__all__ = ["MetricsServer", "render_metrics"]

logger = logging.getLogger(__name__)
MAX_HEAD = 8192
READ_TIMEOUT = 5.0
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

#: snapshot key → (metric name, type, help). Counters get the ``_total`` suffix.
_METRICS: tuple[tuple[str, str, str, str], ...] = (
    ("sessions", "relay_sessions", "gauge", "Open MOQT sessions"),
    ("sessions_opened", "relay_sessions_opened_total", "counter", "MOQT sessions established"),
    ("subscribers", "relay_subscribers", "gauge", "Downstream subscriptions being served"),
    ("tracks", "relay_tracks", "gauge", "Tracks with an upstream subscription"),
    ("namespaces", "relay_namespaces", "gauge", "Announced namespaces"),
    ("cache_bytes", "relay_cache_bytes", "gauge", "Bytes held by the object cache"),
    ("cache_objects", "relay_cache_objects", "gauge", "Objects held by the object cache"),
    ("cache_evictions", "relay_cache_evictions_total", "counter", "Objects evicted from the cache"),
    ("cache_hits", "relay_cache_hits_total", "counter", "FETCHes served from the cache"),
    ("cache_misses", "relay_cache_misses_total", "counter", "FETCHes that needed upstream"),
    ("bytes_in", "relay_bytes_in_total", "counter", "Object payload bytes received from upstream"),
    ("bytes_out", "relay_bytes_out_total", "counter", "Object payload bytes sent downstream"),
    ("objects_in", "relay_objects_in_total", "counter", "Objects received from upstream"),
    ("objects_out", "relay_objects_out_total", "counter", "Objects sent downstream"),
    ("subscribes", "relay_subscribes_total", "counter", "Downstream SUBSCRIBEs accepted"),
    ("subscribe_errors", "relay_subscribe_errors_total", "counter", "Downstream SUBSCRIBEs refused"),
    ("upstream_subscribes", "relay_upstream_subscribes_total", "counter",
     "Upstream SUBSCRIBEs sent (one per track)"),
    ("upstream_announces", "relay_upstream_announces_total", "counter",
     "PUBLISH_NAMESPACEs sent to the upstream relay (one per namespace)"),
    ("upstream_namespace_subscribes", "relay_upstream_namespace_subscribes_total", "counter",
     "SUBSCRIBE_NAMESPACEs sent to the upstream relay (one per prefix)"),
    ("upstream_publishes", "relay_upstream_publishes_total", "counter",
     "PUBLISHes sent to the upstream relay (one per PUBLISHed track)"),
    ("datagrams_dropped", "relay_datagrams_dropped_total", "counter",
     "Object datagrams not forwarded: larger than the session's maximum datagram size"),
    ("fetches", "relay_fetches_total", "counter", "Downstream FETCHes"),
    ("upstream_fetches", "relay_upstream_fetches_total", "counter", "Upstream FETCHes sent"),
    ("fetches_in_flight", "relay_fetches_in_flight", "gauge", "Upstream FETCHes in flight"),
    ("upstream_timeouts", "relay_upstream_timeouts_total", "counter",
     "Upstream requests cancelled after request_timeout without an answer"),
    ("upstream_connects", "relay_upstream_connects_total", "counter",
     "Sessions opened to the upstream relay"),
    ("upstream_losses", "relay_upstream_losses_total", "counter",
     "Upstream sessions lost while in use (a reconnect with backoff follows)"),
    ("upstream_dead", "relay_upstream_dead_total", "counter",
     "Upstream sessions closed for an unacknowledged liveness PING"),
    ("upstream_migrations", "relay_upstream_migrations_total", "counter",
     "Moves to a new upstream session after its GOAWAY"),
    ("upstream_switchovers", "relay_upstream_switchovers_total", "counter",
     "Upstream subscriptions moved to the new session after a GOAWAY"),
    ("excessive_load", "relay_excessive_load_total", "counter",
     "Requests refused EXCESSIVE_LOAD (per-session request cap, cache budget)"),
    ("reserved_refusals", "relay_reserved_refusals_total", "counter",
     "Requests for a reserved namespace answered DOES_NOT_EXIST"),
    ("digest_checks", "relay_digest_checks_total", "counter",
     "Objects checked against their track's layer digest before caching"),
    ("digest_mismatches", "relay_digest_mismatches_total", "counter",
     "Objects that did not match their layer digest (not cached)"),
    ("transcodes", "relay_transcodes_total", "counter",
     "Tracks transcoded at the edge (relay/transcode/edge.py), once per replica and codec"),
    ("transcoded_bytes", "relay_transcoded_bytes_total", "counter",
     "Octets of the coded objects the edge transcoder cached"),
    ("transcoded_objects", "relay_transcoded_objects_total", "counter",
     "Objects coded as they arrived for SUBSCRIBErs of a coded track (relay/transcode/live.py)"),
    ("cache_tracks", "relay_cache_tracks", "gauge", "Track entries held by the object cache"),
    ("cache_reserved", "relay_cache_reserved_bytes", "gauge",
     "Cache bytes reserved for objects still arriving"),
    ("too_far_behind", "relay_too_far_behind_total", "counter",
     "Subscriptions ended TOO_FAR_BEHIND"),
    ("requests", "relay_requests_total", "counter", "Requests received from peers"),
    ("auth_refusals", "relay_auth_refusals_total", "counter",
     "Requests refused with UNAUTHORIZED (and sessions closed for a bad SETUP token)"),
)


def render_metrics(snap: Mapping[str, int]) -> str:
    """The text exposition of a :meth:`RelayStats.snapshot`."""
    lines: list[str] = []
    for key, name, kind, help_ in _METRICS:
        if key not in snap:
            continue
        lines += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}", f"{name} {int(snap[key])}"]
    hits, misses = snap.get("cache_hits", 0), snap.get("cache_misses", 0)
    ratio = hits / (hits + misses) if hits + misses else 0.0
    lines += ["# HELP relay_cache_hit_ratio FETCH cache hits / (hits + misses) since start",
              "# TYPE relay_cache_hit_ratio gauge", f"relay_cache_hit_ratio {ratio:.6g}"]
    return "\n".join(lines) + "\n"


def _response(status: str, body: bytes, content_type: str = "text/plain; charset=utf-8") -> bytes:
    head = (f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n")
    return head.encode("ascii") + body


class MetricsServer:
    """``await MetricsServer(snapshot).start(host, port)``; ``close()``."""

    def __init__(self, snapshot: Callable[[], Mapping[str, int]]) -> None:
        self.snapshot = snapshot
        self.server: asyncio.base_events.Server | None = None

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> MetricsServer:
        self.server = await asyncio.start_server(self._handle, host, port, limit=MAX_HEAD)
        return self

    @property
    def port(self) -> int:
        assert self.server is not None
        return self.server.sockets[0].getsockname()[1]

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            try:
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), READ_TIMEOUT)
            except (asyncio.LimitOverrunError, asyncio.IncompleteReadError,
                    asyncio.TimeoutError, ValueError):
                writer.write(_response("400 Bad Request", b"bad request\n"))
                return
            parts = head.split(b"\r\n", 1)[0].split(b" ")
            if len(parts) == 3 and parts[0] == b"GET" and parts[1] == b"/metrics":
                body = render_metrics(self.snapshot()).encode("utf-8")
                writer.write(_response("200 OK", body, CONTENT_TYPE))
            else:
                writer.write(_response("404 Not Found", b"not found\n"))
        except Exception:  # never let a scrape take the relay down
            logger.exception("relay: metrics request failed")
        finally:
            try:
                await writer.drain()
            except ConnectionError:
                pass
            writer.close()

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()
            self.server = None
