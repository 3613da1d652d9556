"""Relay counters: one plain object, read with :meth:`RelayStats.snapshot`; served in the
Prometheus text format by :mod:`relay.ops.metrics` (``--metrics HOST:PORT``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ["RelayStats"]


@dataclass
class RelayStats:
    """Counters updated by the relay as it works. Gauges (current subscribers, tracks,
    cache bytes/objects, sessions) are read from the live relay through ``gauges``."""

    #: Downstream SUBSCRIBEs accepted / refused, and subscriptions ended TOO_FAR_BEHIND.
    subscribes: int = 0
    subscribe_errors: int = 0
    too_far_behind: int = 0
    #: Upstream subscriptions opened (one per full track name, however many subscribers).
    upstream_subscribes: int = 0
    #: Chaining (--upstream): PUBLISH_NAMESPACEs we sent upstream (one per namespace that
    #: local publishers announced) and upstream SUBSCRIBE_NAMESPACEs (one per prefix).
    upstream_announces: int = 0
    upstream_namespace_subscribes: int = 0
    #: Chaining: PUBLISHes we sent upstream (one per track PUBLISHed here by a publisher).
    upstream_publishes: int = 0
    #: Object datagrams not forwarded to a subscriber: larger than its session's maximum
    #: datagram payload (draft-22 §"Datagrams": dropped without notification).
    datagrams_dropped: int = 0
    #: Downstream FETCHes, those served from the cache, those that needed upstream, and
    #: the upstream FETCHes actually sent (single-flight: misses >= upstream_fetches).
    fetches: int = 0
    cache_hits: int = 0
    cache_misses: int = 0
    upstream_fetches: int = 0
    #: Upstream requests that got no answer (or, a FETCH, no progress) within
    #: ``request_timeout``: cancelled, their waiters answered REQUEST_ERROR TIMEOUT.
    upstream_timeouts: int = 0
    #: The upstream link (relay/subscribe/uplink.py): sessions opened to the upstream relay, sessions
    #: lost (ended while current), closed for an unacknowledged liveness PING, moves to a new
    #: session after a GOAWAY, and subscriptions moved with them (relay/subscribe/switchover.py).
    upstream_connects: int = 0
    upstream_losses: int = 0
    upstream_dead: int = 0
    upstream_migrations: int = 0
    upstream_switchovers: int = 0
    #: Requests refused EXCESSIVE_LOAD: over ``max_requests_per_session`` open requests of
    #: one session, or an upstream FETCH whose objects do not fit the cache budget.
    excessive_load: int = 0
    #: Requests for a reserved namespace (first field "." or ".session") answered
    #: DOES_NOT_EXIST, never forwarded (draft-22 §"Reserved Namespaces").
    reserved_refusals: int = 0
    #: Objects whose payload was hashed against the layer digest their track declares
    #: (LAYER_DIGESTS, relay/fetch/digests.py), and those that did not match it (not cached).
    digest_checks: int = 0
    digest_mismatches: int = 0
    #: Tracks made by the edge transcoder (relay/transcode/edge.py: once per replica and codec),
    #: and the octets of the coded objects it cached.
    transcodes: int = 0
    transcoded_bytes: int = 0
    #: Objects coded for SUBSCRIBErs of a coded track as they arrived (relay/transcode/live.py).
    transcoded_objects: int = 0
    #: Object payload bytes received from upstream / sent downstream (headers excluded).
    bytes_in: int = 0
    bytes_out: int = 0
    objects_in: int = 0
    objects_out: int = 0
    #: Sessions established (SETUP accepted), requests received, and refusals for
    #: authorization (REQUEST_ERROR UNAUTHORIZED, or a session closed for its SETUP token).
    sessions_opened: int = 0
    requests: int = 0
    auth_refusals: int = 0
    gauges: Callable[[], dict[str, int]] | None = field(default=None, repr=False)

    def snapshot(self) -> dict[str, int]:
        out = {k: v for k, v in self.__dict__.items() if isinstance(v, int)}
        if self.gauges is not None:
            out.update(self.gauges())
        return out
