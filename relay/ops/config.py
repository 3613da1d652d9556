"""Relay configuration (one plain dataclass; ``python -m relay`` builds it from argv)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvsp_moq.pubsub.liveness import Reconnect
from kvsp_moq.transport import TransportConfig

from .auth import AuthConfig
from ..transcode.transcoder import Transcoder

__all__ = ["RelayConfig"]

MiB = 1 << 20


@dataclass
class RelayConfig:
    """What a :class:`relay.Relay` needs.

    ``server_transport`` must carry the certificate and key (``python -m relay`` makes a
    self-signed pair when none is given). ``upstream`` is the ``moqt://`` URL of another
    relay that SUBSCRIBE / FETCH / TRACK_STATUS go to when no announced namespace matches;
    local PUBLISH_NAMESPACEs and SUBSCRIBE_NAMESPACE interest are forwarded to it too
    (:mod:`relay.subscribe.namespaces`).
    """

    host: str = "127.0.0.1"
    port: int = 0
    server_transport: TransportConfig = field(default_factory=TransportConfig)
    upstream: str | None = None
    upstream_transport: TransportConfig = field(default_factory=TransportConfig)
    #: Byte budget of the object cache (payload + properties + a fixed per-object overhead).
    cache_bytes: int = 256 * MiB
    #: Bytes a downstream subscriber may have queued in the relay, beyond what the QUIC
    #: layer buffers for its streams (``send_buffer_high_water`` per stream). Exceeding it
    #: ends that subscription with PUBLISH_DONE TOO_FAR_BEHIND (see docs/relay.md).
    subscriber_queue_bytes: int = 8 * MiB
    #: Seconds ``shutdown`` waits for sessions to leave after GOAWAY: sent as the GOAWAY's
    #: Timeout (ms); a session still there with open requests is then closed with
    #: GOAWAY_TIMEOUT (draft-22 §"GOAWAY").
    drain_timeout: float = 10.0
    #: New Session URI sent in GOAWAY on shutdown ("" = none: reconnect to the same URI).
    goaway_uri: str = ""
    #: Seconds to wait for an upstream SETUP, for the answer to every request the relay
    #: sends upstream (SUBSCRIBE, FETCH, TRACK_STATUS, PUBLISH_NAMESPACE,
    #: SUBSCRIBE_NAMESPACE, PUBLISH) and, for a FETCH, between two of its objects; on expiry
    #: the upstream request is cancelled and the downstream ones get REQUEST_ERROR TIMEOUT
    #: (relay/session/deadline.py). Must be > 0.
    request_timeout: float = 30.0
    #: Open requests one downstream session may have; each one beyond gets REQUEST_ERROR
    #: EXCESSIVE_LOAD (relay/session/limits.py). A chained downstream relay carries all of its
    #: clients' requests on one session: size it for that.
    max_requests_per_session: int = 4096
    #: NAMESPACE messages the answer to a SUBSCRIBE_NAMESPACE writes at once; the next page
    #: waits until QUIC has sent what the previous ones wrote (backpressure).
    namespace_page_size: int = 256
    #: Authorization (``--config FILE``, :mod:`relay.ops.auth`); None: the relay is OPEN (every
    #: request allowed, a warning is logged at start).
    auth: AuthConfig | None = None
    #: ``(host, port)`` of the Prometheus endpoint (``--metrics``; None: off).
    metrics: tuple[str, int] | None = None
    #: Send SUBSCRIBE_NAMESPACE to every downstream session allowed to publish, right after
    #: SETUP, and route its NAMESPACE answers like PUBLISH_NAMESPACE (:mod:`relay.subscribe.solicit`;
    #: ``--[no-]solicit-namespaces``): the moq-relay "ingest model" that publishers such as
    #: caprid-relay's rely on (they never send PUBLISH_NAMESPACE).
    solicit_namespaces: bool = True
    #: The prefix solicited (``--solicit-prefix``; default: the empty prefix, everything).
    solicit_prefix: tuple[bytes, ...] = ()
    #: The upstream link (:mod:`relay.subscribe.uplink`): a PING every ``upstream_keepalive`` seconds
    #: (``--upstream-keepalive``; 0: none); one not acknowledged within
    #: ``upstream_liveness_timeout`` (``--upstream-liveness-timeout``) closes the session as
    #: lost (a killed / restarted upstream).
    upstream_keepalive: float = 5.0
    upstream_liveness_timeout: float = 5.0
    #: After the upstream session is lost, reconnect after ``upstream_reconnect_initial``
    #: seconds, doubling per failed attempt up to ``upstream_reconnect_max``
    #: (``--upstream-reconnect-initial`` / ``--upstream-reconnect-max``), while local
    #: announcements, namespace interest or PUBLISHes want the upstream.
    upstream_reconnect_initial: float = 0.1
    upstream_reconnect_max: float = 5.0
    #: Makes tracks of a namespace from others of it (relay/transcode/edge.py: another codec of a
    #: replica, made once and cached); None: every FETCH goes upstream as it is. The KVSP one
    #: is ``kvsp_moq.bridge.transcoding`` (``--transcoder``), passed in: the relay never
    #: imports it.
    transcoder: Transcoder | None = None

    @property
    def upstream_reconnect(self) -> Reconnect:
        """The upstream link's liveness probe and backoff (``kvsp_moq.pubsub.liveness``)."""
        return Reconnect(keepalive=self.upstream_keepalive,
                         liveness_timeout=self.upstream_liveness_timeout,
                         backoff_initial=self.upstream_reconnect_initial,
                         backoff_max=self.upstream_reconnect_max)

    @property
    def auth_token_cache_size(self) -> int:
        """MAX_AUTH_TOKEN_CACHE_SIZE advertised to downstream peers."""
        return self.auth.auth_token_cache_size if self.auth is not None else 4096

    def __post_init__(self) -> None:
        if self.cache_bytes < 0:
            raise ValueError("cache_bytes must be >= 0")
        if self.subscriber_queue_bytes <= 0:
            raise ValueError("subscriber_queue_bytes must be > 0")
        if self.drain_timeout < 0:
            raise ValueError("drain_timeout must be >= 0")
        if not self.request_timeout > 0:
            raise ValueError("request_timeout must be > 0")
        if self.max_requests_per_session < 1:
            raise ValueError("max_requests_per_session must be >= 1")
        if self.namespace_page_size < 1:
            raise ValueError("namespace_page_size must be >= 1")
        self.solicit_prefix = tuple(bytes(f) for f in self.solicit_prefix)
        try:
            self.upstream_reconnect.delay(1)  # building it checks the values
        except ValueError as exc:
            raise ValueError(f"upstream_keepalive / upstream_reconnect_*: {exc}") from None
